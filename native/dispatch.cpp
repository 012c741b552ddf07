// Entry points of the native library: argument checks, ISA selection, thread split.
//
// Compiled with baseline x86-64 flags only: this unit runs on every CPU and decides at run
// time (machine.cpp: __builtin_cpu_supports / cpuid) which ISA unit may run.
#include <atomic>
#include <cerrno>
#include <memory>
#include <cmath>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "kernel.h"
#include "machine.h"
#include "offload_native.h"
#include "batch_alias.h"
#include "parallel.h"
#include "q8_tables.h"

namespace {

using namespace offload;

// Whether a step's loops prefetch: its OFFLOAD_PREFETCH_* asks, AUTO by the CPU's vendor;
// -1 for an unknown code.
int prefetch_of(const offload_step_args &a) {
    switch (a.prefetch) {
        case OFFLOAD_PREFETCH_AUTO: return prefers_prefetch() ? 1 : 0;
        case OFFLOAD_PREFETCH_ON: return 1;
        case OFFLOAD_PREFETCH_OFF: return 0;
        default: return -1;
    }
}

// The unit that runs float32 steps and sums of squares at a level: VBMI adds only the int8
// encoder and decoder of compressed steps (q8_avx512vbmi.cpp).
int unit_isa(int isa) { return isa == OFFLOAD_ISA_AVX512VBMI ? OFFLOAD_ISA_AVX512 : isa; }

bool valid_dtype(int dtype) { return dtype == OFFLOAD_F32 || dtype == OFFLOAD_F16 || dtype == OFFLOAD_BF16; }

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

// [Note: prepared steps]
// A step's arguments are checked and converted once, into a PreparedStep that runs over any
// range of its elements (run_range): offload_rule_step prepares one and splits it into
// kBlock blocks; offload_rule_steps prepares every struct of a batch before it runs any (a
// bad one leaves every tensor untouched) and spreads all their blocks over one set of
// threads. The same range functions run either way, on the same block grid, so a tensor
// gets the same bits alone or in a batch.
struct PreparedStep {
    enum Kind { kAdam, kAmsgrad, kSgd, kAdagrad, kLion, kCompressed };
    Kind kind = kAdam;
    int isa = OFFLOAD_ISA_SCALAR;  // the unit that runs it (VBMI for compressed steps only)
    int64_t n = 0;                 // 0: nothing to run
    AdamConsts adam{};             // kAdam, kAmsgrad
    offload_rule_consts consts{};  // kSgd, kAdagrad, kLion
    AdamBuffers ab{};              // kAdam
    RuleBuffers rb{};              // kAmsgrad, kSgd, kAdagrad, kLion
    const CompressedStep *cs = nullptr;  // kCompressed: the caller's (528 bytes: kept out of
                                         // line, a batch holds one PreparedStep per tensor)
};

int prepare_adam(const offload_step_args &a, PreparedStep &p) {
    if (!adam_args_valid(a)) return -EINVAL;
    int run_isa = resolve_isa(a.isa);
    if (run_isa < 0) return run_isa;
    const int64_t n = a.n;
    if (n == 0) return 0;
    if (!a.param.data || !a.grad.data || !a.states[0].data || !a.states[1].data) return -EINVAL;
    void *lowp = a.lowp.data;
    p.kind = PreparedStep::kAdam;
    p.isa = unit_isa(run_isa);
    p.adam = adam_consts(a.consts.adam);
    p.ab = AdamBuffers{static_cast<float *>(a.param.data), a.grad.data,
                       static_cast<float *>(a.states[0].data), static_cast<float *>(a.states[1].data),
                       lowp, a.grad.dtype, lowp ? a.lowp.dtype : -1, lowp && n >= kStreamLowpMin,
                       prefetch_of(a)};
    p.n = n;
    return 0;
}

// ---- SGD, Adagrad, Lion: one state at most (rule_loop.h in each ISA unit).

// The unit's range function of a step at ISA isa (VBMI runs compressed steps only).
template <class F>
F pick(int isa, F avx512, F avx2, F scalar) {
    return isa == OFFLOAD_ISA_AVX512 ? avx512 : isa == OFFLOAD_ISA_AVX2 ? avx2 : scalar;
}

// ---- AMSGrad: Adam's scalars and three F32 states (rule_loop.h's AmsgradBody).
int prepare_amsgrad(const offload_step_args &a, PreparedStep &p) {
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
    p.kind = PreparedStep::kAmsgrad;
    p.isa = unit_isa(run_isa);
    p.adam = adam_consts(a.consts.adam);
    p.rb = RuleBuffers{static_cast<float *>(a.param.data), a.grad.data,
                       static_cast<float *>(a.states[0].data), lowp, a.grad.dtype,
                       lowp ? a.lowp.dtype : -1, lowp && a.n >= kStreamLowpMin,
                       static_cast<float *>(a.states[1].data), static_cast<float *>(a.states[2].data),
                       prefetch_of(a)};
    p.n = a.n;
    return 0;
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

int prepare_one_state(const offload_step_args &a, PreparedStep &p) {
    if (!one_state_args_valid(a)) return -EINVAL;
    int run_isa = resolve_isa(a.isa);
    if (run_isa < 0) return run_isa;
    const int64_t n = a.n;
    if (n == 0) return 0;
    float *state = a.num_states ? static_cast<float *>(a.states[0].data) : nullptr;
    if (!a.param.data || !a.grad.data || (a.num_states && !state)) return -EINVAL;
    void *lowp = a.lowp.data;
    p.kind = a.rule == OFFLOAD_RULE_SGD       ? PreparedStep::kSgd
           : a.rule == OFFLOAD_RULE_ADAGRAD ? PreparedStep::kAdagrad
                                            : PreparedStep::kLion;
    p.isa = unit_isa(run_isa);
    p.consts = a.consts;
    p.rb = RuleBuffers{static_cast<float *>(a.param.data), a.grad.data, state, lowp,
                       a.grad.dtype, lowp ? a.lowp.dtype : -1, lowp && n >= kStreamLowpMin};
    p.rb.prefetch = prefetch_of(a);
    p.n = n;
    return 0;
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

int prepare_compressed(const offload_step_args &a, Q8Built &q, CompressedStep &cs, PreparedStep &p) {
    if (!compressed_args_valid(a)) return -EINVAL;
    int run_isa = resolve_isa(a.isa);
    if (run_isa < 0) return run_isa;
    if (a.n == 0) return 0;
    int rc = fill_compressed(a, states_wanted(a), q, cs);
    if (rc != 0) return rc;
    cs.prefetch = prefetch_of(a);
    if (run_isa == OFFLOAD_ISA_AVX512VBMI && !vbmi_runs(cs)) run_isa = OFFLOAD_ISA_AVX512;
    p.cs = &cs;
    p.kind = PreparedStep::kCompressed;
    p.isa = run_isa;
    p.n = a.n;
    return 0;
}

// Whether struct a runs the fused tiles of compressed_tile.h.
bool takes_compressed(const offload_step_args &a) {
    return a.num_states >= 0 && a.num_states <= OFFLOAD_MAX_STATES && is_compressed(a);
}

// Checks and converts struct a into p (p.n == 0: nothing to run). A compressed step
// (takes_compressed) is written into *cs, its Q8 tables into q; both must outlive p.
int prepare_step(const offload_step_args &a, Q8Built &q, CompressedStep *cs, PreparedStep &p) {
    if (a.n < 0 || a.num_threads < 1 || prefetch_of(a) < 0 || !valid_pool(a.pool) || struct_overlaps_itself(a))
        return -EINVAL;
    if (takes_compressed(a)) return cs ? prepare_compressed(a, q, *cs, p) : -EINVAL;
    switch (a.rule) {
        case OFFLOAD_RULE_ADAM: return prepare_adam(a, p);
        case OFFLOAD_RULE_ADAM_AMSGRAD: return prepare_amsgrad(a, p);
        case OFFLOAD_RULE_SGD:
        case OFFLOAD_RULE_ADAGRAD:
        case OFFLOAD_RULE_LION: return prepare_one_state(a, p);
        default: return -EINVAL;
    }
}

// Elements [begin, end) of step p; begin is 0 or a multiple of kBlock (compressed steps: of
// kTile, so that every range's tiles sit on the Q8 block grid).
int run_range(const PreparedStep &p, int64_t begin, int64_t end) {
    const int isa = p.isa;
    switch (p.kind) {
        case PreparedStep::kAdam:
            return pick(isa, adam_range_avx512, adam_range_avx2, adam_range_scalar)(p.adam, p.ab, begin, end);
        case PreparedStep::kAmsgrad:
            return pick(isa, amsgrad_range_avx512, amsgrad_range_avx2, amsgrad_range_scalar)(p.adam, p.rb, begin, end);
        case PreparedStep::kSgd:
            return pick(isa, sgd_range_avx512, sgd_range_avx2, sgd_range_scalar)(p.consts.sgd, p.rb, begin, end);
        case PreparedStep::kAdagrad:
            return pick(isa, adagrad_range_avx512, adagrad_range_avx2,
                        adagrad_range_scalar)(p.consts.adagrad, p.rb, begin, end);
        case PreparedStep::kLion:
            return pick(isa, lion_range_avx512, lion_range_avx2, lion_range_scalar)(p.consts.lion, p.rb, begin, end);
        case PreparedStep::kCompressed:
            if (isa == OFFLOAD_ISA_AVX512VBMI) return compressed_range_avx512vbmi(*p.cs, begin, end);
            return pick(isa, compressed_range_avx512, compressed_range_avx2,
                        compressed_range_scalar)(*p.cs, begin, end);
    }
    return -EINVAL;
}

int rule_step_one(const offload_step_args &a) {
    Q8Built q;
    CompressedStep cs{};
    PreparedStep p;
    const int rc = prepare_step(a, q, &cs, p);
    if (rc != 0 || p.n == 0) return rc;
    auto fn = [&p](int64_t begin, int64_t end, int64_t) -> int { return run_range(p, begin, end); };
    return parallel_blocks(p.n, threads_for(p.n, a.num_threads), fn, a.pool);
}

// [Note: batched steps]
// A model is many tensors, most of them small (ResNet-50: 126 of its 161 tensors hold 0.77M
// of its 25.6M params), and a call per tensor paid a ctypes call and, for each tensor of
// 128K elements or more, the start of a helper thread (~20-50 us): a two-thread step of
// ResNet-50 started 35 threads. A batch is cut into work items once: each block of kBlock
// elements of a large tensor, and runs of whole small tensors of about kBlock elements
// together (a few dozen atomic claims for 2000 tensors of 64 elements, not 2000), which one
// set of threads claims.
struct BatchItem {
    int64_t first, last;  // steps [first, last): whole; or step first alone (last == first + 1)
    int64_t begin, end;   // ... its elements [begin, end)
};

// The Q8Built of a step's tables: one per distinct set of table pointers in a batch (every
// struct the Python side packs shares one), built on first use.
struct TableCache {
    struct Entry {
        const void *key[4];
        std::unique_ptr<Q8Built> built;
    };
    std::vector<Entry> entries;
    Q8Built &get(const offload_quant &qa) {
        const void *key[4] = {qa.signed_map, qa.signed_mid, qa.unsigned_map, qa.unsigned_mid};
        for (Entry &e : entries)
            if (memcmp(e.key, key, sizeof key) == 0) return *e.built;
        entries.push_back(Entry{{key[0], key[1], key[2], key[3]}, std::make_unique<Q8Built>()});
        return *entries.back().built;
    }
};

int rule_steps(const offload_step_args *args, int64_t count, int num_threads, int64_t *bad) {
    std::vector<PreparedStep> steps(static_cast<size_t>(count));
    std::deque<CompressedStep> compressed;  // (a deque: its elements never move)
    TableCache tables;
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) {
        CompressedStep *cs = takes_compressed(args[i]) ? &compressed.emplace_back() : nullptr;
        const int rc = prepare_step(args[i], tables.get(args[i].quant), cs, steps[i]);
        if (rc != 0) {
            if (bad) *bad = i;
            return rc;
        }
        total += steps[i].n;
    }
    std::vector<BatchItem> items;
    int64_t run_first = -1, run_last = -1, run_elems = 0;
    auto flush = [&] {
        if (run_first >= 0) items.push_back(BatchItem{run_first, run_last, 0, 0});
        run_first = -1;
        run_elems = 0;
    };
    for (int64_t i = 0; i < count; ++i) {
        const int64_t n = steps[i].n;
        if (n == 0) continue;
        if (n >= kBlock) {  // its blocks; a run of small steps ends before it
            flush();
            for (int64_t b = 0; b < n; b += kBlock) items.push_back(BatchItem{i, i + 1, b, b + kBlock < n ? b + kBlock : n});
            continue;
        }
        if (run_first < 0) run_first = i;
        run_last = i + 1;
        run_elems += n;
        if (run_elems >= kBlock) flush();
    }
    flush();
    auto fn = [&steps, &items](int64_t k) -> int {
        const BatchItem &it = items[k];
        if (it.end > it.begin) return run_range(steps[it.first], it.begin, it.end);
        int first_rc = 0;
        for (int64_t i = it.first; i < it.last; ++i) {
            const int rc = steps[i].n ? run_range(steps[i], 0, steps[i].n) : 0;
            if (rc != 0 && first_rc == 0) first_rc = rc;
        }
        return first_rc;
    };
    int threads = threads_for(total, num_threads);
    if (threads > 1 && batch_aliases(args, count)) threads = 1;  // [Note: aliased entries]
    int pool = OFFLOAD_POOL_AUTO;
    for (int64_t i = 0; i < count; ++i)
        if (args[i].pool == OFFLOAD_POOL_OWN) pool = OFFLOAD_POOL_OWN;
    return parallel_items(static_cast<int64_t>(items.size()), threads, fn, pool);
}

}  // namespace

extern "C" {

// the face's queries (offload_native.h says what each answers)
int offload_abi_version(void) { return 7; }
int64_t offload_block_elems(void) { return kBlock; }
int offload_omp_pool(void) { return loaded_omp_pool() ? 1 : 0; }
int64_t offload_step_args_size(void) { return static_cast<int64_t>(sizeof(offload_step_args)); }
int offload_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }
int offload_isa_best(void) { return isa_best(); }

int offload_rule_step(const offload_step_args *a) {
    if (a == nullptr) return -EINVAL;
    return rule_step_one(*a);
}

int offload_rule_steps(const offload_step_args *args, int64_t count, int num_threads,
                       int64_t *out_bad) {
    if (out_bad) *out_bad = -1;
    if (count < 0 || num_threads < 1 || (count > 0 && args == nullptr)) return -EINVAL;
    try {
        return rule_steps(args, count, num_threads, out_bad);
    } catch (...) {  // the bookkeeping's allocations; nothing has run yet
        return -ENOMEM;
    }
}

int offload_grad_sumsq(const void *grad, int grad_dtype, int64_t n, double *out_sumsq,
                       int *out_nonfinite, int isa, int num_threads, int pool) {
    if (n < 0 || num_threads < 1 || !valid_dtype(grad_dtype) || !valid_pool(pool) || !out_sumsq || !out_nonfinite)
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
    int rc = parallel_blocks(n, threads_for(n, num_threads), fn, pool);
    if (rc != 0) return rc;
    double total = 0.0;
    for (double s : partial) total += s;
    *out_sumsq = total;
    // A double sum of squares of finite fp32/fp16/bf16 values cannot overflow
    // (n * 2^256 << 2^1024), so the sum is non-finite exactly when an element is. The
    // units sum short blocks in fp32 but redo in double any block whose fp32 sum is not
    // finite ([Note: sumsq in fp32 blocks] in unit_dispatch.h), which keeps this true.
    *out_nonfinite = std::isfinite(total) ? 0 : 1;
    return 0;
}

}  // extern "C"
