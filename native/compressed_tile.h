// The fused step of compressed states (ABI 3), written once over a unit's primitives.
//
// [Note: fused tiles]
// A unit's range is walked in tiles of kTile (256) elements on the block grid of the call
// (element 0 starts block 0; dispatch.cpp hands out ranges that start at multiples of
// kTile). Per tile: each BF16 / Q8 state and a BF16 param is decoded into a stack buffer
// (5 x 1 KiB: stays in L1), the unit's own float32 rule loop (adam_range_<isa>, ...) runs
// on the tile with F32 arrays in place, then every decoded array is encoded back (Q8: new
// absmax, codes; BF16: nearest even or stochastic). No full-size float32 buffer exists. As
// the float32 loops treat each element alike wherever it sits, the result equals
// compressed_ref.compose_step around the same unit's float32 step, bit for bit.
//
// Include it *inside* a unit's anonymous namespace after the unit has defined (its own
// instruction set; any len in [1, kTile]):
//   void q8_decode(const uint8_t *codes, float absmax, const Q8Tables &t, float *out, int64_t len);
//   uint32_t abs_bits_max(const float *x, int64_t len);   (quant_scalar.h's meaning)
//   void q8_codes(const float *x, int64_t len, float absmax, const Q8Tables &t, uint8_t *codes);
//     (quant_scalar.h's q8_norm of each value: square roots where t.sqrt_code)
//   void bf16_load(const uint16_t *src, float *out, int64_t len);
//   void bf16_nearest(const float *x, uint16_t *dst, int64_t len);
//   void bf16_stochastic_store(const float *x, uint16_t *dst, int64_t len, uint32_t start,
//                              uint32_t key, int shift);  (kernel.h's stream_key, stream_shift)
// and, optionally, OFFLOAD_FUSED_BF16_ADAM with
//   template <int G, int L, bool L2, bool FROM_END, bool PB16>
//   int64_t adam_bf16_loop(const CompressedStep &s, int64_t begin, int64_t end);
// (AdamW whose two states are BF16, in one loop, the tiles' bits: returns the end of what
// it did, from begin on; the tiles do the rest).
// then expand OFFLOAD_COMPRESSED_ENTRY_POINT(ISA) (or _OVER, below) at file scope.

struct RuleFns {
    int (*adam)(const AdamConsts &, const AdamBuffers &, int64_t, int64_t);
    int (*sgd)(const offload_sgd_consts &, const RuleBuffers &, int64_t, int64_t);
    int (*adagrad)(const offload_adagrad_consts &, const RuleBuffers &, int64_t, int64_t);
    int (*lion)(const offload_lion_consts &, const RuleBuffers &, int64_t, int64_t);
    int (*amsgrad)(const AdamConsts &, const RuleBuffers &, int64_t, int64_t);
};

// One packed block (quant.encode_blocks) of the len live values x.
inline void q8_encode_block(const float *x, int64_t len, const Q8Tables &t, uint8_t *blk) {
    const uint32_t mx = abs_bits_max(x, len);
    uint32_t absmax_bits = mx;
    if (mx >= 0x7F800000u) {
        absmax_bits = 0x7FC00000u;  // a NaN or inf in the block: NaN, as float("nan")
        memset(blk, t.zero_code, kTile);
    } else if (mx == 0) {
        memset(blk, t.zero_code, kTile);
    } else {
        q8_codes(x, len, bits_f32(mx), t, blk);  // (of square roots where t.sqrt_code)
        memset(blk + len, t.zero_code, kTile - len);  // padding: the zero code
    }
    memcpy(blk + kTile, &absmax_bits, 4);
}

inline float *decode_state(const CompressedStep &s, int k, int64_t t0, int64_t len, float *buf) {
    const QArray &a = s.states[k];
    if (a.dtype == OFFLOAD_F32) return static_cast<float *>(a.data) + t0;
    if (a.dtype == OFFLOAD_BF16) {
        bf16_load(static_cast<const uint16_t *>(a.data) + t0, buf, len);
    } else {
        const uint8_t *blk = static_cast<const uint8_t *>(a.data) + (t0 / kTile) * OFFLOAD_Q8_PACKED;
        float absmax;
        memcpy(&absmax, blk + kTile, 4);
        q8_decode(blk, absmax, s.q8[k], buf, len);
    }
    return buf;
}

// Array k's (0: param, 1 + s: state s) bf16 copy of x.
inline void store_bf16(const float *x, uint16_t *dst, int64_t len, int rounding, uint32_t start,
                       uint32_t seed, int k) {
    if (rounding == OFFLOAD_ROUND_STOCHASTIC)
        bf16_stochastic_store(x, dst, len, start, stream_key(seed, k), stream_shift(k));
    else bf16_nearest(x, dst, len);
}

inline void encode_state(const CompressedStep &s, int k, int64_t t0, int64_t len, const float *buf) {
    const QArray &a = s.states[k];
    if (a.dtype == OFFLOAD_F32) return;  // updated in place
    const uint32_t start = static_cast<uint32_t>(static_cast<uint64_t>(s.offset + t0));
    if (a.dtype == OFFLOAD_BF16) {
        store_bf16(buf, static_cast<uint16_t *>(a.data) + t0, len, a.rounding, start, s.seed, 1 + k);
    } else {
        q8_encode_block(buf, len, s.q8[k],
                        static_cast<uint8_t *>(a.data) + (t0 / kTile) * OFFLOAD_Q8_PACKED);
    }
}

inline bool is_q8(int dtype) { return dtype == OFFLOAD_Q8S || dtype == OFFLOAD_Q8U; }

inline uint8_t *q8_block(const CompressedStep &s, int k, int64_t t0) {
    return static_cast<uint8_t *>(s.states[k].data) + (t0 / kTile) * OFFLOAD_Q8_PACKED;
}

#ifdef OFFLOAD_FUSED_BF16_ADAM
// The unit's adam_bf16_loop<G, L, L2, FROM_END, PB16>(s, begin, end) for the step's dtypes
// and flags; returns where it stopped, or -EINVAL.
template <int G, int L, bool PB16>
int64_t adam_bf16_flags(const CompressedStep &s, int64_t begin, int64_t end) {
    if (s.adam.use_l2) {
        if (s.adam.lerp_from_end) return adam_bf16_loop<G, L, true, true, PB16>(s, begin, end);
        return adam_bf16_loop<G, L, true, false, PB16>(s, begin, end);
    }
    if (s.adam.lerp_from_end) return adam_bf16_loop<G, L, false, true, PB16>(s, begin, end);
    return adam_bf16_loop<G, L, false, false, PB16>(s, begin, end);
}

template <int G>
int64_t adam_bf16_lowp(const CompressedStep &s, int64_t begin, int64_t end) {
    if (s.param.dtype == OFFLOAD_BF16) {
        if (s.lowp) return -EINVAL;  // a bf16 param is its own copy (kernel.h)
        return adam_bf16_flags<G, -1, true>(s, begin, end);
    }
    switch (s.lowp ? s.lowp_dtype : -1) {
        case -1: return adam_bf16_flags<G, -1, false>(s, begin, end);
        case OFFLOAD_F16: return adam_bf16_flags<G, OFFLOAD_F16, false>(s, begin, end);
        case OFFLOAD_BF16: return adam_bf16_flags<G, OFFLOAD_BF16, false>(s, begin, end);
        default: return -EINVAL;
    }
}

inline int64_t adam_bf16_states(const CompressedStep &s, int64_t begin, int64_t end) {
    switch (s.grad_dtype) {
        case OFFLOAD_F32: return adam_bf16_lowp<OFFLOAD_F32>(s, begin, end);
        case OFFLOAD_F16: return adam_bf16_lowp<OFFLOAD_F16>(s, begin, end);
        case OFFLOAD_BF16: return adam_bf16_lowp<OFFLOAD_BF16>(s, begin, end);
        default: return -EINVAL;
    }
}
#endif

// Every state of the tile written back. A unit that defines OFFLOAD_Q8_PAIR (the VBMI unit)
// may encode two neighbouring Q8 states in one loop:
//   bool q8_encode_pair(const float *x0, const float *x1, int64_t len, const Q8Tables &t0,
//                       const Q8Tables &t1, uint8_t *blk0, uint8_t *blk1);
// (q8_encode_block's bytes for both, or false having written nothing).
inline void encode_states(const CompressedStep &s, int64_t t0, int64_t len, float *const *st) {
    for (int k = 0; k < s.num_states; ++k) {
#ifdef OFFLOAD_Q8_PAIR
        if (k + 1 < s.num_states && is_q8(s.states[k].dtype) && is_q8(s.states[k + 1].dtype) &&
            q8_encode_pair(st[k], st[k + 1], len, s.q8[k], s.q8[k + 1], q8_block(s, k, t0),
                           q8_block(s, k + 1, t0))) {
            ++k;
            continue;
        }
#endif
        encode_state(s, k, t0, len, st[k]);
    }
}

// The unit's float32 rule over the tile's len elements (arrays already offset to the tile).
inline int tile_rule(const CompressedStep &s, const RuleFns &f, float *p, const void *g,
                     float *const *st, void *lowp, int64_t len) {
    if (s.rule == OFFLOAD_RULE_ADAM) {
        const AdamBuffers b{p, g, st[0], st[1], lowp, s.grad_dtype, s.lowp_dtype, 0};
        return f.adam(s.adam, b, 0, len);
    }
    if (s.rule == OFFLOAD_RULE_ADAM_AMSGRAD) {
        const RuleBuffers b{p, g, st[0], lowp, s.grad_dtype, s.lowp_dtype, 0, st[1], st[2]};
        return f.amsgrad(s.adam, b, 0, len);
    }
    const RuleBuffers b{p, g, s.num_states ? st[0] : nullptr, lowp, s.grad_dtype, s.lowp_dtype, 0};
    switch (s.rule) {
        case OFFLOAD_RULE_SGD: return f.sgd(s.consts.sgd, b, 0, len);
        case OFFLOAD_RULE_ADAGRAD: return f.adagrad(s.consts.adagrad, b, 0, len);
        case OFFLOAD_RULE_LION: return f.lion(s.consts.lion, b, 0, len);
        default: return -EINVAL;
    }
}

inline int compressed_tiles(const CompressedStep &s, const RuleFns &f, int64_t begin, int64_t end) {
#ifdef OFFLOAD_FUSED_BF16_ADAM
    // The unit's one-loop AdamW over bf16 moments ([Note: fused bf16 Adam] in
    // adam_avx512.cpp); what it leaves (a unit without masked stores: the last partial
    // vector) goes through the tiles below, element for element the same arithmetic.
    if (s.rule == OFFLOAD_RULE_ADAM && s.num_states == 2 && s.states[0].dtype == OFFLOAD_BF16 &&
        s.states[1].dtype == OFFLOAD_BF16) {
        const int64_t done = adam_bf16_states(s, begin, end);
        if (done < 0) return static_cast<int>(done);
        begin = done;
    }
#endif
    alignas(64) float pbuf[kTile];
    alignas(64) float sbuf[OFFLOAD_MAX_STATES][kTile];
    const bool bf16_param = s.param.dtype == OFFLOAD_BF16;
    const size_t gsz = s.grad_dtype == OFFLOAD_F32 ? 4 : 2;
#ifdef OFFLOAD_FUSED_Q8_ADAM
    // the unit's whole-tile AdamW over two int8 states ([Note: fused int8 Adam tile] in
    // q8_avx512vbmi.cpp); a partial last tile goes the common way below
    const auto q8_tile = adam_q8_tiles(s);
#endif
    for (int64_t t0 = begin; t0 < end; t0 += kTile) {
        const int64_t len = end - t0 < kTile ? end - t0 : kTile;
#ifdef OFFLOAD_FUSED_Q8_ADAM
        if (q8_tile != nullptr && len == kTile) {
            if (!q8_tile(s, t0, sbuf[0], sbuf[1])) {
                float *st[OFFLOAD_MAX_STATES] = {sbuf[0], sbuf[1]};
                encode_states(s, t0, len, st);
            }
            continue;
        }
#endif
        float *p = pbuf;
        if (bf16_param) bf16_load(static_cast<const uint16_t *>(s.param.data) + t0, pbuf, len);
        else p = static_cast<float *>(s.param.data) + t0;  // updated in place
        float *st[OFFLOAD_MAX_STATES] = {};
        for (int k = 0; k < s.num_states; ++k) st[k] = decode_state(s, k, t0, len, sbuf[k]);
        const void *g = static_cast<const char *>(s.grad) + t0 * gsz;
        void *lowp = s.lowp ? static_cast<void *>(static_cast<uint16_t *>(s.lowp) + t0) : nullptr;
        const int rc = tile_rule(s, f, p, g, st, lowp, len);
        if (rc != 0) return rc;
        encode_states(s, t0, len, st);
        if (bf16_param) {
            const uint32_t start = static_cast<uint32_t>(static_cast<uint64_t>(s.offset + t0));
            store_bf16(pbuf, static_cast<uint16_t *>(s.param.data) + t0, len, s.param.rounding,
                       start, s.seed, 0);
        }
    }
    return 0;
}

// compressed_range_<NAME> over the float32 rules of unit RULES (a unit of its own flags
// may reuse another unit's rules: q8_avx512vbmi.cpp runs the AVX-512 unit's).
#define OFFLOAD_COMPRESSED_ENTRY_POINT_OVER(NAME, RULES)                                    \
    namespace offload {                                                                     \
    int compressed_range_##NAME(const CompressedStep &s, int64_t begin, int64_t end) {      \
        static const RuleFns fns{adam_range_##RULES, sgd_range_##RULES,                     \
                                 adagrad_range_##RULES, lion_range_##RULES,                 \
                                 amsgrad_range_##RULES};                                    \
        return compressed_tiles(s, fns, begin, end);                                        \
    }                                                                                       \
    }
#define OFFLOAD_COMPRESSED_ENTRY_POINT(ISA) OFFLOAD_COMPRESSED_ENTRY_POINT_OVER(ISA, ISA)
