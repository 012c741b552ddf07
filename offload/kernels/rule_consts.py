"""SGD's, Adagrad's and Lion's per-step scalars, checked and folded once for every backend.

As ``adam_consts`` does for Adam: torch forms each scalar in Python doubles (``1 -
dampening``, ``-lr``, ``lr / (1 + (step - 1) * lr_decay)``) and it is rounded to float32
where it meets a float32 tensor. The ``fold_*`` functions do that rounding once; the native
library reads the result from its step struct (the union ``offload_rule_consts`` in
native/offload_native.h) and the numba kernels take it as arguments, so the two cannot
drift apart by a bit. The torch backend does not fold: it is the reference.

The ``*_args`` functions bind a rule's keyword hyperparameters (torch's names and
defaults) into the tuple its backend method takes, refusing bad values in torch's words, so
every backend refuses the same input the same way.
"""
from __future__ import annotations

import struct
from array import array
from typing import Any, Callable, NamedTuple, Optional, Tuple

from ._checks import check_grad_scale

__all__ = ["SgdConsts", "AdagradConsts", "LionConsts", "fold_sgd", "fold_adagrad", "fold_lion",
           "sgd_args", "sgd_plain_args", "adagrad_args", "lion_args", "RuleFoldCache",
           "MOMENTUM_NONE", "MOMENTUM_FIRST", "MOMENTUM_NEXT"]

# How an SGD step treats its momentum buffer: none (momentum 0: untouched, as torch leaves
# it), the first step (buf = d_p, no dampening: torch's clone), a later step.
MOMENTUM_NONE, MOMENTUM_FIRST, MOMENTUM_NEXT = 0, 1, 2


def _f32(*values: float) -> Tuple[float, ...]:
    """Each double rounded to float32 as C's cast rounds (an infinity past float32's range,
    where ``struct`` would raise)."""
    return tuple(array("f", values).tolist())


def _lerp(w: float) -> Tuple[float, bool]:
    """torch.lerp's weight ``w`` (a float32 value) as the kernels take it: ``(w, False)``
    from the start, or ``(w - 1, True)`` from the end when ``|w| >= 0.5`` (a NaN goes
    from the end, as in torch.lerp); ``w - 1`` of a float32 w is exact in double, so one
    rounding gives the float32 difference (as adam_consts does)."""
    if abs(w) < 0.5:
        return w, False
    return _f32(w - 1.0)[0], True


class SgdConsts(NamedTuple):
    grad_scale: float
    """Grad multiplier, negated when maximizing."""
    weight_decay: float
    momentum: float
    one_minus_dampening: float
    neg_lr: float
    use_wd: bool
    momentum_mode: int
    """MOMENTUM_NONE, MOMENTUM_FIRST or MOMENTUM_NEXT."""
    nesterov: bool


class AdagradConsts(NamedTuple):
    grad_scale: float
    weight_decay: float
    eps: float
    neg_clr: float
    """``-lr / (1 + (step - 1) * lr_decay)``."""
    use_wd: bool


class LionConsts(NamedTuple):
    grad_scale: float
    decay: float
    """``1 - lr * weight_decay`` (1 without weight decay: the multiply is then exact)."""
    coeff1: float
    """torch.lerp's weight ``1 - beta1`` (or that minus 1, from the end) for the update."""
    coeff2: float
    """The same for ``1 - beta2``, the moment's own lerp."""
    neg_lr: float
    from_end1: bool
    from_end2: bool


def fold_sgd(lr, momentum, dampening, weight_decay, nesterov, maximize, grad_scale,
             step) -> SgdConsts:
    """SGD's scalars for ``step`` (1 on the first step: the buffer starts as ``d_p``)."""
    lr, momentum, dampening = float(lr), float(momentum), float(dampening)
    weight_decay, grad_scale = float(weight_decay), float(grad_scale)
    f = _f32(-grad_scale if maximize else grad_scale, weight_decay, momentum,
             1.0 - dampening, -lr)
    mode = MOMENTUM_NONE if momentum == 0 else MOMENTUM_FIRST if step == 1 else MOMENTUM_NEXT
    return SgdConsts(*f, weight_decay != 0, mode, bool(nesterov) and momentum != 0)


def fold_adagrad(lr, lr_decay, weight_decay, eps, maximize, grad_scale, step) -> AdagradConsts:
    lr, lr_decay, weight_decay = float(lr), float(lr_decay), float(weight_decay)
    grad_scale = float(grad_scale)
    # torch's step is a float tensor read back as a Python float; lr_decay >= 0 is checked,
    # so the divisor is >= 1
    clr = lr / (1 + (float(step) - 1) * lr_decay)
    f = _f32(-grad_scale if maximize else grad_scale, weight_decay, float(eps), -clr)
    return AdagradConsts(*f, weight_decay != 0)


def fold_lion(lr, beta1, beta2, weight_decay, maximize, grad_scale) -> LionConsts:
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    weight_decay, grad_scale = float(weight_decay), float(grad_scale)
    gs, decay, w1, w2, neg_lr = _f32(-grad_scale if maximize else grad_scale,
                                     1.0 - lr * weight_decay, 1.0 - beta1, 1.0 - beta2, -lr)
    c1, e1 = _lerp(w1)
    c2, e2 = _lerp(w2)
    return LionConsts(gs, decay, c1, c2, neg_lr, e1, e2)


# ---- keyword binding and checks (torch.optim's messages) ----

def _real(name: str, value: Any) -> float:
    """``float(value)``: a Python or numpy number, or a one-element tensor (torch.optim
    accepts a tensor lr), as fold_adam reads them; not a bool (a flag in the wrong place)
    nor a string."""
    if not isinstance(value, (bool, str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")


def _nonneg(name: str, value: Any, label: str) -> float:
    x = _real(name, value)
    if not 0.0 <= x:  # NaN fails too
        raise ValueError(f"Invalid {label}: {value}")
    return x


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def sgd_args(step, *, lr, momentum, dampening=0.0, weight_decay=0.0, nesterov=False,
             maximize=False, grad_scale=1.0) -> tuple:
    """``fold_sgd``'s arguments; the checks of torch.optim.SGD's values. Nesterov with no
    momentum or with dampening is taken, as torch's step takes a group edited so after its
    constructor refused it (Nesterov is then ignored without momentum, and with dampening
    the update is d_p + momentum * buf of the damped buffer); offload.SGD's constructor
    refuses it, as torch's."""
    lr = _nonneg("lr", lr, "learning rate")
    momentum = _nonneg("momentum", momentum, "momentum value")
    dampening = _real("dampening", dampening)
    weight_decay = _nonneg("weight_decay", weight_decay, "weight_decay value")
    _flag("nesterov", nesterov)
    _flag("maximize", maximize)
    check_grad_scale(grad_scale)
    return (lr, momentum, dampening, weight_decay, nesterov, maximize, grad_scale, step)


def sgd_plain_args(step, *, lr, weight_decay=0.0, maximize=False, grad_scale=1.0) -> tuple:
    """SGD without momentum: ``fold_sgd``'s arguments with momentum 0."""
    return sgd_args(step, lr=lr, momentum=0.0, weight_decay=weight_decay, maximize=maximize,
                    grad_scale=grad_scale)


def adagrad_args(step, *, lr, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False,
                 grad_scale=1.0) -> tuple:
    """``fold_adagrad``'s arguments; the checks of torch.optim.Adagrad."""
    lr = _nonneg("lr", lr, "learning rate")
    lr_decay = _nonneg("lr_decay", lr_decay, "lr_decay value")
    weight_decay = _nonneg("weight_decay", weight_decay, "weight_decay value")
    eps = _nonneg("eps", eps, "epsilon value")
    _flag("maximize", maximize)
    check_grad_scale(grad_scale)
    return (lr, lr_decay, weight_decay, eps, maximize, grad_scale, step)


def lion_args(step, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False,
              grad_scale=1.0) -> tuple:
    """``fold_lion``'s arguments (lion-pytorch's defaults; ``step`` is not used: Lion has
    no bias correction)."""
    lr = _nonneg("lr", lr, "learning rate")
    betas = tuple(_real(f"beta{k + 1}", b) for k, b in enumerate((beta1, beta2)))
    for index, beta in enumerate(betas):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    beta1, beta2 = betas
    weight_decay = _nonneg("weight_decay", weight_decay, "weight_decay value")
    _flag("maximize", maximize)
    check_grad_scale(grad_scale)
    return (lr, beta1, beta2, weight_decay, maximize, grad_scale)


class RuleFoldCache:
    """``convert(fold(*hyper))`` remembering its last result, keyed by the exact bits of
    ``hyper`` as doubles (see adam_consts.FoldCache: every param of a group folds the same
    scalars in one step). The tuples the ``*_args`` functions return are plain numbers and
    bools, checked there."""

    def __init__(self, fold: Callable[..., tuple], nargs: int,
                 convert: Callable[[tuple], Any] = lambda c: c) -> None:
        self._fold = fold
        self._key = struct.Struct(f"={nargs}d")
        self._convert = convert
        self._last: Tuple[Optional[bytes], Any] = (None, None)

    def __call__(self, hyper: tuple) -> Any:
        key = self._key.pack(*hyper)
        last = self._last
        if last[0] == key:
            return last[1]
        value = self._convert(self._fold(*hyper))
        self._last = (key, value)
        return value

