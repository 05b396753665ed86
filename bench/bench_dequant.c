/* bench_dequant.c - ns per weight of the float8 wire's host decode (hsdp_dequantize_blocks),
 * into bfloat16, float16 and float32, over a warm destination (no page faults timed); and with
 * streaming stores (hsdp_dequantize_blocks_streaming, what a gathered unit of 8 MiB or more
 * gets). With `cold` as the third argument, 64 MiB are written between runs, so
 * that the codes and the destination start out of the caches, as in a gather.
 * Built like the extension's dtype.c (-O2; the decode loops carry their own O3/target
 * attributes):
 *   gcc -std=c11 -O2 -Icsrc bench/bench_dequant.c csrc/dtype.c csrc/error.c -o /tmp/bench_dequant
 *   /tmp/bench_dequant [weights, default 8388608] [runs, default 15] [cold]
 * Prints, per destination dtype, the minimum over the runs of wall time (CLOCK_MONOTONIC) and
 * of this thread's CPU time (CLOCK_THREAD_CPUTIME_ID): on a shared machine the minimum is the
 * run least disturbed by other work. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hsdp.h"

static double now(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)8 << 20;
    int runs = argc > 2 ? atoi(argv[2]) : 15, cold = argc > 3 && strcmp(argv[3], "cold") == 0;
    size_t evict_bytes = (size_t)64 << 20;
    unsigned char *evict = cold ? malloc(evict_bytes) : NULL;
    if (cold && !evict) return 1;
    size_t nb = (n + HSDP_WIRE_BLOCK - 1) / HSDP_WIRE_BLOCK;
    uint8_t *q = malloc(n);
    float *sc = malloc(nb * sizeof *sc);
    void *dst = aligned_alloc(64, n * 4);
    if (!q || !sc || !dst) return 1;
    uint64_t x = 88172645463325252u;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        q[i] = (uint8_t)x == 0x7F || (uint8_t)x == 0xFF ? 0x7E : (uint8_t)x; /* typical: no NaN */
    }
    for (size_t b = 0; b < nb; b++) sc[b] = 0.02f / 448.0f * (float)(1 + b % 7);
    memset(dst, 0, n * 4);
    const struct { hsdp_dtype dt; const char *name; int stream; } kinds[] = {
        {HSDP_BF16, "bfloat16", 0}, {HSDP_BF16, "bfloat16, streaming", 1}, {HSDP_F16, "float16", 0},
        {HSDP_F16, "float16, streaming", 1},  {HSDP_F32, "float32", 0},  {HSDP_F32, "float32, streaming", 1}};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        double best_wall = 1e30, best_cpu = 1e30;
        for (int r = 0; r < runs; r++) {
            if (cold) memset(evict, r, evict_bytes);
            double w0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
            if ((kinds[k].stream ? hsdp_dequantize_blocks_streaming : hsdp_dequantize_blocks)(dst, kinds[k].dt, q, sc,
                                                                                              n) != HSDP_OK)
                return 1;
            double c1 = now(CLOCK_THREAD_CPUTIME_ID), w1 = now(CLOCK_MONOTONIC);
            if (w1 - w0 < best_wall) best_wall = w1 - w0;
            if (c1 - c0 < best_cpu) best_cpu = c1 - c0;
        }
        printf("%-19s %zu weights%s: min wall %.2f ms (%.3f ns/weight), min cpu %.2f ms (%.3f ns/weight)\n",
               kinds[k].name, n, cold ? " (cold)" : "", best_wall * 1e3, best_wall * 1e9 / (double)n, best_cpu * 1e3,
               best_cpu * 1e9 / (double)n);
    }
    free(q);
    free(sc);
    free(dst);
    free(evict);
    return 0;
}
