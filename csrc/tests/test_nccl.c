/* test_nccl.c - the NCCL backend without a GPU, in one of two modes (one process each, since
 * a process loads its NCCL once):
 *   test_nccl LIBNCCL LIBCUDART   the real libraries: libraries that are not there are named,
 *                                 and a machine with no GPU is said to have none (nothing stays
 *                                 loaded); with a GPU, the library loads.
 *   test_nccl --fake FAKE         fake_cuda_nccl.so (one "GPU" of host memory, a world of one)
 *                                 as both libraries: the backend's own logic runs, whether or
 *                                 not the machine has a GPU: joining, splits, unit gathers from
 *                                 the shard's device copy, staging of host buffers, both
 *                                 all-to-all forms, and the watchdog's timeout.
 * Both modes first check what holds before any loading: built, registered, unusable and
 * saying why, refusing the unique id and bad bootstraps, and naming what fails to load.
 * Neither needs a CUDA or NCCL header. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "backend_nccl.h"
#include "check.h"

static void fake_world(const char *fake) {
    CHECK(hsdp_nccl_load(fake, fake) == HSDP_OK);
    int version = hsdp_nccl_version();
    printf("test_nccl: fake NCCL %d\n", version);
    unsigned char id[HSDP_NCCL_ID_BYTES];
    CHECK(hsdp_nccl_unique_id(id) == HSDP_OK && id[1] == 8);
    hsdp_group *world = NULL, *sub = NULL;
    int we_init = 0;
    CHECK(hsdp_backend_world("nccl", &world, &we_init) == HSDP_ESTATE); /* no bootstrap yet */
    CHECK(strstr(hsdp_last_error(), "needs its bootstrap first") != NULL);
    CHECK(hsdp_nccl_set_bootstrap(id, 0, 1, 0) == HSDP_OK);
    CHECK(hsdp_backend_world("nccl", &world, &we_init) == HSDP_OK && we_init == 1);
    if (!world) return;
    CHECK(world->size == 1 && world->rank == 0 && hsdp_group_overlaps(world));
    CHECK(hsdp_group_split(world, 0, 0, &sub) == HSDP_OK && sub && sub->size == 1 && sub->rank == 0);
    CHECK(hsdp_nccl_comm_stream() != NULL);

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

    /* device buffers go straight to NCCL */
    hsdp_stats stats;
    hsdp_stats_init(&stats);
    const hsdp_backend *b = hsdp_backend_find("nccl");
    char *dsend = hsdp_device_alloc(&stats, b, HSDP_DEVICE_CUDA, 64), *drecv = hsdp_device_alloc(&stats, b, HSDP_DEVICE_CUDA, 64);
    CHECK(dsend && drecv);
    if (dsend && drecv) {
        memset(dsend, 7, 64);
        CHECK(hsdp_all_to_all(sub, dsend, drecv, 64) == HSDP_OK && drecv[63] == 7);
        /* ring attention's point to point, to this rank itself: grouped ncclSend/ncclRecv */
        memset(dsend, 9, 64);
        CHECK(hsdp_sendrecv(sub, dsend, 64, 0, drecv, 64, 0) == HSDP_OK && drecv[0] == 9 && drecv[63] == 9);
        hsdp_req pr;
        memset(dsend, 5, 64);
        CHECK(hsdp_sendrecv_start(&pr, sub, dsend, 64, 0, drecv, 64, 0) == HSDP_OK);
        CHECK(hsdp_gather_wait(&pr) == HSDP_OK && drecv[63] == 5);
        CHECK(hsdp_sendrecv(sub, host_send, 8, 0, host_recv, 8, 0) == HSDP_EUNSUPPORTED); /* host memory */
        hsdp_device_free(&stats, b, HSDP_DEVICE_CUDA, dsend, 64);
        hsdp_device_free(&stats, b, HSDP_DEVICE_CUDA, drecv, 64);
    }

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
    for (int round = 0; round < 3; round++) {
        void *full = hsdp_device_alloc(&stats, b, HSDP_DEVICE_CUDA, u.layout.total_bytes);
        hsdp_gather_req req;
        memset(&req, 0, sizeof req);
        CHECK(full && hsdp_unit_gather_start(&u, full, NULL, &req) == HSDP_OK);
        CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK);
        CHECK(full && memcmp(full, w, sizeof w) == 0);
        CHECK(strcmp(hsdp_share_kind(sub, u.share), "device") == 0);
        hsdp_buffers_released(b, HSDP_DEVICE_CUDA);
        hsdp_device_free(&stats, b, HSDP_DEVICE_CUDA, full, u.layout.total_bytes);
    }
    CHECK(hsdp_unit_write(&u, 0, 0, 10, w, HSDP_F32) == HSDP_ESTATE); /* fixed from the first gather */
    void *host_full = malloc(u.layout.total_bytes);
    CHECK(host_full && hsdp_unit_gather(&u, host_full) == HSDP_OK && memcmp(host_full, w, sizeof w) == 0);
    free(host_full);
    hsdp_unit_free(&u);

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

    /* a collective that never completes: the watchdog (or the waiting call) aborts, naming it */
    CHECK(hsdp_set_timeout(0.3) == HSDP_OK);
    setenv("FAKE_STALL", "1", 1);
    CHECK(hsdp_all_gather(sub, host_send, host_recv, sizeof host_send) == HSDP_ECOMM);
    CHECK(strstr(hsdp_last_error(), "all-gather of 16 bytes per rank over 1 ranks") != NULL);
    CHECK(strstr(hsdp_last_error(), "HSDP_TIMEOUT") != NULL);
    setenv("FAKE_STALL", "0", 1);
    CHECK(hsdp_barrier(world) == HSDP_ECOMM); /* every later call: the communicators are aborted */
    CHECK(strstr(hsdp_last_error(), "the NCCL communicators were aborted") != NULL);
    hsdp_group_free(sub);
    hsdp_group_free(world);
    CHECK(hsdp_backend_finalize("nccl") == HSDP_OK);
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
        CHECK(st == HSDP_EUNSUPPORTED);
        CHECK(strstr(hsdp_last_error(), "no usable GPU for the NCCL backend") != NULL);
        CHECK(!hsdp_nccl_loaded() && hsdp_nccl_version() == 0);
        printf("test_nccl: no GPU: %s\n", hsdp_last_error());
    }
}

int main(int argc, char **argv) {
    if (argc != 3 || !*argv[1] || !*argv[2]) {
        fprintf(stderr, "usage: %s LIBNCCL LIBCUDART | %s --fake FAKE_CUDA_NCCL\n", argv[0], argv[0]);
        return 2;
    }
    int fake = strcmp(argv[1], "--fake") == 0;
    const char *nccl = fake ? argv[2] : argv[1], *cudart = argv[2];
    unloaded(nccl, cudart);
    if (fake)
        fake_world(argv[2]);
    else
        real_libraries(nccl, cudart);
    return check_report();
}
