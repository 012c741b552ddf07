// The part of every ISA unit that is the same in all of them: picking the template
// instantiation of the unit's own `adam_loop` / `sumsq_loop` from run-time flags and dtypes,
// and the unit's two entry points (declared in kernel.h).
//
// Macros rather than shared functions on purpose: each expansion is compiled inside its
// own unit, with that unit's flags, and refers to that unit's anonymous-namespace loops, so
// no instruction set leaks across units (see kernel.h).
#ifndef OFFLOAD_UNIT_DISPATCH_H
#define OFFLOAD_UNIT_DISPATCH_H

#include <stdint.h>

#include "offload_native.h"

// [Note: sumsq in fp32 blocks]
// The SIMD units (AVX2, AVX-512) square and add in fp32 vector accumulators and fold into
// double only once per short block. The scalar unit (its lanes as arrays, each FMA a
// std::fmaf) and numba (offload/kernels/_numba_sumsq.py, llvm.fma.v8f32) run the same
// algorithm, so every backend but the torch reference returns the same bits, and a step
// clipped by max_grad_norm the same params (tests/test_sumsq_bits.py).
// Widening every element to double made the pass compute-bound for 16-bit grads: one core
// read bf16 at ~18 GB/s that way against ~25 GB/s for a plain fp32 stream (measured here).
// - Streams: a single sequential read stream per core stayed below what the core can read
//   here (fp32 at ~22 GB/s per core against ~26 GB/s for bf16; the Adam kernel reads 4
//   streams at once). So the range a unit is given is cut into kSumsqStreams equal runs of
//   whole sub-blocks, read side by side: 100M fp32 ~12% faster (1 and 2 threads), bf16
//   unchanged (already at the per-core limit). What is left (< kSumsqStreams sub-blocks)
//   is read one sub-block at a time.
// - Blocks: a sub-block is kSumsqSub = 2 accumulators x 8 fp32 lanes x kSumsqLaneSteps
//   = 512 elements; a block is the kSumsqStreams sub-blocks read together (or one left-over
//   sub-block). All cuts depend only on the range, and dispatch.cpp hands out fixed
//   kBlock-element ranges whatever the thread count, so every rounding is the same for any
//   thread count. Every unit uses the same cuts, lanes and folds (sumsq_blocks.h): they
//   return the same bits.
// - Bound: each square meets at most kSumsqLaneSteps FMA roundings in its lane plus 3 adds
//   joining the 8 accumulators of a block, all on nonnegative terms, so a block's fp32 sum
//   is within gamma_35 = 35 * 2^-24 / (1 - 35 * 2^-24) ~= 2.09e-6 relative of its exact
//   value (bf16 and fp16 squares are exact in fp32; an fp32 square is rounded inside its
//   FMA, counted above). Blocks are summed in double (exact conversion, then ~2^-53 per
//   add), so the whole sum is within ~2.09e-6 relative in the worst case (a constant
//   input, whose roundings all lean one way, comes close); random data's roundings mostly
//   cancel (~1e-8 to 1e-7 seen). torch's own vector_norm of fp32/bf16 accumulates in fp32
//   over far longer runs (~2e-5 relative drift at 2**20 elements).
// - A block whose fp32 sum is not finite (an inf/NaN element, or squares of huge finite
//   values such as 1e20 overflowing fp32) is recomputed in double: the result is then
//   non-finite exactly when an element is (what dispatch.cpp reports), as before.
// - So is a block whose fp32 sum is below 2^-100 (fp32 and bf16 only): squares of tiny
//   values (|x| < 2^-63) lose bits to fp32 underflow, absolute error <= 2^-150 per rounding.
//   A sum >= 2^-100 bounds that loss to < 2^-40 relative; below it the block is redone
//   exactly. The exact path has one order too: element begin + j into double lane j % 8,
//   joined as ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) (AVX-512 once used 16
//   lanes and gave other last bits for tiny fp32 values). fp16 squares are >= 2^-48,
//   never subnormal in fp32: no such recompute. A block
//   of zeros (padding, untouched rows) also sums below 2^-100; it is only scanned for a
//   nonzero bit (from L1/L2, a fraction of the fp32 pass), so such buffers stay fast.
namespace offload {
constexpr int64_t kSumsqLaneSteps = 32;
constexpr int kSumsqStreams = 4;  // sumsq_group joins 2 * kSumsqStreams accumulators
constexpr int64_t kSumsqSub = 2 * 8 * kSumsqLaneSteps;
constexpr float kSumsqTiny = 0x1p-100f;
}  // namespace offload

namespace {
// True if every element of grad[begin..end) is +0 or -0 (its square sum is exactly 0).
// Plain C++ on purpose: each unit's compiler vectorizes it with that unit's flags, and the
// anonymous namespace keeps one copy per unit (see kernel.h).
template <int G>
inline bool sumsq_all_zero(const void *g, int64_t begin, int64_t end) {
    if (G == OFFLOAD_F32) {
        const uint32_t *p = static_cast<const uint32_t *>(g);
        uint32_t bits = 0;
        for (int64_t i = begin; i < end; ++i) bits |= p[i];
        return (bits & 0x7FFFFFFFu) == 0;
    }
    const uint16_t *p = static_cast<const uint16_t *>(g);
    uint32_t bits = 0;
    for (int64_t i = begin; i < end; ++i) bits |= p[i];
    return (bits & 0x7FFFu) == 0;
}
}  // namespace

// Expand inside the unit's anonymous namespace, after adam_loop and sumsq_loop.
#define OFFLOAD_UNIT_DISPATCH_TEMPLATES                                                     \
    template <int G, int L>                                                                 \
    void adam_flags(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) { \
        if (c.use_l2) {                                                                     \
            if (c.lerp_from_end) adam_loop<G, L, true, true>(c, b, begin, end);             \
            else adam_loop<G, L, true, false>(c, b, begin, end);                            \
        } else {                                                                            \
            if (c.lerp_from_end) adam_loop<G, L, false, true>(c, b, begin, end);            \
            else adam_loop<G, L, false, false>(c, b, begin, end);                           \
        }                                                                                   \
    }                                                                                       \
    template <int G>                                                                        \
    int adam_lowp(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) {  \
        switch (b.lowp_dtype) {                                                             \
            case -1: adam_flags<G, -1>(c, b, begin, end); return 0;                         \
            case OFFLOAD_F16: adam_flags<G, OFFLOAD_F16>(c, b, begin, end); return 0;       \
            case OFFLOAD_BF16: adam_flags<G, OFFLOAD_BF16>(c, b, begin, end); return 0;     \
            default: return -EINVAL;                                                        \
        }                                                                                   \
    }

// Expand at file scope, after the anonymous namespace: defines adam_range_<ISA> and
// sumsq_range_<ISA> in namespace offload.
#define OFFLOAD_UNIT_ENTRY_POINTS(ISA)                                                      \
    namespace offload {                                                                     \
    int adam_range_##ISA(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) { \
        switch (b.grad_dtype) {                                                             \
            case OFFLOAD_F32: return adam_lowp<OFFLOAD_F32>(c, b, begin, end);              \
            case OFFLOAD_F16: return adam_lowp<OFFLOAD_F16>(c, b, begin, end);              \
            case OFFLOAD_BF16: return adam_lowp<OFFLOAD_BF16>(c, b, begin, end);            \
            default: return -EINVAL;                                                        \
        }                                                                                   \
    }                                                                                       \
    int sumsq_range_##ISA(const void *grad, int dtype, int64_t begin, int64_t end, double *out) { \
        switch (dtype) {                                                                    \
            case OFFLOAD_F32: *out = sumsq_loop<OFFLOAD_F32>(grad, begin, end); return 0;   \
            case OFFLOAD_F16: *out = sumsq_loop<OFFLOAD_F16>(grad, begin, end); return 0;   \
            case OFFLOAD_BF16: *out = sumsq_loop<OFFLOAD_BF16>(grad, begin, end); return 0; \
            default: return -EINVAL;                                                        \
        }                                                                                   \
    }                                                                                       \
    }

#endif
