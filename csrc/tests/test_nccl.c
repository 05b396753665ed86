/* test_nccl.c - the NCCL backend without a GPU, in one of two modes (one process each, since
 * a process loads its NCCL once):
 *   test_nccl LIBNCCL LIBCUDART   the real libraries: libraries that are not there are named,
 *                                 and a machine with no GPU is said to have none (nothing stays
 *                                 loaded); with a GPU, the library loads.
 *   test_nccl --fake FAKE [ENDING]
 *                                 fake_cuda_nccl.so (GPUs of host memory whose streams really
 *                                 defer work, a world of one) as both libraries: the backend's
 *                                 own logic runs, whether or not the machine has a GPU: joining,
 *                                 splits, unit gathers from the shard's device copy, staging of
 *                                 host buffers, both all-to-all forms, ordering across streams,
 *                                 no CUDA error left for the framework, no context on a device
 *                                 not chosen, then one ending (a process aborts once): "stall",
 *                                 the watchdog's timeout; "race", an asynchronous error while
 *                                 another communicator's collective is in progress; or
 *                                 "ranks N": a world of N forked ranks over the fake's shared
 *                                 memory (collectives across ranks, a sharded unit, ring
 *                                 attention's sendrecv between them, and a rank that never
 *                                 arrives, named by the others), or "ranks N
 *                                 desync": the same world ending in ranks that gather
 *                                 different units (agreement: every rank fails).
 *   test_nccl --nvrtc LIBNVRTC LIBCUDA
 *                                 the float8 wire's kernel compiled by the real NVRTC.
 * Both modes first check what holds before any loading: built, registered, unusable and
 * saying why, refusing the unique id and bad bootstraps, and naming what fails to load.
 * Neither needs a CUDA or NCCL header. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "backend_nccl.h"
#include "check.h"
#include "cuda_abi.h"
#include "cuda_dequant.h"

/* The fake's own entry points (the CUDA runtime's as the test's "framework" calls them, and
 * its controls), found in the library the backend loaded. */
static struct {
    hsdp_cudaError_t (*get_last_error)(void);
    hsdp_cudaError_t (*stream_sync)(hsdp_cudaStream_t);
    hsdp_cudaError_t (*stream_create)(hsdp_cudaStream_t *, unsigned, int);
    hsdp_cudaError_t (*stream_destroy)(hsdp_cudaStream_t);
    hsdp_cudaError_t (*memcpy_async)(void *, const void *, size_t, hsdp_cudaMemcpyKind, hsdp_cudaStream_t);
    void (*hold)(hsdp_cudaStream_t, int);
    int (*settle)(hsdp_cudaStream_t);
    unsigned (*contexts)(void);
    void (*fail_mallocs)(int);
    int (*violations)(void);
    void (*comm_control)(int, int, int);
    int (*wait_queries)(int);
    int (*pageable_uploads)(void);
    int (*kernel_launches)(void);
    int (*live_comms)(void);
    void (*join_hold)(int);
    int (*dead_streams)(void);
} F;

static int find_fake(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return 0;
#define SYM(field, name) *(void **)&F.field = dlsym(h, name), ok = ok && F.field
    int ok = 1;
    SYM(get_last_error, "cudaGetLastError");
    SYM(stream_sync, "cudaStreamSynchronize");
    SYM(stream_create, "cudaStreamCreateWithPriority");
    SYM(stream_destroy, "cudaStreamDestroy");
    SYM(memcpy_async, "cudaMemcpyAsync");
    SYM(hold, "fake_stream_hold");
    SYM(settle, "fake_stream_settle");
    SYM(contexts, "fake_contexts");
    SYM(fail_mallocs, "fake_fail_mallocs");
    SYM(violations, "fake_violations");
    SYM(comm_control, "fake_comm_control");
    SYM(wait_queries, "fake_wait_queries");
    SYM(pageable_uploads, "fake_pageable_uploads");
    SYM(kernel_launches, "fake_kernel_launches");
    SYM(live_comms, "fake_live_comms");
    SYM(join_hold, "fake_join_hold");
    SYM(dead_streams, "fake_dead_streams");
#undef SYM
    return ok;
}

/* What the framework does before the host reads what its stream computed. */
static void device_sync(void) { CHECK(F.stream_sync(NULL) == hsdp_cudaSuccess); }

/* Another thread entering the backend (a framework's worker, say): it runs on the backend's
 * device, not on device 0. */
static void *other_thread(void *arg) {
    hsdp_group *g = arg;
    int send[2] = {5, 6}, recv[2] = {0};
    hsdp_status st = hsdp_all_gather(g, send, recv, sizeof send);
    return (void *)(intptr_t)(st == HSDP_OK && recv[1] == 6 && F.get_last_error() == hsdp_cudaSuccess);
}

static int cache_emptied;
static int empty_cache(void *arg) { /* what torch.cuda.empty_cache is to the backend */
    (void)arg;
    cache_emptied++;
    return 1;
}

/* The float8 wire on NCCL (issue 22): a unit of bfloat16, float32 and float16 parameters (and
 * an int32 one that travels as it is) gathers its encodings into device memory, and the
 * kernel (the fake runs its source as C, on the side stream) decodes them into the same bytes
 * as the host's decode of the same gather (hsdp_unit_gather: the MPI and single-process path),
 * on every rank. A consumer stream that waits for the unsharded buffer waits for the kernel. */
static void wire_unit(hsdp_group *g, const char *fake, int first_load) {
    hsdp_stats stats;
    hsdp_stats_init(&stats);
    const hsdp_backend *b = hsdp_backend_find("nccl");
    size_t numels[4] = {300, 5, 130, 70};
    hsdp_dtype dts[4] = {HSDP_BF16, HSDP_I32, HSDP_F32, HSDP_F16};
    const unsigned char quant[4] = {1, 0, 1, 1};
    hsdp_unit u;
    CHECK(hsdp_unit_init(&u, numels, dts, NULL, 4, g, &stats) == HSDP_OK);
    snprintf(u.label, sizeof u.label, "blocks.fp8");
    float x[300];
    int32_t ints[5] = {-3, 7, 1 << 20, 0, 42};
    uint32_t lcg = 12345;
    for (int i = 0; i < 300; i++) {
        lcg = lcg * 1664525u + 1013904223u;
        x[i] = ((float)(lcg >> 8) / (float)(1u << 24) - 0.5f) * (i < 128 ? 1e-3f : i < 256 ? 3.0f : 1e-38f);
    }
    x[7] = 0.0f, x[8] = -0.0f;
    CHECK(hsdp_unit_write(&u, 0, 0, 300, x, HSDP_F32) == HSDP_OK);
    CHECK(hsdp_unit_write(&u, 1, 0, 5, ints, HSDP_I32) == HSDP_OK);
    CHECK(hsdp_unit_write(&u, 2, 0, 130, x + 100, HSDP_F32) == HSDP_OK);
    CHECK(hsdp_unit_write(&u, 3, 0, 70, x + 200, HSDP_F32) == HSDP_OK);
    CHECK(hsdp_unit_set_wire(&u, HSDP_F8E4M3, quant) == HSDP_OK);
    size_t total = u.layout.total_bytes, wbytes = hsdp_unit_wire_bytes(&u);
    CHECK(wbytes > 0 && wbytes < total);
    unsigned char *full = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, total);
    unsigned char *wire = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, wbytes);
    unsigned char *ref = malloc(total), *seen = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, total);
    CHECK(full && wire && ref && seen);
    if (!full || !wire || !ref || !seen) return;
    hsdp_gather_req req;
    memset(&req, 0, sizeof req);
    if (first_load) {
        /* not loaded: refused before anything is enqueued, naming what is missing */
        CHECK(hsdp_unit_gather_start_wire(&u, full, NULL, wire, &req) == HSDP_EUNSUPPORTED);
        CHECK(strstr(hsdp_last_error(), "neither is loaded (hsdp_wire_cuda_load)") != NULL);
        CHECK(hsdp_wire_cuda_load("/nonexistent/libnvrtc.so.12", fake) == HSDP_EUNSUPPORTED);
        CHECK(strstr(hsdp_last_error(), "could not open NVRTC '/nonexistent/libnvrtc.so.12'") != NULL);
        CHECK(hsdp_wire_cuda_load(fake, "libm.so.6") == HSDP_EUNSUPPORTED);
        CHECK(strstr(hsdp_last_error(), "'libm.so.6' has no symbol cuInit") != NULL);
        CHECK(!hsdp_wire_cuda_loaded());
    }
    CHECK(hsdp_wire_cuda_load(fake, fake) == HSDP_OK && hsdp_wire_cuda_loaded());
    /* The image is compiled for the device at the first gather (issue 30, L1): a CUBIN for the
     * fake's sm_90 (FAKE_CC), or, for a device newer than the fake NVRTC's list (FAKE_CC=100),
     * PTX for the newest architecture below it. A driver older than the NVRTC (FAKE_REFUSE_PTX=1,
     * set here for the first gather, and by make for a whole run) refuses PTX but loads the
     * CUBIN, so the gather works there; the PTX is refused before the gather is enqueued,
     * saying why. */
    const char *cc = getenv("FAKE_CC"), *refuse = getenv("FAKE_REFUSE_PTX");
    int newer = cc && strcmp(cc, "100") == 0, refusing = refuse && strcmp(refuse, "1") == 0;
    const char *want = newer ? "ptx compute_90" : "cubin sm_90";
    int launches = F.kernel_launches();
    if (first_load) {
        CHECK(hsdp_wire_cuda_image() == NULL);
        hsdp_wire_cuda_blob img;
        CHECK(hsdp_wire_cuda_compile(90, &img) == HSDP_OK && img.cubin && img.arch == 90 && img.size > 4 &&
              memcmp(img.data, "\x7f" "ELF", 4) == 0 && strstr(img.data, ".entry hsdp_wire_dequant"));
        free(img.data);
        CHECK(hsdp_wire_cuda_compile(87, &img) == HSDP_OK && img.cubin && img.arch == 86); /* 8.6's runs on 8.7 */
        free(img.data);
        CHECK(hsdp_wire_cuda_compile(120, &img) == HSDP_OK && !img.cubin && img.arch == 90 &&
              strstr(img.data, "// fake PTX") && img.size == strlen(img.data) + 1);
        free(img.data);
        CHECK(hsdp_wire_cuda_compile(70, &img) == HSDP_EUNSUPPORTED && img.data == NULL);
        CHECK(strstr(hsdp_last_error(), "compute capability 7.0 is older than any NVRTC") &&
              strstr(hsdp_last_error(), "(sm_75 to sm_90)"));
        setenv("FAKE_REFUSE_PTX", "1", 1);
        if (newer) {
            CHECK(hsdp_unit_gather_start_wire(&u, full, NULL, wire, &req) == HSDP_ECOMM);
            char text[200];
            snprintf(text, sizeof text, "loading the float8 wire's kernel (ptx compute_90, compiled by NVRTC '%s') into "
                     "the context of CUDA device 1, compute capability 10.0 (cuModuleLoadData) [the driver is older",
                     fake); /* device 1: fake_world's (first_load) */
            CHECK(strstr(hsdp_last_error(), "CUDA driver error 222") && strstr(hsdp_last_error(), text));
            CHECK(strcmp(hsdp_share_kind(g, u.share), "unset") == 0 && F.kernel_launches() == launches);
            CHECK(hsdp_wire_cuda_image() == NULL);
            unsetenv("FAKE_REFUSE_PTX");
        }
    }
    memset(full, 0xAB, total); /* stale bytes: each must be overwritten, padding included */
    CHECK(hsdp_unit_gather_start_wire(&u, full, NULL, wire, &req) == HSDP_OK);
    CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK);
    device_sync();
    CHECK(F.kernel_launches() > launches);
    CHECK(hsdp_wire_cuda_image() && strcmp(hsdp_wire_cuda_image(), want) == 0);
    if (refusing) setenv("FAKE_REFUSE_PTX", "1", 1); /* as it was */
    else unsetenv("FAKE_REFUSE_PTX");
    CHECK(strcmp(hsdp_share_kind(g, u.share), "device") == 0 && u.wire_encoded && u.shard == NULL);
    /* the host path, on the same unit: the encodings gathered to host memory, decoded there */
    CHECK(hsdp_unit_gather(&u, ref) == HSDP_OK);
    CHECK(memcmp(full, ref, total) == 0);
    /* and the decode is the weights', within float8's error (a zero stays a signed zero) */
    float back[300];
    CHECK(hsdp_cast(back, HSDP_F32, ref + u.layout.slots[0].offset, HSDP_BF16, 300) == HSDP_OK);
    int close = 1;
    for (int i = 0; i < 256; i++) close &= fabsf(back[i] - x[i]) <= fabsf(x[i]) / 8; /* the tail is near float32 underflow */
    CHECK(close && back[7] == 0.0f && !signbit(back[7]) && signbit(back[8]));
    CHECK(memcmp(ref + u.layout.slots[1].offset, ints, sizeof ints) == 0);

    /* ordering: the side stream is busy, so neither the gather nor the kernel has run; a
     * consumer that waits for the unsharded buffer waits for the kernel, never reads before */
    hsdp_buffers_released(b, HSDP_DEVICE_BACKEND);
    hsdp_cudaStream_t comm = hsdp_nccl_comm_stream(), consumer = NULL;
    CHECK(F.stream_create(&consumer, hsdp_cudaStreamNonBlocking, 0) == hsdp_cudaSuccess);
    memset(full, 0xAB, total);
    F.hold(comm, 1);
    memset(&req, 0, sizeof req);
    CHECK(hsdp_unit_gather_start_wire(&u, full, NULL, wire, &req) == HSDP_OK);
    CHECK(hsdp_backend_device(b)->consumer_wait(1, (long long)(uintptr_t)consumer, full + total - 8, 8) == HSDP_OK); /* its tail: the kernel's range */
    CHECK(F.memcpy_async(seen, full, total, hsdp_cudaMemcpyDefault, consumer) == hsdp_cudaSuccess);
    CHECK(F.settle(consumer) > 0);
    F.hold(comm, 0);
    CHECK(F.stream_sync(consumer) == hsdp_cudaSuccess);
    CHECK(memcmp(seen, ref, total) == 0);
    CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK);
    /* the release covers the consumer's reads (it records on its stream), so the stream lives
     * until then ([Note: readers on other streams]) */
    hsdp_buffers_released(b, HSDP_DEVICE_BACKEND);
    CHECK(F.stream_destroy(consumer) == hsdp_cudaSuccess);

    /* the synchronous form (Unit.unshard) goes through the same decode */
    memset(full, 0xAB, total);
    memset(&req, 0, sizeof req);
    CHECK(hsdp_unit_gather_now_wire(&u, full, NULL, wire, &req) == HSDP_OK);
    device_sync();
    CHECK(memcmp(full, ref, total) == 0);
    /* the shard, dropped from the host, reads back as its encoding */
    unsigned char *enc = malloc(hsdp_unit_shard_bytes(&u));
    CHECK(enc && hsdp_unit_shard_bytes(&u) == u.wire_chunk_bytes && hsdp_unit_read_shard(&u, enc) == HSDP_OK);
    CHECK(enc && memcmp(enc, wire + (size_t)g->rank * u.wire_chunk_bytes, u.wire_chunk_bytes) == 0);
    free(enc);
    /* encodings on the device, unsharded buffer on the host: refused before anything runs */
    memset(&req, 0, sizeof req);
    CHECK(hsdp_unit_gather_start_wire(&u, ref, NULL, wire, &req) == HSDP_EUNSUPPORTED);
    CHECK(strstr(hsdp_last_error(), "unsharded buffer must be device memory too") != NULL);
    CHECK(F.get_last_error() == hsdp_cudaSuccess);
    hsdp_buffers_released(b, HSDP_DEVICE_BACKEND);
    hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, full, total);
    hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, wire, wbytes);
    hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, seen, total);
    free(ref);
    hsdp_unit_free(&u);
    CHECK(atomic_load(&stats.sharded_bytes) == 0); /* the dropped encoded chunk was counted as such */
}

enum { DEVICE = 1 }; /* the fake has two: device 0 must get no context from anything here */

static void fake_world(const char *fake, const char *ending) {
    CHECK(hsdp_nccl_load(fake, fake) == HSDP_OK);
    CHECK(find_fake(fake));
    if (!F.violations) return;
    int version = hsdp_nccl_version();
    printf("test_nccl: fake NCCL %d, ending: %s\n", version, ending);
    unsigned char id[HSDP_NCCL_ID_BYTES];
    CHECK(hsdp_nccl_unique_id(id) == HSDP_OK && id[1] == 8);
    hsdp_group *world = NULL, *sub = NULL;
    int we_init = 0;
    CHECK(hsdp_backend_world("nccl", &world, &we_init) == HSDP_ESTATE); /* no bootstrap yet */
    CHECK(strstr(hsdp_last_error(), "needs its bootstrap first") != NULL);
    CHECK(hsdp_nccl_set_bootstrap(id, 0, 1, DEVICE) == HSDP_OK);
    /* the join is non-blocking: polled through ncclInProgress on the communicator it made */
    CHECK(hsdp_backend_world("nccl", &world, &we_init) == HSDP_OK && we_init == 1);
    if (!world) return;
    CHECK(world->size == 1 && world->rank == 0 && hsdp_group_overlaps(world));
    CHECK(hsdp_barrier(world) == HSDP_OK); /* the world's communicator is the one NCCL made */
    CHECK(hsdp_group_split(world, 0, 0, &sub) == HSDP_OK && sub && sub->size == 1 && sub->rank == 0);
    if (!sub) return;
    CHECK(hsdp_barrier(sub) == HSDP_OK);
    hsdp_cudaStream_t comm = hsdp_nccl_comm_stream();
    CHECK(comm != NULL);

    /* R3: one poller per communicator. Every call on a non-blocking communicator leaves NCCL a
     * group job that the poll seeing it done completes; two threads doing so at once free it
     * twice (the fake counts it, and holds that poll open 3 ms as a slow thread's end would):
     * the watchdog, polling every 20 ms, must never poll beside the thread in a call. */
    F.join_hold(3000);
    for (int i = 0; i < 100; i++) CHECK(hsdp_barrier(i % 2 ? world : sub) == HSDP_OK);
    F.join_hold(0);
    CHECK(F.violations() == 0);

    /* host buffers are staged through the device */
    int host_send[4] = {1, 2, 3, 4}, host_recv[4] = {0};
    CHECK(hsdp_all_gather(sub, host_send, host_recv, sizeof host_send) == HSDP_OK);
    CHECK(memcmp(host_send, host_recv, sizeof host_send) == 0);
    CHECK(hsdp_broadcast(sub, host_recv, sizeof host_recv, 0) == HSDP_OK && host_recv[3] == 4);
    CHECK(hsdp_broadcast(sub, host_recv, sizeof host_recv, 1) == HSDP_EINVAL);
    CHECK(hsdp_barrier(sub) == HSDP_OK);
    memset(host_recv, 0, sizeof host_recv);
    CHECK(hsdp_all_to_all(sub, host_send, host_recv, sizeof host_send) == HSDP_OK); /* AlltoAll or grouped */
    CHECK(memcmp(host_send, host_recv, sizeof host_send) == 0);
    CHECK(F.get_last_error() == hsdp_cudaSuccess); /* polling left no error for the framework */

    /* device buffers go straight to NCCL, ordered after the compute stream and before it */
    hsdp_stats stats;
    hsdp_stats_init(&stats);
    const hsdp_backend *b = hsdp_backend_find("nccl");
    char *dsend = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, 64), *drecv = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, 64);
    CHECK(dsend && drecv);
    if (dsend && drecv) {
        memset(dsend, 7, 64);
        CHECK(hsdp_all_to_all(sub, dsend, drecv, 64) == HSDP_OK);
        device_sync();
        CHECK(drecv[63] == 7);
        /* ring attention's point to point, to this rank itself: grouped ncclSend/ncclRecv */
        memset(dsend, 9, 64);
        CHECK(hsdp_sendrecv(sub, dsend, 64, 0, drecv, 64, 0) == HSDP_OK);
        device_sync();
        CHECK(drecv[0] == 9 && drecv[63] == 9);
        hsdp_req pr;
        memset(dsend, 5, 64);
        CHECK(hsdp_sendrecv_start(&pr, sub, dsend, 64, 0, drecv, 64, 0) == HSDP_OK);
        CHECK(hsdp_gather_wait(&pr) == HSDP_OK);
        device_sync();
        CHECK(drecv[63] == 5);
        CHECK(hsdp_sendrecv(sub, host_send, 8, 0, host_recv, 8, 0) == HSDP_EUNSUPPORTED); /* host memory */
        hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, dsend, 64);
        hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, drecv, 64);
    }

    /* out of device memory: the framework's cache is emptied and the allocation retried once;
     * a failure is handled, and leaves no error behind for the framework */
    hsdp_nccl_set_oom_handler(empty_cache, NULL);
    F.fail_mallocs(1);
    void *after_retry = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, 64);
    CHECK(after_retry != NULL && cache_emptied == 1);
    CHECK(F.get_last_error() == hsdp_cudaSuccess);
    if (after_retry) hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, after_retry, 64);
    F.fail_mallocs(2);
    CHECK(hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, 64) == NULL && cache_emptied == 2);
    CHECK(F.get_last_error() == hsdp_cudaSuccess);
    F.fail_mallocs(0);

    /* a unit: written on the host, copied to the device by its first gather, gathered from there */
    size_t numels[2] = {10, 3};
    hsdp_dtype dts[2] = {HSDP_F32, HSDP_BF16};
    hsdp_unit u;
    CHECK(hsdp_unit_init(&u, numels, dts, NULL, 2, sub, &stats) == HSDP_OK);
    float w[10];
    for (int i = 0; i < 10; i++) w[i] = (float)i + 0.5f;
    CHECK(hsdp_unit_write(&u, 0, 0, 10, w, HSDP_F32) == HSDP_OK);
    snprintf(u.label, sizeof u.label, "blocks.0");
    CHECK(strcmp(hsdp_share_kind(sub, u.share), "unset") == 0);
    int pageable = F.pageable_uploads();
    for (int round = 0; round < 3; round++) {
        void *full = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, u.layout.total_bytes);
        hsdp_gather_req req;
        memset(&req, 0, sizeof req);
        CHECK(full && hsdp_unit_gather_start(&u, full, NULL, &req) == HSDP_OK);
        CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK);
        device_sync(); /* the compute stream waited for the gather */
        CHECK(full && memcmp(full, w, sizeof w) == 0);
        CHECK(strcmp(hsdp_share_kind(sub, u.share), "device") == 0);
        hsdp_buffers_released(b, HSDP_DEVICE_BACKEND);
        hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, full, u.layout.total_bytes);
    }
    CHECK(F.pageable_uploads() == pageable); /* the shard went up through pinned memory (in 16-byte slots) */
    /* the host chunk was dropped once on the device; the chunk reads back from there */
    CHECK(u.shard == NULL);
    unsigned char *chunk = malloc(u.layout.chunk_bytes);
    CHECK(chunk && hsdp_unit_read_shard(&u, chunk) == HSDP_OK && memcmp(chunk, w, sizeof w) == 0);
    free(chunk);
    /* a consumer on another stream (DLPack's stream=, a collective on torch's current stream):
     * it reads what a collective writes only once it has landed, never the bytes from before */
    hsdp_cudaStream_t consumer = NULL;
    CHECK(F.stream_create(&consumer, hsdp_cudaStreamNonBlocking, 0) == hsdp_cudaSuccess);
    char *g3 = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, u.layout.total_bytes);
    char *seen = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, u.layout.total_bytes);
    CHECK(g3 && seen);
    F.hold(comm, 1); /* the side stream is busy: the gather has not landed */
    hsdp_gather_req req3;
    memset(&req3, 0, sizeof req3);
    CHECK(hsdp_unit_gather_start(&u, g3, NULL, &req3) == HSDP_OK);
    /* the device contract: a DLPack consumer's stream waits for the gather writing its bytes */
    const hsdp_device_i *dev = hsdp_backend_device(b);
    CHECK(dev && strcmp(dev->name, "cuda") == 0 && dev->dlpack_type == 2);
    CHECK(dev->consumer_wait(1, 0, g3, 8) == HSDP_EINVAL); /* DLPack forbids stream 0 */
    CHECK(dev->consumer_wait(1, (long long)(uintptr_t)consumer, g3 + 4, 8) == HSDP_OK);
    CHECK(F.memcpy_async(seen, g3, sizeof w, hsdp_cudaMemcpyDefault, consumer) == hsdp_cudaSuccess);
    CHECK(F.settle(consumer) > 0); /* it waits for the gather */
    F.hold(comm, 0);
    CHECK(F.stream_sync(consumer) == hsdp_cudaSuccess);
    CHECK(memcmp(seen, w, sizeof w) == 0);
    CHECK(hsdp_unit_gather_wait(&u, &req3) == HSDP_OK);
    hsdp_buffers_released(b, HSDP_DEVICE_BACKEND);
    char *dsrc = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, 16), *ddst = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, 16);
    CHECK(dsrc && ddst && F.memcpy_async(dsrc, host_send, 16, hsdp_cudaMemcpyDefault, consumer) == hsdp_cudaSuccess);
    F.hold(comm, 1);
    dev->call_stream(consumer, 1);
    CHECK(hsdp_all_gather(sub, dsrc, ddst, 16) == HSDP_OK); /* after the consumer's copy, before its next */
    dev->call_stream(NULL, 0);
    CHECK(F.memcpy_async(seen, ddst, 16, hsdp_cudaMemcpyDefault, consumer) == hsdp_cudaSuccess);
    CHECK(F.settle(consumer) > 0);
    F.hold(comm, 0);
    CHECK(F.stream_sync(consumer) == hsdp_cudaSuccess);
    CHECK(memcmp(seen, host_send, 16) == 0);
    hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, dsrc, 16);
    hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, ddst, 16);
    hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, g3, u.layout.total_bytes);
    hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, seen, u.layout.total_bytes);
    CHECK(F.stream_destroy(consumer) == hsdp_cudaSuccess);

    /* R2: a reader on another stream (DLPack's stream=) still reads a pooled buffer when it is
     * released: the next gather into that buffer waits for its reads, so it sees the old bytes */
    {
        hsdp_cudaStream_t reader = NULL;
        CHECK(F.stream_create(&reader, hsdp_cudaStreamNonBlocking, 0) == hsdp_cudaSuccess);
        hsdp_unit one, two;
        float w2[10];
        for (int i = 0; i < 10; i++) w2[i] = -(float)i - 1.0f;
        CHECK(hsdp_unit_init(&one, numels, dts, NULL, 2, sub, &stats) == HSDP_OK);
        CHECK(hsdp_unit_init(&two, numels, dts, NULL, 2, sub, &stats) == HSDP_OK);
        CHECK(hsdp_unit_write(&one, 0, 0, 10, w, HSDP_F32) == HSDP_OK);
        CHECK(hsdp_unit_write(&two, 0, 0, 10, w2, HSDP_F32) == HSDP_OK);
        char *pooled = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, one.layout.total_bytes);
        char *copy = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, one.layout.total_bytes);
        void *scratch = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, two.layout.total_bytes);
        CHECK(pooled && copy && scratch && hsdp_unit_gather(&two, scratch) == HSDP_OK); /* two's shard uploaded */
        CHECK(pooled && hsdp_unit_gather(&one, pooled) == HSDP_OK);
        device_sync();
        CHECK(dev->consumer_wait(1, (long long)(uintptr_t)reader, pooled, sizeof w) == HSDP_OK);
        F.hold(reader, 1); /* its read is queued, not done */
        CHECK(F.memcpy_async(copy, pooled, sizeof w, hsdp_cudaMemcpyDefault, reader) == hsdp_cudaSuccess);
        hsdp_buffers_released(b, HSDP_DEVICE_BACKEND); /* the buffer goes back to the pool ... */
        hsdp_gather_req rr;
        memset(&rr, 0, sizeof rr);
        CHECK(hsdp_unit_gather_start(&two, pooled, NULL, &rr) == HSDP_OK); /* ... and is gathered into again */
        CHECK(hsdp_unit_gather_wait(&two, &rr) == HSDP_OK);
        CHECK(F.settle(comm) > 0); /* the gather waits for the reader */
        F.hold(reader, 0);
        CHECK(F.stream_sync(reader) == hsdp_cudaSuccess);
        device_sync();
        CHECK(copy && memcmp(copy, w, sizeof w) == 0);     /* the reader saw the bytes it imported */
        CHECK(pooled && memcmp(pooled, w2, sizeof w2) == 0); /* and the gather landed after it */
        hsdp_buffers_released(b, HSDP_DEVICE_BACKEND);
        hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, pooled, one.layout.total_bytes);
        hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, copy, one.layout.total_bytes);
        hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, scratch, two.layout.total_bytes);
        hsdp_unit_free(&one);
        hsdp_unit_free(&two);
        /* the reader lives on (a pool stream): hsdp records its release events until finalize */
    }

    CHECK(hsdp_unit_write(&u, 0, 0, 10, w, HSDP_F32) == HSDP_ESTATE); /* fixed from the first gather */
    void *host_full = malloc(u.layout.total_bytes);
    CHECK(host_full && hsdp_unit_gather(&u, host_full) == HSDP_OK && memcmp(host_full, w, sizeof w) == 0);
    free(host_full);

    /* gathers in flight while the side stream is busy: the backend's polling of their events
     * (cudaErrorNotReady) leaves no error for the framework's next launch check, and the
     * watchdog polls them from its own thread on the backend's device */
    void *full2[2] = {hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, u.layout.total_bytes),
                      hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, u.layout.total_bytes)};
    CHECK(full2[0] && full2[1]);
    F.hold(comm, 1);
    hsdp_gather_req reqs[2];
    memset(reqs, 0, sizeof reqs);
    for (int i = 0; i < 2; i++) CHECK(hsdp_unit_gather_start(&u, full2[i], NULL, &reqs[i]) == HSDP_OK);
    CHECK(F.get_last_error() == hsdp_cudaSuccess);
    CHECK(F.wait_queries(3)); /* the watchdog has polled the pending gathers */
    for (int i = 0; i < 2; i++) CHECK(hsdp_unit_gather_wait(&u, &reqs[i]) == HSDP_OK);
    F.hold(comm, 0);
    device_sync();
    CHECK(memcmp(full2[1], w, sizeof w) == 0);
    hsdp_buffers_released(b, HSDP_DEVICE_BACKEND);
    for (int i = 0; i < 2; i++) hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, full2[i], u.layout.total_bytes);
    hsdp_unit_free(&u);

    /* asked to, the unit keeps its host chunk */
    setenv("HSDP_KEEP_HOST_SHARDS", "1", 1);
    hsdp_unit ku;
    CHECK(hsdp_unit_init(&ku, numels, dts, NULL, 2, sub, &stats) == HSDP_OK);
    CHECK(hsdp_unit_write(&ku, 0, 0, 10, w, HSDP_F32) == HSDP_OK);
    void *kfull = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, ku.layout.total_bytes);
    CHECK(kfull && hsdp_unit_gather(&ku, kfull) == HSDP_OK && ku.shard != NULL);
    CHECK(ku.shard && memcmp(ku.shard, w, sizeof w) == 0);
    unsetenv("HSDP_KEEP_HOST_SHARDS");
    hsdp_buffers_released(b, HSDP_DEVICE_BACKEND);
    hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, kfull, ku.layout.total_bytes);
    hsdp_unit_free(&ku);

    /* a unit gathered into host memory on NCCL: staged, and fixed after its first gather too */
    hsdp_unit hu;
    CHECK(hsdp_unit_init(&hu, numels, dts, NULL, 2, sub, &stats) == HSDP_OK);
    CHECK(hsdp_unit_write(&hu, 0, 0, 10, w, HSDP_F32) == HSDP_OK);
    void *hfull = malloc(hu.layout.total_bytes);
    CHECK(hfull && hsdp_unit_gather(&hu, hfull) == HSDP_OK && memcmp(hfull, w, sizeof w) == 0);
    CHECK(strcmp(hsdp_share_kind(sub, hu.share), "collective") == 0);
    CHECK(hsdp_unit_write(&hu, 0, 0, 10, w, HSDP_F32) == HSDP_ESTATE);
    free(hfull);
    hsdp_unit_free(&hu);

    wire_unit(sub, fake, 1);

    /* a thread that never chose a device enters the backend */
    pthread_t t;
    void *thread_ok = NULL;
    CHECK(pthread_create(&t, NULL, other_thread, sub) == 0 && pthread_join(t, &thread_ok) == 0);
    CHECK(thread_ok == (void *)1);
    CHECK(F.contexts() == 1u << DEVICE); /* no thread made a context on device 0 */

    if (strcmp(ending, "clean") == 0) {
        /* R7: a group still held at finalize (a DeviceMesh freed only at interpreter exit) has its
         * communicator torn down by finalize, while CUDA and NCCL are whole; freeing the group
         * after releases memory only */
        hsdp_group *kept = NULL;
        CHECK(hsdp_group_split(world, 0, 0, &kept) == HSDP_OK && kept);
        CHECK(hsdp_barrier(kept) == HSDP_OK);
        hsdp_group_free(sub);
        hsdp_group_free(world);
        CHECK(F.live_comms() == 1);
        CHECK(hsdp_backend_finalize("nccl") == HSDP_OK);
        CHECK(F.live_comms() == 0);
        if (kept) hsdp_group_free(kept);
        CHECK(F.violations() == 0);
        return;
    }
    if (strcmp(ending, "race") == 0) {
        /* the world's communicator fails while this thread is inside a collective on another
         * (non-blocking, still in progress): the watchdog must not abort it under this thread */
        CHECK(hsdp_set_timeout(30) == HSDP_OK);
        char *d = hsdp_device_alloc(&stats, b, HSDP_DEVICE_BACKEND, 64);
        F.comm_control(1, 0, 1);                     /* sub: its collectives stay in progress */
        F.comm_control(0, hsdp_ncclSystemError, 0); /* world: an asynchronous error */
        CHECK(d && hsdp_all_gather(sub, d, d, 64) == HSDP_ECOMM);
        CHECK(strstr(hsdp_last_error(), "asynchronous error") != NULL);
        CHECK(F.violations() == 0); /* no call on an aborted communicator, no abort under a call */
        hsdp_device_free(&stats, b, HSDP_DEVICE_BACKEND, d, 64);
    } else {
        /* a collective that never completes: the watchdog (or the waiting call) aborts, naming it */
        CHECK(hsdp_set_timeout(0.3) == HSDP_OK);
        setenv("FAKE_STALL", "1", 1);
        CHECK(hsdp_all_gather(sub, host_send, host_recv, sizeof host_send) == HSDP_ECOMM);
        CHECK(strstr(hsdp_last_error(), "all-gather of 16 bytes per rank over 1 ranks") != NULL);
        CHECK(strstr(hsdp_last_error(), "HSDP_TIMEOUT") != NULL);
        setenv("FAKE_STALL", "0", 1);
    }
    CHECK(hsdp_barrier(world) == HSDP_ECOMM); /* every later call: the communicators are aborted */
    CHECK(strstr(hsdp_last_error(), "the NCCL communicators were aborted") != NULL);
    CHECK(F.get_last_error() == hsdp_cudaSuccess);
    hsdp_group_free(sub);
    hsdp_group_free(world);
    CHECK(hsdp_backend_finalize("nccl") == HSDP_OK);
    CHECK(F.violations() == 0);
    CHECK(F.dead_streams() == 0); /* no work given to a stream after its end (a reader's release) */
    CHECK(F.contexts() == 1u << DEVICE);
}

enum { MAX_TEST_RANKS = 8 };

/* Ranks that disagree on the unit they gather fail together (agreement.h): rank 0 gathers
 * one unit while the others gather another of the same size, synchronously: every rank fails
 * naming what each asked for, and none hands out the buffer. The group still works after (all
 * gather the same unit: the numbers are right). Then they disagree in a started gather: its
 * wait returns (the tickets are compared late, backend_nccl.c), and the drain at the end of
 * the forward fails on every rank, naming what each asked for, and aborts the communicators
 * (sizes: rank 0 gathers a unit of another size, synchronously: every rank fails, aborted). */
static void desync(hsdp_group *world, int rank, hsdp_stats *stats, int sizes) {
    const hsdp_backend *b = hsdp_backend_find("nccl");
    size_t small[1] = {16 * (size_t)world->size}, big[1] = {32 * (size_t)world->size};
    hsdp_dtype f32[1] = {HSDP_F32};
    hsdp_unit a, other, large;
    CHECK(hsdp_unit_init(&a, small, f32, NULL, 1, world, stats) == HSDP_OK);
    CHECK(hsdp_unit_init(&other, small, f32, NULL, 1, world, stats) == HSDP_OK);
    CHECK(hsdp_unit_init(&large, big, f32, NULL, 1, world, stats) == HSDP_OK);
    float w[16 * MAX_TEST_RANKS];
    for (size_t i = 0; i < small[0]; i++) w[i] = (float)i + 0.5f;
    CHECK(hsdp_unit_write(&a, 0, 0, small[0], w, HSDP_F32) == HSDP_OK);
    void *full = hsdp_device_alloc(stats, b, HSDP_DEVICE_BACKEND, large.layout.total_bytes);
    CHECK(full != NULL);
    if (!full) return;
    hsdp_unit *mine = rank == 0 ? &a : &other;
    char ask0[96], ask1[96];
    snprintf(ask0, sizeof ask0, "rank 0 asks for unit '' (the group's unit #%llu as made", (unsigned long long)a.ident);
    snprintf(ask1, sizeof ask1, "rank 1 asks for unit '' (the group's unit #%llu as made", (unsigned long long)other.ident);

    CHECK(hsdp_unit_gather(mine, full) == HSDP_ECOMM);
    CHECK(strstr(hsdp_last_error(), "do not gather the same unit") != NULL);
    CHECK(strstr(hsdp_last_error(), ask0) != NULL && strstr(hsdp_last_error(), ask1) != NULL);

    hsdp_gather_req req;
    memset(&req, 0, sizeof req);
    CHECK(hsdp_unit_gather_start(&a, full, NULL, &req) == HSDP_OK);
    CHECK(hsdp_unit_gather_wait(&a, &req) == HSDP_OK);
    CHECK(hsdp_nccl_agreement_drain() == HSDP_OK);
    device_sync();
    CHECK(memcmp(full, w, small[0] * sizeof(float)) == 0);

    memset(&req, 0, sizeof req);
    if (sizes) {
        mine = rank == 0 ? &large : &a;
        CHECK(hsdp_unit_gather(mine, full) == HSDP_ECOMM);
        char bytes0[48];
        snprintf(bytes0, sizeof bytes0, "%zu bytes per rank", large.layout.chunk_bytes);
        CHECK(strstr(hsdp_last_error(), "do not gather the same unit") != NULL && strstr(hsdp_last_error(), bytes0));
    } else {
        CHECK(hsdp_unit_gather_start(mine, full, NULL, &req) == HSDP_OK);
        CHECK(hsdp_unit_gather_wait(mine, &req) == HSDP_OK); /* compared late */
        CHECK(hsdp_nccl_agreement_drain() == HSDP_ECOMM);
        CHECK(strstr(hsdp_last_error(), ask0) != NULL && strstr(hsdp_last_error(), ask1) != NULL);
        CHECK(strstr(hsdp_last_error(), "found after the gather's wait had returned") != NULL);
    }
    CHECK(hsdp_barrier(world) == HSDP_ECOMM && strstr(hsdp_last_error(), "aborted") != NULL);
    hsdp_device_free(stats, b, HSDP_DEVICE_BACKEND, full, large.layout.total_bytes);
    hsdp_unit_free(&a);
    hsdp_unit_free(&other);
    hsdp_unit_free(&large);
}

/* Ring attention's point to point between ranks, on device buffers: each rank sends to the
 * next and receives from the one before (hsdp_sendrecv), then the other way round, started
 * and waited, several rounds with a collective of the same communicator between them. */
static void ring_sendrecv(hsdp_group *g, hsdp_stats *stats) {
    const hsdp_backend *b = hsdp_backend_find("nccl");
    int n = g->size, me = g->rank, next = (me + 1) % n, prev = (me + n - 1) % n;
    enum { N = 96 };
    unsigned char *send = hsdp_device_alloc(stats, b, HSDP_DEVICE_BACKEND, N);
    unsigned char *recv = hsdp_device_alloc(stats, b, HSDP_DEVICE_BACKEND, N);
    CHECK(send && recv);
    if (!send || !recv) return;
    memset(send, me + 1, N);
    memset(recv, 0, N);
    CHECK(hsdp_sendrecv(g, send, N, next, recv, N, prev) == HSDP_OK);
    device_sync();
    CHECK(recv[0] == prev + 1 && recv[N - 1] == prev + 1);
    for (int round = 0; round < 3; round++) {
        memset(send, 10 * round + me, N);
        hsdp_req r;
        memset(&r, 0, sizeof r);
        CHECK(hsdp_sendrecv_start(&r, g, send, N, prev, recv, N, next) == HSDP_OK);
        CHECK(hsdp_gather_wait(&r) == HSDP_OK);
        device_sync();
        CHECK(recv[0] == 10 * round + next && recv[N - 1] == 10 * round + next);
        CHECK(hsdp_barrier(g) == HSDP_OK);
    }
    hsdp_device_free(stats, b, HSDP_DEVICE_BACKEND, send, N);
    hsdp_device_free(stats, b, HSDP_DEVICE_BACKEND, recv, N);
}

/* One rank of a world of several (forked processes over the fake's shared memory), ending in
 * a timeout (ending "timeout") or in ranks that disagree ("desync"). */
static void one_rank(const unsigned char *id, int rank, int n, const char *ending) {
    hsdp_group *world = NULL, *sub = NULL;
    int we_init = 0;
    CHECK(hsdp_nccl_set_bootstrap(id, rank, n, rank % 2) == HSDP_OK);
    CHECK(hsdp_backend_world("nccl", &world, &we_init) == HSDP_OK && world);
    if (!world) return;
    CHECK(world->size == n && world->rank == rank);
    CHECK(hsdp_barrier(world) == HSDP_OK);
    CHECK(hsdp_group_split(world, 0, rank, &sub) == HSDP_OK && sub && sub->size == n && sub->rank == rank);
    if (!sub) return;

    /* host buffers, staged: every rank's contribution lands in rank order */
    int mine[2] = {rank * 10, rank * 10 + 1}, all[2 * MAX_TEST_RANKS] = {0};
    CHECK(hsdp_all_gather(sub, mine, all, sizeof mine) == HSDP_OK);
    for (int r = 0; r < n; r++) CHECK(all[2 * r] == r * 10 && all[2 * r + 1] == r * 10 + 1);
    int b[2] = {rank, rank};
    CHECK(hsdp_broadcast(sub, b, sizeof b, n - 1) == HSDP_OK && b[0] == n - 1 && b[1] == n - 1);
    int send[MAX_TEST_RANKS], recv[MAX_TEST_RANKS];
    for (int q = 0; q < n; q++) send[q] = rank * 100 + q, recv[q] = -1;
    CHECK(hsdp_all_to_all(sub, send, recv, sizeof(int)) == HSDP_OK);
    for (int r = 0; r < n; r++) CHECK(recv[r] == r * 100 + rank);

    /* a unit sharded over the ranks: each keeps its chunk; every gather gives each the whole */
    hsdp_stats stats;
    hsdp_stats_init(&stats);
    const hsdp_backend *b_nccl = hsdp_backend_find("nccl");
    size_t numels[2] = {40, 6};
    hsdp_dtype dts[2] = {HSDP_F32, HSDP_BF16};
    hsdp_unit u;
    CHECK(hsdp_unit_init(&u, numels, dts, NULL, 2, world, &stats) == HSDP_OK);
    float w[40];
    for (int i = 0; i < 40; i++) w[i] = (float)i * 0.25f;
    CHECK(hsdp_unit_write(&u, 0, 0, 40, w, HSDP_F32) == HSDP_OK);
    for (int round = 0; round < 2; round++) {
        void *full = hsdp_device_alloc(&stats, b_nccl, HSDP_DEVICE_BACKEND, u.layout.total_bytes);
        hsdp_gather_req req;
        memset(&req, 0, sizeof req);
        CHECK(full && hsdp_unit_gather_start(&u, full, NULL, &req) == HSDP_OK);
        CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK);
        device_sync();
        CHECK(full && memcmp(full, w, sizeof w) == 0);
        hsdp_buffers_released(b_nccl, HSDP_DEVICE_BACKEND);
        hsdp_device_free(&stats, b_nccl, HSDP_DEVICE_BACKEND, full, u.layout.total_bytes);
    }
    /* L2: a started gather's wait orders the compute stream and returns; the host does not
     * wait for the gather (nor its agreement tickets) to land: with the side stream held well
     * past the timeout the wait returns at once, and the tickets are compared later (the
     * drain that ends a forward). Before, the wait held the host on the tickets' copy. */
    {
        uint64_t limit = hsdp_timeout_ns();
        CHECK(hsdp_set_timeout(1.0) == HSDP_OK);
        hsdp_cudaStream_t comm = hsdp_nccl_comm_stream();
        void *full = hsdp_device_alloc(&stats, b_nccl, HSDP_DEVICE_BACKEND, u.layout.total_bytes);
        hsdp_gather_req req;
        memset(&req, 0, sizeof req);
        F.hold(comm, 1);
        CHECK(full && hsdp_unit_gather_start(&u, full, NULL, &req) == HSDP_OK);
        uint64_t t0 = hsdp_now_ns();
        CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK);
        CHECK(hsdp_now_ns() - t0 < 500000000ull); /* well inside the timeout: it did not wait */
        F.hold(comm, 0);
        CHECK(hsdp_nccl_agreement_drain() == HSDP_OK);
        device_sync();
        CHECK(full && memcmp(full, w, sizeof w) == 0);
        hsdp_buffers_released(b_nccl, HSDP_DEVICE_BACKEND);
        hsdp_device_free(&stats, b_nccl, HSDP_DEVICE_BACKEND, full, u.layout.total_bytes);
        CHECK(hsdp_set_timeout((double)limit / 1e9) == HSDP_OK);
    }
    hsdp_unit_free(&u);
    ring_sendrecv(sub, &stats);
    wire_unit(world, getenv("TEST_NCCL_FAKE"), 0);

    if (strncmp(ending, "desync", 6) == 0) {
        desync(world, rank, &stats, strcmp(ending, "desync-sizes") == 0);
    } else {
        /* rank 1 never arrives at a collective the others make, waiting in another: they end in
         * an error naming it, and what it waits in, within the timeout; rank 1 (with a longer
         * one, so that it still waits when they time out) ends in its own */
        CHECK(hsdp_set_timeout(rank == 1 ? 1.5 : 0.5) == HSDP_OK);
        char barrier[64];
        snprintf(barrier, sizeof barrier, "rank 1 (waiting in a barrier over %d ranks)", n);
        if (rank != 1) {
            CHECK(hsdp_all_gather(world, mine, all, sizeof mine) == HSDP_ECOMM);
            char want[96];
            snprintf(want, sizeof want, "an all-gather of 8 bytes per rank over %d ranks", n);
            CHECK(strstr(hsdp_last_error(), want) != NULL && strstr(hsdp_last_error(), "HSDP_TIMEOUT") != NULL);
            CHECK(strstr(hsdp_last_error(), barrier) != NULL);
            CHECK(hsdp_barrier(sub) == HSDP_ECOMM);
        } else {
            CHECK(hsdp_barrier(sub) == HSDP_ECOMM && strstr(hsdp_last_error(), "HSDP_TIMEOUT") != NULL);
        }
    }
    CHECK(F.get_last_error() == hsdp_cudaSuccess);
    hsdp_group_free(sub);
    hsdp_group_free(world);
    CHECK(hsdp_backend_finalize("nccl") == HSDP_OK);
    CHECK(F.violations() == 0);
}

/* A world of n ranks: forked from this process once it has the unique id (the fake's shared
 * memory is inherited), rank 0 here. */
static void several_ranks(const char *fake, int n, const char *ending) {
    CHECK(n >= 2 && n <= MAX_TEST_RANKS);
    CHECK(setenv("TEST_NCCL_FAKE", fake, 1) == 0); /* for wire_unit in every rank */
    CHECK(hsdp_nccl_load(fake, fake) == HSDP_OK);
    CHECK(find_fake(fake));
    unsigned char id[HSDP_NCCL_ID_BYTES];
    CHECK(hsdp_nccl_unique_id(id) == HSDP_OK);
    if (check_failed || n < 2 || n > MAX_TEST_RANKS) return;
    printf("test_nccl: fake NCCL %d, a world of %d ranks\n", hsdp_nccl_version(), n);
    fflush(stdout);
    pid_t kids[MAX_TEST_RANKS] = {0};
    for (int r = 1; r < n; r++) {
        kids[r] = fork();
        if (kids[r] == 0) {
            one_rank(id, r, n, ending);
            if (check_failed) fprintf(stderr, "test_nccl: rank %d: %d failed\n", r, check_failed);
            fflush(NULL);
            _exit(check_failed ? 1 : 0);
        }
        CHECK(kids[r] > 0);
    }
    one_rank(id, 0, n, ending);
    for (int r = 1; r < n; r++) {
        int status = 0;
        CHECK(kids[r] > 0 && waitpid(kids[r], &status, 0) == kids[r] && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
}

/* Before any loading, with LIBS as the (nccl, cudart) pair that loads in this mode. */
static void unloaded(const char *nccl, const char *cudart) {
    CHECK(hsdp_nccl_built());
    CHECK(!hsdp_nccl_loaded() && hsdp_nccl_version() == 0);

    /* the registry knows it; unloaded it is not usable, and says what loads it */
    const hsdp_backend *b = hsdp_backend_find("nccl");
    CHECK(b != NULL);
    hsdp_group *g = NULL;
    int we_init = 1;
    CHECK(hsdp_backend_world("nccl", &g, &we_init) == HSDP_EUNSUPPORTED && g == NULL && we_init == 0);
    CHECK(strstr(hsdp_last_error(), "built but its libraries are not loaded") != NULL);

    /* a path that is not there is named; nothing is left loaded */
    CHECK(hsdp_nccl_load("/nonexistent/libnccl.so.2", cudart) == HSDP_EUNSUPPORTED);
    CHECK(strstr(hsdp_last_error(), "could not open the NCCL library '/nonexistent/libnccl.so.2'") != NULL);
    CHECK(hsdp_nccl_load(nccl, "/nonexistent/libcudart.so") == HSDP_EUNSUPPORTED);
    CHECK(strstr(hsdp_last_error(), "could not open the CUDA runtime '/nonexistent/libcudart.so'") != NULL);
    CHECK(!hsdp_nccl_loaded());
    /* a library that is no NCCL (the C library's libm): its missing symbol is named */
    CHECK(hsdp_nccl_load("libm.so.6", cudart) == HSDP_EUNSUPPORTED);
    CHECK(strstr(hsdp_last_error(), "'libm.so.6' has no symbol ncclGetVersion") != NULL);
    CHECK(hsdp_nccl_load("", cudart) == HSDP_EINVAL);
    CHECK(!hsdp_nccl_loaded());

    unsigned char id[HSDP_NCCL_ID_BYTES] = {0};
    CHECK(hsdp_nccl_unique_id(id) == HSDP_ESTATE);
    CHECK(hsdp_nccl_set_bootstrap(id, 2, 2, 0) == HSDP_EINVAL);
    CHECK(strstr(hsdp_last_error(), "rank 2 is outside a world of 2") != NULL);
    CHECK(hsdp_nccl_set_bootstrap(id, 0, 1, -1) == HSDP_EINVAL);
}

/* The real libraries: on a machine without a GPU, the runtime's own error, nothing loaded. */
static void real_libraries(const char *nccl, const char *cudart) {
    hsdp_status st = hsdp_nccl_load(nccl, cudart);
    if (st == HSDP_OK) {
        printf("test_nccl: a GPU is present: NCCL %d loaded\n", hsdp_nccl_version());
        CHECK(hsdp_nccl_version() >= 21800);
    } else {
        CHECK(st == HSDP_ENODEVICE); /* typed: the Python error is RuntimeError without reading the text */
        CHECK(strstr(hsdp_last_error(), "no usable GPU for the NCCL backend") != NULL);
        CHECK(!hsdp_nccl_loaded() && hsdp_nccl_version() == 0);
        printf("test_nccl: no GPU: %s\n", hsdp_last_error());
    }
}

/* The kernel's source through the real NVRTC (no GPU needed to compile; the driver is only
 * opened): for an sm_90 device a CUBIN (an ELF image), for a device newer than every
 * architecture NVRTC knows PTX for the newest one, whose entry point is the kernel, with the
 * scale multiply neither fused nor flushing, and the parameters read in place, in no local
 * memory (issue 30, D7); a device older than every one is refused, naming the range. */
static int real_nvrtc(const char *nvrtc, const char *driver) {
    hsdp_status st = hsdp_wire_cuda_load(nvrtc, driver);
    if (st != HSDP_OK) fprintf(stderr, "test_nccl: %s\n", hsdp_last_error());
    CHECK(st == HSDP_OK);
    CHECK(hsdp_wire_cuda_image() == NULL); /* nothing is loaded into a context */
    hsdp_wire_cuda_blob cubin = {0}, ptx = {0}, none = {0};
    st = hsdp_wire_cuda_compile(90, &cubin);
    if (st != HSDP_OK) fprintf(stderr, "test_nccl: %s\n", hsdp_last_error());
    CHECK(st == HSDP_OK && cubin.cubin && cubin.arch == 90 && cubin.size > 1024);
    CHECK(cubin.data && memcmp(cubin.data, "\x7f" "ELF", 4) == 0);
    st = hsdp_wire_cuda_compile(999, &ptx); /* compute capability 99.9 */
    if (st != HSDP_OK) fprintf(stderr, "test_nccl: %s\n", hsdp_last_error());
    CHECK(st == HSDP_OK && !ptx.cubin && ptx.arch >= 90 && ptx.arch < 999);
    const char *text = ptx.data;
    char target[32];
    snprintf(target, sizeof target, ".target sm_%d\n", ptx.arch);
    CHECK(text && strlen(text) + 1 == ptx.size && strstr(text, target));
    CHECK(text && strstr(text, ".entry hsdp_wire_dequant(") && strstr(text, "mul.rn.f32"));
    CHECK(text && !strstr(text, "fma.") && !strstr(text, ".ftz"));
    CHECK(text && !strstr(text, ".local") && !strstr(text, "__local_depot"));
    CHECK(hsdp_wire_cuda_compile(10, &none) == HSDP_EUNSUPPORTED && none.data == NULL);
    CHECK(strstr(hsdp_last_error(), "compute capability 1.0 is older than any NVRTC") != NULL);
    printf("test_nccl: NVRTC '%s' compiled the float8 wire's kernel: cubin sm_90 (%zu bytes), and for a newer device "
           "ptx compute_%d (%zu bytes)\n", nvrtc, cubin.size, ptx.arch, ptx.size);
    free(cubin.data);
    free(ptx.data);
    return check_report();
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--nvrtc") == 0) return real_nvrtc(argv[2], argv[3]);
    if (argc < 3 || argc > 6 || !*argv[1] || !*argv[2]) {
        fprintf(stderr, "usage: %s LIBNCCL LIBCUDART | %s --fake FAKE_CUDA_NCCL [stall|race|ranks N [desync|desync-sizes]]\n", argv[0],
                argv[0]);
        return 2;
    }
    int fake = strcmp(argv[1], "--fake") == 0;
    const char *nccl = fake ? argv[2] : argv[1], *cudart = argv[2];
    unloaded(nccl, cudart);
    if (fake)
        if (argc >= 5 && strcmp(argv[3], "ranks") == 0)
            several_ranks(argv[2], atoi(argv[4]), argc == 6 ? argv[5] : "timeout");
        else
            fake_world(argv[2], argc >= 4 ? argv[3] : "stall");
    else
        real_libraries(nccl, cudart);
    return check_report();
}
