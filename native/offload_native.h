/* offload native kernels: the C face loaded by offload/kernels/native_backend.py (ctypes).
 *
 * Plain functions over raw pointers and scalars. No hidden state: the step number and every
 * hyperparameter arrive as arguments. Every function returns 0 or a negative errno and never
 * throws. No libtorch, no Python C API.
 */
#ifndef OFFLOAD_NATIVE_H
#define OFFLOAD_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define OFFLOAD_API __attribute__((visibility("default")))

/* element types of grad / param_lowp (keep in sync with offload/kernels/_checks.py) */
enum { OFFLOAD_F32 = 0, OFFLOAD_F16 = 1, OFFLOAD_BF16 = 2 };
/* instruction sets; -1 asks for the best one the CPU supports */
enum { OFFLOAD_ISA_BEST = -1, OFFLOAD_ISA_SCALAR = 0, OFFLOAD_ISA_AVX2 = 1, OFFLOAD_ISA_AVX512 = 2 };

/* 1 if the CPU (and OS) can run `isa`, else 0. */
OFFLOAD_API int offload_isa_supported(int isa);
/* The ISA that OFFLOAD_ISA_BEST selects. */
OFFLOAD_API int offload_isa_best(void);
/* ABI version of this face; the Python side refuses a library whose version differs. */
OFFLOAD_API int offload_abi_version(void);

/* One Adam / AdamW step over n elements, torch.optim.Adam(foreach=False) numerics.
 * param, exp_avg, exp_avg_sq: fp32, updated in place. grad: grad_dtype, read only.
 * param_lowp: NULL or lowp_dtype (F16/BF16), receives the round-to-nearest-even copy of the
 * updated param. g = float(grad) * grad_scale, negated if maximize; decoupled != 0 is AdamW
 * decay (p *= 1 - lr*wd), else L2 (g += wd*p). bias_correction == 0 uses bc1 = bc2 = 1.
 * num_threads >= 1: threads are spawned for this call only, when n is large enough.
 * Returns 0, -EINVAL (bad argument), -ENOTSUP (isa not supported by this CPU). */
OFFLOAD_API int offload_adam_step(float *param, const void *grad, int grad_dtype,
                                  float *exp_avg, float *exp_avg_sq, void *param_lowp,
                                  int lowp_dtype, int64_t n, double lr, double beta1,
                                  double beta2, double eps, double weight_decay, int64_t step,
                                  int decoupled, int bias_correction, int maximize,
                                  double grad_scale, int isa, int num_threads);

/* Sum of squares of float(grad[0..n)) accumulated in double, and whether any element is
 * NaN or Inf, in one pass. */
OFFLOAD_API int offload_grad_sumsq(const void *grad, int grad_dtype, int64_t n,
                                   double *out_sumsq, int *out_nonfinite, int isa,
                                   int num_threads);

#ifdef __cplusplus
}
#endif

#endif
