/* nccl_agreement.c - the NCCL backend's agreement tickets (nccl_internal.h, agreement.h):
 * every unit gather carries its ticket in the same NCCL group as its data, and its wait
 * compares them. */
#ifndef HSDP_NO_NCCL
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

#include "agreement.h"
#include "nccl_internal.h" /* last: it defines the short names api and S */

/* ---------------------------------------------------------------- agreement */
/* Every unit gather carries its ticket (agreement.h) in the same NCCL group as its data: a
 * second ncclAllGather, of 64 bytes per rank, in place in a slot of device memory, filled
 * from pinned host memory before and copied back after, on the side stream.
 * [Note: tickets checked late] A synchronous gather waits on the host for that copy (within
 * the timeout) and compares before it returns: a mismatch fails on every rank and the buffer
 * is not handed out. A started gather's wait does not: it orders the compute stream after the
 * gather and returns, and its tickets join a queue, compared in order once they have landed:
 * at every later wait (those already landed, without waiting), when the slots run out, and
 * in full at hsdp_nccl_agreement_drain, which the end of every sharded forward calls (and a
 * synchronous gather, a group's free and finalize). So the host runs ahead of the GPU by as
 * many units as it likes, and a mismatch found late cannot be taken back: the compute stream
 * may have read the buffer, so it aborts every communicator, and the forward raises at its
 * end on every rank instead of returning numbers. A mismatch of sizes also aborts the
 * communicators: NCCL does not check that the ranks' counts match, and an all-gather of
 * unequal counts may leave a communicator out of step, so no later collective may trust it
 * (or it hangs, and the watchdog ends it). Host units, and HSDP_AGREE_SEPARATE, exchange the
 * tickets in their own staged all-gather first (hsdp_agree). Slots are taken at the start
 * and given back at the wait, so at most TICKET_SLOTS unit gathers are in flight at once. */
enum { TICKET_SLOTS = 64 };
typedef struct {
    int slot;
    hsdp_group *g;  /* a group is freed only after the queue is drained (nccl_free) */
    char what[160]; /* the gather, for the message */
} ticket_due;
static struct {
    pthread_mutex_t mu;             /* the queue below; taken before S.mu, never with it held */
    ticket_due due[TICKET_SLOTS];   /* waited gathers whose tickets are not compared yet, oldest first */
    unsigned due_head, due_count;
    hsdp_ticket *host; /* pinned (cudaHostAlloc): TICKET_SLOTS slots of `ranks` tickets; freed at finalize */
    char *dev;         /* the same on the device (nccl_dev_malloc); freed at finalize */
    int ranks;         /* tickets per slot: the world's size */
    hsdp_cudaEvent_t ev[TICKET_SLOTS]; /* each slot's copy back to the host */
    atomic_int used[TICKET_SLOTS];     /* taken at a gather's start (S.issue), given back once compared */
} T = {.mu = PTHREAD_MUTEX_INITIALIZER};

void nccl_tickets_free(void) {
    for (int i = 0; i < TICKET_SLOTS; i++) {
        if (T.ev[i]) CUDA(cudaEventDestroy, T.ev[i]);
        T.ev[i] = NULL;
        atomic_store(&T.used[i], 0);
    }
    if (T.host) CUDA(cudaFreeHost, T.host);
    if (T.dev) CUDA(cudaFree, T.dev);
    T.host = NULL;
    T.dev = NULL;
    T.ranks = 0;
}

/* S.issue held: the slots, made on first use. */
static hsdp_status tickets_ready(int size) {
    if (!T.host) {
        int ranks = S.boot.size > size ? S.boot.size : size;
        size_t n = (size_t)TICKET_SLOTS * (size_t)ranks * sizeof(hsdp_ticket);
        void *h = NULL, *d = NULL;
        hsdp_cudaError_t e = CUDA(cudaHostAlloc, &h, n, hsdp_cudaHostAllocDefault);
        if (e != hsdp_cudaSuccess) return nccl_cuda_fail(e, "allocating pinned memory for the agreement tickets");
        T.host = h;
        e = nccl_dev_malloc(&d, n);
        T.dev = d;
        for (int i = 0; e == hsdp_cudaSuccess && i < TICKET_SLOTS; i++)
            e = CUDA(cudaEventCreateWithFlags, &T.ev[i], hsdp_cudaEventDisableTiming);
        if (e != hsdp_cudaSuccess) {
            nccl_tickets_free();
            return nccl_cuda_fail(e, "allocating the agreement tickets on the GPU");
        }
        T.ranks = ranks;
    }
    if (size > T.ranks)
        return hsdp_fail(HSDP_EINVAL, "a group of %d ranks is larger than the NCCL world of %d", size, T.ranks);
    return HSDP_OK;
}

/* S.issue held: this rank's ticket for a unit gather on g, in a free slot (*slot), copied to
 * the device on the side stream. */
hsdp_status nccl_ticket_begin(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes, int *slot) {
    *slot = -1;
    hsdp_status st = tickets_ready(g->size);
    if (st != HSDP_OK) return st;
    int i = 0;
    while (i < TICKET_SLOTS && atomic_load(&T.used[i])) i++;
    if (i == TICKET_SLOTS && T.due_count) { /* slots wait in the queue: compare the oldest */
        st = nccl_tickets_settle(1, 1);
        if (st != HSDP_OK) return st;
        for (i = 0; i < TICKET_SLOTS && atomic_load(&T.used[i]);) i++;
    }
    if (i == TICKET_SLOTS)
        return hsdp_fail(HSDP_ESTATE, "more than %d unit gathers are in flight on the NCCL backend: wait some before "
                         "starting more", TICKET_SLOTS);
    hsdp_ticket *mine = T.host + (size_t)i * (size_t)T.ranks + (size_t)g->rank;
    *mine = hsdp_ticket_make(g, label, ident, nbytes);
    char *dev = T.dev + ((size_t)i * (size_t)T.ranks + (size_t)g->rank) * sizeof *mine;
    CUDA_TRY(CUDA(cudaMemcpyAsync, dev, mine, sizeof *mine, hsdp_cudaMemcpyDefault, S.comm), "copying a ticket to the GPU");
    atomic_store(&T.used[i], 1);
    *slot = i;
    return HSDP_OK;
}

/* S.issue held: the data's all-gather (slot < 0: alone), or it and the tickets' in one NCCL
 * group, then the tickets copied back to the host. */
hsdp_status nccl_enqueue_unit(hsdp_group *g, int slot, const void *send, void *recv, size_t nbytes) {
    nccl_comm *c = g->impl;
    if (slot < 0) return nccl_enqueue(c, OP_GATHER, g->size, send, recv, nbytes, 0);
    size_t tb = sizeof(hsdp_ticket);
    char *tk = T.dev + (size_t)slot * (size_t)T.ranks * tb;
    pthread_mutex_lock(&S.calls);
    hsdp_status st = nccl_failed_status_if_failed();
    if (st == HSDP_OK) {
        hsdp_ncclResult_t rc = api.ncclGroupStart();
        if (rc == hsdp_ncclSuccess)
            rc = api.ncclAllGather(tk + (size_t)g->rank * tb, tk, tb, hsdp_ncclUint8, c->comm, S.comm);
        if (rc == hsdp_ncclSuccess) rc = api.ncclAllGather(send, recv, nbytes, hsdp_ncclUint8, c->comm, S.comm);
        hsdp_ncclResult_t end = api.ncclGroupEnd();
        st = nccl_done(c, rc != hsdp_ncclSuccess ? rc : end, "ncclAllGather (a unit and its tickets)");
    }
    pthread_mutex_unlock(&S.calls);
    if (st != HSDP_OK) return st;
    hsdp_ticket *host = T.host + (size_t)slot * (size_t)T.ranks;
    CUDA_TRY(CUDA(cudaMemcpyAsync, host, tk, tb * (size_t)g->size, hsdp_cudaMemcpyDefault, S.comm),
             "copying the tickets back from the GPU");
    CUDA_TRY(CUDA(cudaEventRecord, T.ev[slot], S.comm), "recording the tickets' event");
    return HSDP_OK;
}

/* A slot's tickets landed on the host: the slot may be taken again (issue_device, after a failure). */
hsdp_status nccl_ticket_landed(int slot, const char *what) { return nccl_host_wait(T.ev[slot], what); }

/* Waits on the host (within the timeout) for slot's tickets, compares them, and gives the
 * slot back. A slot of a gather that failed before is given back as is (st). late: the
 * gather's buffer was handed out already, so a mismatch aborts every communicator. */
hsdp_status nccl_ticket_check(hsdp_group *g, int slot, hsdp_status st, const char *what, int late) {
    if (slot < 0) return st;
    if (st == HSDP_OK) st = nccl_host_wait(T.ev[slot], what);
    if (st == HSDP_OK) {
        const hsdp_ticket *all = T.host + (size_t)slot * (size_t)T.ranks;
        st = hsdp_tickets_check_late(g, all, late);
        int sizes_differ = 0;
        for (int j = 1; st != HSDP_OK && j < g->size; j++) sizes_differ |= all[j].nbytes != all[0].nbytes;
        if (st != HSDP_OK && (sizes_differ || late)) {
            char msg[sizeof S.why];
            snprintf(msg, sizeof msg, "%s", hsdp_last_error());
            st = ABORT_ALL("%s", msg);
        }
    }
    atomic_store(&T.used[slot], 0);
    return st;
}

/* Compares the queued tickets in order (T.mu taken here): those landed, or (block) every one,
 * waiting for each; oldest_only: just the oldest (a slot is needed). The first failure stops
 * it; the rest are given back as they are (the communicators are aborted by then). */
hsdp_status nccl_tickets_settle(int block, int oldest_only) {
    hsdp_status st = HSDP_OK;
    pthread_mutex_lock(&T.mu);
    while (T.due_count) {
        ticket_due *d = &T.due[T.due_head];
        if (st == HSDP_OK && !block) {
            hsdp_cudaError_t e = CUDA(cudaEventQuery, T.ev[d->slot]);
            if (e == hsdp_cudaErrorNotReady || nccl_capture_error(e)) break;
        }
        st = nccl_ticket_check(d->g, d->slot, st, d->what, 1);
        T.due_head = (T.due_head + 1) % TICKET_SLOTS;
        T.due_count--;
        if (oldest_only) break;
    }
    pthread_mutex_unlock(&T.mu);
    return st;
}

/* The tickets of a waited gather join the queue (its slot stays taken until compared). */
void nccl_tickets_due(hsdp_group *g, int slot, const char *what) {
    pthread_mutex_lock(&T.mu);
    ticket_due *d = &T.due[(T.due_head + T.due_count) % TICKET_SLOTS];
    d->slot = slot;
    d->g = g;
    snprintf(d->what, sizeof d->what, "%s", what);
    T.due_count++; /* at most one entry per slot: never more than TICKET_SLOTS */
    pthread_mutex_unlock(&T.mu);
}

hsdp_status hsdp_nccl_agreement_drain(void) {
    if (!S.world_up) return HSDP_OK;
    nccl_device_guard();
    hsdp_status st = nccl_tickets_settle(1, 0);
    return st == HSDP_OK ? nccl_failed_status_if_failed() : st;
}
#endif
