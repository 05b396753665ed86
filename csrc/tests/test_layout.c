/* test_layout.c - pins the flat layout against an independent formula, for random units
 * (numels, dtypes, zero-size parameters) and every shard size S in 1..8:
 *   offset_i = round_up(end_{i-1}, 64), end_i = offset_i + numel_i * itemsize_i,
 *   total = round_up(end_last, 64 * S), chunk = total / S,
 * and rank s's owned range of parameter i is [offset_i, end_i) intersected with
 * [s * chunk, (s + 1) * chunk): every byte of every parameter owned exactly once.
 * Catches, among others, a layout that places parameters after the first 64 bytes further
 * on (mutation 6 of the pre-refactor pins). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../hsdp.h"
#include "check.h"

#define MAX_PARAMS 24

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t next_rand(void) { /* xorshift64*: reproducible, no libc rand() */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static size_t below(size_t n) { return (size_t)(next_rand() % n); }

static size_t up(size_t x, size_t m) { return x % m ? x + (m - x % m) : x; }

static const size_t itemsize[HSDP_DTYPE_COUNT] = {
    [HSDP_F32] = 4, [HSDP_F16] = 2, [HSDP_BF16] = 2, [HSDP_F8E4M3] = 1, [HSDP_F8E5M2] = 1,
    [HSDP_F64] = 8, [HSDP_BOOL] = 1, [HSDP_U8] = 1,  [HSDP_I8] = 1,     [HSDP_U16] = 2,
    [HSDP_I16] = 2, [HSDP_U32] = 4, [HSDP_I32] = 4,  [HSDP_U64] = 8,    [HSDP_I64] = 8,
};

/* One unit at one shard size, against the formula above. */
static void check_unit(const size_t *numels, const hsdp_dtype *dts, size_t n, int S) {
    size_t off[MAX_PARAMS], nb[MAX_PARAMS], end = 0;
    for (size_t i = 0; i < n; i++) {
        size_t bytes = numels[i] * itemsize[dts[i]], a = bytes >= 256 ? 256 : bytes >= 128 ? 128 : 64;
        off[i] = up(end, a);
        nb[i] = numels[i] * itemsize[dts[i]];
        end = off[i] + nb[i];
    }
    size_t total = up(end, (size_t)64 * (size_t)S), chunk = total / (size_t)S;

    hsdp_layout l;
    CHECK(hsdp_layout_init(&l, numels, dts, n, S) == HSDP_OK);
    CHECK(l.nslots == n && l.shard == S);
    CHECK(l.used_bytes == end);
    CHECK(l.total_bytes == total);
    CHECK(l.chunk_bytes == chunk);
    for (size_t i = 0; i < n && i < l.nslots; i++) {
        CHECK(l.slots[i].offset == off[i]);
        CHECK(l.slots[i].nbytes == nb[i]);
        CHECK(l.slots[i].numel == numels[i]);
        CHECK(l.slots[i].dtype == dts[i]);
        /* owned ranges: as the intersection formula says, and together exactly once */
        unsigned char *seen = calloc(nb[i] ? nb[i] : 1, 1);
        CHECK(seen != NULL);
        if (!seen) break;
        for (int s = 0; s < S; s++) {
            size_t c0 = (size_t)s * chunk, c1 = c0 + chunk;
            size_t lo = off[i] > c0 ? off[i] : c0, hi = off[i] + nb[i] < c1 ? off[i] + nb[i] : c1;
            size_t b = 0, e = 0, co = 0;
            int owns = hsdp_layout_owned(&l, i, s, &b, &e, &co);
            CHECK(owns == (lo < hi));
            if (!owns) continue;
            CHECK(b == lo - off[i] && e == hi - off[i] && co == lo - c0);
            CHECK(b % itemsize[dts[i]] == 0 && e % itemsize[dts[i]] == 0);
            for (size_t k = b; k < e && k < nb[i]; k++) seen[k]++;
        }
        size_t once = 0;
        for (size_t k = 0; k < nb[i]; k++) once += seen[k] == 1;
        CHECK(once == nb[i]);
        free(seen);
    }
    hsdp_layout_free(&l);
}

static void test_fixed(void) {
    /* worked by hand (a parameter of 256 bytes or more starts at a multiple of 256, a smaller
     * one at 128 or 64; chunks are multiples of 64): 28 bytes at 0, 2 at 64, 0 at 128, 13 at
     * 128, 300 at 256, used 556, total 576 (3 chunks of 192) */
    size_t numels[] = {7, 1, 0, 13, 75};
    hsdp_dtype dts[] = {HSDP_F32, HSDP_BF16, HSDP_F32, HSDP_F8E4M3, HSDP_F32};
    hsdp_layout l;
    CHECK(hsdp_layout_init(&l, numels, dts, 5, 3) == HSDP_OK);
    CHECK(l.slots[0].offset == 0 && l.slots[1].offset == 64 && l.slots[2].offset == 128 && l.slots[3].offset == 128);
    CHECK(l.slots[4].offset == 256);
    CHECK(l.used_bytes == 556 && l.total_bytes == 576 && l.chunk_bytes == 192);
    size_t b, e, co;
    CHECK(hsdp_layout_owned(&l, 3, 0, &b, &e, &co) == 1 && b == 0 && e == 13 && co == 128);
    CHECK(hsdp_layout_owned(&l, 4, 1, &b, &e, &co) == 1 && b == 0 && e == 128 && co == 64);
    CHECK(hsdp_layout_owned(&l, 3, 1, &b, &e, &co) == 0);
    CHECK(hsdp_layout_owned(&l, 0, 0, &b, &e, &co) == 1 && b == 0 && e == 28 && co == 0);
    hsdp_layout_free(&l);
    check_unit(numels, dts, 5, 3);
}

static void test_random(void) {
    size_t numels[MAX_PARAMS];
    hsdp_dtype dts[MAX_PARAMS];
    for (int trial = 0; trial < 300; trial++) {
        size_t n = 1 + below(MAX_PARAMS);
        for (size_t i = 0; i < n; i++) {
            dts[i] = (hsdp_dtype)below(HSDP_DTYPE_COUNT);
            switch (below(4)) {
            case 0: numels[i] = below(3); break;      /* 0, 1 or 2 elements */
            case 1: numels[i] = 1 + below(64); break; /* smaller than a cache line or two */
            default: numels[i] = below(5000); break;
            }
        }
        for (int S = 1; S <= 8; S++) check_unit(numels, dts, n, S);
    }
}

int main(void) {
    for (int d = 0; d < HSDP_DTYPE_COUNT; d++) CHECK(hsdp_dtype_size((hsdp_dtype)d) == itemsize[d]);
    test_fixed();
    test_random();
    return check_report();
}
