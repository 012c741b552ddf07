// Entry points of the native library: argument checks, ISA selection, thread split.
//
// Compiled with baseline x86-64 flags only: this unit runs on every CPU and decides at run
// time (__builtin_cpu_supports / cpuid) which ISA unit may run.
#include <atomic>
#include <cerrno>
#include <memory>
#include <cmath>
#include <cpuid.h>
#include <cstring>
#include <thread>
#include <vector>

#include "kernel.h"
#include "offload_native.h"
#include "q8_tables.h"

namespace {

using namespace offload;

// Below this many elements per thread, spawning a thread (~20-50 us) costs more than it
// saves (at ~1 G elements/s a thread does 64 K elements in ~60 us).
constexpr int64_t kMinPerThread = 1 << 16;

bool has_f16c() {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    return (c & bit_F16C) != 0;
}

// AVX512_VBMI: CPUID leaf 7, ECX bit 1 (read directly: older compilers' __builtin_cpu_supports
// may not know the name; __get_cpuid_count needs GCC 7 or later, __cpuid_count does not).
bool has_vbmi() {
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    unsigned a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    return (c & (1u << 1)) != 0;
}

bool probe_isa(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case OFFLOAD_ISA_SCALAR:
            return true;
        case OFFLOAD_ISA_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
        case OFFLOAD_ISA_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("fma") && has_f16c();
        case OFFLOAD_ISA_AVX512VBMI:
            return probe_isa(OFFLOAD_ISA_AVX512) && has_vbmi();
        default:
            return false;
    }
}

// The CPU's features, probed once: CPUID traps to the hypervisor in a VM (~20 us per
// call measured here), too slow to repeat on every kernel call. This is a fact about the
// machine, not state carried between steps.
struct IsaTable {
    bool ok[OFFLOAD_ISA_AVX512VBMI + 1];
    IsaTable() {
        for (int i = 0; i <= OFFLOAD_ISA_AVX512VBMI; ++i) ok[i] = probe_isa(i);
    }
};

bool isa_supported(int isa) {
    static const IsaTable table;  // thread-safe one-time init (C++11 magic statics)
    return isa >= OFFLOAD_ISA_SCALAR && isa <= OFFLOAD_ISA_AVX512VBMI && table.ok[isa];
}

int isa_best() {
    if (isa_supported(OFFLOAD_ISA_AVX512VBMI)) return OFFLOAD_ISA_AVX512VBMI;
    if (isa_supported(OFFLOAD_ISA_AVX512)) return OFFLOAD_ISA_AVX512;
    if (isa_supported(OFFLOAD_ISA_AVX2)) return OFFLOAD_ISA_AVX2;
    return OFFLOAD_ISA_SCALAR;
}

// -ENOTSUP for an ISA the CPU lacks, -EINVAL for an unknown code; else the ISA to run.
int resolve_isa(int isa) {
    if (isa == OFFLOAD_ISA_BEST) return isa_best();
    if (isa < OFFLOAD_ISA_SCALAR || isa > OFFLOAD_ISA_AVX512VBMI) return -EINVAL;
    return isa_supported(isa) ? isa : -ENOTSUP;
}

// The unit that runs float32 steps and sums of squares at a level: VBMI adds only the int8
// encoder and decoder of compressed steps (q8_avx512vbmi.cpp).
int unit_isa(int isa) { return isa == OFFLOAD_ISA_AVX512VBMI ? OFFLOAD_ISA_AVX512 : isa; }

bool valid_dtype(int dtype) { return dtype == OFFLOAD_F32 || dtype == OFFLOAD_F16 || dtype == OFFLOAD_BF16; }

// Work is cut into fixed blocks that threads claim from a shared counter, rather than one
// static range per thread: on a shared machine (or beside the I/O threads of the swap
// pipeline) a slow or descheduled thread then delays one block, not half the step. The blocks do
// not depend on the thread count, so per-block results (sum of squares) combine in the
// same order whatever the thread count: results are reproducible.
#ifndef OFFLOAD_BLOCK_ELEMS
#define OFFLOAD_BLOCK_ELEMS (1 << 16)
#endif
constexpr int64_t kBlock = OFFLOAD_BLOCK_ELEMS;
// compressed steps cut ranges on the Q8 block grid ([Note: fused tiles] in compressed_tile.h)
static_assert(kBlock % kTile == 0, "OFFLOAD_BLOCK_ELEMS must be a multiple of 256");

// [Note: streamed lowp copy]
// The step reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg, exp_avg_sq
// back into the lines it read, plus the fp16/bf16 copy. An ordinary store to the copy first
// reads its line from memory (read for ownership), so a bf16 step reads 4 + 2 + 4 + 4 + 2
// = 16 B per element, exactly what an fp32-grad step without a copy reads; on this VM the
// step is bound by reads (~33 GB/s for 2 cores, with writes going alongside), so that RFO
// made the bf16 step as slow as the fp32 one. Non-temporal stores skip the read: 14 B.
// Measured here, 100M elements, 2 threads, interleaved in one process: bf16 grad + bf16
// copy 1.067x / 1.075x the fp32-grad step with ordinary stores, 0.999x / 1.031x streamed.
// They also bypass the caches, so the copy is streamed only when it is larger than a core's
// L2 (1 MiB here) - a copy that small may still be in cache when the next forward reads it,
// a larger one is evicted before that anyway (and on the device path the copy goes to a
// staging buffer the DMA engine reads). The SIMD units peel up to one vector so that the
// streamed stores are aligned, and fence before returning.
constexpr int64_t kStreamLowpMin = 1 << 20;

int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Shared by the caller and its helper threads; heap-held so a helper that starts late
// (after the caller returned) touches only this, never the caller's stack.
struct BlockQueue {
    std::atomic<int64_t> next{0};
    std::atomic<int> active{0};  // helpers inside drain(): the caller waits for them
    std::atomic<int> first_error{0};
    int64_t blocks = 0;
    int64_t n = 0;
};

template <typename Fn>
void drain(BlockQueue &q, Fn &fn) {
    for (;;) {
        int64_t blk = q.next.fetch_add(1);
        if (blk >= q.blocks) return;
        int64_t begin = blk * kBlock, end = begin + kBlock < q.n ? begin + kBlock : q.n;
        int rc = fn(begin, end, blk);
        if (rc != 0) {
            int expected = 0;
            q.first_error.compare_exchange_strong(expected, rc);
        }
    }
}

// Helpers are spawned per call and detached; the caller works too and, once no block is
// left, waits only for helpers that claimed one. A helper the scheduler has not started
// yet is not waited for: on a busy machine a new thread can wait a whole scheduling
// period before its first run (measured here: 2 threads took 2x as long as 1 while the
// caller waited to join an idle helper). A late helper finds no block, so it never calls
// fn, and leaves. Ordering: a helper raises `active` before claiming (seq_cst), so a
// helper that claimed a block is counted before the caller's last failed claim.
template <typename Fn>
int parallel_blocks_impl(int64_t n, int threads, Fn &fn) {
    auto q = std::make_shared<BlockQueue>();
    q->blocks = num_blocks(n);
    q->n = n;
    Fn *fp = &fn;
    for (int t = 1; t < threads; ++t) {
        try {
            std::thread([q, fp] {
                q->active.fetch_add(1);
                drain(*q, *fp);
                q->active.fetch_sub(1);
            }).detach();
        } catch (...) {
            break;  // fewer helpers: the caller still does every block left
        }
    }
    drain(*q, fn);
    while (q->active.load() != 0) std::this_thread::yield();
    return q->first_error.load();
}

int threads_for(int64_t n, int requested) {
    int64_t by_size = n / kMinPerThread;
    int64_t t = requested < by_size ? requested : by_size;
    return t < 1 ? 1 : static_cast<int>(t);
}

// Runs fn(begin, end, block) -> int over [0, n) in kBlock blocks on `threads` threads (the
// caller is one of them). Returns the first nonzero result; never throws (the only
// allocation that can fail is the bookkeeping, reported as -ENOMEM).
template <typename Fn>
int parallel_blocks(int64_t n, int threads, Fn fn) noexcept {
    try {
        return parallel_blocks_impl(n, threads, fn);
    } catch (...) {
        return -ENOMEM;
    }
}

// The kernel's copy of the folded constants (offload/kernels/adam_consts.py folds them).
AdamConsts adam_consts(const offload_adam_consts &k) {
    AdamConsts c;
    c.grad_scale = k.grad_scale;
    c.l2 = k.l2;
    c.decay = k.decay;
    c.lerp_coeff = k.lerp_coeff;
    c.beta2 = k.beta2;
    c.one_minus_beta2 = k.one_minus_beta2;
    c.bc2_sqrt = k.bc2_sqrt;
    c.eps = k.eps;
    c.neg_step_size = k.neg_step_size;
    c.use_l2 = k.use_l2 != 0;
    c.lerp_from_end = k.lerp_from_end != 0;
    return c;
}

bool adam_args_valid(const offload_step_args &a) {
    if (a.num_states != 2 || a.param.dtype != OFFLOAD_F32 || !valid_dtype(a.grad.dtype))
        return false;
    if (a.states[0].dtype != OFFLOAD_F32 || a.states[1].dtype != OFFLOAD_F32) return false;
    return a.lowp.data == nullptr || a.lowp.dtype == OFFLOAD_F16 || a.lowp.dtype == OFFLOAD_BF16;
}

int adam_rule_step(const offload_step_args &a) {
    if (!adam_args_valid(a)) return -EINVAL;
    int run_isa = resolve_isa(a.isa);
    if (run_isa < 0) return run_isa;
    run_isa = unit_isa(run_isa);
    const int64_t n = a.n;
    if (n == 0) return 0;
    if (!a.param.data || !a.grad.data || !a.states[0].data || !a.states[1].data) return -EINVAL;
    const AdamConsts c = adam_consts(a.consts.adam);
    void *lowp = a.lowp.data;
    AdamBuffers b{static_cast<float *>(a.param.data), a.grad.data,
                  static_cast<float *>(a.states[0].data), static_cast<float *>(a.states[1].data),
                  lowp, a.grad.dtype, lowp ? a.lowp.dtype : -1, lowp && n >= kStreamLowpMin};
    auto fn = [&c, &b, run_isa](int64_t begin, int64_t end, int64_t) -> int {
        switch (run_isa) {
            case OFFLOAD_ISA_AVX512: return adam_range_avx512(c, b, begin, end);
            case OFFLOAD_ISA_AVX2: return adam_range_avx2(c, b, begin, end);
            default: return adam_range_scalar(c, b, begin, end);
        }
    };
    return parallel_blocks(n, threads_for(n, a.num_threads), fn);
}

// ---- SGD, Adagrad, Lion: one state at most (rule_loop.h in each ISA unit).

template <class C>
using RuleRange = int (*)(const C &, const RuleBuffers &, int64_t, int64_t);

template <class C>
int run_rule(const C &c, const RuleBuffers &b, int64_t n, int run_isa, int num_threads,
             RuleRange<C> avx512, RuleRange<C> avx2, RuleRange<C> scalar) {
    RuleRange<C> f = run_isa == OFFLOAD_ISA_AVX512 ? avx512
                   : run_isa == OFFLOAD_ISA_AVX2   ? avx2
                                                   : scalar;
    auto fn = [&c, &b, f](int64_t begin, int64_t end, int64_t) -> int { return f(c, b, begin, end); };
    return parallel_blocks(n, threads_for(n, num_threads), fn);
}

// ---- AMSGrad: Adam's scalars and three F32 states (rule_loop.h's AmsgradBody).
int amsgrad_rule_step(const offload_step_args &a) {
    if (a.num_states != 3 || a.param.dtype != OFFLOAD_F32 || !valid_dtype(a.grad.dtype)) return -EINVAL;
    for (int k = 0; k < 3; ++k)
        if (a.states[k].dtype != OFFLOAD_F32) return -EINVAL;
    if (a.lowp.data && a.lowp.dtype != OFFLOAD_F16 && a.lowp.dtype != OFFLOAD_BF16) return -EINVAL;
    int run_isa = resolve_isa(a.isa);
    if (run_isa < 0) return run_isa;
    if (a.n == 0) return 0;
    if (!a.param.data || !a.grad.data || !a.states[0].data || !a.states[1].data || !a.states[2].data)
        return -EINVAL;
    void *lowp = a.lowp.data;
    const RuleBuffers b{static_cast<float *>(a.param.data), a.grad.data,
                        static_cast<float *>(a.states[0].data), lowp, a.grad.dtype,
                        lowp ? a.lowp.dtype : -1, lowp && a.n >= kStreamLowpMin,
                        static_cast<float *>(a.states[1].data), static_cast<float *>(a.states[2].data)};
    return run_rule(adam_consts(a.consts.adam), b, a.n, unit_isa(run_isa), a.num_threads, amsgrad_range_avx512,
                    amsgrad_range_avx2, amsgrad_range_scalar);
}

// The states a rule reads: SGD's buffer only when its step uses momentum.
bool one_state_args_valid(const offload_step_args &a) {
    int want = 1;
    if (a.rule == OFFLOAD_RULE_SGD) {
        const int mode = a.consts.sgd.momentum_mode;
        if (mode < 0 || mode > 2) return false;
        // a step without momentum may still be handed the buffer (torch leaves it as is)
        if (mode == 0 && a.num_states == 0) want = 0;
    }
    if (a.num_states != want || a.param.dtype != OFFLOAD_F32 || !valid_dtype(a.grad.dtype))
        return false;
    if (want == 1 && a.states[0].dtype != OFFLOAD_F32) return false;
    return a.lowp.data == nullptr || a.lowp.dtype == OFFLOAD_F16 || a.lowp.dtype == OFFLOAD_BF16;
}

int one_state_rule_step(const offload_step_args &a) {
    if (!one_state_args_valid(a)) return -EINVAL;
    int run_isa = resolve_isa(a.isa);
    if (run_isa < 0) return run_isa;
    run_isa = unit_isa(run_isa);
    const int64_t n = a.n;
    if (n == 0) return 0;
    float *state = a.num_states ? static_cast<float *>(a.states[0].data) : nullptr;
    if (!a.param.data || !a.grad.data || (a.num_states && !state)) return -EINVAL;
    void *lowp = a.lowp.data;
    const RuleBuffers b{static_cast<float *>(a.param.data), a.grad.data, state, lowp,
                        a.grad.dtype, lowp ? a.lowp.dtype : -1, lowp && n >= kStreamLowpMin};
    const int t = a.num_threads;
    switch (a.rule) {
        case OFFLOAD_RULE_SGD:
            return run_rule(a.consts.sgd, b, n, run_isa, t, sgd_range_avx512, sgd_range_avx2,
                            sgd_range_scalar);
        case OFFLOAD_RULE_ADAGRAD:
            return run_rule(a.consts.adagrad, b, n, run_isa, t, adagrad_range_avx512,
                            adagrad_range_avx2, adagrad_range_scalar);
        default:
            return run_rule(a.consts.lion, b, n, run_isa, t, lion_range_avx512, lion_range_avx2,
                            lion_range_scalar);
    }
}

// ---- compressed states / a BF16 param (ABI 3): the fused tiles of compressed_tile.h.

bool is_compressed(const offload_step_args &a) {
    if (a.param.dtype != OFFLOAD_F32) return true;
    for (int k = 0; k < a.num_states && k < OFFLOAD_MAX_STATES; ++k)
        if (a.states[k].dtype != OFFLOAD_F32) return true;
    return false;
}

// How many states rule a->rule reads (SGD's buffer may be absent without momentum); -1 if
// the count or SGD's mode is invalid.
int states_wanted(const offload_step_args &a) {
    if (a.rule == OFFLOAD_RULE_ADAM) return a.num_states == 2 ? 2 : -1;
    if (a.rule == OFFLOAD_RULE_ADAM_AMSGRAD) return a.num_states == 3 ? 3 : -1;
    if (a.rule == OFFLOAD_RULE_SGD) {
        const int mode = a.consts.sgd.momentum_mode;
        if (mode < 0 || mode > 2) return -1;
        if (mode == 0 && a.num_states == 0) return 0;
    }
    return a.num_states == 1 ? 1 : -1;
}

bool valid_rounding(const offload_array &x) {
    return x.dtype != OFFLOAD_BF16 || x.rounding == OFFLOAD_ROUND_NEAREST ||
           x.rounding == OFFLOAD_ROUND_STOCHASTIC;
}

bool compressed_args_valid(const offload_step_args &a) {
    const int want = states_wanted(a);
    if (want < 0 || !valid_dtype(a.grad.dtype) || !valid_rounding(a.param)) return false;
    if (a.param.dtype != OFFLOAD_F32 && a.param.dtype != OFFLOAD_BF16) return false;
    if (a.lowp.data && (a.param.dtype == OFFLOAD_BF16 ||
                        (a.lowp.dtype != OFFLOAD_F16 && a.lowp.dtype != OFFLOAD_BF16)))
        return false;
    if (!a.param.data || !a.grad.data) return false;
    for (int k = 0; k < want; ++k) {
        const offload_array &x = a.states[k];
        if (!x.data || x.dtype < OFFLOAD_F32 || x.dtype > OFFLOAD_Q8U || x.dtype == OFFLOAD_F16 ||
            !valid_rounding(x))
            return false;
        const bool q8s = x.dtype == OFFLOAD_Q8S, q8u = x.dtype == OFFLOAD_Q8U;
        if ((q8s && (!a.quant.signed_map || !a.quant.signed_mid)) ||
            (q8u && (!a.quant.unsigned_map || !a.quant.unsigned_mid)))
            return false;
    }
    return true;
}

int fill_compressed(const offload_step_args &a, int want, Q8Built &q, CompressedStep &s) {
    const float *maps[2] = {a.quant.signed_map, a.quant.unsigned_map};
    const float *mids[2] = {a.quant.signed_mid, a.quant.unsigned_mid};
    s.rule = a.rule;
    s.num_states = want;
    s.consts = a.consts;
    if (a.rule == OFFLOAD_RULE_ADAM || a.rule == OFFLOAD_RULE_ADAM_AMSGRAD)
        s.adam = adam_consts(a.consts.adam);
    s.param = QArray{a.param.data, a.param.dtype, a.param.rounding};
    s.grad = a.grad.data;
    s.grad_dtype = a.grad.dtype;
    s.lowp = a.lowp.data;
    s.lowp_dtype = a.lowp.data ? a.lowp.dtype : -1;
    for (int k = 0; k < want; ++k) {
        const offload_array &x = a.states[k];
        s.states[k] = QArray{x.data, x.dtype, x.rounding};
        if (x.dtype != OFFLOAD_Q8S && x.dtype != OFFLOAD_Q8U) continue;
        const int m = x.dtype == OFFLOAD_Q8S ? 0 : 1;
        if (!q.tables(m, maps[m], mids[m], s.q8[k])) return -EINVAL;
    }
    s.offset = a.quant.offset;
    s.seed = a.quant.seed;
    return 0;
}

// Whether the VBMI unit runs step s: it has a Q8 state (the unit differs from the AVX-512
// one only there) and every Q8 state's map fits its tables (else the AVX-512 unit's
// encoder, whose bucket table or tree takes any sorted map, runs the step).
bool vbmi_runs(const CompressedStep &s) {
    bool q8 = false;
    for (int k = 0; k < s.num_states; ++k) {
        const int dtype = s.states[k].dtype;
        if (dtype != OFFLOAD_Q8S && dtype != OFFLOAD_Q8U) continue;
        if (s.q8[k].vbmi == nullptr) return false;
        q8 = true;
    }
    return q8;
}

int compressed_rule_step(const offload_step_args &a) {
    if (!compressed_args_valid(a)) return -EINVAL;
    int run_isa = resolve_isa(a.isa);
    if (run_isa < 0) return run_isa;
    const int64_t n = a.n;
    if (n == 0) return 0;
    Q8Built q;
    CompressedStep s{};
    int rc = fill_compressed(a, states_wanted(a), q, s);
    if (rc != 0) return rc;
    if (run_isa == OFFLOAD_ISA_AVX512VBMI && !vbmi_runs(s)) run_isa = OFFLOAD_ISA_AVX512;
    // kBlock ranges start at multiples of kTile: every thread's tiles sit on the block grid
    auto fn = [&s, run_isa](int64_t begin, int64_t end, int64_t) -> int {
        switch (run_isa) {
            case OFFLOAD_ISA_AVX512VBMI: return compressed_range_avx512vbmi(s, begin, end);
            case OFFLOAD_ISA_AVX512: return compressed_range_avx512(s, begin, end);
            case OFFLOAD_ISA_AVX2: return compressed_range_avx2(s, begin, end);
            default: return compressed_range_scalar(s, begin, end);
        }
    };
    return parallel_blocks(n, threads_for(n, a.num_threads), fn);
}

}  // namespace

extern "C" {

int offload_abi_version(void) { return 4; }

int64_t offload_step_args_size(void) { return static_cast<int64_t>(sizeof(offload_step_args)); }

int offload_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

int offload_isa_best(void) { return isa_best(); }

int offload_rule_step(const offload_step_args *a) {
    if (a == nullptr || a->n < 0 || a->num_threads < 1) return -EINVAL;
    if (a->num_states >= 0 && a->num_states <= OFFLOAD_MAX_STATES && is_compressed(*a))
        return compressed_rule_step(*a);
    switch (a->rule) {
        case OFFLOAD_RULE_ADAM: return adam_rule_step(*a);
        case OFFLOAD_RULE_ADAM_AMSGRAD: return amsgrad_rule_step(*a);
        case OFFLOAD_RULE_SGD:
        case OFFLOAD_RULE_ADAGRAD:
        case OFFLOAD_RULE_LION: return one_state_rule_step(*a);
        default: return -EINVAL;
    }
}

int offload_grad_sumsq(const void *grad, int grad_dtype, int64_t n, double *out_sumsq,
                       int *out_nonfinite, int isa, int num_threads) {
    if (n < 0 || num_threads < 1 || !valid_dtype(grad_dtype) || !out_sumsq || !out_nonfinite)
        return -EINVAL;
    int run_isa = resolve_isa(isa);
    if (run_isa < 0) return run_isa;
    run_isa = unit_isa(run_isa);
    *out_sumsq = 0.0;
    *out_nonfinite = 0;
    if (n == 0) return 0;
    if (!grad) return -EINVAL;
    // one per block, summed in block order: reproducible, as every unit's rounding depends
    // only on the block's own elements (the SIMD units' fp32 sub-blocks start at `begin`)
    std::vector<double> partial;
    try {
        partial.assign(num_blocks(n), 0.0);
    } catch (...) {
        return -ENOMEM;
    }
    auto fn = [&partial, grad, grad_dtype, run_isa](int64_t begin, int64_t end, int64_t blk) -> int {
        double *out = &partial[blk];
        switch (run_isa) {
            case OFFLOAD_ISA_AVX512: return sumsq_range_avx512(grad, grad_dtype, begin, end, out);
            case OFFLOAD_ISA_AVX2: return sumsq_range_avx2(grad, grad_dtype, begin, end, out);
            default: return sumsq_range_scalar(grad, grad_dtype, begin, end, out);
        }
    };
    int rc = parallel_blocks(n, threads_for(n, num_threads), fn);
    if (rc != 0) return rc;
    double total = 0.0;
    for (double s : partial) total += s;
    *out_sumsq = total;
    // A double sum of squares of finite fp32/fp16/bf16 values cannot overflow
    // (n * 2^256 << 2^1024), so the sum is non-finite exactly when an element is. The SIMD
    // units sum short blocks in fp32 but redo in double any block whose fp32 sum is not
    // finite ([Note: sumsq in fp32 blocks] in unit_dispatch.h), which keeps this true.
    *out_nonfinite = std::isfinite(total) ? 0 : 1;
    return 0;
}

}  // extern "C"
