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
 * It behaves like NCCL as NCCL's own source says (github.com/NVIDIA/nccl, tag v2.28.9-1, the
 * NCCL torch 2.11's CUDA 13 wheels bring; the lines are cited beside the code below):
 * - A non-blocking init hands back its communicator at once (src/init.cc:2001,
 *   "*newcomm = comm") and says ncclInProgress for a few polls.
 * - A split under a non-blocking parent sets *newcomm to NULL (init.cc:2571, "*newcomm
 *   should be NCCL_COMM_NULL until comm split fully complete"), returns ncclSuccess
 *   (ncclCommSplit, init.cc:2666; the group end's ncclInProgress passes NCCLCHECK,
 *   src/include/checks.h:122), makes the child on a thread of the PARENT's group job (its
 *   mode is the parent's config.blocking, src/group.cc:56) and stores it into *newcomm when
 *   done (init.cc:1613, "assign it to user pointer"): here at the poll of the parent that
 *   reports it, the latest moment NCCL's order allows.
 * - Every group end on a non-blocking communicator says ncclInProgress and leaves a group
 *   job on it (group.cc:707, "nonblocking group"); a call on a communicator whose last one
 *   was not polled to its end is ncclInvalidArgument (ncclCommEnsureReady, init.cc:373,
 *   called by every collective, src/enqueue.cc:2637). The poll that reads it done completes
 *   the job (init.cc:2732, "if there is linked group job, we should complete it";
 *   group.cc:767 ncclGroupJobComplete): two threads doing so at once free it twice, and are
 *   counted (fake_violations()); a NULL communicator is ncclInvalidArgument.
 * - ncclCommAbort (init.cc:2503) kills the communicator: any later call on it, or one racing
 *   with the abort, is counted and fails. Its teardown frees device memory (commReclaim,
 *   init.cc:2304), and cudaFree waits for the whole device: an abort while another
 *   communicator's collective is stuck would hang, and is counted instead.
 * A world of one rank, or of several forked processes (see "worlds of ranks": collectives
 * and grouped point to point between them), on FAKE_DEVICES devices (default 2) whose memory
 * is host memory.
 *
 * Controls, by environment: FAKE_HOST_VIEW=1 makes hsdp_cuda_device_memory_is_host() say 1,
 * so the backend views its device buffers as the CPU and a CPU-only torch runs on them, and
 * makes pageable host memory device memory, so torch's CPU tensors are device tensors to the
 * backend as they are to torch (tests/nccl_torch_fake.py); FAKE_NCCL_VERSION (default 23007); FAKE_STALL=1 makes every
 * event recorded from then on never complete (a peer that never arrives); FAKE_REFUSE_PTX=1
 * makes cuModuleLoadData refuse the PTX (a driver older than the NVRTC). By the fake_*
 * functions at the end (test_nccl finds them with dlsym): holding a stream, failing the
 * next cudaMalloc calls, a communicator's asynchronous error or hang. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "wire_kernel.h"

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
static int host_view(void);
/* Device memory: the fake's cudaMalloc blocks, and under FAKE_HOST_VIEW=1 pageable host memory
 * too: there the device is the host, and a framework that views it as the CPU (a CPU-only
 * torch) makes its device tensors in pageable memory, which must then be device memory to the
 * backend as they are to the framework (on a GPU, the framework's device tensors are). */
static int is_device(const void *p) {
    block *b = find(p);
    return b ? !b->pinned : host_view();
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
/* Free device memory. The real call (CUDA Runtime API, Memory Management, cudaMemGetInfo: "Gets
 * free and total device memory ... available for allocation by the device" of the current
 * device) acts on the calling thread's current device, making a context on device 0 when the
 * thread has none: so the fake's context() runs, as in the other device calls. The figure is
 * FAKE_FREE_BYTES (default 3 GiB) of a 4 GiB device, whatever is allocated: tests check that
 * the number reaches the caller, not the fake's bookkeeping; a malformed value aborts. */
hsdp_cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
    context();
    const char *s = getenv("FAKE_FREE_BYTES");
    char *end = NULL;
    *free_bytes = s && *s ? (size_t)strtoull(s, &end, 10) : (size_t)3 << 30;
    if (s && *s && *end) {
        fprintf(stderr, "fake_cuda_nccl: FAKE_FREE_BYTES=%s is not a byte count\n", s);
        abort();
    }
    *total = (size_t)4 << 30;
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaPointerGetAttributes(hsdp_cudaPointerAttributes *a, const void *p) {
    context();
    memset(a, 0, sizeof *a);
    pthread_mutex_lock(&G);
    block *b = find(p);
    a->type = b && b->pinned ? hsdp_cudaMemoryTypeHost
              : b || host_view() ? hsdp_cudaMemoryTypeDevice /* see is_device */
                                 : hsdp_cudaMemoryTypeUnregistered;
    pthread_mutex_unlock(&G);
    return hsdp_cudaSuccess;
}

/* ---------------------------------------------------------------- streams and events */
typedef struct fake_event {
    uint64_t recorded, done; /* done: the latest record its stream has reached */
    int stalled;             /* the latest record never completes (FAKE_STALL) */
    int refs, destroyed;     /* ops pending on it; freed once destroyed and unreferenced */
} fake_event;

typedef enum { K_COPY, K_RECORD, K_WAIT, K_FN } op_kind;
typedef struct op {
    op_kind kind;
    void *dst;
    const void *src;
    size_t n;
    void *owned; /* a snapshot of a pageable source, freed once copied; K_FN: fn's argument */
    void (*fn)(void *arg); /* K_FN: work that may block (a collective with other ranks), run outside G */
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
        if (o->kind == K_FN) { /* the op stays at the head, so nothing behind it runs meanwhile */
            pthread_mutex_unlock(&G);
            o->fn(o->owned);
            pthread_mutex_lock(&G);
        }
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
    /* Until a whole pass finds nothing runnable: a stream passed over while it waited for an
     * event may become runnable when a later stream records that event, and its work would
     * then run after this returned (cudaFree's memory written after the free). */
    for (;;) {
        int busy = 0;
        for (fake_stream *s = streams; s && !busy; s = s->next) busy = runnable(s, s->head);
        if (!busy) return;
        pthread_cond_wait(&C, &G);
    }
}
static fake_stream *stream_of(hsdp_cudaStream_t h) { /* G held */
    if (h) return (fake_stream *)h;
    if (!legacy) legacy = stream_new();
    return legacy;
}
/* Whether h names a stream that exists (G held): work on a destroyed one is refused with
 * cudaErrorInvalidResourceHandle (on CUDA it is undefined) and counted (fake_dead_streams). */
static atomic_int dead_stream_uses;
static int live_stream(hsdp_cudaStream_t h) {
    if (!h) return 1;
    for (fake_stream *s = streams; s; s = s->next)
        if (s == (fake_stream *)h) return 1;
    atomic_fetch_add(&dead_stream_uses, 1);
    return 0;
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
    if (!live_stream(s)) {
        pthread_mutex_unlock(&G);
        free(o);
        return err(400); /* cudaErrorInvalidResourceHandle */
    }
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
    if (!live_stream(s)) {
        pthread_mutex_unlock(&G);
        free(o);
        return err(400); /* cudaErrorInvalidResourceHandle */
    }
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

/* The backend's question (backend_nccl.c, hsdp_nccl_load): is device memory host memory the
 * host reads? Always so here; said only under FAKE_HOST_VIEW=1, so the other tests see a GPU
 * (and only then is pageable host memory device memory too: is_device). */
static int host_view(void) {
    const char *s = getenv("FAKE_HOST_VIEW");
    return s && strcmp(s, "1") == 0;
}
int hsdp_cuda_device_memory_is_host(void) { return host_view(); }

/* ---------------------------------------------------------------- worlds of ranks
 * A world of one needs nothing shared. A world of several: ranks are processes forked from
 * the one that made the unique id, which maps (MAP_SHARED) a region they all inherit and
 * names its address in the id. Each communicator is a channel there; a collective on a
 * stream is an op its worker runs outside G: it puts this rank's contribution in its slot,
 * waits for every rank's (a peer that never arrives keeps it waiting, so the events behind
 * it never complete), computes its result, and waits for every rank to have read before the
 * slots are reused. An abort of the communicator releases it. */
/* 512 MiB of address space (MAP_NORESERVE), touched only as used: a torch model's shards fit */
enum { MAX_RANKS = 8, MAX_CHANNELS = 64, SLOT_BYTES = 1 << 20 };
typedef struct {
    pthread_mutex_t mu; /* process-shared */
    pthread_cond_t cv;
    uint64_t arrived[MAX_CHANNELS][MAX_RANKS], left[MAX_CHANNELS][MAX_RANKS];
    int nchannels;                   /* channels given to communicators so far (the world's: 0) */
    int split_base[MAX_CHANNELS];    /* a split of the channel's communicator: its first new channel */
    /* point to point, [channel][from][to]: messages posted and taken so far, the latest's place */
    uint64_t p2p_posted[MAX_CHANNELS][MAX_RANKS][MAX_RANKS], p2p_taken[MAX_CHANNELS][MAX_RANKS][MAX_RANKS];
    size_t p2p_off[MAX_CHANNELS][MAX_RANKS][MAX_RANKS], p2p_len[MAX_CHANNELS][MAX_RANKS][MAX_RANKS];
    unsigned char slot[MAX_CHANNELS][MAX_RANKS][SLOT_BYTES];
} shared_world;

enum { MAX_COMMS = 64 };
/* What a non-blocking communicator has in flight: NCCL's "group job" (group.cc,
 * ncclGroupEndInternal: for a non-blocking communicator every group end starts a thread,
 * sets the communicator's asyncResult to ncclInProgress and returns ncclInProgress; the job
 * is joined by the ncclCommGetAsyncError that first sees it done, init.cc
 * ncclCommGetAsyncError: "if there is linked group job, we should complete it"). */
typedef enum { JOB_NONE, JOB_POLLS, JOB_SPLIT } job_kind;
struct fake_comm;
typedef struct {
    job_kind kind;
    int polls_left;               /* JOB_POLLS: ncclInProgress for this many more polls */
    pthread_t thread;             /* JOB_SPLIT: the child's init, as NCCL runs it (its own thread) */
    atomic_int done;              /* JOB_SPLIT: the thread has ended */
    hsdp_ncclResult_t result;     /* JOB_SPLIT: how it ended */
    struct fake_comm *child;      /* JOB_SPLIT: the new communicator, once made */
    hsdp_ncclComm_t *out;         /* JOB_SPLIT: where the caller asked for it */
    int color, key, child_blocking;
} fake_job;
typedef struct fake_comm {
    int rank, size, index;
    shared_world *world; /* NULL in a world of one */
    int channel;         /* its part of the shared world */
    int blocking;        /* its config's: a blocking one completes every call before returning */
    uint64_t seq;        /* collectives enqueued on it (under G) */
    fake_job job;        /* under G */
    atomic_int dead;       /* aborted: any use from now on is counted */
    atomic_int in_call;    /* threads inside a call on it (an abort then races with them) */
    atomic_int polling;    /* threads inside ncclCommGetAsyncError on it */
    atomic_int running;    /* its collectives a stream is running now (abort's device sync waits for them) */
    const void *sent;      /* the grouped send to self, matched by the next receive */
    size_t sent_n;
    uint64_t p2p_sent[MAX_RANKS], p2p_received[MAX_RANKS]; /* messages to and from each peer (under G) */
} fake_comm;
static fake_comm *comms[MAX_COMMS]; /* every communicator made, by index; freed at unload */
static atomic_int ncomms, violations, join_hold_us;
static hsdp_ncclResult_t async_error[MAX_COMMS];
static atomic_int hang[MAX_COMMS];

/* A violation of NCCL's rules by the caller: counted for the test, and said on stderr. */
static void violation(const char *what, const fake_comm *c) {
    atomic_fetch_add(&violations, 1);
    fprintf(stderr, "fake_cuda_nccl: VIOLATION: %s (communicator #%d)\n", what, c ? c->index : -1);
}

/* Every call on a communicator: a dead one, or one being aborted, is a violation. */
static fake_comm *enter(hsdp_ncclComm_t h);
/* A call that needs the communicator ready (init.cc ncclCommEnsureReady, called by every
 * collective, enqueue.cc ncclEnqueueCheck, by ncclCommSplit, ncclCommCount and
 * ncclCommUserRank): one whose last non-blocking call has not been polled to its end
 * (ncclCommGetAsyncError still said ncclInProgress) gets ncclInvalidArgument ("Attempt to use
 * communicator before the previous operation returned ncclSuccess"); a violation here. */
static fake_comm *enter_ready(hsdp_ncclComm_t h) {
    fake_comm *c = enter(h);
    if (!c) return NULL;
    pthread_mutex_lock(&G);
    int ready = c->job.kind == JOB_NONE;
    pthread_mutex_unlock(&G);
    if (!ready) {
        violation("a call on a communicator whose last non-blocking call was not polled to its end", c);
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
        violation("a call on an aborted communicator", c);
        atomic_fetch_sub(&c->in_call, 1);
        return NULL;
    }
    return c;
}
static void leave(fake_comm *c) {
    if (c) atomic_fetch_sub(&c->in_call, 1);
}
/* The end of a non-blocking call (G held): the communicator is busy until polled. */
static hsdp_ncclResult_t in_progress(fake_comm *c, int polls) {
    if (c->blocking) return hsdp_ncclSuccess;
    c->job = (fake_job){.kind = JOB_POLLS, .polls_left = polls};
    return hsdp_ncclInProgress;
}

hsdp_ncclResult_t ncclGetVersion(int *v) {
    const char *s = getenv("FAKE_NCCL_VERSION");
    *v = s ? atoi(s) : 23007;
    return hsdp_ncclSuccess;
}
enum { ID_WORLD_AT = 16 }; /* where the id carries the shared world's address */
hsdp_ncclResult_t ncclGetUniqueId(hsdp_ncclUniqueId *id) {
    for (size_t i = 0; i < sizeof id->internal; i++) id->internal[i] = (char)(i * 7 + 1);
    /* the region forked ranks share; mapped for the life of the process */
    shared_world *w = mmap(NULL, sizeof *w, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (w == MAP_FAILED) return hsdp_ncclSystemError;
    w->nchannels = 1;
    pthread_mutexattr_t ma;
    pthread_condattr_t ca;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&w->mu, &ma);
    pthread_cond_init(&w->cv, &ca);
    memcpy(id->internal + ID_WORLD_AT, &w, sizeof w);
    return hsdp_ncclSuccess;
}
/* A communicator of n ranks (NULL: past the fake's limits). */
static fake_comm *make_comm(int n, int rank, int blocking, shared_world *world, int channel) {
    if (n < 1 || n > MAX_RANKS || rank < 0 || rank >= n || (n > 1 && !world) || channel >= MAX_CHANNELS) return NULL;
    int index = atomic_fetch_add(&ncomms, 1);
    if (index >= MAX_COMMS) return NULL;
    fake_comm *c = calloc(1, sizeof *c); /* owned by comms[], freed at unload (free_comms) */
    if (!c) return NULL;
    c->size = n;
    c->rank = rank;
    c->world = n > 1 ? world : NULL;
    c->channel = channel;
    c->index = index;
    c->blocking = blocking;
    comms[index] = c;
    return c;
}
static int config_ok(const hsdp_ncclConfig_t *cfg) { /* what NCCL checks first */
    return cfg && cfg->magic == HSDP_NCCL_API_MAGIC && cfg->version >= 21400;
}
/* A config's blocking, as NCCL reads it: NCCL_COMM_BLOCKING overrides (init.cc envConfigOverride). */
static int blocking_of(const hsdp_ncclConfig_t *cfg) {
    const char *env = getenv("NCCL_COMM_BLOCKING");
    if (env && *env) return atoi(env) != 0;
    return cfg->blocking == HSDP_NCCL_CONFIG_UNDEF_INT ? 1 : cfg->blocking != 0;
}
static shared_world *world_of(const hsdp_ncclUniqueId *id) {
    shared_world *w;
    memcpy(&w, id->internal + ID_WORLD_AT, sizeof w);
    return w;
}
/* Init sets *newcomm at once (init.cc ncclCommInitRankDev: "*newcomm = comm" before the job
 * is launched), so a non-blocking one is polled on the communicator it returned. */
static hsdp_ncclResult_t init_comm(hsdp_ncclComm_t *out, int n, hsdp_ncclUniqueId id, int rank, int blocking) {
    if (!out) return hsdp_ncclInvalidArgument;
    *out = NULL;
    if (n < 1 || n > MAX_RANKS || rank < 0 || rank >= n) return hsdp_ncclInvalidArgument;
    fake_comm *c = make_comm(n, rank, blocking, world_of(&id), 0);
    if (!c) return hsdp_ncclSystemError;
    *out = (hsdp_ncclComm_t)c;
    pthread_mutex_lock(&G);
    hsdp_ncclResult_t rc = in_progress(c, 3);
    pthread_mutex_unlock(&G);
    return rc;
}
hsdp_ncclResult_t ncclCommInitRank(hsdp_ncclComm_t *c, int n, hsdp_ncclUniqueId id, int rank) {
    context();
    return init_comm(c, n, id, rank, 1);
}
hsdp_ncclResult_t ncclCommInitRankConfig(hsdp_ncclComm_t *c, int n, hsdp_ncclUniqueId id, int rank,
                                         hsdp_ncclConfig_t *cfg) {
    context();
    if (!config_ok(cfg)) return hsdp_ncclInvalidArgument;
    return init_comm(c, n, id, rank, blocking_of(cfg));
}
static int all_reached(shared_world *w, uint64_t of[MAX_RANKS], fake_comm *c, uint64_t seq);
/* A split of a world of several ranks, on the host: every rank's (color, key) is exchanged
 * over the parent's channel (as a collective, in its sequence), the parent's rank 0 gives each
 * color a channel of its own, and each rank learns its place. Ranks of a color are ordered by
 * key, then by parent rank, as NCCL orders them. The backend splits with no collective of the
 * parent in flight (it waits for its collectives on the host before a split). */
static hsdp_ncclResult_t split_shared(fake_comm *c, int color, int key, int *rank, int *size, int *channel) {
    shared_world *w = c->world;
    int ch = c->channel, me = c->rank, n = c->size;
    pthread_mutex_lock(&G);
    uint64_t seq = ++c->seq;
    pthread_mutex_unlock(&G);
    int mine[2] = {color, key}, all[MAX_RANKS][2];
    pthread_mutex_lock(&w->mu);
    memcpy(w->slot[ch][me], mine, sizeof mine);
    w->arrived[ch][me] = seq;
    pthread_cond_broadcast(&w->cv);
    int ok = all_reached(w, w->arrived[ch], c, seq);
    if (ok) {
        for (int r = 0; r < n; r++) memcpy(all[r], w->slot[ch][r], sizeof all[r]);
        if (me == 0) { /* before its read is published: the others read the base after */
            int colors = 0;
            for (int r = 0; r < n; r++) {
                int first = all[r][0] >= 0;
                for (int q = 0; q < r && first; q++) first = all[q][0] != all[r][0];
                colors += first;
            }
            w->split_base[ch] = w->nchannels;
            w->nchannels += colors;
        }
        w->left[ch][me] = seq;
        pthread_cond_broadcast(&w->cv);
        ok = all_reached(w, w->left[ch], c, seq);
    }
    int base = w->split_base[ch];
    pthread_mutex_unlock(&w->mu);
    if (!ok) return hsdp_ncclSystemError; /* aborted while waiting for a peer */
    int index = 0; /* the color's channel: colors numbered by their first rank */
    for (int r = 0; r < n; r++) {
        int first = all[r][0] >= 0;
        for (int q = 0; q < r && first; q++) first = all[q][0] != all[r][0];
        if (all[r][0] == color) break;
        index += first;
    }
    *rank = *size = 0;
    for (int r = 0; r < n; r++) {
        if (all[r][0] != color) continue;
        ++*size;
        if (all[r][1] < key || (all[r][1] == key && r < me)) ++*rank;
    }
    *channel = base + index;
    return *channel < MAX_CHANNELS ? hsdp_ncclSuccess : hsdp_ncclSystemError; /* the fake's limit */
}
/* A split's child init, on a thread of its own as NCCL runs it (init.cc ncclCommInitChildComm
 * queues ncclCommInitRankFunc as an async job of the parent; group.cc ncclGroupEndInternal
 * starts its thread when the parent is non-blocking): the (color, key) exchange over the parent,
 * then the child. */
static void *split_job(void *arg) {
    fake_comm *c = arg;
    pthread_mutex_lock(&G);
    int color = c->job.color, key = c->job.key, blocking = c->job.child_blocking;
    pthread_mutex_unlock(&G);
    int rank = 0, size = 1, channel = 0;
    hsdp_ncclResult_t rc = c->world ? split_shared(c, color, key, &rank, &size, &channel) : hsdp_ncclSuccess;
    fake_comm *child = NULL;
    if (rc == hsdp_ncclSuccess && color >= 0 && !(child = make_comm(size, rank, blocking, c->world, channel)))
        rc = hsdp_ncclSystemError;
    pthread_mutex_lock(&G);
    c->job.child = child;
    c->job.result = rc;
    atomic_store(&c->job.done, 1);
    pthread_cond_broadcast(&C);
    pthread_mutex_unlock(&G);
    return NULL;
}
/* Ranks with the same color form a communicator, ordered by key (a channel of their own in a
 * shared world); color < 0 (NCCL_SPLIT_NOCOLOR) takes part and gets none. As NCCL does it
 * (init.cc ncclCommSplit -> ncclCommInitChildComm):
 * - the parent must be ready (ncclCommEnsureReady), and *newcomm is set to NULL at once
 *   ("*newcomm should be NCCL_COMM_NULL until comm split fully complete");
 * - the child is made by an async job of the PARENT, so the group's mode is the parent's
 *   config.blocking (group.cc ncclAsyncLaunch: "ncclGroupBlocking = comm->config.blocking");
 * - under a non-blocking parent the call returns ncclSuccess (the group end's ncclInProgress
 *   passes NCCLCHECK, checks.h, and ncclCommSplit returns its own res), the parent's
 *   asyncResult is ncclInProgress until the job ends, and the job's thread stores the child
 *   into *newcomm when it is done (init.cc ncclCommInitRankFunc, exit: "assign it to user
 *   pointer", COMPILER_ATOMIC_STORE(job->newcomm, comm)), which is before the parent's
 *   asyncResult leaves ncclInProgress (group.cc groupLaunch -> ncclCommSetAsyncError(job->comm)).
 *   The fake stores it at the latest moment that order allows: the poll of the parent that
 *   says the split is done. A caller that polls the NULL it was given, or reads *newcomm
 *   before polling the parent to its end, fails as it would on NCCL; one that let *newcomm go
 *   out of scope would have it written after its end there. */
hsdp_ncclResult_t ncclCommSplit(hsdp_ncclComm_t h, int color, int key, hsdp_ncclComm_t *out, hsdp_ncclConfig_t *cfg) {
    context();
    fake_comm *c = enter(h); /* CommCheck */
    if (!c) return hsdp_ncclInvalidArgument;
    if (!out || !config_ok(cfg)) { /* PtrCheck, parseCommConfig */
        leave(c);
        return hsdp_ncclInvalidArgument;
    }
    leave(c);
    if (!(c = enter_ready(h))) return hsdp_ncclInvalidArgument; /* ncclCommEnsureReady */
    *out = NULL;
    pthread_mutex_lock(&G);
    c->job = (fake_job){.kind = JOB_SPLIT, .out = out, .color = color, .key = key, .child_blocking = blocking_of(cfg)};
    int rc = pthread_create(&c->job.thread, NULL, split_job, c);
    if (rc != 0) c->job.kind = JOB_NONE;
    pthread_mutex_unlock(&G);
    hsdp_ncclResult_t res = rc == 0 ? hsdp_ncclSuccess : hsdp_ncclSystemError;
    if (rc == 0 && c->blocking) { /* a blocking group: done before returning */
        pthread_mutex_lock(&G);
        while (!atomic_load(&c->job.done)) pthread_cond_wait(&C, &G);
        pthread_join(c->job.thread, NULL);
        *out = (hsdp_ncclComm_t)c->job.child;
        res = c->job.result;
        c->job.kind = JOB_NONE;
        pthread_mutex_unlock(&G);
    }
    leave(c);
    return res;
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
/* init.cc ncclCommGetAsyncError: CommCheck (a NULL communicator is ncclInvalidArgument, *e
 * untouched), then the communicator's asyncResult; and "if there is linked group job, we
 * should complete it": when it reads ncclSuccess with a group job linked, it joins the job's
 * thread and drops the communicator's reference to it (group.cc ncclGroupJobComplete:
 * the join is guarded by an atomic exchange, the reference count and `comm->groupJob = NULL`
 * are not), so two threads polling one communicator as its job ends both drop the reference:
 * the job is freed twice. That is counted as a violation; join_hold_us (fake_join_hold)
 * widens the window as a thread that takes a while to end would. */
hsdp_ncclResult_t ncclCommGetAsyncError(hsdp_ncclComm_t h, hsdp_ncclResult_t *e) {
    fake_comm *c = enter(h);
    if (!c) return hsdp_ncclInvalidArgument;
    if (!e) {
        leave(c);
        return hsdp_ncclInvalidArgument;
    }
    int others = atomic_fetch_add(&c->polling, 1);
    pthread_mutex_lock(&G);
    fake_job *j = &c->job;
    int pending = j->kind != JOB_NONE, hangs = atomic_load(&hang[c->index]), complete = 0;
    hsdp_ncclResult_t state = hsdp_ncclSuccess;
    if (j->kind == JOB_POLLS && (hangs || j->polls_left > 0)) {
        if (!hangs) j->polls_left--;
        state = hsdp_ncclInProgress;
    } else if (j->kind == JOB_SPLIT && !atomic_load(&j->done)) {
        state = hsdp_ncclInProgress;
    } else {
        complete = pending;
    }
    pthread_mutex_unlock(&G);
    if (others > 0 && pending)
        violation("ncclCommGetAsyncError from two threads at once on a communicator with a group job: NCCL "
                  "completes the job in both (init.cc ncclCommGetAsyncError -> group.cc ncclGroupJobComplete)", c);
    if (complete) {
        int hold = atomic_load(&join_hold_us);
        if (hold > 0) usleep((useconds_t)hold);
        pthread_mutex_lock(&G);
        if (j->kind == JOB_SPLIT) {
            pthread_join(j->thread, NULL);
            if (j->child) __atomic_store_n(j->out, (hsdp_ncclComm_t)j->child, __ATOMIC_RELEASE);
            state = j->result;
        }
        j->kind = JOB_NONE;
        pthread_mutex_unlock(&G);
    }
    if (state == hsdp_ncclSuccess && async_error[c->index]) state = async_error[c->index];
    if (state == hsdp_ncclSuccess && hangs) state = hsdp_ncclInProgress;
    *e = state;
    atomic_fetch_sub(&c->polling, 1);
    leave(c);
    return hsdp_ncclSuccess;
}
/* ncclCommAbort frees the communicator's device memory (init.cc commReclaim -> commFree), and
 * cudaFree synchronizes the device: the abort waits for every kernel still running, those of
 * other communicators too. One stuck in a collective that a peer never joins, of a
 * communicator not aborted yet, makes the abort hang (NVIDIA/nccl issue #829, PR #564). The
 * fake waits FAKE_ABORT_SYNC_MS (default 3000) for them, then counts a violation instead of
 * hanging. */
static void device_sync_for_abort(const fake_comm *c) {
    const char *s = getenv("FAKE_ABORT_SYNC_MS");
    int limit_ms = s ? atoi(s) : 3000;
    for (int waited = 0;; waited++) {
        const fake_comm *stuck = NULL;
        for (int i = 0; i < atomic_load(&ncomms) && i < MAX_COMMS && !stuck; i++)
            if (comms[i] && comms[i] != c && !atomic_load(&comms[i]->dead) && atomic_load(&comms[i]->running))
                stuck = comms[i];
        if (!stuck) return;
        if (waited >= limit_ms) {
            violation("ncclCommAbort would hang: its cudaFree synchronizes the device behind a collective of a "
                      "communicator not aborted yet, which waits for a peer", stuck);
            return;
        }
        usleep(1000);
    }
}
hsdp_ncclResult_t ncclCommAbort(hsdp_ncclComm_t h) {
    if (!h) return hsdp_ncclSuccess; /* init.cc ncclCommAbort: a NULL communicator is ncclSuccess */
    fake_comm *c = enter(h);
    if (!c) return hsdp_ncclInvalidArgument;
    /* another thread inside a call on it: NCCL would free the communicator under it */
    if (atomic_load(&c->in_call) > 1) violation("ncclCommAbort racing with another call on the communicator", c);
    atomic_store(&c->dead, 1);
    /* the abort joins a job still running (ncclCommEnsureReady -> ncclGroupJobAbort); a split's
     * exchange ends once the parent is dead, and its child is never handed out */
    pthread_mutex_lock(&G);
    if (c->job.kind == JOB_SPLIT) {
        pthread_mutex_unlock(&G);
        pthread_join(c->job.thread, NULL);
        pthread_mutex_lock(&G);
        if (c->job.child) atomic_store(&c->job.child->dead, 1);
    }
    c->job.kind = JOB_NONE;
    pthread_mutex_unlock(&G);
    device_sync_for_abort(c);
    leave(c);
    return hsdp_ncclSuccess;
}
const char *ncclGetErrorString(hsdp_ncclResult_t r) { return r == hsdp_ncclSuccess ? "no error" : "fake NCCL error"; }
const char *ncclGetLastError(hsdp_ncclComm_t c) {
    (void)c;
    return "";
}

static size_t nbytes(size_t count, hsdp_ncclDataType_t t) { return count * (t == hsdp_ncclFloat32 ? 4 : 1); }

/* Groups (group.cc): the calls between ncclGroupStart and ncclGroupEnd are one group, a call
 * outside them a group of its own. At a group's end every non-blocking communicator in it is
 * busy (its asyncResult ncclInProgress) until polled, and the end says ncclInProgress
 * (ncclGroupEndInternal: "nonblocking group" starts a thread and returns ncclInProgress). */
enum { MAX_GROUP_COMMS = 8 };
static _Thread_local int group_depth;
static _Thread_local fake_comm *group_comms[MAX_GROUP_COMMS];
static _Thread_local int group_ncomms;
static hsdp_ncclResult_t group_close(void);
static hsdp_ncclResult_t group_call(fake_comm *c) {
    int known = 0;
    for (int i = 0; i < group_ncomms; i++) known |= group_comms[i] == c;
    if (!known && group_ncomms < MAX_GROUP_COMMS) group_comms[group_ncomms++] = c;
    return group_depth > 0 ? hsdp_ncclSuccess : group_close();
}

typedef enum { C_GATHER, C_BCAST, C_SUM, C_ALLTOALL } coll_kind;
typedef struct {
    fake_comm *c;
    coll_kind kind;
    const void *send;
    void *recv;
    size_t n; /* bytes per rank (all-to-all: per peer) */
    int root;
    uint64_t seq;
} coll;

/* Waits under w->mu until *counter reaches seq; 0 if the communicator was aborted meanwhile
 * (an abort releases what waits for peers that never come). */
static int reached(shared_world *w, const uint64_t *counter, fake_comm *c, uint64_t seq) {
    for (;;) {
        if (*counter >= seq) return 1;
        if (atomic_load(&c->dead)) return 0;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 5 * 1000 * 1000;
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&w->cv, &w->mu, &until);
    }
}
/* The same until every rank's counter in `of` reaches seq (counters only grow). */
static int all_reached(shared_world *w, uint64_t of[MAX_RANKS], fake_comm *c, uint64_t seq) {
    for (int r = 0; r < c->size; r++)
        if (!reached(w, &of[r], c, seq)) return 0;
    return 1;
}

static void run_coll(void *arg) { /* on the stream's worker, outside G */
    coll *k = arg;
    fake_comm *c = k->c;
    shared_world *w = c->world;
    int ch = c->channel, me = c->rank, n = c->size;
    size_t in = k->kind == C_ALLTOALL ? k->n * (size_t)n : k->n;
    atomic_fetch_add(&c->running, 1);
    pthread_mutex_lock(&w->mu);
    if (k->send && (k->kind != C_BCAST || me == k->root)) memcpy(w->slot[ch][me], k->send, in);
    w->arrived[ch][me] = k->seq;
    pthread_cond_broadcast(&w->cv);
    if (all_reached(w, w->arrived[ch], c, k->seq)) {
        for (int r = 0; r < n; r++) {
            if (k->kind == C_GATHER) memcpy((char *)k->recv + (size_t)r * k->n, w->slot[ch][r], k->n);
            if (k->kind == C_ALLTOALL)
                memcpy((char *)k->recv + (size_t)r * k->n, w->slot[ch][r] + (size_t)me * k->n, k->n);
        }
        if (k->kind == C_BCAST) memcpy(k->recv, w->slot[ch][k->root], k->n);
        if (k->kind == C_SUM) {
            float sum = 0, v;
            for (int r = 0; r < n; r++) memcpy(&v, w->slot[ch][r], sizeof v), sum += v;
            memcpy(k->recv, &sum, sizeof sum);
        }
        w->left[ch][me] = k->seq; /* read: the slots may be reused once every rank has */
        pthread_cond_broadcast(&w->cv);
        (void)all_reached(w, w->left[ch], c, k->seq);
    }
    pthread_mutex_unlock(&w->mu); /* k is the op's, freed with it */
    atomic_fetch_sub(&c->running, 1);
}

/* Enqueues a collective of a world of several ranks on stream st. */
static hsdp_ncclResult_t enqueue_coll(fake_comm *c, coll_kind kind, const void *s, void *r, size_t n, int root,
                                      hsdp_cudaStream_t st) {
    if ((kind == C_ALLTOALL ? n * (size_t)c->size : n) > SLOT_BYTES) return hsdp_ncclInvalidUsage; /* the fake's limit */
    coll *k = malloc(sizeof *k);
    op *o = calloc(1, sizeof *o);
    if (!k || !o) {
        free(k);
        free(o);
        return hsdp_ncclSystemError;
    }
    pthread_mutex_lock(&G);
    *k = (coll){.c = c, .kind = kind, .send = s, .recv = r, .n = n, .root = root, .seq = ++c->seq};
    *o = (op){.kind = K_FN, .fn = run_coll, .owned = k};
    push(st, o);
    pthread_mutex_unlock(&G);
    return hsdp_ncclSuccess;
}
/* A collective: NCCL reads and writes device memory only; the copy runs on the stream. A
 * hanging communicator takes the call but reports ncclInProgress (a non-blocking one). */
static hsdp_ncclResult_t collective(hsdp_ncclComm_t h, coll_kind kind, const void *s, void *r, size_t n, int root,
                                    hsdp_cudaStream_t st) {
    context();
    fake_comm *c = enter_ready(h);
    if (!c) return hsdp_ncclInvalidArgument;
    pthread_mutex_lock(&G);
    int ok = (!s || is_device(s)) && (!r || is_device(r));
    pthread_mutex_unlock(&G);
    hsdp_ncclResult_t rc = hsdp_ncclSuccess;
    if (!ok)
        rc = hsdp_ncclInvalidUsage;
    else if (c->world)
        rc = enqueue_coll(c, kind, s, r, n, root, st);
    else if (s && r && s != r && copy_on(st, r, s, n) != hsdp_cudaSuccess) /* a world of one: a copy */
        rc = hsdp_ncclSystemError;
    if (rc == hsdp_ncclSuccess) rc = group_call(c);
    leave(c);
    return rc;
}
hsdp_ncclResult_t ncclAllGather(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclComm_t c,
                                hsdp_cudaStream_t st) {
    return collective(c, C_GATHER, s, r, nbytes(count, t), 0, st);
}
hsdp_ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, int root,
                                hsdp_ncclComm_t c, hsdp_cudaStream_t st) {
    return collective(c, C_BCAST, s, r, nbytes(count, t), root, st);
}
hsdp_ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclRedOp_t op,
                                hsdp_ncclComm_t c, hsdp_cudaStream_t st) {
    (void)op; /* the barrier's: a float sum */
    return collective(c, C_SUM, s, r, nbytes(count, t), 0, st);
}
hsdp_ncclResult_t ncclAlltoAll(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclComm_t c,
                               hsdp_cudaStream_t st) {
    return collective(c, C_ALLTOALL, s, r, nbytes(count, t), 0, st);
}
/* Point to point. A world of one: a grouped send to this rank, matched by the next receive (a
 * copy on the stream). A world of several: the sends and receives between ncclGroupStart and
 * ncclGroupEnd (or a lone call outside a group) are one op on the stream, run by its worker
 * outside G: it posts each send in this rank's slot, for its peer (one send to a peer per
 * group, the group's bytes within the slot, all on one communicator and stream: the fake's
 * limits), takes each receive once its peer has posted the matching send (the n-th send from
 * a rank to another matches that one's n-th receive from it), and returns once every peer has
 * taken what it was sent, so the slot is free for what follows (on the same stream: a rank's
 * point to point on one communicator goes on one stream, as the backend's does). A receive whose size is not
 * the send's is a violation (NCCL does not check; the bytes would be wrong). */
enum { MAX_P2P = 2 * MAX_RANKS };
typedef struct {
    int send, peer;
    void *buf; /* a send's source, or a receive's destination */
    size_t n;
    uint64_t seq; /* the n-th message between this rank and peer, in its direction */
} p2p_item;
typedef struct {
    fake_comm *c;
    hsdp_cudaStream_t st;
    int n;
    size_t sent; /* bytes of the sends: their place in the slot */
    p2p_item item[MAX_P2P];
} p2p_group;
static _Thread_local p2p_group *pending; /* this thread's open group (heap; the op's once enqueued) */
static _Thread_local int group_failed;   /* a call of the open group failed: its end fails */

static void run_p2p(void *arg) { /* on the stream's worker, outside G */
    p2p_group *g = arg;
    fake_comm *c = g->c;
    shared_world *w = c->world;
    int ch = c->channel, me = c->rank, ok = 1;
    atomic_fetch_add(&c->running, 1);
    pthread_mutex_lock(&w->mu);
    size_t off = 0;
    for (int i = 0; i < g->n; i++) {
        p2p_item *it = &g->item[i];
        if (!it->send) continue;
        memcpy(w->slot[ch][me] + off, it->buf, it->n);
        w->p2p_off[ch][me][it->peer] = off;
        w->p2p_len[ch][me][it->peer] = it->n;
        w->p2p_posted[ch][me][it->peer] = it->seq;
        off += it->n;
    }
    pthread_cond_broadcast(&w->cv);
    for (int i = 0; i < g->n && ok; i++) {
        p2p_item *it = &g->item[i];
        if (it->send) continue;
        ok = reached(w, &w->p2p_posted[ch][it->peer][me], c, it->seq);
        if (!ok) break;
        size_t len = w->p2p_len[ch][it->peer][me];
        if (len != it->n) atomic_fetch_add(&violations, 1);
        memcpy(it->buf, w->slot[ch][it->peer] + w->p2p_off[ch][it->peer][me], len < it->n ? len : it->n);
        w->p2p_taken[ch][it->peer][me] = it->seq;
        pthread_cond_broadcast(&w->cv);
    }
    for (int i = 0; i < g->n && ok; i++) /* the slot is free once every peer has taken its send */
        if (g->item[i].send) ok = reached(w, &w->p2p_taken[ch][me][g->item[i].peer], c, g->item[i].seq);
    pthread_mutex_unlock(&w->mu); /* g is the op's, freed with it */
    atomic_fetch_sub(&c->running, 1);
}
/* Enqueues the open group on its stream (a world of several); it is the op's from now on. */
static hsdp_ncclResult_t p2p_flush(void) {
    p2p_group *g = pending;
    pending = NULL;
    int failed = group_failed;
    group_failed = 0;
    if (!g) return failed ? hsdp_ncclInvalidUsage : hsdp_ncclSuccess;
    op *o = failed ? NULL : calloc(1, sizeof *o);
    if (!o) {
        free(g);
        return failed ? hsdp_ncclInvalidUsage : hsdp_ncclSystemError;
    }
    pthread_mutex_lock(&G);
    for (int i = 0; i < g->n; i++) { /* numbered in the order the ops reach the stream */
        p2p_item *it = &g->item[i];
        it->seq = ++(it->send ? g->c->p2p_sent : g->c->p2p_received)[it->peer];
    }
    *o = (op){.kind = K_FN, .fn = run_p2p, .owned = g};
    push(g->st, o);
    pthread_mutex_unlock(&G);
    return hsdp_ncclSuccess;
}
/* A send (send = 1) or receive of n bytes with peer, added to this thread's group. */
static hsdp_ncclResult_t p2p_add(fake_comm *c, int send, void *buf, size_t n, int peer, hsdp_cudaStream_t st) {
    if (!pending && !(pending = calloc(1, sizeof *pending))) return hsdp_ncclSystemError;
    p2p_group *g = pending;
    if (!g->c) g->c = c, g->st = st;
    int ok = g->c == c && g->st == st && g->n < MAX_P2P && (!send || g->sent + n <= SLOT_BYTES);
    for (int i = 0; i < g->n && ok; i++) ok = g->item[i].send != send || g->item[i].peer != peer;
    if (!ok) return hsdp_ncclInvalidUsage;
    g->item[g->n++] = (p2p_item){.send = send, .peer = peer, .buf = buf, .n = n};
    if (send) g->sent += n;
    return hsdp_ncclSuccess;
}
static hsdp_ncclResult_t p2p(int send, void *buf, size_t count, hsdp_ncclDataType_t t, int peer, hsdp_ncclComm_t h,
                             hsdp_cudaStream_t st) {
    context();
    fake_comm *c = enter_ready(h);
    if (!c) return hsdp_ncclInvalidArgument;
    size_t n = nbytes(count, t);
    pthread_mutex_lock(&G);
    int ok = peer >= 0 && peer < c->size && (!n || is_device(buf));
    pthread_mutex_unlock(&G);
    hsdp_ncclResult_t rc = ok ? hsdp_ncclSuccess : hsdp_ncclInvalidUsage;
    if (rc == hsdp_ncclSuccess && !c->world) { /* a world of one: to and from this rank */
        if (send) {
            c->sent = buf;
            c->sent_n = n;
        } else {
            rc = c->sent && c->sent_n == n && copy_on(st, buf, c->sent, n) == hsdp_cudaSuccess ? hsdp_ncclSuccess
                                                                                               : hsdp_ncclInvalidUsage;
            c->sent = NULL;
        }
    } else if (rc == hsdp_ncclSuccess) {
        rc = p2p_add(c, send, buf, n, peer, st);
        if (rc != hsdp_ncclSuccess) group_failed = 1;
    }
    if (rc == hsdp_ncclSuccess)
        rc = group_call(c); /* outside a group: a group of its own, ended here */
    else if (group_depth == 0)
        (void)p2p_flush(); /* a failed call of its own: nothing of it is enqueued */
    leave(c);
    return rc;
}
hsdp_ncclResult_t ncclSend(const void *s, size_t count, hsdp_ncclDataType_t t, int peer, hsdp_ncclComm_t h,
                           hsdp_cudaStream_t st) {
    return p2p(1, (void *)s, count, t, peer, h, st);
}
hsdp_ncclResult_t ncclRecv(void *r, size_t count, hsdp_ncclDataType_t t, int peer, hsdp_ncclComm_t h,
                           hsdp_cudaStream_t st) {
    return p2p(0, r, count, t, peer, h, st);
}
hsdp_ncclResult_t ncclGroupStart(void) {
    group_depth++;
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclGroupEnd(void) {
    if (group_depth == 0) return hsdp_ncclInvalidUsage;
    return --group_depth == 0 ? group_close() : hsdp_ncclSuccess;
}
static hsdp_ncclResult_t group_close(void) {
    hsdp_ncclResult_t rc = p2p_flush();
    pthread_mutex_lock(&G);
    for (int i = 0; rc == hsdp_ncclSuccess && i < group_ncomms; i++)
        if (in_progress(group_comms[i], 1) == hsdp_ncclInProgress) rc = hsdp_ncclInProgress;
    group_ncomms = 0;
    pthread_mutex_unlock(&G);
    return rc;
}

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
/* Work given to a stream already destroyed (refused). */
int fake_dead_streams(void) { return atomic_load(&dead_stream_uses); }
/* The devices with a context (bit d for device d). */
unsigned fake_contexts(void) { return atomic_load(&contexts); }
/* The next n cudaMalloc/cudaHostAlloc calls fail with cudaErrorMemoryAllocation. */
void fake_fail_mallocs(int n) { atomic_store(&fail_mallocs, n); }
/* Copies enqueued from pageable host memory to the device so far. */
int fake_pageable_uploads(void) { return atomic_load(&pageable_uploads); }
/* Calls on an aborted communicator, and aborts racing with another call on it. */
int fake_violations(void) { return atomic_load(&violations); }
/* The communicators made and not aborted (a process should leave none at its end). */
int fake_live_comms(void) {
    int n = 0;
    for (int i = 0; i < atomic_load(&ncomms) && i < MAX_COMMS; i++) n += comms[i] && !atomic_load(&comms[i]->dead);
    return n;
}
/* The poll that completes a group job takes `us` microseconds (see ncclCommGetAsyncError). */
void fake_join_hold(int us) { atomic_store(&join_hold_us, us); }
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

/* ---------------------------------------------------------------- NVRTC and the driver
 * The float8 wire's kernel (cuda_dequant.c): "compiling" checks the source names the kernel
 * and takes the architecture as NVRTC does: --gpu-architecture=sm_XY gives a CUBIN stand-in
 * (and PTX), compute_XY (the default: compute_75) PTX only, nvrtcGetCUBINSize saying 0 then,
 * as NVRTC documents for a virtual architecture; an architecture outside this NVRTC's list
 * (75 80 86 89 90: one that does not know 10.0) is NVRTC_ERROR_INVALID_OPTION. Each image
 * names its target (".target sm_XY") and the kernel. The devices' compute capability is
 * FAKE_CC (major * 10 + minor; default 90; FAKE_CC=100: a device newer than this NVRTC).
 * cuModuleLoadData takes a CUBIN for the device's major and a minor no later than its own
 * (else CUDA_ERROR_NO_BINARY_FOR_GPU), PTX for a target no later than the device; under
 * FAKE_REFUSE_PTX=1 it refuses every PTX (CUDA_ERROR_UNSUPPORTED_PTX_VERSION: a driver older
 * than the NVRTC) and still takes a CUBIN, as a real one does. cuLaunchKernel of the kernel
 * runs the host form of the same source (wire_kernel.h) ON the stream, deferred like a copy,
 * so a consumer that does not wait for it reads stale bytes. Its segments must lie in device
 * memory. */
#include <stdio.h> /* snprintf, for the images */
static const int fake_archs[] = {75, 80, 86, 89, 90};
enum { NVRTC_ERROR_OUT_OF_MEMORY = 1, NVRTC_ERROR_INVALID_OPTION = 5, NVRTC_ERROR_COMPILATION = 6 };
struct _nvrtcProgram {
    char *src;
    char *ptx;   /* after compiling */
    char *cubin; /* after compiling for a real architecture (sm_XY) */
};
hsdp_nvrtcResult nvrtcCreateProgram(hsdp_nvrtcProgram *prog, const char *src, const char *name, int numHeaders,
                                    const char *const *headers, const char *const *includeNames) {
    (void)name, (void)numHeaders, (void)headers, (void)includeNames;
    hsdp_nvrtcProgram p = calloc(1, sizeof *p);
    if (!p || !(p->src = strdup(src))) {
        free(p);
        return NVRTC_ERROR_OUT_OF_MEMORY;
    }
    *prog = p;
    return hsdp_NVRTC_SUCCESS;
}
/* an image naming its target and the kernel; malloc'd, owned by the program */
static char *fake_image(const char *head, int arch) {
    char *img = malloc(96);
    if (img) snprintf(img, 96, "%s\n.target sm_%d\n.visible .entry " HSDP_WK_NAME "\n", head, arch);
    return img;
}
hsdp_nvrtcResult nvrtcCompileProgram(hsdp_nvrtcProgram prog, int numOptions, const char *const *options) {
    int arch = 75, real = 0;
    for (int i = 0; i < numOptions; i++) {
        const char *o = options[i], *v = strncmp(o, "--gpu-architecture=", 19) == 0 ? o + 19
                                        : strncmp(o, "-arch=", 6) == 0             ? o + 6
                                                                                   : NULL;
        if (!v) continue;
        real = strncmp(v, "sm_", 3) == 0;
        if (!real && strncmp(v, "compute_", 8) != 0) return NVRTC_ERROR_INVALID_OPTION;
        arch = atoi(v + (real ? 3 : 8));
    }
    int known = 0;
    for (size_t i = 0; i < sizeof fake_archs / sizeof *fake_archs; i++) known |= fake_archs[i] == arch;
    if (!known) return NVRTC_ERROR_INVALID_OPTION;
    if (!strstr(prog->src, "__global__") || !strstr(prog->src, " " HSDP_WK_NAME "(") || !strstr(prog->src, "hsdp_wk_item"))
        return NVRTC_ERROR_COMPILATION;
    free(prog->ptx);
    free(prog->cubin);
    prog->cubin = NULL;
    prog->ptx = fake_image("// fake PTX", arch);
    if (real) prog->cubin = fake_image("\x7f" "ELF fake CUBIN", arch);
    return prog->ptx && (!real || prog->cubin) ? hsdp_NVRTC_SUCCESS : NVRTC_ERROR_OUT_OF_MEMORY;
}
hsdp_nvrtcResult nvrtcGetPTXSize(hsdp_nvrtcProgram prog, size_t *n) {
    *n = prog->ptx ? strlen(prog->ptx) + 1 : 0;
    return hsdp_NVRTC_SUCCESS;
}
hsdp_nvrtcResult nvrtcGetPTX(hsdp_nvrtcProgram prog, char *ptx) {
    if (prog->ptx) strcpy(ptx, prog->ptx);
    return hsdp_NVRTC_SUCCESS;
}
hsdp_nvrtcResult nvrtcGetCUBINSize(hsdp_nvrtcProgram prog, size_t *n) {
    *n = prog->cubin ? strlen(prog->cubin) + 1 : 0; /* 0 for a virtual architecture, as NVRTC's */
    return hsdp_NVRTC_SUCCESS;
}
hsdp_nvrtcResult nvrtcGetCUBIN(hsdp_nvrtcProgram prog, char *cubin) {
    if (prog->cubin) strcpy(cubin, prog->cubin);
    return hsdp_NVRTC_SUCCESS;
}
hsdp_nvrtcResult nvrtcGetNumSupportedArchs(int *n) {
    *n = (int)(sizeof fake_archs / sizeof *fake_archs);
    return hsdp_NVRTC_SUCCESS;
}
hsdp_nvrtcResult nvrtcGetSupportedArchs(int *archs) {
    memcpy(archs, fake_archs, sizeof fake_archs);
    return hsdp_NVRTC_SUCCESS;
}
hsdp_nvrtcResult nvrtcGetProgramLogSize(hsdp_nvrtcProgram prog, size_t *n) {
    (void)prog;
    *n = 1;
    return hsdp_NVRTC_SUCCESS;
}
hsdp_nvrtcResult nvrtcGetProgramLog(hsdp_nvrtcProgram prog, char *log) {
    (void)prog;
    log[0] = '\0';
    return hsdp_NVRTC_SUCCESS;
}
hsdp_nvrtcResult nvrtcDestroyProgram(hsdp_nvrtcProgram *prog) {
    if (*prog) {
        free((*prog)->src);
        free((*prog)->ptx);
        free((*prog)->cubin);
        free(*prog);
        *prog = NULL;
    }
    return hsdp_NVRTC_SUCCESS;
}
const char *nvrtcGetErrorString(hsdp_nvrtcResult r) { return r == hsdp_NVRTC_SUCCESS ? "NVRTC_SUCCESS" : "fake NVRTC error"; }

struct CUmod_st {
    int has_kernel;
};
struct CUfunc_st {
    int dequant;
};
static struct CUmod_st the_module;
static struct CUfunc_st the_kernel = {.dequant = 1};
static atomic_int launches;
enum { CU_ERROR_INVALID_VALUE = 1, CU_ERROR_INVALID_DEVICE = 101, CU_ERROR_INVALID_IMAGE = 200,
       CU_ERROR_NO_BINARY_FOR_GPU = 209, CU_ERROR_UNSUPPORTED_PTX_VERSION = 222, CU_ERROR_NOT_FOUND = 500 };
static int fake_cc(void) { /* the devices' compute capability, major * 10 + minor */
    const char *s = getenv("FAKE_CC");
    int cc = s ? atoi(s) : 90;
    return cc >= 10 && cc <= 999 ? cc : 90;
}
hsdp_CUresult cuInit(unsigned int flags) { return flags ? CU_ERROR_INVALID_VALUE : hsdp_CUDA_SUCCESS; }
hsdp_CUresult cuCtxGetDevice(hsdp_CUdevice *dev) {
    context(); /* the runtime's context on this thread, current to the driver as cudart makes it */
    *dev = current_device;
    return hsdp_CUDA_SUCCESS;
}
hsdp_CUresult cuDeviceGetAttribute(int *value, hsdp_CUdevice_attribute attr, hsdp_CUdevice dev) {
    if (dev < 0 || dev >= ndevices()) return CU_ERROR_INVALID_DEVICE;
    if (attr == hsdp_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) *value = fake_cc() / 10;
    else if (attr == hsdp_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) *value = fake_cc() % 10;
    else return CU_ERROR_INVALID_VALUE;
    return hsdp_CUDA_SUCCESS;
}
hsdp_CUresult cuModuleLoadData(hsdp_CUmodule *m, const void *image) {
    context();
    const char *target = image ? strstr(image, ".target sm_") : NULL;
    if (!target || !strstr(image, ".entry")) return CU_ERROR_INVALID_IMAGE;
    int cubin = memcmp(image, "\x7f" "ELF", 4) == 0, arch = atoi(target + 11), cc = fake_cc();
    if (arch > cc || (cubin && arch / 10 != cc / 10)) return CU_ERROR_NO_BINARY_FOR_GPU;
    const char *refuse = getenv("FAKE_REFUSE_PTX"); /* a driver older than the NVRTC that made the PTX */
    if (!cubin && refuse && strcmp(refuse, "1") == 0) return CU_ERROR_UNSUPPORTED_PTX_VERSION;
    the_module.has_kernel = strstr(image, ".entry " HSDP_WK_NAME) != NULL;
    *m = &the_module;
    return hsdp_CUDA_SUCCESS;
}
hsdp_CUresult cuModuleGetFunction(hsdp_CUfunction *f, hsdp_CUmodule m, const char *name) {
    if (m != &the_module || !m->has_kernel || strcmp(name, HSDP_WK_NAME) != 0) return CU_ERROR_NOT_FOUND;
    *f = &the_kernel;
    return hsdp_CUDA_SUCCESS;
}
static void run_dequant(void *arg) { /* on the stream's worker */
    const hsdp_wk_args *a = arg;
    for (unsigned it = 0; it < a->items; it++)
        for (unsigned t = 0; t < HSDP_WK_BLOCK; t++) hsdp_wk_item(a, it, t);
}
hsdp_CUresult cuLaunchKernel(hsdp_CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned shared, hsdp_cudaStream_t h, void **params, void **extra) {
    context();
    if (f != &the_kernel || !gx || gy != 1 || gz != 1 || bx != HSDP_WK_BLOCK || by != 1 || bz != 1 || shared || extra ||
        !params || !params[0])
        return CU_ERROR_INVALID_VALUE;
    hsdp_wk_args *a = malloc(sizeof *a); /* the parameters by value, as a launch takes them */
    op *o = calloc(1, sizeof *o);
    if (!a || !o) {
        free(a);
        free(o);
        return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    }
    memcpy(a, params[0], sizeof *a);
    pthread_mutex_lock(&G);
    int ok = a->nseg > 0 && a->nseg <= HSDP_WK_SEGS;
    for (unsigned i = 0; ok && i < a->nseg; i++) {
        const hsdp_wk_seg *sg = &a->seg[i];
        size_t bytes = sg->kind == HSDP_WK_ZERO || sg->kind == HSDP_WK_COPY ? sg->n
                       : sg->n * (sg->kind == HSDP_WK_F32 ? 4 : 2);
        const char *d = (const char *)(uintptr_t)sg->dst, *src = (const char *)(uintptr_t)sg->src;
        ok = is_device(d) && is_device(d + bytes - 1) && sg->kind <= HSDP_WK_F32 &&
             (sg->kind == HSDP_WK_ZERO || (is_device(src) && is_device(src + sg->n - 1))) &&
             (sg->kind <= HSDP_WK_COPY || is_device((const void *)(uintptr_t)sg->scales));
    }
    if (!ok) {
        pthread_mutex_unlock(&G);
        free(a);
        free(o);
        return CU_ERROR_INVALID_VALUE;
    }
    *o = (op){.kind = K_FN, .fn = run_dequant, .owned = a};
    push(h, o);
    atomic_fetch_add(&launches, 1);
    pthread_mutex_unlock(&G);
    return hsdp_CUDA_SUCCESS;
}
hsdp_CUresult cuGetErrorString(hsdp_CUresult e, const char **text) {
    *text = e == hsdp_CUDA_SUCCESS ? "no error" : "fake CUDA driver error";
    return hsdp_CUDA_SUCCESS;
}
/* How many kernels were launched so far (the float8 wire's dequantization). */
int fake_kernel_launches(void) { return atomic_load(&launches); }

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
SAME_FN(nvrtcCreateProgram);
SAME_FN(nvrtcCompileProgram);
SAME_FN(nvrtcGetPTXSize);
SAME_FN(nvrtcGetPTX);
SAME_FN(nvrtcGetProgramLogSize);
SAME_FN(nvrtcGetProgramLog);
SAME_FN(nvrtcDestroyProgram);
SAME_FN(nvrtcGetErrorString);
SAME_FN(cuInit);
SAME_FN(cuModuleLoadData);
SAME_FN(cuModuleGetFunction);
SAME_FN(cuLaunchKernel);
SAME_FN(cuGetErrorString);
SAME_FN(nvrtcGetCUBINSize);
SAME_FN(nvrtcGetCUBIN);
SAME_FN(nvrtcGetNumSupportedArchs);
SAME_FN(nvrtcGetSupportedArchs);
SAME_FN(cuCtxGetDevice);
SAME_FN(cuDeviceGetAttribute);
