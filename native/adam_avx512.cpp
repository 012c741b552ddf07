// AVX-512 Adam kernel (F, BW, VL, DQ + FMA + F16C); compiled with those flags only here.
// 16 fp32 lanes per step; the tail uses masked loads and stores, so every element goes
// through the same instruction sequence. Numerics mirror adam_scalar.cpp / torch's
// vectorized kernels as built (fmadd in lerp, in the L2 add and in addcmul; divisions
// kept as divisions); exp_avg and exp_avg_sq then match torch bit for bit without L2 decay.
#include <cerrno>
#include <immintrin.h>
#include <string.h>

#include "kernel.h"
#include "quant_scalar.h"
#include "unit_dispatch.h"
#include "offload_native.h"

namespace {

using namespace offload;

#include "avx512_states.h"

#include "avx512_adam.h"

template <int G, int L, bool L2, bool FROM_END, bool MASKED, bool STREAM = false>
inline void adam_vec(const VConsts &c, const AdamBuffers &b, int64_t i, __mmask16 k) {
    __m512 g = _mm512_mul_ps(load_grad<G, MASKED>(b.grad, i, k), c.gs);
    __m512 p = load<MASKED>(b.param + i, k);
    __m512 m = load<MASKED>(b.exp_avg + i, k);
    __m512 v = load<MASKED>(b.exp_avg_sq + i, k);
    adam_math<L2, FROM_END>(c, g, p, m, v);
    store<MASKED>(b.param + i, p, k);
    store<MASKED>(b.exp_avg + i, m, k);
    store<MASKED>(b.exp_avg_sq + i, v, k);
    store_lowp<L, MASKED, STREAM>(b.lowp, i, p, k);
}

// The shared loop's primitives (see adam_loop.h); the part left over is one masked vector.
constexpr int64_t kLanes = 16;
constexpr uintptr_t kStreamAlign = 32;  // _mm256_stream_si256: 16 fp16/bf16

template <int G, int L, bool L2, bool FROM_END, bool STREAM>
inline void adam_full(const VConsts &vc, const AdamBuffers &b, int64_t i) {
    adam_vec<G, L, L2, FROM_END, false, STREAM>(vc, b, i, 0xFFFF);
}

template <int G, int L, bool L2, bool FROM_END>
inline void adam_part(const VConsts &vc, const AdamBuffers &b, int64_t i, int64_t end) {
    adam_vec<G, L, L2, FROM_END, true>(vc, b, i, static_cast<__mmask16>((1u << (end - i)) - 1u));
}

#include "adam_loop.h"

OFFLOAD_UNIT_DISPATCH_TEMPLATES

// ---- SGD, Adagrad, Lion (rule_loop.h) over this unit's vectors; the part left over is
// staged (rule_loop.h), not masked: the rules share one loop across the units.
using VF = __m512;
inline VF vset1(float x) { return _mm512_set1_ps(x); }
inline VF vload(const float *p) { return _mm512_loadu_ps(p); }
inline void vstore(float *p, VF x) { _mm512_storeu_ps(p, x); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vdiv(VF a, VF b) { return _mm512_div_ps(a, b); }
inline VF vsqrt(VF a) { return _mm512_sqrt_ps(a); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
// torch's vectorized sign: (0 < x) - (x < 0) as 1.0 / 0.0 selects; 0 for zeros and NaN
inline VF vsign(VF x) {
    const VF one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    return _mm512_sub_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(zero, x, _CMP_LT_OQ), one),
                         _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), one));
}
// torch.maximum's vectorized form: max_ps (b unless a > b), all-ones NaN where either is NaN
inline VF vmax_nan(VF a, VF b) {
    const __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_max_ps(a, b), nan, _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
}
template <int G>
inline VF vload_grad(const void *g, int64_t i) { return load_grad<G, false>(g, i, 0xFFFF); }
template <int L, bool STREAM>
inline void vstore_lowp(void *dst, int64_t i, VF x) { store_lowp<L, false, STREAM>(dst, i, x, 0xFFFF); }
inline void vfence() { _mm_sfence(); }

#include "rule_loop.h"

// ---- sum of squares: fp32 blocks folded into double, see [Note: sumsq in fp32 blocks] in
// unit_dispatch.h. 256-bit vectors on purpose: measured here (EPYC, 100M elements, one
// stream), a 512-bit fp32 load+FMA loop ran ~10% below the same loop on 256 bits, and bf16
// gained nothing from 512 bits; the memory bus is the limit either way. AVX-512 still
// gives the masked tail loads (VL + BW); the lanes, blocks and folds are adam_avx2.cpp's.
// A step squares 16 elements into two fp32 accumulators; bf16 is split into even and odd
// elements without widening, as there. Masked-off elements read as 0 and cannot fault.
template <int G, bool MASKED>
inline void sumsq_step(const void *g, int64_t i, __mmask16 k, __m256 &a, __m256 &b) {
    __m256 x, y;
    if (G == OFFLOAD_F32) {
        const float *src = static_cast<const float *>(g) + i;
        x = MASKED ? _mm256_maskz_loadu_ps(static_cast<__mmask8>(k), src) : _mm256_loadu_ps(src);
        y = MASKED ? _mm256_maskz_loadu_ps(static_cast<__mmask8>(k >> 8), src + 8)
                   : _mm256_loadu_ps(src + 8);
    } else if (G == OFFLOAD_F16) {
        const uint16_t *src = static_cast<const uint16_t *>(g) + i;
        __m128i h0 = MASKED ? _mm_maskz_loadu_epi16(static_cast<__mmask8>(k), src)
                            : _mm_loadu_si128(reinterpret_cast<const __m128i *>(src));
        __m128i h1 = MASKED ? _mm_maskz_loadu_epi16(static_cast<__mmask8>(k >> 8), src + 8)
                            : _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + 8));
        x = _mm256_cvtph_ps(h0);
        y = _mm256_cvtph_ps(h1);
    } else {
        const uint16_t *src = static_cast<const uint16_t *>(g) + i;
        __m256i w = MASKED ? _mm256_maskz_loadu_epi16(k, src)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src));
        x = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        y = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)));
    }
    a = _mm256_fmadd_ps(x, x, a);
    b = _mm256_fmadd_ps(y, y, b);
}

inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u);
}

#include "sumsq_m256.h"

// The exact path in the one order of every unit (adam_avx2.cpp's): element begin + j into
// double lane j % 8, then the low and high halves added and joined by sumsq_dtotal. Eight
// elements a step, not sixteen: sixteen double lanes would be another order, and these
// blocks are rare. Only for blocks the fp32 path cannot take (see the note); kept out of
// line so the hot loop stays small.
template <int G>
__attribute__((noinline)) double sumsq_f64(const void *g, int64_t begin, int64_t end) {
    __m512d a = _mm512_setzero_pd();
    for (int64_t i = begin; i < end; i += 8) {
        __mmask16 k = tail_mask(end - i > 8 ? 8 : end - i);
        __m512d x = _mm512_cvtps_pd(_mm512_castps512_ps256(load_grad<G, true>(g, i, k)));
        a = _mm512_fmadd_pd(x, x, a);
    }
    return sumsq_dtotal(_mm512_castpd512_pd256(a), _mm512_extractf64x4_pd(a, 1));
}

// The shared driver's primitives (see sumsq_blocks.h).
template <int G>
inline void sumsq_full(const void *g, int64_t i, __m256 &a, __m256 &b) {
    sumsq_step<G, false>(g, i, 0xFFFF, a, b);
}

template <int G>
inline void sumsq_tail(const void *g, int64_t i, int64_t end, __m256 &a, __m256 &b) {
    sumsq_step<G, true>(g, i, tail_mask(end - i), a, b);
}

inline bool lanes_all_below(__m256 t, float limit) {
    return _mm256_cmp_ps_mask(t, _mm256_set1_ps(limit), _CMP_LT_OQ) == 0xFF;
}
inline bool lanes_none_at_least(__m256 t, float limit) {
    return _mm256_cmp_ps_mask(t, _mm256_set1_ps(limit), _CMP_GE_OQ) == 0;
}

#include "sumsq_blocks.h"

// ---- compressed states: compressed_tile.h's primitives (the rest in avx512_states.h).

// map[code] for 32 codes from the map held in 16 registers as 16-bit halves (Q8Tables'
// halves): per half, permutex2var_epi16 reads 64 entries by the low 6 bits of the code,
// bits 6 and 7 pick among the 4 results; unpack lo/hi joins the halves into floats. The
// unpacks work per 128-bit lane, so the codes are first put in the order that makes the
// two results codes 0..15 and 16..31. Measured here (Zen 4): 0.16 ns/code against 0.26 for
// 16 codes at a time through permutex2var_ps on the float map, and both faster than a
// 16-lane gather from the L1 table.
struct Q8Map {
    __m512i lo[4][2], hi[4][2];
    __m512i order;
    explicit Q8Map(const uint16_t *halves) {
        for (int j = 0; j < 4; ++j)
            for (int h = 0; h < 2; ++h) {
                lo[j][h] = _mm512_loadu_si512(halves + 64 * j + 32 * h);
                hi[j][h] = _mm512_loadu_si512(halves + 256 + 64 * j + 32 * h);
            }
        // word p (128-bit lane p / 8, q = p % 8) gets code 4 * (p / 8) + q (q < 4: the
        // unpacklo result, codes 0..15) or 16 + 4 * (p / 8) + q - 4 (unpackhi, 16..31)
        alignas(64) static const uint16_t kOrder[32] = {0,  1,  2,  3,  16, 17, 18, 19, 4,  5,  6,
                                                        7,  20, 21, 22, 23, 8,  9,  10, 11, 24, 25,
                                                        26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
        order = _mm512_load_si512(kOrder);
    }
    static inline __m512i half(const __m512i (&t)[4][2], __m512i c, __mmask32 b6, __mmask32 b7) {
        __m512i q[4];
        for (int j = 0; j < 4; ++j) q[j] = _mm512_permutex2var_epi16(t[j][0], c, t[j][1]);
        return _mm512_mask_blend_epi16(b7, _mm512_mask_blend_epi16(b6, q[0], q[1]),
                                       _mm512_mask_blend_epi16(b6, q[2], q[3]));
    }
    // map[codes[0..31]] as two vectors of 16 floats
    inline void lookup(__m512i codes16, __m512 &first, __m512 &second) const {
        const __m512i c = _mm512_permutexvar_epi16(order, codes16);
        const __mmask32 b6 = _mm512_test_epi16_mask(c, _mm512_set1_epi16(64));
        const __mmask32 b7 = _mm512_test_epi16_mask(c, _mm512_set1_epi16(128));
        const __m512i l = half(lo, c, b6, b7), h = half(hi, c, b6, b7);
        first = _mm512_castsi512_ps(_mm512_unpacklo_epi16(l, h));
        second = _mm512_castsi512_ps(_mm512_unpackhi_epi16(l, h));
    }
};

inline void q8_decode(const uint8_t *codes, float absmax, const Q8Tables &t, float *out, int64_t len) {
    const Q8Map m(t.halves);
    const __m512 a = _mm512_set1_ps(absmax);
    for (int64_t i = 0; i < len; i += 32) {
        const __mmask32 k = len - i >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << (len - i)) - 1u);
        __m512 v[2];
        m.lookup(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(k, codes + i)), v[0], v[1]);
        store_ps(out + i, lanes_mask(len - i), _mm512_mul_ps(v[0], a));
        if (len - i > 16) store_ps(out + i + 16, lanes_mask(len - i - 16), _mm512_mul_ps(v[1], a));
    }
}

// The 255 midpoints in 16 registers, by tree level (quant_scalar.h's q8_code_one): levels
// 1-4 (tree[1..15]) and 5 (tree[16..31]) one register each, read by permutexvar on the low
// 4 bits of the node index; level 6 two, read by permutex2var (low 5 bits); levels 7 and 8
// four and eight, pairs read by permutex2var and joined by index bits 5 and 6.
struct Q8Tree {
    __m512 l14, l5, l6[2], l7[4], l8[8];
    explicit Q8Tree(const float *t) {
        l14 = _mm512_loadu_ps(t);
        l5 = _mm512_loadu_ps(t + 16);
        for (int j = 0; j < 2; ++j) l6[j] = _mm512_loadu_ps(t + 32 + 16 * j);
        for (int j = 0; j < 4; ++j) l7[j] = _mm512_loadu_ps(t + 64 + 16 * j);
        for (int j = 0; j < 8; ++j) l8[j] = _mm512_loadu_ps(t + 128 + 16 * j);
    }
};

// idx = 2 * idx + (thr < xn), lane-wise
inline __m512i tree_step(__m512i idx, __m512 thr, __m512 xn) {
    const __mmask16 right = _mm512_cmp_ps_mask(thr, xn, _CMP_LT_OQ);
    const __m512i twice = _mm512_add_epi32(idx, idx);
    return _mm512_mask_add_epi32(twice, right, twice, _mm512_set1_epi32(1));
}

// The codes of V vectors of normalized values, walked level by level side by side: one
// vector's 8 levels are a chain of dependent shuffles and compares (latency-bound), V
// independent chains keep the shuffle units busy. The final node index is 256 + code,
// whose low byte vpmovdb keeps.
template <int V>
inline void q8_search(const Q8Tree &t, const __m512 (&xn)[V], __m128i (&out)[V]) {
    __m512i idx[V];
    for (int j = 0; j < V; ++j) idx[j] = _mm512_set1_epi32(1);
    for (int level = 0; level < 4; ++level)
        for (int j = 0; j < V; ++j) idx[j] = tree_step(idx[j], _mm512_permutexvar_ps(idx[j], t.l14), xn[j]);
    for (int j = 0; j < V; ++j) idx[j] = tree_step(idx[j], _mm512_permutexvar_ps(idx[j], t.l5), xn[j]);
    for (int j = 0; j < V; ++j)
        idx[j] = tree_step(idx[j], _mm512_permutex2var_ps(t.l6[0], idx[j], t.l6[1]), xn[j]);
    for (int j = 0; j < V; ++j) {
        const __mmask16 b5 = _mm512_test_epi32_mask(idx[j], _mm512_set1_epi32(32));
        const __m512 thr = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t.l7[0], idx[j], t.l7[1]),
                                                _mm512_permutex2var_ps(t.l7[2], idx[j], t.l7[3]));
        idx[j] = tree_step(idx[j], thr, xn[j]);
    }
    for (int j = 0; j < V; ++j) {
        const __mmask16 c5 = _mm512_test_epi32_mask(idx[j], _mm512_set1_epi32(32));
        const __mmask16 c6 = _mm512_test_epi32_mask(idx[j], _mm512_set1_epi32(64));
        const __m512 lo = _mm512_mask_blend_ps(c5, _mm512_permutex2var_ps(t.l8[0], idx[j], t.l8[1]),
                                               _mm512_permutex2var_ps(t.l8[2], idx[j], t.l8[3]));
        const __m512 hi = _mm512_mask_blend_ps(c5, _mm512_permutex2var_ps(t.l8[4], idx[j], t.l8[5]),
                                               _mm512_permutex2var_ps(t.l8[6], idx[j], t.l8[7]));
        out[j] = _mm512_cvtepi32_epi8(tree_step(idx[j], _mm512_mask_blend_ps(c6, lo, hi), xn[j]));
    }
}

// The bucket table's keys in 4 registers ([Note: bucketed encoder] in q8_buckets.h).
struct Q8Keys {
    __m512i pos[2], neg[2];
    explicit Q8Keys(const Q8Buckets &b) {
        for (int j = 0; j < 2; ++j) {
            pos[j] = _mm512_loadu_si512(b.key + 16 * j);
            neg[j] = _mm512_loadu_si512(b.key + 32 + 16 * j);
        }
    }
};

// 16 codes by the bucket table: the key from the registers, the bucket's word gathered,
// one compare (quant_scalar.h's q8_code_bucket, lane-wise; |xn| held to [2^-31, 2)).
inline __m128i bucket_codes(const Q8Keys &k, const uint32_t *word, __m512 xn) {
    const __m512i xb = _mm512_castps_si512(xn);
    __m512i ac = _mm512_and_si512(xb, _mm512_set1_epi32(0x7FFFFFFF));
    ac = _mm512_min_epu32(_mm512_max_epu32(ac, _mm512_set1_epi32(96 << 23)), _mm512_set1_epi32(0x3FFFFFFF));
    const __m512i ki = _mm512_srli_epi32(ac, 23);  // permutex2var reads its low 5 bits
    const __m512i kw = _mm512_mask_mov_epi32(_mm512_permutex2var_epi32(k.pos[0], ki, k.pos[1]),
                                             _mm512_movepi32_mask(xb),
                                             _mm512_permutex2var_epi32(k.neg[0], ki, k.neg[1]));
    const __m512i shift = _mm512_and_si512(kw, _mm512_set1_epi32(31));
    const __m512i b = _mm512_add_epi32(_mm512_srlv_epi32(ac, shift), _mm512_srai_epi32(kw, 5));
    const __m512i w = _mm512_i32gather_epi32(b, word, 4);
    const __m512i rel = _mm512_sllv_epi32(_mm512_xor_si512(xb, _mm512_srai_epi32(xb, 31)),
                                          _mm512_sub_epi32(_mm512_set1_epi32(32), shift));
    const __mmask16 up = _mm512_cmpge_epu32_mask(rel, _mm512_andnot_si512(_mm512_set1_epi32(0xFF), w));
    return _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(w, up, w, _mm512_set1_epi32(1)));
}

// Measured here (Zen 4, 2**16 values of each map): the tree 0.66 ns/code, the buckets
// 0.58 (the gather is over half of it; 16 codes per iteration were 0.61).
inline void q8_codes_bucketed(const float *x, int64_t len, __m512 a, bool root, const Q8Buckets &bk,
                              uint8_t *codes) {
    constexpr int V = 4;
    const Q8Keys keys(bk);
    for (int64_t i = 0; i < len; i += 16 * V) {
        __m512 xn[V];
        __mmask16 k[V];
        for (int j = 0; j < V; ++j) {
            k[j] = lanes_mask(len - i - 16 * j);
            xn[j] = q8_root(_mm512_div_ps(_mm512_maskz_loadu_ps(k[j], x + i + 16 * j), a), root);  // IEEE division
        }
        for (int j = 0; j < V; ++j) store_u8(codes + i + 16 * j, k[j], bucket_codes(keys, bk.word, xn[j]));
    }
}

inline void q8_codes(const float *x, int64_t len, float absmax, const Q8Tables &tables, uint8_t *codes) {
    constexpr int V = 4;
    const __m512 a = _mm512_set1_ps(absmax);
    const bool root = tables.sqrt_code;
    if (tables.buckets) return q8_codes_bucketed(x, len, a, root, *tables.buckets, codes);
    const Q8Tree t(tables.tree);
    for (int64_t i = 0; i < len; i += 16 * V) {
        __m512 xn[V];
        __mmask16 k[V];
        __m128i c[V];
        for (int j = 0; j < V; ++j) {
            k[j] = lanes_mask(len - i - 16 * j);
            xn[j] = q8_root(_mm512_div_ps(_mm512_maskz_loadu_ps(k[j], x + i + 16 * j), a), root);  // IEEE division
        }
        q8_search<V>(t, xn, c);
        for (int j = 0; j < V; ++j) store_u8(codes + i + 16 * j, k[j], c[j]);
    }
}

// ---- [Note: fused bf16 Adam]
// AdamW with both moments in bfloat16 is the one compressed step whose states need no block
// pass (no absmax, no codes), so this unit runs it in one loop over the range instead of
// compressed_tile.h's three passes per tile (decode to a stack buffer, the float32 rule,
// encode back). Measured here (Zen 4, 1M-20M elements, 1 thread), the tiles cost 1.2-1.3 ns
// per element against 0.5-0.7 for the float32 kernel: the stack round trip and the two
// extra loops over L1, not the rounding, were the time. Per element the operations are
// those of the tile path (bf16 load, adam_vec's float32 arithmetic, the same nearest-even or
// counter-hashed stochastic store at the element's own stream index), so the bits are the
// same; the tile path still serves every other unit and every other mix of dtypes. The two
// moments share one hash per element (its top half rounds exp_avg, its low half exp_avg_sq:
// quant.py's scheme): the second hash was ~15 % of this loop's time at 1M elements.

template <int G, int L, bool L2, bool FROM_END, bool PB16, bool MASKED>
inline void adam_bf16_vec(const VConsts &c, const Bf16AdamStep &r, int64_t i,
                          __mmask16 k) {
    __m512 g = _mm512_mul_ps(load_grad<G, MASKED>(r.grad, i, k), c.gs);
    __m512 p = PB16 ? load_bf16<MASKED>(r.param, i, k) : load<MASKED>(static_cast<float *>(r.param) + i, k);
    __m512 m = load_bf16<MASKED>(r.m, i, k);
    __m512 v = load_bf16<MASKED>(r.v, i, k);
    adam_math<L2, FROM_END>(c, g, p, m, v);
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(r.offset + static_cast<uint32_t>(i))),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    // one hash for both moments (quant.py: a pair of states shares it, top and low half)
    const __m512i h = r.sm || r.sv ? stream_hash(index, r.kmv) : _mm512_setzero_si512();
    store_bf16v(r.m, i, r.sm ? bf16_sr(m, hash_top(h)) : to_bf16(m), k);
    store_bf16v(r.v, i, r.sv ? bf16_sr(v, hash_low(h)) : to_bf16(v), k);
    if (PB16) {
        store_bf16v(r.param, i, round_bf16(p, r.sp, index, r.kp), k);
    } else {
        store<MASKED>(static_cast<float *>(r.param) + i, p, k);
        store_lowp<L, MASKED, false>(r.lowp, i, p, k);
    }
}

// compressed_tile.h's hook ([Note: fused bf16 Adam] dispatch there): the whole range, the
// last vector masked; returns end.
#define OFFLOAD_FUSED_BF16_ADAM 1
template <int G, int L, bool L2, bool FROM_END, bool PB16>
int64_t adam_bf16_loop(const CompressedStep &s, int64_t begin, int64_t end) {
    const VConsts c(s.adam);
    const Bf16AdamStep r(s);
    const int64_t pbytes = PB16 ? 2 : 4;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        // [Note: software prefetch] (kernel.h): this loop gained the most from it
        if (r.prefetch && ((i - begin) & 31) == 0 && i + kPrefetchAhead < end) {
            const int64_t j = i + kPrefetchAhead;
            prefetch_read(r.grad, j * grad_bytes(G));
            prefetch_write(r.param, j * pbytes);
            prefetch_write(r.m, j * 2);
            prefetch_write(r.v, j * 2);
        }
        if (r.prefetch && ((i - begin) & 31) == 16 && i + kPrefetchAhead < end) {  // the 4-byte streams' second line
            const int64_t j = i + kPrefetchAhead;
            if (G == OFFLOAD_F32) prefetch_read(r.grad, j * 4);
            if (!PB16) prefetch_write(r.param, j * 4);
        }
        adam_bf16_vec<G, L, L2, FROM_END, PB16, false>(c, r, i, 0xFFFF);
    }
    if (i < end) adam_bf16_vec<G, L, L2, FROM_END, PB16, true>(c, r, i, lanes_mask(end - i));
    return end;
}

#include "compressed_tile.h"

}  // namespace

OFFLOAD_UNIT_ENTRY_POINTS(avx512)
OFFLOAD_RULE_ENTRY_POINTS(avx512)
OFFLOAD_COMPRESSED_ENTRY_POINT(avx512)
