// Entry points of the native library: argument checks, ISA selection, thread split.
//
// Compiled with baseline x86-64 flags only: this unit runs on every CPU and decides at run
// time (__builtin_cpu_supports / cpuid) which ISA unit may run.
#include <atomic>
#include <cerrno>
#include <memory>
#include <cmath>
#include <cpuid.h>
#include <thread>
#include <vector>

#include "kernel.h"
#include "offload_native.h"

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
        default:
            return false;
    }
}

// The CPU's features, probed once: CPUID traps to the hypervisor in a VM (~20 us per
// call measured here), too slow to repeat on every kernel call. This is a fact about the
// machine, not state carried between steps.
struct IsaTable {
    bool ok[3];
    IsaTable() {
        for (int i = 0; i < 3; ++i) ok[i] = probe_isa(i);
    }
};

bool isa_supported(int isa) {
    static const IsaTable table;  // thread-safe one-time init (C++11 magic statics)
    return isa >= OFFLOAD_ISA_SCALAR && isa <= OFFLOAD_ISA_AVX512 && table.ok[isa];
}

int isa_best() {
    if (isa_supported(OFFLOAD_ISA_AVX512)) return OFFLOAD_ISA_AVX512;
    if (isa_supported(OFFLOAD_ISA_AVX2)) return OFFLOAD_ISA_AVX2;
    return OFFLOAD_ISA_SCALAR;
}

// -ENOTSUP for an ISA the CPU lacks, -EINVAL for an unknown code; else the ISA to run.
int resolve_isa(int isa) {
    if (isa == OFFLOAD_ISA_BEST) return isa_best();
    if (isa < OFFLOAD_ISA_SCALAR || isa > OFFLOAD_ISA_AVX512) return -EINVAL;
    return isa_supported(isa) ? isa : -ENOTSUP;
}

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

}  // namespace

extern "C" {

int offload_abi_version(void) { return 1; }

int offload_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

int offload_isa_best(void) { return isa_best(); }

int offload_adam_step(float *param, const void *grad, int grad_dtype, float *exp_avg,
                      float *exp_avg_sq, void *param_lowp, int lowp_dtype, int64_t n, double lr,
                      double beta1, double beta2, double eps, double weight_decay, int64_t step,
                      int decoupled, int bias_correction, int maximize, double grad_scale,
                      int isa, int num_threads) {
    if (n < 0 || step < 1 || num_threads < 1 || !valid_dtype(grad_dtype)) return -EINVAL;
    if (param_lowp != nullptr && lowp_dtype != OFFLOAD_F16 && lowp_dtype != OFFLOAD_BF16)
        return -EINVAL;
    int run_isa = resolve_isa(isa);
    if (run_isa < 0) return run_isa;
    if (n == 0) return 0;
    if (!param || !grad || !exp_avg || !exp_avg_sq) return -EINVAL;

    // Scalars as torch's _single_tensor_adam forms them: Python doubles, rounded to float
    // where they meet a float32 tensor. beta^step uses the same libm pow as Python's float **.
    AdamConsts c;
    double gs = maximize ? -grad_scale : grad_scale;
    c.grad_scale = static_cast<float>(gs);
    c.use_l2 = !decoupled && weight_decay != 0.0;
    c.l2 = static_cast<float>(weight_decay);
    c.decay = (decoupled && weight_decay != 0.0) ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
    float w = static_cast<float>(1.0 - beta1);  // torch.lerp weight
    c.lerp_from_end = !(std::fabs(w) < 0.5f);
    c.lerp_coeff = c.lerp_from_end ? w - 1.0f : w;
    c.beta2 = static_cast<float>(beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    double bc1 = 1.0, bc2 = 1.0;
    if (bias_correction) {
        bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
        bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    }
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    c.eps = static_cast<float>(eps);
    c.neg_step_size = static_cast<float>(-(lr / bc1));

    AdamBuffers b{param, grad, exp_avg, exp_avg_sq, param_lowp, grad_dtype,
                  param_lowp ? lowp_dtype : -1, param_lowp && n >= kStreamLowpMin};
    auto fn = [&c, &b, run_isa](int64_t begin, int64_t end, int64_t) -> int {
        switch (run_isa) {
            case OFFLOAD_ISA_AVX512: return adam_range_avx512(c, b, begin, end);
            case OFFLOAD_ISA_AVX2: return adam_range_avx2(c, b, begin, end);
            default: return adam_range_scalar(c, b, begin, end);
        }
    };
    return parallel_blocks(n, threads_for(n, num_threads), fn);
}

int offload_grad_sumsq(const void *grad, int grad_dtype, int64_t n, double *out_sumsq,
                       int *out_nonfinite, int isa, int num_threads) {
    if (n < 0 || num_threads < 1 || !valid_dtype(grad_dtype) || !out_sumsq || !out_nonfinite)
        return -EINVAL;
    int run_isa = resolve_isa(isa);
    if (run_isa < 0) return run_isa;
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
