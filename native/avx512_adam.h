// The AVX-512 Adam arithmetic and its loads and stores, shared by the AVX-512 unit and its
// VBMI variant (adam_avx512.cpp, q8_avx512vbmi.cpp): one formula, so the fused int8 tile of
// the VBMI unit ([Note: fused int8 Adam tile] there) gives the AVX-512 unit's bits. Include it
// *inside* a unit's anonymous namespace after avx512_states.h (each unit compiles its own
// copy with its own flags, see kernel.h). Numerics: see the head of adam_avx512.cpp.
#ifndef OFFLOAD_AVX512_ADAM_H
#define OFFLOAD_AVX512_ADAM_H

template <int G, bool MASKED>
inline __m512 load_grad(const void *g, int64_t i, __mmask16 k) {
    if (G == OFFLOAD_F32) {
        const float *src = static_cast<const float *>(g) + i;
        return MASKED ? _mm512_maskz_loadu_ps(k, src) : _mm512_loadu_ps(src);
    }
    const uint16_t *src = static_cast<const uint16_t *>(g) + i;
    __m256i h = MASKED ? _mm256_maskz_loadu_epi16(k, src)
                       : _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src));
    if (G == OFFLOAD_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <bool MASKED>
inline __m512 load(const float *src, __mmask16 k) {
    return MASKED ? _mm512_maskz_loadu_ps(k, src) : _mm512_loadu_ps(src);
}

template <bool MASKED>
inline void store(float *dst, __m512 x, __mmask16 k) {
    if (MASKED) _mm512_mask_storeu_ps(dst, k, x);
    else _mm512_storeu_ps(dst, x);
}

// STREAM: a non-temporal store, for full vectors at 32-byte aligned addresses only (see
// adam_loop and [Note: streamed lowp copy] in dispatch.cpp).
template <int L, bool MASKED, bool STREAM>
inline void store_lowp(void *dst, int64_t i, __m512 x, __mmask16 k) {
    if (L < 0) return;
    __m256i h = (L == OFFLOAD_F16) ? _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                   : to_bf16(x);
    uint16_t *out = static_cast<uint16_t *>(dst) + i;
    if (MASKED) _mm256_mask_storeu_epi16(out, k, h);
    else if (STREAM) _mm256_stream_si256(reinterpret_cast<__m256i *>(out), h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), h);
}

struct VConsts {
    __m512 gs, l2, decay, coeff, b2, w2, bc2s, eps, nss;
    bool bc2_one;  // [Note: a bias correction of one] (kernel.h)
    explicit VConsts(const AdamConsts &c)
        : gs(_mm512_set1_ps(c.grad_scale)), l2(_mm512_set1_ps(c.l2)),
          decay(_mm512_set1_ps(c.decay)), coeff(_mm512_set1_ps(c.lerp_coeff)),
          b2(_mm512_set1_ps(c.beta2)), w2(_mm512_set1_ps(c.one_minus_beta2)),
          bc2s(_mm512_set1_ps(c.bc2_sqrt)), eps(_mm512_set1_ps(c.eps)),
          nss(_mm512_set1_ps(c.neg_step_size)), bc2_one(bias_correction_one(c.bc2_sqrt)) {}
};

// One vector of Adam on registers: torch's formula as built (fmadd in lerp, in the L2 add and
// in addcmul; divisions kept as divisions). g is already scaled. [Note: explicit FMAs] The
// library is built with -ffp-contract=off (setup.py), so every FMA is one the code asks for and
// the bits do not depend on how the compiler inlined a function. AdamW's decay is a product
// rounded on its own, then the step added, as torch's param.mul_(1 - lr * wd) and
// param.addcdiv_(...) are two ops: fused into one FMA (GCC once contracted the two, and the
// backends kept it) a quarter of the params differed from torch's in the last bit, and a
// training run (grads then differing too) drifted past torchao's test tolerance in 2 steps.
template <bool L2, bool FROM_END>
inline void adam_math(const VConsts &c, __m512 g, __m512 &p, __m512 &m, __m512 &v) {
    if (L2) g = _mm512_fmadd_ps(p, c.l2, g);
    m = _mm512_fmadd_ps(c.coeff, _mm512_sub_ps(g, m), FROM_END ? g : m);
    v = _mm512_mul_ps(v, c.b2);
    v = _mm512_fmadd_ps(_mm512_mul_ps(c.w2, g), g, v);
    const __m512 root = _mm512_sqrt_ps(v);
    __m512 denom = _mm512_add_ps(c.bc2_one ? root : _mm512_div_ps(root, c.bc2s), c.eps);
    p = _mm512_add_ps(_mm512_mul_ps(p, c.decay), _mm512_div_ps(_mm512_mul_ps(c.nss, m), denom));
}

template <bool MASKED>
inline __m512 load_bf16(const void *src, int64_t i, __mmask16 k) {
    const uint16_t *q = static_cast<const uint16_t *>(src) + i;
    const __m256i h = MASKED ? _mm256_maskz_loadu_epi16(k, q) : _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The hash of stochastic rounding at stream index `index` (lanes), key = stream_key.
inline __m512i stream_hash(__m512i index, uint32_t key) {
    return lowbias32_v(_mm512_xor_si512(index, _mm512_set1_epi32(static_cast<int>(key))));
}

// bf16_stochastic_store's bits of one vector, given its 16-bit random numbers r.
inline __m256i bf16_sr(__m512 x, __m512i r) {
    // one masked shift: NaN lanes keep 0xFFFF
    const __m512i t = _mm512_mask_srli_epi32(_mm512_set1_epi32(0xFFFF), _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q),
                                             _mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    return _mm512_cvtepi32_epi16(t);
}

// The top and low halves of a hash (stream_shift 16 and 0).
inline __m512i hash_top(__m512i h) { return _mm512_srli_epi32(h, 16); }
inline __m512i hash_low(__m512i h) { return _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF)); }

// The param's bits (stream 0, the top half), stochastic or nearest even.
inline __m256i round_bf16(__m512 x, bool stochastic, __m512i index, uint32_t key) {
    return stochastic ? bf16_sr(x, hash_top(stream_hash(index, key))) : to_bf16(x);
}

inline void store_bf16v(void *dst, int64_t i, __m256i h, __mmask16 k) {
    store_u16(static_cast<uint16_t *>(dst) + i, k, h);
}

#endif
