/* dtype_bits.h - what dtype.c (the scalar conversions, hsdp_cast) and dtype_float8.c (the
 * float8 wire's block-scaled codec) share: a float's bits, the attribute that vectorises
 * their loops, and a dtype's name for a message. */
#ifndef HSDP_DTYPE_BITS_H
#define HSDP_DTYPE_BITS_H

#include <stdint.h>
#include <string.h>

#include "hsdp.h"

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

static inline const char *safe_name(hsdp_dtype dt) {
    const char *s = hsdp_dtype_name(dt);
    return s ? s : "<unknown dtype>";
}

#endif
