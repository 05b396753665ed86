/* fake_cuda_nccl.c - a stand-in for libcudart and libnccl with one "GPU" whose memory is host
 * memory and a world of one rank, so that the NCCL backend's own logic (loading, joining,
 * the side stream's ordering, staging, shares, the watchdog) runs under ASan on a machine
 * without a GPU. Built as a shared library and passed as both libraries to test_nccl.
 *
 * Controls, by environment: FAKE_NCCL_VERSION (default 23007); FAKE_STALL=1 makes every
 * event recorded from then on never complete (a peer that never arrives). */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

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

cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaMalloc(void **p, size_t n) {
    block *b = malloc(sizeof *b);
    if (!b) return cudaErrorMemoryAllocation;
    b->p = calloc(1, n ? n : 1);
    b->n = n;
    b->next = blocks;
    blocks = b;
    *p = b->p;
    return b->p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *p) {
    for (block **b = &blocks; *b; b = &(*b)->next)
        if ((*b)->p == p) {
            block *dead = *b;
            *b = dead->next;
            free(dead->p);
            free(dead);
            return cudaSuccess;
        }
    return p ? cudaErrorInvalidValue : cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k, cudaStream_t s) {
    (void)k, (void)s;
    memmove(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
    memset(a, 0, sizeof *a);
    a->type = find(p) ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
    return cudaSuccess;
}

/* ---------------------------------------------------------------- streams and events */
static int stream_tokens[64], nstreams;
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    *least = 0, *greatest = -1;
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned flags, int prio) {
    (void)flags, (void)prio;
    *s = (cudaStream_t)&stream_tokens[nstreams++ % 64];
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    (void)s;
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    (void)s, (void)e, (void)flags;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    (void)s;
    return cudaSuccess;
}

typedef struct {
    int pending; /* never completes (FAKE_STALL) */
} fake_event;
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    (void)flags;
    *e = (cudaEvent_t)calloc(1, sizeof(fake_event));
    return *e ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    free(e);
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    (void)s;
    const char *stall = getenv("FAKE_STALL");
    ((fake_event *)e)->pending = stall && *stall == '1';
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) { return ((fake_event *)e)->pending ? cudaErrorNotReady : cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "fake CUDA error"; }

/* ---------------------------------------------------------------- a world of one */
typedef struct {
    int rank, size;
    const void *sent; /* the grouped send to self, matched by the next receive */
    size_t sent_n;
} fake_comm;

ncclResult_t ncclGetVersion(int *v) {
    const char *s = getenv("FAKE_NCCL_VERSION");
    *v = s ? atoi(s) : 23007;
    return ncclSuccess;
}
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    for (size_t i = 0; i < sizeof id->internal; i++) id->internal[i] = (char)(i * 7 + 1);
    return ncclSuccess;
}
static ncclResult_t new_comm(ncclComm_t *out, int n, int rank) {
    if (n != 1 || rank != 0) return ncclInvalidArgument; /* one process: a world of one */
    fake_comm *c = calloc(1, sizeof *c);
    if (!c) return ncclSystemError;
    c->size = 1;
    *out = (ncclComm_t)c;
    return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t *c, int n, ncclUniqueId id, int rank) {
    (void)id;
    return new_comm(c, n, rank);
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t *c, int n, ncclUniqueId id, int rank, ncclConfig_t *cfg) {
    (void)id, (void)cfg;
    ncclResult_t rc = new_comm(c, n, rank);
    return rc == ncclSuccess && cfg && !cfg->blocking ? ncclInProgress : rc; /* done by the next poll */
}
ncclResult_t ncclCommSplit(ncclComm_t c, int color, int key, ncclComm_t *out, ncclConfig_t *cfg) {
    (void)c, (void)color, (void)key, (void)cfg;
    return new_comm(out, 1, 0);
}
ncclResult_t ncclCommUserRank(const ncclComm_t c, int *r) {
    *r = ((fake_comm *)c)->rank;
    return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t c, int *n) {
    *n = ((fake_comm *)c)->size;
    return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *e) {
    (void)c;
    *e = ncclSuccess;
    return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t c) {
    free(c);
    return ncclSuccess;
}
const char *ncclGetErrorString(ncclResult_t r) { return r == ncclSuccess ? "no error" : "fake NCCL error"; }
const char *ncclGetLastError(ncclComm_t c) {
    (void)c;
    return "";
}

static size_t nbytes(size_t count, ncclDataType_t t) { return count * (t == ncclFloat32 ? 4 : 1); }
static ncclResult_t need_device(const void *p) { return !p || find(p) ? ncclSuccess : ncclInvalidUsage; }

ncclResult_t ncclAllGather(const void *s, void *r, size_t count, ncclDataType_t t, ncclComm_t c, cudaStream_t st) {
    (void)c, (void)st;
    if (need_device(s) || need_device(r)) return ncclInvalidUsage; /* NCCL cannot read host memory */
    memmove(r, s, nbytes(count, t));
    return ncclSuccess;
}
ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, ncclDataType_t t, int root, ncclComm_t c,
                           cudaStream_t st) {
    (void)c, (void)st;
    if (root != 0 || need_device(s) || need_device(r)) return ncclInvalidUsage;
    memmove(r, s, nbytes(count, t));
    return ncclSuccess;
}
ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                           cudaStream_t st) {
    (void)op, (void)c, (void)st;
    if (need_device(s) || need_device(r)) return ncclInvalidUsage;
    memmove(r, s, nbytes(count, t));
    return ncclSuccess;
}
ncclResult_t ncclAlltoAll(const void *s, void *r, size_t count, ncclDataType_t t, ncclComm_t c, cudaStream_t st) {
    (void)c, (void)st;
    if (need_device(s) || need_device(r)) return ncclInvalidUsage;
    memmove(r, s, nbytes(count, t));
    return ncclSuccess;
}
ncclResult_t ncclSend(const void *s, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
    (void)st;
    if (peer != 0 || need_device(s)) return ncclInvalidUsage;
    ((fake_comm *)c)->sent = s;
    ((fake_comm *)c)->sent_n = nbytes(count, t);
    return ncclSuccess;
}
ncclResult_t ncclRecv(void *r, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
    (void)st;
    fake_comm *fc = (fake_comm *)c;
    if (peer != 0 || need_device(r) || !fc->sent || fc->sent_n != nbytes(count, t)) return ncclInvalidUsage;
    memmove(r, fc->sent, fc->sent_n);
    fc->sent = NULL;
    return ncclSuccess;
}
ncclResult_t ncclGroupStart(void) { return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) { return ncclSuccess; }
