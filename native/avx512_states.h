// The AVX-512 primitives of compressed states that the AVX-512 unit and its VBMI variant
// (adam_avx512.cpp, q8_avx512vbmi.cpp) share: tails, absmax, bf16 loads and stores.
// Include it *inside* a unit's anonymous namespace, after <immintrin.h>, kernel.h and
// `using namespace offload;`: each unit compiles its own copy with its own flags (see
// kernel.h). Every loop masks its last vector (masked-off lanes load zeros, never stored).
#ifndef OFFLOAD_AVX512_STATES_H
#define OFFLOAD_AVX512_STATES_H

// torch's cvtfp32_bf16: round to nearest even, NaN -> 0xFFFF.
inline __m256i to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i t = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    // one masked shift: NaN lanes keep 0xFFFF
    t = _mm512_mask_srli_epi32(_mm512_set1_epi32(0xFFFF), _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), t, 16);
    return _mm512_cvtepi32_epi16(t);
}

// quant_scalar.h's q8_norm of 16 values xn = x / a: xn, or sqrt(max(xn, +0)) for a
// square-root code (maxps gives its second operand, +0, for -0).
inline __m512 q8_root(__m512 xn, bool root) {
    return root ? _mm512_sqrt_ps(_mm512_max_ps(xn, _mm512_setzero_ps())) : xn;
}

inline __mmask16 lanes_mask(int64_t left) {
    if (left <= 0) return 0;
    return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u);
}

// Stores of the compressed primitives: plain for a full vector, masked only for the last,
// partial one (masked stores to memory are slow on Zen 4: measured here, the decode loop
// spent ~10% on its masked store).
inline void store_ps(float *dst, __mmask16 k, __m512 x) {
    if (k == 0xFFFF) _mm512_storeu_ps(dst, x);
    else _mm512_mask_storeu_ps(dst, k, x);
}
inline void store_u16(uint16_t *dst, __mmask16 k, __m256i x) {
    if (k == 0xFFFF) _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst), x);
    else _mm256_mask_storeu_epi16(dst, k, x);
}
inline void store_u8(uint8_t *dst, __mmask16 k, __m128i x) {
    if (k == 0xFFFF) _mm_storeu_si128(reinterpret_cast<__m128i *>(dst), x);
    else _mm_mask_storeu_epi8(dst, k, x);
}

inline uint32_t abs_bits_max(const float *x, int64_t len) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m = _mm512_setzero_si512();
    for (int64_t i = 0; i < len; i += 16) {
        const __m512i v = _mm512_maskz_loadu_epi32(lanes_mask(len - i), x + i);
        m = _mm512_max_epu32(m, _mm512_and_si512(v, abs_mask));
    }
    return static_cast<uint32_t>(_mm512_reduce_max_epu32(m));
}

inline void bf16_load(const uint16_t *src, float *out, int64_t len) {
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 k = lanes_mask(len - i);
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, src + i));
        store_ps(out + i, k, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
}

inline void bf16_nearest(const float *x, uint16_t *dst, int64_t len) {
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 k = lanes_mask(len - i);
        store_u16(dst + i, k, to_bf16(_mm512_maskz_loadu_ps(k, x + i)));
    }
}

inline __m512i lowbias32_v(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

inline void bf16_stochastic_store(const float *x, uint16_t *dst, int64_t len, uint32_t start,
                                  uint32_t key, int shift) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i vkey = _mm512_set1_epi32(static_cast<int>(key));
    const __m128i vshift = _mm_cvtsi32_si128(shift);
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 k = lanes_mask(len - i);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        const __m512i index = _mm512_add_epi32(
            _mm512_set1_epi32(static_cast<int>(start + static_cast<uint32_t>(i))), iota);
        const __m512i r = _mm512_and_si512(_mm512_srl_epi32(lowbias32_v(_mm512_xor_si512(index, vkey)), vshift),
                                           _mm512_set1_epi32(0xFFFF));
        __m512i t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(v), r), 16);
        t = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), t);
        store_u16(dst + i, k, _mm512_cvtepi32_epi16(t));
    }
}

#endif
