/* nccl_gather.c - the NCCL backend's gathers of units and its requests (nccl_internal.h):
 * begun into device or host memory, waited for, with their tickets (nccl_agreement.c) and the
 * float8 wire's decode; and ring attention's sendrecv. */
#ifndef HSDP_NO_NCCL
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "agreement.h"
#include "cuda_dequant.h"
#include "nccl_internal.h" /* last: it defines the short names api and S */

/* A gather's own state (a request's, or a synchronous gather's on the stack): the event its
 * reader is ordered after (reader_after), and its tickets. */
typedef struct {
    hsdp_cudaEvent_t ev;
    hsdp_cudaStream_t stream; /* the reader's: the thread's call stream when set, else the compute stream */
    int slot;       /* a unit gather's tickets (agreement), or -1 */
    char what[160]; /* what it gathers, for the tickets' wait */
} nccl_task;
_Static_assert(sizeof(nccl_task) <= HSDP_REQ_STATE_BYTES, "nccl_task must fit in hsdp_req.state");

/* ---- the float8 wire (issue 22): decoded on the side stream (cuda_dequant.c) ----
 * A unit's gathered encodings are dequantized by a kernel enqueued right after the gather,
 * on the same stream, and tracked as a collective writing the unsharded buffer: the event the
 * compute stream (or a DLPack consumer) waits on is the kernel's. S.issue held. */
static hsdp_status wire_check(const hsdp_gather_req *wr, const char *label) { /* before anything is enqueued */
    if (!nccl_on_device(wr->full))
        return hsdp_fail(HSDP_EUNSUPPORTED, "unit '%s': the float8 wire gathers into device memory here, so its "
                         "unsharded buffer must be device memory too", label ? label : "");
    if (!hsdp_wire_cuda_loaded())
        return hsdp_fail(HSDP_EUNSUPPORTED, "unit '%s': the float8 wire on NCCL dequantizes with a kernel that NVRTC "
                         "compiles and the CUDA driver launches, and neither is loaded (hsdp_wire_cuda_load)",
                         label ? label : "");
    return hsdp_wire_cuda_prepare(); /* the module in this context: a driver refusing the PTX says so now */
}
static hsdp_status wire_decode(const hsdp_gather_req *wr, const char *label, hsdp_cudaEvent_t *ev) {
    hsdp_status st = hsdp_wire_cuda_decode(wr->u, wr->wire, wr->full, S.comm);
    char what[160];
    snprintf(what, sizeof what, "the float8 dequantization of unit '%s' (%zu bytes)", label ? label : "",
             wr->u->layout.total_bytes);
    return st == HSDP_OK ? nccl_track(what, wr->full, wr->u->layout.total_bytes, ev) : st;
}
/* ---- end of the float8 wire ---- */

/* Issues a gather into device memory (S.issue taken here): with share, a unit's fixed chunk
 * from its device copy (made by the first gather), else send as given; the tickets in the
 * same NCCL group when mode is HSDP_AGREE_ON; with wr, the float8 wire's decode after it.
 * t gets the event its reader waits on and the tickets' slot, for task_wait. On failure
 * nothing is left to wait for: the slot is given back. */
static hsdp_status issue_device(nccl_task *t, hsdp_group *g, void **share, const void *send, void *recv,
                                size_t nbytes, const char *label, uint64_t ident, int mode,
                                const hsdp_gather_req *wr) {
    nccl_describe(t->what, sizeof t->what, "gather", label, nbytes, g->size);
    pthread_mutex_lock(&S.issue);
    S.issuing = g->impl;
    const void *src = send;
    hsdp_status st = nccl_begin();
    if (st == HSDP_OK && share) st = nccl_fixed_source(share, send, nbytes, &src);
    if (st == HSDP_OK && src != (const char *)recv + (size_t)g->rank * nbytes)
        st = nccl_in_place(src, recv, nbytes, g->rank, &src);
    if (st == HSDP_OK && mode == HSDP_AGREE_ON) st = nccl_ticket_begin(g, label, ident, nbytes, &t->slot);
    int enqueued = 0;
    if (st == HSDP_OK) enqueued = (st = nccl_enqueue_unit(g, t->slot, src, recv, nbytes)) == HSDP_OK;
    if (st == HSDP_OK) st = nccl_track(t->what, recv, nbytes * (size_t)g->size, &t->ev);
    if (st == HSDP_OK && wr) st = wire_decode(wr, label, &t->ev); /* the float8 wire */
    nccl_issue_unlock();
    if (st != HSDP_OK && enqueued && t->slot >= 0) {
        /* the tickets' copy-back is queued: the slot is taken again only once it has landed,
         * or it would overwrite the next gather's ticket (the error stays this one's) */
        char why[sizeof S.why];
        snprintf(why, sizeof why, "%s", hsdp_last_error());
        (void)nccl_ticket_landed(t->slot, t->what);
        st = hsdp_fail(st, "%s", why);
    }
    if (st != HSDP_OK) (void)nccl_ticket_check(g, t->slot, st, t->what, 0); /* no wait follows: the slot goes back now */
    if (st != HSDP_OK) t->slot = -1;
    return st;
}

/* Ends what a gather began: its reader ordered after it (the device's reader_after: the
 * compute stream waits, the host does not; over a host view the host waits), then its
 * tickets: now, waited for on the host (now: a synchronous gather), or queued, compared once
 * landed ([Note: tickets checked late]). */
static hsdp_status task_wait(hsdp_group *g, nccl_task *t, int now) {
    hsdp_status st = atomic_load(&S.failed) ? nccl_failed_status() : HSDP_OK;
    if (st == HSDP_OK && t->ev) st = nccl_refuse_capture(t->stream, t->what);
    if (st == HSDP_OK && t->ev) st = nccl_device_now()->reader_after(t->ev, t->stream, t->what);
    if (t->slot < 0) return st;
    if (st != HSDP_OK || now) {
        hsdp_status before = st == HSDP_OK ? nccl_tickets_settle(1, 0) : st; /* in order: the queue first */
        st = nccl_ticket_check(g, t->slot, before, t->what, 0);
    } else {
        /* the earlier gathers' tickets that have landed, without waiting; this one's is compared
         * by a later call, so a wait returns the same on every rank however fast its copy is */
        st = nccl_tickets_settle(0, 0);
        if (st == HSDP_OK)
            nccl_tickets_due(g, t->slot, t->what);
        else
            (void)nccl_ticket_check(g, t->slot, st, t->what, 0);
    }
    t->slot = -1;
    return st;
}

/* Begins a gather into recv: of a unit's fixed chunk (share; check: whether it checks that
 * every rank gathers the same unit, told ident) or, share NULL, of send as given. dev says
 * whether recv is device memory (nccl_on_device, asked once by the caller). Into device memory
 * it is issued into t, for task_wait; into host memory it is staged and done before this
 * returns, and t holds nothing to wait for. Agreement travels with a device gather's data
 * (HSDP_AGREE_ON); into host memory, or under HSDP_AGREE_SEPARATE, it is its own staged
 * all-gather first (hsdp_agree). */
static hsdp_status gather_begin(nccl_task *t, hsdp_group *g, void **share, const void *send, void *recv,
                                size_t nbytes, const char *label, uint64_t ident, int check, int dev,
                                const hsdp_gather_req *wr) {
    t->ev = NULL;
    t->stream = nccl_consumer_stream();
    t->slot = -1;
    t->what[0] = '\0';
    int mode = share && check && g->size > 1 ? hsdp_agreement_check() : HSDP_AGREE_OFF;
    if (mode == HSDP_AGREE_SEPARATE || (mode != HSDP_AGREE_OFF && !dev)) {
        hsdp_status st = hsdp_agree(g, label, ident, nbytes, nccl_all_gather);
        if (st != HSDP_OK) return st;
        mode = HSDP_AGREE_OFF;
    }
    if (dev) return issue_device(t, g, share, send, recv, nbytes, label, ident, mode, wr);
    /* a host buffer: staged each time; a unit's chunk is fixed from now on like any other,
     * and once on the device it is gathered from its device copy (its host chunk may be gone) */
    if (share && *share && *share != hsdp_share_collective()) send = ((nccl_share *)*share)->dev;
    hsdp_status st = nccl_all_gather(g, send, recv, nbytes);
    if (st == HSDP_OK && share && !*share) *share = hsdp_share_collective();
    return st;
}

/* A synchronous gather of a fixed chunk: begun, then waited for (a unit's returns once its
 * tickets are checked). */
static hsdp_status gather_fixed_as(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                   const char *label, uint64_t ident, int check) {
    nccl_device_guard();
    int dev = nccl_on_device(recv);
    nccl_task t;
    hsdp_status st = gather_begin(&t, g, share, send, recv, nbytes, label, ident, check, dev, NULL);
    return st == HSDP_OK && dev ? task_wait(g, &t, 1) : st;
}

hsdp_status nccl_gather_fixed(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                     const char *label) {
    return gather_fixed_as(g, share, send, recv, nbytes, label, 0, 0);
}

hsdp_status nccl_gather_unit(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                    const char *label, uint64_t ident) {
    return gather_fixed_as(g, share, send, recv, nbytes, label, ident, 1);
}
hsdp_status nccl_gather_start(hsdp_req *r, const void *send, void *recv, size_t nbytes) {
    nccl_device_guard();
    nccl_task *t = (nccl_task *)r->state;
    t->ev = NULL;
    t->slot = -1;
    r->start_ns = hsdp_now_ns();
    const hsdp_gather_req *wr = hsdp_unit_landing_request(r); /* float8 wire: decoded here, see wire_decode */
    if (r->then && (!wr || wr->widened)) /* a conversion is host work: a device unit computes in its storage dtypes */
        return hsdp_fail(HSDP_EUNSUPPORTED, "a GPU gather cannot convert dtypes on the host; compute in the storage dtype");
    int dev = nccl_on_device(recv); /* asked once for the whole gather */
    hsdp_status st = wr && dev ? wire_check(wr, r->label) : HSDP_OK;
    if (st == HSDP_OK)
        st = gather_begin(t, r->g, r->share, send, recv, nbytes, r->label, r->ident, 1, dev, dev ? wr : NULL);
    if (!dev) { /* a host gather: staged and complete before returning */
        if (st == HSDP_OK && wr) st = r->then(r->then_arg); /* the float8 wire's decode, on the host */
        r->end_ns = hsdp_now_ns();
    }
    return st;
}

void nccl_gather_wait(hsdp_req *r) {
    nccl_device_guard();
    hsdp_status st = task_wait(r->g, (nccl_task *)r->state, 0);
    r->end_ns = hsdp_now_ns();
    r->status = st;
    if (st != HSDP_OK) snprintf(r->err, sizeof r->err, "%s", hsdp_last_error());
}

/* Ring attention's point to point on device buffers (UNTESTED ON A GPU; the fake library's
 * world of one runs it): ncclSend to dest and ncclRecv from source inside one NCCL group, on
 * the side stream after the compute stream's work so far (which wrote the send buffer);
 * gather_wait makes the compute stream wait for it, the host never does. NCCL does not check
 * that the sizes of a pair match: every rank of the ring must pass the same shapes. Host
 * buffers are refused: ring attention on the GPU keeps its blocks on the device. */
hsdp_status nccl_sendrecv_start(hsdp_req *r, const void *send, size_t sbytes, int dest, void *recv,
                                       size_t rbytes, int source) {
    nccl_device_guard();
    nccl_task *t = (nccl_task *)r->state;
    t->ev = NULL;
    t->slot = -1;
    r->start_ns = hsdp_now_ns();
    if ((sbytes && !nccl_on_device(send)) || (rbytes && !nccl_on_device(recv)))
        return hsdp_fail(HSDP_EUNSUPPORTED, "the NCCL backend's sendrecv takes device buffers only");
    nccl_comm *c = r->g->impl;
    char what[160];
    snprintf(what, sizeof what, "a sendrecv of %zu bytes to rank %d and %zu from rank %d over %d ranks", sbytes, dest,
             rbytes, source, r->g->size);
    memcpy(t->what, what, sizeof t->what); /* for its wait */
    hsdp_cudaStream_t order = nccl_consumer_stream(); /* the consumer's stream */
    t->stream = order; /* its wait orders the same stream */
    hsdp_status st = nccl_refuse_capture(order, what);
    if (st != HSDP_OK) return st;
    pthread_mutex_lock(&S.issue);
    S.issuing = c;
    st = nccl_begin();
    if (st == HSDP_OK) {
        /* the send buffer was written on the consumer's stream: read it after */
        hsdp_cudaError_t e = CUDA(cudaEventRecord, S.ready, order);
        if (e == hsdp_cudaSuccess) e = CUDA(cudaStreamWaitEvent, S.comm, S.ready, 0);
        if (e != hsdp_cudaSuccess) st = nccl_cuda_fail(e, "ordering a sendrecv after the compute stream");
    }
    if (st == HSDP_OK) {
        hsdp_ncclResult_t rc = api.ncclGroupStart();
        if (rc == hsdp_ncclSuccess && sbytes) rc = api.ncclSend(send, sbytes, hsdp_ncclUint8, dest, c->comm, S.comm);
        if (rc == hsdp_ncclSuccess && rbytes) rc = api.ncclRecv(recv, rbytes, hsdp_ncclUint8, source, c->comm, S.comm);
        hsdp_ncclResult_t end = api.ncclGroupEnd();
        st = nccl_done(c, rc != hsdp_ncclSuccess ? rc : end, "ring attention's grouped ncclSend/ncclRecv");
    }
    if (st == HSDP_OK) st = nccl_track(what, recv, rbytes, &t->ev);
    nccl_issue_unlock();
    return st;
}

hsdp_status nccl_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                                 int source) {
    hsdp_req r = {.g = g};
    hsdp_status st = nccl_sendrecv_start(&r, send, sbytes, dest, recv, rbytes, source);
    if (st != HSDP_OK) return st;
    nccl_gather_wait(&r); /* the compute stream waits for it */
    if (r.status != HSDP_OK) return hsdp_fail(r.status, "%s", r.err);
    return HSDP_OK;
}

int nccl_overlaps(const hsdp_group *g) {
    (void)g;
    return 1;
}
#endif
