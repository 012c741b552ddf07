// Portable Adam kernel: the fallback for CPUs without AVX2, with the numerics (and the
// FMAs) of the SIMD units. Compiled with baseline flags only (the compiler may still use SSE2).
#include <cerrno>
#include <cmath>
#include <cstring>

#include "convert.h"
#include "quant_scalar.h"
#include "kernel.h"
#include "unit_dispatch.h"
#include "offload_native.h"

namespace {

using namespace offload;

template <int G>
inline float load_grad(const void *g, int64_t i) {
    if (G == OFFLOAD_F32) return static_cast<const float *>(g)[i];
    if (G == OFFLOAD_F16) return half_to_float(static_cast<const uint16_t *>(g)[i]);
    return bf16_to_float(static_cast<const uint16_t *>(g)[i]);
}

// torch's _single_tensor_adam (the scalars are folded by offload/kernels/adam_consts.py) with
// the FMAs of the SIMD units' adam_math (avx512_adam.h, [Note: explicit FMAs]) and of numba's
// adam_update, written out as std::fma: every unit and numba then give the same bits. (This
// loop once wrote them as a multiply and an add, and the scalar unit alone differed in the
// last bit.) On a CPU without FMA glibc computes std::fma exactly in software: slower, the
// same bits.
template <int G, int L, bool L2, bool FROM_END>
void adam_loop(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) {
    float *__restrict p = b.param;
    float *__restrict m = b.exp_avg;
    float *__restrict v = b.exp_avg_sq;
    uint16_t *__restrict lowp = static_cast<uint16_t *>(b.lowp);
    const bool bc2_one = bias_correction_one(c.bc2_sqrt);
    for (int64_t i = begin; i < end; ++i) {
        float g = load_grad<G>(b.grad, i) * c.grad_scale;
        float pi = p[i];
        if (L2) g = std::fma(pi, c.l2, g);
        float mi = m[i];
        mi = std::fma(c.lerp_coeff, g - mi, FROM_END ? g : mi);
        float vi = std::fma(c.one_minus_beta2 * g, g, v[i] * c.beta2);
        const float root = std::sqrt(vi);  // [Note: a bias correction of one] (kernel.h)
        float denom = (bc2_one ? root : root / c.bc2_sqrt) + c.eps;
        pi = pi * c.decay + (c.neg_step_size * mi) / denom;  // two roundings, as torch (-ffp-contract=off)
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (L == OFFLOAD_F16) lowp[i] = float_to_half(pi);
        if (L == OFFLOAD_BF16) lowp[i] = float_to_bf16(pi);
    }
}

OFFLOAD_UNIT_DISPATCH_TEMPLATES

// ---- SGD, Adagrad, Lion (rule_loop.h) with one-lane "vectors": the portable reference.
// vfmadd is std::fma, one rounding as in the SIMD units and torch's vectorized kernels,
// unlike adam_loop above: Lion takes the sign of a lerp, so one rounding of difference
// near zero moves a param by a whole lr. On a CPU without FMA glibc computes it exactly in
// software (slower; this unit is the fallback of CPUs without AVX2).
constexpr int64_t kLanes = 1;
constexpr uintptr_t kStreamAlign = 0;  // no streamed stores here
using VF = float;
inline VF vset1(float x) { return x; }
inline VF vload(const float *p) { return *p; }
inline void vstore(float *p, VF x) { *p = x; }
inline VF vadd(VF a, VF b) { return a + b; }
inline VF vsub(VF a, VF b) { return a - b; }
inline VF vmul(VF a, VF b) { return a * b; }
inline VF vdiv(VF a, VF b) { return a / b; }
inline VF vsqrt(VF a) { return std::sqrt(a); }
inline VF vfmadd(VF a, VF b, VF c) { return std::fma(a, b, c); }
inline VF vsign(VF x) { return static_cast<float>(0.0f < x) - static_cast<float>(x < 0.0f); }
// torch.maximum's vectorized form (max_ps: b unless a > b; all-ones NaN where either is NaN),
// so the units agree on every bit
inline VF vmax_nan(VF a, VF b) {
    if (a != a || b != b) {
        const uint32_t ones = 0xFFFFFFFFu;
        float nan;
        memcpy(&nan, &ones, 4);
        return nan;
    }
    return a > b ? a : b;
}
template <int G>
inline VF vload_grad(const void *g, int64_t i) { return load_grad<G>(g, i); }
template <int L, bool STREAM>
inline void vstore_lowp(void *dst, int64_t i, VF x) {
    if (L == OFFLOAD_F16) static_cast<uint16_t *>(dst)[i] = float_to_half(x);
    if (L == OFFLOAD_BF16) static_cast<uint16_t *>(dst)[i] = float_to_bf16(x);
}
inline void vfence() {}

#include "rule_loop.h"

template <int G>
double sumsq_loop(const void *g, int64_t begin, int64_t end) {
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = begin;
    for (; i + 4 <= end; i += 4)
        for (int k = 0; k < 4; ++k) {
            double x = load_grad<G>(g, i + k);
            acc[k] += x * x;
        }
    for (; i < end; ++i) {
        double x = load_grad<G>(g, i);
        acc[0] += x * x;
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// ---- compressed states: the scheme one element at a time (quant_scalar.h), the fused
// tiles of compressed_tile.h around the loops above.
inline void q8_decode(const uint8_t *codes, float absmax, const Q8Tables &t, float *out, int64_t len) {
    q8_decode_scalar(codes, absmax, t.map, out, len);
}
inline uint32_t abs_bits_max(const float *x, int64_t len) { return abs_bits_max_scalar(x, len); }
inline void q8_codes(const float *x, int64_t len, float absmax, const Q8Tables &t, uint8_t *codes) {
    q8_codes_scalar(x, len, absmax, t, codes);
}
inline void bf16_load(const uint16_t *src, float *out, int64_t len) { bf16_load_scalar(src, out, len); }
inline void bf16_nearest(const float *x, uint16_t *dst, int64_t len) { bf16_nearest_scalar(x, dst, len); }
inline void bf16_stochastic_store(const float *x, uint16_t *dst, int64_t len, uint32_t start,
                                  uint32_t key, int shift) {
    bf16_stochastic_scalar(x, dst, len, start, key, shift);
}

#include "compressed_tile.h"

}  // namespace

OFFLOAD_UNIT_ENTRY_POINTS(scalar)
OFFLOAD_RULE_ENTRY_POINTS(scalar)
OFFLOAD_COMPRESSED_ENTRY_POINT(scalar)
