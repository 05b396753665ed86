/* fake_cuda_nccl.c - a stand-in for libcudart and libnccl, so that the NCCL backend's own
 * logic (loading, joining, ordering across streams, staging, shares, the watchdog, aborts)
 * runs under ASan on a machine without a GPU. Built as a shared library and passed as both
 * libraries to test_nccl. Written against cuda_abi.h, the declarations the backend uses (no
 * CUDA headers needed); the end of this file asserts that each function here has the type
 * the backend calls it by.
 *
 * It behaves like CUDA where the backend can get it wrong:
 * - Streams really defer work: each has a worker thread that runs its copies, collectives,
 *   event records and event waits in order, so a missing wait reads stale bytes. Copies from
 *   pageable host memory snapshot their source when enqueued, copies into pageable host
 *   memory return once done (as CUDA's do); pinned memory (cudaHostAlloc) is asynchronous.
 * - An event completes when its stream reaches it; cudaEventQuery says cudaErrorNotReady
 *   until then.
 * - The last error and the current device are per thread. Every failing call, NotReady
 *   included, leaves its error for cudaGetLastError (as the runtime does: the next
 *   kernel-launch check of a framework sharing the runtime would raise it). A thread's first
 *   call without cudaSetDevice makes a context on device 0 (fake_contexts() says which).
 * - Non-blocking NCCL init and split return ncclInProgress, and ncclCommGetAsyncError says
 *   ncclInProgress for a few polls; a NULL communicator is ncclInvalidArgument.
 * - ncclCommAbort kills the communicator: any later call on it, or one racing with the
 *   abort, is counted (fake_violations()) and fails; so is a call needing a communicator
 *   whose non-blocking init or split was not polled to its end.
 * A world of one rank, on FAKE_DEVICES devices (default 2) whose memory is host memory.
 *
 * Controls, by environment: FAKE_NCCL_VERSION (default 23007); FAKE_STALL=1 makes every
 * event recorded from then on never complete (a peer that never arrives). By the fake_*
 * functions at the end (test_nccl finds them with dlsym): holding a stream, failing the
 * next cudaMalloc calls, a communicator's asynchronous error or hang. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_abi.h"

/* One lock for the whole fake device, one condition for every change of its state. */
static pthread_mutex_t G = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t C = PTHREAD_COND_INITIALIZER;

static _Thread_local hsdp_cudaError_t last_error;
static _Thread_local int current_device = -1; /* -1: no cudaSetDevice on this thread yet */
static atomic_uint contexts;                    /* bit d: a context exists on device d */
static atomic_int fail_mallocs, pageable_uploads;

static hsdp_cudaError_t err(hsdp_cudaError_t e) {
    if (e != hsdp_cudaSuccess) last_error = e;
    return e;
}
/* What every call that needs a context does first: the thread's device, else device 0. */
static void context(void) {
    if (current_device < 0) current_device = 0;
    atomic_fetch_or(&contexts, 1u << current_device);
}
static int ndevices(void) {
    const char *s = getenv("FAKE_DEVICES");
    int n = s ? atoi(s) : 2;
    return n > 0 && n <= 8 ? n : 2;
}

/* ---------------------------------------------------------------- memory: device and pinned */
typedef struct block {
    void *p;
    size_t n;
    int pinned; /* cudaHostAlloc: host memory the device reaches asynchronously */
    struct block *next;
} block;
static block *blocks; /* under G */

static block *find(const void *p) {
    for (block *b = blocks; b; b = b->next)
        if ((const char *)p >= (const char *)b->p && (const char *)p < (const char *)b->p + (b->n ? b->n : 1)) return b;
    return NULL;
}
static int is_device(const void *p) {
    block *b = find(p);
    return b && !b->pinned;
}
static int is_pageable(const void *p) { return p && !find(p); }

hsdp_cudaError_t cudaGetDeviceCount(int *n) {
    *n = ndevices();
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaSetDevice(int d) {
    if (d < 0 || d >= ndevices()) return err(hsdp_cudaErrorInvalidDevice);
    current_device = d;
    context();
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaGetLastError(void) {
    hsdp_cudaError_t e = last_error;
    last_error = hsdp_cudaSuccess;
    return e;
}
static hsdp_cudaError_t alloc(void **p, size_t n, int pinned) {
    context();
    *p = NULL;
    int left = atomic_load(&fail_mallocs);
    while (left > 0 && !atomic_compare_exchange_weak(&fail_mallocs, &left, left - 1)) {
    }
    if (left > 0) return err(hsdp_cudaErrorMemoryAllocation);
    block *b = malloc(sizeof *b);
    void *mem = calloc(1, n ? n : 1);
    if (!b || !mem) {
        free(b);
        free(mem);
        return err(hsdp_cudaErrorMemoryAllocation);
    }
    *b = (block){.p = mem, .n = n, .pinned = pinned};
    pthread_mutex_lock(&G);
    b->next = blocks;
    blocks = b;
    pthread_mutex_unlock(&G);
    *p = mem;
    return hsdp_cudaSuccess;
}
static void settle_all(void);
static hsdp_cudaError_t release(void *p, int pinned) {
    context();
    if (!p) return hsdp_cudaSuccess;
    pthread_mutex_lock(&G);
    settle_all(); /* cudaFree synchronizes the device (with work that can still run) */
    for (block **b = &blocks; *b; b = &(*b)->next)
        if ((*b)->p == p && (*b)->pinned == pinned) {
            block *dead = *b;
            *b = dead->next;
            pthread_mutex_unlock(&G);
            free(dead->p);
            free(dead);
            return hsdp_cudaSuccess;
        }
    pthread_mutex_unlock(&G);
    return err(hsdp_cudaErrorInvalidValue);
}
hsdp_cudaError_t cudaMalloc(void **p, size_t n) { return alloc(p, n, 0); }
hsdp_cudaError_t cudaFree(void *p) { return release(p, 0); }
hsdp_cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags) {
    (void)flags;
    return alloc(p, n, 1);
}
hsdp_cudaError_t cudaFreeHost(void *p) { return release(p, 1); }
hsdp_cudaError_t cudaPointerGetAttributes(hsdp_cudaPointerAttributes *a, const void *p) {
    context();
    memset(a, 0, sizeof *a);
    pthread_mutex_lock(&G);
    block *b = find(p);
    a->type = !b ? hsdp_cudaMemoryTypeUnregistered : b->pinned ? hsdp_cudaMemoryTypeHost : hsdp_cudaMemoryTypeDevice;
    pthread_mutex_unlock(&G);
    return hsdp_cudaSuccess;
}

/* ---------------------------------------------------------------- streams and events */
typedef struct fake_event {
    uint64_t recorded, done; /* done: the latest record its stream has reached */
    int stalled;             /* the latest record never completes (FAKE_STALL) */
    int refs, destroyed;     /* ops pending on it; freed once destroyed and unreferenced */
} fake_event;

typedef enum { K_COPY, K_RECORD, K_WAIT } op_kind;
typedef struct op {
    op_kind kind;
    void *dst;
    const void *src;
    size_t n;
    void *owned; /* a snapshot of a pageable source, freed once copied */
    fake_event *ev;
    uint64_t gen;
    int stalled;
    uint64_t seq; /* the stream's count of ops enqueued, this one included */
    struct op *next;
} op;

typedef struct fake_stream {
    pthread_t worker;
    op *head, *tail;
    uint64_t enqueued, ran;
    int held, quit;
    struct fake_stream *next; /* every live stream, under G */
} fake_stream;
static fake_stream *legacy; /* the NULL stream, made on first use */
static fake_stream *streams;

static void unref(fake_event *e) {
    if (e && --e->refs == 0 && e->destroyed) free(e);
}
static int runnable(const fake_stream *s, const op *o) {
    return o && !s->held && (o->kind != K_WAIT || o->ev->done >= o->gen);
}
static int stuck(const fake_stream *s, const op *o) { /* never runnable again */
    return o && (s->held || (o->kind == K_WAIT && o->ev->stalled && o->ev->done < o->gen));
}

static void *worker(void *arg) {
    fake_stream *s = arg;
    pthread_mutex_lock(&G);
    for (;;) {
        op *o = s->head;
        if (!runnable(s, o)) {
            if (s->quit && (!o || stuck(s, o))) break;
            pthread_cond_wait(&C, &G);
            continue;
        }
        if (o->kind == K_COPY) memmove(o->dst, o->src, o->n);
        if (o->kind == K_RECORD && !o->stalled && o->ev->done < o->gen) o->ev->done = o->gen;
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->ran = o->seq;
        unref(o->ev);
        free(o->owned);
        free(o);
        pthread_cond_broadcast(&C);
    }
    for (op *o = s->head, *next; o; o = next) { /* destroyed while stuck: dropped */
        next = o->next;
        unref(o->ev);
        free(o->owned);
        free(o);
    }
    s->head = s->tail = NULL;
    pthread_mutex_unlock(&G);
    return NULL;
}

static fake_stream *stream_new(void) { /* G held */
    fake_stream *s = calloc(1, sizeof *s);
    if (s && pthread_create(&s->worker, NULL, worker, s) != 0) {
        free(s);
        s = NULL;
    }
    if (s) {
        s->next = streams;
        streams = s;
    }
    return s;
}
static void settle_all(void) { /* G held */
    for (fake_stream *s = streams; s; s = s->next)
        while (runnable(s, s->head)) pthread_cond_wait(&C, &G);
}
static fake_stream *stream_of(hsdp_cudaStream_t h) { /* G held */
    if (h) return (fake_stream *)h;
    if (!legacy) legacy = stream_new();
    return legacy;
}
/* Appends o to h's queue; returns its sequence number (G held). */
static uint64_t push(hsdp_cudaStream_t h, op *o) {
    fake_stream *s = stream_of(h);
    o->seq = ++s->enqueued;
    if (o->ev) o->ev->refs++;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    pthread_cond_broadcast(&C);
    return o->seq;
}
static void wait_ran(hsdp_cudaStream_t h, uint64_t seq) { /* G held */
    fake_stream *s = stream_of(h);
    while (s->ran < seq) pthread_cond_wait(&C, &G);
}
/* A copy on a stream, as CUDA orders it (also what the fake collectives enqueue). */
static hsdp_cudaError_t copy_on(hsdp_cudaStream_t h, void *dst, const void *src, size_t n) {
    if (!n) return hsdp_cudaSuccess;
    op *o = calloc(1, sizeof *o);
    if (!o) return err(hsdp_cudaErrorMemoryAllocation);
    *o = (op){.kind = K_COPY, .dst = dst, .src = src, .n = n};
    pthread_mutex_lock(&G);
    int from_pageable = is_pageable(src), to_pageable = is_pageable(dst);
    if (from_pageable) { /* staged at once: the caller may reuse its memory on return */
        o->owned = malloc(n);
        if (!o->owned) {
            pthread_mutex_unlock(&G);
            free(o);
            return err(hsdp_cudaErrorMemoryAllocation);
        }
        memcpy(o->owned, src, n);
        o->src = o->owned;
        if (!to_pageable) atomic_fetch_add(&pageable_uploads, 1);
    }
    uint64_t seq = push(h, o);
    if (to_pageable) wait_ran(h, seq); /* into pageable memory: returns once done */
    pthread_mutex_unlock(&G);
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, hsdp_cudaMemcpyKind k, hsdp_cudaStream_t s) {
    (void)k;
    context();
    return copy_on(s, dst, src, n);
}

hsdp_cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    context();
    *least = 0, *greatest = -1;
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaStreamCreateWithPriority(hsdp_cudaStream_t *s, unsigned flags, int prio) {
    (void)flags, (void)prio;
    context();
    pthread_mutex_lock(&G);
    *s = (hsdp_cudaStream_t)stream_new();
    pthread_mutex_unlock(&G);
    return *s ? hsdp_cudaSuccess : err(hsdp_cudaErrorMemoryAllocation);
}
hsdp_cudaError_t cudaStreamDestroy(hsdp_cudaStream_t h) {
    context();
    if (!h) return err(hsdp_cudaErrorInvalidValue);
    fake_stream *s = (fake_stream *)h;
    pthread_mutex_lock(&G);
    s->quit = 1; /* its work still runs, unless it can never run */
    for (fake_stream **p = &streams; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            break;
        }
    pthread_cond_broadcast(&C);
    pthread_mutex_unlock(&G);
    pthread_join(s->worker, NULL);
    free(s);
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaStreamSynchronize(hsdp_cudaStream_t h) {
    context();
    pthread_mutex_lock(&G);
    fake_stream *s = stream_of(h);
    wait_ran(h, s->enqueued);
    pthread_mutex_unlock(&G);
    return hsdp_cudaSuccess;
}

hsdp_cudaError_t cudaEventCreateWithFlags(hsdp_cudaEvent_t *e, unsigned flags) {
    (void)flags;
    context();
    *e = (hsdp_cudaEvent_t)calloc(1, sizeof(fake_event));
    return *e ? hsdp_cudaSuccess : err(hsdp_cudaErrorMemoryAllocation);
}
hsdp_cudaError_t cudaEventDestroy(hsdp_cudaEvent_t h) {
    context();
    if (!h) return err(hsdp_cudaErrorInvalidValue);
    pthread_mutex_lock(&G);
    fake_event *e = (fake_event *)h;
    e->destroyed = 1; /* as CUDA: pending work that uses it still completes */
    if (e->refs == 0) free(e);
    pthread_mutex_unlock(&G);
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaEventRecord(hsdp_cudaEvent_t h, hsdp_cudaStream_t s) {
    context();
    const char *stall = getenv("FAKE_STALL");
    op *o = calloc(1, sizeof *o);
    if (!o) return err(hsdp_cudaErrorMemoryAllocation);
    pthread_mutex_lock(&G);
    fake_event *e = (fake_event *)h;
    e->stalled = stall && *stall == '1';
    *o = (op){.kind = K_RECORD, .ev = e, .gen = ++e->recorded, .stalled = e->stalled};
    push(s, o);
    pthread_mutex_unlock(&G);
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaStreamWaitEvent(hsdp_cudaStream_t s, hsdp_cudaEvent_t h, unsigned flags) {
    (void)flags;
    context();
    op *o = calloc(1, sizeof *o);
    if (!o) return err(hsdp_cudaErrorMemoryAllocation);
    pthread_mutex_lock(&G);
    fake_event *e = (fake_event *)h;
    *o = (op){.kind = K_WAIT, .ev = e, .gen = e->recorded}; /* the record most recent now */
    push(s, o);
    pthread_mutex_unlock(&G);
    return hsdp_cudaSuccess;
}
static uint64_t queries; /* cudaEventQuery calls, under G */
hsdp_cudaError_t cudaEventQuery(hsdp_cudaEvent_t h) {
    context();
    pthread_mutex_lock(&G);
    queries++;
    pthread_cond_broadcast(&C);
    fake_event *e = (fake_event *)h;
    int done = e->done >= e->recorded;
    pthread_mutex_unlock(&G);
    return done ? hsdp_cudaSuccess : err(hsdp_cudaErrorNotReady);
}
const char *cudaGetErrorString(hsdp_cudaError_t e) { return e == hsdp_cudaSuccess ? "no error" : "fake CUDA error"; }

/* ---------------------------------------------------------------- a world of one */
enum { MAX_COMMS = 64 };
typedef struct {
    int rank, size, index;
    int polls_left;        /* a non-blocking init or split: ncclInProgress for this many polls */
    atomic_int dead;       /* aborted: any use from now on is counted */
    atomic_int in_call;    /* threads inside a call on it (an abort then races with them) */
    const void *sent;      /* the grouped send to self, matched by the next receive */
    size_t sent_n;
} fake_comm;
static fake_comm *comms[MAX_COMMS]; /* every communicator made, by index; freed at unload */
static atomic_int ncomms, violations;
static hsdp_ncclResult_t async_error[MAX_COMMS];
static atomic_int hang[MAX_COMMS];

/* Every call on a communicator: a dead one, or one being aborted, is a violation. */
static fake_comm *enter(hsdp_ncclComm_t h);
/* A call that needs the communicator ready: one whose non-blocking init has not been seen
 * to finish (ncclCommGetAsyncError still said ncclInProgress) is a violation too. */
static fake_comm *enter_ready(hsdp_ncclComm_t h) {
    fake_comm *c = enter(h);
    if (!c) return NULL;
    pthread_mutex_lock(&G);
    int ready = c->polls_left == 0;
    pthread_mutex_unlock(&G);
    if (!ready) {
        atomic_fetch_add(&violations, 1);
        atomic_fetch_sub(&c->in_call, 1);
        return NULL;
    }
    return c;
}
static fake_comm *enter(hsdp_ncclComm_t h) {
    fake_comm *c = (fake_comm *)h;
    if (!c) return NULL;
    atomic_fetch_add(&c->in_call, 1);
    if (atomic_load(&c->dead)) {
        atomic_fetch_add(&violations, 1);
        atomic_fetch_sub(&c->in_call, 1);
        return NULL;
    }
    return c;
}
static void leave(fake_comm *c) {
    if (c) atomic_fetch_sub(&c->in_call, 1);
}

hsdp_ncclResult_t ncclGetVersion(int *v) {
    const char *s = getenv("FAKE_NCCL_VERSION");
    *v = s ? atoi(s) : 23007;
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclGetUniqueId(hsdp_ncclUniqueId *id) {
    for (size_t i = 0; i < sizeof id->internal; i++) id->internal[i] = (char)(i * 7 + 1);
    return hsdp_ncclSuccess;
}
static hsdp_ncclResult_t new_comm(hsdp_ncclComm_t *out, int n, int rank, int polls) {
    if (!out) return hsdp_ncclInvalidArgument;
    if (n != 1 || rank != 0) return hsdp_ncclInvalidArgument; /* one process: a world of one */
    int index = atomic_fetch_add(&ncomms, 1);
    if (index >= MAX_COMMS) return hsdp_ncclSystemError;
    fake_comm *c = calloc(1, sizeof *c);
    if (!c) return hsdp_ncclSystemError;
    c->size = 1;
    c->index = index;
    c->polls_left = polls;
    comms[index] = c;
    *out = (hsdp_ncclComm_t)c; /* set at once, as NCCL does, so a non-blocking init can be polled */
    return polls ? hsdp_ncclInProgress : hsdp_ncclSuccess;
}
static int config_ok(const hsdp_ncclConfig_t *cfg) { /* what NCCL checks first */
    return cfg && cfg->magic == HSDP_NCCL_API_MAGIC && cfg->version >= 21400;
}
hsdp_ncclResult_t ncclCommInitRank(hsdp_ncclComm_t *c, int n, hsdp_ncclUniqueId id, int rank) {
    (void)id;
    context();
    return new_comm(c, n, rank, 0);
}
hsdp_ncclResult_t ncclCommInitRankConfig(hsdp_ncclComm_t *c, int n, hsdp_ncclUniqueId id, int rank,
                                         hsdp_ncclConfig_t *cfg) {
    (void)id;
    context();
    if (!config_ok(cfg)) return hsdp_ncclInvalidArgument;
    return new_comm(c, n, rank, cfg->blocking ? 0 : 3);
}
hsdp_ncclResult_t ncclCommSplit(hsdp_ncclComm_t h, int color, int key, hsdp_ncclComm_t *out, hsdp_ncclConfig_t *cfg) {
    (void)color, (void)key;
    context();
    fake_comm *c = enter_ready(h);
    if (!c || !config_ok(cfg)) {
        leave(c);
        return hsdp_ncclInvalidArgument;
    }
    hsdp_ncclResult_t rc = new_comm(out, 1, 0, cfg->blocking ? 0 : 2);
    leave(c);
    return rc;
}
hsdp_ncclResult_t ncclCommUserRank(const hsdp_ncclComm_t h, int *r) {
    fake_comm *c = enter_ready(h);
    if (!c) return hsdp_ncclInvalidArgument;
    *r = c->rank;
    leave(c);
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclCommCount(const hsdp_ncclComm_t h, int *n) {
    fake_comm *c = enter_ready(h);
    if (!c) return hsdp_ncclInvalidArgument;
    *n = c->size;
    leave(c);
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclCommGetAsyncError(hsdp_ncclComm_t h, hsdp_ncclResult_t *e) {
    fake_comm *c = enter(h);
    if (!c) return hsdp_ncclInvalidArgument; /* *e untouched, as NCCL leaves it */
    pthread_mutex_lock(&G);
    if (c->polls_left > 0) {
        c->polls_left--;
        *e = hsdp_ncclInProgress;
    } else {
        *e = async_error[c->index] ? async_error[c->index]
             : atomic_load(&hang[c->index]) ? hsdp_ncclInProgress : hsdp_ncclSuccess;
    }
    pthread_mutex_unlock(&G);
    leave(c);
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclCommAbort(hsdp_ncclComm_t h) {
    fake_comm *c = enter(h);
    if (!c) return hsdp_ncclInvalidArgument;
    /* another thread inside a call on it: NCCL would free the communicator under it */
    if (atomic_load(&c->in_call) > 1) atomic_fetch_add(&violations, 1);
    atomic_store(&c->dead, 1);
    leave(c);
    return hsdp_ncclSuccess;
}
const char *ncclGetErrorString(hsdp_ncclResult_t r) { return r == hsdp_ncclSuccess ? "no error" : "fake NCCL error"; }
const char *ncclGetLastError(hsdp_ncclComm_t c) {
    (void)c;
    return "";
}

static size_t nbytes(size_t count, hsdp_ncclDataType_t t) { return count * (t == hsdp_ncclFloat32 ? 4 : 1); }
/* A collective: NCCL reads and writes device memory only; the copy runs on the stream. A
 * hanging communicator takes the call but reports ncclInProgress (a non-blocking one). */
static hsdp_ncclResult_t collective(hsdp_ncclComm_t h, const void *s, void *r, size_t n, hsdp_cudaStream_t st) {
    context();
    fake_comm *c = enter_ready(h);
    if (!c) return hsdp_ncclInvalidArgument;
    pthread_mutex_lock(&G);
    int ok = (!s || is_device(s)) && (!r || is_device(r));
    pthread_mutex_unlock(&G);
    hsdp_ncclResult_t rc = !ok ? hsdp_ncclInvalidUsage
                           : s && r && s != r && copy_on(st, r, s, n) != hsdp_cudaSuccess ? hsdp_ncclSystemError
                           : atomic_load(&hang[c->index]) ? hsdp_ncclInProgress : hsdp_ncclSuccess;
    leave(c);
    return rc;
}
hsdp_ncclResult_t ncclAllGather(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclComm_t c,
                                hsdp_cudaStream_t st) {
    return collective(c, s, r, nbytes(count, t), st);
}
hsdp_ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, int root,
                                hsdp_ncclComm_t c, hsdp_cudaStream_t st) {
    if (root != 0) return hsdp_ncclInvalidUsage;
    return collective(c, s, r, nbytes(count, t), st);
}
hsdp_ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclRedOp_t op,
                                hsdp_ncclComm_t c, hsdp_cudaStream_t st) {
    (void)op;
    return collective(c, s, r, nbytes(count, t), st);
}
hsdp_ncclResult_t ncclAlltoAll(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclComm_t c,
                               hsdp_cudaStream_t st) {
    return collective(c, s, r, nbytes(count, t), st);
}
hsdp_ncclResult_t ncclSend(const void *s, size_t count, hsdp_ncclDataType_t t, int peer, hsdp_ncclComm_t h,
                           hsdp_cudaStream_t st) {
    (void)st;
    fake_comm *c = enter_ready(h);
    if (!c) return hsdp_ncclInvalidArgument;
    pthread_mutex_lock(&G);
    int ok = peer == 0 && is_device(s);
    pthread_mutex_unlock(&G);
    if (ok) {
        c->sent = s;
        c->sent_n = nbytes(count, t);
    }
    leave(c);
    return ok ? hsdp_ncclSuccess : hsdp_ncclInvalidUsage;
}
hsdp_ncclResult_t ncclRecv(void *r, size_t count, hsdp_ncclDataType_t t, int peer, hsdp_ncclComm_t h,
                           hsdp_cudaStream_t st) {
    fake_comm *c = enter_ready(h);
    if (!c) return hsdp_ncclInvalidArgument;
    pthread_mutex_lock(&G);
    int ok = peer == 0 && is_device(r) && c->sent && c->sent_n == nbytes(count, t);
    pthread_mutex_unlock(&G);
    hsdp_ncclResult_t rc = ok && copy_on(st, r, c->sent, c->sent_n) == hsdp_cudaSuccess ? hsdp_ncclSuccess
                                                                                      : hsdp_ncclInvalidUsage;
    c->sent = NULL;
    leave(c);
    return rc;
}
hsdp_ncclResult_t ncclGroupStart(void) { return hsdp_ncclSuccess; }
hsdp_ncclResult_t ncclGroupEnd(void) { return hsdp_ncclSuccess; }

/* ---------------------------------------------------------------- controls, for test_nccl */
/* Holds a stream (its queued work waits) or lets it go. */
void fake_stream_hold(hsdp_cudaStream_t h, int on) {
    pthread_mutex_lock(&G);
    stream_of(h)->held = on;
    pthread_cond_broadcast(&C);
    pthread_mutex_unlock(&G);
}
/* Waits until a stream has run all it can now; returns how many of its ops still wait. */
int fake_stream_settle(hsdp_cudaStream_t h) {
    pthread_mutex_lock(&G);
    fake_stream *s = stream_of(h);
    while (runnable(s, s->head)) pthread_cond_wait(&C, &G);
    int n = (int)(s->enqueued - s->ran);
    pthread_mutex_unlock(&G);
    return n;
}
/* Waits (at most 5 s) until other threads have made n more cudaEventQuery calls; 1 if they did. */
int fake_wait_queries(int n) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5;
    pthread_mutex_lock(&G);
    uint64_t goal = queries + (uint64_t)n;
    while (queries < goal && pthread_cond_timedwait(&C, &G, &until) == 0) {
    }
    int ok = queries >= goal;
    pthread_mutex_unlock(&G);
    return ok;
}
/* The devices with a context (bit d for device d). */
unsigned fake_contexts(void) { return atomic_load(&contexts); }
/* The next n cudaMalloc/cudaHostAlloc calls fail with cudaErrorMemoryAllocation. */
void fake_fail_mallocs(int n) { atomic_store(&fail_mallocs, n); }
/* Copies enqueued from pageable host memory to the device so far. */
int fake_pageable_uploads(void) { return atomic_load(&pageable_uploads); }
/* Calls on an aborted communicator, and aborts racing with another call on it. */
int fake_violations(void) { return atomic_load(&violations); }
/* Communicator `index` (in order of creation: the world is 0) reports `error` from
 * ncclCommGetAsyncError (0: none), and hangs (its calls stay ncclInProgress) while `hangs`. */
void fake_comm_control(int index, int error, int hangs) {
    if (index < 0 || index >= MAX_COMMS) return;
    pthread_mutex_lock(&G);
    async_error[index] = (hsdp_ncclResult_t)error;
    atomic_store(&hang[index], hangs);
    pthread_mutex_unlock(&G);
}
__attribute__((destructor)) static void free_comms(void) {
    for (int i = 0; i < MAX_COMMS; i++) free(comms[i]);
}

/* ---------------------------------------------------------------- the backend's view of these */
#define SAME_FN(name) _Static_assert(__builtin_types_compatible_p(__typeof__(&name), hsdp_##name##_fn), #name)
SAME_FN(cudaGetDeviceCount);
SAME_FN(cudaSetDevice);
SAME_FN(cudaMalloc);
SAME_FN(cudaFree);
SAME_FN(cudaMemcpyAsync);
SAME_FN(cudaPointerGetAttributes);
SAME_FN(cudaDeviceGetStreamPriorityRange);
SAME_FN(cudaStreamCreateWithPriority);
SAME_FN(cudaStreamDestroy);
SAME_FN(cudaStreamWaitEvent);
SAME_FN(cudaStreamSynchronize);
SAME_FN(cudaEventCreateWithFlags);
SAME_FN(cudaEventDestroy);
SAME_FN(cudaEventRecord);
SAME_FN(cudaEventQuery);
SAME_FN(cudaGetErrorString);
SAME_FN(cudaGetLastError);
SAME_FN(cudaHostAlloc);
SAME_FN(cudaFreeHost);
SAME_FN(ncclGetVersion);
SAME_FN(ncclGetUniqueId);
SAME_FN(ncclCommInitRank);
SAME_FN(ncclCommInitRankConfig);
SAME_FN(ncclCommSplit);
SAME_FN(ncclCommUserRank);
SAME_FN(ncclCommCount);
SAME_FN(ncclCommGetAsyncError);
SAME_FN(ncclCommAbort);
SAME_FN(ncclGetErrorString);
SAME_FN(ncclGetLastError);
SAME_FN(ncclAllGather);
SAME_FN(ncclBroadcast);
SAME_FN(ncclAllReduce);
SAME_FN(ncclAlltoAll);
SAME_FN(ncclSend);
SAME_FN(ncclRecv);
SAME_FN(ncclGroupStart);
SAME_FN(ncclGroupEnd);
