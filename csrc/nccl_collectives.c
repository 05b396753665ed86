/* nccl_collectives.c - the NCCL backend's synchronous collectives (nccl_internal.h).
 *
 * Streams. Every collective runs on one side stream of high priority. A started gather
 * records an event there, and its wait makes the compute stream wait on that event: the
 * host never blocks. A gather into a pooled buffer must not overwrite bytes the compute
 * stream may still read: when buffers go back to the pool an event is recorded on the
 * compute stream (buffers_released, nccl_device.c), and every later collective waits on it
 * first (nccl_begin). That one event covers every buffer released so far, since the compute
 * stream runs in order. */
#ifndef HSDP_NO_NCCL
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

#include "nccl_internal.h" /* last: it defines the short names api and S */

/* ---------------------------------------------------------------- the collectives */

static hsdp_status enqueue_calls(nccl_comm *c, op_kind op, int size, const void *send, void *recv, size_t nbytes,
                                 int root);
/* Enqueues one collective on device buffers (S.issue held), under S.calls. */
hsdp_status nccl_enqueue(nccl_comm *c, op_kind op, int size, const void *send, void *recv, size_t nbytes,
                           int root) {
    pthread_mutex_lock(&S.calls);
    hsdp_status st = atomic_load(&S.failed) ? nccl_failed_status() : enqueue_calls(c, op, size, send, recv, nbytes, root);
    pthread_mutex_unlock(&S.calls);
    return st;
}
static hsdp_status enqueue_calls(nccl_comm *c, op_kind op, int size, const void *send, void *recv, size_t nbytes,
                                 int root) {
    hsdp_ncclResult_t rc = hsdp_ncclSuccess;
    switch (op) {
    case OP_GATHER:
        rc = api.ncclAllGather(send, recv, nbytes, hsdp_ncclUint8, c->comm, S.comm);
        return nccl_done(c, rc, "ncclAllGather");
    case OP_BCAST:
        rc = api.ncclBroadcast(recv, recv, nbytes, hsdp_ncclUint8, root, c->comm, S.comm);
        return nccl_done(c, rc, "ncclBroadcast");
    case OP_BARRIER:
        rc = api.ncclAllReduce(recv, recv, 1, hsdp_ncclFloat32, hsdp_ncclSum, c->comm, S.comm);
        return nccl_done(c, rc, "the barrier's ncclAllReduce");
    case OP_ALLTOALL:
        if (api.ncclAlltoAll) {
            rc = api.ncclAlltoAll(send, recv, nbytes, hsdp_ncclUint8, c->comm, S.comm);
            return nccl_done(c, rc, "ncclAlltoAll");
        }
        rc = api.ncclGroupStart();
        for (int p = 0; rc == hsdp_ncclSuccess && p < size; p++) {
            rc = api.ncclSend((const char *)send + (size_t)p * nbytes, nbytes, hsdp_ncclUint8, p, c->comm, S.comm);
            if (rc == hsdp_ncclSuccess)
                rc = api.ncclRecv((char *)recv + (size_t)p * nbytes, nbytes, hsdp_ncclUint8, p, c->comm, S.comm);
        }
        hsdp_ncclResult_t end = api.ncclGroupEnd();
        return nccl_done(c, rc != hsdp_ncclSuccess ? rc : end, "the all-to-all's grouped ncclSend/ncclRecv");
    }
    return hsdp_fail(HSDP_EINVAL, "unknown collective");
}

/* A synchronous collective. On device buffers it returns once enqueued, with the compute
 * stream made to wait for it; on host buffers, through the staging buffer, once done. */
static hsdp_status run_sync(hsdp_group *g, op_kind op, const void *send, void *recv, size_t nbytes, int root,
                            const char *what) {
    nccl_device_guard();
    nccl_comm *c = g->impl;
    size_t n = (size_t)g->size;
    size_t send_n = op == OP_GATHER ? nbytes : op == OP_ALLTOALL ? nbytes * n : 0;
    size_t recv_n = op == OP_GATHER || op == OP_ALLTOALL ? nbytes * n : op == OP_BCAST ? nbytes : sizeof(float);
    int direct = op != OP_BARRIER && nccl_on_device(send) && nccl_on_device(recv);
    hsdp_cudaStream_t order = nccl_consumer_stream(); /* the consumer's stream */
    hsdp_status st = direct ? nccl_refuse_capture(order, what) : HSDP_OK;
    if (st != HSDP_OK) return st;
    pthread_mutex_lock(&S.issue);
    S.issuing = c;
    st = nccl_begin();
    void *base = NULL;
    const void *s = send;
    void *r = recv;
    if (st == HSDP_OK && direct) {
        /* the caller's device buffers were written on the compute stream: read them after */
        hsdp_cudaError_t e = CUDA(cudaEventRecord, S.ready, order);
        if (e == hsdp_cudaSuccess) e = CUDA(cudaStreamWaitEvent, S.comm, S.ready, 0);
        if (e != hsdp_cudaSuccess) st = nccl_cuda_fail(e, "ordering a collective after the compute stream");
    }
    if (st == HSDP_OK && !direct) {
        /* recv first, then (all-to-all) send, each 64-byte aligned */
        size_t off = (recv_n + 63) / 64 * 64;
        st = nccl_scratch(off + send_n + 64, &base);
        if (st == HSDP_OK) {
            r = base;
            if (op == OP_GATHER) s = (char *)base + (size_t)g->rank * nbytes; /* in place */
            if (op == OP_ALLTOALL) s = (char *)base + off;
            hsdp_cudaError_t e = hsdp_cudaSuccess;
            if (op == OP_BCAST && nbytes)
                e = CUDA(cudaMemcpyAsync, r, recv, nbytes, hsdp_cudaMemcpyDefault, S.comm);
            else if (send_n && send)
                e = CUDA(cudaMemcpyAsync, (void *)s, send, send_n, hsdp_cudaMemcpyDefault, S.comm);
            if (e != hsdp_cudaSuccess) st = nccl_cuda_fail(e, "staging host memory on the device");
        }
    }
    if (st == HSDP_OK) st = nccl_enqueue(c, op, g->size, s, r, nbytes, root);
    hsdp_cudaEvent_t ev = NULL;
    if (st == HSDP_OK) st = nccl_track(what, direct ? recv : NULL, recv_n, &ev);
    if (st == HSDP_OK && direct) st = nccl_device_now()->reader_after(ev, order, what);
    /* staged: the collective is waited for (within the timeout) before the copy back, which
     * into pageable memory blocks the host until the side stream reaches it: behind a
     * collective a peer never joins, it would block beyond any timeout */
    if (st == HSDP_OK && !direct) st = nccl_host_wait(ev, what);
    if (st == HSDP_OK && !direct && op != OP_BARRIER && recv_n) {
        hsdp_cudaError_t e = CUDA(cudaMemcpyAsync, recv, r, recv_n, hsdp_cudaMemcpyDefault, S.comm);
        if (e != hsdp_cudaSuccess) st = nccl_cuda_fail(e, "copying a collective's result to host memory");
        if (st == HSDP_OK) st = nccl_track(what, NULL, 0, &ev); /* pinned host memory: the copy is asynchronous */
        if (st == HSDP_OK) st = nccl_host_wait(ev, what);
    }
    nccl_issue_unlock();
    return st;
}

void nccl_describe(char *out, size_t n, const char *op, const char *label, size_t nbytes, int size) {
    if (label && *label)
        snprintf(out, n, "the %s of unit '%s' (%zu bytes per rank over %d ranks)", op, label, nbytes, size);
    else
        snprintf(out, n, "an %s of %zu bytes per rank over %d ranks", op, nbytes, size);
}

hsdp_status nccl_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    char what[160];
    nccl_describe(what, sizeof what, "all-gather", NULL, nbytes, g->size);
    return run_sync(g, OP_GATHER, send, recv, nbytes, 0, what);
}

hsdp_status nccl_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    if (root < 0 || root >= g->size)
        return hsdp_fail(HSDP_EINVAL, "broadcast root %d is outside a group of %d", root, g->size);
    char what[160];
    nccl_describe(what, sizeof what, "broadcast", NULL, nbytes, g->size);
    return run_sync(g, OP_BCAST, buf, buf, nbytes, root, what);
}

hsdp_status nccl_barrier(hsdp_group *g) {
    char what[160];
    snprintf(what, sizeof what, "a barrier over %d ranks", g->size);
    return run_sync(g, OP_BARRIER, NULL, NULL, 0, 0, what);
}

hsdp_status nccl_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    char what[160];
    nccl_describe(what, sizeof what, "all-to-all", NULL, nbytes, g->size);
    return run_sync(g, OP_ALLTOALL, send, recv, nbytes, 0, what);
}
#endif
