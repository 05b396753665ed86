/* fake_cuda_nccl.c - a stand-in for libcudart and libnccl with one "GPU" whose memory is host
 * memory and a world of one rank, so that the NCCL backend's own logic (loading, joining,
 * the side stream's ordering, staging, shares, the watchdog) runs under ASan on a machine
 * without a GPU. Built as a shared library and passed as both libraries to test_nccl.
 * Written against cuda_abi.h, the declarations the backend uses (no CUDA headers needed);
 * the end of this file asserts that each function here has the type the backend calls it by.
 *
 * Controls, by environment: FAKE_NCCL_VERSION (default 23007); FAKE_STALL=1 makes every
 * event recorded from then on never complete (a peer that never arrives). */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"

/* ---------------------------------------------------------------- device memory: a list */
typedef struct block {
    void *p;
    size_t n;
    struct block *next;
} block;
static block *blocks;

static block *find(const void *p) {
    for (block *b = blocks; b; b = b->next)
        if ((const char *)p >= (const char *)b->p && (const char *)p < (const char *)b->p + (b->n ? b->n : 1)) return b;
    return NULL;
}

hsdp_cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaSetDevice(int d) { return d == 0 ? hsdp_cudaSuccess : hsdp_cudaErrorInvalidDevice; }
hsdp_cudaError_t cudaMalloc(void **p, size_t n) {
    block *b = malloc(sizeof *b);
    if (!b) return hsdp_cudaErrorMemoryAllocation;
    b->p = calloc(1, n ? n : 1);
    b->n = n;
    b->next = blocks;
    blocks = b;
    *p = b->p;
    return b->p ? hsdp_cudaSuccess : hsdp_cudaErrorMemoryAllocation;
}
hsdp_cudaError_t cudaFree(void *p) {
    for (block **b = &blocks; *b; b = &(*b)->next)
        if ((*b)->p == p) {
            block *dead = *b;
            *b = dead->next;
            free(dead->p);
            free(dead);
            return hsdp_cudaSuccess;
        }
    return p ? hsdp_cudaErrorInvalidValue : hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, hsdp_cudaMemcpyKind k, hsdp_cudaStream_t s) {
    (void)k, (void)s;
    memmove(dst, src, n);
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaPointerGetAttributes(hsdp_cudaPointerAttributes *a, const void *p) {
    memset(a, 0, sizeof *a);
    a->type = find(p) ? hsdp_cudaMemoryTypeDevice : hsdp_cudaMemoryTypeUnregistered;
    return hsdp_cudaSuccess;
}

/* ---------------------------------------------------------------- streams and events */
static int stream_tokens[64], nstreams;
hsdp_cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    *least = 0, *greatest = -1;
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaStreamCreateWithPriority(hsdp_cudaStream_t *s, unsigned flags, int prio) {
    (void)flags, (void)prio;
    *s = (hsdp_cudaStream_t)&stream_tokens[nstreams++ % 64];
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaStreamDestroy(hsdp_cudaStream_t s) {
    (void)s;
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaStreamWaitEvent(hsdp_cudaStream_t s, hsdp_cudaEvent_t e, unsigned flags) {
    (void)s, (void)e, (void)flags;
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaStreamSynchronize(hsdp_cudaStream_t s) {
    (void)s;
    return hsdp_cudaSuccess;
}

typedef struct {
    int pending; /* never completes (FAKE_STALL) */
} fake_event;
hsdp_cudaError_t cudaEventCreateWithFlags(hsdp_cudaEvent_t *e, unsigned flags) {
    (void)flags;
    *e = (hsdp_cudaEvent_t)calloc(1, sizeof(fake_event));
    return *e ? hsdp_cudaSuccess : hsdp_cudaErrorMemoryAllocation;
}
hsdp_cudaError_t cudaEventDestroy(hsdp_cudaEvent_t e) {
    free(e);
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaEventRecord(hsdp_cudaEvent_t e, hsdp_cudaStream_t s) {
    (void)s;
    const char *stall = getenv("FAKE_STALL");
    ((fake_event *)e)->pending = stall && *stall == '1';
    return hsdp_cudaSuccess;
}
hsdp_cudaError_t cudaEventQuery(hsdp_cudaEvent_t e) {
    return ((fake_event *)e)->pending ? hsdp_cudaErrorNotReady : hsdp_cudaSuccess;
}
const char *cudaGetErrorString(hsdp_cudaError_t e) { return e == hsdp_cudaSuccess ? "no error" : "fake CUDA error"; }

/* ---------------------------------------------------------------- a world of one */
typedef struct {
    int rank, size;
    const void *sent; /* the grouped send to self, matched by the next receive */
    size_t sent_n;
} fake_comm;

hsdp_ncclResult_t ncclGetVersion(int *v) {
    const char *s = getenv("FAKE_NCCL_VERSION");
    *v = s ? atoi(s) : 23007;
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclGetUniqueId(hsdp_ncclUniqueId *id) {
    for (size_t i = 0; i < sizeof id->internal; i++) id->internal[i] = (char)(i * 7 + 1);
    return hsdp_ncclSuccess;
}
static hsdp_ncclResult_t new_comm(hsdp_ncclComm_t *out, int n, int rank) {
    if (n != 1 || rank != 0) return hsdp_ncclInvalidArgument; /* one process: a world of one */
    fake_comm *c = calloc(1, sizeof *c);
    if (!c) return hsdp_ncclSystemError;
    c->size = 1;
    *out = (hsdp_ncclComm_t)c;
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclCommInitRank(hsdp_ncclComm_t *c, int n, hsdp_ncclUniqueId id, int rank) {
    (void)id;
    return new_comm(c, n, rank);
}
hsdp_ncclResult_t ncclCommInitRankConfig(hsdp_ncclComm_t *c, int n, hsdp_ncclUniqueId id, int rank,
                                         hsdp_ncclConfig_t *cfg) {
    (void)id;
    /* what NCCL checks first: a config made by its initializer, of a version it reads */
    if (!cfg || cfg->magic != HSDP_NCCL_API_MAGIC || cfg->version < 21400) return hsdp_ncclInvalidArgument;
    hsdp_ncclResult_t rc = new_comm(c, n, rank);
    return rc == hsdp_ncclSuccess && cfg && !cfg->blocking ? hsdp_ncclInProgress : rc; /* done by the next poll */
}
hsdp_ncclResult_t ncclCommSplit(hsdp_ncclComm_t c, int color, int key, hsdp_ncclComm_t *out, hsdp_ncclConfig_t *cfg) {
    (void)c, (void)color, (void)key, (void)cfg;
    return new_comm(out, 1, 0);
}
hsdp_ncclResult_t ncclCommUserRank(const hsdp_ncclComm_t c, int *r) {
    *r = ((fake_comm *)c)->rank;
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclCommCount(const hsdp_ncclComm_t c, int *n) {
    *n = ((fake_comm *)c)->size;
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclCommGetAsyncError(hsdp_ncclComm_t c, hsdp_ncclResult_t *e) {
    (void)c;
    *e = hsdp_ncclSuccess;
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclCommAbort(hsdp_ncclComm_t c) {
    free(c);
    return hsdp_ncclSuccess;
}
const char *ncclGetErrorString(hsdp_ncclResult_t r) { return r == hsdp_ncclSuccess ? "no error" : "fake NCCL error"; }
const char *ncclGetLastError(hsdp_ncclComm_t c) {
    (void)c;
    return "";
}

static size_t nbytes(size_t count, hsdp_ncclDataType_t t) { return count * (t == hsdp_ncclFloat32 ? 4 : 1); }
static hsdp_ncclResult_t need_device(const void *p) { return !p || find(p) ? hsdp_ncclSuccess : hsdp_ncclInvalidUsage; }

hsdp_ncclResult_t ncclAllGather(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclComm_t c,
                                hsdp_cudaStream_t st) {
    (void)c, (void)st;
    if (need_device(s) || need_device(r)) return hsdp_ncclInvalidUsage; /* NCCL cannot read host memory */
    memmove(r, s, nbytes(count, t));
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, int root,
                                hsdp_ncclComm_t c, hsdp_cudaStream_t st) {
    (void)c, (void)st;
    if (root != 0 || need_device(s) || need_device(r)) return hsdp_ncclInvalidUsage;
    memmove(r, s, nbytes(count, t));
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclRedOp_t op,
                                hsdp_ncclComm_t c, hsdp_cudaStream_t st) {
    (void)op, (void)c, (void)st;
    if (need_device(s) || need_device(r)) return hsdp_ncclInvalidUsage;
    memmove(r, s, nbytes(count, t));
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclAlltoAll(const void *s, void *r, size_t count, hsdp_ncclDataType_t t, hsdp_ncclComm_t c,
                               hsdp_cudaStream_t st) {
    (void)c, (void)st;
    if (need_device(s) || need_device(r)) return hsdp_ncclInvalidUsage;
    memmove(r, s, nbytes(count, t));
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclSend(const void *s, size_t count, hsdp_ncclDataType_t t, int peer, hsdp_ncclComm_t c,
                           hsdp_cudaStream_t st) {
    (void)st;
    if (peer != 0 || need_device(s)) return hsdp_ncclInvalidUsage;
    ((fake_comm *)c)->sent = s;
    ((fake_comm *)c)->sent_n = nbytes(count, t);
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclRecv(void *r, size_t count, hsdp_ncclDataType_t t, int peer, hsdp_ncclComm_t c,
                           hsdp_cudaStream_t st) {
    (void)st;
    fake_comm *fc = (fake_comm *)c;
    if (peer != 0 || need_device(r) || !fc->sent || fc->sent_n != nbytes(count, t)) return hsdp_ncclInvalidUsage;
    memmove(r, fc->sent, fc->sent_n);
    fc->sent = NULL;
    return hsdp_ncclSuccess;
}
hsdp_ncclResult_t ncclGroupStart(void) { return hsdp_ncclSuccess; }
hsdp_ncclResult_t ncclGroupEnd(void) { return hsdp_ncclSuccess; }

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
