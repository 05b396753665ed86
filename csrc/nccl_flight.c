/* nccl_flight.c - the NCCL backend's process state and its collectives in flight
 * (nccl_internal.h).
 *
 * Failures. Every call is checked. A watchdog thread retires finished collectives, polls
 * every communicator's asynchronous error, and aborts all communicators when one fails or
 * a collective outlives HSDP_TIMEOUT; from then on every call fails with what happened,
 * naming the collective (and its unit) and the ranks that were not in it (watchdog.h).
 *
 * Host memory. A collective whose buffers are host memory (checkpoint plans, agreement
 * checks, NumPy arrays) is staged through a device scratch buffer (nccl_scratch) and waited
 * for on the host, so every slot accepts both kinds of pointer. */
#ifndef HSDP_NO_NCCL
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "watchdog.h"
#include "nccl_internal.h" /* last: it defines the short names api and S */

nccl_state S = {.mu = PTHREAD_MUTEX_INITIALIZER, .issue = PTHREAD_MUTEX_INITIALIZER, .calls = PTHREAD_MUTEX_INITIALIZER};

/* The device guard: every thread that enters the backend runs on its device. A thread's
 * first CUDA call without cudaSetDevice makes a context on device 0 (about 0.5 GiB): the
 * watchdog's first event query, or a framework's worker thread calling in, would do so on
 * every rank of an 8-GPU host. One GPU per process, so the thread's device is set and left
 * so (cached per thread; redone if the backend's device changes). */
static _Thread_local int thread_device = -1;
void nccl_device_guard(void) {
    if (!S.world_up || thread_device == S.device) return;
    if (CUDA(cudaSetDevice, S.device) == hsdp_cudaSuccess) thread_device = S.device;
}

void hsdp_nccl_set_compute_stream(void *stream) { S.compute = (hsdp_cudaStream_t)stream; }

/* Device memory comes from cudaMalloc, beside the framework's caching allocator, not from
 * it: the backend has no framework of its own (NumPy callers, the C tests), and its buffers
 * live for a unit's life, not a kernel's. What that costs is memory torch caches and we
 * cannot use: on cudaErrorMemoryAllocation the handler (torch.cuda.empty_cache) gives its
 * cached blocks back, and the allocation is retried once. */
static struct {
    hsdp_nccl_oom_fn fn;
    void *arg;
} oom;
void hsdp_nccl_set_oom_handler(hsdp_nccl_oom_fn fn, void *arg) {
    oom.fn = fn;
    oom.arg = arg;
}
hsdp_cudaError_t nccl_dev_malloc(void **p, size_t n) {
    hsdp_cudaError_t e = CUDA(cudaMalloc, p, n); /* a failure is cleared from the last error */
    if (e == hsdp_cudaErrorMemoryAllocation && oom.fn && oom.fn(oom.arg)) e = CUDA(cudaMalloc, p, n);
    return e;
}

static _Thread_local hsdp_cudaStream_t call_stream;
static _Thread_local int call_stream_set;
void nccl_call_stream(void *stream, int set) {
    call_stream = (hsdp_cudaStream_t)stream;
    call_stream_set = set;
}
hsdp_cudaStream_t nccl_consumer_stream(void) { return call_stream_set ? call_stream : S.compute; }
void *hsdp_nccl_comm_stream(void) { return (void *)S.comm; }

const char *nccl_text(hsdp_ncclResult_t rc, nccl_comm *c) {
    const char *last = c && api.ncclGetLastError ? api.ncclGetLastError(c->comm) : NULL;
    return last && *last ? last : api.ncclGetErrorString(rc);
}

hsdp_status nccl_cuda_fail(hsdp_cudaError_t e, const char *what) {
    return hsdp_fail(HSDP_ECOMM, "%s failed: CUDA error %d (%s)", what, (int)e, api.cudaGetErrorString(e));
}

hsdp_status nccl_failed_status(void) {
    return hsdp_fail(HSDP_ECOMM, "the NCCL communicators were aborted: %s", S.why);
}
hsdp_status nccl_failed_status_if_failed(void) { return atomic_load(&S.failed) ? nccl_failed_status() : HSDP_OK; }

/* Failing: the first failure is recorded once, saying why on stderr, and every call from
 * then on fails with it; peers blocked in a collective with this rank are released by their
 * own watchdogs within the same timeout. The communicators are then aborted under S.calls,
 * the lock every NCCL call on a live communicator is made under (but the watchdog's polls of
 * ncclCommGetAsyncError, which NCCL allows beside them): ncclCommAbort frees the
 * communicator, so no thread is inside a call on it then. S.calls is held only around NCCL
 * calls, which return at once (non-blocking communicators) or poll S.failed, never around a
 * CUDA call that may wait on the side stream (a copy into pageable memory, cudaFree): so the
 * watchdog takes it within a poll even while the issuing thread is stuck behind a hung
 * collective, and the abort is what releases that thread. The watchdog aborts (watch_once),
 * and so does an issuing thread on its way out (nccl_issue_unlock), whichever comes first. S.mu held. */
void nccl_abort_all_locked(const char *fmt, ...) {
    /* every writer holds S.mu; readers see S.failed set only once S.why is whole */
    if (atomic_load(&S.failed)) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(S.why, sizeof S.why, fmt, ap);
    va_end(ap);
    atomic_store(&S.failed, 1);
    fprintf(stderr, "hsdp: rank %d (NCCL): %s; aborting the NCCL communicators\n", S.boot.rank, S.why);
}

static void abort_one_locked(nccl_comm *c) {
    if (c->aborted) return;
    api.ncclCommAbort(c->comm);
    c->aborted = 1;
}

/* After a failure: aborts every live communicator not yet aborted (S.calls and S.mu held).
 * [Note: abort order] ncclCommAbort frees the communicator's device memory, and cudaFree waits
 * for every kernel on the device: aborting a communicator while another one's collective is
 * stuck waiting for a peer hangs (NVIDIA/nccl issue #829). The side stream runs in order, so
 * the collective that can be stuck is the oldest in flight, and each one behind it starts
 * once the one before is aborted: the communicators of the collectives in flight are aborted
 * oldest first, then the rest. */
void nccl_abort_comms_locked(void) {
    for (unsigned i = 0; i < S.count; i++) {
        const nccl_comm *of = S.ring[(S.head + i) % RING].comm;
        for (nccl_comm *c = S.live; of && c; c = c->next) /* still live: not freed since */
            if (c == of) abort_one_locked(c);
    }
    for (nccl_comm *c = S.live; c; c = c->next) abort_one_locked(c);
}

/* Every section that issues NCCL calls ends here: after a failure, its thread aborts. */
static void abort_comms(void) {
    pthread_mutex_lock(&S.calls);
    pthread_mutex_lock(&S.mu);
    nccl_abort_comms_locked();
    pthread_mutex_unlock(&S.mu);
    pthread_mutex_unlock(&S.calls);
}
void nccl_issue_unlock(void) {
    if (atomic_load(&S.failed)) abort_comms();
    S.issuing = NULL;
    pthread_mutex_unlock(&S.issue);
}


double nccl_timeout_s(void) { return (double)hsdp_timeout_ns() / 1e9; }

/* One pause of a wait that began at `since`: what it waits for (a collective's launch, a
 * gather's event) mostly ends within tens of microseconds on a GPU, and a sleep costs the
 * timer's slack (about 50 us) on top of its length, so the first 100 us only yield the CPU;
 * then 20 us sleeps, and after 10 ms, 1 ms ones (a long wait costs no CPU to speak of). */
void nccl_nap(uint64_t since) {
    uint64_t waited = hsdp_now_ns() - since;
    if (waited < 100000) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, waited < 10000000 ? 20000 : 1000000};
    nanosleep(&ts, NULL);
}

/* S.calls and S.mu held: the live communicators' asynchronous errors (but skip's, polled by its
 * caller); one fails them all. */
static void poll_errors_locked(const nccl_comm *skip) {
    for (nccl_comm *c = S.live; c && !atomic_load(&S.failed); c = c->next) {
        hsdp_ncclResult_t state = hsdp_ncclInProgress;
        if (c == skip || c->aborted || api.ncclCommGetAsyncError(c->comm, &state) != hsdp_ncclSuccess) continue;
        if (state != hsdp_ncclSuccess && state != hsdp_ncclInProgress)
            nccl_abort_all_locked("NCCL reported an asynchronous error: %s", nccl_text(state, c));
    }
}
/* S.calls held: the other communicators' errors, which the watchdog polls only when S.calls
 * is free ([Note: who polls a communicator]). */
static void poll_others(const nccl_comm *self) {
    pthread_mutex_lock(&S.mu);
    poll_errors_locked(self);
    pthread_mutex_unlock(&S.mu);
}

/* An NCCL call's result on a non-blocking communicator: hsdp_ncclInProgress is polled until the
 * call is done, within the timeout. S.calls held: the only thread that polls c now (see
 * [Note: who polls a communicator]). A poll that itself fails leaves `state` untouched (NCCL's
 * CommCheck returns first), so it starts as "in progress" and the poll's own result is read:
 * a failed poll is never taken for a finished call. */
hsdp_status nccl_done(nccl_comm *c, hsdp_ncclResult_t rc, const char *what) {
    uint64_t t0 = hsdp_now_ns(), limit = hsdp_timeout_ns();
    while (rc == hsdp_ncclInProgress) {
        hsdp_ncclResult_t state = hsdp_ncclInProgress;
        hsdp_ncclResult_t qrc = api.ncclCommGetAsyncError(c->comm, &state);
        if (qrc != hsdp_ncclSuccess)
            return ABORT_ALL("%s: ncclCommGetAsyncError failed with NCCL error %d (%s)", what, (int)qrc,
                             api.ncclGetErrorString(qrc));
        rc = state;
        if (rc != hsdp_ncclInProgress) break;
        if (hsdp_now_ns() - t0 > 2000000) /* a while in progress: the watchdog cannot poll now, this thread does */
            poll_others(c);
        if (atomic_load(&S.failed)) return nccl_failed_status(); /* aborted on the way out (nccl_issue_unlock) */
        if (limit && hsdp_now_ns() - t0 > limit)
            return ABORT_ALL("%s did not complete within %g s (HSDP_TIMEOUT)", what, nccl_timeout_s());
        nccl_nap(t0);
    }
    if (rc != hsdp_ncclSuccess)
        return hsdp_fail(HSDP_ECOMM, "%s failed: NCCL error %d (%s)", what, (int)rc, nccl_text(rc, c));
    return HSDP_OK;
}

/* What this rank waits in, for the peers' watchdogs (watchdog.h): the oldest collective in
 * flight, which is the one a missing peer holds up (the side stream runs in order). S.mu held. */
static void publish_locked(void) {
    if (hsdp_peers_known()) hsdp_watch_publish(S.count ? S.ring[S.head].what : NULL);
}

/* "; not in it: rank R (...)": who of the oldest collective's group does not wait in it
 * (watchdog.h), for a timeout's message. Takes S.mu briefly; asks the peers without it. */
static void name_missing(char *out, size_t n) {
    out[0] = '\0';
    char what[sizeof S.ring[0].what];
    int *ranks = NULL, size = 0;
    pthread_mutex_lock(&S.mu);
    const flight *f = S.count ? &S.ring[S.head] : NULL;
    for (nccl_comm *c = S.live; f && f->comm && c; c = c->next)
        if (c == f->comm && c->world_ranks) { /* still live: its ranks may be read */
            ranks = malloc(sizeof *ranks * (size_t)c->size); /* freed below */
            if (ranks) memcpy(ranks, c->world_ranks, sizeof *ranks * (size_t)c->size);
            size = c->size;
            memcpy(what, f->what, sizeof what);
        }
    pthread_mutex_unlock(&S.mu);
    if (ranks) hsdp_who_is_missing(out, n, what, ranks, size);
    free(ranks);
}

/* CUDA's errors for a query made while a stream is being captured into a graph (900-908,
 * cudaErrorStreamCaptureUnsupported ... cudaErrorStreamCaptureWrongThread): the event is not
 * known to be done, nothing failed on the GPU. */
int nccl_capture_error(hsdp_cudaError_t e) { return e >= 900 && e <= 908; }

/* A stream being captured into a CUDA graph (torch.cuda.graph, torch.compile with
 * mode="reduce-overhead") cannot be ordered after hsdp's gathers: they run on the side stream,
 * outside the graph, and a replay would read whatever the pooled buffer holds then. Refused,
 * saying so, before anything is enqueued on it. */
hsdp_status nccl_refuse_capture(hsdp_cudaStream_t stream, const char *what) {
    unsigned status = hsdp_cudaStreamCaptureStatusNone;
    hsdp_cudaError_t e = api.cudaStreamIsCapturing ? CUDA(cudaStreamIsCapturing, stream, &status) : hsdp_cudaSuccess;
    if (!nccl_capture_error(e) && (e != hsdp_cudaSuccess || status == hsdp_cudaStreamCaptureStatusNone)) return HSDP_OK;
    return hsdp_fail(HSDP_EUNSUPPORTED, "%s: the stream it orders is being captured into a CUDA graph "
                     "(torch.cuda.graph, or torch.compile with mode=\"reduce-overhead\"); hsdp's gathers run on a side "
                     "stream outside the graph and cannot be captured: capture a model that is not sharded, or run the "
                     "sharded one outside the capture", what);
}

/* Retires finished collectives from the front of the ring (S.mu held). A collective's clock
 * (t0, for the timeout) starts no earlier than the one before it retired: the side stream
 * runs in order, so one queued behind others has not begun while they run (a deep prefetch
 * behind a long forward would otherwise age while it waits its turn). */
static void retire_locked(void) {
    unsigned before = S.count;
    while (S.count) {
        flight *f = &S.ring[S.head];
        hsdp_cudaError_t e = CUDA(cudaEventQuery, f->ev);
        if (e == hsdp_cudaErrorNotReady || nccl_capture_error(e)) break;
        if (e != hsdp_cudaSuccess)
            nccl_abort_all_locked("%s failed on the GPU: CUDA error %d (%s)", f->what, (int)e, api.cudaGetErrorString(e));
        S.head = (S.head + 1) % RING;
        S.count--;
    }
    if (S.count != before) {
        uint64_t now = hsdp_now_ns();
        if (S.count && S.ring[S.head].t0 < now) S.ring[S.head].t0 = now;
        publish_locked();
    }
}

static void watch_once(void) {
    pthread_mutex_lock(&S.mu);
    retire_locked();
    uint64_t limit = hsdp_timeout_ns();
    if (S.count && limit && !atomic_load(&S.failed)) {
        flight *f = &S.ring[S.head];
        uint64_t age = hsdp_now_ns() - f->t0, t0 = f->t0;
        if (age > limit) {
            char what[sizeof f->what], missing[640];
            memcpy(what, f->what, sizeof what);
            pthread_mutex_unlock(&S.mu); /* asking the peers takes a while */
            name_missing(missing, sizeof missing);
            pthread_mutex_lock(&S.mu);
            retire_locked();
            if (S.count && S.ring[S.head].t0 == t0) /* still waiting */
                nccl_abort_all_locked("%s has waited %.1f s for its peers (HSDP_TIMEOUT=%g s)%s", what, (double)age / 1e9,
                                 nccl_timeout_s(), missing);
        }
    }
    /* [Note: who polls a communicator] NCCL's ncclCommGetAsyncError is not safe from two
     * threads on one communicator: every call on a non-blocking communicator leaves a "group
     * job" linked to it, and the poll that sees it done completes it (init.cc
     * ncclCommGetAsyncError -> group.cc ncclGroupJobComplete), dropping its reference without
     * a lock: two pollers at that moment free it twice. Every call and its polls run under
     * S.calls, so the watchdog polls only when it can take S.calls without waiting: while a
     * thread is in a call, that thread polls (nccl_done) and sees what the watchdog would. */
    if (!atomic_load(&S.failed) && pthread_mutex_trylock(&S.calls) == 0) {
        poll_errors_locked(NULL);
        pthread_mutex_unlock(&S.calls);
    }
    int abort_now = 0;
    for (nccl_comm *c = S.live; c && atomic_load(&S.failed); c = c->next) abort_now |= !c->aborted;
    pthread_mutex_unlock(&S.mu);
    if (abort_now) abort_comms(); /* S.calls before S.mu: within a poll of the thread in a call */
}

static void *watchdog(void *arg) {
    (void)arg;
    if (CUDA(cudaSetDevice, S.device) == hsdp_cudaSuccess) thread_device = S.device; /* before any CUDA call */
    while (!atomic_load(&S.stop)) {
        watch_once();
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* Records the end of the collective just enqueued on the side stream, in the ring the
 * watchdog watches; *ev gets its event. A full ring waits for the oldest to finish. */
hsdp_status nccl_track(const char *what, const void *dst, size_t dst_n, hsdp_cudaEvent_t *ev) {
    pthread_mutex_lock(&S.mu);
    uint64_t since = hsdp_now_ns();
    for (;;) {
        retire_locked();
        if (atomic_load(&S.failed)) {
            pthread_mutex_unlock(&S.mu);
            return nccl_failed_status();
        }
        if (S.count < RING) break;
        pthread_mutex_unlock(&S.mu);
        nccl_nap(since);
        pthread_mutex_lock(&S.mu);
    }
    flight *f = &S.ring[(S.head + S.count) % RING];
    hsdp_cudaError_t e = hsdp_cudaSuccess;
    if (!f->ev) e = CUDA(cudaEventCreateWithFlags, &f->ev, hsdp_cudaEventDisableTiming);
    if (e == hsdp_cudaSuccess) e = CUDA(cudaEventRecord, f->ev, S.comm);
    if (e != hsdp_cudaSuccess) {
        pthread_mutex_unlock(&S.mu);
        return nccl_cuda_fail(e, "recording a collective's event");
    }
    f->t0 = hsdp_now_ns();
    f->dst = dst;
    f->dst_n = dst_n;
    f->comm = S.issuing;
    snprintf(f->what, sizeof f->what, "%s", what);
    if (++S.count == 1) publish_locked();
    *ev = f->ev;
    pthread_mutex_unlock(&S.mu);
    return HSDP_OK;
}

/* Blocks the host until ev has happened, within the timeout (host buffers need it). */
hsdp_status nccl_host_wait(hsdp_cudaEvent_t ev, const char *what) {
    uint64_t t0 = hsdp_now_ns(), limit = hsdp_timeout_ns();
    for (;;) {
        hsdp_cudaError_t e = CUDA(cudaEventQuery, ev);
        if (e == hsdp_cudaSuccess) return HSDP_OK;
        if (e != hsdp_cudaErrorNotReady && !nccl_capture_error(e)) return nccl_cuda_fail(e, what);
        if (atomic_load(&S.failed)) return nccl_failed_status();
        if (limit && hsdp_now_ns() - t0 > limit) {
            char missing[640];
            name_missing(missing, sizeof missing);
            return ABORT_ALL("%s has waited %g s for its peers (HSDP_TIMEOUT)%s", what, nccl_timeout_s(), missing);
        }
        nccl_nap(t0);
    }
}

/* Makes `stream` (a consumer's: NULL, the legacy default stream) wait for every collective
 * still in flight that writes into [p, p + n); the host never blocks. */
hsdp_status nccl_stream_wait(void *stream, const void *p, size_t n) {
    if (!S.world_up || !p) return HSDP_OK;
    nccl_device_guard();
    const char *lo = p, *hi = lo + n;
    pthread_mutex_lock(&S.mu);
    retire_locked();
    /* the side stream runs in order: the latest overlapping collective covers the earlier */
    hsdp_cudaEvent_t last = NULL;
    for (unsigned i = 0; i < S.count; i++) {
        const flight *f = &S.ring[(S.head + i) % RING];
        if (f->dst && f->dst < hi && lo < f->dst + f->dst_n) last = f->ev;
    }
    hsdp_cudaError_t e = last ? CUDA(cudaStreamWaitEvent, (hsdp_cudaStream_t)stream, last, 0) : hsdp_cudaSuccess;
    pthread_mutex_unlock(&S.mu);
    return e == hsdp_cudaSuccess ? HSDP_OK : nccl_cuda_fail(e, "ordering a consumer's stream after a gather");
}

/* Before enqueuing: no collective after a failure, and none may overwrite a pooled buffer
 * the compute stream may still read. */
hsdp_status nccl_begin(void) {
    if (atomic_load(&S.failed)) return nccl_failed_status();
    if (S.have_released) CUDA_TRY(CUDA(cudaStreamWaitEvent, S.comm, S.released, 0), "waiting for released buffers");
    if (!atomic_load(&S.readers_pending)) return HSDP_OK;
    hsdp_cudaError_t e = hsdp_cudaSuccess;
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < S.nreaders && e == hsdp_cudaSuccess; i++)
        if (S.readers[i].pending) {
            e = CUDA(cudaStreamWaitEvent, S.comm, S.readers[i].ev, 0);
            S.readers[i].pending = 0; /* the side stream runs in order: once is enough */
        }
    atomic_store(&S.readers_pending, 0);
    pthread_mutex_unlock(&S.mu);
    return e == hsdp_cudaSuccess ? HSDP_OK : nccl_cuda_fail(e, "waiting for buffers released by another stream");
}

/* A consumer's stream other than the compute stream read a buffer (S.mu taken here). */
hsdp_status nccl_note_reader(hsdp_cudaStream_t stream) {
    if (stream == S.compute) return HSDP_OK;
    hsdp_status st = HSDP_OK;
    pthread_mutex_lock(&S.mu);
    int i = 0;
    while (i < S.nreaders && S.readers[i].stream != stream) i++;
    if (i == S.nreaders) {
        if (i == (int)(sizeof S.readers / sizeof *S.readers)) {
            st = hsdp_fail(HSDP_EUNSUPPORTED, "more than %d CUDA streams read hsdp's gathered buffers: hsdp orders the "
                           "release of its buffers after each of them, and keeps that many", i);
        } else {
            hsdp_cudaError_t e = CUDA(cudaEventCreateWithFlags, &S.readers[i].ev, hsdp_cudaEventDisableTiming);
            if (e != hsdp_cudaSuccess) st = nccl_cuda_fail(e, "creating a reader stream's release event");
            else S.readers[i].stream = stream, S.nreaders++;
        }
    }
    if (st == HSDP_OK) S.readers[i].read = 1;
    pthread_mutex_unlock(&S.mu);
    return st;
}

int nccl_on_device(const void *p) {
    if (!p) return 1; /* nothing to stage */
    hsdp_cudaPointerAttributes a;
    if (CUDA(cudaPointerGetAttributes, &a, p) != hsdp_cudaSuccess) return 0;
    return a.type == hsdp_cudaMemoryTypeDevice || a.type == hsdp_cudaMemoryTypeManaged;
}

/* A device buffer of at least n bytes for staging host memory (S.issue held). */
hsdp_status nccl_scratch(size_t n, void **out) {
    if (n > S.scratch_n) {
        if (S.scratch) {
            hsdp_cudaEvent_t ev = NULL;
            hsdp_status st = nccl_track("the collectives using the staging buffer", NULL, 0, &ev);
            if (st == HSDP_OK) st = nccl_host_wait(ev, "the collectives using the staging buffer");
            if (st != HSDP_OK) return st;
            CUDA(cudaFree, S.scratch);
            S.scratch = NULL;
            S.scratch_n = 0;
        }
        CUDA_TRY(nccl_dev_malloc(&S.scratch, n), "allocating a device staging buffer");
        S.scratch_n = n;
    }
    *out = S.scratch;
    return HSDP_OK;
}

/* The side stream, its events and the watchdog thread, on `device` (nccl_world). */
hsdp_status nccl_start_process_state(int device) {
    int n = 0;
    CUDA_TRY(CUDA(cudaGetDeviceCount, &n), "cudaGetDeviceCount");
    if (device >= n)
        return hsdp_fail(HSDP_EINVAL, "CUDA device %d does not exist: this machine shows %d (LOCAL_RANK must be below "
                         "the number of visible GPUs)", device, n);
    CUDA_TRY(CUDA(cudaSetDevice, device), "cudaSetDevice");
    S.device = device;
    thread_device = device;
    if (!S.comm) {
        int least = 0, greatest = 0;
        CUDA_TRY(CUDA(cudaDeviceGetStreamPriorityRange, &least, &greatest), "cudaDeviceGetStreamPriorityRange");
        CUDA_TRY(CUDA(cudaStreamCreateWithPriority, &S.comm, hsdp_cudaStreamNonBlocking, greatest),
                 "creating the gather stream");
        CUDA_TRY(CUDA(cudaEventCreateWithFlags, &S.released, hsdp_cudaEventDisableTiming), "creating the release event");
        CUDA_TRY(CUDA(cudaEventCreateWithFlags, &S.ready, hsdp_cudaEventDisableTiming), "creating the ordering event");
    }
    if (!S.watchdog_on) {
        atomic_store(&S.stop, 0);
        int rc = pthread_create(&S.watchdog, NULL, watchdog, NULL);
        if (rc != 0) return hsdp_fail(HSDP_ECOMM, "could not start the NCCL watchdog thread: %s", strerror(rc));
        S.watchdog_on = 1;
    }
    S.world_up = 1;
    return HSDP_OK;
}
#endif
