/* mpi_watchdog.c - the MPI backend's use of the watchdog (watchdog.h): every collective is
 * bracketed by hsdp_mpi_watch_begin / hsdp_watch_end (MPI calls are serialised, so one slot
 * suffices), and the thread started with the world ends the whole job (MPI_Abort) when one
 * outlives HSDP_TIMEOUT, naming what waited and who is missing. Direct gathers need no peer
 * and are not watched. */
#if defined(HSDP_HAVE_MPI)
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "mpi_internal.h"
#include "watchdog.h"

void hsdp_mpi_watch_begin(const char *op, const hsdp_group *g, size_t nbytes) {
    hsdp_watch_begin(op, ((const mpi_group *)g->impl)->world_ranks, g->size, nbytes);
}

static void expire(void) {
    MPI_Abort(MPI_COMM_WORLD, 124); /* the launcher ends every rank */
}

void hsdp_mpi_watch_start_thread(void) {
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    hsdp_watch_start_thread(rank, expire);
}

/* Collective over the world, like the dup of MPI_COMM_WORLD it runs beside. Whether it runs
 * must be the same on every rank, so it is decided by this call's own history, never by
 * hsdp_peers_known() (another backend, or a failed malloc on one rank, may set that on some
 * ranks only); hsdp_peers_learn ignores every call after the first. */
void hsdp_mpi_learn_world_peers(void) {
    static atomic_int done;
    int n = 0, me = 0;
    if (MPI_Comm_size(MPI_COMM_WORLD, &n) != MPI_SUCCESS || n < 2 || atomic_exchange(&done, 1)) return;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    uint64_t mine[HSDP_PEER_WORDS];
    hsdp_peers_mine(mine);
    uint64_t *all = malloc(sizeof mine * (size_t)n); /* freed below (hsdp_peers_learn copies) */
    if (!all) { /* the others are in the all-gather below: leaving would hang them */
        fprintf(stderr, "hsdp: rank %d: out of memory for the %d ranks' watchdog records; ending the job\n", me, n);
        MPI_Abort(MPI_COMM_WORLD, 1);
        _exit(1);
    }
    if (MPI_Allgather(mine, HSDP_PEER_WORDS, MPI_UINT64_T, all, HSDP_PEER_WORDS, MPI_UINT64_T, MPI_COMM_WORLD) ==
        MPI_SUCCESS)
        (void)hsdp_peers_learn(all, n, me); /* without memory: timeouts name no one */
    free(all);
}
#endif
