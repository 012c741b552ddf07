"""Adam's per-step scalars, folded once for every backend that takes them as float32.

torch's ``_single_tensor_adam`` forms its scalars in Python doubles (``1 - beta1``,
``lr / bias_correction1``, ``sqrt(bias_correction2)``) and they are rounded to float32 where
they meet a float32 tensor. ``fold_adam`` does exactly that, once: the native library reads
the result from its step struct (``offload_adam_consts`` in native/offload_native.h) and the
numba kernels take it as arguments, so the two cannot drift apart by a bit. The torch backend
does not use it: it is the reference, and lets torch round its own scalars.
"""
from __future__ import annotations

import math
import struct
from array import array
from typing import Any, Callable, NamedTuple, Optional, Tuple

__all__ = ["AdamConsts", "FoldCache", "fold_adam"]


class AdamConsts(NamedTuple):
    """One step's scalars; every float is a float32 value (as a Python float)."""

    grad_scale: float
    """Grad multiplier, negated when maximizing."""
    l2: float
    """Weight decay added to the grad (Adam), used when ``use_l2``."""
    decay: float
    """``1 - lr * weight_decay`` (AdamW), 1 otherwise."""
    lerp_coeff: float
    """torch.lerp's weight ``w = 1 - beta1``, or ``w - 1`` when ``lerp_from_end``."""
    beta2: float
    one_minus_beta2: float
    bc2_sqrt: float
    """``sqrt(1 - beta2**step)``; 1 without bias correction."""
    eps: float
    neg_step_size: float
    """``-lr / (1 - beta1**step)``; ``-lr`` without bias correction."""
    use_l2: bool
    lerp_from_end: bool
    """torch.lerp starts from the end (the grad) when ``|w| >= 0.5``, else from exp_avg."""


def _pow(base: float, exponent: float) -> float:
    """C's pow: Python's ``**`` raises where C returns an infinity (|beta| > 1, large steps)."""
    try:
        return base ** exponent
    except OverflowError:
        odd = exponent % 2 == 1
        return -math.inf if base < 0 and odd else math.inf


# The NaN an invalid operation makes: x86's "default NaN" has its sign bit set (what the C
# kernel computed before the fold moved here; the library is x86-only), math.nan has not.
_DEFAULT_NAN = -math.nan


def _div(a: float, b: float) -> float:
    """IEEE division (Python raises on a zero divisor: beta1 = 1 with bias correction)."""
    if b != 0 or math.isnan(a):
        return a / b if b != 0 else a
    if a == 0:
        return _DEFAULT_NAN
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _sqrt(x: float) -> float:
    """C's sqrt: Python raises for x < 0 (beta2 > 1 with bias correction)."""
    return math.sqrt(x) if x >= 0 or math.isnan(x) else _DEFAULT_NAN


_make = tuple.__new__  # builds the NamedTuple without its per-call keyword handling
_F9 = struct.Struct("=9f")


def fold_adam(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              step: int, decoupled: bool, bias_correction: bool = True,
              maximize: bool = False, grad_scale: float = 1.0) -> AdamConsts:
    """Adam's (``decoupled``: AdamW's) scalars for ``step`` (1 on the first step).

    Each value is the double torch computes, rounded once to float32 as C's double -> float
    cast rounds (to nearest even; an infinity past float32's range, where torch's scalars
    would be infinite too). Degenerate hyperparameters (beta1 = 1, beta2 > 1, overflowing
    powers) fold as IEEE arithmetic does, not as Python's exceptions. Python numbers, numpy
    scalars and one-element tensors are read with ``float()``."""
    lr, beta1, beta2, eps = float(lr), float(beta1), float(beta2), float(eps)
    weight_decay, grad_scale = float(weight_decay), float(grad_scale)
    use_l2 = not decoupled and weight_decay != 0
    decay = 1.0 - lr * weight_decay if decoupled and weight_decay != 0 else 1.0
    head = (-grad_scale if maximize else grad_scale, weight_decay, decay, 1.0 - beta1, beta2,
            1.0 - beta2)
    try:  # the common case in plain Python arithmetic; it raises where IEEE would not
        if bias_correction:
            bc1 = 1.0 - beta1 ** float(step)
            bc2 = 1.0 - beta2 ** float(step)
        else:
            bc1 = bc2 = 1.0
        f = _F9.unpack(_F9.pack(*head, math.sqrt(bc2), eps, -(lr / bc1)))
    except (OverflowError, ZeroDivisionError, ValueError):
        f = _fold_ieee(head, lr, beta1, beta2, eps, step, bias_correction)
    w = f[3]
    from_end = not abs(w) < 0.5  # a NaN weight goes from the end, as in torch.lerp
    if from_end:
        # w - 1 in float32: exact in double for any float32 w below 2**52, so one rounding
        # gives the float32 difference
        f = f[:3] + (array("f", (w - 1.0,))[0],) + f[4:]
    return _make(AdamConsts, f + (use_l2, from_end))


def _fold_ieee(head: tuple, lr: float, beta1: float, beta2: float, eps: float, step: int,
               bias_correction: bool) -> tuple:
    """fold_adam's float32 values where Python raises (``struct`` refuses a finite double
    past float32's range; ``array("f")`` rounds it to infinity as C does)."""
    if bias_correction:
        bc1 = 1.0 - _pow(beta1, float(step))
        bc2 = 1.0 - _pow(beta2, float(step))
    else:
        bc1 = bc2 = 1.0
    return tuple(array("f", head + (_sqrt(bc2), eps, -_div(lr, bc1))).tolist())


class FoldCache:
    """``fold_adam`` remembering its last result (passed through ``convert``), keyed by the
    exact bits of its arguments as doubles. Every param of one group in one step has the same
    hyperparameters and step, so a step folds once per group instead of once per param (the
    fold is a visible share of a tiny param's per-call cost). The key holds what the fold
    reads (``float()`` of each number, the truth of each flag), so a hit returns what folding
    would; -0.0 and 0.0 are different keys. Safe to share between threads: the cache is one
    tuple, read and replaced whole."""

    _KEY = struct.Struct("=10d")

    def __init__(self, convert: Callable[[AdamConsts], Any] = lambda c: c) -> None:
        self._convert = convert
        self._last: Tuple[Optional[bytes], Any] = (None, None)

    def __call__(self, hyper: tuple) -> Any:
        """``convert(fold_adam(*hyper))``."""
        try:
            key = self._KEY.pack(*hyper)
        except (struct.error, TypeError, ValueError, OverflowError):
            return self._convert(fold_adam(*hyper))  # not plain numbers: fold_adam says why
        last = self._last
        if last[0] == key:
            return last[1]
        value = self._convert(fold_adam(*hyper))
        self._last = (key, value)
        return value
