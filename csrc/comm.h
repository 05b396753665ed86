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

struct hsdp_exec;

struct hsdp_group {
    const hsdp_comm_ops *ops;
    int rank, size;
    void *impl;              /* owned by the backend; released by ops->free */
    struct hsdp_exec *exec;  /* borrowed: the backend's worker thread, or NULL (run inline) */
};

/* comm.c: the collectives as callers use them. With a worker (g->exec), each call is queued
 * on it and waited for; the _start variant returns at once. */
hsdp_status hsdp_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes);
hsdp_status hsdp_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root);
hsdp_status hsdp_barrier(hsdp_group *g);
hsdp_status hsdp_group_split(hsdp_group *g, int color, int key, hsdp_group **out);
/* The backend's all-gather called on this thread while the worker is held idle: the raw
 * collective that benchmarks compare hsdp's path with. */
hsdp_status hsdp_all_gather_direct(hsdp_group *g, const void *send, void *recv, size_t nbytes);
/* Frees the group (NULL is fine). The caller owned it. */
void hsdp_group_free(hsdp_group *g);

/* comm_single.c: a world of one rank, always available. Caller owns *out. */
hsdp_status hsdp_world_single(hsdp_group **out);

/* comm_mpi.c: MPI_COMM_WORLD (duplicated). Initialises MPI only if nobody has; *we_init is
 * set to 1 in that case so that hsdp_mpi_finalize knows it may finalise. Without MPI
 * compiled in: HSDP_EUNSUPPORTED with a message that says what to install. */
int hsdp_mpi_compiled(void);
hsdp_status hsdp_world_mpi(hsdp_group **out, int *we_init);
/* Whether MPI calls run on the worker thread (so gathers overlap with compute). */
int hsdp_mpi_async(void);
/* Finalises MPI if it is initialised and not yet finalised. Call only if we initialised it. */
hsdp_status hsdp_mpi_finalize(void);

#endif
