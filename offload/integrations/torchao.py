"""torchao's ``CPUOffloadOptimizer(params, optimizer_class, *, offload_gradients, **kwargs)`` call,
answered by an offload optimizer.

torchao's (and torchtune's, which wraps it) keeps a GPU model's optimizer states on the host and
runs ``optimizer_class`` there with torch's CPU kernels, one optimizer per param. A config or a
script that names it changes its import only::

    from offload.integrations.torchao import CPUOffloadOptimizer
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=1e-4, fused=True)

and gets the offload optimizer of that rule (states in host memory, ``offload="cpu"``, unless
``offload="nvme"`` and ``swap_dir=`` among the keywords put them on disk; SIMD kernels; the
grads of CUDA params copied to pinned host buffers by backward hooks). ``optimizer_class`` (a class or its dotted path, as torchtune's
configs give it) picks the rule:

| optimizer_class | offload |
|---|---|
| ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` / ``Adagrad``, or offload's own classes | ``offload.AdamW`` / ``Adam`` / ``SGD`` / ``Adagrad`` |
| torchao's ``AdamW8bit`` / ``Adam8bit`` | ``offload.AdamW`` / ``Adam`` with ``state_dtype="int8"`` (offload's block-wise code, blocks of 256, not torchao's bits) |
| torchao's ``AdamW`` / ``Adam`` | ``offload.AdamW`` / ``Adam`` |
| ``bf16_stochastic_round=True`` (torchao's) | ``master_dtype="bfloat16"``: bf16 params are their own master, stochastically rounded (bf16 params only) |

Anything else (torchao's 4-bit and FP8 states, another library's optimizer) is a ``ValueError``
naming what is supported: offload runs its own kernels, not ``optimizer_class``.
``offload_gradients=True`` is ``release_grads=True`` (each device grad is freed once it is on the
host; gradient accumulation works with it, which torchao's does not support). The return value is the offload
optimizer itself (a ``torch.optim.Optimizer``: LR schedulers, ``state_dict`` in torch's layout),
not a wrapper of one optimizer per param, so its ``state_dict()`` is not torchao's list of dicts.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

import offload

__all__ = ["CPUOffloadOptimizer"]

_TORCH = ("AdamW", "Adam", "SGD", "Adagrad")  # torch.optim's classes offload has, by the same names
_OURS = _TORCH + ("Lion",)
_TORCHAO_8BIT = {"AdamW8bit": "AdamW", "Adam8bit": "Adam"}
_TORCHAO_PLAIN = {"AdamW": "AdamW", "Adam": "Adam", "_AdamW": "AdamW", "_Adam": "Adam"}
_SUPPORTED = ("torch.optim.AdamW, Adam, SGD, Adagrad; offload's optimizers; torchao's AdamW8bit, Adam8bit, "
              "AdamW and Adam")


def _name_of(optimizer_class: Any) -> Tuple[str, str]:
    """(module, class name) of a class or of a dotted path such as "torch.optim.AdamW"."""
    if isinstance(optimizer_class, str):
        module, _, name = optimizer_class.rpartition(".")
        return module, name
    if isinstance(optimizer_class, type):
        return optimizer_class.__module__, optimizer_class.__name__
    raise TypeError(f"CPUOffloadOptimizer: optimizer_class must be an optimizer class or its dotted path, "
                    f"got {optimizer_class!r}")


def _rule(optimizer_class: Any, kwargs: Dict[str, Any]) -> Tuple[type, Dict[str, Any]]:
    """The offload class for ``optimizer_class`` and the keywords it adds (module docstring's table)."""
    module, name = _name_of(optimizer_class)
    root = module.split(".")[0]
    if (module.startswith("torch.optim") and name in _TORCH) or (root == "offload" and name in _OURS):
        return getattr(offload, name), {}
    if root == "torchao" and (name in _TORCHAO_8BIT or name in _TORCHAO_PLAIN):
        extra = {"master_dtype": "bfloat16"} if kwargs.get("bf16_stochastic_round", False) else {}
        if name in _TORCHAO_PLAIN:
            return getattr(offload, _TORCHAO_PLAIN[name]), extra
        if kwargs.get("block_size", 256) != 256:
            raise ValueError(f"CPUOffloadOptimizer: offload's int8 states use blocks of 256, got block_size="
                             f"{kwargs['block_size']!r}")
        return getattr(offload, _TORCHAO_8BIT[name]), {"state_dtype": "int8", **extra}
    raise ValueError(f"CPUOffloadOptimizer: offload runs its own kernels and has none for {module}.{name}; "
                     f"supported: {_SUPPORTED}")


def CPUOffloadOptimizer(params: Any, optimizer_class: Any = torch.optim.AdamW, *,  # noqa: N802 (torchao's name)
                        offload_gradients: bool = False, **kwargs: Any) -> torch.optim.Optimizer:
    """The offload optimizer torchao's ``CPUOffloadOptimizer(params, optimizer_class, ...)`` asks
    for (module docstring). ``kwargs``: ``optimizer_class``'s arguments and offload's options."""
    if not isinstance(offload_gradients, bool):
        raise TypeError(f"CPUOffloadOptimizer: offload_gradients must be True or False, got {offload_gradients!r}")
    cls, extra = _rule(optimizer_class, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("block_size", "bf16_stochastic_round")}
    for key, value in extra.items():
        if key in kwargs and kwargs[key] != value:
            raise ValueError(f"CPUOffloadOptimizer: {key}={kwargs[key]!r} contradicts optimizer_class "
                             f"{_name_of(optimizer_class)[1]} ({key}={value!r})")
    kwargs = {**extra, **kwargs}
    kwargs.setdefault("offload", "cpu")
    if offload_gradients:
        kwargs["release_grads"] = True
    return cls(params, **kwargs)
