/* backend_single.c - a world of one rank: every collective is a local copy or nothing. It
 * has no dependencies, so hsdp works (and its tests run) where no MPI or CUDA exists. It has
 * no asynchronous slots: a started gather is a copy done before start returns. */
#include <stdlib.h>
#include <string.h>

#include "backend.h"

static int single_usable(const char **why) {
    *why = NULL;
    return 1;
}

static hsdp_status single_world(hsdp_group **out, int *we_init);

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

static hsdp_status single_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    (void)g;
    if (nbytes) memcpy(recv, send, nbytes);
    return HSDP_OK;
}

static hsdp_status single_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    (void)g, (void)color, (void)key;
    int unused;
    return single_world(out, &unused);
}

static void single_free(hsdp_group *g) { free(g); }

const hsdp_backend hsdp_backend_single = {
    .name = "single",
    .usable = single_usable,
    .world = single_world,
    .all_gather = single_all_gather,
    .broadcast = single_broadcast,
    .barrier = single_barrier,
    .all_to_all = single_all_to_all,
    .split = single_split,
    .free = single_free,
};

static hsdp_status single_world(hsdp_group **out, int *we_init) {
    *we_init = 0;
    hsdp_group *g = malloc(sizeof *g); /* owned by the caller; hsdp_group_free */
    if (!g) return hsdp_fail(HSDP_ENOMEM, "could not allocate a process group");
    *g = (hsdp_group){.backend = &hsdp_backend_single, .rank = 0, .size = 1, .impl = NULL};
    *out = g;
    return HSDP_OK;
}
