/* test_mpi.c - the MPI backend across real ranks (run under mpiexec), found by name in the
 * registry: a unit's gather rebuilds every parameter on every rank of each shard group of a
 * (2, S/2) or (1, S) mesh, broadcast over the replicate group copies replica 0's shard, the
 * asynchronous slots run gathers on the worker, and all_to_all exchanges blocks. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "check.h"

/* The test-only fakedev backend (backend_fakedev.c): MPI's collectives under its own name,
 * and a device of its own. Only with HSDP_FAKE_DEVICE=1; MPI is already running, so its
 * world starts nothing. A gather lands in a device buffer, counted apart from the host's. */
static void test_fakedev(void) {
    hsdp_group *fw = NULL, *half = NULL;
    int we = 1;
    unsetenv("HSDP_FAKE_DEVICE");
    CHECK(hsdp_backend_world("fakedev", &fw, &we) == HSDP_EUNSUPPORTED && fw == NULL);
    CHECK(strstr(hsdp_last_error(), "HSDP_FAKE_DEVICE=1") != NULL);
    setenv("HSDP_FAKE_DEVICE", "1", 1);
    CHECK(hsdp_backend_world("fakedev", &fw, &we) == HSDP_OK && we == 0 && fw->backend == &hsdp_backend_fakedev);
    CHECK(hsdp_group_split(fw, fw->rank % 2, fw->rank, &half) == HSDP_OK && half->backend == &hsdp_backend_fakedev);
    const hsdp_device_i *dev = hsdp_backend_device(fw->backend);
    CHECK(dev && strcmp(dev->name, "fakedev") == 0 && dev->dlpack_type == 1 && dev->live_bytes() == 0);
    hsdp_stats st;
    hsdp_stats_init(&st);
    size_t n = sizeof(int) * (size_t)fw->size;
    int *recv = hsdp_device_alloc(&st, fw->backend, HSDP_DEVICE_BACKEND, n); /* owned here */
    CHECK(recv && dev->live_bytes() == n && st.unsharded_bytes == n);
    int mine = 100 + fw->rank;
    CHECK(hsdp_all_gather(fw, &mine, recv, sizeof mine) == HSDP_OK);
    for (int r = 0; recv && r < fw->size; r++) CHECK(recv[r] == 100 + r);
    hsdp_buffers_released(fw->backend, HSDP_DEVICE_BACKEND); /* no streams: nothing to order */
    hsdp_device_free(&st, fw->backend, HSDP_DEVICE_BACKEND, recv, n);
    CHECK(dev->live_bytes() == 0 && st.unsharded_bytes == 0);
    CHECK(hsdp_barrier(half) == HSDP_OK);
    hsdp_group_free(half);
    hsdp_group_free(fw);
}

int main(void) {
    hsdp_group *world = NULL;
    int we_init = 0;
    if (hsdp_backend_world("mpi", &world, &we_init) != HSDP_OK) {
        fprintf(stderr, "%s\n", hsdp_last_error());
        return 2;
    }
    CHECK(we_init == 1);
    int W = world->size, R = W % 2 == 0 && W > 2 ? 2 : 1;
    hsdp_mesh m;
    CHECK(hsdp_mesh_init(&m, W, world->rank, R, -1) == HSDP_OK);
    hsdp_group *shard = NULL, *rep = NULL;
    CHECK(hsdp_group_split(world, m.r, m.s, &shard) == HSDP_OK && shard->size == m.shard && shard->rank == m.s);
    CHECK(hsdp_group_split(world, m.s, m.r, &rep) == HSDP_OK && rep->size == m.replicate && rep->rank == m.r);
    hsdp_stats st;
    hsdp_stats_init(&st);
    size_t numels[] = {1000, 3, 257};
    hsdp_dtype dts[] = {HSDP_F32, HSDP_BF16, HSDP_F16}, cts[] = {HSDP_F32, HSDP_F32, HSDP_F16};
    hsdp_unit u;
    CHECK(hsdp_unit_init(&u, numels, dts, cts, 3, shard, &st) == HSDP_OK);
    float *src = malloc(1000 * sizeof *src); /* owned here */
    for (int k = 0; k < 1000; k++) src[k] = (float)k * 0.5f;
    for (size_t i = 0; i < 3; i++) CHECK(hsdp_unit_write(&u, i, 0, numels[i], src, HSDP_F32) == HSDP_OK);
    void *full = hsdp_buffer_alloc(&st, u.layout.total_bytes); /* owned here */
    void *wide = hsdp_buffer_alloc(&st, u.widened_bytes);       /* owned here */
    /* replica r's shard becomes replica 0's (before the first gather: then it is fixed) */
    if (m.r != 0) memset(u.shard, 0xAB, u.layout.chunk_bytes);
    CHECK(hsdp_broadcast(rep, u.shard, u.layout.chunk_bytes, 0) == HSDP_OK);
    CHECK(strcmp(hsdp_share_kind(u.group, u.share), "unset") == 0);
    CHECK(hsdp_unit_gather(&u, full) == HSDP_OK);
    /* the first gather decided how later ones run: direct reads of the peers' shards here
     * (one host), or collective with one rank; the shard is fixed either way */
    CHECK(strcmp(hsdp_share_kind(u.group, u.share), shard->size > 1 ? "direct" : "collective") == 0);
    CHECK(hsdp_unit_write(&u, 0, 0, 1, src, HSDP_F32) == HSDP_ESTATE);
    CHECK(hsdp_unit_widen(&u, full, wide) == HSDP_OK);
    CHECK(memcmp((char *)full + u.layout.slots[0].offset, src, 1000 * sizeof(float)) == 0);
    CHECK(memcmp((char *)wide + u.widen_offset[1], src, 3 * sizeof(float)) == 0);
    uint16_t h;
    memcpy(&h, (char *)full + u.layout.slots[2].offset + 2 * 256, 2);
    CHECK(hsdp_f16_to_f32(h) == 128.0f);
    memset(full, 0, u.layout.total_bytes);
    CHECK(hsdp_unit_gather(&u, full) == HSDP_OK); /* the second gather: direct */
    CHECK(memcmp((char *)full + u.layout.slots[0].offset, src, 1000 * sizeof(float)) == 0);
    CHECK(hsdp_broadcast(rep, u.shard, 8, R) == HSDP_EINVAL);
    /* two gathers in flight on the worker at once, waited out of order */
    CHECK(hsdp_group_overlaps(shard) == 1 && shard->backend->gather_start != NULL);
    hsdp_unit u2;
    CHECK(hsdp_unit_init(&u2, numels, dts, cts, 3, shard, &st) == HSDP_OK);
    for (size_t i = 0; i < 3; i++) CHECK(hsdp_unit_write(&u2, i, 0, numels[i], src, HSDP_F32) == HSDP_OK);
    void *full2 = hsdp_buffer_alloc(&st, u2.layout.total_bytes); /* owned here */
    void *wide2 = hsdp_buffer_alloc(&st, u2.widened_bytes);       /* owned here */
    memset(full, 0, u.layout.total_bytes);
    hsdp_gather_req r1, r2;
    CHECK(hsdp_unit_gather_start(&u, full, wide, &r1) == HSDP_OK);
    CHECK(hsdp_unit_gather_start(&u2, full2, wide2, &r2) == HSDP_OK);
    CHECK(hsdp_unit_gather_wait(&u2, &r2) == HSDP_OK);
    CHECK(hsdp_unit_gather_wait(&u, &r1) == HSDP_OK);
    CHECK(r1.req.pending == 0 && r1.req.end_ns >= r1.req.start_ns && r1.req.start_ns >= r1.req.submit_ns);
    CHECK(memcmp((char *)full + u.layout.slots[0].offset, src, 1000 * sizeof(float)) == 0);
    CHECK(memcmp((char *)full2 + u2.layout.slots[0].offset, src, 1000 * sizeof(float)) == 0);
    CHECK(memcmp((char *)wide2 + u2.widen_offset[1], src, 3 * sizeof(float)) == 0);
    /* a synchronous gather runs on this thread when the worker is idle; its nested
     * collective must not wait for the queue lock it already holds */
    memset(full, 0, u.layout.total_bytes);
    CHECK(hsdp_unit_gather_now(&u, full, wide, &r1) == HSDP_OK);
    CHECK(memcmp((char *)full + u.layout.slots[0].offset, src, 1000 * sizeof(float)) == 0);
    CHECK(memcmp((char *)wide + u.widen_offset[1], src, 3 * sizeof(float)) == 0);
    /* the synchronous slot: on this thread while the worker is idle */
    memset(full, 0, u.layout.total_bytes);
    CHECK(hsdp_all_gather(shard, u.shard, full, u.layout.chunk_bytes) == HSDP_OK);
    CHECK(memcmp((char *)full + u.layout.slots[0].offset, src, 1000 * sizeof(float)) == 0);
    /* all_to_all: block j of rank i's send carries (i, j); it arrives as block i at rank j */
    int P = world->size;
    int *a2a_send = malloc((size_t)P * 2 * sizeof(int)), *a2a_recv = malloc((size_t)P * 2 * sizeof(int));
    for (int j = 0; j < P; j++) {
        a2a_send[2 * j] = world->rank;
        a2a_send[2 * j + 1] = j;
    }
    CHECK(hsdp_all_to_all(world, a2a_send, a2a_recv, 2 * sizeof(int)) == HSDP_OK);
    int a2a_ok = 1;
    for (int i = 0; i < P; i++) a2a_ok &= a2a_recv[2 * i] == i && a2a_recv[2 * i + 1] == world->rank;
    CHECK(a2a_ok);
    free(a2a_send);
    free(a2a_recv);
    /* ring attention's point to point: to the next rank, from the previous, sync and started */
    {
        int mine[3] = {world->rank, 7, -world->rank}, got[3] = {0};
        int next = (world->rank + 1) % P, prev = (world->rank + P - 1) % P;
        CHECK(hsdp_sendrecv(world, mine, sizeof mine, next, got, sizeof got, prev) == HSDP_OK);
        CHECK(got[0] == prev && got[1] == 7 && got[2] == -prev);
        hsdp_req pr;
        CHECK(hsdp_sendrecv_start(&pr, world, mine, sizeof mine, prev, got, sizeof got, next) == HSDP_OK);
        CHECK(hsdp_gather_wait(&pr) == HSDP_OK && got[0] == next && got[2] == -next);
        CHECK(hsdp_sendrecv(world, mine, sizeof mine, P, got, sizeof got, prev) == HSDP_EINVAL);
        CHECK(hsdp_sendrecv(world, mine, sizeof mine, world->rank, got, sizeof got, world->rank) == HSDP_OK);
        CHECK(got[0] == world->rank);
        if (P > 1) CHECK(hsdp_sendrecv(world, mine, sizeof mine, world->rank, got, sizeof got, prev) == HSDP_EINVAL);
    }
    /* a float8 wire across the ranks: the first gather encodes (collectively), the second
     * reads the peers' encodings directly, one more runs on the worker; all three agree and
     * stay within e4m3's 2^-4 of the source */
    hsdp_unit u3;
    unsigned char quant[] = {1, 1, 1};
    CHECK(hsdp_unit_init(&u3, numels, dts, NULL, 3, shard, &st) == HSDP_OK);
    for (size_t i = 0; i < 3; i++) CHECK(hsdp_unit_write(&u3, i, 0, numels[i], src, HSDP_F32) == HSDP_OK);
    CHECK(hsdp_unit_set_wire(&u3, HSDP_F8E4M3, quant) == HSDP_OK);
    size_t t3 = u3.layout.total_bytes;
    unsigned char *f3 = hsdp_buffer_alloc(&st, t3), *g3 = hsdp_buffer_alloc(&st, t3); /* owned here */
    CHECK(hsdp_unit_gather(&u3, f3) == HSDP_OK && u3.wire_encoded);
    CHECK(strcmp(hsdp_share_kind(u3.group, u3.share), shard->size > 1 ? "direct" : "collective") == 0);
    CHECK(hsdp_unit_gather(&u3, g3) == HSDP_OK && memcmp(f3, g3, t3) == 0);
    memset(g3, 0, t3);
    hsdp_gather_req r3;
    CHECK(hsdp_unit_gather_start(&u3, g3, NULL, &r3) == HSDP_OK && hsdp_unit_gather_wait(&u3, &r3) == HSDP_OK);
    CHECK(memcmp(f3, g3, t3) == 0);
    CHECK(r3.decoded == shard->size); /* each chunk decoded as it was read, none after */
    int close3 = 1;
    for (size_t k = 0; k < 1000; k++) {
        float v;
        memcpy(&v, f3 + u3.layout.slots[0].offset + 4 * k, 4);
        close3 &= v >= src[k] * (1 - 0x1p-4f) - 1e-3f && v <= src[k] * (1 + 0x1p-4f) + 1e-3f;
    }
    CHECK(close3);
    hsdp_buffer_free(&st, f3, t3);
    hsdp_buffer_free(&st, g3, t3);
    hsdp_unit_free(&u3);
    /* the collective path (tickets beside the data) over the whole world, chunks uneven (1260
     * elements over W ranks, three dtypes): each chunk decoded as it lands, this rank's while
     * the peers' are in flight, is byte for byte the decode after the whole gather */
    {
        hsdp_unit u4;
        CHECK(setenv("HSDP_DIRECT_GATHER", "0", 1) == 0); /* read by the unit's first gather */
        CHECK(hsdp_unit_init(&u4, numels, dts, NULL, 3, world, &st) == HSDP_OK);
        for (size_t i = 0; i < 3; i++) CHECK(hsdp_unit_write(&u4, i, 0, numels[i], src, HSDP_F32) == HSDP_OK);
        CHECK(hsdp_unit_set_wire(&u4, HSDP_F8E4M3, quant) == HSDP_OK);
        size_t t4 = u4.layout.total_bytes;
        unsigned char *f4 = hsdp_buffer_alloc(&st, t4), *g4 = hsdp_buffer_alloc(&st, t4); /* owned here */
        CHECK(hsdp_unit_gather(&u4, f4) == HSDP_OK); /* all of it decoded after the gather */
        CHECK(unsetenv("HSDP_DIRECT_GATHER") == 0);
        CHECK(strcmp(hsdp_share_kind(u4.group, u4.share), "collective") == 0);
        hsdp_gather_req r4;
        memset(g4, 0xCD, t4);
        CHECK(hsdp_unit_gather_start(&u4, g4, NULL, &r4) == HSDP_OK && hsdp_unit_gather_wait(&u4, &r4) == HSDP_OK);
        CHECK(memcmp(f4, g4, t4) == 0 && r4.decoded == world->size);
        memset(g4, 0xCD, t4);
        CHECK(hsdp_unit_gather_now(&u4, g4, NULL, &r4) == HSDP_OK);
        CHECK(memcmp(f4, g4, t4) == 0 && r4.decoded == world->size);
        /* in pieces of 64 bytes (a block is 128 weights: pieces end mid-block and before the
         * scales are all in), each decoded as it lands; then each rank splitting its own way
         * (the tickets say how; 0: one message): byte for byte the decode after the gather */
        size_t was = hsdp_wire_piece_bytes();
        for (int round = 0; round < 3; round++) {
            size_t mine[] = {64, world->rank % 2 ? 64 : 0, 64 * (size_t)(world->rank + 1)};
            hsdp_set_wire_piece_bytes(mine[round]);
            memset(g4, 0xCD, t4);
            CHECK(hsdp_unit_gather_start(&u4, g4, NULL, &r4) == HSDP_OK && hsdp_unit_gather_wait(&u4, &r4) == HSDP_OK);
            CHECK(memcmp(f4, g4, t4) == 0 && r4.decoded == world->size);
        }
        /* rank 0 gathers u4 in pieces, the others a larger unit in more pieces: every rank
         * fails on the tickets, none hangs; then they pair up again */
        hsdp_set_wire_piece_bytes(64);
        hsdp_unit u5;
        size_t numels5[] = {4000, 3, 257};
        float *src5 = calloc(4000, sizeof *src5); /* owned here */
        CHECK(src5 && setenv("HSDP_DIRECT_GATHER", "0", 1) == 0);
        CHECK(hsdp_unit_init(&u5, numels5, dts, NULL, 3, world, &st) == HSDP_OK);
        for (size_t i = 0; i < 3; i++) CHECK(hsdp_unit_write(&u5, i, 0, numels5[i], src5, HSDP_F32) == HSDP_OK);
        CHECK(hsdp_unit_set_wire(&u5, HSDP_F8E4M3, quant) == HSDP_OK);
        size_t t5 = u5.layout.total_bytes;
        unsigned char *f5 = hsdp_buffer_alloc(&st, t5); /* owned here */
        hsdp_gather_req r5;
        hsdp_status s5 = world->rank == 0 ? hsdp_unit_gather_start(&u4, g4, NULL, &r4)
                                          : hsdp_unit_gather_start(&u5, f5, NULL, &r5);
        if (s5 == HSDP_OK) s5 = world->rank == 0 ? hsdp_unit_gather_wait(&u4, &r4) : hsdp_unit_gather_wait(&u5, &r5);
        CHECK(s5 == HSDP_ECOMM && strstr(hsdp_last_error(), "do not gather the same unit"));
        CHECK(unsetenv("HSDP_DIRECT_GATHER") == 0);
        memset(g4, 0xCD, t4);
        CHECK(hsdp_unit_gather_start(&u4, g4, NULL, &r4) == HSDP_OK && hsdp_unit_gather_wait(&u4, &r4) == HSDP_OK);
        CHECK(memcmp(f4, g4, t4) == 0 && r4.decoded == world->size);
        hsdp_set_wire_piece_bytes(was);
        hsdp_buffer_free(&st, f5, t5);
        hsdp_unit_free(&u5);
        free(src5);
        hsdp_buffer_free(&st, f4, t4);
        hsdp_buffer_free(&st, g4, t4);
        hsdp_unit_free(&u4);
    }
    hsdp_buffer_free(&st, full2, u2.layout.total_bytes);
    hsdp_buffer_free(&st, wide2, u2.widened_bytes);
    hsdp_unit_free(&u2);
    CHECK(hsdp_barrier(world) == HSDP_OK);
    hsdp_buffer_free(&st, full, u.layout.total_bytes);
    hsdp_buffer_free(&st, wide, u.widened_bytes);
    hsdp_unit_free(&u);
    free(src);
    hsdp_group_free(rep);
    hsdp_group_free(shard);
    hsdp_group_free(world);
    test_fakedev();
    int rc = check_report();
    hsdp_backend_finalize("mpi");
    return rc;
}
