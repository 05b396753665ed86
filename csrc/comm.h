/* comm.h - the collective backend table. Each backend is an existing engine (MPI, NCCL) or
 * the dependency-free world of one; hsdp never does its own networking. A group is a set of
 * world ranks with a backend-specific handle; every collective takes one. */
#ifndef HSDP_COMM_H
#define HSDP_COMM_H

#include "hsdp.h"

typedef struct {
    const char *name;
    /* Every rank sends `nbytes` from send; recv (size * nbytes) receives rank i's block at
     * i * nbytes. send may equal recv + rank * nbytes (in place). */
    hsdp_status (*all_gather)(hsdp_group *g, const void *send, void *recv, size_t nbytes);
    hsdp_status (*broadcast)(hsdp_group *g, void *buf, size_t nbytes, int root);
    hsdp_status (*barrier)(hsdp_group *g);
    /* Collective over g: ranks with the same color form a new group, ordered by key. */
    hsdp_status (*split)(hsdp_group *g, int color, int key, hsdp_group **out);
    void (*free)(hsdp_group *g);
} hsdp_comm_ops;

struct hsdp_group {
    const hsdp_comm_ops *ops;
    int rank, size;
    void *impl; /* owned by the backend; released by ops->free */
};

static inline hsdp_status hsdp_all_gather(hsdp_group *g, const void *send, void *recv,
                                          size_t nbytes) {
    return g->ops->all_gather(g, send, recv, nbytes);
}
static inline hsdp_status hsdp_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    return g->ops->broadcast(g, buf, nbytes, root);
}
static inline hsdp_status hsdp_barrier(hsdp_group *g) { return g->ops->barrier(g); }
static inline hsdp_status hsdp_group_split(hsdp_group *g, int color, int key,
                                           hsdp_group **out) {
    return g->ops->split(g, color, key, out);
}
/* Frees the group (NULL is fine). The caller owned it. */
static inline void hsdp_group_free(hsdp_group *g) {
    if (g) g->ops->free(g);
}

/* comm_single.c: a world of one rank, always available. Caller owns *out. */
hsdp_status hsdp_world_single(hsdp_group **out);

/* comm_mpi.c: MPI_COMM_WORLD (duplicated). Initialises MPI only if nobody has; *we_init is
 * set to 1 in that case so that hsdp_mpi_finalize knows it may finalise. Without MPI
 * compiled in: HSDP_EUNSUPPORTED with a message that says what to install. */
int hsdp_mpi_compiled(void);
hsdp_status hsdp_world_mpi(hsdp_group **out, int *we_init);
/* Finalises MPI if it is initialised and not yet finalised. Call only if we initialised it. */
hsdp_status hsdp_mpi_finalize(void);

#endif
