/* nccl_device.c - the NCCL backend's device (nccl_internal.h): the CUDA table of device.h,
 * and the host's view of the same memory over the test fake; the buffers; and a unit's shard
 * once on the device (its share: uploaded through pinned memory by its first gather, read
 * back, freed).
 *
 * Shards. A unit's shard is written on the host while loading; its first gather copies it
 * to device memory (the share), and every gather from then on copies the device copy into
 * its slot of the buffer and gathers in place. */
#ifndef HSDP_NO_NCCL
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_dequant.h"
#include "nccl_internal.h" /* last: it defines the short names api and S */

/* The device copy a fixed chunk is gathered from: made (and filled from the host chunk) by
 * the first gather. */
hsdp_status nccl_in_place(const void *src, void *recv, size_t nbytes, int rank, const void **send) {
    /* NCCL's in-place form (send = recv + rank * chunk) skips its own copy of this rank's
     * chunk; the one copy is ours, on the side stream, device to device */
    char *mine = (char *)recv + (size_t)rank * nbytes;
    hsdp_cudaError_t e = CUDA(cudaMemcpyAsync, mine, src, nbytes, hsdp_cudaMemcpyDefault, S.comm);
    if (e != hsdp_cudaSuccess) return nccl_cuda_fail(e, "copying a shard into its gather buffer");
    *send = mine;
    return HSDP_OK;
}

/* Uploads n bytes of pageable host memory to dev on the side stream through two pinned slots
 * (memcpy into one while the other's copy runs): a copy from pageable memory is staged by
 * the driver through its own small pinned buffer, synchronously and at a fraction of the
 * bandwidth. Without pinned memory (cudaHostAlloc failed) the copy is a plain one. S.issue held. */
#ifndef HSDP_PIN_SLOT_BYTES
#define HSDP_PIN_SLOT_BYTES (8u << 20) /* test_nccl builds with 16, so that a unit spans slots */
#endif
enum { PIN_SLOT_BYTES = HSDP_PIN_SLOT_BYTES };
static hsdp_status upload(void *dev, const void *host, size_t n) {
    if (!S.pinned) {
        void *p = NULL;
        if (CUDA(cudaHostAlloc, &p, 2 * (size_t)PIN_SLOT_BYTES, hsdp_cudaHostAllocDefault) != hsdp_cudaSuccess ||
            CUDA(cudaEventCreateWithFlags, &S.pin_ev[0], hsdp_cudaEventDisableTiming) != hsdp_cudaSuccess ||
            CUDA(cudaEventCreateWithFlags, &S.pin_ev[1], hsdp_cudaEventDisableTiming) != hsdp_cudaSuccess) {
            if (p) CUDA(cudaFreeHost, p);
            for (int i = 0; i < 2; i++)
                if (S.pin_ev[i]) CUDA(cudaEventDestroy, S.pin_ev[i]);
            S.pin_ev[0] = S.pin_ev[1] = NULL;
            CUDA_TRY(CUDA(cudaMemcpyAsync, dev, host, n, hsdp_cudaMemcpyDefault, S.comm), "copying a shard to the GPU");
            return HSDP_OK;
        }
        S.pinned = p;
    }
    for (size_t off = 0, i = 0; off < n; off += PIN_SLOT_BYTES, i ^= 1) {
        size_t len = n - off < PIN_SLOT_BYTES ? n - off : PIN_SLOT_BYTES;
        if (S.pin_used[i]) { /* the slot's previous copy must have read it */
            hsdp_status st = nccl_host_wait(S.pin_ev[i], "an upload of a shard through pinned memory");
            if (st != HSDP_OK) return st;
        }
        char *slot = (char *)S.pinned + i * (size_t)PIN_SLOT_BYTES;
        memcpy(slot, (const char *)host + off, len);
        CUDA_TRY(CUDA(cudaMemcpyAsync, (char *)dev + off, slot, len, hsdp_cudaMemcpyDefault, S.comm),
                 "copying a shard to the GPU");
        CUDA_TRY(CUDA(cudaEventRecord, S.pin_ev[i], S.comm), "recording an upload's event");
        S.pin_used[i] = 1;
    }
    return HSDP_OK;
}

hsdp_status nccl_fixed_source(void **share, const void *send, size_t nbytes, const void **src) {
    nccl_share *s = *share;
    if (!s) {
        s = calloc(1, sizeof *s); /* owned by the unit through *share; freed by share_free */
        if (!s) return hsdp_fail(HSDP_ENOMEM, "could not allocate a shard's device record");
        hsdp_cudaError_t e = nccl_dev_malloc(&s->dev, nbytes);
        hsdp_status st = e == hsdp_cudaSuccess ? upload(s->dev, send, nbytes) : nccl_cuda_fail(e, "allocating a shard on the GPU");
        if (st != HSDP_OK) {
            if (s->dev) CUDA(cudaFree, s->dev);
            free(s);
            return st;
        }
        *share = s;
    }
    *src = s->dev;
    return HSDP_OK;
}


void nccl_share_free(hsdp_group *g, void *share, void *memory) {
    nccl_device_guard();
    (void)g;
    nccl_share *s = share;
    free(memory);
    if (!s) return;
    /* a gather may still read the device copy: drain the side stream first (unless aborted) */
    if (!atomic_load(&S.failed)) (void)CUDA(cudaStreamSynchronize, S.comm);
    CUDA(cudaFree, s->dev);
    free(s);
}

hsdp_status nccl_share_read(hsdp_group *g, const void *share, void *out, size_t nbytes) {
    (void)g;
    nccl_device_guard();
    const nccl_share *s = share;
    pthread_mutex_lock(&S.issue);
    hsdp_status st = nccl_begin();
    if (st == HSDP_OK && nbytes) {
        /* on the side stream, after the upload and what is queued there, waited for first
         * (within the timeout: a copy into pageable memory would block behind a hung
         * collective); then the copy, waited for on the host */
        const char *what = "reading a shard back from the GPU";
        hsdp_cudaEvent_t ev = NULL;
        st = nccl_track(what, NULL, 0, &ev);
        if (st == HSDP_OK) st = nccl_host_wait(ev, what);
        hsdp_cudaError_t e = st == HSDP_OK ? CUDA(cudaMemcpyAsync, out, s->dev, nbytes, hsdp_cudaMemcpyDefault, S.comm)
                                           : hsdp_cudaSuccess;
        if (e != hsdp_cudaSuccess) st = nccl_cuda_fail(e, what);
        if (st == HSDP_OK) st = nccl_track(what, NULL, 0, &ev);
        if (st == HSDP_OK) st = nccl_host_wait(ev, what);
    }
    nccl_issue_unlock();
    return st;
}

const char *nccl_share_kind(const void *share) {
    (void)share;
    return "device";
}

/* ---------------------------------------------------------------- the device: CUDA */
static void *nccl_buffer_alloc(size_t nbytes) {
    void *p = NULL;
    if (!api.loaded) return NULL;
    nccl_device_guard();
    return nccl_dev_malloc(&p, nbytes) == hsdp_cudaSuccess ? p : NULL;
}

static void nccl_buffer_free(void *p, size_t nbytes) {
    nccl_device_guard();
    (void)nbytes;
    if (p) CUDA(cudaFree, p);
}

static void nccl_buffers_released(void) {
    if (!S.world_up) return;
    nccl_device_guard();
    if (CUDA(cudaEventRecord, S.released, S.compute) == hsdp_cudaSuccess) S.have_released = 1;
    if (!S.nreaders) return; /* read unlocked: only a reader's first import adds one */
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < S.nreaders; i++)
        if (S.readers[i].read && CUDA(cudaEventRecord, S.readers[i].ev, S.readers[i].stream) == hsdp_cudaSuccess) {
            S.readers[i].read = 0;
            S.readers[i].pending = 1;
            atomic_store(&S.readers_pending, 1);
        }
    pthread_mutex_unlock(&S.mu);
}

/* DLPack's CUDA streams: None or 1 (the legacy default stream), 2 (per-thread default), -1
 * (the consumer orders itself) or a stream handle; 0 is ambiguous and refused. */
static hsdp_status nccl_consumer_wait(int given, long long stream, const void *p, size_t n) {
    if (given && (stream == 0 || stream < -1))
        return hsdp_fail(HSDP_EINVAL, "__dlpack__(stream=%lld): a CUDA consumer's stream is None, -1, 1, 2 or a "
                                      "stream handle (DLPack forbids 0)", stream);
    if (given && stream == -1) return HSDP_OK;
    hsdp_cudaStream_t s = !given || stream == 1 ? NULL : (hsdp_cudaStream_t)(uintptr_t)stream;
    hsdp_status st = nccl_stream_wait(s, p, n);
    return st == HSDP_OK && S.world_up ? nccl_note_reader(s) : st;
}

static const char *nccl_wire_missing(void) {
    return hsdp_wire_cuda_loaded() ? NULL
                                   : "dequantizes with a GPU kernel that is not loaded: call hsdp.nccl.load_wire_kernel() "
                                     "first (it needs NVRTC and the CUDA driver)";
}

/* A stream reads next: it waits on the collective's event; the host does not. */
static hsdp_status stream_after(void *done, void *stream, const char *what) {
    hsdp_cudaError_t e = CUDA(cudaStreamWaitEvent, (hsdp_cudaStream_t)stream, (hsdp_cudaEvent_t)done, 0);
    if (e == hsdp_cudaSuccess) return HSDP_OK;
    char msg[200];
    snprintf(msg, sizeof msg, "ordering the consumer's stream after %s", what);
    return nccl_cuda_fail(e, msg);
}

static int nccl_device_id(void) { return S.device; } /* one GPU per process */

/* The GPU's free bytes now, as torch.cuda.mem_get_info reads them (cudaMemGetInfo on this
 * process's device), so the residency budget needs no framework to ask. */
static hsdp_status nccl_mem_free(size_t *free_bytes) {
    size_t total = 0;
    if (!api.loaded) return hsdp_fail(HSDP_ESTATE, "the NCCL backend is not loaded");
    if (!api.cudaMemGetInfo) return hsdp_fail(HSDP_EUNSUPPORTED, "this CUDA runtime has no cudaMemGetInfo");
    nccl_device_guard();
    hsdp_cudaError_t e = CUDA(cudaMemGetInfo, free_bytes, &total);
    return e == hsdp_cudaSuccess ? HSDP_OK : nccl_cuda_fail(e, "reading the GPU's free memory (cudaMemGetInfo)");
}

/* What both tables below share: they are two views of the same device memory, named
 * 'cuda', allocated, released and decoded into alike. */
#define NCCL_DEVICE_MEMORY                                                                                    \
    .name = "cuda", .alloc = nccl_buffer_alloc, .free = nccl_buffer_free, .released = nccl_buffers_released,  \
    .wire_missing = nccl_wire_missing

const hsdp_device_i nccl_device = {
    NCCL_DEVICE_MEMORY,
    .framework = "cuda",
    .dlpack_type = 2, /* kDLCUDA */
    .dlpack_id = nccl_device_id,
    .consumer_wait = nccl_consumer_wait,
    .call_stream = nccl_call_stream,
    .reader_after = stream_after,
    .mem_free = nccl_mem_free,
};

/* The same device memory over a runtime whose device memory the host reads (the test fake,
 * chosen by hsdp_nccl_load): views of it are CPU tensors (kDLCPU), so a CPU-only torch
 * computes on them. The reader is the host, which has no stream: every wait on a collective
 * writing device memory blocks the host (host_after), so a buffer's bytes have landed when
 * its gather's wait returns, as device.h says of a device without consumer_wait. */
static int nccl_host_id(void) { return 0; } /* kDLCPU has one device */
static hsdp_status host_after(void *done, void *stream, const char *what) {
    (void)stream;
    return nccl_host_wait((hsdp_cudaEvent_t)done, what);
}
static const hsdp_device_i nccl_host_device = {
    NCCL_DEVICE_MEMORY,
    .framework = "cpu",
    .dlpack_type = 1, /* kDLCPU */
    .dlpack_id = nccl_host_id,
    .reader_after = host_after,
};
#undef NCCL_DEVICE_MEMORY

/* The device table in effect (hsdp_nccl_load chose it: api.host_view): every collective path
 * orders its readers through it and never asks which one it is. */
const hsdp_device_i *nccl_device_now(void) { return api.host_view ? &nccl_host_device : &nccl_device; }
#endif
