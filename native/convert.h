// fp16 / bf16 <-> fp32 conversions in portable C++, bit-exact with what torch's CPU kernels
// produce on x86 (checked by tests/test_kernels.py):
//  - fp32 -> fp16: IEEE round-to-nearest-even, as the F16C instruction vcvtps2ph does,
//    including its NaN rule (quiet bit set, top 10 payload bits kept, sign kept);
//  - fp32 -> bf16: torch's round_to_nearest_even, with NaN -> 0xFFFF as torch's vectorized
//    conversion (cvtfp32_bf16) writes it on AVX2 and AVX-512 CPUs;
//  - fp16 -> fp32 and bf16 -> fp32 are exact.
// Everything here is `static inline` in an anonymous namespace: each ISA unit gets its own
// copy compiled with its own flags (see kernel.h).
#ifndef OFFLOAD_CONVERT_H
#define OFFLOAD_CONVERT_H

#include <stdint.h>
#include <string.h>

namespace {

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// After Maratos' FP16 library (fp16_ieee_to_fp32_value), which torch's c10::Half uses.
static inline float half_to_float(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float exp_scale = 0x1.0p-112f;
    const float normalized = bits_f32((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = 126u << 23;
    const float magic_bias = 0.5f;
    const float denormalized = bits_f32((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = 1u << 27;
    const uint32_t result = sign | (two_w < denormalized_cutoff ? f32_bits(denormalized)
                                                                : f32_bits(normalized));
    return bits_f32(result);
}

// fp16_ieee_from_fp32_value, with the NaN rule of vcvtps2ph.
static inline uint16_t float_to_half(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    if (shl1_w > 0xFF000000u)  // NaN
        return static_cast<uint16_t>((sign >> 16) | 0x7E00u | ((w >> 13) & 0x3FFu));
    float base = (bits_f32(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    return static_cast<uint16_t>((sign >> 16) | (exp_bits + mantissa_bits));
}

static inline float bf16_to_float(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

static inline uint16_t float_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;  // NaN, as torch's vector path
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

#endif
