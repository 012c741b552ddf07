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

// ---- sum of squares: the SIMD units' blocked fp32 sum (sumsq_blocks.h, [Note: sumsq in
// fp32 blocks] in unit_dispatch.h) with lanes as arrays and each FMA a std::fmaf (one fp32
// rounding, as vfmadd; glibc's is exact without FMA hardware too): the same bits as the
// AVX2 and AVX-512 units. A double add then a cast to float would round twice.
struct SumsqF {
    float v[8];
};
struct SumsqD {
    double v[4];
};

inline SumsqF sumsq_zero() { return SumsqF{}; }
inline SumsqF sumsq_add(SumsqF a, SumsqF b) {
    for (int l = 0; l < 8; ++l) a.v[l] += b.v[l];
    return a;
}
inline SumsqD sumsq_dzero() { return SumsqD{}; }
inline void sumsq_widen_add(SumsqF t, SumsqD &d0, SumsqD &d1) {
    for (int l = 0; l < 4; ++l) {
        d0.v[l] += static_cast<double>(t.v[l]);
        d1.v[l] += static_cast<double>(t.v[4 + l]);
    }
}
inline double sumsq_dtotal(SumsqD d0, SumsqD d1) {
    double l[4];
    for (int k = 0; k < 4; ++k) l[k] = d0.v[k] + d1.v[k];
    return (l[0] + l[1]) + (l[2] + l[3]);
}
inline bool lanes_all_below(SumsqF t, float limit) {
    bool all = true;
    for (int l = 0; l < 8; ++l) all = all && t.v[l] < limit;  // false for NaN, as _CMP_LT_OQ
    return all;
}
inline bool lanes_none_at_least(SumsqF t, float limit) {
    bool none = true;
    for (int l = 0; l < 8; ++l) none = none && !(t.v[l] >= limit);
    return none;
}

// elements i .. i + len - 1 (len <= 16) into the lanes of sumsq_blocks.h's sumsq_full
template <int G>
inline void sumsq_lanes(const void *g, int64_t i, int64_t len, SumsqF &a, SumsqF &b) {
    for (int64_t m = 0; m < len; ++m) {
        float x = load_grad<G>(g, i + m);
        // bf16: a takes the even elements, b the odd ones; otherwise a the first 8
        int64_t lane = G == OFFLOAD_BF16 ? m / 2 : m % 8;
        bool in_b = G == OFFLOAD_BF16 ? (m % 2 == 1) : (m >= 8);
        float &acc = in_b ? b.v[lane] : a.v[lane];
        acc = std::fmaf(x, x, acc);
    }
}
template <int G>
inline void sumsq_full(const void *g, int64_t i, SumsqF &a, SumsqF &b) {
    sumsq_lanes<G>(g, i, 16, a, b);
}
// A missing element adds 0 * 0 in the SIMD units: fma(0, 0, acc) is acc, so it is skipped.
template <int G>
inline void sumsq_tail(const void *g, int64_t i, int64_t end, SumsqF &a, SumsqF &b) {
    sumsq_lanes<G>(g, i, end - i, a, b);
}

// The exact path in the SIMD units' order: element begin + j into double lane j % 8
// (products of floats are exact in double, so a multiply and an add are their FMA).
template <int G>
double sumsq_f64(const void *g, int64_t begin, int64_t end) {
    SumsqD d0 = sumsq_dzero(), d1 = d0;
    for (int64_t j = 0; j < end - begin; ++j) {
        double x = load_grad<G>(g, begin + j);
        double &acc = j % 8 < 4 ? d0.v[j % 4] : d1.v[j % 4];
        acc += x * x;
    }
    return sumsq_dtotal(d0, d1);
}

#include "sumsq_blocks.h"

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
