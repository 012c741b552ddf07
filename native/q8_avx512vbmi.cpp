// The AVX-512 unit's compressed step on CPUs with VBMI (vpermb / vpermi2b: 64 byte lanes
// read any of 64 / 128 table bytes in one instruction); compiled with the AVX-512 unit's
// flags plus -mavx512vbmi, only here. The float32 rules are the AVX-512 unit's own
// (adam_range_avx512, ...); only the int8 decoder and encoder differ, and give the same
// bits (tools/q8_exhaustive.py, tests/test_q8_vbmi.py). dispatch.cpp runs it for the ISA
// level OFFLOAD_ISA_AVX512VBMI when the step has a Q8 state and every Q8 state's tables fit
// (Q8Tables::vbmi), else the AVX-512 unit's step.
//
// Decode: 64 codes at a time. map[code] is four byte planes of 256 bytes (Q8Tables'
// map_bytes); per plane two vpermi2b read 128 entries each by the code's low 7 bits and bit
// 7 (vpmovb2m) picks one; two rounds of unpacks join the planes into 4 vectors of floats.
// The unpacks work per 128-bit lane, so the codes are first put in the order (kOrder) that
// makes the four results elements 0..15, ..., 48..63.
//
// [Note: VBMI encoder]
// The bucket table of [Note: bucketed encoder] (q8_buckets.h) without its gather:
// - The bucket comes from the top 16 bits of xn (sign, exponent, 7 mantissa bits), 32
//   elements per vector: the key (sign, exponent) reads its shift and offset from two
//   64-entry 16-bit tables (vpermi2w), bucket = (|top16| >> shift) + offset. This needs
//   every key's mantissa bits <= 7 (true of both maps: at most 6 signed, 7 unsigned).
// - A bucket holds at most one code boundary, so with base = #{i : mid[i] < the bucket's
//   lowest float}, the code is base + (mid[base] < xn) for every xn of the bucket (a
//   bucket without a boundary has mid[base] above all of its floats; mid[255] is +inf).
//   base is a byte table of at most 512 buckets (vpermi2b by the low 7 bits, blends by
//   bits 7 and 8), mid[base] four byte planes read as the decoder reads the map, and the
//   compare is the scheme's own float compare: no cut, no rel.
// Q8Vbmi (kernel.h) holds these tables; q8_buckets.h's build_q8_vbmi derives them from the
// bucket table and refuses a map they do not fit (the step then runs the AVX-512 unit).
// Measured here (Zen 4, one state's 256 codes in L1): encode 0.23 ns/element against 0.54
// for the gather (a 16-lane gather costs ~7 ns here), decode 0.076 against 0.125.
#include <cerrno>
#include <immintrin.h>
#include <string.h>

#include "kernel.h"
#include "quant_scalar.h"
#include "offload_native.h"

namespace {

using namespace offload;

#include "avx512_states.h"
#include "avx512_adam.h"

// byte 16 l + 4 k + d of the reordered codes is code 16 k + 4 l + d (a transpose of l, k)
alignas(64) constexpr uint8_t kOrder[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

inline __m512i load64(const void *p) { return _mm512_load_si512(p); }

// t[code] of 64 codes c (in kOrder) from the byte planes t[4][256]: out[k] = elements
// 16 k .. 16 k + 15 as floats.
inline void plane_lookup(const uint8_t (*t)[256], __m512i c, __m512 (&out)[4]) {
    const __mmask64 hi = _mm512_movepi8_mask(c);
    __m512i p[4];
    for (int j = 0; j < 4; ++j) {
        const __m512i lo = _mm512_permutex2var_epi8(load64(t[j]), c, load64(t[j] + 64));
        const __m512i up = _mm512_permutex2var_epi8(load64(t[j] + 128), c, load64(t[j] + 192));
        p[j] = _mm512_mask_blend_epi8(hi, lo, up);
    }
    const __m512i w01l = _mm512_unpacklo_epi8(p[0], p[1]), w01h = _mm512_unpackhi_epi8(p[0], p[1]);
    const __m512i w23l = _mm512_unpacklo_epi8(p[2], p[3]), w23h = _mm512_unpackhi_epi8(p[2], p[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h));
}

inline __mmask64 bytes_mask(int64_t left) {
    return left >= 64 ? ~0ull : (1ull << left) - 1u;
}

inline void q8_decode(const uint8_t *codes, float absmax, const Q8Tables &t, float *out, int64_t len) {
    const __m512 a = _mm512_set1_ps(absmax);
    const __m512i order = load64(kOrder);
    for (int64_t i = 0; i < len; i += 64) {
        const __m512i c = _mm512_maskz_loadu_epi8(bytes_mask(len - i), codes + i);
        __m512 v[4];
        plane_lookup(t.map_bytes, _mm512_permutexvar_epi8(order, c), v);
        for (int k = 0; k < 4; ++k)
            if (len - i > 16 * k) store_ps(out + i + 16 * k, lanes_mask(len - i - 16 * k), _mm512_mul_ps(v[k], a));
    }
}

// The buckets of 32 values (their top 16 bits h), as 16-bit lanes; |h| held to the
// exponents 96..127 (|xn| in [2^-31, 2)) as q8_code_bucket holds it.
inline __m512i buckets32(const Q8Vbmi &t, __m512i h) {
    const __mmask32 neg = _mm512_movepi16_mask(h);
    __m512i a = _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF));
    a = _mm512_min_epu16(_mm512_max_epu16(a, _mm512_set1_epi16(96 << 7)), _mm512_set1_epi16(0x3FFF));
    __m512i key = _mm512_srli_epi16(a, 7);  // the exponent, 96..127: vpermi2w reads bits 0..5,
    key = _mm512_mask_add_epi16(key, neg, key, _mm512_set1_epi16(32));  // 32..63 or, negative, 0..31
    const __m512i shift = _mm512_permutex2var_epi16(load64(t.shift), key, load64(t.shift + 32));
    const __m512i off = _mm512_permutex2var_epi16(load64(t.off), key, load64(t.off + 32));
    return _mm512_add_epi16(_mm512_srlv_epi16(a, shift), off);
}

// The codes of 64 normalized values xn[0..3] ([Note: VBMI encoder]), in element order.
inline __m512i codes64(const Q8Vbmi &t, const __m512 (&xn)[4]) {
    alignas(64) static constexpr uint16_t kTopHalves[32] = {
        1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
        33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    alignas(64) static constexpr uint8_t kLowBytes[64] = {
        0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
        32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62,
        64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86, 88, 90, 92, 94,
        96, 98, 100, 102, 104, 106, 108, 110, 112, 114, 116, 118, 120, 122, 124, 126};
    __m512i b[2];
    __mmask32 big[2];
    for (int h = 0; h < 2; ++h) {
        const __m512i top = _mm512_permutex2var_epi16(_mm512_castps_si512(xn[2 * h]), load64(kTopHalves),
                                                      _mm512_castps_si512(xn[2 * h + 1]));
        b[h] = buckets32(t, top);
        big[h] = _mm512_cmpge_epu16_mask(b[h], _mm512_set1_epi16(256));
    }
    // base[bucket]: 4 x 128 bytes by the low 7 bits, then bit 7 and bit 8 pick
    const __m512i low = _mm512_permutex2var_epi8(b[0], load64(kLowBytes), b[1]);
    const __mmask64 b7 = _mm512_movepi8_mask(low), b8 = _mm512_kunpackd(big[1], big[0]);
    __m512i q[4];
    for (int j = 0; j < 4; ++j)
        q[j] = _mm512_permutex2var_epi8(load64(t.base + 128 * j), low, load64(t.base + 128 * j + 64));
    const __m512i base = _mm512_mask_blend_epi8(b8, _mm512_mask_blend_epi8(b7, q[0], q[1]),
                                                _mm512_mask_blend_epi8(b7, q[2], q[3]));
    __m512 mid[4];
    plane_lookup(t.mid, _mm512_permutexvar_epi8(load64(kOrder), base), mid);
    __mmask16 up[4];
    for (int k = 0; k < 4; ++k) up[k] = _mm512_cmp_ps_mask(mid[k], xn[k], _CMP_LT_OQ);  // mid[base] < xn
    const __mmask64 inc = _mm512_kunpackd(_mm512_kunpackw(up[3], up[2]), _mm512_kunpackw(up[1], up[0]));
    return _mm512_mask_add_epi8(base, inc, base, _mm512_set1_epi8(1));
}

// dispatch.cpp runs this unit only when every Q8 state has its t.vbmi.
inline void q8_codes(const float *x, int64_t len, float absmax, const Q8Tables &t, uint8_t *codes) {
    const __m512 a = _mm512_set1_ps(absmax);
    const bool root = t.sqrt_code;
    for (int64_t i = 0; i < len; i += 64) {
        __m512 xn[4];
        for (int k = 0; k < 4; ++k)  // IEEE division (and square root), as the scheme
            xn[k] = q8_root(_mm512_div_ps(_mm512_maskz_loadu_ps(lanes_mask(len - i - 16 * k), x + i + 16 * k), a), root);
        const __m512i c = codes64(*t.vbmi, xn);
        if (len - i >= 64) _mm512_storeu_si512(codes + i, c);
        else _mm512_mask_storeu_epi8(codes + i, bytes_mask(len - i), c);
    }
}

// Adam's two int8 states of a whole tile side by side: two independent chains of
// permutes per iteration instead of one (the encoder is a chain of ~20 dependent steps per 64
// codes). Measured here (Zen 4, 20M elements, int8 Adam, 1 thread, CPU time, the two
// builds in one process): 1.46-1.48 ns per element against 1.64-1.68 one state after the
// other (bf16 param: 1.67 against 1.88). Blocks of zeros, NaN or inf and partial
// tiles go the common way (q8_encode_block).
// With the two blocks' abs_bits_max already known (m0, m1: the fused tile keeps them).
inline bool q8_encode_pair_max(const float *x0, const float *x1, uint32_t m0, uint32_t m1, const Q8Tables &t0,
                               const Q8Tables &t1, uint8_t *blk0, uint8_t *blk1) {
    if (m0 - 1u >= 0x7F7FFFFFu || m1 - 1u >= 0x7F7FFFFFu) return false;  // 0, or NaN / inf
    const __m512 a0 = _mm512_set1_ps(bits_f32(m0)), a1 = _mm512_set1_ps(bits_f32(m1));
    const bool r0 = t0.sqrt_code, r1 = t1.sqrt_code;
    for (int64_t i = 0; i < kTile; i += 64) {
        __m512 y0[4], y1[4];
        for (int q = 0; q < 4; ++q) {  // IEEE division (and square root), as the scheme
            y0[q] = q8_root(_mm512_div_ps(_mm512_loadu_ps(x0 + i + 16 * q), a0), r0);
            y1[q] = q8_root(_mm512_div_ps(_mm512_loadu_ps(x1 + i + 16 * q), a1), r1);
        }
        const __m512i c0 = codes64(*t0.vbmi, y0), c1 = codes64(*t1.vbmi, y1);
        _mm512_storeu_si512(blk0 + i, c0);
        _mm512_storeu_si512(blk1 + i, c1);
    }
    memcpy(blk0 + kTile, &m0, 4);
    memcpy(blk1 + kTile, &m1, 4);
    return true;
}

inline bool q8_encode_pair(const float *x0, const float *x1, int64_t len, const Q8Tables &t0,
                           const Q8Tables &t1, uint8_t *blk0, uint8_t *blk1) {
    if (len != kTile) return false;
    return q8_encode_pair_max(x0, x1, abs_bits_max(x0, kTile), abs_bits_max(x1, kTile), t0, t1, blk0, blk1);
}

// ---- [Note: fused int8 Adam tile]
// AdamW over two int8 states, a whole tile (256 elements, one block of each state) at a
// time: the codes are decoded in registers (64 per round, as q8_decode) straight into the
// AVX-512 unit's Adam arithmetic (avx512_adam.h's adam_math), the new moments go to the
// stack tile with their abs_bits_max kept in registers, and the pair encoder then runs on the
// tile with those maxima. compressed_tile.h's path for the same tile decodes both states to
// the stack, runs the rule over the stack, then reads each state again for its absmax: three
// more passes over L1. Per element the operations are those of that path (decode's multiply,
// adam_vec's arithmetic, the same bf16 param rounding), so the bits are too. Partial tiles,
// and blocks whose new absmax is 0, NaN or inf, take the common path for their encoding.
inline __m512 q8_scale(__m512 mapped, __m512 absmax) { return _mm512_mul_ps(mapped, absmax); }

template <int G, int L, bool L2, bool FROM_END, bool PB16>
void adam_q8_tile(const VConsts &c, const CompressedStep &s, int64_t t0, float *m_out, float *v_out,
                  uint32_t &mx_m, uint32_t &mx_v) {
    const uint8_t *bm = static_cast<const uint8_t *>(s.states[0].data) + (t0 / kTile) * OFFLOAD_Q8_PACKED;
    const uint8_t *bv = static_cast<const uint8_t *>(s.states[1].data) + (t0 / kTile) * OFFLOAD_Q8_PACKED;
    float am, av;
    memcpy(&am, bm + kTile, 4);
    memcpy(&av, bv + kTile, 4);
    const __m512 am_v = _mm512_set1_ps(am), av_v = _mm512_set1_ps(av);
    const __m512i order = load64(kOrder), abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i acc_m = _mm512_setzero_si512(), acc_v = _mm512_setzero_si512();
    const uint32_t key_p = stream_key(s.seed, 0);
    const bool sp = s.param.rounding == OFFLOAD_ROUND_STOCHASTIC;
    const uint32_t start = static_cast<uint32_t>(static_cast<uint64_t>(s.offset + t0));
    for (int64_t i = 0; i < kTile; i += 64) {
        __m512 dm[4], dv[4];
        plane_lookup(s.q8[0].map_bytes, _mm512_permutexvar_epi8(order, _mm512_loadu_si512(bm + i)), dm);
        plane_lookup(s.q8[1].map_bytes, _mm512_permutexvar_epi8(order, _mm512_loadu_si512(bv + i)), dv);
        for (int k = 0; k < 4; ++k) {
            const int64_t e = t0 + i + 16 * k;  // the element's index in the call
            __m512 g = _mm512_mul_ps(load_grad<G, false>(s.grad, e, 0xFFFF), c.gs);
            __m512 p = PB16 ? load_bf16<false>(s.param.data, e, 0xFFFF)
                            : _mm512_loadu_ps(static_cast<const float *>(s.param.data) + e);
            __m512 m = q8_scale(dm[k], am_v), v = q8_scale(dv[k], av_v);
            adam_math<L2, FROM_END>(c, g, p, m, v);
            if (PB16) {
                const __m512i index = _mm512_add_epi32(
                    _mm512_set1_epi32(static_cast<int>(start + static_cast<uint32_t>(i + 16 * k))),
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
                store_bf16v(s.param.data, e, round_bf16(p, sp, index, key_p), 0xFFFF);
            } else {
                _mm512_storeu_ps(static_cast<float *>(s.param.data) + e, p);
                store_lowp<L, false, false>(s.lowp, e, p, 0xFFFF);
            }
            _mm512_store_ps(m_out + i + 16 * k, m);
            _mm512_store_ps(v_out + i + 16 * k, v);
            acc_m = _mm512_max_epu32(acc_m, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
            acc_v = _mm512_max_epu32(acc_v, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
        }
    }
    mx_m = static_cast<uint32_t>(_mm512_reduce_max_epu32(acc_m));
    mx_v = static_cast<uint32_t>(_mm512_reduce_max_epu32(acc_v));
}

// One full tile of AdamW over two Q8 states (both with VBMI tables): stepped into m_out and
// v_out and encoded; false: a block of zeros, NaN or inf, left for the caller to encode the
// common way (compressed_tile.h's encode_states) from m_out and v_out.
template <int G, int L, bool L2, bool FROM_END, bool PB16>
bool adam_q8_full(const CompressedStep &s, int64_t t0, float *m_out, float *v_out) {
    const VConsts c(s.adam);
    uint32_t mx_m, mx_v;
    adam_q8_tile<G, L, L2, FROM_END, PB16>(c, s, t0, m_out, v_out, mx_m, mx_v);
    uint8_t *bm = static_cast<uint8_t *>(s.states[0].data) + (t0 / kTile) * OFFLOAD_Q8_PACKED;
    uint8_t *bv = static_cast<uint8_t *>(s.states[1].data) + (t0 / kTile) * OFFLOAD_Q8_PACKED;
    return q8_encode_pair_max(m_out, v_out, mx_m, mx_v, s.q8[0], s.q8[1], bm, bv);
}

using Q8TileFn = bool (*)(const CompressedStep &, int64_t, float *, float *);

template <int G, int L, bool PB16>
Q8TileFn q8_tile_flags(const CompressedStep &s) {
    if (s.adam.use_l2) return s.adam.lerp_from_end ? adam_q8_full<G, L, true, true, PB16> : adam_q8_full<G, L, true, false, PB16>;
    return s.adam.lerp_from_end ? adam_q8_full<G, L, false, true, PB16> : adam_q8_full<G, L, false, false, PB16>;
}

template <int G>
Q8TileFn q8_tile_lowp(const CompressedStep &s) {
    if (s.param.dtype == OFFLOAD_BF16) return s.lowp ? nullptr : q8_tile_flags<G, -1, true>(s);
    switch (s.lowp ? s.lowp_dtype : -1) {
        case -1: return q8_tile_flags<G, -1, false>(s);
        case OFFLOAD_F16: return q8_tile_flags<G, OFFLOAD_F16, false>(s);
        case OFFLOAD_BF16: return q8_tile_flags<G, OFFLOAD_BF16, false>(s);
        default: return nullptr;
    }
}

// compressed_tile.h's hook: the step's full-tile function, or nullptr (not AdamW over two
// Q8 states: the common path). The Q8 states have their VBMI tables (dispatch.cpp).
#define OFFLOAD_FUSED_Q8_ADAM 1
inline Q8TileFn adam_q8_tiles(const CompressedStep &s) {
    const auto q8 = [](int dtype) { return dtype == OFFLOAD_Q8S || dtype == OFFLOAD_Q8U; };
    if (s.rule != OFFLOAD_RULE_ADAM || s.num_states != 2 || !q8(s.states[0].dtype) || !q8(s.states[1].dtype) ||
        s.q8[0].map_bytes == nullptr || s.q8[1].map_bytes == nullptr)
        return nullptr;
    switch (s.grad_dtype) {
        case OFFLOAD_F32: return q8_tile_lowp<OFFLOAD_F32>(s);
        case OFFLOAD_F16: return q8_tile_lowp<OFFLOAD_F16>(s);
        case OFFLOAD_BF16: return q8_tile_lowp<OFFLOAD_BF16>(s);
        default: return nullptr;
    }
}

#define OFFLOAD_Q8_PAIR
#include "compressed_tile.h"

}  // namespace

OFFLOAD_COMPRESSED_ENTRY_POINT_OVER(avx512vbmi, avx512)
