// The AVX2 unit's int8 codec (compressed_tile.h's q8_decode, abs_bits_max and q8_codes, 8
// lanes at a time; the part left over goes through quant_scalar.h: the same bits). Include it
// *inside* adam_avx2.cpp's anonymous namespace, after <immintrin.h>, kernel.h,
// quant_scalar.h and `using namespace offload;` (compiled with that unit's flags only).
#ifndef OFFLOAD_AVX2_Q8_H
#define OFFLOAD_AVX2_Q8_H

// [Note: AVX2 table lookups] The int8 states read small tables (the map, the bucket keys
// and words) at 8 indices per vector. vpgatherdd is slow where this unit runs: on an AMD
// EPYC (Zen 3, AVX2 only) of CI's machine kind a ymm gather from L1 took 3.8 ns, eight
// scalar loads inserted into a vector 2.4 (a microbenchmark of each in a loop); Intel cores that
// take this unit (no AVX-512) are older ones or run the Gather Data Sampling mitigation,
// which makes gathers several times slower. The loads read the same table entries, so the
// bits are the gather's. The encoder reads only the bucket words from memory: the keys come
// from registers ([Note: sign-shared keys] in q8_buckets.h). Measured on that EPYC (CPU
// time, 2^14 values of each map in L1): encode 1.33 -> ~1.1 ns per value (signed map) and
// 1.64 -> ~1.4 (square-root code), decode 0.38 -> 0.28.
// table[i] | table[j] << 32 in the low half of a vector.
inline __m128i lookup_pair(const int32_t *table, uint32_t i, uint32_t j) {
    return _mm_insert_epi32(_mm_cvtsi32_si128(table[i]), table[j], 1);
}

// The 8 loads joined in a tree (pairs, then quads, then halves): a dependency chain of 3
// steps instead of 7, so more lookups overlap (decode -28 %, encode -10 % on Zen 3).
inline __m256i join_pairs(__m128i p0, __m128i p1, __m128i p2, __m128i p3) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi64(p0, p1)),
                                   _mm_unpacklo_epi64(p2, p3), 1);
}

inline __m256i lookup8(const int32_t *table, __m256i idx) {
    const __m128i lo = _mm256_castsi256_si128(idx), hi = _mm256_extracti128_si256(idx, 1);
    const uint64_t a = static_cast<uint64_t>(_mm_cvtsi128_si64(lo));
    const uint64_t b = static_cast<uint64_t>(_mm_extract_epi64(lo, 1));
    const uint64_t c = static_cast<uint64_t>(_mm_cvtsi128_si64(hi));
    const uint64_t d = static_cast<uint64_t>(_mm_extract_epi64(hi, 1));
    return join_pairs(lookup_pair(table, static_cast<uint32_t>(a), static_cast<uint32_t>(a >> 32)),
                      lookup_pair(table, static_cast<uint32_t>(b), static_cast<uint32_t>(b >> 32)),
                      lookup_pair(table, static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32)),
                      lookup_pair(table, static_cast<uint32_t>(d), static_cast<uint32_t>(d >> 32)));
}

// map[codes[0..7]]: the 8 codes read as one 64-bit integer and split by shifts (no vector to
// integer moves), the loads joined as in lookup8.
inline __m256 lookup_codes8(const float *map, const uint8_t *codes) {
    const int32_t *t = reinterpret_cast<const int32_t *>(map);
    uint64_t c;
    memcpy(&c, codes, 8);
    const auto at = [c](int k) { return static_cast<uint32_t>(c >> (8 * k)) & 0xFFu; };
    return _mm256_castsi256_ps(join_pairs(lookup_pair(t, at(0), at(1)), lookup_pair(t, at(2), at(3)),
                                          lookup_pair(t, at(4), at(5)), lookup_pair(t, at(6), at(7))));
}

inline __m256 lookup8(const float *table, __m256i idx) {
    return _mm256_castsi256_ps(lookup8(reinterpret_cast<const int32_t *>(table), idx));
}

inline void q8_decode(const uint8_t *codes, float absmax, const Q8Tables &t, float *out, int64_t len) {
    const float *map = t.map;
    const __m256 a = _mm256_set1_ps(absmax);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(lookup_codes8(map, codes + i), a));
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

// |xn|'s bits held to [2^-31, 2): what indexes the tables (quant_scalar.h's q8_code_bucket).
inline __m256i held_magnitude(__m256i xb) {
    const __m256i ac = _mm256_and_si256(xb, _mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_min_epu32(_mm256_max_epu32(ac, _mm256_set1_epi32(96 << 23)), _mm256_set1_epi32(0x3FFFFFFF));
}

// The codes of xn (bits xb, held magnitude ac) from their keys kw: the bucket's word loaded,
// one unsigned compare of rel(xn) with its cut (max + equal: AVX2 has no unsigned compare).
inline __m256i codes_of_keys(const Q8Buckets &bk, __m256i xb, __m256i ac, __m256i kw) {
    const __m256i shift = _mm256_and_si256(kw, _mm256_set1_epi32(31));
    const __m256i b = _mm256_add_epi32(_mm256_srlv_epi32(ac, shift), _mm256_srai_epi32(kw, 5));
    const __m256i w = lookup8(reinterpret_cast<const int32_t *>(bk.word), b);
    const __m256i rel = _mm256_sllv_epi32(_mm256_xor_si256(xb, _mm256_srai_epi32(xb, 31)),
                                          _mm256_sub_epi32(_mm256_set1_epi32(32), shift));
    const __m256i cut = _mm256_andnot_si256(_mm256_set1_epi32(0xFF), w);
    const __m256i up = _mm256_cmpeq_epi32(_mm256_max_epu32(rel, cut), rel);  // rel >= cut: -1
    return _mm256_sub_epi32(w, up);
}

// 8 codes by the bucket table ([Note: bucketed encoder] in q8_buckets.h): the key looked up,
// then codes_of_keys (quant_scalar.h's q8_code_bucket lane-wise; the low byte is the code).
inline __m256i bucket_codes(const Q8Buckets &bk, __m256 xn) {
    const __m256i xb = _mm256_castps_si256(xn), ac = held_magnitude(xb);
    const __m256i ki = _mm256_add_epi32(_mm256_sub_epi32(_mm256_srli_epi32(ac, 23), _mm256_set1_epi32(96)),
                                        _mm256_slli_epi32(_mm256_srli_epi32(xb, 31), 5));
    return codes_of_keys(bk, xb, ac, lookup8(bk.key, ki));
}

// The shared table's 32 positive keys in 4 registers ([Note: sign-shared keys] in
// q8_buckets.h) and the step to a negative key.
struct Q8SharedKeys {
    __m256i k[4], neg;
    explicit Q8SharedKeys(const Q8Buckets &b) {
        for (int j = 0; j < 4; ++j) k[j] = _mm256_load_si256(reinterpret_cast<const __m256i *>(b.key + 8 * j));
        neg = _mm256_set1_epi32(b.neg_key);
    }
};

inline __m256i blend_by_sign(__m256i a, __m256i b, __m256i sign) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b),
                                                _mm256_castsi256_ps(sign)));
}

// bucket_codes over the shared table: the key permuted out of 4 registers by the exponent
// (bits 0-2 by the permute, bits 3 and 4 by blends), plus neg_key where xn < 0; the same
// words, so the same codes.
inline __m256i shared_bucket_codes(const Q8Buckets &bk, const Q8SharedKeys &keys, __m256 xn) {
    const __m256i xb = _mm256_castps_si256(xn), ac = held_magnitude(xb);
    const __m256i e = _mm256_srli_epi32(ac, 23);  // 96..127: the permute reads its low 3 bits
    const __m256i b3 = _mm256_slli_epi32(e, 28), b4 = _mm256_slli_epi32(e, 27);
    const __m256i lo = blend_by_sign(_mm256_permutevar8x32_epi32(keys.k[0], e),
                                     _mm256_permutevar8x32_epi32(keys.k[1], e), b3);
    const __m256i hi = blend_by_sign(_mm256_permutevar8x32_epi32(keys.k[2], e),
                                     _mm256_permutevar8x32_epi32(keys.k[3], e), b3);
    const __m256i kw = _mm256_add_epi32(blend_by_sign(lo, hi, b4),
                                        _mm256_and_si256(_mm256_srai_epi32(xb, 31), keys.neg));
    return codes_of_keys(bk, xb, ac, kw);
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
    if (t.shared) {
        const Q8SharedKeys keys(*t.shared);
        const __m256i low = _mm256_set1_epi32(0xFF), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (; i + 32 <= len; i += 32) {
            // 32 codes packed at once: the packs work per 128-bit lane, the permute restores
            // the order
            __m256i c[4];
            for (int j = 0; j < 4; ++j)
                c[j] = _mm256_and_si256(shared_bucket_codes(*t.shared, keys, q8_norm8(x + i + 8 * j, a, root)), low);
            const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(codes + i), _mm256_permutevar8x32_epi32(bytes, order));
        }
        for (; i + 8 <= len; i += 8) {
            const __m256 xn = q8_norm8(x + i, a, root);
            _mm_storel_epi64(reinterpret_cast<__m128i *>(codes + i),
                             low_bytes(shared_bucket_codes(*t.shared, keys, xn)));
        }
        return q8_codes_scalar(x + i, len - i, absmax, t, codes + i);
    }
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

#endif
