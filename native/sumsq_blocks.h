// The blocked fp32 sum of squares shared by the SIMD units (see [Note: sumsq in fp32
// blocks] in unit_dispatch.h): streams, sub-blocks, the fold into double and the recompute
// of blocks the fp32 path cannot take.
//
// Include it *inside* a unit's anonymous namespace, after the unit has defined, with its
// own instruction set:
//   template <int G> void sumsq_full(const void *g, int64_t i, __m256 &a, __m256 &b);
//       squares of the 16 elements at i into two fp32 accumulators
//   template <int G> void sumsq_tail(const void *g, int64_t i, int64_t end, __m256 &a, __m256 &b);
//       the same for the end - i < 16 elements at i (the rest read as zeros)
//   bool lanes_all_below(__m256 t, __m256 limit);   bool lanes_none_at_least(__m256 t, __m256 limit);
//   template <int G> double sumsq_f64(const void *g, int64_t begin, int64_t end);   the exact path
// Each unit thus compiles its own copy with its own flags (nothing leaks across units, see
// kernel.h) while the cuts, lanes and folds, which decide the bits of the result, are
// written once: the units return the same bits.

template <int G>
inline __m256 sumsq_group(const void *g, int64_t s, int64_t stride) {
    // kSumsqStreams sub-blocks of kSumsqSub elements at s + k * stride, read side by side
    static_assert(kSumsqStreams == 4, "the sum below joins 8 accumulators");
    __m256 a[2 * kSumsqStreams];
    for (int k = 0; k < 2 * kSumsqStreams; ++k) a[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < kSumsqSub; i += 16)
        for (int k = 0; k < kSumsqStreams; ++k)
            sumsq_full<G>(g, s + k * stride + i, a[2 * k], a[2 * k + 1]);
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])),
                         _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7])));
}

template <int G>
inline __m256 sumsq_part(const void *g, int64_t s, int64_t e) {
    // [s, e), e - s <= kSumsqSub: the part the streams leave over
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t i = s;
    for (; i + 16 <= e; i += 16) sumsq_full<G>(g, i, a0, a1);
    if (i < e) sumsq_tail<G>(g, i, e, a0, a1);
    return _mm256_add_ps(a0, a1);
}

// Adds a block's fp32 sum t into the double accumulators; false (nothing added) when the
// block must be redone in double: t not finite, or (fp32/bf16) below kSumsqTiny.
template <int G>
inline bool sumsq_fold(__m256 t, __m256d &d0, __m256d &d1) {
    const __m256 inf = _mm256_set1_ps(__builtin_inff()), tiny = _mm256_set1_ps(kSumsqTiny);
    // t >= 0 lane-wise or NaN: all lanes < inf means the block's fp32 sum is finite
    bool finite = lanes_all_below(t, inf);
    bool tiny_sum = G != OFFLOAD_F16 && lanes_none_at_least(t, tiny);
    if (__builtin_expect(!finite || tiny_sum, 0)) return false;
    d0 = _mm256_add_pd(d0, _mm256_cvtps_pd(_mm256_castps256_ps128(t)));
    d1 = _mm256_add_pd(d1, _mm256_cvtps_pd(_mm256_extractf128_ps(t, 1)));
    return true;
}

template <int G>
inline double sumsq_redo(const void *g, int64_t s, int64_t e) {
    return sumsq_all_zero<G>(g, s, e) ? 0.0 : sumsq_f64<G>(g, s, e);
}

template <int G>
double sumsq_loop(const void *g, int64_t begin, int64_t end) {
    __m256d d0 = _mm256_setzero_pd(), d1 = d0;
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
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(d0, d1));
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + redone;
}
