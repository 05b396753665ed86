/* wire_kernel.h - the float8 wire's dequantization on a GPU, as ONE text that is both the CUDA
 * kernel (compiled by NVRTC at first use, cuda_dequant.c) and C (the fake CUDA library runs
 * it on the host in its place, csrc/tests/fake_cuda_nccl.c). The tests therefore check the
 * kernel's own arithmetic against the host's (hsdp_dequantize_blocks in dtype.c) bit for bit.
 *
 * The includer defines HSDP_WK(...) first: `#__VA_ARGS__` makes the text a string (the
 * kernel source), `__VA_ARGS__` compiles it here. Inside it: no preprocessor lines, no string
 * or character literals, no hexadecimal floats (C++ before 17 has none), and only what C and
 * CUDA C++ mean the same way. Three names are the includer's: HSDP_WK_FN (a function's
 * qualifiers), HSDP_WK_U32(f) and HSDP_WK_F32(u) (a float's bits and back).
 *
 * The arithmetic is dtype.c's: e4m3fn bits -> float (normal: rebias the exponent; subnormal:
 * the integer times 2^-9, exact), times the block's float32 scale (one multiply, no FMA: the
 * kernel is compiled with --fmad=false, and no flush to zero), rounded once to the destination
 * with integer rounding to nearest even. A NaN byte (0x7F / 0xFF) gives the quiet NaN.
 *
 * The work. A launch gets up to HSDP_WK_SEGS segments by value (no device memory to own):
 * each zeroes, copies or dequantizes a contiguous run of the gathered buffer. A segment is cut
 * into items: HSDP_WK_BLOCK elements (one scale block: its scale is scales[item]) or
 * HSDP_WK_BYTES bytes; each CUDA block of HSDP_WK_BLOCK threads does one item at a time.
 * hsdp_wk_item finds its segment through a pointer to the parameters (a binary search over
 * seg[].first), which the host form needs; the kernel declares them __grid_constant__
 * (cuda_dequant.c), so on the GPU that pointer reads the parameter space in place rather than
 * a per-thread copy in local memory (issue 30, D7). */
#ifndef HSDP_WIRE_KERNEL_H
#define HSDP_WIRE_KERNEL_H

#define HSDP_WK_BLOCK 128 /* threads per CUDA block; elements per item; HSDP_WIRE_BLOCK (hsdp.h) */
#define HSDP_WK_BYTES 512 /* bytes per item of a copy or a zeroing */
#define HSDP_WK_SEGS 80   /* segments per launch: 8 + 80 * 40 bytes of parameters, under CUDA's 4 KiB */
#define HSDP_WK_NAME "hsdp_wire_dequant" /* the kernel's entry point (keep in step with the text) */
enum { HSDP_WK_ZERO = 0, HSDP_WK_COPY = 1, HSDP_WK_BF16 = 2, HSDP_WK_F16 = 3, HSDP_WK_F32 = 4 };

#define HSDP_WK_TEXT                                                                                          \
    HSDP_WK(                                                                                                  \
    typedef struct {                                                                                          \
        unsigned long long dst, src, scales; /* device addresses */                                           \
        unsigned long long n;                /* elements (dequantized) or bytes (zero, copy) */               \
        unsigned int first;                  /* the segment's first item in this launch */                    \
        unsigned int kind;                   /* HSDP_WK_ZERO .. HSDP_WK_F32 */                                \
    } hsdp_wk_seg;                                                                                            \
    typedef struct {                                                                                          \
        unsigned int nseg, items;                                                                             \
        hsdp_wk_seg seg[80];                                                                                  \
    } hsdp_wk_args;                                                                                           \
                                                                                                              \
    HSDP_WK_FN float hsdp_wk_e4m3_mag(unsigned int a) {                                                       \
        unsigned int normal = (a << 20) + (120u << 23);                                                       \
        unsigned int sub = HSDP_WK_U32((float)a * 1.953125e-3f);                                              \
        return HSDP_WK_F32(a < 8u ? sub : normal);                                                            \
    }                                                                                                         \
    HSDP_WK_FN unsigned int hsdp_wk_round_even(unsigned int m, unsigned int shift) {                          \
        unsigned int r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);               \
        return r + ((rem > half || (rem == half && (r & 1u))) ? 1u : 0u);                                     \
    }                                                                                                         \
    HSDP_WK_FN unsigned int hsdp_wk_f16(unsigned int x) {                                                     \
        unsigned int sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;                                         \
        if (a > 0x7F800000u) return sign | 0x7E00u | ((a >> 13) & 0x01FFu);                                   \
        if (a >= 0x477FF000u) return sign | 0x7C00u;                                                          \
        if (a >= 0x38800000u) {                                                                               \
            a -= 112u << 23;                                                                                  \
            a += 0x0FFFu + ((a >> 13) & 1u);                                                                  \
            return sign | (a >> 13);                                                                          \
        }                                                                                                     \
        if (a <= 0x33000000u) return sign;                                                                    \
        return sign | hsdp_wk_round_even((a & 0x007FFFFFu) | 0x00800000u, 126u - (a >> 23));                 \
    }                                                                                                         \
    HSDP_WK_FN void hsdp_wk_item(const hsdp_wk_args *args, unsigned int item, unsigned int t) {               \
        unsigned int lo = 0, hi = args->nseg;                                                                 \
        while (hi - lo > 1u) {                                                                                \
            unsigned int mid = (lo + hi) / 2u;                                                                \
            if (args->seg[mid].first <= item) lo = mid; else hi = mid;                                        \
        }                                                                                                     \
        const hsdp_wk_seg *s = &args->seg[lo];                                                                \
        unsigned long long k = item - s->first;                                                               \
        unsigned char *dst = (unsigned char *)s->dst;                                                         \
        const unsigned char *src = (const unsigned char *)s->src;                                             \
        if (s->kind == 0u || s->kind == 1u) {                                                                 \
            unsigned long long end = (k + 1u) * 512u < s->n ? (k + 1u) * 512u : s->n;                         \
            for (unsigned long long j = k * 512u + t; j < end; j += 128u) dst[j] = s->kind ? src[j] : 0;      \
            return;                                                                                           \
        }                                                                                                     \
        unsigned long long i = k * 128u + t;                                                                  \
        if (i >= s->n) return;                                                                                \
        unsigned int q = src[i], a = q & 0x7Fu;                                                               \
        float scale = ((const float *)s->scales)[k];                                                          \
        unsigned int b = HSDP_WK_U32(hsdp_wk_e4m3_mag(a) * scale);                                            \
        if (s->kind == 4u) {                                                                                  \
            ((unsigned int *)dst)[i] = (a == 0x7Fu ? 0x7FC00000u : b) | (q & 0x80u) << 24;                    \
        } else if (s->kind == 2u) {                                                                           \
            unsigned int h = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;                                          \
            ((unsigned short *)dst)[i] = (unsigned short)((a == 0x7Fu ? 0x7FC0u : h) | (q & 0x80u) << 8);     \
        } else {                                                                                              \
            unsigned int h = hsdp_wk_f16(a == 0x7Fu ? 0x7FC00000u : b);                                       \
            ((unsigned short *)dst)[i] = (unsigned short)(h | (q & 0x80u) << 8);                              \
        }                                                                                                     \
    }                                                                                                         \
    )

/* The text as C, here: the launch parameters' types for cuda_dequant.c, and the host run of the
 * kernel for the fake library (hsdp_wk_item over every item and thread). */
#include <string.h>
static inline unsigned int hsdp_wk_u32_host(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline float hsdp_wk_f32_host(unsigned int u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#define HSDP_WK_FN static inline
#define HSDP_WK_U32(f) hsdp_wk_u32_host(f)
#define HSDP_WK_F32(u) hsdp_wk_f32_host(u)
#define HSDP_WK(...) __VA_ARGS__
HSDP_WK_TEXT
#undef HSDP_WK
#undef HSDP_WK_FN
#undef HSDP_WK_U32
#undef HSDP_WK_F32
_Static_assert(sizeof(hsdp_wk_seg) == 40, "a segment is 40 bytes on host and device alike");
_Static_assert(sizeof(((hsdp_wk_args *)0)->seg) / sizeof(hsdp_wk_seg) == HSDP_WK_SEGS, "seg[80] is HSDP_WK_SEGS");
_Static_assert(sizeof(hsdp_wk_args) <= 4096, "a launch's parameters fit CUDA's 4 KiB");

#endif
