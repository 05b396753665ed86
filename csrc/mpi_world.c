/* mpi_world.c - the MPI world: starting MPI and its worker, wrapping communicators as groups,
 * and finalising (mpi_internal.h). */
#if defined(HSDP_HAVE_MPI)
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mpi_internal.h"
#include "watchdog.h"
#include "peer_status.h"

/* Open MPI loads its components with dlopen and expects libmpi's symbols to be global; a
 * Python extension is loaded RTLD_LOCAL, so promote the library before MPI_Init. */
static void promote_libmpi(void) {
    Dl_info info;
    if (dladdr((void *)&MPI_Init, &info) && info.dli_fname)
        (void)dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
}

/* ---------------------------------------------------------------- world and finalisation */
int hsdp_mpi_usable(const char **why) {
    *why = NULL;
    return 1;
}

static hsdp_status dup_world(void *out) {
    MPI_Comm c;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c);
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Comm_dup");
    hsdp_mpi_learn_world_peers(); /* collective over the world, like the dup itself */
    return hsdp_mpi_wrap(c, out);
}

hsdp_status hsdp_mpi_world(hsdp_group **out, int *we_init) {
    int initialized = 0;
    *we_init = 0;
    if (hsdp_mpi_done()) return hsdp_fail(HSDP_ESTATE, "MPI has already been finalised in this process");
    MPI_Initialized(&initialized);
    if (!initialized) {
        promote_libmpi();
        int provided = 0;
        /* One thread makes MPI calls at a time (the worker), so SERIALIZED is enough. */
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
        if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Init_thread");
        *we_init = 1;
    }
    if (!hsdp_mpi_worker) {
        int provided = MPI_THREAD_SINGLE;
        MPI_Query_thread(&provided);
        /* Whoever initialised MPI with less than SERIALIZED forbids calls from our thread:
         * then every call runs on the caller's thread and gathers do not overlap. */
        if (provided >= MPI_THREAD_SERIALIZED) {
            hsdp_status st = hsdp_exec_start(&hsdp_mpi_worker);
            if (st != HSDP_OK) return st;
        }
    }
    hsdp_mpi_watch_start_thread();
    return hsdp_exec_run(hsdp_mpi_worker, dup_world, out);
}

/* Every rank of the world meets here before MPI_Finalize, watched like any collective.
 * MPI_Finalize is collective too, but unwatched: once gathers are direct a rank may finish
 * alone (correctly: the weights do not change), and a peer stalled after warm-up would hold
 * it in MPI_Finalize forever, silently. Past HSDP_TIMEOUT the watchdog names that peer and
 * ends the job, as in any collective. On the calling thread: the worker has stopped. */
static hsdp_status finalize_barrier(void) {
    int n = 0;
    if (MPI_Comm_size(MPI_COMM_WORLD, &n) != MPI_SUCCESS || n < 2) return HSDP_OK;
    int *ranks = malloc(sizeof *ranks * (size_t)n); /* freed below, after the watchdog stops */
    if (ranks)
        for (int i = 0; i < n; i++) ranks[i] = i;
    hsdp_watch_next("finalising: every rank ends MPI together");
    hsdp_watch_begin("MPI_Barrier", ranks, n, 0);
    int rc = MPI_Barrier(MPI_COMM_WORLD);
    hsdp_watch_end();
    hsdp_watch_stop_thread(); /* no longer reads ranks */
    free(ranks);
    return rc == MPI_SUCCESS ? HSDP_OK : hsdp_mpi_fail(rc, "MPI_Barrier (finalising)");
}

hsdp_status hsdp_mpi_finalize(void) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized || hsdp_mpi_done()) return HSDP_OK;
    /* MPI_Finalize belongs on the thread that initialised MPI (this one); the worker must be
     * idle for good first. */
    hsdp_exec_stop(hsdp_mpi_worker);
    hsdp_status met = finalize_barrier(); /* peers' status asks are still answered meanwhile */
    hsdp_watch_stop_thread();
    hsdp_status_stop();
    int rc = MPI_Finalize();
    hsdp_mpi_flush_graves(0, 1); /* MPI_Finalize is collective: no peer reads any more */
    if (met != HSDP_OK) return met;
    return rc == MPI_SUCCESS ? HSDP_OK : hsdp_mpi_fail(rc, "MPI_Finalize");
}
#endif
