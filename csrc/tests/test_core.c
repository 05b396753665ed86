/* test_core.c - the core without Python: mesh arithmetic, flat layout, a unit's life on the
 * world-of-one backend (found by name in the registry), the S-rank write path through
 * simulated shard groups, the worker thread the MPI backend runs on, the status answer a
 * rank gives its peers' watchdogs over TCP, and what a peer reads of what a rank waits in. */
#define _POSIX_C_SOURCE 200809L /* fileno */
#include <stdint.h>
#include <stdio.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../backend.h"
#include "../exec.h"
#include "../hsdp.h"
#include "../peer_status.h"
#include "../watchdog.h"
#include "check.h"

/* What a rank waits in, read by a peer from the rank's memory while the rank rewrites it
 * without pause (a forked child here, publishing two descriptions in turn): every read is
 * one whole description, never the start of one and the rest of the other, nor "in no
 * collective" while a rewrite is under way (watchdog.c's seqlock). Runs first: the child must not inherit a status thread, and the peers this
 * process learns are used by nothing after it. */
static void test_watch_publication(void) {
    char a[151], b[151];
    memset(a, 'a', sizeof a - 1);
    memset(b, 'b', sizeof b - 1);
    a[sizeof a - 1] = b[sizeof b - 1] = '\0';
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t child = fork();
    if (child == 0) {
        uint64_t rec[HSDP_PEER_WORDS];
        hsdp_peers_mine(rec);
        hsdp_watch_publish(a); /* before the parent reads: never "in no collective" */
        if (write(fds[1], rec, sizeof rec) != (ssize_t)sizeof rec) _exit(1);
        for (;;) { /* until the parent kills it */
            hsdp_watch_publish(a);
            hsdp_watch_publish(b);
        }
    }
    CHECK(child > 0);
    uint64_t all[2 * HSDP_PEER_WORDS] = {0}; /* rank 0: this process (not read); rank 1: the child */
    int got = child > 0 && read(fds[0], all + HSDP_PEER_WORDS, sizeof all / 2) == (ssize_t)(sizeof all / 2);
    CHECK(got);
    CHECK(!got || hsdp_peers_learn(all, 2, 0) == 0);
    int ranks[] = {1}, whole = 0;
    char want_a[256], want_b[256], out[640];
    snprintf(want_a, sizeof want_a, "; not in it: rank 1 (waiting in %s)", a);
    snprintf(want_b, sizeof want_b, "; not in it: rank 1 (waiting in %s)", b);
    for (int i = 0; got && i < 2000; i++) {
        hsdp_who_is_missing(out, sizeof out, "another collective", ranks, 1);
        int ok = strcmp(out, want_a) == 0 || strcmp(out, want_b) == 0;
        if (!ok && whole == i) fprintf(stderr, "test_watch_publication: read %d: '%.80s...'\n", i, out);
        whole += ok;
    }
    CHECK(whole == 2000);
    if (child > 0) {
        kill(child, SIGKILL);
        CHECK(waitpid(child, NULL, 0) == child);
    }
    close(fds[0]);
    close(fds[1]);
}

static void test_mesh(void) {
    hsdp_mesh m;
    CHECK(hsdp_mesh_init(&m, 8, 5, 2, 4) == HSDP_OK);
    CHECK(m.r == 1 && m.s == 1);
    int sg[4], rg[2];
    hsdp_mesh_shard_group(&m, sg);
    hsdp_mesh_replicate_group(&m, rg);
    CHECK(sg[0] == 4 && sg[1] == 5 && sg[2] == 6 && sg[3] == 7);
    CHECK(rg[0] == 1 && rg[1] == 5);
    CHECK(hsdp_mesh_init(&m, 8, 0, 2, -1) == HSDP_OK && m.shard == 4);
    CHECK(hsdp_mesh_init(&m, 8, 0, 3, -1) == HSDP_EINVAL);
    CHECK(strstr(hsdp_last_error(), "3") && strstr(hsdp_last_error(), "8"));
    CHECK(hsdp_mesh_init(&m, 8, 0, 2, 2) == HSDP_EINVAL);
    CHECK(strstr(hsdp_last_error(), "= 4") && strstr(hsdp_last_error(), "8"));
    CHECK(hsdp_mesh_init(&m, 4, 4, 1, 4) == HSDP_EINVAL);
    CHECK(hsdp_mesh_init(&m, 4, 0, 0, 4) == HSDP_EINVAL);
    CHECK(hsdp_mesh_init(&m, 4, 0, 1, 0) == HSDP_EINVAL);
    /* every (world, replicate) pair: coordinates invert rank_of */
    for (int w = 1; w <= 8; w++)
        for (int r = 1; r <= w; r++) {
            if (w % r) continue;
            for (int k = 0; k < w; k++) {
                CHECK(hsdp_mesh_init(&m, w, k, r, -1) == HSDP_OK);
                CHECK(hsdp_mesh_rank_of(&m, m.r, m.s) == k);
            }
        }
}

static void test_layout(void) {
    /* primes, one element, a zero-size parameter and mixed dtypes */
    size_t numels[] = {7, 1, 0, 13, 1021, 3};
    hsdp_dtype dts[] = {HSDP_F32, HSDP_BF16, HSDP_F32, HSDP_F8E4M3, HSDP_F16, HSDP_F64};
    for (int S = 1; S <= 8; S++) {
        hsdp_layout l;
        CHECK(hsdp_layout_init(&l, numels, dts, 6, S) == HSDP_OK);
        CHECK(l.total_bytes % ((size_t)HSDP_ALIGN * (size_t)S) == 0);
        CHECK(l.chunk_bytes * (size_t)S == l.total_bytes);
        CHECK(l.total_bytes >= l.used_bytes);
        for (size_t i = 0; i < l.nslots; i++) {
            CHECK(l.slots[i].offset % HSDP_ALIGN == 0);
            CHECK(l.slots[i].nbytes == numels[i] * hsdp_dtype_size(dts[i]));
            if (i) CHECK(l.slots[i].offset >= l.slots[i - 1].offset + l.slots[i - 1].nbytes);
            /* the ranks' owned ranges tile the parameter exactly, in order */
            size_t covered = 0;
            for (int s = 0; s < S; s++) {
                size_t b, e, off;
                if (!hsdp_layout_owned(&l, i, s, &b, &e, &off)) continue;
                CHECK(b == covered);
                CHECK(b % hsdp_dtype_size(dts[i]) == 0 && e % hsdp_dtype_size(dts[i]) == 0);
                CHECK(off + (e - b) <= l.chunk_bytes);
                CHECK((size_t)s * l.chunk_bytes + off == l.slots[i].offset + b);
                covered = e;
            }
            CHECK(covered == l.slots[i].nbytes);
        }
        hsdp_layout_free(&l);
    }
    hsdp_layout l;
    CHECK(hsdp_layout_init(&l, numels, dts, 0, 3) == HSDP_OK && l.total_bytes == 0 && l.chunk_bytes == 0);
    hsdp_layout_free(&l);
    CHECK(hsdp_layout_init(&l, numels, dts, 1, 0) == HSDP_EINVAL);
    hsdp_dtype bad = HSDP_DTYPE_COUNT;
    CHECK(hsdp_layout_init(&l, numels, &bad, 1, 1) == HSDP_ETYPE);
}

/* A group that reports rank s of S but never communicates: enough to exercise the write
 * path of every rank in one process; the test concatenates the shards itself. */
static hsdp_status fake_all_gather(hsdp_group *g, const void *s, void *r, size_t n) {
    (void)g, (void)s, (void)r, (void)n;
    return hsdp_fail(HSDP_ECOMM, "fake group");
}
static const hsdp_backend fake_backend = {.name = "fake", .all_gather = fake_all_gather};

static void test_unit_ranks(void) {
    size_t numels[] = {37, 1, 101, 5};
    hsdp_dtype dts[] = {HSDP_F32, HSDP_F32, HSDP_BF16, HSDP_F16};
    hsdp_dtype cts[] = {HSDP_F32, HSDP_F32, HSDP_F32, HSDP_F16}; /* bf16 computed in f32, as NumPy needs */
    float *src[4];
    for (int i = 0; i < 4; i++) {
        src[i] = malloc(numels[i] * sizeof(float)); /* owned here, freed below */
        for (size_t k = 0; k < numels[i]; k++) src[i][k] = (float)(i * 1000 + (int)k) * 0.25f;
    }
    for (int S = 1; S <= 5; S++) {
        hsdp_stats st;
        hsdp_stats_init(&st);
        hsdp_group groups[5];
        hsdp_unit units[5];
        for (int s = 0; s < S; s++) {
            groups[s] = (hsdp_group){.backend = &fake_backend, .rank = s, .size = S};
            CHECK(hsdp_unit_init(&units[s], numels, dts, cts, 4, &groups[s], &st) == HSDP_OK);
            /* param 2 written in two pieces, as a streaming loader would */
            CHECK(hsdp_unit_write(&units[s], 0, 0, 37, src[0], HSDP_F32) == HSDP_OK);
            CHECK(hsdp_unit_write(&units[s], 1, 0, 1, src[1], HSDP_F32) == HSDP_OK);
            CHECK(hsdp_unit_write(&units[s], 2, 0, 50, src[2], HSDP_F32) == HSDP_OK);
            CHECK(hsdp_unit_write(&units[s], 2, 50, 51, src[2] + 50, HSDP_F32) == HSDP_OK);
            CHECK(hsdp_unit_write(&units[s], 3, 0, 5, src[3], HSDP_F32) == HSDP_OK);
        }
        CHECK(st.sharded_bytes == units[0].layout.chunk_bytes * (size_t)S);
        size_t total = units[0].layout.total_bytes;
        unsigned char *full = malloc(total);                       /* owned here */
        float *wide = malloc(units[0].widened_bytes);              /* owned here */
        for (int s = 0; s < S; s++) memcpy(full + (size_t)s * units[0].layout.chunk_bytes, units[s].shard, units[0].layout.chunk_bytes);
        CHECK(hsdp_unit_widen(&units[0], full, wide) == HSDP_OK);
        const hsdp_slot *sl = units[0].layout.slots;
        CHECK(memcmp(full + sl[0].offset, src[0], 37 * 4) == 0);
        CHECK(memcmp(full + sl[1].offset, src[1], 4) == 0);
        const float *w2 = (const float *)((unsigned char *)wide + units[0].widen_offset[2]);
        int ok = 1;
        for (size_t k = 0; k < 101; k++) ok &= w2[k] == hsdp_bf16_to_f32(hsdp_f32_to_bf16(src[2][k]));
        CHECK(ok);
        uint16_t h;
        memcpy(&h, full + sl[3].offset + 2 * 4, 2);
        CHECK(hsdp_f16_to_f32(h) == src[3][4]);
        CHECK(units[0].widen_offset[0] == SIZE_MAX && units[0].widen_offset[3] == SIZE_MAX);
        /* out-of-range writes are refused */
        CHECK(hsdp_unit_write(&units[0], 4, 0, 1, src[0], HSDP_F32) == HSDP_EINVAL);
        CHECK(hsdp_unit_write(&units[0], 0, 30, 8, src[0], HSDP_F32) == HSDP_EINVAL);
        CHECK(hsdp_unit_write(&units[0], 0, 0, 1, src[0], HSDP_I32) == HSDP_ETYPE);
        CHECK(hsdp_unit_gather(&units[0], full) == HSDP_ECOMM);
        free(full);
        free(wide);
        for (int s = 0; s < S; s++) hsdp_unit_free(&units[s]);
        CHECK(st.sharded_bytes == 0);
    }
    for (int i = 0; i < 4; i++) free(src[i]);
}

static void test_unit_single(void) {
    hsdp_stats st;
    hsdp_stats_init(&st);
    hsdp_group *g = NULL;
    int we = 1;
    CHECK(hsdp_backend_world("single", &g, &we) == HSDP_OK && g->size == 1 && g->rank == 0 && we == 0);
    CHECK(hsdp_group_overlaps(g) == 0); /* no asynchronous slots: a started gather runs at once */
    size_t numels[] = {3, 4};
    hsdp_dtype dts[] = {HSDP_F32, HSDP_F8E5M2}, cts[] = {HSDP_F32, HSDP_F32};
    hsdp_unit u;
    /* a compute dtype the storage cannot convert to is refused, and nothing stays counted */
    hsdp_dtype bad[] = {HSDP_I32, HSDP_F32};
    CHECK(hsdp_unit_init(&u, numels, dts, bad, 2, g, &st) == HSDP_ETYPE && st.sharded_bytes == 0);
    /* every slot computed in its storage dtype: nothing to convert */
    CHECK(hsdp_unit_init(&u, numels, dts, NULL, 2, g, &st) == HSDP_OK && u.widened_bytes == 0);
    CHECK(u.widen_offset[0] == SIZE_MAX && u.widen_offset[1] == SIZE_MAX);
    hsdp_unit_free(&u);
    CHECK(hsdp_unit_init(&u, numels, dts, cts, 2, g, &st) == HSDP_OK);
    float a[3] = {1, 2, 3}, b[4] = {0.5f, -2, 1024, 3};
    CHECK(hsdp_unit_write(&u, 0, 0, 3, a, HSDP_F32) == HSDP_OK);
    CHECK(hsdp_unit_write(&u, 1, 0, 4, b, HSDP_F32) == HSDP_OK);
    void *full = hsdp_buffer_alloc(&st, u.layout.total_bytes); /* owned here */
    void *wide = hsdp_buffer_alloc(&st, u.widened_bytes);       /* owned here */
    CHECK(full && wide);
    CHECK(st.unsharded_bytes == u.layout.total_bytes + u.widened_bytes);
    CHECK(hsdp_unit_gather(&u, full) == HSDP_OK && st.gathers == 1);
    CHECK(hsdp_unit_widen(&u, full, wide) == HSDP_OK);
    CHECK(memcmp(full, a, sizeof a) == 0);
    CHECK(memcmp((unsigned char *)wide + u.widen_offset[1], b, sizeof b) == 0); /* all exact in e5m2 */
    /* started and waited through the request: inline on a backend without async slots */
    hsdp_gather_req req;
    memset(full, 0, u.layout.total_bytes);
    memset(wide, 0, u.widened_bytes);
    CHECK(hsdp_unit_gather_start(&u, full, wide, &req) == HSDP_OK && req.req.end_ns >= req.req.start_ns);
    CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK && st.gathers == 2);
    CHECK(memcmp(full, a, sizeof a) == 0 && memcmp((unsigned char *)wide + u.widen_offset[1], b, sizeof b) == 0);
    hsdp_buffer_free(&st, full, u.layout.total_bytes);
    hsdp_buffer_free(&st, wide, u.widened_bytes);
    CHECK(st.unsharded_bytes == 0 && st.peak_unsharded_bytes > 0 && st.buffer_allocs == 2);
    hsdp_unit_free(&u);
    CHECK(st.sharded_bytes == 0);
    /* collectives of the world of one */
    char x[8] = "abcdefg", y[8] = {0};
    CHECK(hsdp_all_gather(g, x, y, 8) == HSDP_OK && memcmp(x, y, 8) == 0);
    CHECK(hsdp_broadcast(g, x, 8, 0) == HSDP_OK && hsdp_broadcast(g, x, 8, 1) == HSDP_EINVAL);
    CHECK(hsdp_barrier(g) == HSDP_OK);
    char z[8] = {0};
    CHECK(hsdp_all_to_all(g, x, z, 8) == HSDP_OK && memcmp(x, z, 8) == 0);
    CHECK(hsdp_all_to_all(g, x, x + 1, 4) == HSDP_EINVAL); /* overlapping buffers are refused */
    hsdp_group *sub = NULL;
    CHECK(hsdp_group_split(g, 0, 0, &sub) == HSDP_OK && sub->size == 1);
    hsdp_group_free(sub);
    hsdp_group_free(g);
}

typedef struct {
    int *log, *n, id;
} order_arg;

static hsdp_status record(void *p) {
    order_arg *a = p;
    a->log[(*a->n)++] = a->id;
    return a->id == 7 ? hsdp_fail(HSDP_ECOMM, "task %d failed on purpose", a->id) : HSDP_OK;
}

static void test_exec(void) {
    hsdp_exec *ex = NULL;
    CHECK(hsdp_exec_start(&ex) == HSDP_OK);
    int log[33], n = 0;
    hsdp_task tasks[32];
    order_arg args[32];
    for (int i = 0; i < 32; i++) {
        args[i] = (order_arg){log, &n, i};
        tasks[i] = (hsdp_task){.fn = record, .arg = &args[i]};
        hsdp_exec_submit(ex, &tasks[i]);
    }
    int ok = 1;
    for (int i = 0; i < 32; i++) {
        hsdp_status st = hsdp_task_wait(ex, &tasks[i]);
        ok &= i == 7 ? st == HSDP_ECOMM : st == HSDP_OK;
        if (i == 7) CHECK(strstr(hsdp_last_error(), "task 7 failed on purpose") != NULL);
        ok &= tasks[i].end_ns >= tasks[i].start_ns && tasks[i].start_ns >= tasks[i].submit_ns;
    }
    CHECK(ok);
    CHECK(n == 32);
    for (int i = 0; i < 32; i++) ok &= log[i] == i; /* FIFO: collectives keep program order */
    CHECK(ok);
    hsdp_exec_stop(ex);
    order_arg late = {log, &n, 99};
    CHECK(hsdp_exec_run(ex, record, &late) == HSDP_OK && n == 33 && log[32] == 99); /* inline after stop */
    hsdp_exec_free(ex);
}

/* The registry by name. test_core is built without MPI: asking for it says what to install;
 * NCCL is known but not built; an unknown name lists the known ones. */
static void test_registry(void) {
    CHECK(hsdp_backend_count() == 4 && hsdp_backend_at(4) == NULL);
    /* the test-only fake device is never chosen by accident: it needs HSDP_FAKE_DEVICE=1 */
    const char *fake_why = NULL;
    unsetenv("HSDP_FAKE_DEVICE");
    CHECK(hsdp_backend_find("fakedev") == &hsdp_backend_fakedev && hsdp_backend_fakedev.usable(&fake_why) == 0);
    CHECK(fake_why && strstr(fake_why, "set HSDP_FAKE_DEVICE=1") != NULL);
    CHECK(hsdp_backend_find("single") == &hsdp_backend_single && hsdp_backend_find("mpi") == &hsdp_backend_mpi);
    CHECK(hsdp_backend_find("nccl") != NULL && hsdp_backend_find("tcp") == NULL && hsdp_backend_find(NULL) == NULL);
    const char *why = "unset";
    CHECK(hsdp_backend_single.usable(&why) == 1 && why == NULL);
    CHECK(hsdp_backend_mpi.usable(&why) == 0 && strstr(why, "apt-get install libopenmpi-dev") != NULL);
    for (size_t i = 0; i < hsdp_backend_count(); i++) {
        const hsdp_backend *b = hsdp_backend_at(i);
        /* every usable backend fills every required slot */
        if (b->usable(&why))
            CHECK(b->world && b->all_gather && b->broadcast && b->barrier && b->all_to_all && b->split && b->free);
        CHECK((b->gather_start == NULL) == (b->gather_wait == NULL)); /* the async pair comes together */
        /* a device table fills its required slots, and its name is no other device's */
        const hsdp_device_i *d = b->device;
        CHECK(!d || (d->name && d->framework && d->dlpack_type > 0 && d->alloc && d->free &&
                     strcmp(d->name, "host") != 0 && hsdp_device_backend(d->name) == b));
    }
    hsdp_group *g = (hsdp_group *)1;
    int we = 1;
    CHECK(hsdp_backend_world("mpi", &g, &we) == HSDP_EUNSUPPORTED && g == NULL && we == 0);
    CHECK(strstr(hsdp_last_error(), "apt-get install libopenmpi-dev openmpi-bin") != NULL);
    CHECK(hsdp_backend_world("nccl", &g, &we) == HSDP_EUNSUPPORTED && strstr(hsdp_last_error(), "NCCL") != NULL);
    CHECK(hsdp_backend_world("tcp", &g, &we) == HSDP_EINVAL);
    CHECK(strstr(hsdp_last_error(), "unknown backend 'tcp'; expected one of 'single', 'mpi', 'nccl'") != NULL);
    CHECK(hsdp_backend_finalize("mpi") == HSDP_OK && hsdp_backend_finalize("tcp") == HSDP_EINVAL);
    /* host buffers need no backend; a device buffer needs the backend's slot */
    hsdp_stats st;
    hsdp_stats_init(&st);
    CHECK(hsdp_device_alloc(&st, &hsdp_backend_single, HSDP_DEVICE_BACKEND, 64) == NULL);
    CHECK(strstr(hsdp_last_error(), "backend 'single' has no device: it cannot allocate device buffers") != NULL);
    void *p = hsdp_device_alloc(&st, &hsdp_backend_single, HSDP_DEVICE_HOST, 100);
    CHECK(p && st.unsharded_bytes == 100 && st.buffer_allocs == 1);
    hsdp_device_free(&st, &hsdp_backend_single, HSDP_DEVICE_HOST, p, 100);
    CHECK(st.unsharded_bytes == 0);
    /* device names come from the backends' device tables: no backend is named here */
    hsdp_device d;
    const char *label = NULL;
    CHECK(hsdp_device_parse("cuda", &d, &label) == 0 && d == HSDP_DEVICE_BACKEND && strcmp(label, "cuda") == 0);
    CHECK(hsdp_device_backend("cuda") == &hsdp_backend_nccl && hsdp_backend_device(&hsdp_backend_mpi) == NULL);
    CHECK(hsdp_device_parse("host", &d, NULL) == 0 && d == HSDP_DEVICE_HOST && hsdp_device_parse("tpu", &d, NULL) == -1);
}

/* hsdp_unit_read: exact bytes, a cast, and the refusals (past the end, a wrapping offset,
 * incompatible dtypes). The libFuzzer harness (fuzz_checkpoint.c) covers the rest. */
static void test_unit_read(void) {
    float vals[6] = {1, 2, 3, 4, 5, 6};
    FILE *f = tmpfile(); /* owned here, closed below */
    CHECK(f != NULL && fwrite(vals, sizeof vals, 1, f) == 1 && fflush(f) == 0);
    int fd = fileno(f);
    hsdp_stats st;
    hsdp_stats_init(&st);
    hsdp_group g = {.backend = &fake_backend, .rank = 0, .size = 1};
    size_t numels[] = {4, 2};
    hsdp_dtype dts[] = {HSDP_F32, HSDP_BF16};
    hsdp_unit u;
    CHECK(hsdp_unit_init(&u, numels, dts, NULL, 2, &g, &st) == HSDP_OK);
    size_t n = 0;
    CHECK(hsdp_unit_read(&u, 0, fd, 4, HSDP_F32, &n) == HSDP_OK && n == 16);
    CHECK(memcmp(u.shard, vals + 1, 16) == 0);
    CHECK(hsdp_unit_read(&u, 1, fd, 16, HSDP_F32, &n) == HSDP_OK && n == 8);
    uint16_t h[2];
    memcpy(h, u.shard + u.layout.slots[1].offset, sizeof h);
    CHECK(hsdp_bf16_to_f32(h[0]) == 5 && hsdp_bf16_to_f32(h[1]) == 6);
    CHECK(hsdp_unit_read(&u, 0, fd, 12, HSDP_F32, &n) == HSDP_EIO && n == 0);              /* past the end */
    CHECK(hsdp_unit_read(&u, 0, fd, UINT64_MAX - 8, HSDP_F32, &n) == HSDP_EINVAL && n == 0); /* wraps */
    CHECK(hsdp_unit_read(&u, 0, fd, 0, HSDP_I32, &n) == HSDP_ETYPE);
    CHECK(hsdp_unit_read(&u, 2, fd, 0, HSDP_F32, &n) == HSDP_EINVAL);
    hsdp_unit_free(&u);
    fclose(f);
}

static int waiting;
static int describe(char *what, size_t n) {
    snprintf(what, n, "%s", waiting ? "MPI_Barrier of 0 bytes over a group of 2 ranks" : "");
    return waiting;
}

/* Serve, then ask this very process: the answer follows what it waits in; a wrong cookie,
 * a closed port and no card get no answer, each within its time limit. */
static void test_peer_status(void) {
    hsdp_status_card card, again;
    hsdp_status_serve(describe, &card);
    CHECK(card.cookie != 0 && card.port > 0 && card.port < 65536 && card.addr[0] != 0);
    hsdp_status_serve(describe, &again); /* once per process: the same card */
    CHECK(again.cookie == card.cookie && again.port == card.port);
    char what[320] = "x";
    int active = -1;
    CHECK(hsdp_status_ask(&card, 2000, &active, what, sizeof what) == 1 && active == 0 && what[0] == '\0');
    waiting = 1;
    CHECK(hsdp_status_ask(&card, 2000, &active, what, sizeof what) == 1 && active == 1 &&
          strcmp(what, "MPI_Barrier of 0 bytes over a group of 2 ranks") == 0);
    char small[8];
    CHECK(hsdp_status_ask(&card, 2000, &active, small, sizeof small) == 1 && strcmp(small, "MPI_Bar") == 0);
    hsdp_status_card wrong = card;
    wrong.cookie ^= 1;
    CHECK(hsdp_status_ask(&wrong, 2000, &active, what, sizeof what) == 0);
    hsdp_status_card none = {0, 0, {0}};
    CHECK(hsdp_status_ask(&none, 2000, &active, what, sizeof what) == 0);
    hsdp_status_stop();
    hsdp_status_stop(); /* idempotent */
    CHECK(hsdp_status_ask(&card, 500, &active, what, sizeof what) == 0); /* nobody listens now */
}

/* What a wire gather of units[0..S) must give, before they are encoded: every rank's stored
 * piece of each slot, quantized and dequantized by the block functions where quant[i] is set,
 * copied where not, zeros in the padding. Returns a calloc'd buffer of layout.total_bytes,
 * the caller's to free. */
static unsigned char *wire_reference(const hsdp_unit *units, int S, size_t nslots, const hsdp_dtype *dts,
                                     const unsigned char *quant) {
    size_t chunk = units[0].layout.chunk_bytes;
    unsigned char *want = calloc(1, units[0].layout.total_bytes);
    CHECK(want != NULL);
    for (int s = 0; s < S && want; s++) {
        for (size_t i = 0; i < nslots; i++) {
            size_t b, e, off;
            if (!hsdp_layout_owned(&units[s].layout, i, s, &b, &e, &off)) continue;
            unsigned char *dst = want + (size_t)s * chunk + off;
            size_t n = (e - b) / hsdp_dtype_size(dts[i]);
            if (!quant[i]) {
                memcpy(dst, units[s].shard + off, e - b);
                continue;
            }
            uint8_t *q = malloc(n);                                      /* owned here */
            float *sc = malloc((n / HSDP_WIRE_BLOCK + 1) * sizeof *sc); /* owned here */
            CHECK(hsdp_quantize_blocks(q, sc, units[s].shard + off, dts[i], n) == HSDP_OK);
            CHECK(hsdp_dequantize_blocks(dst, dts[i], q, sc, n) == HSDP_OK);
            free(q);
            free(sc);
        }
    }
    return want;
}

/* A gathered unit of 8 MiB or more is decoded with streaming stores (unit.c,
 * DECODE_STREAM_BYTES): on 2 ranks, each chunk decodes to the bytes the block functions give,
 * the second parameter's piece starting off a 64-byte line. */
static void test_unit_wire_streaming(void) {
    enum { S = 2 };
    size_t numels[] = {(4u << 20) + 77, 300};
    hsdp_dtype dts[] = {HSDP_BF16, HSDP_BF16};
    unsigned char quant[] = {1, 1};
    size_t most = numels[0];
    float *src = malloc(most * sizeof *src); /* owned here */
    for (size_t k = 0; k < most; k++) src[k] = (float)sin((double)k * 0.37) * (k % 97 == 0 ? 40.0f : 0.05f);
    hsdp_stats st;
    hsdp_stats_init(&st);
    hsdp_group groups[S];
    hsdp_unit units[S];
    for (int s = 0; s < S; s++) {
        groups[s] = (hsdp_group){.backend = &fake_backend, .rank = s, .size = S};
        CHECK(hsdp_unit_init(&units[s], numels, dts, NULL, 2, &groups[s], &st) == HSDP_OK);
        for (size_t i = 0; i < 2; i++) CHECK(hsdp_unit_write(&units[s], i, 0, numels[i], src, HSDP_F32) == HSDP_OK);
        CHECK(hsdp_unit_set_wire(&units[s], HSDP_F8E4M3, quant) == HSDP_OK);
    }
    hsdp_unit *u = &units[0];
    size_t W = u->wire_chunk_bytes, total = u->layout.total_bytes;
    CHECK(total >= (8u << 20));
    unsigned char *want = wire_reference(units, S, 2, dts, quant); /* owned here */
    for (int s = 0; s < S; s++) CHECK(hsdp_unit_encode(&units[s]) == HSDP_OK);
    unsigned char *wire = malloc(W * S), *full = hsdp_buffer_alloc(&st, total); /* owned here */
    for (int s = 0; s < S; s++) memcpy(wire + (size_t)s * W, units[s].shard, W);
    memset(full, 0xAB, total);
    CHECK(hsdp_unit_decode(u, wire, full) == HSDP_OK);
    CHECK(memcmp(full, want, total) == 0);
    free(wire);
    hsdp_buffer_free(&st, full, total);
    free(want);
    free(src);
    for (int s = 0; s < S; s++) hsdp_unit_free(&units[s]);
}

/* A unit with a float8 wire: each rank's chunk is encoded alone, blocks start at each
 * parameter's piece, the decode of all the encodings rebuilds every piece exactly as the
 * block functions give it, slots not marked come back bit for bit, padding comes back zero,
 * and the shard (and sharded_bytes) shrinks to the encoding. */
static void test_unit_wire(void) {
    size_t numels[] = {300, 37, 5, 9, 1000};
    hsdp_dtype dts[] = {HSDP_BF16, HSDP_F32, HSDP_F16, HSDP_F8E5M2, HSDP_F32};
    unsigned char quant[] = {1, 0, 1, 0, 1};
    float *src = malloc(1000 * sizeof *src); /* owned here */
    for (size_t k = 0; k < 1000; k++) src[k] = (float)sin((double)k * 0.37) * (k % 97 == 0 ? 40.0f : 0.05f);
    for (int S = 1; S <= 5; S++) {
        hsdp_stats st;
        hsdp_stats_init(&st);
        hsdp_group groups[5];
        hsdp_unit units[5];
        for (int s = 0; s < S; s++) {
            groups[s] = (hsdp_group){.backend = &fake_backend, .rank = s, .size = S};
            CHECK(hsdp_unit_init(&units[s], numels, dts, NULL, 5, &groups[s], &st) == HSDP_OK);
            for (size_t i = 0; i < 5; i++)
                CHECK(hsdp_unit_write(&units[s], i, 0, numels[i], src, HSDP_F32) == HSDP_OK);
            CHECK(hsdp_unit_set_wire(&units[s], HSDP_F8E4M3, quant) == HSDP_OK);
        }
        hsdp_unit *u = &units[0];
        size_t chunk = u->layout.chunk_bytes, W = u->wire_chunk_bytes, total = u->layout.total_bytes;
        CHECK(W % HSDP_ALIGN == 0 && W < chunk);
        /* the stored copy of every rank's piece, decoded the slow way, before encoding */
        unsigned char *want = wire_reference(units, S, 5, dts, quant); /* owned here */
        for (int s = 0; s < S; s++) CHECK(hsdp_unit_encode(&units[s]) == HSDP_OK && units[s].wire_encoded);
        CHECK(hsdp_unit_encode(&units[0]) == HSDP_OK); /* twice: nothing more */
        CHECK(st.sharded_bytes == W * (size_t)S && hsdp_unit_shard_bytes(u) == W);
        /* fixed from now on, saying why */
        CHECK(hsdp_unit_write(u, 0, 0, 1, src, HSDP_F32) == HSDP_ESTATE && strstr(hsdp_last_error(), "float8"));
        unsigned char *wire = malloc(W * (size_t)S), *full = malloc(total); /* owned here */
        for (int s = 0; s < S; s++) memcpy(wire + (size_t)s * W, units[s].shard, W);
        memset(full, 0xAB, total); /* a reused buffer: the padding must come back zero */
        CHECK(hsdp_unit_decode(u, wire, full) == HSDP_OK);
        CHECK(memcmp(full, want, total) == 0);
        /* and close to the source: 2^-4 relative plus the bfloat16 rounding, or a block's
         * subnormal step */
        uint16_t h;
        int close = 1;
        for (size_t k = 0; k < 300; k++) {
            memcpy(&h, full + u->layout.slots[0].offset + 2 * k, 2);
            close &= fabs(hsdp_bf16_to_f32(h) - src[k]) <= fabs(src[k]) * 0.075 + 40.0 / 448 / 1024;
        }
        CHECK(close);
        CHECK(memcmp(full + u->layout.slots[1].offset, src, 37 * 4) == 0);
        free(wire);
        free(full);
        free(want);
        for (int s = 0; s < S; s++) hsdp_unit_free(&units[s]);
        CHECK(st.sharded_bytes == 0);
    }
    /* refusals: a marked slot that is not float32/16 or bfloat16, another wire dtype, twice */
    hsdp_stats st;
    hsdp_stats_init(&st);
    hsdp_group g1 = {.backend = &fake_backend, .rank = 0, .size = 1};
    hsdp_unit u;
    CHECK(hsdp_unit_init(&u, numels, dts, NULL, 5, &g1, &st) == HSDP_OK);
    unsigned char bad[] = {0, 0, 0, 1, 0}, none[] = {0, 0, 0, 0, 0};
    CHECK(hsdp_unit_set_wire(&u, HSDP_F8E4M3, bad) == HSDP_ETYPE && strstr(hsdp_last_error(), "parameter 3") &&
          strstr(hsdp_last_error(), "float8_e5m2"));
    CHECK(hsdp_unit_set_wire(&u, HSDP_F8E5M2, quant) == HSDP_ETYPE && strstr(hsdp_last_error(), "float8_e5m2"));
    CHECK(hsdp_unit_set_wire(&u, HSDP_F8E4M3, none) == HSDP_OK && u.quant == NULL); /* nothing to gain */
    CHECK(hsdp_unit_set_wire(&u, HSDP_F8E4M3, quant) == HSDP_OK && u.quant != NULL);
    CHECK(hsdp_unit_set_wire(&u, HSDP_F8E4M3, quant) == HSDP_ESTATE);
    hsdp_unit_free(&u);
    CHECK(st.sharded_bytes == 0);

    /* through the world of one: gather, started + waited, synchronous; the buffer the
     * encodings arrive in is accounted while held and given back after */
    hsdp_group *g = NULL;
    int we = 0;
    CHECK(hsdp_backend_world("single", &g, &we) == HSDP_OK);
    CHECK(hsdp_unit_init(&u, numels, dts, NULL, 5, g, &st) == HSDP_OK);
    for (size_t i = 0; i < 5; i++) CHECK(hsdp_unit_write(&u, i, 0, numels[i], src, HSDP_F32) == HSDP_OK);
    CHECK(hsdp_unit_set_wire(&u, HSDP_F8E4M3, quant) == HSDP_OK);
    void *full = hsdp_buffer_alloc(&st, u.layout.total_bytes), *ref = malloc(u.layout.total_bytes); /* owned here */
    CHECK(hsdp_unit_gather(&u, full) == HSDP_OK && u.wire_encoded); /* the first gather encodes */
    CHECK(st.unsharded_bytes == u.layout.total_bytes && st.peak_unsharded_bytes == u.layout.total_bytes + u.wire_chunk_bytes);
    memcpy(ref, full, u.layout.total_bytes);
    hsdp_gather_req req;
    memset(full, 0, u.layout.total_bytes);
    CHECK(hsdp_unit_gather_start(&u, full, NULL, &req) == HSDP_OK && req.wire != NULL);
    CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK && req.wire == NULL);
    CHECK(memcmp(full, ref, u.layout.total_bytes) == 0);
    memset(full, 0, u.layout.total_bytes);
    CHECK(hsdp_unit_gather_now(&u, full, NULL, &req) == HSDP_OK && req.wire == NULL);
    CHECK(memcmp(full, ref, u.layout.total_bytes) == 0);
    CHECK(st.unsharded_bytes == u.layout.total_bytes && st.gathers == 3);
    /* into the caller's buffer (a pooled one): nothing allocated, nothing freed */
    CHECK(hsdp_unit_wire_bytes(&u) == u.wire_chunk_bytes);
    void *wire = hsdp_buffer_alloc(&st, hsdp_unit_wire_bytes(&u)); /* owned here */
    uint64_t allocs = st.buffer_allocs;
    memset(full, 0, u.layout.total_bytes);
    CHECK(hsdp_unit_gather_start_wire(&u, full, NULL, wire, &req) == HSDP_OK && req.wire == wire && !req.wire_owned);
    CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK && memcmp(full, ref, u.layout.total_bytes) == 0);
    memset(full, 0, u.layout.total_bytes);
    CHECK(hsdp_unit_gather_now_wire(&u, full, NULL, wire, &req) == HSDP_OK);
    CHECK(memcmp(full, ref, u.layout.total_bytes) == 0 && st.buffer_allocs == allocs);
    hsdp_buffer_free(&st, wire, hsdp_unit_wire_bytes(&u));
    hsdp_buffer_free(&st, full, u.layout.total_bytes);
    free(ref);
    hsdp_unit_free(&u);
    CHECK(st.sharded_bytes == 0 && st.unsharded_bytes == 0);
    hsdp_group_free(g);
    free(src);
}

int main(void) {
    test_watch_publication();
    test_peer_status();
    test_registry();
    test_exec();
    test_mesh();
    test_layout();
    test_unit_ranks();
    test_unit_single();
    test_unit_wire();
    test_unit_wire_streaming();
    test_unit_read();
    return check_report();
}
