// sumsq_blocks.h's lane primitives on 256-bit vectors, shared by the AVX2 and AVX-512 units
// (both sum in 256-bit lanes, see adam_avx512.cpp). Include it inside the unit's anonymous
// namespace, after the unit's sumsq_full / sumsq_tail / sumsq_f64: each unit compiles its
// own copy with its own flags (kernel.h).
using SumsqF = __m256;
using SumsqD = __m256d;

inline __m256 sumsq_zero() { return _mm256_setzero_ps(); }
inline __m256 sumsq_add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256d sumsq_dzero() { return _mm256_setzero_pd(); }

inline void sumsq_widen_add(__m256 t, __m256d &d0, __m256d &d1) {
    d0 = _mm256_add_pd(d0, _mm256_cvtps_pd(_mm256_castps256_ps128(t)));
    d1 = _mm256_add_pd(d1, _mm256_cvtps_pd(_mm256_extractf128_ps(t, 1)));
}

// ((l0 + l1) + (l2 + l3)) of l = d0 + d1: the final join, also that of sumsq_f64
inline double sumsq_dtotal(__m256d d0, __m256d d1) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(d0, d1));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}
