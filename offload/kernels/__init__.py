"""Optimizer kernels: native SIMD C++ (AVX-512 / AVX2 / scalar), numba fallback, torch reference.

Every backend has the same entry points (the contract every caller relies on):

- ``rule_step(rule, param, grad, states, *, step, param_lowp=None, num_threads=None,
  **hyper)``: one step of ``rule`` (a ``fields.Rule`` or its name: ``ADAM``, ``SGD``,
  ``SGD_PLAIN``, ``ADAGRAD``, ``LION``) with the rule's states by field name
  (``{"exp_avg": ..., "exp_avg_sq": ...}``), each checked against its field's dtype;
  Adam's ``hyper`` are ``lr, beta1, beta2, eps, weight_decay, decoupled`` and optionally
  ``bias_correction=True, maximize=False, grad_scale=1.0``; the other rules take torch's
  names and defaults (``rule_consts.sgd_args``, ``adagrad_args``, ``lion_args``), checked
  with torch.optim's messages.
- ``adam_step(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
  decoupled, bias_correction=True, maximize=False, grad_scale=1.0, param_lowp=None,
  num_threads=None)``: the same Adam step with the moments in field order.
- ``grad_sumsq(grad, *, num_threads=None) -> (sumsq, nonfinite)``.
- ``checked_rule_steps(rule, entries, hyper, num_threads=None)``: one step over a list of
  ``_rule_step.StepEntry`` (tensors the caller checked, as ``optim.functional.rule_step``
  does): one tensor at a time by default, the whole list in one native call
  (``offload_rule_steps``: [Note: batched steps] in native/dispatch.cpp) on the native backend.

Adam's float32 constants are folded once, in ``adam_consts.fold_adam`` (the other rules':
``rule_consts``), for the native library (one ``struct offload_step_args``,
native/offload_native.h) and the numba kernels.
"""
from ._threads import get_num_threads, set_num_threads
from .registry import BACKENDS, backend_status, get_backend
from .isa import native_isa, supported_isas

__all__ = ["get_backend", "backend_status", "set_num_threads", "get_num_threads",
           "native_isa", "supported_isas", "BACKENDS"]
