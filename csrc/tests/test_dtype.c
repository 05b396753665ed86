/* test_dtype.c - standalone tests for dtype.c (metadata, scalar conversions, hsdp_cast,
 * accounted buffers). Prints failures to stderr and one "N passed, N failed" line to stdout;
 * exits non-zero if anything failed.
 *
 * The conversions are checked against a slow, obviously-correct reference (find the two
 * representable neighbours by value, compare with their exact midpoint) over every bit
 * pattern of each narrow format, every midpoint, and many random inputs. */
#include <fenv.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hsdp.h"

static int g_pass, g_fail;

#define CHECK(expr)                                                                      \
    do {                                                                                 \
        if (expr) {                                                                      \
            g_pass++;                                                                    \
        } else {                                                                         \
            g_fail++;                                                                    \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #expr);    \
        }                                                                                \
    } while (0)

/* ---------------------------------------------------------------- helpers */

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float ffrom(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static double dfrom(uint64_t u) {
    double d;
    memcpy(&d, &u, 8);
    return d;
}

static uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* A narrow float format: E exponent bits (bias 2^(E-1)-1), M mantissa bits; fn = the
 * e4m3fn flavour (no inf, only all-ones is NaN). */
typedef struct {
    const char *name;
    hsdp_dtype dt;
    unsigned E, M;
    int fn;
} fmt;

static const fmt FMTS[] = {
    {"bfloat16", HSDP_BF16, 8, 7, 0},
    {"float16", HSDP_F16, 5, 10, 0},
    {"float8_e4m3fn", HSDP_F8E4M3, 4, 3, 1},
    {"float8_e5m2", HSDP_F8E5M2, 5, 2, 0},
};
#define NFMTS (sizeof FMTS / sizeof FMTS[0])

static uint32_t f_signbit(const fmt *f) { return 1u << (f->E + f->M); }
static uint32_t f_top(const fmt *f) { return ((1u << f->E) - 1) << f->M; }
static uint32_t f_maxfin(const fmt *f) {
    return f->fn ? f_top(f) + (1u << f->M) - 2 : f_top(f) - 1;
}
/* The first pattern past the largest finite: +inf, or (fn) the NaN. */
static uint32_t f_ovf(const fmt *f) { return f_maxfin(f) + 1; }

static int f_isnan(const fmt *f, uint32_t p) {
    uint32_t a = p & (f_signbit(f) - 1);
    return f->fn ? a == f_ovf(f) : a > f_top(f);
}

/* Value of a positive pattern as if the exponent range continued (so the overflow pattern
 * gets the value the next binade would give: 65536 for f16, 480 for e4m3fn). */
static double f_value(const fmt *f, uint32_t p) {
    int bias = (1 << (f->E - 1)) - 1;
    uint32_t e = p >> f->M, m = p & ((1u << f->M) - 1);
    if (e == 0) return ldexp((double)m, 1 - bias - (int)f->M);
    return ldexp((double)((1u << f->M) + m), (int)e - bias - (int)f->M);
}

/* Reference round-to-nearest-even by value. For NaN input returns the canonical NaN. */
static uint32_t ref_encode(const fmt *f, double x) {
    uint32_t sign = signbit(x) ? f_signbit(f) : 0;
    if (isnan(x)) return sign | f_ovf(f) | (f->fn ? 0 : 1u << (f->M - 1));
    double ax = fabs(x);
    uint32_t ovf = f_ovf(f);
    if (ax >= f_value(f, ovf)) return sign | ovf; /* also inf */
    uint32_t lo = 0, hi = f_maxfin(f); /* largest p with value(p) <= ax */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo + 1) / 2;
        if (f_value(f, mid) <= ax)
            lo = mid;
        else
            hi = mid - 1;
    }
    double mid = (f_value(f, lo) + f_value(f, lo + 1)) / 2; /* exact: few significant bits */
    uint32_t r;
    if (ax < mid)
        r = lo;
    else if (ax > mid)
        r = lo + 1;
    else
        r = (lo & 1) ? lo + 1 : lo;
    return sign | r; /* r == ovf is already the overflow pattern */
}

static uint32_t enc_f32(const fmt *f, float x) {
    switch (f->dt) {
    case HSDP_BF16:
        return hsdp_f32_to_bf16(x);
    case HSDP_F16:
        return hsdp_f32_to_f16(x);
    case HSDP_F8E4M3:
        return hsdp_f32_to_f8e4m3(x);
    default:
        return hsdp_f32_to_f8e5m2(x);
    }
}

static float dec_f32(const fmt *f, uint32_t p) {
    switch (f->dt) {
    case HSDP_BF16:
        return hsdp_bf16_to_f32((uint16_t)p);
    case HSDP_F16:
        return hsdp_f16_to_f32((uint16_t)p);
    case HSDP_F8E4M3:
        return hsdp_f8e4m3_to_f32((uint8_t)p);
    default:
        return hsdp_f8e5m2_to_f32((uint8_t)p);
    }
}

/* The f64 path of hsdp_cast, one element: rounds from double directly. */
static uint32_t enc_f64(const fmt *f, double x) {
    unsigned char out[2] = {0, 0};
    hsdp_status s = hsdp_cast(out, f->dt, &x, HSDP_F64, 1);
    if (s != HSDP_OK) return 0xFFFFFFFFu;
    if (hsdp_dtype_size(f->dt) == 1) return out[0];
    uint16_t h;
    memcpy(&h, out, 2);
    return h;
}

/* Equal, or both NaN (NaN payloads are not part of the contract). */
static int same_pattern(const fmt *f, uint32_t got, uint32_t want) {
    if (f_isnan(f, want)) return f_isnan(f, got);
    return got == want;
}

/* Counts mismatches of one input on both the f32 and f64 paths; reports the first few. */
static int check_input(const fmt *f, double x, int *reported) {
    int bad = 0;
    uint32_t want = ref_encode(f, x);
    if ((double)(float)x == x || isnan(x)) {
        uint32_t got = enc_f32(f, (float)x);
        if (!same_pattern(f, got, want)) {
            bad++;
            if ((*reported)++ < 5)
                fprintf(stderr, "%s f32 %a (0x%08X): got 0x%X want 0x%X\n", f->name, x,
                        (unsigned)fbits((float)x), (unsigned)got, (unsigned)want);
        }
    }
    uint32_t got = enc_f64(f, x);
    if (!same_pattern(f, got, want)) {
        bad++;
        if ((*reported)++ < 5)
            fprintf(stderr, "%s f64 %a: got 0x%X want 0x%X\n", f->name, x, (unsigned)got,
                    (unsigned)want);
    }
    return bad;
}

/* ---------------------------------------------------------------- metadata */

static void test_metadata(void) {
    static const struct {
        hsdp_dtype dt;
        const char *name;
        size_t size;
        int is_float;
    } T[] = {
        {HSDP_F32, "float32", 4, 1},
        {HSDP_F16, "float16", 2, 1},
        {HSDP_BF16, "bfloat16", 2, 1},
        {HSDP_F8E4M3, "float8_e4m3fn", 1, 1},
        {HSDP_F8E5M2, "float8_e5m2", 1, 1},
        {HSDP_F64, "float64", 8, 1},
        {HSDP_BOOL, "bool", 1, 0},
        {HSDP_U8, "uint8", 1, 0},
        {HSDP_I8, "int8", 1, 0},
        {HSDP_U16, "uint16", 2, 0},
        {HSDP_I16, "int16", 2, 0},
        {HSDP_U32, "uint32", 4, 0},
        {HSDP_I32, "int32", 4, 0},
        {HSDP_U64, "uint64", 8, 0},
        {HSDP_I64, "int64", 8, 0},
    };
    CHECK(sizeof T / sizeof T[0] == HSDP_DTYPE_COUNT);
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++) {
        hsdp_dtype got = HSDP_DTYPE_COUNT;
        CHECK(hsdp_dtype_size(T[i].dt) == T[i].size);
        CHECK(hsdp_dtype_name(T[i].dt) != NULL && strcmp(hsdp_dtype_name(T[i].dt), T[i].name) == 0);
        CHECK(hsdp_dtype_from_name(T[i].name, &got) == 0 && got == T[i].dt);
        CHECK(hsdp_dtype_from_name(hsdp_dtype_name(T[i].dt), &got) == 0 && got == T[i].dt);
        CHECK(!!hsdp_dtype_is_float(T[i].dt) == T[i].is_float);
    }
    hsdp_dtype out = HSDP_I64;
    CHECK(hsdp_dtype_from_name("float128", &out) == -1 && out == HSDP_I64); /* untouched */
    CHECK(hsdp_dtype_from_name("", &out) == -1);
    CHECK(hsdp_dtype_from_name("Float32", &out) == -1); /* exact names only */
    CHECK(hsdp_dtype_from_name("float8_e4m3", &out) == -1);
    CHECK(hsdp_dtype_from_name(NULL, &out) == -1);
    CHECK(hsdp_dtype_name(HSDP_DTYPE_COUNT) == NULL);
    CHECK(hsdp_dtype_size(HSDP_DTYPE_COUNT) == 0);
    CHECK(!hsdp_dtype_is_float(HSDP_DTYPE_COUNT));
}

/* ---------------------------------------------------------------- bfloat16 */

static void test_bf16(void) {
    /* Ties go to the even kept lsb; anything off the tie goes to the nearer. */
    CHECK(hsdp_f32_to_bf16(ffrom(0x3F808000u)) == 0x3F80); /* tie, even below */
    CHECK(hsdp_f32_to_bf16(ffrom(0x3F818000u)) == 0x3F82); /* tie, even above */
    CHECK(hsdp_f32_to_bf16(ffrom(0x3F808001u)) == 0x3F81); /* just above tie */
    CHECK(hsdp_f32_to_bf16(ffrom(0x3F807FFFu)) == 0x3F80); /* just below tie */
    CHECK(hsdp_f32_to_bf16(ffrom(0x3F818001u)) == 0x3F82);
    CHECK(hsdp_f32_to_bf16(ffrom(0x3F817FFFu)) == 0x3F81);
    CHECK(hsdp_f32_to_bf16(ffrom(0xBF808000u)) == 0xBF80); /* sign does not matter */
    CHECK(hsdp_f32_to_bf16(ffrom(0xBF818000u)) == 0xBF82);
    CHECK(hsdp_f32_to_bf16(1.0f) == 0x3F80);
    CHECK(hsdp_bf16_to_f32(0x3F80) == 1.0f);
    CHECK(hsdp_bf16_to_f32(0xC040) == -3.0f);

    /* Specials. */
    CHECK(hsdp_f32_to_bf16(INFINITY) == 0x7F80);
    CHECK(hsdp_f32_to_bf16(-INFINITY) == 0xFF80);
    CHECK(hsdp_f32_to_bf16(0.0f) == 0x0000);
    CHECK(hsdp_f32_to_bf16(-0.0f) == 0x8000);
    CHECK(signbit(hsdp_bf16_to_f32(0x8000)) && hsdp_bf16_to_f32(0x8000) == 0.0f);
    CHECK(isinf(hsdp_bf16_to_f32(0x7F80)) && hsdp_bf16_to_f32(0x7F80) > 0);
    CHECK(isinf(hsdp_bf16_to_f32(0xFF80)) && hsdp_bf16_to_f32(0xFF80) < 0);
    uint16_t n = hsdp_f32_to_bf16(NAN);
    CHECK((n & 0x7F80) == 0x7F80 && (n & 0x007F) != 0 && (n & 0x0040)); /* quiet NaN */
    CHECK(isnan(hsdp_bf16_to_f32(n)));
    /* A NaN whose payload lives only in the low 16 bits must not truncate to inf. */
    CHECK(hsdp_f32_to_bf16(ffrom(0x7F800001u)) == 0x7FC0);
    CHECK(hsdp_f32_to_bf16(ffrom(0xFF800001u)) == 0xFFC0); /* sign kept */
    CHECK(hsdp_f32_to_bf16(ffrom(0xFFC00000u)) == 0xFFC0);

    /* Overflow: FLT_MAX (0x7F7FFFFF) is above max bf16 0x7F7F plus half an ulp -> inf. */
    CHECK(hsdp_f32_to_bf16(FLT_MAX) == 0x7F80);
    CHECK(hsdp_f32_to_bf16(-FLT_MAX) == 0xFF80);
    CHECK(hsdp_f32_to_bf16(ffrom(0x7F7F7FFFu)) == 0x7F7F); /* below the tie: stays finite */
    CHECK(hsdp_f32_to_bf16(ffrom(0x7F7F8000u)) == 0x7F80); /* tie, 0x7F7F odd -> inf */
    CHECK(hsdp_f32_to_bf16(3.0e38f) == 0x7F62);            /* 3.0e38 is still finite */

    /* Subnormals. */
    CHECK(hsdp_f32_to_bf16(ffrom(0x00010000u)) == 0x0001);
    CHECK(hsdp_bf16_to_f32(0x0001) == ldexpf(1.0f, -133));
    CHECK(hsdp_f32_to_bf16(ffrom(0x00008000u)) == 0x0000); /* tie with 0 -> even (0) */
    CHECK(hsdp_f32_to_bf16(ffrom(0x00008001u)) == 0x0001);
    CHECK(hsdp_f32_to_bf16(ffrom(0x00018000u)) == 0x0002);
    CHECK(hsdp_f32_to_bf16(ffrom(0x807F8000u)) == 0x8080); /* largest subnormal rounds up */
    CHECK(hsdp_f32_to_bf16(ldexpf(1.0f, -149)) == 0x0000);

    /* double -> bf16 rounds once: 1 + 2^-8 + 2^-30 is above the tie between 1 and 1+2^-7,
     * though as a float it would be exactly the tie (and go to even, 1.0). */
    double x = 1.0 + ldexp(1, -8) + ldexp(1, -30);
    uint16_t h = 0;
    CHECK(hsdp_cast(&h, HSDP_BF16, &x, HSDP_F64, 1) == HSDP_OK && h == 0x3F81);
    CHECK(hsdp_f32_to_bf16((float)x) == 0x3F80);
}

/* ---------------------------------------------------------------- float16 */

static void test_f16(void) {
    CHECK(hsdp_f32_to_f16(1.0f) == 0x3C00);
    CHECK(hsdp_f32_to_f16(-2.0f) == 0xC000);
    CHECK(hsdp_f32_to_f16(65504.0f) == 0x7BFF);
    CHECK(hsdp_f32_to_f16(65519.0f) == 0x7BFF);
    CHECK(hsdp_f32_to_f16(65520.0f) == 0x7C00); /* tie with 65536, 0x7BFF odd -> inf */
    CHECK(hsdp_f32_to_f16(-65520.0f) == 0xFC00);
    CHECK(hsdp_f32_to_f16(1e10f) == 0x7C00);
    CHECK(hsdp_f32_to_f16(INFINITY) == 0x7C00);
    CHECK(hsdp_f32_to_f16(-INFINITY) == 0xFC00);
    CHECK(hsdp_f32_to_f16(-0.0f) == 0x8000);
    uint16_t n = hsdp_f32_to_f16(NAN);
    CHECK((n & 0x7C00) == 0x7C00 && (n & 0x0200)); /* quiet NaN */
    CHECK(hsdp_f32_to_f16(ffrom(0x7F800001u)) != 0x7C00);
    CHECK(isnan(hsdp_f16_to_f32(hsdp_f32_to_f16(ffrom(0xFF800001u)))));
    CHECK(hsdp_f32_to_f16(ffrom(0xFF800001u)) & 0x8000);

    /* Ties to even at 1: ulp there is 2^-10. */
    CHECK(hsdp_f32_to_f16(1.0f + ldexpf(1, -11)) == 0x3C00);
    CHECK(hsdp_f32_to_f16(1.0f + 3 * ldexpf(1, -11)) == 0x3C02);
    CHECK(hsdp_f32_to_f16(nextafterf(1.0f + ldexpf(1, -11), 2.0f)) == 0x3C01);
    CHECK(hsdp_f32_to_f16(nextafterf(1.0f + 3 * ldexpf(1, -11), 0.0f)) == 0x3C01);

    /* Subnormals: smallest 2^-24, normals start at 2^-14. */
    CHECK(hsdp_f32_to_f16(ldexpf(1, -24)) == 0x0001);
    CHECK(hsdp_f16_to_f32(0x0001) == ldexpf(1, -24));
    CHECK(hsdp_f16_to_f32(0x8001) == -ldexpf(1, -24));
    CHECK(hsdp_f16_to_f32(0x03FF) == ldexpf(1023, -24));
    CHECK(hsdp_f32_to_f16(ldexpf(1, -25)) == 0x0000);     /* tie with 0 -> 0 */
    CHECK(hsdp_f32_to_f16(-ldexpf(1, -25)) == 0x8000);
    CHECK(hsdp_f32_to_f16(nextafterf(ldexpf(1, -25), 1)) == 0x0001);
    CHECK(hsdp_f32_to_f16(ldexpf(3, -26)) == 0x0001);     /* 0.75 ulp -> 1 */
    CHECK(hsdp_f32_to_f16(ldexpf(3, -25)) == 0x0002);     /* 1.5 ulp tie -> 2 */
    CHECK(hsdp_f32_to_f16(ldexpf(5, -25)) == 0x0002);     /* 2.5 ulp tie -> 2 */
    CHECK(hsdp_f32_to_f16(ldexpf(1, -14)) == 0x0400);
    CHECK(hsdp_f32_to_f16(ldexpf(2047, -25)) == 0x0400);  /* 1023.5 ulp tie -> 1024 */
    CHECK(hsdp_f32_to_f16(ldexpf(1, -30)) == 0x0000);
    CHECK(hsdp_f32_to_f16(FLT_MIN) == 0x0000);

    /* Every pattern: decode is the exact value, and encode(decode(p)) == p. */
    const fmt *f = &FMTS[1];
    int bad_val = 0, bad_rt = 0;
    for (uint32_t p = 0; p < 0x10000u; p++) {
        float v = hsdp_f16_to_f32((uint16_t)p);
        uint16_t back = hsdp_f32_to_f16(v);
        if (f_isnan(f, p)) {
            if (!isnan(v) || !f_isnan(f, back)) bad_rt++;
            continue;
        }
        double want = f_value(f, p & 0x7FFF);
        if ((p & 0x7FFF) == 0x7C00) want = INFINITY;
        if (p & 0x8000) want = -want;
        if ((double)v != want || !!signbit(v) != !!(p & 0x8000)) bad_val++;
        if (back != p) bad_rt++;
    }
    CHECK(bad_val == 0);
    CHECK(bad_rt == 0);
}

/* ---------------------------------------------------------------- float8 */

static void test_f8(void) {
    /* e4m3fn: S.1111.110 = 448 is the largest finite; S.1111.111 is NaN; no inf.
     * Overflow boundary: the pattern after 448 would be 480 (it is the NaN), so the midpoint
     * is 464. 464 itself is a tie between 0x7E (mantissa 110, even) and 0x7F (odd), and ties
     * go to even, so 464 -> 448; anything above 464 -> NaN. This matches ml_dtypes and
     * PyTorch's float8_e4m3fn conversion (non-saturating). */
    CHECK(hsdp_f8e4m3_to_f32(0x7E) == 448.0f);
    CHECK(hsdp_f8e4m3_to_f32(0xFE) == -448.0f);
    CHECK(isnan(hsdp_f8e4m3_to_f32(0x7F)) && isnan(hsdp_f8e4m3_to_f32(0xFF)));
    CHECK(hsdp_f8e4m3_to_f32(0x78) == 256.0f); /* exponent 15 is an ordinary binade */
    CHECK(hsdp_f32_to_f8e4m3(448.0f) == 0x7E);
    CHECK(hsdp_f32_to_f8e4m3(460.0f) == 0x7E);
    CHECK(hsdp_f32_to_f8e4m3(464.0f) == 0x7E); /* the tie: even -> 448 */
    CHECK(hsdp_f32_to_f8e4m3(-464.0f) == 0xFE);
    CHECK(hsdp_f32_to_f8e4m3(nextafterf(464.0f, 1000.0f)) == 0x7F); /* just above -> NaN */
    CHECK(hsdp_f32_to_f8e4m3(-nextafterf(464.0f, 1000.0f)) == 0xFF);
    CHECK(hsdp_f32_to_f8e4m3(480.0f) == 0x7F);
    CHECK(hsdp_f32_to_f8e4m3(1e6f) == 0x7F);
    CHECK(hsdp_f32_to_f8e4m3(INFINITY) == 0x7F);
    CHECK(hsdp_f32_to_f8e4m3(-INFINITY) == 0xFF);
    CHECK(hsdp_f32_to_f8e4m3(NAN) == 0x7F);
    CHECK(hsdp_f32_to_f8e4m3(-NAN) == 0xFF);
    CHECK(hsdp_f32_to_f8e4m3(-0.0f) == 0x80);
    CHECK(hsdp_f32_to_f8e4m3(0.0f) == 0x00);
    CHECK(hsdp_f32_to_f8e4m3(1.0f) == 0x38);
    /* Subnormals: m * 2^-9, smallest 2^-9, normals from 2^-6. */
    CHECK(hsdp_f8e4m3_to_f32(0x01) == ldexpf(1, -9));
    CHECK(hsdp_f8e4m3_to_f32(0x07) == ldexpf(7, -9));
    CHECK(hsdp_f8e4m3_to_f32(0x08) == ldexpf(1, -6));
    CHECK(hsdp_f32_to_f8e4m3(ldexpf(1, -9)) == 0x01);
    CHECK(hsdp_f32_to_f8e4m3(ldexpf(1, -10)) == 0x00); /* tie with 0 -> 0 */
    CHECK(hsdp_f32_to_f8e4m3(ldexpf(3, -11)) == 0x01);
    CHECK(hsdp_f32_to_f8e4m3(ldexpf(3, -10)) == 0x02); /* 1.5 -> 2 */
    CHECK(hsdp_f32_to_f8e4m3(ldexpf(15, -10)) == 0x08); /* 7.5 -> 8 = smallest normal */
    CHECK(hsdp_f32_to_f8e4m3(-ldexpf(1, -9)) == 0x81);
    CHECK(signbit(hsdp_f8e4m3_to_f32(0x80)));

    /* e5m2: IEEE-like, max 57344 = 1.75 * 2^15; inf 0x7C; NaN 0x7D..0x7F. The tie between
     * 57344 and the inf slot (65536) is 61440 and 0x7B is odd, so 61440 -> inf. */
    CHECK(hsdp_f8e5m2_to_f32(0x7B) == 57344.0f);
    CHECK(isinf(hsdp_f8e5m2_to_f32(0x7C)) && isinf(hsdp_f8e5m2_to_f32(0xFC)));
    CHECK(isnan(hsdp_f8e5m2_to_f32(0x7D)) && isnan(hsdp_f8e5m2_to_f32(0xFF)));
    CHECK(hsdp_f32_to_f8e5m2(57344.0f) == 0x7B);
    CHECK(hsdp_f32_to_f8e5m2(61439.0f) == 0x7B);
    CHECK(hsdp_f32_to_f8e5m2(61440.0f) == 0x7C);
    CHECK(hsdp_f32_to_f8e5m2(-1e9f) == 0xFC);
    CHECK(hsdp_f32_to_f8e5m2(INFINITY) == 0x7C);
    CHECK(hsdp_f32_to_f8e5m2(-INFINITY) == 0xFC);
    CHECK(isnan(hsdp_f8e5m2_to_f32(hsdp_f32_to_f8e5m2(NAN))));
    CHECK(hsdp_f32_to_f8e5m2(-0.0f) == 0x80);
    CHECK(hsdp_f8e5m2_to_f32(0x01) == ldexpf(1, -16));
    CHECK(hsdp_f32_to_f8e5m2(ldexpf(1, -16)) == 0x01);
    CHECK(hsdp_f32_to_f8e5m2(ldexpf(1, -17)) == 0x00);
    CHECK(hsdp_f32_to_f8e5m2(ldexpf(3, -17)) == 0x02);
    CHECK(hsdp_f32_to_f8e5m2(1.0f) == 0x3C);
    CHECK(hsdp_f32_to_f8e5m2(1.125f) == 0x3C); /* tie between 1 and 1.25 -> even */
    CHECK(hsdp_f32_to_f8e5m2(1.375f) == 0x3E); /* tie between 1.25 and 1.5 -> even */

    /* All 256 patterns of each: exact decode and round trip. */
    for (size_t k = 2; k < 4; k++) {
        const fmt *f = &FMTS[k];
        int bad_val = 0, bad_rt = 0;
        for (uint32_t p = 0; p < 256; p++) {
            float v = dec_f32(f, p);
            uint32_t back = enc_f32(f, v);
            if (f_isnan(f, p)) {
                if (!isnan(v) || !f_isnan(f, back)) bad_rt++;
                continue;
            }
            double want = f_value(f, p & 0x7F);
            if (!f->fn && (p & 0x7F) == f_top(f)) want = INFINITY;
            if (p & 0x80) want = -want;
            if ((double)v != want || !!signbit(v) != !!(p & 0x80)) bad_val++;
            if (back != p) bad_rt++;
        }
        CHECK(bad_val == 0);
        CHECK(bad_rt == 0);
    }
}

/* ---------------------------------------------------------------- against the reference */

static void test_reference(void) {
    for (size_t k = 0; k < NFMTS; k++) {
        const fmt *f = &FMTS[k];
        int bad = 0, reported = 0, bad_dec = 0;

        /* bfloat16 decode of every pattern (f16/f8 are covered above). */
        if (f->dt == HSDP_BF16) {
            for (uint32_t p = 0; p < 0x10000u; p++) {
                float v = hsdp_bf16_to_f32((uint16_t)p);
                if (f_isnan(f, p)) {
                    if (!isnan(v)) bad_dec++;
                    continue;
                }
                double want = (p & 0x7FFF) == 0x7F80 ? INFINITY : f_value(f, p & 0x7FFF);
                if (p & 0x8000) want = -want;
                if ((double)v != want || hsdp_f32_to_bf16(v) != p) bad_dec++;
            }
        }
        CHECK(bad_dec == 0);

        /* Every midpoint between neighbours (including the one past the largest finite),
         * and the doubles / floats just either side of it. */
        for (uint32_t p = 0; p <= f_maxfin(f); p++) {
            double mid = (f_value(f, p) + f_value(f, p + 1)) / 2;
            double cand[6] = {mid,
                              nextafter(mid, INFINITY),
                              nextafter(mid, 0),
                              (double)nextafterf((float)mid, INFINITY),
                              (double)nextafterf((float)mid, 0),
                              f_value(f, p)};
            for (int c = 0; c < 6; c++) {
                bad += check_input(f, cand[c], &reported);
                bad += check_input(f, -cand[c], &reported);
            }
        }

        /* Random floats: uniform bit patterns, then exponents near the format's range with
         * mantissas that often sit on or next to a tie. */
        uint64_t seed = 0x9E3779B97F4A7C15ull + k;
        for (int i = 0; i < 200000; i++) {
            uint64_t r = xorshift(&seed);
            uint32_t b = (uint32_t)r;
            if (i & 1) {
                int bias = (1 << (f->E - 1)) - 1;
                int lo = 127 - bias - (int)f->M - 3, hi = 127 + bias + 3;
                if (hi > 254) hi = 254;
                if (lo < 1) lo = 1;
                uint32_t e = (uint32_t)(lo + (int)((r >> 32) % (uint64_t)(hi - lo + 1)));
                uint32_t m = (uint32_t)(r >> 8) & 0x7FFFFFu;
                unsigned cut = (unsigned)((r >> 40) % 24); /* zero the low bits below a 1 */
                if (cut) m = (m & ~((1u << cut) - 1)) | (1u << (cut - 1));
                b = (b & 0x80000000u) | (e << 23) | m;
            }
            bad += check_input(f, (double)ffrom(b), &reported);
        }
        /* Random doubles near the range, some just off a float-exact tie (double rounding
         * would get those wrong). */
        for (int i = 0; i < 100000; i++) {
            uint64_t r = xorshift(&seed);
            int bias = (1 << (f->E - 1)) - 1;
            int lo = 1023 - bias - (int)f->M - 3, hi = 1023 + bias + 3;
            uint64_t e = (uint64_t)(lo + (int)((r >> 52) % (uint64_t)(hi - lo + 1)));
            uint64_t m = r & ((1ull << 52) - 1);
            if (i & 1) { /* tie in the target, then nudge by a tiny amount below float lsb */
                unsigned cut = 52 - f->M;
                m = (m & ~((1ull << cut) - 1)) | (1ull << (cut - 1));
                if (i & 2) m += 1;
                if (i & 4) m -= 2;
            }
            double x = dfrom(((r >> 63) << 63) | (e << 52) | m);
            bad += check_input(f, x, &reported);
        }
        CHECK(bad == 0);
    }
}

/* ---------------------------------------------------------------- hsdp_cast */

static void test_cast(void) {
    enum { N = 1000 };
    /* Unaligned on purpose: +1 byte offsets into byte buffers. */
    unsigned char srcbuf[8 * N + 1], midbuf[8 * N + 1], outbuf[8 * N + 1];
    unsigned char *src = srcbuf + 1, *mid = midbuf + 1, *out = outbuf + 1;
    uint64_t seed = 12345;

    /* f32 -> bf16 -> f32 matches the scalar functions. */
    for (int i = 0; i < N; i++) {
        float v = (i < 8) ? (float[]){0.0f, -0.0f, INFINITY, -INFINITY, NAN, FLT_MAX, 1.0f,
                                      ffrom(0x3F808000u)}[i]
                          : ffrom((uint32_t)xorshift(&seed));
        memcpy(src + 4 * i, &v, 4);
    }
    CHECK(hsdp_cast(mid, HSDP_BF16, src, HSDP_F32, N) == HSDP_OK);
    CHECK(hsdp_cast(out, HSDP_F32, mid, HSDP_BF16, N) == HSDP_OK);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        float v, w;
        uint16_t h;
        memcpy(&v, src + 4 * i, 4);
        memcpy(&h, mid + 2 * i, 2);
        memcpy(&w, out + 4 * i, 4);
        if (h != hsdp_f32_to_bf16(v)) bad++;
        if (fbits(w) != fbits(hsdp_bf16_to_f32(h))) bad++;
        /* Half an ulp of 8 significant bits, relative; subnormals have fewer bits. */
        if (isnormal(v) && !isinf(w) && fabsf(w - v) > fabsf(v) * ldexpf(1, -8)) bad++;
    }
    CHECK(bad == 0);

    /* f32 -> f16 -> f32 likewise. */
    CHECK(hsdp_cast(mid, HSDP_F16, src, HSDP_F32, N) == HSDP_OK);
    CHECK(hsdp_cast(out, HSDP_F32, mid, HSDP_F16, N) == HSDP_OK);
    bad = 0;
    for (int i = 0; i < N; i++) {
        float v, w;
        uint16_t h;
        memcpy(&v, src + 4 * i, 4);
        memcpy(&h, mid + 2 * i, 2);
        memcpy(&w, out + 4 * i, 4);
        if (h != hsdp_f32_to_f16(v)) bad++;
        if (fbits(w) != fbits(hsdp_f16_to_f32(h))) bad++;
    }
    CHECK(bad == 0);

    /* f64 <-> f32. */
    double d[5] = {1.0 / 3.0, -0.0, 1e300, -1e-300, 2.5};
    float fo[5];
    double dback[5];
    CHECK(hsdp_cast(fo, HSDP_F32, d, HSDP_F64, 5) == HSDP_OK);
    CHECK(fo[0] == (float)(1.0 / 3.0) && signbit(fo[1]) && fo[1] == 0.0f && isinf(fo[2]) &&
          fo[3] == -0.0f && signbit(fo[3]) && fo[4] == 2.5f);
    CHECK(hsdp_cast(dback, HSDP_F64, fo, HSDP_F32, 5) == HSDP_OK);
    CHECK(dback[0] == (double)fo[0] && dback[4] == 2.5 && isinf(dback[2]));
    /* f64 -> f16 / e4m3 / e5m2 and back. */
    double dd[3] = {1.0, 448.0, 65504.0};
    uint16_t hh[3];
    uint8_t b8[3];
    double d2[3];
    CHECK(hsdp_cast(hh, HSDP_F16, dd, HSDP_F64, 3) == HSDP_OK);
    CHECK(hh[0] == 0x3C00 && hh[2] == 0x7BFF);
    CHECK(hsdp_cast(d2, HSDP_F64, hh, HSDP_F16, 3) == HSDP_OK && d2[2] == 65504.0);
    CHECK(hsdp_cast(b8, HSDP_F8E4M3, dd, HSDP_F64, 3) == HSDP_OK);
    CHECK(b8[0] == 0x38 && b8[1] == 0x7E && b8[2] == 0x7F);
    CHECK(hsdp_cast(d2, HSDP_F64, b8, HSDP_F8E4M3, 3) == HSDP_OK);
    CHECK(d2[0] == 1.0 && d2[1] == 448.0 && isnan(d2[2]));

    /* f16 <-> bf16, all patterns: one rounding, the same as going through float. */
    static uint16_t all[0x10000], conv[0x10000];
    for (uint32_t p = 0; p < 0x10000u; p++) all[p] = (uint16_t)p;
    CHECK(hsdp_cast(conv, HSDP_BF16, all, HSDP_F16, 0x10000) == HSDP_OK);
    bad = 0;
    for (uint32_t p = 0; p < 0x10000u; p++)
        if (conv[p] != hsdp_f32_to_bf16(hsdp_f16_to_f32((uint16_t)p))) bad++;
    CHECK(bad == 0);
    CHECK(conv[0x3C00] == 0x3F80 && conv[0x7C00] == 0x7F80 && conv[0x8000] == 0x8000);
    CHECK(hsdp_cast(conv, HSDP_F16, all, HSDP_BF16, 0x10000) == HSDP_OK);
    bad = 0;
    for (uint32_t p = 0; p < 0x10000u; p++)
        if (conv[p] != hsdp_f32_to_f16(hsdp_bf16_to_f32((uint16_t)p))) bad++;
    CHECK(bad == 0);
    CHECK(conv[0x3F80] == 0x3C00 && conv[0x4780] == 0x7C00); /* 65536 -> inf */

    /* bf16 -> f32 (the vectorised widening), all patterns, at every start and length that
     * leaves a different tail past the vectors (and none at all), into unaligned storage: the scalar bits. */
    static unsigned char wide[4 * 0x10000 + 4];
    for (size_t start = 0; start < 3; start++)
        for (size_t k = 0; k < 44; k++) {
            size_t len = k < 40 ? k : 0x10000 - start - 13 * (k - 40); /* short ones, then all */
            memset(wide, 0xAB, sizeof wide);
            CHECK(hsdp_cast(wide + 1, HSDP_F32, all + start, HSDP_BF16, len) == HSDP_OK);
            bad = 0;
            for (size_t p = 0; p < len; p++) {
                uint32_t w;
                memcpy(&w, wide + 1 + 4 * p, 4);
                if (w != fbits(hsdp_bf16_to_f32((uint16_t)(start + p)))) bad++;
            }
            CHECK(bad == 0 && wide[0] == 0xAB && wide[1 + 4 * len] == 0xAB); /* nothing outside written */
        }

    /* float8 <-> float8 and float8 <-> bf16 on unaligned storage. */
    for (int p = 0; p < 256; p++) src[p] = (unsigned char)p;
    CHECK(hsdp_cast(mid, HSDP_F8E5M2, src, HSDP_F8E4M3, 256) == HSDP_OK);
    CHECK(hsdp_cast(out, HSDP_BF16, src, HSDP_F8E5M2, 256) == HSDP_OK);
    bad = 0;
    for (int p = 0; p < 256; p++) {
        uint16_t h;
        memcpy(&h, out + 2 * p, 2);
        if (mid[p] != hsdp_f32_to_f8e5m2(hsdp_f8e4m3_to_f32((uint8_t)p))) bad++;
        if (h != hsdp_f32_to_bf16(hsdp_f8e5m2_to_f32((uint8_t)p))) bad++;
    }
    CHECK(bad == 0);

    /* Same dtype: a byte copy (no canonicalisation, NaN payloads kept), and in place. */
    for (int i = 0; i < 64; i++) src[i] = (unsigned char)(i * 37 + 1);
    memset(out, 0, 64);
    CHECK(hsdp_cast(out, HSDP_F32, src, HSDP_F32, 16) == HSDP_OK && memcmp(out, src, 64) == 0);
    memset(out, 0, 64);
    CHECK(hsdp_cast(out, HSDP_I16, src, HSDP_I16, 32) == HSDP_OK && memcmp(out, src, 64) == 0);
    memcpy(mid, src, 64);
    CHECK(hsdp_cast(mid, HSDP_BF16, mid, HSDP_BF16, 32) == HSDP_OK && memcmp(mid, src, 64) == 0);
    CHECK(hsdp_cast(NULL, HSDP_F32, NULL, HSDP_BF16, 0) == HSDP_OK); /* nothing to do */

    /* Rejected combinations name both dtypes. */
    CHECK(hsdp_cast(out, HSDP_F32, src, HSDP_I32, 4) == HSDP_ETYPE);
    CHECK(strstr(hsdp_last_error(), "int32") && strstr(hsdp_last_error(), "float32"));
    CHECK(hsdp_cast(out, HSDP_I32, src, HSDP_I8, 4) == HSDP_ETYPE);
    CHECK(strstr(hsdp_last_error(), "int8") && strstr(hsdp_last_error(), "int32"));
    CHECK(strcmp(hsdp_last_error(), "cannot cast int8 to int32") == 0);
    CHECK(hsdp_cast(out, HSDP_U8, src, HSDP_BF16, 4) == HSDP_ETYPE);
    CHECK(strstr(hsdp_last_error(), "bfloat16") && strstr(hsdp_last_error(), "uint8"));
    CHECK(hsdp_cast(out, HSDP_F32, src, HSDP_BOOL, 4) == HSDP_ETYPE);
    CHECK(strstr(hsdp_last_error(), "bool") && strstr(hsdp_last_error(), "float32"));
    CHECK(hsdp_cast(out, HSDP_F64, src, HSDP_I64, 0) == HSDP_ETYPE); /* even for n == 0 */
    CHECK(hsdp_cast(out, HSDP_DTYPE_COUNT, src, HSDP_F32, 1) == HSDP_ETYPE);
    CHECK(hsdp_cast(out, HSDP_F32, src, (hsdp_dtype)-1, 1) == HSDP_ETYPE);
}

/* ---------------------------------------------------------------- buffers */

static void test_buffers(void) {
    hsdp_stats st;
    memset(&st, 0xAB, sizeof st); /* init must clear whatever was there */
    hsdp_stats_init(&st);
    CHECK(st.sharded_bytes == 0 && st.unsharded_bytes == 0 && st.peak_unsharded_bytes == 0 &&
          st.whole_bytes == 0 && st.buffer_allocs == 0 && st.gathers == 0);

    /* Owned here until the hsdp_buffer_free calls below. */
    unsigned char *a = hsdp_buffer_alloc(&st, 100);
    CHECK(a != NULL && (uintptr_t)a % 64 == 0);
    CHECK(st.unsharded_bytes == 100 && st.peak_unsharded_bytes == 100 && st.buffer_allocs == 1);
    if (a) memset(a, 1, 128); /* the rounded-up size is usable (ASan would catch otherwise) */

    unsigned char *b = hsdp_buffer_alloc(&st, 1000);
    CHECK(b != NULL && (uintptr_t)b % 64 == 0);
    CHECK(st.unsharded_bytes == 1100 && st.peak_unsharded_bytes == 1100 && st.buffer_allocs == 2);

    void *z = hsdp_buffer_alloc(&st, 0);
    CHECK(z != NULL && (uintptr_t)z % 64 == 0 && z != a && z != b);
    CHECK(st.unsharded_bytes == 1100 && st.buffer_allocs == 3);

    hsdp_buffer_free(&st, b, 1000);
    CHECK(st.unsharded_bytes == 100 && st.peak_unsharded_bytes == 1100);
    unsigned char *c = hsdp_buffer_alloc(&st, 500); /* below the peak: peak unchanged */
    CHECK(c != NULL && (uintptr_t)c % 64 == 0);
    CHECK(st.unsharded_bytes == 600 && st.peak_unsharded_bytes == 1100 && st.buffer_allocs == 4);

    /* A size that cannot be rounded up fails cleanly, without touching the counters. */
    CHECK(hsdp_buffer_alloc(&st, SIZE_MAX) == NULL);
    CHECK(strstr(hsdp_last_error(), "could not allocate") != NULL);
    CHECK(st.unsharded_bytes == 600 && st.buffer_allocs == 4);

    hsdp_buffer_free(&st, NULL, 123); /* no-op, like free(NULL) */
    CHECK(st.unsharded_bytes == 600);
    hsdp_buffer_free(&st, c, 500);
    hsdp_buffer_free(&st, z, 0);
    hsdp_buffer_free(&st, a, 100);
    CHECK(st.unsharded_bytes == 0 && st.peak_unsharded_bytes == 1100 && st.buffer_allocs == 4);
    CHECK(st.sharded_bytes == 0 && st.whole_bytes == 0 && st.gathers == 0);
}

/* ---------------------------------------------------------------- block-scaled float8 */

static void test_blocks(void) {
    enum { N = 3 * HSDP_WIRE_BLOCK + 37 }; /* three full blocks and a short one */
    const size_t nb = (N + HSDP_WIRE_BLOCK - 1) / HSDP_WIRE_BLOCK;
    float x[N], y[N], sc[(N + HSDP_WIRE_BLOCK - 1) / HSDP_WIRE_BLOCK];
    uint8_t q[N];

    /* Exact: every e4m3 value times a power of two, in a block whose absmax is 448 * 2^k,
     * has scale 2^k and comes back bit for bit (signed zeros included). */
    for (size_t i = 0; i < N; i++) {
        size_t b = i / HSDP_WIRE_BLOCK;
        float v = hsdp_f8e4m3_to_f32((uint8_t)(i % 256 == 0x7F || i % 256 == 0xFF ? 0x7E : i % 256));
        x[i] = ldexpf(v, (int)b * 3 - 4);
    }
    for (size_t b = 0; b < nb; b++) x[b * HSDP_WIRE_BLOCK] = ldexpf(448.0f, (int)b * 3 - 4);
    CHECK(hsdp_quantize_blocks(q, sc, x, HSDP_F32, N) == HSDP_OK);
    for (size_t b = 0; b < nb; b++) CHECK(sc[b] == ldexpf(1.0f, (int)b * 3 - 4));
    CHECK(hsdp_dequantize_blocks(y, HSDP_F32, q, sc, N) == HSDP_OK);
    CHECK(memcmp(x, y, sizeof x) == 0);

    /* The encoder is the scalar one: with absmax 448 the scale is 1, so every code must be
     * hsdp_f32_to_f8e4m3's (nearest even, subnormals included), for random floats over
     * e4m3's whole range and every midpoint between two e4m3 values. */
    uint64_t seed0 = 12345;
    for (int round = 0; round < 200; round++) {
        for (size_t i = 0; i < N; i++) {
            if (round % 2) { /* the midpoints, and just either side of them */
                uint8_t c = (uint8_t)(xorshift(&seed0) % 0x7E);
                double mid = ((double)hsdp_f8e4m3_to_f32(c) + (double)hsdp_f8e4m3_to_f32((uint8_t)(c + 1))) / 2;
                float f = (float)mid;
                int k = (int)(xorshift(&seed0) % 3);
                x[i] = k == 0 ? f : k == 1 ? nextafterf(f, 0) : nextafterf(f, 1000);
            } else {
                x[i] = ldexpf((float)(xorshift(&seed0) >> 40) / (float)(1 << 24), (int)(xorshift(&seed0) % 20) - 11);
            }
            if (xorshift(&seed0) & 1) x[i] = -x[i];
            if (x[i] > 448.0f) x[i] = 448.0f;
            if (x[i] < -448.0f) x[i] = -448.0f;
        }
        for (size_t b = 0; b < nb; b++) x[b * HSDP_WIRE_BLOCK] = 448.0f;
        CHECK(hsdp_quantize_blocks(q, sc, x, HSDP_F32, N) == HSDP_OK);
        int same = 1;
        for (size_t i = 0; i < N; i++) same &= q[i] == hsdp_f32_to_f8e4m3(x[i]);
        CHECK(same);
    }

    /* Bounded: random weights over many magnitudes. Every element is within 2^-4 of its
     * value (e4m3 keeps 3 mantissa bits) plus half the smallest subnormal step times the
     * scale (scale * 2^-10), so within absmax * (2^-4 + 2^-10 / 448) of the block's absmax
     * (the bound checked, per block); and bfloat16 adds its own half ulp. */
    uint64_t seed = 0x9E3779B97F4A7C15u;
    for (int round = 0; round < 20; round++) {
        for (size_t i = 0; i < N; i++) {
            double u = (double)(xorshift(&seed) >> 11) / 9007199254740992.0; /* [0, 1) */
            int e = (int)(xorshift(&seed) % 24) - 16;
            x[i] = (float)((u * 2.0 - 1.0) * ldexp(1.0, e + (round % 7) * 5 - 15));
        }
        CHECK(hsdp_quantize_blocks(q, sc, x, HSDP_F32, N) == HSDP_OK);
        CHECK(hsdp_dequantize_blocks(y, HSDP_F32, q, sc, N) == HSDP_OK);
        int ok = 1;
        for (size_t b = 0; b < nb; b++) {
            size_t lo = b * HSDP_WIRE_BLOCK, hi = lo + HSDP_WIRE_BLOCK < N ? lo + HSDP_WIRE_BLOCK : N;
            float amax = 0;
            for (size_t i = lo; i < hi; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            ok &= sc[b] == amax / 448.0f;
            for (size_t i = lo; i < hi; i++) {
                double err = fabs((double)y[i] - (double)x[i]);
                ok &= err <= fabs((double)x[i]) * 0x1p-4 + (double)sc[b] * 0x1p-10 * 1.0000001;
                ok &= fabs((double)y[i]) <= (double)amax * 1.0000001; /* saturated: never past absmax */
            }
        }
        CHECK(ok);
        /* bfloat16 source and destination: one more rounding, half a bfloat16 ulp */
        uint16_t hb[N], hb2[N];
        for (size_t i = 0; i < N; i++) hb[i] = hsdp_f32_to_bf16(x[i]);
        CHECK(hsdp_quantize_blocks(q, sc, hb, HSDP_BF16, N) == HSDP_OK);
        CHECK(hsdp_dequantize_blocks(hb2, HSDP_BF16, q, sc, N) == HSDP_OK);
        ok = 1;
        for (size_t i = 0; i < N; i++) {
            double a = hsdp_bf16_to_f32(hb[i]), b2 = hsdp_bf16_to_f32(hb2[i]);
            double bound = fabs(a) * (0x1p-4 + 0x1p-8 * 1.07) + (double)sc[i / HSDP_WIRE_BLOCK] * 0x1p-10 * 1.01;
            ok &= fabs(b2 - a) <= bound;
        }
        CHECK(ok);
        /* float16 destination */
        uint16_t h16[N];
        CHECK(hsdp_dequantize_blocks(h16, HSDP_F16, q, sc, N) == HSDP_OK);
        ok = 1;
        for (size_t i = 0; i < N; i++) {
            float want = hsdp_f8e4m3_to_f32(q[i]) * sc[i / HSDP_WIRE_BLOCK];
            ok &= h16[i] == hsdp_f32_to_f16(want);
        }
        CHECK(ok);
    }

    /* Zeros: an all-zero block has scale 0 and gives zeros (signs kept); a zero among other
     * values stays zero. */
    for (size_t i = 0; i < N; i++) x[i] = i < HSDP_WIRE_BLOCK ? (i % 2 ? -0.0f : 0.0f) : (i % 5 == 0 ? 0.0f : 1.5f);
    CHECK(hsdp_quantize_blocks(q, sc, x, HSDP_F32, N) == HSDP_OK);
    CHECK(sc[0] == 0.0f && sc[1] == 1.5f / 448.0f);
    CHECK(hsdp_dequantize_blocks(y, HSDP_F32, q, sc, N) == HSDP_OK);
    CHECK(memcmp(x, y, sizeof x) == 0);

    /* Non-finite: NaN stays NaN, +-inf becomes NaN (e4m3fn has no infinity); neither
     * enters the scale, so the block's finite values keep their precision. A block of only
     * NaN and inf has scale 0. */
    for (size_t i = 0; i < N; i++) x[i] = (float)(i % 7) - 3.0f;
    x[1] = NAN;
    x[2] = INFINITY;
    x[3] = -INFINITY;
    for (size_t i = HSDP_WIRE_BLOCK; i < 2 * HSDP_WIRE_BLOCK; i++) x[i] = i % 2 ? NAN : -INFINITY;
    CHECK(hsdp_quantize_blocks(q, sc, x, HSDP_F32, N) == HSDP_OK);
    CHECK(sc[0] == 3.0f / 448.0f && sc[1] == 0.0f);
    CHECK(hsdp_dequantize_blocks(y, HSDP_F32, q, sc, N) == HSDP_OK);
    CHECK(isnan(y[1]) && isnan(y[2]) && isnan(y[3]));
    int fin_ok = 1;
    for (size_t i = 4; i < HSDP_WIRE_BLOCK; i++)
        fin_ok &= fabs((double)y[i] - (double)x[i]) <= fabs((double)x[i]) * 0x1p-4 + (double)sc[0] * 0x1p-10;
    CHECK(fin_ok && y[0] == -y[6]);
    int all_nan = 1;
    for (size_t i = HSDP_WIRE_BLOCK; i < 2 * HSDP_WIRE_BLOCK; i++) all_nan &= isnan(y[i]);
    CHECK(all_nan);

    /* Tiny blocks: the smallest bfloat16 subnormal keeps a nonzero scale and comes back. */
    x[0] = hsdp_bf16_to_f32(1);
    for (size_t i = 1; i < HSDP_WIRE_BLOCK; i++) x[i] = 0;
    CHECK(hsdp_quantize_blocks(q, sc, x, HSDP_F32, HSDP_WIRE_BLOCK) == HSDP_OK && sc[0] > 0);
    CHECK(hsdp_dequantize_blocks(y, HSDP_F32, q, sc, HSDP_WIRE_BLOCK) == HSDP_OK);
    CHECK(fabs((double)y[0] - (double)x[0]) <= (double)x[0] * 0x1p-4);

    /* Empty input writes nothing; other dtypes are refused by name. */
    CHECK(hsdp_quantize_blocks(NULL, NULL, NULL, HSDP_F32, 0) == HSDP_OK);
    CHECK(hsdp_quantize_blocks(q, sc, x, HSDP_F64, 1) == HSDP_ETYPE && strstr(hsdp_last_error(), "float64"));
    CHECK(hsdp_dequantize_blocks(y, HSDP_I32, q, sc, 1) == HSDP_ETYPE && strstr(hsdp_last_error(), "int32"));
}

/* The decode's reference: the formulation hsdp_dequantize_blocks had before it was vectorised
 * for AVX-512 and its float16 loop made branch-free (and the one wire_kernel.h copies): the
 * code's exact float (hsdp_f8e4m3_to_f32), one float32 multiply by the block's scale, then
 * integer rounding to nearest even (bfloat16), f16_from_bits (float16) or nothing (float32);
 * the NaN code gives the quiet NaN; the code's sign is OR'd on last. */
static uint32_t decode_ref(uint8_t q, float scale, hsdp_dtype dt) {
    uint32_t a = q & 0x7Fu, sign = q & 0x80u;
    volatile float mag = hsdp_f8e4m3_to_f32((uint8_t)a); /* volatile: one multiply, as written */
    float p = mag * scale;
    uint32_t b;
    memcpy(&b, &p, 4);
    if (dt == HSDP_F32) return (a == 0x7Fu ? 0x7FC00000u : b) | sign << 24;
    if (dt == HSDP_BF16) return (a == 0x7Fu ? 0x7FC0u : (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) | sign << 8;
    uint32_t qnan = 0x7FC00000u;
    if (a == 0x7Fu) memcpy(&p, &qnan, 4);
    return hsdp_f32_to_f16(p) | sign << 8;
}

/* Every code times scales that cover what a product can do: exact, rounding (random scales,
 * all 24 bits used), ties, overflow to the largest finite and to inf in float16 (65504,
 * 65520), bfloat16 and float32 (FLT_MAX), subnormal in float16 (below 2^-14), bfloat16 and
 * float32 (below 2^-126), underflow to zero; zero, negative, infinite and NaN scales; and
 * each at a destination misaligned by one element and with a block tail shorter than a
 * vector, so the vector loops' prologue and epilogue are covered too. */
static void test_blocks_exhaustive(void) {
    enum { N = 3 * HSDP_WIRE_BLOCK - 51 };
    float scales[96];
    size_t ns = 0;
    const float fixed[] = {1.0f, 0.5f, 0x1p-20f, 0x1p-24f, 0x1p-30f, 0x1p-126f, 0x1p-130f, 0x1p-140f, 0x1p-149f,
                           0x1p-145f, 65504.0f / 448.0f, 65520.0f / 448.0f, 146.3f,
                           0x1.fffffep127f / 448.0f, 0x1.fffffep127f / 400.0f, 0x1.fffffep127f, 0.02f / 448.0f,
                           1.0f / 3.0f, 0x1.000002p0f, 0x1.7ffffep0f, 0.0f, -0.0f, -0.75f, INFINITY, NAN,
                           0x1p-133f * 3.0f, 0x1p-9f, 0x1p-15f * 1.5f,
                           /* the bounds of the AVX512-BF16 decode's scales (dtype.c) */
                           0x1p-117f, 0x1.fffffep-118f, 0x1.000002p-117f, 0x1p-116f * 1.75f};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) scales[ns++] = fixed[i];
    uint64_t seed = 0xD1B54A32D192ED03u;
    while (ns < sizeof scales / sizeof scales[0]) {
        uint32_t bits = (uint32_t)(xorshift(&seed) >> 33) & 0x7FFFFFFFu; /* any finite or not */
        if ((bits & 0x7F800000u) == 0x7F800000u) bits &= 0x3FFFFFFFu;
        float f;
        memcpy(&f, &bits, 4);
        scales[ns++] = f;
    }
    uint8_t q[N];
    for (size_t i = 0; i < N; i++) q[i] = (uint8_t)(i * 7 + 3); /* the first 256: every code once */
    const hsdp_dtype dts[] = {HSDP_BF16, HSDP_F16, HSDP_F32};
    int bad = 0;
    /* in every rounding mode: the product (the one step that rounds by it) is the same */
    const int modes[] = {FE_TONEAREST, FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO};
    for (size_t mode = 0; mode < sizeof modes / sizeof modes[0]; mode++) {
    CHECK(fesetround(modes[mode]) == 0);
    for (size_t k = 0; k < ns; k++) {
        float sc[3] = {scales[k], scales[k], scales[k]};
        for (size_t t = 0; t < 3; t++) {
            size_t item = hsdp_dtype_size(dts[t]);
            for (size_t skew = 0; skew < 4; skew++) { /* 2, 3: streaming stores (the same bytes) */
                _Alignas(64) unsigned char out[(N + 1) * 4];
                CHECK((skew < 2 ? hsdp_dequantize_blocks : hsdp_dequantize_blocks_streaming)(
                          out + skew % 2 * item, dts[t], q, sc, N) == HSDP_OK);
                for (size_t i = 0; i < N; i++) {
                    uint32_t got = 0;
                    memcpy(&got, out + (skew % 2 + i) * item, item);
                    uint32_t want = decode_ref(q[i], sc[0], dts[t]);
                    if (got != want && bad++ < 5)
                        fprintf(stderr, "code 0x%02X scale %a to %s, rounding mode %zu: 0x%X, want 0x%X\n", q[i],
                                (double)sc[0], hsdp_dtype_name(dts[t]), mode, got, want);
                }
            }
        }
    }
    }
    fesetround(FE_TONEAREST);
    CHECK(bad == 0);
    /* blocks that take the AVX512 decode (dtype.c) and blocks that do not, in one call */
    const float mixed[3] = {0.02f / 448.0f, 0x1p-126f, -0.75f};
    for (size_t t = 0; t < 3; t++) {
        for (int stream = 0; stream < 2; stream++) {
            size_t item = hsdp_dtype_size(dts[t]);
            _Alignas(64) unsigned char out[N * 4];
            CHECK((stream ? hsdp_dequantize_blocks_streaming : hsdp_dequantize_blocks)(out, dts[t], q, mixed, N) ==
                  HSDP_OK);
            for (size_t i = 0; i < N; i++) {
                uint32_t got = 0;
                memcpy(&got, out + i * item, item);
                bad += got != decode_ref(q[i], mixed[i / HSDP_WIRE_BLOCK], dts[t]);
            }
        }
    }
    CHECK(bad == 0);
}

int main(void) {
    test_metadata();
    test_bf16();
    test_f16();
    test_f8();
    test_reference();
    test_cast();
    test_buffers();
    test_blocks();
    test_blocks_exhaustive();
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
