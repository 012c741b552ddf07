/* offload native kernels: the C face loaded by offload/kernels/native_backend.py (ctypes).
 *
 * Plain functions over raw pointers, scalars and plain structs. No hidden state: every
 * constant of a step arrives as an argument. Every function returns 0 or a negative errno
 * and never throws. No libtorch, no Python C API.
 */
#ifndef OFFLOAD_NATIVE_H
#define OFFLOAD_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define OFFLOAD_API __attribute__((visibility("default")))

/* element types (keep in sync with offload/kernels/_checks.py). Q8S / Q8U: block-wise 8-bit
 * states, packed as OFFLOAD_Q8_BLOCK one-byte codes then the block's float absmax
 * (OFFLOAD_Q8_PACKED bytes per block), decoded as map[code] * absmax with the signed or
 * unsigned map of struct offload_quant; the scheme, bit for bit: offload/kernels/quant.py. */
enum { OFFLOAD_F32 = 0, OFFLOAD_F16 = 1, OFFLOAD_BF16 = 2, OFFLOAD_Q8S = 3, OFFLOAD_Q8U = 4 };
#define OFFLOAD_Q8_BLOCK 256
#define OFFLOAD_Q8_PACKED 260
/* software prefetch in the kernels' streaming loops: AUTO takes the machine's default (on for
 * Intel CPUs, off for the others: [Note: software prefetch] in native/kernel.h) */
enum { OFFLOAD_PREFETCH_AUTO = 0, OFFLOAD_PREFETCH_ON = 1, OFFLOAD_PREFETCH_OFF = 2 };
/* the threads a parallel call runs on: AUTO, the OpenMP pool (libgomp) the process already
 * loaded, torch's, when there is one and the process has not forked since this library was
 * loaded, else threads of the call's own; OWN, always the call's own ([Note: torch's OpenMP
 * pool] in native/parallel.h) */
enum { OFFLOAD_POOL_AUTO = 0, OFFLOAD_POOL_OWN = 1 };
/* how a BF16 param or state is rounded after its update */
enum { OFFLOAD_ROUND_NEAREST = 0, OFFLOAD_ROUND_STOCHASTIC = 1 };
/* instruction sets; -1 asks for the best one the CPU supports. AVX512VBMI is the AVX-512
 * unit with VBMI byte permutes for int8 states (Q8S / Q8U): the same results, faster; a
 * library without it (or a CPU without VBMI) reports it unsupported. */
enum { OFFLOAD_ISA_BEST = -1, OFFLOAD_ISA_SCALAR = 0, OFFLOAD_ISA_AVX2 = 1, OFFLOAD_ISA_AVX512 = 2,
       OFFLOAD_ISA_AVX512VBMI = 3 };

/* 1 if the CPU (and OS) can run `isa`, else 0. */
OFFLOAD_API int offload_isa_supported(int isa);
/* The ISA that OFFLOAD_ISA_BEST selects. */
OFFLOAD_API int offload_isa_best(void);
/* ABI version of this face (3: Q8 / BF16 states, BF16 params, struct offload_quant; 4: Q8U codes
 * square roots; 5: offload_rule_steps, the prefetch switch; 6: the pool switch; 7:
 * offload_block_elems); the Python side refuses a library whose version differs. */
OFFLOAD_API int offload_abi_version(void);
/* The element count of the ranges a step and offload_grad_sumsq hand to threads
 * (OFFLOAD_BLOCK_ELEMS). The grad norm's bits depend on it, and the numba backend cuts the same
 * ranges, so the Python side refuses a library built with another. */
OFFLOAD_API int64_t offload_block_elems(void);
/* 1 if OFFLOAD_POOL_AUTO would run on an OpenMP pool now (libgomp loaded, no fork since), else 0. */
OFFLOAD_API int offload_omp_pool(void);

/* Optimizer rules a step can apply; the codes of offload.kernels.fields.RULES. */
enum { OFFLOAD_RULE_ADAM = 0, OFFLOAD_RULE_SGD = 1, OFFLOAD_RULE_ADAGRAD = 2, OFFLOAD_RULE_LION = 3,
       OFFLOAD_RULE_ADAM_AMSGRAD = 4 };
/* The most per-element states a rule may keep (Adam keeps two, AMSGrad three). */
#define OFFLOAD_MAX_STATES 4

/* One typed array of the step's n elements: a raw pointer and its element type. */
struct offload_array {
    void *data;
    int32_t dtype;    /* OFFLOAD_F32, OFFLOAD_F16, OFFLOAD_BF16; states also Q8S / Q8U */
    int32_t rounding; /* BF16 param or state: OFFLOAD_ROUND_*; else 0 */
};

/* The tables and random streams of compressed states (quant.py's notes). A Q8S code is
 * #{i : signed_mid[i] < x / absmax} and decodes as signed_map[code] * absmax; a Q8U code is
 * #{i : unsigned_mid[i] < sqrt(max(x / absmax, 0))} and decodes as unsigned_map[code] *
 * absmax, unsigned_map holding the squares of the levels whose midpoints unsigned_mid holds
 * (quant.SQRT_DECODE, quant.UNSIGNED_MID). Each map: 256 sorted floats with an exact 0.
 * Stochastic rounding of element i of array k (param k = 0, state s k = 1 + s):
 * h = lowbias32((uint32_t)(offset + i) ^ seed ^ STREAM[key(k)]), r = the top half of h for
 * the param and even states, the low half for odd states (which share the key of the even
 * state before them: quant.stream_key), bf16 bits = (bits(x) + r) >> 16, NaN -> 0xFFFF.
 * Unused (NULL / 0) when every array is F32. */
struct offload_quant {
    const float *signed_map;   /* [256] */
    const float *signed_mid;   /* [255] */
    const float *unsigned_map; /* [256] */
    const float *unsigned_mid; /* [255] */
    int64_t offset;
    uint32_t seed;
    int32_t reserved;
};

/* Adam's scalars for one step, folded by the caller (offload/kernels/adam_consts.py) and
 * already rounded to float the way torch rounds its Python scalars; the kernel only reads
 * them. g = float(grad) * grad_scale (negated for maximize); g += l2 * p when use_l2;
 * p *= decay; exp_avg = lerp(exp_avg, g, w) as torch.lerp computes it (lerp_coeff = w, or
 * w - 1 from the end when lerp_from_end); exp_avg_sq = exp_avg_sq * beta2 +
 * one_minus_beta2 * g * g; p += neg_step_size * exp_avg / (sqrt(exp_avg_sq) / bc2_sqrt + eps).
 * OFFLOAD_RULE_ADAM_AMSGRAD takes the same scalars and a third state, max_exp_avg_sq:
 * max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq) (NaN if either is: torch.maximum), and
 * the denominator is sqrt(max_exp_avg_sq) / bc2_sqrt + eps. */
struct offload_adam_consts {
    float grad_scale;
    float l2;
    float decay;
    float lerp_coeff;
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;
    float eps;
    float neg_step_size;
    int32_t use_l2;        /* 0 or 1 */
    int32_t lerp_from_end; /* 0 or 1 */
};

/* SGD's scalars (offload/kernels/rule_consts.py fold_sgd), torch's _single_tensor_sgd:
 * d_p = float(grad) * grad_scale (negated for maximize); d_p += weight_decay * p when use_wd;
 * momentum_mode 0: no buffer (update = d_p); 1 (the first step): buf = d_p; 2: buf =
 * buf * momentum + one_minus_dampening * d_p; update = d_p + momentum * buf when nesterov,
 * else buf; p += neg_lr * update. The buffer is states[0] (needed unless mode is 0). */
struct offload_sgd_consts {
    float grad_scale;
    float weight_decay;
    float momentum;
    float one_minus_dampening;
    float neg_lr;
    int32_t use_wd;        /* 0 or 1 */
    int32_t momentum_mode; /* 0, 1 or 2 */
    int32_t nesterov;      /* 0 or 1 */
};

/* Adagrad's scalars (fold_adagrad), torch's _single_tensor_adagrad: g as SGD's d_p;
 * sum += g * g; p += neg_clr * g / (sqrt(sum) + eps). The sum is states[0]. */
struct offload_adagrad_consts {
    float grad_scale;
    float weight_decay;
    float eps;
    float neg_clr;
    int32_t use_wd;
};

/* Lion's scalars (fold_lion), lion-pytorch's update_fn in its lerp form: g as above;
 * p *= decay; p += neg_lr * sign(lerp(exp_avg, g, w1)); exp_avg = lerp(exp_avg, g, w2);
 * each lerp as in Adam (coeff = w, or w - 1 from the end). exp_avg is states[0]. */
struct offload_lion_consts {
    float grad_scale;
    float decay;
    float coeff1;
    float coeff2;
    float neg_lr;
    int32_t from_end1; /* 0 or 1 */
    int32_t from_end2; /* 0 or 1 */
};

/* A rule's constants; the reserved bytes keep the size fixed as rules are added. */
union offload_rule_consts {
    struct offload_adam_consts adam;
    struct offload_sgd_consts sgd;
    struct offload_adagrad_consts adagrad;
    struct offload_lion_consts lion;
    double reserved[8];
};

/* Everything one step of one rule over n elements needs. offload_step_args_size() reports
 * sizeof(struct offload_step_args) so a caller can refuse a library of another layout. */
struct offload_step_args {
    int32_t rule;                  /* OFFLOAD_RULE_* */
    int32_t num_states;            /* entries of states[] the rule reads: 2 for Adam, 3 for
                                      AMSGrad, 1 for
                                      Adagrad and Lion, 1 or 0 (no momentum) for SGD */
    int64_t n;                     /* elements of every array below (Q8 states: values; the
                                      data is ceil(n / 256) packed blocks) */
    struct offload_array param;    /* F32, or BF16: the param is its own master (lowp must
                                      then be NULL), updated in place */
    struct offload_array grad;     /* any dtype, read only */
    struct offload_array lowp;     /* data NULL: none; else F16/BF16, receives the
                                      round-to-nearest-even copy of the updated param */
    struct offload_array states[OFFLOAD_MAX_STATES]; /* the rule's fields, in the order of
                                      offload.kernels.fields (Adam: exp_avg, exp_avg_sq, F32;
                                      AMSGrad: then max_exp_avg_sq),
                                      updated in place */
    union offload_rule_consts consts;
    int32_t isa;                   /* OFFLOAD_ISA_* */
    int32_t num_threads;           /* >= 1; threads are used when n is large enough (a thread's
                                      range starts at a multiple of OFFLOAD_Q8_BLOCK when a
                                      state is Q8); offload_rule_steps takes its own count
                                      instead */
    struct offload_quant quant;
    int32_t prefetch;              /* OFFLOAD_PREFETCH_*: software prefetch in the streaming
                                      loops, a hint that never changes a value */
    int32_t pool;                  /* OFFLOAD_POOL_*: the threads it runs on (offload_rule_steps:
                                      OWN if any struct asks for it) */
};

/* sizeof(struct offload_step_args) as this library was compiled. */
OFFLOAD_API int64_t offload_step_args_size(void);

/* One step of rule a->rule (torch.optim.Adam / SGD / Adagrad (foreach=False) numerics for
 * Adam / AdamW, SGD, Adagrad; lion-pytorch's for Lion).
 * Returns 0, -EINVAL (bad argument: unknown rule, state count, dtype, n < 0, NULL pointer),
 * -ENOTSUP (isa not supported by this CPU). */
OFFLOAD_API int offload_rule_step(const struct offload_step_args *a);

/* The steps of args[0..count) in one call, as offload_rule_step would run each, the elements
 * of all of them spread over up to num_threads threads together (each struct's num_threads
 * is checked, not used). Every struct is checked before any memory is touched: on a bad one
 * nothing is updated, its index goes to *out_bad (when not NULL; else -1) and its error is
 * returned. Structs whose arrays overlap (the same param twice) run in struct order on
 * one thread: the result of the calls one after another ([Note: aliased entries]).
 * Returns 0, -EINVAL, -ENOTSUP or -ENOMEM (before anything ran). */
OFFLOAD_API int offload_rule_steps(const struct offload_step_args *args, int64_t count,
                                   int num_threads, int64_t *out_bad);

/* Sum of squares of float(grad[0..n)) accumulated in double, and whether any element is
 * NaN or Inf, in one pass. */
OFFLOAD_API int offload_grad_sumsq(const void *grad, int grad_dtype, int64_t n,
                                   double *out_sumsq, int *out_nonfinite, int isa,
                                   int num_threads, int pool);

/* A minimal io_uring ring over raw syscalls (native/uring_ring.cpp), the ring of the `uring`
 * io engine where python-liburing cannot run. offload_uring_open: a ring of `entries` SQEs
 * (eventfd >= 0: registered, signalled on each completion) in *out. offload_uring_queue: up to
 * n reads (writes[i] == 0) or writes of lens[i] bytes at addrs[i] <-> fds[i] at offsets[i],
 * tagged user_data[i], into the SQ ring (buf_index[i] >= 0: IORING_OP_READ_FIXED / WRITE_FIXED
 * through that registered buffer); returns how many fit. offload_uring_submit: hands the
 * queued entries to the kernel; returns how many it took or -errno (-EAGAIN / -EBUSY: they stay
 * queued). offload_uring_reap: up to max completions (user_data, res: bytes or -errno);
 * returns their count. One thread at a time per ring. */
OFFLOAD_API int offload_uring_open(uint32_t entries, int eventfd, void **out);
OFFLOAD_API int offload_uring_queue(void *ring, int n, const int32_t *writes, const int32_t *fds,
                                    const uint64_t *addrs, const uint32_t *lens,
                                    const uint64_t *offsets, const uint64_t *user_data,
                                    const int32_t *buf_index);
OFFLOAD_API int offload_uring_submit(void *ring);
OFFLOAD_API int offload_uring_reap(void *ring, int max, uint64_t *user_data, int32_t *res);
OFFLOAD_API int offload_uring_fd(void *ring);
OFFLOAD_API void offload_uring_close(void *ring);

#ifdef __cplusplus
}
#endif

#endif
