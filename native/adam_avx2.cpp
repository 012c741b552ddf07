// AVX2 + FMA + F16C Adam kernel; compiled with those flags only here.
// 8 fp32 lanes per step. AVX2 has no cheap masked 16-bit loads/stores, so the tail
// (< 8 elements) is staged through small stack buffers and run through the same vector
// code: every element sees identical arithmetic, whatever its position.
#include <cerrno>
#include <immintrin.h>
#include <string.h>

#include "kernel.h"
#include "quant_scalar.h"
#include "unit_dispatch.h"
#include "offload_native.h"

namespace {

using namespace offload;

template <int G>
inline __m256 load_grad(const void *g, int64_t i) {
    if (G == OFFLOAD_F32) return _mm256_loadu_ps(static_cast<const float *>(g) + i);
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(g) + i));
    if (G == OFFLOAD_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// torch's cvtfp32_bf16: round to nearest even, NaN -> 0xFFFF.
inline __m128i to_bf16(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    t = _mm256_srli_epi32(t, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    t = _mm256_blendv_epi8(t, _mm256_set1_epi32(0xFFFF), nan);
    // pack 8 x u32 (each <= 0xFFFF) to 8 x u16: packus works per 128-bit lane, then
    // gather qwords 0 and 2 into the low half.
    __m256i packed = _mm256_packus_epi32(t, t);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// STREAM: a non-temporal store, at 16-byte aligned addresses only (see adam_loop and
// [Note: streamed lowp copy] in dispatch.cpp).
template <int L, bool STREAM>
inline void store_lowp(void *dst, int64_t i, __m256 x) {
    if (L < 0) return;
    __m128i h = (L == OFFLOAD_F16) ? _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                   : to_bf16(x);
    __m128i *out = reinterpret_cast<__m128i *>(static_cast<uint16_t *>(dst) + i);
    if (STREAM) _mm_stream_si128(out, h);
    else _mm_storeu_si128(out, h);
}

struct VConsts {
    __m256 gs, l2, decay, coeff, b2, w2, bc2s, eps, nss;
    bool bc2_one;  // [Note: a bias correction of one] (kernel.h)
    explicit VConsts(const AdamConsts &c)
        : gs(_mm256_set1_ps(c.grad_scale)), l2(_mm256_set1_ps(c.l2)),
          decay(_mm256_set1_ps(c.decay)), coeff(_mm256_set1_ps(c.lerp_coeff)),
          b2(_mm256_set1_ps(c.beta2)), w2(_mm256_set1_ps(c.one_minus_beta2)),
          bc2s(_mm256_set1_ps(c.bc2_sqrt)), eps(_mm256_set1_ps(c.eps)),
          nss(_mm256_set1_ps(c.neg_step_size)), bc2_one(bias_correction_one(c.bc2_sqrt)) {}
};

// One vector of Adam on registers (g already scaled), as avx512_adam.h's adam_math: the FMAs
// are written out ([Note: explicit FMAs] there).
template <bool L2, bool FROM_END>
inline void adam_math(const VConsts &c, __m256 g, __m256 &p, __m256 &m, __m256 &v) {
    if (L2) g = _mm256_fmadd_ps(p, c.l2, g);
    m = _mm256_fmadd_ps(c.coeff, _mm256_sub_ps(g, m), FROM_END ? g : m);
    v = _mm256_mul_ps(v, c.b2);
    v = _mm256_fmadd_ps(_mm256_mul_ps(c.w2, g), g, v);
    const __m256 root = _mm256_sqrt_ps(v);
    __m256 denom = _mm256_add_ps(c.bc2_one ? root : _mm256_div_ps(root, c.bc2s), c.eps);
    p = _mm256_add_ps(_mm256_mul_ps(p, c.decay), _mm256_div_ps(_mm256_mul_ps(c.nss, m), denom));
}

// One vector of 8 at index i of the (possibly staged) buffers in b.
template <int G, int L, bool L2, bool FROM_END, bool STREAM = false>
inline void adam_vec(const VConsts &c, const AdamBuffers &b, int64_t i) {
    __m256 g = _mm256_mul_ps(load_grad<G>(b.grad, i), c.gs);
    __m256 p = _mm256_loadu_ps(b.param + i);
    __m256 m = _mm256_loadu_ps(b.exp_avg + i);
    __m256 v = _mm256_loadu_ps(b.exp_avg_sq + i);
    adam_math<L2, FROM_END>(c, g, p, m, v);
    _mm256_storeu_ps(b.param + i, p);
    _mm256_storeu_ps(b.exp_avg + i, m);
    _mm256_storeu_ps(b.exp_avg_sq + i, v);
    store_lowp<L, STREAM>(b.lowp, i, p);
}

inline size_t elem_size(int dtype) { return dtype == OFFLOAD_F32 ? 4 : 2; }

// Elements [i, end), fewer than 8: staged through zero-padded copies and run as one full
// vector, then the live part copied back.
template <int G, int L, bool L2, bool FROM_END>
void adam_partial(const VConsts &vc, const AdamBuffers &b, int64_t i, int64_t end) {
    int64_t left = end - i;
    alignas(32) float p[8] = {0}, m[8] = {0}, v[8] = {0}, g[8] = {0};
    alignas(32) uint16_t lowp[8] = {0};
    memcpy(p, b.param + i, left * 4);
    memcpy(m, b.exp_avg + i, left * 4);
    memcpy(v, b.exp_avg_sq + i, left * 4);
    size_t gsz = elem_size(b.grad_dtype);
    memcpy(g, static_cast<const char *>(b.grad) + i * gsz, left * gsz);
    AdamBuffers t{p, g, m, v, lowp, b.grad_dtype, b.lowp_dtype, 0};
    adam_vec<G, L, L2, FROM_END>(vc, t, 0);
    memcpy(b.param + i, p, left * 4);
    memcpy(b.exp_avg + i, m, left * 4);
    memcpy(b.exp_avg_sq + i, v, left * 4);
    if (L >= 0) memcpy(static_cast<uint16_t *>(b.lowp) + i, lowp, left * 2);
}

// The shared loop's primitives (see adam_loop.h).
constexpr int64_t kLanes = 8;
constexpr uintptr_t kStreamAlign = 16;  // _mm_stream_si128: 8 fp16/bf16

template <int G, int L, bool L2, bool FROM_END, bool STREAM>
inline void adam_full(const VConsts &vc, const AdamBuffers &b, int64_t i) {
    adam_vec<G, L, L2, FROM_END, STREAM>(vc, b, i);
}

template <int G, int L, bool L2, bool FROM_END>
inline void adam_part(const VConsts &vc, const AdamBuffers &b, int64_t i, int64_t end) {
    adam_partial<G, L, L2, FROM_END>(vc, b, i, end);
}

#include "adam_loop.h"

OFFLOAD_UNIT_DISPATCH_TEMPLATES

// ---- SGD, Adagrad, Lion (rule_loop.h) over this unit's vectors.
using VF = __m256;
inline VF vset1(float x) { return _mm256_set1_ps(x); }
inline VF vload(const float *p) { return _mm256_loadu_ps(p); }
inline void vstore(float *p, VF x) { _mm256_storeu_ps(p, x); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vdiv(VF a, VF b) { return _mm256_div_ps(a, b); }
inline VF vsqrt(VF a) { return _mm256_sqrt_ps(a); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
// torch's vectorized sign: (0 < x) - (x < 0) as 1.0 / 0.0 selects; 0 for zeros and NaN
inline VF vsign(VF x) {
    const VF one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    return _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(zero, x, _CMP_LT_OQ), one),
                         _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), one));
}
// torch.maximum's vectorized form: max_ps (b unless a > b), all-ones NaN where either is NaN
inline VF vmax_nan(VF a, VF b) { return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q)); }
template <int G>
inline VF vload_grad(const void *g, int64_t i) { return load_grad<G>(g, i); }
template <int L, bool STREAM>
inline void vstore_lowp(void *dst, int64_t i, VF x) { store_lowp<L, STREAM>(dst, i, x); }
inline void vfence() { _mm_sfence(); }

#include "rule_loop.h"

// ---- sum of squares: fp32 blocks folded into double, see [Note: sumsq in fp32 blocks] in
// unit_dispatch.h; the same lanes, blocks and folds as adam_avx512.cpp. A step squares 16
// elements into two fp32 accumulators. Which element lands in which lane does not matter to
// a sum of squares, so bf16 needs no widening: one 256-bit load holds 16 of them, the even
// ones in the low halves of its 32-bit words (shifted up) and the odd ones in the high
// halves (masked). The tail (< 16 elements) is staged through a zeroed buffer.
template <int G>
inline void sumsq_step(const void *g, int64_t i, __m256 &a, __m256 &b) {
    if (G == OFFLOAD_BF16) {
        __m256i w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(g) + i));
        __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)));
        a = _mm256_fmadd_ps(even, even, a);
        b = _mm256_fmadd_ps(odd, odd, b);
    } else {
        __m256 x = load_grad<G>(g, i), y = load_grad<G>(g, i + 8);
        a = _mm256_fmadd_ps(x, x, a);
        b = _mm256_fmadd_ps(y, y, b);
    }
}

// [begin, end), end - begin < 16, through one zero-padded step.
template <int G>
inline void sumsq_tail(const void *g, int64_t begin, int64_t end, __m256 &a, __m256 &b) {
    alignas(32) float buf[16] = {0};
    size_t gsz = G == OFFLOAD_F32 ? 4 : 2;
    memcpy(buf, static_cast<const char *>(g) + begin * gsz, (end - begin) * gsz);
    sumsq_step<G>(buf, 0, a, b);
}

#include "sumsq_m256.h"

// The exact path: every element converted to double before its FMA (exact products), in
// the one order of every unit: element begin + j into double lane j % 8 (a0 holds lanes
// 0-3, a1 lanes 4-7), joined by sumsq_dtotal. Only for blocks the fp32 path cannot take
// (see the note); kept out of line so the hot loop stays small.
template <int G>
__attribute__((noinline)) double sumsq_f64(const void *g, int64_t begin, int64_t end) {
    __m256d a0 = _mm256_setzero_pd(), a1 = a0;
    for (int64_t i = begin; i < end; i += 8) {
        __m256 x;
        if (end - i >= 8) {
            x = load_grad<G>(g, i);
        } else {
            alignas(32) float buf[8] = {0};
            size_t gsz = G == OFFLOAD_F32 ? 4 : 2;
            memcpy(buf, static_cast<const char *>(g) + i * gsz, (end - i) * gsz);
            x = load_grad<G>(buf, 0);
        }
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    return sumsq_dtotal(a0, a1);
}

// The shared driver's primitives (see sumsq_blocks.h).
template <int G>
inline void sumsq_full(const void *g, int64_t i, __m256 &a, __m256 &b) {
    sumsq_step<G>(g, i, a, b);
}

inline bool lanes_all_below(__m256 t, float limit) {
    return _mm256_movemask_ps(_mm256_cmp_ps(t, _mm256_set1_ps(limit), _CMP_LT_OQ)) == 0xFF;
}
inline bool lanes_none_at_least(__m256 t, float limit) {
    return _mm256_movemask_ps(_mm256_cmp_ps(t, _mm256_set1_ps(limit), _CMP_GE_OQ)) == 0;
}

#include "sumsq_blocks.h"

// ---- compressed states: compressed_tile.h's primitives, 8 lanes at a time; the part
// left over (< 8) goes through quant_scalar.h, whose operations are exact: the same bits.
#include "avx2_q8.h"

inline void bf16_load(const uint16_t *src, float *out, int64_t len) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + i));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    bf16_load_scalar(src + i, out + i, len - i);
}

inline void bf16_nearest(const float *x, uint16_t *dst, int64_t len) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i), to_bf16(_mm256_loadu_ps(x + i)));
    bf16_nearest_scalar(x + i, dst + i, len - i);
}

inline __m256i lowbias32_v(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

inline void bf16_stochastic_store(const float *x, uint16_t *dst, int64_t len, uint32_t start,
                                  uint32_t key, int shift) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i vkey = _mm256_set1_epi32(static_cast<int>(key));
    const __m128i vshift = _mm_cvtsi32_si128(shift);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256i index = _mm256_add_epi32(
            _mm256_set1_epi32(static_cast<int>(start + static_cast<uint32_t>(i))), iota);
        const __m256i r = _mm256_and_si256(_mm256_srl_epi32(lowbias32_v(_mm256_xor_si256(index, vkey)), vshift),
                                           _mm256_set1_epi32(0xFFFF));
        __m256i t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(v), r), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        t = _mm256_blendv_epi8(t, _mm256_set1_epi32(0xFFFF), nan);
        const __m256i packed = _mm256_packus_epi32(t, t);  // per 128-bit lane, as to_bf16
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i),
                         _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
    }
    bf16_stochastic_scalar(x + i, dst + i, len - i, start + static_cast<uint32_t>(i), key, shift);
}

// ---- [Note: fused bf16 Adam] (adam_avx512.cpp) for 8 lanes: full vectors only, the last
// partial vector is left to the tiles (AVX2 has no masked 16-bit stores).
inline __m256 load_bf16(const void *src, int64_t i) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(src) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The hash of stochastic rounding at stream index `index` (lanes), key = stream_key.
inline __m256i stream_hash(__m256i index, uint32_t key) {
    return lowbias32_v(_mm256_xor_si256(index, _mm256_set1_epi32(static_cast<int>(key))));
}
inline __m256i hash_top(__m256i h) { return _mm256_srli_epi32(h, 16); }
inline __m256i hash_low(__m256i h) { return _mm256_and_si256(h, _mm256_set1_epi32(0xFFFF)); }

// bf16_stochastic_store's bits of one vector, given its 16-bit random numbers r.
inline __m128i bf16_sr(__m256 x, __m256i r) {
    __m256i t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    t = _mm256_blendv_epi8(t, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_packus_epi32(t, t);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// The param's bits (stream 0, the top half), stochastic or nearest even.
inline __m128i round_bf16(__m256 x, bool stochastic, __m256i index, uint32_t key) {
    return stochastic ? bf16_sr(x, hash_top(stream_hash(index, key))) : to_bf16(x);
}

inline void store_bf16v(void *dst, int64_t i, __m128i h) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(static_cast<uint16_t *>(dst) + i), h);
}


template <int G, int L, bool L2, bool FROM_END, bool PB16>
inline void adam_bf16_vec(const VConsts &c, const Bf16AdamStep &r, int64_t i) {
    __m256 g = _mm256_mul_ps(load_grad<G>(r.grad, i), c.gs);
    __m256 p = PB16 ? load_bf16(r.param, i) : _mm256_loadu_ps(static_cast<float *>(r.param) + i);
    __m256 m = load_bf16(r.m, i);
    __m256 v = load_bf16(r.v, i);
    adam_math<L2, FROM_END>(c, g, p, m, v);
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(r.offset + static_cast<uint32_t>(i))),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    // one hash for both moments (quant.py: a pair of states shares it, top and low half)
    const __m256i h = r.sm || r.sv ? stream_hash(index, r.kmv) : _mm256_setzero_si256();
    store_bf16v(r.m, i, r.sm ? bf16_sr(m, hash_top(h)) : to_bf16(m));
    store_bf16v(r.v, i, r.sv ? bf16_sr(v, hash_low(h)) : to_bf16(v));
    if (PB16) {
        store_bf16v(r.param, i, round_bf16(p, r.sp, index, r.kp));
    } else {
        _mm256_storeu_ps(static_cast<float *>(r.param) + i, p);
        store_lowp<L, false>(r.lowp, i, p);
    }
}

// compressed_tile.h's hook ([Note: fused bf16 Adam] dispatch there): the full vectors of
// the range; returns where they end.
#define OFFLOAD_FUSED_BF16_ADAM 1
template <int G, int L, bool L2, bool FROM_END, bool PB16>
int64_t adam_bf16_loop(const CompressedStep &s, int64_t begin, int64_t end) {
    const VConsts c(s.adam);
    const Bf16AdamStep r(s);
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) adam_bf16_vec<G, L, L2, FROM_END, PB16>(c, r, i);
    return i;
}

#include "compressed_tile.h"

}  // namespace

OFFLOAD_UNIT_ENTRY_POINTS(avx2)
OFFLOAD_RULE_ENTRY_POINTS(avx2)
OFFLOAD_COMPRESSED_ENTRY_POINT(avx2)
