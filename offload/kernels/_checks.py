"""Argument checks shared by every backend, so all three fail the same way on bad input.

The kernels read and write raw memory, so a wrong dtype, a strided view or a short buffer
must be refused before any pointer is handed to C or numba; the error names the argument
and the offending value.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Tuple

import torch

from ._threads import MAX_THREADS
from .fields import ADAM, Rule, StateField

__all__ = ["GRAD_DTYPES", "LOWP_DTYPES", "check_adam_args", "check_compressed_args", "check_grad_scale", "check_states",
           "check_step_args", "check_tensor", "check_threads", "written_overlap"]

# dtype -> code understood by native/ and the numba backend (keep in sync with offload_native.h)
GRAD_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
LOWP_DTYPES = {torch.float16: 1, torch.bfloat16: 2}


def check_tensor(name: str, t: object, dtypes, *, contiguous: bool = True) -> torch.Tensor:
    """A contiguous CPU tensor whose dtype is in ``dtypes`` (any shape; read as flat).
    ``contiguous=False`` for callers that pass strided tensors through a contiguous copy."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
    if t.is_neg():  # its memory holds -t: a kernel would read and write the wrong sign
        raise ValueError(f"{name} carries torch's lazy negation (is_neg()); pass {name}.resolve_neg()")
    return t


def written_overlap(param: torch.Tensor, states: Sequence[torch.Tensor], names: Sequence[str],
                    param_lowp: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why the tensors one step writes (contiguous: param, its states, the low-precision
    copy) cannot be stepped, if two of them overlap (a param that is its own exp_avg: each
    backend would store last a different one, native/batch_alias.h); else None."""
    spans = [("param", param)] + list(zip(names, states)) + ([] if param_lowp is None else [("param_lowp", param_lowp)])
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, t in spans if t.numel()]
    for i, (a, lo, hi) in enumerate(spans):
        for b, lo2, hi2 in spans[:i]:
            if lo < hi2 and lo2 < hi:
                return f"{a} overlaps {b} in memory: a step writes each of them"
    return None


def check_threads(num_threads: Optional[int]) -> None:
    if num_threads is None:
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or not 1 <= num_threads <= MAX_THREADS:
        raise ValueError(f"num_threads must be a positive int (at most {MAX_THREADS}) or None, got {num_threads!r}")


def check_grad_scale(grad_scale: object) -> None:
    """The grad multiplier (1/loss-scale times the clip coefficient): finite and >= 0, or
    every updated element would be NaN or move against its gradient."""
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)):
        raise TypeError(f"grad_scale must be a float, got {type(grad_scale).__name__} {grad_scale!r}")
    if not (math.isfinite(grad_scale) and grad_scale >= 0):
        raise ValueError(f"grad_scale must be a finite number >= 0, got {grad_scale!r}")


def check_adam_args(param, grad, exp_avg, exp_avg_sq, param_lowp, step, num_threads, *,
                    contiguous: bool = True) -> int:
    """Validate one adam_step call; returns the element count."""
    return check_step_args(param, grad, ADAM.fields, (exp_avg, exp_avg_sq), param_lowp, step,
                           num_threads, contiguous=contiguous)


def check_step_args(param, grad, fields: Sequence[StateField], states: Sequence[torch.Tensor],
                    param_lowp, step, num_threads, *, contiguous: bool = True) -> int:
    """Validate one step: ``states[i]`` is the tensor of ``fields[i]``, which must have the
    field's dtype and param's element count. Returns the element count.
    (Called once per param per step, also for tiny params: kept free of temporaries.)"""
    check_tensor("param", param, (torch.float32,), contiguous=contiguous)
    check_tensor("grad", grad, GRAD_DTYPES, contiguous=contiguous)
    for field, t in zip(fields, states):
        check_tensor(field.name, t, (field.dtype,), contiguous=contiguous)
    if param_lowp is not None:
        check_tensor("param_lowp", param_lowp, LOWP_DTYPES, contiguous=contiguous)
    n = param.numel()
    if grad.numel() != n:
        _numel_error("grad", grad, n)
    for field, t in zip(fields, states):
        if t.numel() != n:
            _numel_error(field.name, t, n)
    if param_lowp is not None and param_lowp.numel() != n:
        _numel_error("param_lowp", param_lowp, n)
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 1 \
            or float(step) != int(step):
        raise ValueError(f"step must be an integer >= 1, got {step!r}")
    check_threads(num_threads)
    return n


def check_compressed_args(param, grad, fields: Sequence[StateField], states: Sequence[torch.Tensor],
                          param_lowp, step, num_threads, q) -> int:
    """``check_step_args`` for a step with compressed states or a bfloat16 param: each state
    has its field's storage dtype and size (packed blocks for int8), a bfloat16 param has no
    separate low-precision copy, the rounding seed is a uint32 and the offset >= 0."""
    check_tensor("param", param, (torch.float32, torch.bfloat16))
    if param.dtype == torch.bfloat16 and param_lowp is not None:
        raise ValueError("a bfloat16 param is its own master: pass param_lowp=None")
    n = param.numel()
    check_tensor("grad", grad, GRAD_DTYPES)
    if grad.numel() != n:
        _numel_error("grad", grad, n)
    for field, t in zip(fields, states):
        check_tensor(field.name, t, (field.storage_dtype,))
        want = field.storage_numel(n)
        if t.numel() != want:
            what = f"{want} bytes of packed blocks" if field.blocked else f"{want} elements"
            raise ValueError(f"{field.name} ({field.describe()}) of a param of {n} elements "
                             f"takes {what}, got {t.numel()}")
    if param_lowp is not None:
        check_tensor("param_lowp", param_lowp, LOWP_DTYPES)
        if param_lowp.numel() != n:
            _numel_error("param_lowp", param_lowp, n)
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 1 \
            or float(step) != int(step):
        raise ValueError(f"step must be an integer >= 1, got {step!r}")
    check_threads(num_threads)
    for name, v in (("rounding_seed", q.seed), ("element_offset", q.offset)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or \
                (name == "rounding_seed" and v >= 1 << 32):
            raise ValueError(f"{name} must be an int in [0, {'2**32' if name == 'rounding_seed' else 'inf'}), got {v!r}")
    return n


def _numel_error(name: str, t: torch.Tensor, n: int) -> None:
    raise ValueError(f"{name} has {t.numel()} elements, param has {n}")


def check_states(rule: Rule, states: Mapping[str, torch.Tensor],
                 names: Optional[Tuple[str, ...]] = None) -> Tuple[torch.Tensor, ...]:
    """The tensors of ``states`` (keyed by field name) in the order of ``rule.fields``; the
    keys must be exactly the rule's field names (``names``, when the caller has them)."""
    names = rule.names if names is None else names
    try:
        ordered = tuple([states[k] for k in names])
        if len(states) == len(names):  # all names found, none other: the names are unique
            return ordered
    except KeyError:
        pass
    except TypeError:
        if not isinstance(states, Mapping):
            raise TypeError(f"states must be a mapping of state name to tensor, "
                            f"got {type(states).__name__}") from None
        raise
    if not isinstance(states, Mapping):
        raise TypeError(f"states must be a mapping of state name to tensor, got {type(states).__name__}")
    missing = [k for k in names if k not in states]
    extra = sorted(str(k) for k in states if k not in names)
    raise ValueError(f"rule {rule.name!r} keeps the states {list(names)}; "
                     f"missing {missing}, unexpected {extra}")
