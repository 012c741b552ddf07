// The blocked fp32 sum of squares of every unit (see [Note: sumsq in fp32 blocks] in
// unit_dispatch.h): streams, sub-blocks, the fold into double and the recompute of blocks
// the fp32 path cannot take.
//
// Include it *inside* a unit's anonymous namespace, after the unit has defined, with its
// own instruction set (sumsq_m256.h does it for the AVX units, adam_scalar.cpp with arrays):
//   SumsqF: 8 fp32 lanes;  SumsqD: 4 double lanes
//   SumsqF sumsq_zero();   SumsqF sumsq_add(SumsqF, SumsqF);   (lane-wise fp32 add)
//   template <int G> void sumsq_full(const void *g, int64_t i, SumsqF &a, SumsqF &b);
//       fp32 FMAs of the squares of the 16 elements at i into a and b: lane l of a takes
//       element i + l and lane l of b element i + 8 + l (fp32, fp16), or i + 2l and i + 2l + 1
//       (bf16, split without widening); the join below adds a and b first, so either way
//       lane l sums the same two elements
//   template <int G> void sumsq_tail(const void *g, int64_t i, int64_t end, SumsqF &a, SumsqF &b);
//       the same for the end - i < 16 elements at i (the rest read as zeros)
//   bool lanes_all_below(SumsqF t, float limit);  bool lanes_none_at_least(SumsqF t, float limit);
//   SumsqD sumsq_dzero();  void sumsq_widen_add(SumsqF t, SumsqD &d0, SumsqD &d1);
//       d0 += lanes 0-3 of t, d1 += lanes 4-7, each converted to double
//   double sumsq_dtotal(SumsqD d0, SumsqD d1);   ((l0 + l1) + (l2 + l3)) of l = d0 + d1
//   template <int G> double sumsq_f64(const void *g, int64_t begin, int64_t end);
//       the exact path, in the one order of [Note: sumsq in fp32 blocks]
// Each unit thus compiles its own copy with its own flags (nothing leaks across units, see
// kernel.h) while the cuts, lanes and folds, which decide the bits of the result, are
// written once: the units return the same bits (and offload/kernels/_numba_sumsq.py
// follows this file line by line).

template <int G>
inline SumsqF sumsq_group(const void *g, int64_t s, int64_t stride) {
    // kSumsqStreams sub-blocks of kSumsqSub elements at s + k * stride, read side by side
    static_assert(kSumsqStreams == 4, "the sum below joins 8 accumulators");
    SumsqF a[2 * kSumsqStreams];
    for (int k = 0; k < 2 * kSumsqStreams; ++k) a[k] = sumsq_zero();
    for (int64_t i = 0; i < kSumsqSub; i += 16)
        for (int k = 0; k < kSumsqStreams; ++k)
            sumsq_full<G>(g, s + k * stride + i, a[2 * k], a[2 * k + 1]);
    return sumsq_add(sumsq_add(sumsq_add(a[0], a[1]), sumsq_add(a[2], a[3])),
                     sumsq_add(sumsq_add(a[4], a[5]), sumsq_add(a[6], a[7])));
}

template <int G>
inline SumsqF sumsq_part(const void *g, int64_t s, int64_t e) {
    // [s, e), e - s <= kSumsqSub: the part the streams leave over
    SumsqF a0 = sumsq_zero(), a1 = a0;
    int64_t i = s;
    for (; i + 16 <= e; i += 16) sumsq_full<G>(g, i, a0, a1);
    if (i < e) sumsq_tail<G>(g, i, e, a0, a1);
    return sumsq_add(a0, a1);
}

// Adds a block's fp32 sum t into the double accumulators; false (nothing added) when the
// block must be redone in double: t not finite, or (fp32/bf16) below kSumsqTiny.
template <int G>
inline bool sumsq_fold(SumsqF t, SumsqD &d0, SumsqD &d1) {
    // t >= 0 lane-wise or NaN: all lanes < inf means the block's fp32 sum is finite
    bool finite = lanes_all_below(t, __builtin_inff());
    bool tiny_sum = G != OFFLOAD_F16 && lanes_none_at_least(t, kSumsqTiny);
    if (__builtin_expect(!finite || tiny_sum, 0)) return false;
    sumsq_widen_add(t, d0, d1);
    return true;
}

template <int G>
inline double sumsq_redo(const void *g, int64_t s, int64_t e) {
    return sumsq_all_zero<G>(g, s, e) ? 0.0 : sumsq_f64<G>(g, s, e);
}

template <int G>
double sumsq_loop(const void *g, int64_t begin, int64_t end) {
    SumsqD d0 = sumsq_dzero(), d1 = d0;
    double redone = 0.0;  // blocks recomputed in double, in block order
    // kSumsqStreams equal runs of whole sub-blocks (16384 elements each for a full
    // dispatch block), then single sub-blocks for what is left
    const int64_t stride = (end - begin) / (kSumsqStreams * kSumsqSub) * kSumsqSub;
    for (int64_t j = 0; j < stride; j += kSumsqSub) {
        if (sumsq_fold<G>(sumsq_group<G>(g, begin + j, stride), d0, d1)) continue;
        for (int k = 0; k < kSumsqStreams; ++k) {
            int64_t s = begin + k * stride + j;
            redone += sumsq_redo<G>(g, s, s + kSumsqSub);
        }
    }
    for (int64_t s = begin + kSumsqStreams * stride; s < end; s += kSumsqSub) {
        int64_t e = end - s > kSumsqSub ? s + kSumsqSub : end;
        if (!sumsq_fold<G>(sumsq_part<G>(g, s, e), d0, d1)) redone += sumsq_redo<G>(g, s, e);
    }
    return sumsq_dtotal(d0, d1) + redone;
}
