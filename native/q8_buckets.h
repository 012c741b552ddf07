// Builds kernel.h's Q8Buckets (the bucket table of [Note: bucketed encoder]) from a map's
// 255 midpoints. Included by dispatch.cpp only (compiled without wider instruction sets);
// tools/q8_exhaustive.py checks the encoders that read the table against quant.py's scheme
// on every float32 in [-1, 1].
//
// [Note: bucketed encoder]
// The code of xn is #{i : mid[i] < xn} (quant.py). The maps are monotone and dense only
// near 1, so the float bits of xn nearly say which code it gets. A bucket is a run of
// float32 bit patterns of one sign: all exponents e <= 96 (|xn| < 2^-30) form one bucket
// per sign, and exponent e in 97..127 is cut by its top mb(sign, e) mantissa bits (mb in
// 0..10, per exponent the fewest bits that leave at most one code boundary in a bucket).
// Over a bucket's floats the code is non-decreasing in xn, so it takes at most the values
// base and base + 1; the table keeps per bucket base and a cut, and
//     code = base + (rel(xn) >= cut)  (mod 256),
// rel(xn) = the low 23 - mb bits of bits(xn) ^ (xn < 0 ? 0xFFFFFFFF : 0), which grows with
// xn inside a bucket of either sign. The cut is found here by evaluating the scheme's own
// comparison mid[base] < xn on the bucket's floats (a binary search over rel), so every
// float gets the scheme's code by construction, ties included. A bucket without a
// boundary stores base - 1 and cut 0 (always up: mod 256, base 0 stores 255).
// Layout (kernel.h's Q8Buckets), for the SIMD units' sake:
//   key[sign * 32 + (max(e, 96) & 31)] = (first - (max(e, 96) << mb)) << 5 | (23 - mb),
//     first = the key's first bucket, so bucket = (bits(|xn|) >> (23 - mb)) + (key >> 5)
//     with |xn| raised to 2^-31 when below (a bucket of constant code: no cut read);
//   word[bucket] = cut << (9 + mb) | base, so the compare is
//     (bits(xn) ^ sign mask) << (9 + mb) >= (word & ~0xFF)   (the top bits shifted out).
// One permute and one gather and ~18 integer ops per vector instead of 8 search levels.
// A map the table does not fit (two boundaries in a bucket even at 10 bits, more than
// kQ8Buckets buckets, unsorted midpoints) gets ok = false: the units search the tree.
#ifndef OFFLOAD_Q8_BUCKETS_H
#define OFFLOAD_Q8_BUCKETS_H

#include <stdint.h>
#include <string.h>

#include "kernel.h"

namespace {

inline float q8b_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// #{i : mid[i] < x} of sorted midpoints (binary search).
inline uint32_t q8b_count_below(const float *mid, float x) {
    uint32_t lo = 0, hi = 255;
    while (lo < hi) {
        const uint32_t m = (lo + hi) / 2;
        if (mid[m] < x) lo = m + 1;
        else hi = m;
    }
    return lo;
}

// The float of a bucket at rel (the bucket's magnitude bits lo..lo + mask, sign neg).
inline float q8b_at(uint32_t lo, uint32_t mask, bool neg, uint32_t rel) {
    return neg ? -q8b_float(lo + (mask - rel)) : q8b_float(lo + rel);
}

// The table word of the bucket of magnitude bits [lo, lo + mask] and sign neg, or -1 if
// it holds more than one code boundary.
inline int64_t q8b_word(const float *mid, uint32_t lo, uint32_t mask, bool neg, int s2) {
    const uint32_t base = q8b_count_below(mid, q8b_at(lo, mask, neg, 0));
    const uint32_t top = q8b_count_below(mid, q8b_at(lo, mask, neg, mask));
    if (top == base) return (base - 1) & 0xFFu;  // cut 0: always up
    if (top != base + 1) return -1;
    uint32_t a = 0, b = mask;  // the smallest rel whose float is above mid[base]: in (0, mask]
    while (a < b) {
        const uint32_t m = a + (b - a) / 2;
        if (mid[base] < q8b_at(lo, mask, neg, m)) b = m;
        else a = m + 1;
    }
    return static_cast<int64_t>(a) << s2 | base;
}

// Fills the key's buckets with mb mantissa bits at t.word[first..]; false if one does not fit.
inline bool q8b_fill_key(const float *mid, int key, int mb, uint32_t first, offload::Q8Buckets &t) {
    const bool neg = key >= 32;
    const uint32_t e = 96 + static_cast<uint32_t>(key & 31);
    const int shift = 23 - mb;
    for (uint32_t b = 0; b < (1u << mb); ++b) {
        // e == 96 also stands for every smaller exponent: magnitudes 0 .. 2^-30 (exclusive)
        const uint32_t lo = e == 96 ? 0u : (e << 23 | b << shift);
        const uint32_t mask = e == 96 ? (97u << 23) - 1u : (1u << shift) - 1u;
        const int64_t w = q8b_word(mid, lo, mask, neg, 9 + mb);
        if (w < 0 || (e == 96 && w > 0xFF)) return false;  // e <= 96: no rel, no cut
        t.word[first + b] = static_cast<uint32_t>(w);
    }
    const int32_t off = static_cast<int32_t>(first) - static_cast<int32_t>(e << mb);
    t.key[key] = static_cast<int32_t>(static_cast<uint32_t>(off) << 5 | static_cast<uint32_t>(shift));
    return true;
}

// t for the sorted midpoints mid[255]; t.ok = false where the map does not fit.
inline void build_q8_buckets(const float *mid, offload::Q8Buckets &t) {
    t.ok = false;
    t.neg_key = -1;
    for (int i = 0; i + 1 < 255; ++i)
        if (!(mid[i] <= mid[i + 1])) return;  // unsorted or NaN: the tree search
    uint32_t used = 0;
    for (int key = 0; key < 64; ++key) {
        int mb = 0;
        const int max_mb = (key & 31) == 0 ? 0 : 10;
        while (mb <= max_mb && (used + (1u << mb) > offload::kQ8Buckets ||
                                !q8b_fill_key(mid, key, mb, used, t)))
            ++mb;
        if (mb > max_mb) return;
        used += 1u << mb;
    }
    t.ok = true;
}

// The same table with the keys of both signs alike ([Note: sign-shared keys]): t.ok = false
// where the map does not fit.
//
// [Note: sign-shared keys] Here each exponent's mantissa bits are the most either sign needs
// (a bucket split further keeps at most one boundary), the positive buckets come first and
// the negative ones S buckets later, so key[32 + k] = key[k] + (S << 5): t.neg_key = S << 5.
// The scalar and AVX-512 readers of the table see an ordinary one; the AVX2 unit keeps the
// 32 positive keys in 4 registers (a permute by the exponent instead of 8 loads from L1)
// and adds neg_key for negative values.
inline void build_q8_buckets_shared(const float *mid, offload::Q8Buckets &t) {
    t.ok = false;
    t.neg_key = -1;
    for (int i = 0; i + 1 < 255; ++i)
        if (!(mid[i] <= mid[i + 1])) return;
    // the mantissa bits per exponent, tried in a scratch table at bucket 0
    static thread_local offload::Q8Buckets scratch;
    int mb[32];
    uint32_t half = 0;
    for (int k = 0; k < 32; ++k) {
        const int max_mb = k == 0 ? 0 : 10;
        int m = 0;
        while (m <= max_mb && (!q8b_fill_key(mid, k, m, 0, scratch) || !q8b_fill_key(mid, 32 + k, m, 0, scratch)))
            ++m;
        if (m > max_mb) return;
        mb[k] = m;
        half += 1u << m;
    }
    if (2 * half > offload::kQ8Buckets) return;
    uint32_t used = 0;
    for (int k = 0; k < 32; ++k) {
        if (!q8b_fill_key(mid, k, mb[k], used, t) || !q8b_fill_key(mid, 32 + k, mb[k], half + used, t)) return;
        used += 1u << mb[k];
    }
    t.neg_key = static_cast<int32_t>(half << 5);
    t.ok = true;
}

// The VBMI unit's tables ([Note: VBMI encoder] in q8_avx512vbmi.cpp) from the bucket table b
// of the midpoints mid[255]; v.ok = false where b does not fit them (no table, a key of more
// than 7 mantissa bits, more than kQ8VbmiBuckets buckets).
inline void build_q8_vbmi(const float *mid, const offload::Q8Buckets &b, offload::Q8Vbmi &v) {
    v.ok = false;
    if (!b.ok) return;
    memset(v.base, 0, sizeof v.base);  // buckets past the last key's: never read
    for (int key = 0; key < 64; ++key) {
        const uint32_t shift = static_cast<uint32_t>(b.key[key]) & 31u;
        if (shift < 16) return;  // the 16-bit half of xn must hold the bucket's mantissa bits
        const int mb = 23 - static_cast<int>(shift);
        const int32_t off = b.key[key] >> 5;
        const uint32_t first = static_cast<uint32_t>(off + ((96 + (key & 31)) << mb));
        if (first + (1u << mb) > offload::kQ8VbmiBuckets) return;
        // the unit's index: (the exponent + 32 * sign) mod 64, so negative keys come first
        const int slot = key < 32 ? key + 32 : key - 32;
        v.shift[slot] = static_cast<uint16_t>(shift - 16);
        v.off[slot] = static_cast<uint16_t>(off);  // mod 2^16, as the unit adds it
        for (uint32_t i = first; i < first + (1u << mb); ++i) {
            // word = cut << (9 + mb) | base, or base - 1 with cut 0 where the code is constant
            const uint32_t w = b.word[i];
            v.base[i] = static_cast<uint8_t>((w >> (9 + mb)) == 0 ? w + 1 : w);
        }
    }
    for (int i = 0; i < 256; ++i) {
        const float m = i < 255 ? mid[i] : __builtin_inff();  // code 255: never below xn <= 1
        uint32_t bits;
        memcpy(&bits, &m, 4);
        for (int j = 0; j < 4; ++j) v.mid[j][i] = static_cast<uint8_t>(bits >> (8 * j));
    }
    v.ok = true;
}

}  // namespace

#endif
