// Internal interface between dispatch.cpp and the per-ISA translation units.
//
// Each ISA unit (adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp) is compiled with its own
// flags. Only the plain structs and the entry points below cross unit boundaries; every
// helper lives in an anonymous namespace inside its unit, so the linker can never merge an
// AVX-512-compiled inline function into the scalar path (the ODR trap of per-ISA builds).
#ifndef OFFLOAD_KERNEL_H
#define OFFLOAD_KERNEL_H

#include <stdint.h>

#include "offload_native.h"

namespace offload {

// [Note: software prefetch] The SIMD units' streaming loops (adam_loop.h, rule_loop.h, the
// AVX-512 unit's fused bf16 Adam) ask for each stream's cache line kPrefetchAhead elements
// ahead, once per 16 elements. Where the loop body is heavy (bf16 conversions, the stochastic
// hash) the out-of-order window fills with arithmetic and too few loads are in flight for
// one core to reach its memory bandwidth; the hardware prefetchers of the Intel Xeon
// (Sapphire Rapids, 2 vCPUs) measured here did not make up for it. There, 100M elements, one
// thread: AdamW over bf16 moments 127-142 -> 104-112 ms, fp32 Adam 141-150 -> 132-135 ms,
// SGD / Adagrad / Lion ~8 % faster. On an AMD EPYC (Zen 4, 2 vCPUs; twenty-eighth session,
// two builds alternated in one process, 100M elements) the same prefetches made fp32 AdamW
// 15-30 % slower on one thread and 8-15 % on two, bf16 moments 2-6 %: there the hardware
// prefetchers keep up, and the extra requests only compete with them. So the loops prefetch
// where the step asks (offload_step_args.prefetch), by default on Intel CPUs only
// (dispatch.cpp). A prefetch never faults and changes no value; past the range's end it is
// not issued.
constexpr int64_t kPrefetchAhead = 512;
inline void prefetch_read(const void *p, int64_t byte_offset) {
    __builtin_prefetch(static_cast<const char *>(p) + byte_offset, 0, 3);
}
inline void prefetch_write(const void *p, int64_t byte_offset) {
    __builtin_prefetch(static_cast<const char *>(p) + byte_offset, 1, 3);
}
inline int64_t grad_bytes(int grad_dtype) { return grad_dtype == OFFLOAD_F32 ? 4 : 2; }

// Scalars of one step, already rounded to float the way torch rounds its Python scalars
// (folded once, in offload/kernels/adam_consts.py; dispatch.cpp copies them from the C face).
struct AdamConsts {
    float grad_scale;    // grad multiplier, negated when maximize
    float l2;            // weight decay folded into the grad (Adam), used when use_l2
    float decay;         // 1 - lr*wd (AdamW), 1 otherwise
    float lerp_coeff;    // torch lerp: w = 1-beta1 if w < 0.5 else w - 1
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;      // sqrt(1 - beta2^step) (1 without bias correction; see below)
    float eps;
    float neg_step_size; // -lr / (1 - beta1^step)
    bool use_l2;
    bool lerp_from_end;  // torch lerp base: end (grad) when w >= 0.5, else start (exp_avg)
};

// [Note: a bias correction of one]
// Adam's denominator is sqrt(v) / bc2_sqrt + eps, and bc2_sqrt, rounded to float, is exactly
// 1 once beta2^step < ~2^-25: after 16,628 steps with beta2 = 0.999, 325 with 0.95 (the
// usual LLM setting), and always without bias correction. x / 1.0f is x for every float
// (NaN, inf and -0 included; a square root is never subnormal, so not even flush-to-zero
// modes differ), so the units skip that division then, with the same bits as torch's. It
// was one of three divider operations per element: measured on Zen 4 (twenty-ninth
// session), a cache-resident fp32 step ~30 % faster, int8 states 3-6 %, bf16 states ~3 %;
// fp32 states in memory are bound by the bandwidth and gain nothing.
inline bool bias_correction_one(float bc2_sqrt) { return bc2_sqrt == 1.0f; }

struct AdamBuffers {
    float *param;
    const void *grad;
    float *exp_avg;
    float *exp_avg_sq;
    void *lowp;
    int grad_dtype;
    int lowp_dtype;  // -1: no lowp copy
    // Nonzero: write the lowp copy with non-temporal stores (see [Note: streamed lowp copy]
    // in dispatch.cpp). A hint only: the scalar unit ignores it, and the values are the same.
    int stream_lowp;
    int prefetch;  // nonzero: software prefetch ([Note: software prefetch]); a hint as well
};

// Update elements [begin, end). Returns 0 or -EINVAL for an unknown dtype.
int adam_range_scalar(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end);
int adam_range_avx2(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end);
int adam_range_avx512(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end);

// The arrays of a rule of rule_loop.h (SGD, Adagrad, Lion: at most one state; AMSGrad: three).
struct RuleBuffers {
    float *param;
    const void *grad;
    float *state;  // the rule's first state; NULL for SGD without momentum
    void *lowp;
    int grad_dtype;
    int lowp_dtype;   // -1: no lowp copy
    int stream_lowp;  // as in AdamBuffers
    float *state1 = nullptr;  // AMSGrad's exp_avg_sq
    float *state2 = nullptr;  // AMSGrad's max_exp_avg_sq
    int prefetch = 0;         // as in AdamBuffers
};

// Update elements [begin, end) by the rule's step. Returns 0 or -EINVAL (unknown dtype or
// mode).
int sgd_range_scalar(const offload_sgd_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int sgd_range_avx2(const offload_sgd_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int sgd_range_avx512(const offload_sgd_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int adagrad_range_scalar(const offload_adagrad_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int adagrad_range_avx2(const offload_adagrad_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int adagrad_range_avx512(const offload_adagrad_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int lion_range_scalar(const offload_lion_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int lion_range_avx2(const offload_lion_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int lion_range_avx512(const offload_lion_consts &c, const RuleBuffers &b, int64_t begin, int64_t end);

// AMSGrad: Adam's scalars, states exp_avg, exp_avg_sq, max_exp_avg_sq in state, state1, state2.
int amsgrad_range_scalar(const AdamConsts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int amsgrad_range_avx2(const AdamConsts &c, const RuleBuffers &b, int64_t begin, int64_t end);
int amsgrad_range_avx512(const AdamConsts &c, const RuleBuffers &b, int64_t begin, int64_t end);

// Sum of squares of float(grad[begin..end)) in double.
int sumsq_range_scalar(const void *grad, int dtype, int64_t begin, int64_t end, double *out);
int sumsq_range_avx2(const void *grad, int dtype, int64_t begin, int64_t end, double *out);
int sumsq_range_avx512(const void *grad, int dtype, int64_t begin, int64_t end, double *out);

// ---- compressed states (ABI 3): the fused tile loop of each unit (compressed_tile.h).

// The per-array random streams of stochastic bf16 rounding: quant.STREAMS (param, then states
// 0..3); a test holds the two to the same bits. Array k (0: param, 1 + s: state s) hashes
// with stream_key(seed, k) and takes the half of the hash at stream_shift(k) (quant.py's
// stream_key / stream_shift: a pair of states shares one hash, top half and low half).
constexpr uint32_t kStreams[1 + OFFLOAD_MAX_STATES] = {0x00000000u, 0x68E31DA4u, 0xB5297A4Du,
                                                       0x1B56C4E9u, 0x3C6EF372u};
constexpr uint32_t stream_key(uint32_t seed, int k) {
    return seed ^ kStreams[k == 0 ? 0 : 1 + ((k - 1) & ~1)];
}
constexpr int stream_shift(int k) { return k > 0 && ((k - 1) & 1) ? 0 : 16; }
constexpr int64_t kTile = OFFLOAD_Q8_BLOCK;  // elements decoded into L1 buffers at a time

// A Q8 state's tables: the decode map and the 255 midpoints as an implicit binary search
// tree (Eytzinger order: tree[1] the root, children of node j at 2j and 2j + 1; tree[0]
// unused), so a code is 8 steps of idx = 2 * idx + (tree[idx] < xn), minus 256.
struct Q8Tables {
    const float *map;   // [256]
    const uint16_t *halves;  // [512]: the low 16 bits of map[0..255], then the high 16 bits
    const float *tree;  // [256]
    uint8_t zero_code;  // the code whose map value is 0
    const struct Q8Buckets *buckets;  // nullptr: the map does not fit (search the tree)
    const uint8_t (*map_bytes)[256];  // [4][256]: byte j of map[code] in plane j (VBMI unit)
    const struct Q8Vbmi *vbmi;  // nullptr: the buckets do not fit the VBMI unit's tables
    bool sqrt_code;  // Q8U: the code is of sqrt(max(x / absmax, 0)), map[] holds the squared
                     // levels ([Note: square-root code] in quant.py)
    const struct Q8Buckets *shared;  // the bucket table with sign-shared keys (the AVX2
                                     // unit's, [Note: sign-shared keys]), or nullptr
};

// The bucket table of a map ([Note: bucketed encoder] in q8_buckets.h, which builds it).
constexpr uint32_t kQ8Buckets = 1024;
struct Q8Buckets {
    alignas(64) int32_t key[64];  // sign * 32 + max(exponent, 96) - 96 -> first << 5 | shift
    uint32_t word[kQ8Buckets];    // cut << (9 + mantissa bits) | base
    int32_t neg_key;  // key[32 + k] - key[k] for every k ([Note: sign-shared keys]), else -1
    bool ok;
};

// The VBMI unit's form of the bucket table ([Note: VBMI encoder] in q8_avx512vbmi.cpp):
// byte and 16-bit tables that live in registers, read by permutes instead of gathers.
constexpr uint32_t kQ8VbmiBuckets = 512;
struct Q8Vbmi {
    alignas(64) uint8_t mid[4][256];           // byte j of mid[code] in plane j; mid[255] = +inf
    alignas(64) uint8_t base[kQ8VbmiBuckets];  // bucket -> #{i : mid[i] < its lowest float}
    alignas(64) uint16_t shift[64];            // key -> 7 - mantissa bits (negative keys first)
    alignas(64) uint16_t off[64];              // key -> first bucket - (exponent << bits)
    bool ok;
};

// One array of a compressed step: data, OFFLOAD_* dtype, OFFLOAD_ROUND_* for BF16.
struct QArray {
    void *data;
    int dtype;
    int rounding;
};

struct CompressedStep {
    int rule;                        // OFFLOAD_RULE_*
    int num_states;
    offload_rule_consts consts;      // SGD / Adagrad / Lion
    AdamConsts adam;                 // Adam, converted once
    QArray param;                    // F32 or BF16 (then lowp is NULL)
    const void *grad;
    int grad_dtype;
    void *lowp;
    int lowp_dtype;                  // -1: none
    QArray states[OFFLOAD_MAX_STATES];
    Q8Tables q8[OFFLOAD_MAX_STATES]; // Q8S / Q8U states only
    int64_t offset;                  // random stream index of element 0
    uint32_t seed;
    int prefetch;                    // as in AdamBuffers (the fused bf16 Adam loop's)
};

// AdamW over two BF16 states in one loop ([Note: fused bf16 Adam] in adam_avx512.cpp): the
// step's arrays and rounding, copied out of the CompressedStep once per call (stores through
// the arrays could otherwise alias its fields, and the loop would reload them).
struct Bf16AdamStep {
    void *__restrict param;
    const void *__restrict grad;
    uint16_t *__restrict m;
    uint16_t *__restrict v;
    void *__restrict lowp;
    bool sp, sm, sv;           // stochastic: param (when bf16), exp_avg, exp_avg_sq
    uint32_t kp, kmv;          // stream keys: the param's; the moments' (one hash, two halves)
    uint32_t offset;           // stream index of element 0, mod 2**32
    bool prefetch;
    explicit Bf16AdamStep(const CompressedStep &s)
        : param(s.param.data), grad(s.grad), m(static_cast<uint16_t *>(s.states[0].data)),
          v(static_cast<uint16_t *>(s.states[1].data)), lowp(s.lowp),
          sp(s.param.rounding == OFFLOAD_ROUND_STOCHASTIC),
          sm(s.states[0].rounding == OFFLOAD_ROUND_STOCHASTIC),
          sv(s.states[1].rounding == OFFLOAD_ROUND_STOCHASTIC),
          kp(stream_key(s.seed, 0)), kmv(stream_key(s.seed, 1)),
          offset(static_cast<uint32_t>(static_cast<uint64_t>(s.offset))), prefetch(s.prefetch != 0) {}
};

// Elements [begin, end) of a compressed step, begin a multiple of kTile. Returns 0 or -EINVAL.
int compressed_range_scalar(const CompressedStep &s, int64_t begin, int64_t end);
int compressed_range_avx2(const CompressedStep &s, int64_t begin, int64_t end);
int compressed_range_avx512(const CompressedStep &s, int64_t begin, int64_t end);
// The AVX-512 unit's compressed step with VBMI byte permutes (q8_avx512vbmi.cpp): only for
// steps whose every Q8 state has its Q8Tables::vbmi; the rules are the AVX-512 unit's.
int compressed_range_avx512vbmi(const CompressedStep &s, int64_t begin, int64_t end);

}  // namespace offload

#endif
