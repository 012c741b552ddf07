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
    explicit VConsts(const AdamConsts &c)
        : gs(_mm256_set1_ps(c.grad_scale)), l2(_mm256_set1_ps(c.l2)),
          decay(_mm256_set1_ps(c.decay)), coeff(_mm256_set1_ps(c.lerp_coeff)),
          b2(_mm256_set1_ps(c.beta2)), w2(_mm256_set1_ps(c.one_minus_beta2)),
          bc2s(_mm256_set1_ps(c.bc2_sqrt)), eps(_mm256_set1_ps(c.eps)),
          nss(_mm256_set1_ps(c.neg_step_size)) {}
};

// One vector of Adam on registers (g already scaled), as avx512_adam.h's adam_math: the FMAs
// are written out ([Note: explicit FMAs] there).
template <bool L2, bool FROM_END>
inline void adam_math(const VConsts &c, __m256 g, __m256 &p, __m256 &m, __m256 &v) {
    if (L2) g = _mm256_fmadd_ps(p, c.l2, g);
    m = _mm256_fmadd_ps(c.coeff, _mm256_sub_ps(g, m), FROM_END ? g : m);
    v = _mm256_mul_ps(v, c.b2);
    v = _mm256_fmadd_ps(_mm256_mul_ps(c.w2, g), g, v);
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bc2s), c.eps);
    p = _mm256_fmadd_ps(p, c.decay, _mm256_div_ps(_mm256_mul_ps(c.nss, m), denom));
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

inline double hsum(__m256d s) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, s);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

// The exact path: every element converted to double before its FMA. Only for blocks the
// fp32 path cannot take (see the note); kept out of line so the hot loop stays small.
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
    return hsum(_mm256_add_pd(a0, a1));
}

// The shared driver's primitives (see sumsq_blocks.h).
template <int G>
inline void sumsq_full(const void *g, int64_t i, __m256 &a, __m256 &b) {
    sumsq_step<G>(g, i, a, b);
}

inline bool lanes_all_below(__m256 t, __m256 limit) {
    return _mm256_movemask_ps(_mm256_cmp_ps(t, limit, _CMP_LT_OQ)) == 0xFF;
}
inline bool lanes_none_at_least(__m256 t, __m256 limit) {
    return _mm256_movemask_ps(_mm256_cmp_ps(t, limit, _CMP_GE_OQ)) == 0;
}

#include "sumsq_blocks.h"

// ---- compressed states: compressed_tile.h's primitives, 8 lanes at a time; the part
// left over (< 8) goes through quant_scalar.h, whose operations are exact: the same bits.
// [Note: AVX2 table lookups] The int8 states read small tables (the map, the bucket keys
// and words) at 8 indices per vector. vpgatherdd is slow where this unit runs: on an AMD
// EPYC (Zen 3, AVX2 only) of CI's machine kind a ymm gather from L1 took 3.8 ns, eight
// scalar loads inserted into a vector 2.4 (a microbenchmark of each in a loop); Intel cores that
// take this unit (no AVX-512) are older ones or run the Gather Data Sampling mitigation,
// which makes gathers several times slower. The loads read the same table entries, so the
// bits are the gather's.
inline __m256i lookup8(const int32_t *table, __m256i idx) {
    const __m128i lo = _mm256_castsi256_si128(idx), hi = _mm256_extracti128_si256(idx, 1);
    const uint64_t a = static_cast<uint64_t>(_mm_cvtsi128_si64(lo));
    const uint64_t b = static_cast<uint64_t>(_mm_extract_epi64(lo, 1));
    const uint64_t c = static_cast<uint64_t>(_mm_cvtsi128_si64(hi));
    const uint64_t d = static_cast<uint64_t>(_mm_extract_epi64(hi, 1));
    __m128i r0 = _mm_cvtsi32_si128(table[static_cast<uint32_t>(a)]);
    r0 = _mm_insert_epi32(r0, table[a >> 32], 1);
    r0 = _mm_insert_epi32(r0, table[static_cast<uint32_t>(b)], 2);
    r0 = _mm_insert_epi32(r0, table[b >> 32], 3);
    __m128i r1 = _mm_cvtsi32_si128(table[static_cast<uint32_t>(c)]);
    r1 = _mm_insert_epi32(r1, table[c >> 32], 1);
    r1 = _mm_insert_epi32(r1, table[static_cast<uint32_t>(d)], 2);
    r1 = _mm_insert_epi32(r1, table[d >> 32], 3);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(r0), r1, 1);
}

inline __m256 lookup8(const float *table, __m256i idx) {
    return _mm256_castsi256_ps(lookup8(reinterpret_cast<const int32_t *>(table), idx));
}

inline void q8_decode(const uint8_t *codes, float absmax, const Q8Tables &t, float *out, int64_t len) {
    const float *map = t.map;
    const __m256 a = _mm256_set1_ps(absmax);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(codes + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(lookup8(map, c), a));
    }
    q8_decode_scalar(codes + i, absmax, map, out + i, len - i);
}

inline uint32_t abs_bits_max(const float *x, int64_t len) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + i));
        m = _mm256_max_epu32(m, _mm256_and_si256(v, abs_mask));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i *>(lanes), m);
    uint32_t r = abs_bits_max_scalar(x + i, len - i);
    for (uint32_t v : lanes) r = v > r ? v : r;
    return r;
}

// idx = 2 * idx + (thr < xn), lane-wise (a true compare is -1)
inline __m256i tree_step(__m256i idx, __m256 thr, __m256 xn) {
    const __m256i right = _mm256_castps_si256(_mm256_cmp_ps(thr, xn, _CMP_LT_OQ));
    return _mm256_sub_epi32(_mm256_add_epi32(idx, idx), right);
}

// The first 5 tree levels (tree[1..31]) in 4 registers read by permutevar8x32 (low 3 bits
// of the node index; level 5 joined by bit 3); levels 6-8 looked up in the L1 table (lookup8). V
// vectors walk the levels side by side (independent dependency chains, as in the AVX-512
// unit).
template <int V>
inline void q8_search(const float *tree, const __m256 (&r)[4], const __m256 (&xn)[V],
                      __m128i (&out)[V]) {
    __m256i idx[V];
    for (int j = 0; j < V; ++j) idx[j] = _mm256_set1_epi32(1);
    for (int level = 0; level < 3; ++level)
        for (int j = 0; j < V; ++j) idx[j] = tree_step(idx[j], _mm256_permutevar8x32_ps(r[0], idx[j]), xn[j]);
    for (int j = 0; j < V; ++j) idx[j] = tree_step(idx[j], _mm256_permutevar8x32_ps(r[1], idx[j]), xn[j]);
    for (int j = 0; j < V; ++j) {
        const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx[j], 28));  // bit 3 to the sign
        idx[j] = tree_step(idx[j], _mm256_blendv_ps(_mm256_permutevar8x32_ps(r[2], idx[j]),
                                                    _mm256_permutevar8x32_ps(r[3], idx[j]), b3), xn[j]);
    }
    for (int level = 5; level < 8; ++level)
        for (int j = 0; j < V; ++j) idx[j] = tree_step(idx[j], lookup8(tree, idx[j]), xn[j]);
    for (int j = 0; j < V; ++j) {
        const __m256i c = _mm256_and_si256(idx[j], _mm256_set1_epi32(0xFF));  // 256 + code
        const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        out[j] = _mm_packus_epi16(w, w);
    }
}

// 8 codes by the bucket table ([Note: bucketed encoder] in q8_buckets.h): the key and the
// bucket's word gathered, one unsigned compare (max + equal: AVX2 has no unsigned compare);
// quant_scalar.h's q8_code_bucket lane-wise. The low byte of each lane is the code.
inline __m256i bucket_codes(const Q8Buckets &bk, __m256 xn) {
    const __m256i xb = _mm256_castps_si256(xn);
    __m256i ac = _mm256_and_si256(xb, _mm256_set1_epi32(0x7FFFFFFF));
    ac = _mm256_min_epu32(_mm256_max_epu32(ac, _mm256_set1_epi32(96 << 23)), _mm256_set1_epi32(0x3FFFFFFF));
    const __m256i ki = _mm256_add_epi32(_mm256_sub_epi32(_mm256_srli_epi32(ac, 23), _mm256_set1_epi32(96)),
                                        _mm256_slli_epi32(_mm256_srli_epi32(xb, 31), 5));
    const __m256i kw = lookup8(bk.key, ki);
    const __m256i shift = _mm256_and_si256(kw, _mm256_set1_epi32(31));
    const __m256i b = _mm256_add_epi32(_mm256_srlv_epi32(ac, shift), _mm256_srai_epi32(kw, 5));
    const __m256i w = lookup8(reinterpret_cast<const int32_t *>(bk.word), b);
    const __m256i rel = _mm256_sllv_epi32(_mm256_xor_si256(xb, _mm256_srai_epi32(xb, 31)),
                                          _mm256_sub_epi32(_mm256_set1_epi32(32), shift));
    const __m256i cut = _mm256_andnot_si256(_mm256_set1_epi32(0xFF), w);
    const __m256i up = _mm256_cmpeq_epi32(_mm256_max_epu32(rel, cut), rel);  // rel >= cut: -1
    return _mm256_sub_epi32(w, up);
}

inline __m128i low_bytes(__m256i c) {
    c = _mm256_and_si256(c, _mm256_set1_epi32(0xFF));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    return _mm_packus_epi16(w, w);
}

// quant_scalar.h's q8_norm of 8 values: x / a, or sqrt(max(x / a, +0)) (maxps gives its
// second operand, +0, for -0).
inline __m256 q8_norm8(const float *x, __m256 a, bool root) {
    const __m256 xn = _mm256_div_ps(_mm256_loadu_ps(x), a);  // IEEE division
    return root ? _mm256_sqrt_ps(_mm256_max_ps(xn, _mm256_setzero_ps())) : xn;
}

inline void q8_codes(const float *x, int64_t len, float absmax, const Q8Tables &t, uint8_t *codes) {
    constexpr int V = 4;
    const __m256 a = _mm256_set1_ps(absmax);
    const bool root = t.sqrt_code;
    int64_t i = 0;
    if (t.buckets) {
        for (; i + 8 <= len; i += 8) {
            const __m256 xn = q8_norm8(x + i, a, root);
            _mm_storel_epi64(reinterpret_cast<__m128i *>(codes + i), low_bytes(bucket_codes(*t.buckets, xn)));
        }
        return q8_codes_scalar(x + i, len - i, absmax, t, codes + i);
    }
    const float *tree = t.tree;
    const __m256 r[4] = {_mm256_loadu_ps(tree), _mm256_loadu_ps(tree + 8),
                         _mm256_loadu_ps(tree + 16), _mm256_loadu_ps(tree + 24)};
    for (; i + 8 * V <= len; i += 8 * V) {
        __m256 xn[V];
        __m128i c[V];
        for (int j = 0; j < V; ++j) xn[j] = q8_norm8(x + i + 8 * j, a, root);
        q8_search<V>(tree, r, xn, c);
        for (int j = 0; j < V; ++j) _mm_storel_epi64(reinterpret_cast<__m128i *>(codes + i + 8 * j), c[j]);
    }
    for (; i + 8 <= len; i += 8) {
        const __m256 xn[1] = {q8_norm8(x + i, a, root)};
        __m128i c[1];
        q8_search<1>(tree, r, xn, c);
        _mm_storel_epi64(reinterpret_cast<__m128i *>(codes + i), c[0]);
    }
    q8_codes_scalar(x + i, len - i, absmax, t, codes + i);
}

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
