/* comm.c - the collectives as the rest of the core calls them. A backend with a worker
 * thread (MPI) gets every call queued on it, so MPI sees one calling thread and a gather can
 * run while Python computes; a backend without one (the world of one) runs inline. */
#include <stdlib.h>

#include "comm.h"
#include "exec.h"

typedef struct {
    hsdp_group *g;
    const void *send;
    void *recv;
    size_t nbytes;
    int root, color, key;
    hsdp_group **out;
} call_args;

static hsdp_status do_all_gather(void *p) {
    call_args *a = p;
    return a->g->ops->all_gather(a->g, a->send, a->recv, a->nbytes);
}
static hsdp_status do_broadcast(void *p) {
    call_args *a = p;
    return a->g->ops->broadcast(a->g, a->recv, a->nbytes, a->root);
}
static hsdp_status do_barrier(void *p) {
    call_args *a = p;
    return a->g->ops->barrier(a->g);
}
static hsdp_status do_split(void *p) {
    call_args *a = p;
    return a->g->ops->split(a->g, a->color, a->key, a->out);
}
static hsdp_status do_free(void *p) {
    hsdp_group *g = p;
    g->ops->free(g);
    return HSDP_OK;
}

hsdp_status hsdp_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    call_args a = {.g = g, .send = send, .recv = recv, .nbytes = nbytes};
    return hsdp_exec_run(g->exec, do_all_gather, &a);
}

hsdp_status hsdp_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    call_args a = {.g = g, .recv = buf, .nbytes = nbytes, .root = root};
    return hsdp_exec_run(g->exec, do_broadcast, &a);
}

hsdp_status hsdp_barrier(hsdp_group *g) {
    call_args a = {.g = g};
    return hsdp_exec_run(g->exec, do_barrier, &a);
}

hsdp_status hsdp_group_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    call_args a = {.g = g, .color = color, .key = key, .out = out};
    return hsdp_exec_run(g->exec, do_split, &a);
}

hsdp_status hsdp_all_gather_direct(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    hsdp_exec_quiesce(g->exec);
    hsdp_status st = g->ops->all_gather(g, send, recv, nbytes);
    hsdp_exec_resume(g->exec);
    return st;
}

void hsdp_group_free(hsdp_group *g) {
    if (g) (void)hsdp_exec_run(g->exec, do_free, g);
}
