/* dtype_float8.c - the float8 wire's block-scaled codec (hsdp.h: hsdp_quantize_blocks,
 * hsdp_dequantize_blocks): a block of HSDP_WIRE_BLOCK weights as e4m3fn bytes and one float32
 * scale, encoded on the host, and decoded on the host by vectorised loops (or, on CPUs that
 * have it, AVX-512 VBMI table lookups). The GPU's decode is cuda_dequant.c's kernel. */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype_bits.h"
#include "hsdp.h"

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
