"""``differentiable=True``: torch's own optimizer, said so with a warning.

[Note: differentiable steps are torch's] ``differentiable=True`` asks for a step that autograd
can differentiate through (meta-learning: a loss after the step, its gradient with respect to
the params before it, or to a Tensor lr). The kernels here update params and states in place
through raw pointers, outside autograd, and the swap stores keep no graph; they cannot honour
it. It used to be refused; but a model that asks for it wants torch's semantics, and torch's
own optimizer test suite builds every optimizer with it (48 of its 180 CPU tests stopped at the
refusal). So ``offload.Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` called with
``differentiable=True`` return torch's optimizer of the same name, built with the same
arguments, and warn once that nothing is offloaded. Offload's own options cannot apply to it:
any of them set to other than its default is refused (NotImplementedError, as before), and
so is a subclass (whose overrides torch's class would drop). Lion has no ``differentiable``.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict

import torch

__all__ = ["TorchWhenDifferentiable"]

_DEFAULTS: Dict[str, Any] = {"offload": "none", "backend": None, "swap_dir": None, "max_host_bytes": None,
                             "sub_group_size": None, "verify": False, "resume": False, "io_engine": None,
                             "num_threads": None, "max_grad_norm": None, "stage": None, "process_group": None,
                             "state_dtype": "float32", "master_dtype": None, "release_grads": False,
                             "bias_correction": True}
"""Each offload option (``options.OPTIMIZER_OPTIONS``, and Adam's ``bias_correction``) at
the value that changes nothing in a torch optimizer."""

_warned: set = set()


class TorchWhenDifferentiable:
    """Mixin of offload's optimizers that torch has (see the note): ``TORCH_CLASS``."""

    TORCH_CLASS: Any = None

    def __new__(cls, *args: Any, **kwargs: Any):
        if kwargs.get("differentiable") is not True or cls.__dict__.get("TORCH_CLASS") is None:
            return super().__new__(cls)  # (the constructor refuses a subclass's differentiable=True)
        ours = [k for k, v in kwargs.items() if k in _DEFAULTS and not _is_default(k, v)]
        if ours:
            raise NotImplementedError(
                f"offload.{cls.__name__}: differentiable=True is torch.optim.{cls.__name__}'s own step (the "
                f"kernels update the states in place outside autograd), and {', '.join(map(repr, ours))} cannot "
                "apply to it: drop them, or differentiable=False")
        torch_kwargs = {k: v for k, v in kwargs.items() if k not in _DEFAULTS}
        opt = cls.TORCH_CLASS(*args, **torch_kwargs)
        if cls not in _warned:
            _warned.add(cls)
            warnings.warn(f"offload.{cls.__name__}(differentiable=True) is torch.optim.{cls.__name__}: autograd "
                          "through the step needs torch's own update, so nothing is offloaded (states beside the "
                          "params, torch's kernels)", UserWarning, stacklevel=2)
        return opt


def _is_default(key: str, value: Any) -> bool:
    if key == "stage" and value == 0 and type(value) is int:  # stage 0: nothing partitioned, as torch's
        return True
    want = _DEFAULTS[key]
    return value is want or (isinstance(value, type(want)) and not isinstance(value, torch.Tensor) and value == want)
