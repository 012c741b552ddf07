"""Optimizer kernels: native SIMD C++ (AVX-512 / AVX2 / scalar), numba fallback, torch reference.

Every backend has the same two entry points (the contract every caller relies on):
``adam_step(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
decoupled, bias_correction=True, maximize=False, grad_scale=1.0, param_lowp=None,
num_threads=None)`` and ``grad_sumsq(grad, *, num_threads=None) -> (sumsq, nonfinite)``.
"""
from ._threads import get_num_threads, set_num_threads
from .registry import BACKENDS, backend_status, get_backend
from .isa import native_isa, supported_isas

__all__ = ["get_backend", "backend_status", "set_num_threads", "get_num_threads",
           "native_isa", "supported_isas", "BACKENDS"]
