/* bench_direct_widen.c - where a direct gather of a NumPy unit spends its time: one 8 MiB
 * bfloat16 unit on 2 ranks (4 MiB chunk each), widened to float32 as the NumPy adapter needs,
 * in two processes at once (as two ranks on one host run), each reading the other's chunk with
 * process_vm_readv as csrc/mpi_direct.c does. Per unit, the parts and the wholes:
 *   own copy       this rank's chunk into the gathered bfloat16 buffer (memcpy)
 *   peer read      the peer's chunk into it (process_vm_readv)
 *   widen, scalar  the 8 MiB into 16 MiB of float32, one element a step (the loop the -O2 build
 *                  made of hsdp_cast's bfloat16 widening before it was vectorised)
 *   widen, hsdp    the same through hsdp_cast (vectorised: widen_bf16 in csrc/dtype.c)
 *   gather, ...    own copy + peer read + widen: the gather as built, with either widening
 *   fused, ...     no bfloat16 buffer: the own chunk widened straight from the shard, the peer's
 *                  read in 256 KiB pieces into a bounce buffer and widened from there
 * Before each timed step both processes meet (a pipe) and, unless the second argument is 0,
 * walk 64 MiB to push the buffers out of cache, as a block's compute does between gathers.
 *   gcc -std=gnu11 -O2 -Icsrc bench/bench_direct_widen.c csrc/dtype.c csrc/error.c -o /tmp/bench_direct_widen
 *   /tmp/bench_direct_widen [piece KiB, default 256] [evict 1|0, default 1] [runs, default 21]
 * Prints each process's median and minimum ms per unit; the fused variants are checked
 * bit-identical to the gather's. Each process reads the other's memory, as ranks do: with Yama,
 * ptrace_scope must be 0 (direct gathers need the same; they fall back to MPI otherwise). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hsdp.h"

enum { CHUNK = 4 << 20, N = CHUNK / 2, EVICT = 64 << 20, MAXRUNS = 101 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* What main's -O2 build compiled hsdp_cast's bfloat16 -> float32 loop to: one element a step. */
__attribute__((noinline, optimize("no-tree-vectorize"))) static void widen_scalar(void *d, const void *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t x;
        memcpy(&x, (const char *)s + 2 * i, 2);
        uint32_t y = (uint32_t)x << 16;
        memcpy((char *)d + 4 * i, &y, 4);
    }
}

static void widen_hsdp(void *d, const void *s, size_t n) {
    if (hsdp_cast(d, HSDP_F32, s, HSDP_BF16, n) != HSDP_OK) abort();
}

static void peer_read(pid_t pid, void *dst, const void *addr, size_t n) {
    for (size_t done = 0; done < n;) {
        struct iovec l = {(char *)dst + done, n - done}, r = {(char *)addr + done, n - done};
        ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got <= 0) {
            perror("process_vm_readv");
            exit(1);
        }
        done += (size_t)got;
    }
}

static void meet(int rank, const int *to_child, const int *to_parent) {
    char c = 0;
    if (rank) {
        if (write(to_parent[1], &c, 1) != 1 || read(to_child[0], &c, 1) != 1) exit(1);
    } else if (read(to_parent[0], &c, 1) != 1 || write(to_child[1], &c, 1) != 1) {
        exit(1);
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    size_t piece = (argc > 1 ? (size_t)atoi(argv[1]) : 256) << 10;
    int evict = argc > 2 ? atoi(argv[2]) : 1, runs = argc > 3 ? atoi(argv[3]) : 21;
    if (piece == 0 || piece > CHUNK || piece % 2 || runs < 1 || runs > MAXRUNS) {
        fprintf(stderr, "bad arguments: piece KiB in 1..4096, runs in 1..%d\n", MAXRUNS);
        return 2;
    }
    /* Both chunks before the fork, so each sits at the same address in both processes: a
     * process reads its peer's at the address of its own copy of the other one. */
    uint16_t *shard[2];
    for (int r = 0; r < 2; r++) {
        shard[r] = aligned_alloc(64, CHUNK);
        for (size_t i = 0; i < N; i++) shard[r][i] = (uint16_t)(i * 7919u + (unsigned)r * 104729u);
    }
    int to_child[2], to_parent[2];
    if (pipe(to_child) || pipe(to_parent)) return 1;
    pid_t parent = getpid(), child = fork();
    if (child < 0) return 1;
    int rank = child == 0;
    pid_t peer = rank ? parent : child;
    const uint16_t *own = shard[rank], *theirs = shard[!rank];
    unsigned char *full = aligned_alloc(64, 2 * CHUNK), *bounce = aligned_alloc(64, piece);
    uint32_t *wide = aligned_alloc(64, 8 * (size_t)N), *want = aligned_alloc(64, 8 * (size_t)N);
    char *trash = malloc(EVICT);
    if (!full || !bounce || !wide || !want || !trash) return 1;
    memset(full, 1, 2 * CHUNK); /* every page touched before timing */
    memset(wide, 1, 8 * (size_t)N);
    memset(trash, 0, EVICT);
    enum { OWN, PEER, W_SCALAR, W_HSDP, G_SCALAR, G_HSDP, F_SCALAR, F_HSDP, V };
    static const char *name[V] = {"own copy (4 MiB)", "peer read (4 MiB)", "widen, scalar (8 -> 16 MiB)",
                                  "widen, hsdp_cast", "gather + scalar widen", "gather + hsdp_cast widen",
                                  "fused, scalar widen", "fused, hsdp_cast widen"};
    static double t[V][MAXRUNS];
    for (int rep = 0; rep < runs; rep++)
        for (int v = 0; v < V; v++) {
            void (*widen)(void *, const void *, size_t) =
                v == W_SCALAR || v == G_SCALAR || v == F_SCALAR ? widen_scalar : widen_hsdp;
            meet(rank, to_child, to_parent);
            if (evict)
                for (size_t i = 0; i < EVICT; i += 64) trash[i]++;
            double t0 = now();
            if (v == OWN || v == G_SCALAR || v == G_HSDP) memcpy(full + (size_t)rank * CHUNK, own, CHUNK);
            if (v == PEER || v == G_SCALAR || v == G_HSDP) peer_read(peer, full + (size_t)!rank * CHUNK, theirs, CHUNK);
            if (v == W_SCALAR || v == W_HSDP || v == G_SCALAR || v == G_HSDP) widen(wide, full, 2 * (size_t)N);
            if (v == F_SCALAR || v == F_HSDP) {
                widen(wide + (size_t)rank * N, own, N);
                uint32_t *dst = wide + (size_t)!rank * N;
                for (size_t off = 0; off < CHUNK; off += piece) {
                    size_t m = CHUNK - off < piece ? CHUNK - off : piece;
                    peer_read(peer, bounce, (const char *)theirs + off, m);
                    widen(dst + off / 2, bounce, m / 2);
                }
            }
            t[v][rep] = now() - t0;
            if (v == G_HSDP) memcpy(want, wide, 8 * (size_t)N);
            if ((v == F_SCALAR || v == F_HSDP) && memcmp(want, wide, 8 * (size_t)N)) {
                fprintf(stderr, "process %d: %s differs from the gather's bytes\n", rank, name[v]);
                return 1;
            }
        }
    if (rank) meet(rank, to_child, to_parent); /* the parent prints first */
    for (int v = 0; v < V; v++) {
        qsort(t[v], (size_t)runs, sizeof t[v][0], cmp);
        printf("process %d (piece %zu KiB, evict %d, %d runs): %-28s median %6.3f ms  min %6.3f ms\n", rank,
               piece >> 10, evict, runs, name[v], t[v][runs / 2] * 1e3, t[v][0] * 1e3);
    }
    fflush(stdout);
    if (!rank) {
        meet(rank, to_child, to_parent);
        int status = 0;
        waitpid(child, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    return 0;
}
