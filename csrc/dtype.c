/* dtype.c - dtype metadata, scalar float conversions and hsdp_cast.
 *
 * Every narrowing conversion rounds to nearest, ties to even, with integer arithmetic on the
 * bit patterns, so the result never depends on the FPU rounding mode. Widening is exact. The
 * float8 wire's block-scaled codec is in dtype_float8.c. */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype_bits.h"
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
