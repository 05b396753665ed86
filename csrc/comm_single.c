/* comm_single.c - a world of one rank: every collective is a local copy or nothing. It has
 * no dependencies, so hsdp works (and its tests run) where no MPI or CUDA exists. */
#include <stdlib.h>
#include <string.h>

#include "comm.h"

static hsdp_status single_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    (void)g;
    if (send != recv && nbytes) memmove(recv, send, nbytes);
    return HSDP_OK;
}

static hsdp_status single_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    (void)g, (void)buf, (void)nbytes;
    if (root != 0) return hsdp_fail(HSDP_EINVAL, "broadcast root %d is outside a group of 1", root);
    return HSDP_OK;
}

static hsdp_status single_barrier(hsdp_group *g) {
    (void)g;
    return HSDP_OK;
}

static hsdp_status single_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    (void)g, (void)color, (void)key;
    return hsdp_world_single(out);
}

static void single_free(hsdp_group *g) { free(g); }

static const hsdp_comm_ops single_ops = {
    .name = "single",
    .all_gather = single_all_gather,
    .broadcast = single_broadcast,
    .barrier = single_barrier,
    .split = single_split,
    .free = single_free,
};

hsdp_status hsdp_world_single(hsdp_group **out) {
    hsdp_group *g = malloc(sizeof *g); /* owned by the caller; hsdp_group_free */
    if (!g) return hsdp_fail(HSDP_ENOMEM, "could not allocate a process group");
    *g = (hsdp_group){.ops = &single_ops, .rank = 0, .size = 1, .impl = NULL, .exec = NULL};
    *out = g;
    return HSDP_OK;
}
