/* nccl_world.c - the NCCL backend's communicators (nccl_internal.h): the world joined from
 * its bootstrap (a unique id the caller carries to the ranks, backend_nccl.h), splits, frees,
 * and finalize. */
#ifndef HSDP_NO_NCCL
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "watchdog.h"
#include "nccl_internal.h" /* last: it defines the short names api and S */

/* ---------------------------------------------------------------- communicators */
static hsdp_status comm_wrap(hsdp_ncclComm_t comm, int rank, int size, hsdp_group **out) {
    nccl_comm *c = calloc(1, sizeof *c); /* owned by the group; freed by nccl_free */
    hsdp_group *g = malloc(sizeof *g);   /* owned by the caller; hsdp_group_free */
    if (!c || !g) {
        free(c);
        free(g);
        api.ncclCommAbort(comm);
        return hsdp_fail(HSDP_ENOMEM, "could not allocate an NCCL group");
    }
    c->comm = comm;
    c->size = size;
    pthread_mutex_lock(&S.mu);
    c->next = S.live;
    S.live = c;
    pthread_mutex_unlock(&S.mu);
    *g = (hsdp_group){.backend = &hsdp_backend_nccl, .rank = rank, .size = size, .impl = c};
    *out = g;
    return HSDP_OK;
}

/* Which world rank each rank of g is, so that a timeout can name them (watchdog.h): the
 * world's own, or learned over a split group by an all-gather. Collective over g. */
static hsdp_status learn_world_ranks(hsdp_group *g, int world) {
    nccl_comm *c = g->impl;
    int *ranks = malloc(sizeof *ranks * (size_t)g->size); /* owned by c; freed by nccl_free */
    if (!ranks) return hsdp_fail(HSDP_ENOMEM, "could not allocate the world ranks of a group of %d", g->size);
    hsdp_status st = HSDP_OK;
    if (world)
        for (int i = 0; i < g->size; i++) ranks[i] = i;
    else
        st = nccl_all_gather(g, &S.boot.rank, ranks, sizeof *ranks);
    pthread_mutex_lock(&S.mu);
    if (st == HSDP_OK) c->world_ranks = ranks;
    pthread_mutex_unlock(&S.mu);
    if (st != HSDP_OK) free(ranks);
    return st;
}

/* Every rank's peer record (watchdog.h), all-gathered over the world once: a timeout can then
 * name who did not arrive. Collective over the world (the first world learned wins, as with
 * MPI's: one world per process). */
static hsdp_status learn_peers(hsdp_group *world) {
    if (world->size < 2) return HSDP_OK;
    uint64_t mine[HSDP_PEER_WORDS];
    hsdp_peers_mine(mine);
    uint64_t *all = malloc(sizeof mine * (size_t)world->size); /* freed below (hsdp_peers_learn copies) */
    if (!all) return hsdp_fail(HSDP_ENOMEM, "could not allocate the %d ranks' watchdog records", world->size);
    hsdp_status st = nccl_all_gather(world, mine, all, sizeof mine);
    if (st == HSDP_OK && hsdp_peers_learn(all, world->size, world->rank) != 0)
        st = hsdp_fail(HSDP_ENOMEM, "could not keep the %d ranks' watchdog records", world->size);
    free(all);
    return st;
}

/* Non-blocking communicators, so that joining can be timed out. */
static hsdp_ncclConfig_t comm_config(void) {
    hsdp_ncclConfig_t cfg = HSDP_NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    return cfg;
}

static hsdp_status join_done(hsdp_ncclComm_t comm, hsdp_ncclResult_t rc, const char *what) {
    nccl_comm tmp = {.comm = comm};
    if (rc != hsdp_ncclSuccess && rc != hsdp_ncclInProgress)
        return hsdp_fail(HSDP_ECOMM, "%s failed: NCCL error %d (%s)", what, (int)rc, api.ncclGetErrorString(rc));
    uint64_t t0 = hsdp_now_ns(), limit = hsdp_timeout_ns();
    for (;;) {
        hsdp_ncclResult_t state = hsdp_ncclInProgress;
        hsdp_ncclResult_t qrc = api.ncclCommGetAsyncError(comm, &state);
        if (qrc != hsdp_ncclSuccess) {
            if (comm) api.ncclCommAbort(comm);
            return hsdp_fail(HSDP_ECOMM, "%s failed: ncclCommGetAsyncError on the new communicator said NCCL error "
                             "%d (%s)", what, (int)qrc, api.ncclGetErrorString(qrc));
        }
        if (state == hsdp_ncclSuccess) return HSDP_OK;
        if (atomic_load(&S.failed)) { /* another communicator failed: this one is not live yet */
            api.ncclCommAbort(comm);
            return nccl_failed_status();
        }
        if (state != hsdp_ncclInProgress) {
            hsdp_status st = hsdp_fail(HSDP_ECOMM, "%s failed: NCCL error %d (%s)", what, (int)state,
                                       nccl_text(state, &tmp));
            api.ncclCommAbort(comm);
            return st;
        }
        if (limit && hsdp_now_ns() - t0 > limit) {
            api.ncclCommAbort(comm);
            return hsdp_fail(HSDP_ECOMM, "%s did not finish within %g s (HSDP_TIMEOUT): a rank did not arrive, or "
                             "the ranks were not given the same unique id", what, nccl_timeout_s());
        }
        nccl_nap(t0);
    }
}

hsdp_status hsdp_nccl_unique_id(unsigned char out[HSDP_NCCL_ID_BYTES]) {
    if (!api.loaded) return hsdp_fail(HSDP_ESTATE, "the NCCL library is not loaded yet");
    hsdp_ncclUniqueId id;
    _Static_assert(sizeof id == HSDP_NCCL_ID_BYTES, "ncclUniqueId is 128 bytes");
    hsdp_ncclResult_t rc = api.ncclGetUniqueId(&id);
    if (rc != hsdp_ncclSuccess)
        return hsdp_fail(HSDP_ECOMM, "ncclGetUniqueId failed: NCCL error %d (%s)", (int)rc, api.ncclGetErrorString(rc));
    memcpy(out, &id, sizeof id);
    return HSDP_OK;
}

hsdp_status hsdp_nccl_set_bootstrap(const unsigned char id[HSDP_NCCL_ID_BYTES], int rank, int size, int device) {
    if (size < 1 || rank < 0 || rank >= size)
        return hsdp_fail(HSDP_EINVAL, "rank %d is outside a world of %d", rank, size);
    if (device < 0) return hsdp_fail(HSDP_EINVAL, "the CUDA device must be >= 0, got %d", device);
    memcpy(S.boot.id, id, HSDP_NCCL_ID_BYTES);
    S.boot.rank = rank;
    S.boot.size = size;
    S.boot.device = device;
    S.boot.set = 1;
    return HSDP_OK;
}

int nccl_usable(const char **why) {
    if (!api.loaded) {
        *why = "the NCCL backend is built but its libraries are not loaded: hsdp.distributed.init_process_group"
               "('nccl') loads them after importing torch";
        return 0;
    }
    *why = NULL;
    return 1;
}

hsdp_status nccl_world(hsdp_group **out, int *we_init) {
    *out = NULL;
    *we_init = 0;
    if (!S.boot.set)
        return hsdp_fail(HSDP_ESTATE, "the NCCL world needs its bootstrap first: use hsdp.distributed."
                         "init_process_group('nccl'), which exchanges the unique id over MPI or torch's TCPStore");
    S.boot.set = 0; /* an id joins one world */
    hsdp_status st = nccl_start_process_state(S.boot.device);
    if (st != HSDP_OK) return st;
    hsdp_ncclUniqueId id;
    memcpy(&id, S.boot.id, sizeof id);
    hsdp_ncclComm_t comm = NULL;
    char what[128];
    snprintf(what, sizeof what, "joining the NCCL world of %d ranks as rank %d", S.boot.size, S.boot.rank);
    if (api.ncclCommInitRankConfig) {
        hsdp_ncclConfig_t cfg = comm_config();
        /* two statements: the call writes comm, join_done reads it (one call's arguments
         * would leave the order unspecified, and clang passes the NULL from before) */
        hsdp_ncclResult_t rc = api.ncclCommInitRankConfig(&comm, S.boot.size, id, S.boot.rank, &cfg);
        st = join_done(comm, rc, what);
    } else { /* before 2.14: blocking, so not bounded by the timeout */
        hsdp_ncclResult_t rc = api.ncclCommInitRank(&comm, S.boot.size, id, S.boot.rank);
        st = rc == hsdp_ncclSuccess ? HSDP_OK
                                    : hsdp_fail(HSDP_ECOMM, "%s failed: %s", what, api.ncclGetErrorString(rc));
    }
    if (st != HSDP_OK) return st;
    st = comm_wrap(comm, S.boot.rank, S.boot.size, out);
    if (st == HSDP_OK) *we_init = 1;
    if (st == HSDP_OK) st = learn_world_ranks(*out, 1);
    if (st == HSDP_OK) st = learn_peers(*out);
    if (st != HSDP_OK && *out) { /* the world is not usable: the caller gets none */
        nccl_free(*out);
        *out = NULL;
        *we_init = 0;
    }
    return st;
}

hsdp_status nccl_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    nccl_device_guard();
    *out = NULL;
    if (!api.ncclCommSplit)
        return hsdp_fail(HSDP_EUNSUPPORTED, "subgroups need ncclCommSplit (NCCL 2.18 or later); the loaded NCCL is %d",
                         api.version);
    if (atomic_load(&S.failed)) return nccl_failed_status();
    nccl_comm *c = g->impl;
    hsdp_ncclComm_t comm = NULL;
    hsdp_ncclConfig_t cfg = comm_config();
    char what[96];
    snprintf(what, sizeof what, "ncclCommSplit (color %d, key %d)", color, key);
    /* [Note: a split's handle] Under a non-blocking parent, ncclCommSplit sets *newcomm to NULL,
     * returns, and makes the child on a thread of its own, which stores the child's handle into
     * *newcomm when done (init.cc ncclCommInitChildComm, ncclCommInitRankFunc); the parent says
     * ncclInProgress until then. So the handle goes to a slot on the heap that outlives this
     * frame, the PARENT is polled to its end (under S.calls, as every call on it), and only then
     * is the slot read, and the child polled. A parent that fails or times out is aborted with
     * the rest (nccl_issue_unlock), which joins the split's thread: the slot is freed after that. */
    hsdp_ncclComm_t *slot = calloc(1, sizeof *slot); /* owned here; freed once NCCL can no longer write it */
    if (!slot) return hsdp_fail(HSDP_ENOMEM, "could not allocate the handle of a split NCCL communicator");
    pthread_mutex_lock(&S.issue);
    S.issuing = c;
    pthread_mutex_lock(&S.calls);
    hsdp_status st = nccl_failed_status_if_failed();
    if (st == HSDP_OK) {
        hsdp_ncclResult_t rc = api.ncclCommSplit(c->comm, color, key, slot, &cfg);
        if (rc == hsdp_ncclSuccess) rc = hsdp_ncclInProgress; /* the parent says when it is done */
        st = nccl_done(c, rc, what);
        if (st != HSDP_OK && !atomic_load(&S.failed)) /* the split's thread may still write the slot */
            (void)ABORT_ALL("%s", hsdp_last_error());
    }
    pthread_mutex_unlock(&S.calls);
    nccl_issue_unlock(); /* after a failure: every communicator aborted, the parent's split thread joined */
    comm = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    free(slot);
    if (st == HSDP_OK && !comm && color >= 0)
        st = hsdp_fail(HSDP_ECOMM, "%s finished without a communicator", what);
    if (st == HSDP_OK && comm) st = join_done(comm, hsdp_ncclInProgress, what); /* the child, polled to its end */
    if (st != HSDP_OK || !comm) return st;
    int rank = -1, size = -1;
    if (api.ncclCommUserRank(comm, &rank) != hsdp_ncclSuccess || api.ncclCommCount(comm, &size) != hsdp_ncclSuccess) {
        api.ncclCommAbort(comm);
        return hsdp_fail(HSDP_ECOMM, "could not read the rank and size of a split NCCL communicator");
    }
    st = comm_wrap(comm, rank, size, out);
    if (st == HSDP_OK) st = learn_world_ranks(*out, 0);
    if (st != HSDP_OK && *out) {
        nccl_free(*out);
        *out = NULL;
    }
    return st;
}

/* Frees a communicator without a collective: a group may be dropped on its ranks in any
 * order (Python's garbage collector decides), and ncclCommAbort tears down locally once
 * this rank's collectives on it are done. */
void nccl_free(hsdp_group *g) {
    nccl_device_guard();
    nccl_comm *c = g->impl;
    (void)nccl_tickets_settle(1, 0); /* the queue may name this group */
    if (c) {
        if (!atomic_load(&S.failed) && S.comm) {
            hsdp_cudaEvent_t ev = NULL;
            pthread_mutex_lock(&S.issue);
            if (nccl_track("the last collectives of a group being freed", NULL, 0, &ev) == HSDP_OK)
                (void)nccl_host_wait(ev, "the last collectives of a group being freed");
            nccl_issue_unlock();
        }
        pthread_mutex_lock(&S.mu);
        for (nccl_comm **p = &S.live; *p; p = &(*p)->next)
            if (*p == c) {
                *p = c->next;
                break;
            }
        if (!c->aborted) api.ncclCommAbort(c->comm);
        pthread_mutex_unlock(&S.mu);
        free(c->world_ranks);
        free(c);
    }
    free(g);
}

hsdp_status nccl_finalize(void) {
    nccl_device_guard();
    if (S.watchdog_on) {
        atomic_store(&S.stop, 1);
        pthread_join(S.watchdog, NULL);
        S.watchdog_on = 0;
    }
    (void)nccl_tickets_settle(1, 0); /* the slots go below */
    if (S.comm && !atomic_load(&S.failed)) (void)CUDA(cudaStreamSynchronize, S.comm);
    /* Every communicator still live is torn down now, while CUDA and NCCL are whole: the groups
     * that hold them (a DeviceMesh, a model's context) may be freed only at interpreter exit,
     * when the CUDA runtime may be unloading, and NCCL's proxy threads would outlive the job.
     * The side stream is drained, so each abort (ncclCommAbort, which also needs no peer) has
     * nothing in flight; the groups' own frees later release only memory (nccl_free). */
    pthread_mutex_lock(&S.calls);
    pthread_mutex_lock(&S.mu);
    nccl_abort_comms_locked();
    pthread_mutex_unlock(&S.mu);
    pthread_mutex_unlock(&S.calls);
    if (S.scratch) CUDA(cudaFree, S.scratch);
    S.scratch = NULL;
    nccl_tickets_free();
    if (S.pinned) CUDA(cudaFreeHost, S.pinned);
    S.pinned = NULL;
    for (int i = 0; i < 2; i++) {
        if (S.pin_ev[i]) CUDA(cudaEventDestroy, S.pin_ev[i]);
        S.pin_ev[i] = NULL;
        S.pin_used[i] = 0;
    }
    S.scratch_n = 0;
    for (unsigned i = 0; i < RING; i++)
        if (S.ring[i].ev) {
            CUDA(cudaEventDestroy, S.ring[i].ev);
            S.ring[i].ev = NULL;
        }
    S.head = S.count = 0;
    if (S.released) CUDA(cudaEventDestroy, S.released);
    for (int i = 0; i < S.nreaders; i++) CUDA(cudaEventDestroy, S.readers[i].ev);
    memset(S.readers, 0, sizeof S.readers);
    S.nreaders = 0;
    atomic_store(&S.readers_pending, 0);
    if (S.ready) CUDA(cudaEventDestroy, S.ready);
    S.ready = NULL;
    if (S.comm) CUDA(cudaStreamDestroy, S.comm);
    S.released = NULL;
    S.comm = NULL;
    S.have_released = 0;
    S.world_up = 0;
    return HSDP_OK;
}
#endif
