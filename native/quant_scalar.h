// The compressed-state scheme (offload/kernels/quant.py) one element at a time: the scalar
// unit's whole implementation and the SIMD units' tails. Every operation here is exact
// (integer ops, one IEEE float division and square root, comparisons), so a SIMD lane and
// this code give the same bits by construction.
// `static inline` in an anonymous namespace: each ISA unit gets its own copy (see kernel.h).
#ifndef OFFLOAD_QUANT_SCALAR_H
#define OFFLOAD_QUANT_SCALAR_H

#include <stdint.h>
#include <string.h>

#include "convert.h"
#include "kernel.h"

namespace {

// Chris Wellons' lowbias32 (quant.lowbias32).
static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

// quant.round_bf16_stochastic of one element: (bits + r) >> 16, NaN -> 0xFFFF; r is the
// half of lowbias32(index ^ key) at `shift` (16: top, 0: low), key = kernel.h's stream_key.
static inline uint16_t bf16_stochastic(float f, uint32_t index, uint32_t key, int shift) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;
    return static_cast<uint16_t>((u + ((lowbias32(index ^ key) >> shift) & 0xFFFFu)) >> 16);
}

// #{i : mid[i] < xn} by the Eytzinger tree of the midpoints (kernel.h's Q8Tables).
static inline uint8_t q8_code_one(float xn, const float *tree) {
    uint32_t idx = 1;
    for (int level = 0; level < 8; ++level) idx = 2 * idx + (tree[idx] < xn ? 1u : 0u);
    return static_cast<uint8_t>(idx - 256);
}

// The same code by the bucket table ([Note: bucketed encoder] in q8_buckets.h). |xn| is
// held to [2^-31, 2) before it indexes anything, so no input reads outside the tables
// (the encoder only sees |xn| <= 1: x / max |x|).
static inline uint8_t q8_code_bucket(float xn, const offload::Q8Buckets &b) {
    const uint32_t u = f32_bits(xn);
    uint32_t ac = u & 0x7FFFFFFFu;
    ac = ac < (96u << 23) ? (96u << 23) : ac > 0x3FFFFFFFu ? 0x3FFFFFFFu : ac;
    const int32_t kw = b.key[(u >> 31) * 32 + ((ac >> 23) & 31)];
    const uint32_t shift = static_cast<uint32_t>(kw) & 31u;  // 13..23
    const uint32_t w = b.word[(ac >> shift) + static_cast<uint32_t>(kw >> 5)];
    const uint32_t rel = (u ^ (0u - (u >> 31))) << (32 - shift);
    return static_cast<uint8_t>(w + (rel >= (w & ~0xFFu) ? 1u : 0u));
}

// What a code counts the midpoints below: x / absmax, or with a square-root code (Q8U)
// sqrt(max(x / absmax, 0)) ([Note: square-root code] in quant.py). IEEE division and square
// root; max(xn, 0) as the SIMD units' maxps(xn, 0) (+0 for -0 and negatives).
static inline float q8_norm(float x, float absmax, bool root) {
    const float xn = x / absmax;
    return root ? __builtin_sqrtf(xn > 0.0f ? xn : 0.0f) : xn;
}

static inline void q8_codes_scalar(const float *x, int64_t len, float absmax,
                                   const offload::Q8Tables &t, uint8_t *codes) {
    const bool root = t.sqrt_code;
    if (t.buckets) {
        for (int64_t i = 0; i < len; ++i) codes[i] = q8_code_bucket(q8_norm(x[i], absmax, root), *t.buckets);
    } else {
        for (int64_t i = 0; i < len; ++i) codes[i] = q8_code_one(q8_norm(x[i], absmax, root), t.tree);
    }
}

// max over i of bits(|x[i]|) as an unsigned integer: for non-negative floats the integer
// order is the float order, and a NaN or inf shows as a value >= 0x7F800000.
static inline uint32_t abs_bits_max_scalar(const float *x, int64_t len) {
    uint32_t m = 0;
    for (int64_t i = 0; i < len; ++i) {
        const uint32_t a = f32_bits(x[i]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

static inline void q8_decode_scalar(const uint8_t *codes, float absmax, const float *map,
                                    float *out, int64_t len) {
    for (int64_t i = 0; i < len; ++i) out[i] = map[codes[i]] * absmax;
}

static inline void bf16_load_scalar(const uint16_t *src, float *out, int64_t len) {
    for (int64_t i = 0; i < len; ++i) out[i] = bf16_to_float(src[i]);
}

static inline void bf16_nearest_scalar(const float *x, uint16_t *dst, int64_t len) {
    for (int64_t i = 0; i < len; ++i) dst[i] = float_to_bf16(x[i]);
}

static inline void bf16_stochastic_scalar(const float *x, uint16_t *dst, int64_t len,
                                          uint32_t start, uint32_t key, int shift) {
    for (int64_t i = 0; i < len; ++i)
        dst[i] = bf16_stochastic(x[i], start + static_cast<uint32_t>(i), key, shift);
}

}  // namespace

#endif
