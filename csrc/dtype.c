/* dtype.c - dtype metadata, scalar float conversions and hsdp_cast.
 *
 * Every narrowing conversion rounds to nearest, ties to even, with integer arithmetic on the
 * bit patterns, so the result never depends on the FPU rounding mode. Widening is exact. */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hsdp.h"

/* ---------------------------------------------------------------- metadata */

/* Indexed by hsdp_dtype; the static asserts below keep it in step with the enum. */
static const struct {
    const char *name;
    size_t size;
    int is_float;
} dtype_info[HSDP_DTYPE_COUNT] = {
    [HSDP_F32] = {"float32", 4, 1},
    [HSDP_F16] = {"float16", 2, 1},
    [HSDP_BF16] = {"bfloat16", 2, 1},
    [HSDP_F8E4M3] = {"float8_e4m3fn", 1, 1},
    [HSDP_F8E5M2] = {"float8_e5m2", 1, 1},
    [HSDP_F64] = {"float64", 8, 1},
    [HSDP_BOOL] = {"bool", 1, 0},
    [HSDP_U8] = {"uint8", 1, 0},
    [HSDP_I8] = {"int8", 1, 0},
    [HSDP_U16] = {"uint16", 2, 0},
    [HSDP_I16] = {"int16", 2, 0},
    [HSDP_U32] = {"uint32", 4, 0},
    [HSDP_I32] = {"int32", 4, 0},
    [HSDP_U64] = {"uint64", 8, 0},
    [HSDP_I64] = {"int64", 8, 0},
};

_Static_assert(sizeof(float) == 4, "float must be IEEE binary32");
_Static_assert(sizeof(double) == 8, "double must be IEEE binary64");
_Static_assert(HSDP_DTYPE_COUNT == 15, "dtype_info must list every dtype");

/* The enum may be signed or unsigned depending on the compiler; compare as unsigned so a
 * negative value is out of range too. */
static int dtype_valid(hsdp_dtype dt) { return (unsigned)dt < (unsigned)HSDP_DTYPE_COUNT; }

size_t hsdp_dtype_size(hsdp_dtype dt) { return dtype_valid(dt) ? dtype_info[dt].size : 0; }

const char *hsdp_dtype_name(hsdp_dtype dt) { return dtype_valid(dt) ? dtype_info[dt].name : NULL; }

int hsdp_dtype_from_name(const char *name, hsdp_dtype *out) {
    if (name == NULL) return -1;
    for (int i = 0; i < HSDP_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_info[i].name) == 0) {
            if (out) *out = (hsdp_dtype)i;
            return 0;
        }
    }
    return -1;
}

int hsdp_dtype_is_float(hsdp_dtype dt) { return dtype_valid(dt) && dtype_info[dt].is_float; }

/* ---------------------------------------------------------------- bit helpers */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint64_t f64_bits(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

/* Shifts m right by `shift` (1..63) rounding to nearest, ties to even. */
static inline uint64_t shift_round_even(uint64_t m, unsigned shift) {
    uint64_t r = m >> shift;
    uint64_t rem = m & ((UINT64_C(1) << shift) - 1);
    uint64_t half = UINT64_C(1) << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) r++;
    return r;
}

/* Generic double -> narrow float with E exponent bits (bias 2^(E-1) - 1) and M mantissa
 * bits. `fn` selects the "finite" flavour (float8_e4m3fn): the all-ones exponent is an
 * ordinary binade except its all-ones mantissa, which is NaN, and there is no infinity, so
 * overflow and inf become NaN. Rounding starts from a double, so an f64 source is rounded
 * once (never f64 -> f32 -> narrow, which could round twice). The carry out of the mantissa
 * into the exponent is what rounds the largest subnormal up to the smallest normal and the
 * largest finite up to the overflow pattern. */
static uint16_t narrow_from_f64(double d, unsigned E, unsigned M, int fn) {
    const uint64_t frac_mask = (UINT64_C(1) << 52) - 1;
    uint64_t x = f64_bits(d);
    uint64_t a = x & ~(UINT64_C(1) << 63);
    uint32_t sign = (uint32_t)(x >> 63) << (E + M);
    uint32_t expmax = (1u << E) - 1;
    uint32_t top = expmax << M; /* IEEE: +inf; fn: first pattern of the last binade */
    uint32_t nan = fn ? (top | ((1u << M) - 1)) : (top | (1u << (M - 1)));
    uint32_t maxfin = fn ? nan - 1 : top - 1;
    uint32_t ovf = fn ? nan : top;

    if (a > UINT64_C(0x7FF0000000000000)) /* NaN: quiet, keep the top payload bits */
        return (uint16_t)(sign | nan | (uint32_t)((a & frac_mask) >> (52 - M)));
    if (a == UINT64_C(0x7FF0000000000000)) return (uint16_t)(sign | ovf);

    int e = (int)(a >> 52);
    /* Double subnormals (and zero) are far below half the smallest narrow subnormal. */
    if (e == 0) return (uint16_t)sign;
    int te = e - 1023 + (int)((1u << (E - 1)) - 1); /* exponent field in the target */
    if (te > (int)expmax) return (uint16_t)(sign | ovf); /* overflows even before rounding */

    uint64_t m;
    unsigned shift;
    if (te >= 1) {
        /* Normal: exponent and fraction side by side, so a rounding carry bumps the
         * exponent. te <= 255, so te << 52 fits in 64 bits. */
        m = ((uint64_t)te << 52) | (a & frac_mask);
        shift = 52 - M;
    } else {
        /* Subnormal in the target: denormalise the significand by 1 - te more places. */
        int s = (int)(52 - M) + (1 - te);
        if (s > 53) return (uint16_t)sign; /* below half the smallest subnormal -> 0 */
        m = (a & frac_mask) | (UINT64_C(1) << 52);
        shift = (unsigned)s;
    }
    uint64_t r = shift_round_even(m, shift);
    if (r > maxfin) return (uint16_t)(sign | ovf);
    return (uint16_t)(sign | (uint32_t)r);
}

/* ---------------------------------------------------------------- bfloat16 */

/* Hot (cast loops): kept inline on bit patterns. */
static inline uint16_t bf16_from_bits(uint32_t x) {
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x0040u); /* quiet */
    /* Adding 0x7FFF (+1 when the kept lsb is odd) carries exactly when the dropped half is
     * above the tie, or at the tie with an odd lsb. FLT_MAX carries into +inf, as it
     * should: it is above the largest bfloat16 plus half an ulp. */
    x += 0x7FFFu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline uint32_t bf16_to_bits(uint16_t h) { return (uint32_t)h << 16; }

uint16_t hsdp_f32_to_bf16(float f) { return bf16_from_bits(f32_bits(f)); }

float hsdp_bf16_to_f32(uint16_t h) { return f32_from_bits(bf16_to_bits(h)); }

/* ---------------------------------------------------------------- float16 */

static inline uint16_t f16_from_bits(uint32_t x) {
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x01FFu)); /* NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 (or inf) -> inf */
    if (a >= 0x38800000u) {
        /* Normal (>= 2^-14): rebias the exponent 127 -> 15, then round off 13 bits the same
         * way as bfloat16. A carry into the exponent is a correct round-up. */
        a -= (uint32_t)(127 - 15) << 23;
        a += 0x0FFFu + ((a >> 13) & 1u);
        return (uint16_t)(sign | (a >> 13));
    }
    /* 2^-25 is the tie between 0 and the smallest subnormal 2^-24: even wins, so <= -> 0. */
    if (a <= 0x33000000u) return (uint16_t)sign;
    /* Subnormal: with the implicit bit, the value is m * 2^(e - 150), i.e. m >> (126 - e)
     * in units of 2^-24; the shift is 14..24 here. Rounding the largest subnormal up gives
     * 0x0400, the smallest normal. */
    uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
    unsigned shift = 126u - (a >> 23);
    return (uint16_t)(sign | (uint32_t)shift_round_even(m, shift));
}

static inline uint32_t f16_to_bits(uint16_t h) {
    /* Move exponent+mantissa into float position and rebias 15 -> 127. Inf/NaN need the
     * exponent pushed the rest of the way to 255. Subnormals come out as 2^-14 * (1 + m/1024)
     * after the implicit-bit fix-up; subtracting 2^-14 is exact and normalises them. */
    uint32_t o = (uint32_t)(h & 0x7FFFu) << 13;
    uint32_t exp = o & 0x0F800000u;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == 0x0F800000u) {
        o += (uint32_t)(128 - 16) << 23;
    } else if (exp == 0) {
        o += 1u << 23;
        o = f32_bits(f32_from_bits(o) - 0x1p-14f);
    }
    return o | ((uint32_t)(h & 0x8000u) << 16);
}

uint16_t hsdp_f32_to_f16(float f) { return f16_from_bits(f32_bits(f)); }

float hsdp_f16_to_f32(uint16_t h) { return f32_from_bits(f16_to_bits(h)); }

/* ---------------------------------------------------------------- float8 */

/* float -> double is exact, so the generic encoder rounds these once. */
uint8_t hsdp_f32_to_f8e4m3(float f) { return (uint8_t)narrow_from_f64((double)f, 4, 3, 1); }

float hsdp_f8e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t e = (b >> 3) & 0x0Fu;
    uint32_t m = b & 0x07u;
    if (e == 0x0F && m == 0x07) return f32_from_bits(sign | 0x7FC00000u); /* the NaN */
    if (e == 0) /* subnormal: m * 2^-9, exact */
        return f32_from_bits(sign | f32_bits((float)m * 0x1p-9f));
    return f32_from_bits(sign | ((e - 7u + 127u) << 23) | (m << 20));
}

uint8_t hsdp_f32_to_f8e5m2(float f) { return (uint8_t)narrow_from_f64((double)f, 5, 2, 0); }

/* e5m2 is float16 with the low 8 mantissa bits dropped, so decode it as one. */
float hsdp_f8e5m2_to_f32(uint8_t b) { return f32_from_bits(f16_to_bits((uint16_t)(b << 8))); }

/* ---------------------------------------------------------------- hsdp_cast */

/* Element loads/stores for the generic paths. memcpy because narrow-dtype buffers (slots in
 * a packed layout) need not be aligned for the wide type. */
static double load_f64(const unsigned char *p, hsdp_dtype dt) {
    switch (dt) {
    case HSDP_F64: {
        double d;
        memcpy(&d, p, 8);
        return d;
    }
    case HSDP_F32: {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    case HSDP_F16: {
        uint16_t h;
        memcpy(&h, p, 2);
        return hsdp_f16_to_f32(h);
    }
    case HSDP_BF16: {
        uint16_t h;
        memcpy(&h, p, 2);
        return hsdp_bf16_to_f32(h);
    }
    case HSDP_F8E4M3:
        return hsdp_f8e4m3_to_f32(*p);
    default: /* HSDP_F8E5M2; the caller only passes floating dtypes */
        return hsdp_f8e5m2_to_f32(*p);
    }
}

static void store_f64(unsigned char *p, hsdp_dtype dt, double d) {
    switch (dt) {
    case HSDP_F64:
        memcpy(p, &d, 8);
        break;
    case HSDP_F32: {
        float f = (float)d; /* binary64 -> binary32 in the (default) nearest-even mode */
        memcpy(p, &f, 4);
        break;
    }
    case HSDP_F16: {
        uint16_t h = narrow_from_f64(d, 5, 10, 0);
        memcpy(p, &h, 2);
        break;
    }
    case HSDP_BF16: {
        uint16_t h = narrow_from_f64(d, 8, 7, 0);
        memcpy(p, &h, 2);
        break;
    }
    case HSDP_F8E4M3:
        *p = (uint8_t)narrow_from_f64(d, 4, 3, 1);
        break;
    default: /* HSDP_F8E5M2 */
        *p = (uint8_t)narrow_from_f64(d, 5, 2, 0);
        break;
    }
}

static float load_f32(const unsigned char *p, hsdp_dtype dt) {
    uint16_t h;
    switch (dt) {
    case HSDP_F32: {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    case HSDP_F16:
        memcpy(&h, p, 2);
        return hsdp_f16_to_f32(h);
    case HSDP_BF16:
        memcpy(&h, p, 2);
        return hsdp_bf16_to_f32(h);
    case HSDP_F8E4M3:
        return hsdp_f8e4m3_to_f32(*p);
    default: /* HSDP_F8E5M2 */
        return hsdp_f8e5m2_to_f32(*p);
    }
}

static void store_f32(unsigned char *p, hsdp_dtype dt, float f) {
    uint16_t h;
    switch (dt) {
    case HSDP_F32:
        memcpy(p, &f, 4);
        break;
    case HSDP_F16:
        h = hsdp_f32_to_f16(f);
        memcpy(p, &h, 2);
        break;
    case HSDP_BF16:
        h = hsdp_f32_to_bf16(f);
        memcpy(p, &h, 2);
        break;
    case HSDP_F8E4M3:
        *p = hsdp_f32_to_f8e4m3(f);
        break;
    default: /* HSDP_F8E5M2 */
        *p = hsdp_f32_to_f8e5m2(f);
        break;
    }
}

static const char *safe_name(hsdp_dtype dt) {
    const char *s = hsdp_dtype_name(dt);
    return s ? s : "<unknown dtype>";
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && __GNUC__ >= 11
/* AVX-512 (x86-64-v4: 16 weights a vector, half the instructions of AVX2's 8; 0.17 against
 * 0.33 ns per weight into bfloat16 on an AMD EPYC, bench/bench_dequant.c), AVX2, or SSE2:
 * whichever the CPU has, chosen at load time */
#define HSDP_VECTORIZE __attribute__((optimize("O3"), target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* AVX2 where the CPU has it (chosen at load time), SSE2 otherwise */
#define HSDP_VECTORIZE __attribute__((optimize("O3"), target_clones("avx2", "default")))
#elif defined(__GNUC__) && !defined(__clang__)
#define HSDP_VECTORIZE __attribute__((optimize("O3")))
#else
#define HSDP_VECTORIZE
#endif

/* bfloat16 to float32, the widening NumPy's compute needs after every gather of a bfloat16
 * unit: a shift, vectorised here (the -O2 build leaves hsdp_cast's loops scalar; 4 MiB of
 * bfloat16 widened in 0.5-0.7 ms against 1.7-2.0 scalar, two processes at once on an AMD
 * EPYC, docs/performance.md section 7). The same bits as bf16_to_bits, element for element. */
HSDP_VECTORIZE static void widen_bf16(unsigned char *d, const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t x;
        memcpy(&x, s + sizeof x * i, sizeof x);
        uint32_t y = bf16_to_bits(x);
        memcpy(d + sizeof y * i, &y, sizeof y);
    }
}

hsdp_status hsdp_cast(void *dst, hsdp_dtype dt, const void *src, hsdp_dtype st, size_t n) {
    if (!dtype_valid(dt) || !dtype_valid(st) ||
        (dt != st && !(hsdp_dtype_is_float(dt) && hsdp_dtype_is_float(st))))
        return hsdp_fail(HSDP_ETYPE, "cannot cast %s to %s", safe_name(st), safe_name(dt));
    if (n == 0) return HSDP_OK; /* dst/src may be NULL then; memcpy(NULL, ..., 0) is UB */

    size_t ssz = hsdp_dtype_size(st), dsz = hsdp_dtype_size(dt);
    if (n > SIZE_MAX / 8)
        return hsdp_fail(HSDP_EINVAL, "cast of %zu elements overflows size_t", n);

    if (dt == st) {
        if (dst != src) memcpy(dst, src, n * ssz);
        return HSDP_OK;
    }

    unsigned char *d = dst;
    const unsigned char *s = src;

    /* Hot pairs get their own loops (no per-element dtype switch); the widening from bf16 is
     * vectorised (widen_bf16), the f16 ones branch per element on the range. One loop, written once: each
     * element's bits (from_t) through fn into to_t's, a macro so that every pair's loop is
     * compiled with its own fn inlined. */
#define CAST_PAIR(from, to, from_t, to_t, fn)                                                                 \
    if (st == (from) && dt == (to)) {                                                                         \
        for (size_t i = 0; i < n; i++) {                                                                      \
            from_t x;                                                                                         \
            memcpy(&x, s + sizeof x * i, sizeof x);                                                           \
            to_t y = fn(x);                                                                                   \
            memcpy(d + sizeof y * i, &y, sizeof y);                                                           \
        }                                                                                                     \
        return HSDP_OK;                                                                                       \
    }
    if (st == HSDP_BF16 && dt == HSDP_F32) {
        widen_bf16(d, s, n);
        return HSDP_OK;
    }
    CAST_PAIR(HSDP_F32, HSDP_BF16, uint32_t, uint16_t, bf16_from_bits)
    CAST_PAIR(HSDP_F16, HSDP_F32, uint16_t, uint32_t, f16_to_bits)
    CAST_PAIR(HSDP_F32, HSDP_F16, uint32_t, uint16_t, f16_from_bits)
#undef CAST_PAIR

    if (st == HSDP_F64 || dt == HSDP_F64) {
        /* Through double: widening to double is exact, and narrowing from it rounds once. */
        for (size_t i = 0; i < n; i++) store_f64(d + i * dsz, dt, load_f64(s + i * ssz, st));
    } else {
        /* Every other float dtype widens exactly to float. */
        for (size_t i = 0; i < n; i++) store_f32(d + i * dsz, dt, load_f32(s + i * ssz, st));
    }
    return HSDP_OK;
}

/* ---------------------------------------------------------------- block-scaled float8 */

/* e4m3fn bits -> float, branch-free so that the loops below vectorise: the magnitude bits
 * a = eeee mmm. A normal (e > 0) is the float with that exponent rebiased by 127 - 7 = 120
 * and those mantissa bits on top; a subnormal (e == 0) is m * 2^-9, exact from the integer
 * (no float subnormal is ever formed, so no CPU slow path). The one NaN per sign is a = 0x7F. */
static inline float e4m3_mag(uint32_t a) {
    uint32_t normal = (a << 20) + (120u << 23);
    uint32_t sub = f32_bits((float)a * 0x1p-9f);
    uint32_t is_sub = 0u - (uint32_t)(a < 8); /* all ones or zero: a select without a branch */
    return f32_from_bits((sub & is_sub) | (normal & ~is_sub));
}

/* One weight: e4m3(x) * scale, rounded once to bfloat16 / float32 / float16. */
static inline uint16_t dequant_bf16_one(uint32_t x, float scale) {
    uint32_t a = x & 0x7Fu, sign = (x & 0x80u) << 8;
    uint32_t b = f32_bits(e4m3_mag(a) * scale); /* finite: |q| <= 448 and scale is finite */
    uint32_t h = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    uint32_t is_nan = 0u - (uint32_t)(a == 0x7Fu);
    return (uint16_t)(((0x7FC0u & is_nan) | (h & ~is_nan)) | sign);
}

static inline float dequant_f32_one(uint32_t x, float scale) {
    uint32_t a = x & 0x7Fu, sign = (x & 0x80u) << 24;
    uint32_t b = f32_bits(e4m3_mag(a) * scale);
    uint32_t is_nan = 0u - (uint32_t)(a == 0x7Fu);
    return f32_from_bits((0x7FC00000u & is_nan) | (b & ~is_nan) | sign);
}

/* f16_from_bits without a branch, so that the float16 loop vectorises too: every case of it
 * is computed and the one that applies is selected by masks (the same bits, case for case;
 * the shift counts are masked to 0..31 only so that the lanes not selected stay defined). */
static inline uint32_t f16_from_bits_nb(uint32_t x) {
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
    uint32_t nan = 0x7E00u | ((a >> 13) & 0x01FFu);
    uint32_t an = a - ((uint32_t)(127 - 15) << 23);
    uint32_t normal = (an + 0x0FFFu + ((an >> 13) & 1u)) >> 13;
    uint32_t m = (a & 0x007FFFFFu) | 0x00800000u, sh = (126u - (a >> 23)) & 31u;
    uint32_t r = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << ((sh - 1u) & 31u);
    uint32_t gt = 0u - (uint32_t)(rem > half), tie = 0u - (uint32_t)(rem == half);
    uint32_t sub = r + ((gt | (tie & (0u - (r & 1u)))) & 1u);
    uint32_t is_nan = 0u - (uint32_t)(a > 0x7F800000u), is_inf = 0u - (uint32_t)(a >= 0x477FF000u);
    uint32_t is_norm = 0u - (uint32_t)(a >= 0x38800000u), is_zero = 0u - (uint32_t)(a <= 0x33000000u);
    uint32_t h = sub & ~is_zero;                    /* below 2^-14: subnormal or zero */
    h = (normal & is_norm) | (h & ~is_norm);        /* 2^-14 up to 65520 */
    h = (0x7C00u & is_inf) | (h & ~is_inf);         /* 65520 and above, inf */
    h = (nan & is_nan) | (h & ~is_nan);
    return sign | h;
}

static inline uint16_t dequant_f16_one(uint32_t x, float scale) {
    uint32_t a = x & 0x7Fu, sign = (x & 0x80u) << 8;
    uint32_t b = f32_bits(e4m3_mag(a) * scale);
    uint32_t is_nan = 0u - (uint32_t)(a == 0x7Fu);
    return (uint16_t)(f16_from_bits_nb((0x7FC00000u & is_nan) | (b & ~is_nan)) | sign);
}

/* A run of n weights in blocks of HSDP_WIRE_BLOCK, the block loop inside the vectorised
 * function: one call (through the ifunc) per run rather than per block, and full blocks'
 * inner loop has a constant trip count (no vector epilogue): 0.158 against 0.177 ns/weight
 * into bfloat16 (bench/bench_dequant.c). */
#define HSDP_DEQUANT_RUN(NAME, T, ONE)                                                                  \
    HSDP_VECTORIZE static void NAME(T *restrict d, const uint8_t *restrict q, const float *scales, size_t n) { \
        size_t full = n / HSDP_WIRE_BLOCK * HSDP_WIRE_BLOCK;                                            \
        for (size_t b0 = 0; b0 < full; b0 += HSDP_WIRE_BLOCK) {                                         \
            float scale;                                                                                \
            memcpy(&scale, scales + b0 / HSDP_WIRE_BLOCK, sizeof scale); /* need not be aligned */      \
            for (size_t j = 0; j < HSDP_WIRE_BLOCK; j++) d[b0 + j] = ONE(q[b0 + j], scale);             \
        }                                                                                               \
        if (full < n) { /* the last, shorter block */                                                   \
            float scale;                                                                                \
            memcpy(&scale, scales + full / HSDP_WIRE_BLOCK, sizeof scale);                              \
            for (size_t j = full; j < n; j++) d[j] = ONE(q[j], scale);                                  \
        }                                                                                               \
    }
HSDP_DEQUANT_RUN(dequant_bf16, uint16_t, dequant_bf16_one)
HSDP_DEQUANT_RUN(dequant_f32, float, dequant_f32_one)
HSDP_DEQUANT_RUN(dequant_f16, uint16_t, dequant_f16_one)

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define HSDP_DEQUANT_VBMI 1
/* With AVX512-VBMI and AVX512-BF16 (AMD Zen 4, Intel Sapphire Rapids and later), chosen at
 * run time: 64 codes at a time, their exact bfloat16 magnitudes looked up in two 128-entry
 * byte tables (one vpermi2b each for the low and the high byte), widened to float32 by
 * placing them in the high half and multiplied by the block's scale: the magnitude's product
 * the scalar loops form (whatever the FPU rounding mode), the code's sign OR'd on after the
 * rounding, as they do. Into float32 it is stored; into float16, rounded by vcvtps2ph (to
 * nearest even, as f16_from_bits); into bfloat16, by vcvtne2ps2bf16, which is the integer
 * rounding of dequant_bf16_one (to nearest even; a NaN stays the quiet NaN) for every normal
 * float32 but flushes subnormal ones to zero, so it takes only blocks whose every nonzero
 * product is normal: scales from 2^-117 (the smallest nonzero code is 2^-9) to FLT_MAX. Into
 * bfloat16 0.06 against 0.17 ns per weight on an AMD EPYC (bench/bench_dequant.c);
 * test_dtype.c checks every code against the reference under scales of every kind. */
#include <immintrin.h>

#include <pthread.h>

/* What dequant_vbmi looks up, made once from e4m3_mag (the scalar loops' own decode) by
 * vbmi_tables_make: the bfloat16 bits of each e4m3fn magnitude a = 0..127 (a = 0x7F: the
 * quiet NaN 0x7FC0), low and high byte, exact, as e4m3fn's 3 mantissa bits and its exponents
 * fit bfloat16's; and the order of the codes (below). */
static struct {
    _Alignas(64) uint8_t lo[128];
    _Alignas(64) uint8_t hi[128];
    _Alignas(64) uint8_t order[64];
} vbmi_tables;
static pthread_once_t vbmi_tables_once = PTHREAD_ONCE_INIT;

static void vbmi_tables_make(void) {
    for (uint32_t a = 0; a < 128; a++) {
        uint32_t b = a == 0x7Fu ? 0x7FC00000u : f32_bits(e4m3_mag(a));
        vbmi_tables.lo[a] = (uint8_t)(b >> 16);
        vbmi_tables.hi[a] = (uint8_t)(b >> 24);
    }
    /* The byte and word unpacks work within 128-bit lanes: code 16L + 4k + j of the permuted
     * vector ends up in float32 vector k, lane L, element j. Permuted so that it is code
     * 16k + 4L + j, the four float32 vectors hold codes 0-15, 16-31, 32-47, 48-63. */
    for (int L = 0; L < 4; L++)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 4; j++) vbmi_tables.order[16 * L + 4 * k + j] = (uint8_t)(16 * k + 4 * L + j);
}

/* Whether a block's scale takes the vector decode into dt: for bfloat16, from 2^-117 to FLT_MAX
 * (see above); for float32 and float16, from +0 to FLT_MAX (a negative, infinite or NaN scale:
 * the scalar loops). */
static int vbmi_takes(float sc, hsdp_dtype dt) {
    uint32_t b = f32_bits(sc);
    return b < 0x7F800000u && (dt != HSDP_BF16 || b >= 0x05000000u);
}

#define HSDP_VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")))

/* The tables and the code order dequant_vbmi works with, loaded once per call. */
typedef struct {
    __m512i lo0, lo1, hi0, hi1, zero, perm;
} vbmi_consts;

/* The magnitudes of the 64 codes at q times the scale in s, as float32: codes 0-15, 16-31,
 * 32-47, 48-63 in p[0..3]. */
HSDP_VBMI_TARGET static inline void vbmi_products(const vbmi_consts *c, const uint8_t *q, __m512 s, __m512 p[4]) {
    __m512i x = _mm512_permutexvar_epi8(c->perm, _mm512_loadu_si512(q));
    __m512i lo = _mm512_permutex2var_epi8(c->lo0, x, c->lo1); /* bit 7, the sign, is not an index bit */
    __m512i hi = _mm512_permutex2var_epi8(c->hi0, x, c->hi1);
    __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);
    p[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(c->zero, w0)), s);
    p[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(c->zero, w0)), s);
    p[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(c->zero, w1)), s);
    p[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(c->zero, w1)), s);
}

/* nblocks whole blocks of HSDP_WIRE_BLOCK codes into dt (bfloat16, float16 or float32); a block
 * whose scale vbmi_takes refuses goes to the scalar loop instead. `stream`: non-temporal
 * stores where dst is 64-byte aligned (each block's output is 256 or 512 bytes on from the
 * last), fenced at the end; they skip reading the destination's lines before writing them
 * (8M weights into bfloat16 decoded out of cache in 0.52 against 0.73 ms, bench/bench_dequant.c
 * cold). */
HSDP_VBMI_TARGET static void dequant_vbmi(void *dst, hsdp_dtype dt, const uint8_t *q, const float *scales,
                                          size_t nblocks, int stream) {
    pthread_once(&vbmi_tables_once, vbmi_tables_make);
    const vbmi_consts c = {.lo0 = _mm512_load_si512(vbmi_tables.lo), .lo1 = _mm512_load_si512(vbmi_tables.lo + 64),
                           .hi0 = _mm512_load_si512(vbmi_tables.hi), .hi1 = _mm512_load_si512(vbmi_tables.hi + 64),
                           .zero = _mm512_setzero_si512(), .perm = _mm512_load_si512(vbmi_tables.order)};
    const __m512i sign16 = _mm512_set1_epi16((short)0x8000), sign32 = _mm512_set1_epi32((int)0x80000000u);
    const __m256i sign16h = _mm256_set1_epi16((short)0x8000);
    unsigned char *out = dst;
    size_t item = hsdp_dtype_size(dt);
    stream = stream && ((uintptr_t)out & 63) == 0;
    for (size_t b = 0; b < nblocks; b++) {
        float sc;
        memcpy(&sc, scales + b, sizeof sc); /* need not be aligned */
        size_t k0 = b * HSDP_WIRE_BLOCK;
        unsigned char *o = out + k0 * item;
        if (!vbmi_takes(sc, dt)) {
            if (dt == HSDP_BF16)
                dequant_bf16((uint16_t *)(void *)o, q + k0, scales + b, HSDP_WIRE_BLOCK);
            else if (dt == HSDP_F32)
                dequant_f32((float *)(void *)o, q + k0, scales + b, HSDP_WIRE_BLOCK);
            else
                dequant_f16((uint16_t *)(void *)o, q + k0, scales + b, HSDP_WIRE_BLOCK);
            continue;
        }
        const __m512 s = _mm512_set1_ps(sc);
        __m512 p[4];
        /* one loop per destination and kind of store, so that none branches inside */
/* the codes' signs (bit 7) OR'd onto the rounded magnitudes: 32 bfloat16, 16 float16, 16 float32 */
#define HSDP_VBMI_LOOP(STEP, ...)                                                   \
    for (size_t k = 0; k < HSDP_WIRE_BLOCK; k += 64, o += (STEP)) {                \
        const uint8_t *qk = q + k0 + k;                                             \
        vbmi_products(&c, qk, s, p);                                                \
        __VA_ARGS__;                                                                \
    }
#define HSDP_BF16_PAIR(v)                                                                                     \
    _mm512_ternarylogic_epi32((__m512i)_mm512_cvtne2ps_pbh(p[2 * (v) + 1], p[2 * (v)]),                      \
                              _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const void *)(qk + 32 * (v)))), 8), \
                              sign16, 0xF8)
#define HSDP_F16_QUAD(v)                                                                                      \
    _mm256_ternarylogic_epi32(_mm512_cvtps_ph(p[v], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),          \
                              _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)(qk + 16 * (v)))), 8), \
                              sign16h, 0xF8)
#define HSDP_F32_QUAD(v)                                                                                      \
    _mm512_castsi512_ps(_mm512_ternarylogic_epi32(                                                            \
        _mm512_castps_si512(p[v]),                                                                            \
        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(qk + 16 * (v)))), 24), sign32, 0xF8))
        if (dt == HSDP_BF16 && stream) {
            HSDP_VBMI_LOOP(128, for (int v = 0; v < 2; v++) _mm512_stream_si512((void *)(o + 64 * v), HSDP_BF16_PAIR(v)))
        } else if (dt == HSDP_BF16) {
            HSDP_VBMI_LOOP(128, for (int v = 0; v < 2; v++) _mm512_storeu_si512(o + 64 * v, HSDP_BF16_PAIR(v)))
        } else if (dt == HSDP_F32 && stream) {
            HSDP_VBMI_LOOP(256, for (int v = 0; v < 4; v++) _mm512_stream_ps((float *)(void *)(o + 64 * v),
                                                                                HSDP_F32_QUAD(v)))
        } else if (dt == HSDP_F32) {
            HSDP_VBMI_LOOP(256, for (int v = 0; v < 4; v++) _mm512_storeu_ps(o + 64 * v, HSDP_F32_QUAD(v)))
        } else if (stream) {
            HSDP_VBMI_LOOP(128, for (int v = 0; v < 4; v++) _mm256_stream_si256((__m256i *)(void *)(o + 32 * v),
                                                                                 HSDP_F16_QUAD(v)))
        } else {
            HSDP_VBMI_LOOP(128, for (int v = 0; v < 4; v++) _mm256_storeu_si256((__m256i *)(void *)(o + 32 * v),
                                                                                  HSDP_F16_QUAD(v)))
        }
#undef HSDP_F32_QUAD
#undef HSDP_F16_QUAD
#undef HSDP_BF16_PAIR
#undef HSDP_VBMI_LOOP
    }
    if (stream) _mm_sfence(); /* the streamed lines are seen by whoever reads them next */
}
#endif

/* Whole blocks by dequant_vbmi where the CPU has it, the rest by the scalar loops. */
static void dequant_run(void *dst, hsdp_dtype dt, const uint8_t *q, const float *scales, size_t n, int stream) {
    size_t full = 0, item = hsdp_dtype_size(dt);
#ifdef HSDP_DEQUANT_VBMI
    if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16")) {
        full = n / HSDP_WIRE_BLOCK * HSDP_WIRE_BLOCK;
        dequant_vbmi(dst, dt, q, scales, full / HSDP_WIRE_BLOCK, stream);
    }
#endif
    (void)stream;
    if (full == n) return;
    unsigned char *d = (unsigned char *)dst + full * item;
    const float *sc = scales + full / HSDP_WIRE_BLOCK;
    if (dt == HSDP_BF16)
        dequant_bf16((uint16_t *)(void *)d, q + full, sc, n - full);
    else if (dt == HSDP_F32)
        dequant_f32((float *)(void *)d, q + full, sc, n - full);
    else
        dequant_f16((uint16_t *)(void *)d, q + full, sc, n - full);
}

static inline int finite_f32(float f) { return (f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

/* float -> e4m3fn for a finite |r| <= 448, rounding to nearest even: for a normal result,
 * the float's 23 mantissa bits round to 3 (a carry bumps the exponent, as it should) and the
 * exponent is rebiased 127 -> 7; below 2^-6 the result is subnormal, rare in a scaled block,
 * and the generic encoder does it. */
static inline uint8_t e4m3_from_finite(float r) {
    uint32_t b = f32_bits(r), sign = (b >> 24) & 0x80u, a = b & 0x7FFFFFFFu;
    if (a < 0x3C800000u) return (uint8_t)(sign | hsdp_f32_to_f8e4m3(f32_from_bits(a)));
    uint32_t rounded = a + 0x7FFFFu + ((a >> 20) & 1u);
    return (uint8_t)(sign | ((rounded >> 20) - (120u << 3)));
}

hsdp_status hsdp_quantize_blocks(uint8_t *q, float *scales, const void *src, hsdp_dtype st, size_t n) {
    if (st != HSDP_F32 && st != HSDP_F16 && st != HSDP_BF16)
        return hsdp_fail(HSDP_ETYPE, "only float32, float16 and bfloat16 are quantized to float8, not %s",
                         safe_name(st));
    size_t ssz = hsdp_dtype_size(st);
    const unsigned char *s = src;
    for (size_t b0 = 0, bi = 0; b0 < n; b0 += HSDP_WIRE_BLOCK, bi++) {
        size_t m = n - b0 < HSDP_WIRE_BLOCK ? n - b0 : HSDP_WIRE_BLOCK;
        float x[HSDP_WIRE_BLOCK], amax = 0.0f;
        hsdp_status cst = hsdp_cast(x, HSDP_F32, s + b0 * ssz, st, m); /* the block as float32 */
        if (cst != HSDP_OK) return cst;
        for (size_t j = 0; j < m; j++) {
            float a = x[j] < 0 ? -x[j] : x[j];
            if (finite_f32(x[j]) && a > amax) amax = a; /* NaN compares false: skipped too */
        }
        /* absmax / 448 rounded once to float32; 0 for an all-zero (or all non-finite) block
         * and for a block so small that the division underflows (absmax < 448 * 2^-150). */
        float scale = amax / HSDP_F8E4M3_MAX;
        memcpy(scales + bi, &scale, sizeof scale);
        for (size_t j = 0; j < m; j++) {
            float v = x[j];
            uint8_t o;
            if (!finite_f32(v)) {
                o = hsdp_f32_to_f8e4m3(v); /* NaN stays NaN; +-inf becomes NaN (no inf in e4m3fn) */
            } else if (scale == 0.0f) {
                o = (uint8_t)(f32_bits(v) >> 31 << 7); /* +-0 */
            } else {
                /* A rounded scale can put absmax a hair over 448 (or, for a subnormal scale,
                 * more): saturate, so a finite weight never becomes NaN. */
                float r = v / scale;
                if (r > HSDP_F8E4M3_MAX) r = HSDP_F8E4M3_MAX;
                if (r < -HSDP_F8E4M3_MAX) r = -HSDP_F8E4M3_MAX;
                o = e4m3_from_finite(r);
            }
            q[b0 + j] = o;
        }
    }
    return HSDP_OK;
}

static hsdp_status dequantize(void *dst, hsdp_dtype dt, const uint8_t *q, const float *scales, size_t n, int stream) {
    if (dt != HSDP_F32 && dt != HSDP_F16 && dt != HSDP_BF16)
        return hsdp_fail(HSDP_ETYPE, "float8 blocks are dequantized to float32, float16 or bfloat16, not %s",
                         safe_name(dt));
    /* dst is element-aligned: slots and their pieces start on element boundaries of
     * 64-byte-aligned buffers (callers of this function keep that). */
    dequant_run(dst, dt, q, scales, n, stream);
    return HSDP_OK;
}

hsdp_status hsdp_dequantize_blocks(void *dst, hsdp_dtype dt, const uint8_t *q, const float *scales, size_t n) {
    return dequantize(dst, dt, q, scales, n, 0);
}

hsdp_status hsdp_dequantize_blocks_streaming(void *dst, hsdp_dtype dt, const uint8_t *q, const float *scales,
                                             size_t n) {
    return dequantize(dst, dt, q, scales, n, 1);
}
