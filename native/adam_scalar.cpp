// Portable Adam kernel: the fallback for CPUs without AVX2, and the numerics every SIMD
// unit mirrors. Compiled with baseline flags only (the compiler may still use SSE2).
#include <cerrno>
#include <cmath>

#include "convert.h"
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

// Statement order follows torch's _single_tensor_adam (the scalars are folded by
// offload/kernels/adam_consts.py).
template <int G, int L, bool L2, bool FROM_END>
void adam_loop(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) {
    float *__restrict p = b.param;
    float *__restrict m = b.exp_avg;
    float *__restrict v = b.exp_avg_sq;
    uint16_t *__restrict lowp = static_cast<uint16_t *>(b.lowp);
    for (int64_t i = begin; i < end; ++i) {
        float g = load_grad<G>(b.grad, i) * c.grad_scale;
        float pi = p[i];
        if (L2) g = g + c.l2 * pi;
        pi = pi * c.decay;
        float mi = m[i];
        mi = c.lerp_coeff * (g - mi) + (FROM_END ? g : mi);
        float vi = v[i] * c.beta2;
        vi = vi + c.one_minus_beta2 * g * g;
        float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
        pi = pi + c.neg_step_size * mi / denom;
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (L == OFFLOAD_F16) lowp[i] = float_to_half(pi);
        if (L == OFFLOAD_BF16) lowp[i] = float_to_bf16(pi);
    }
}

OFFLOAD_UNIT_DISPATCH_TEMPLATES

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

}  // namespace

OFFLOAD_UNIT_ENTRY_POINTS(scalar)
