"""The per-param checks of SwappedState (fp32 CPU params updated in place) and the kernel
keywords of a step's hyperparameters (an ``AdamHyper``/``RuleHyper`` or a dict of Adam's)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

__all__ = ["check_params", "kernel_kwargs"]

_HYPER_KEYS = {"lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "bias_correction", "maximize",
               "grad_scale"}


def kernel_kwargs(hyper: Any, step: int) -> Dict[str, Any]:
    if hasattr(hyper, "kernel_kwargs"):
        return hyper.kernel_kwargs(step)
    if not isinstance(hyper, dict):
        raise ValueError(f"hyper must be an AdamHyper or a dict, got {type(hyper).__name__}")
    unknown = set(hyper) - _HYPER_KEYS
    missing = {"lr", "beta1", "beta2", "eps", "weight_decay", "decoupled"} - set(hyper)
    if unknown or missing:
        raise ValueError(f"hyper: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    return dict(hyper, step=step)


def check_params(params: List[torch.Tensor]) -> Dict[int, int]:
    """The index of each param by id; ValueError for one the in-place store cannot update.
    (A non-contiguous param is stepped through a contiguous copy: SwappedState.step.)"""
    index: Dict[int, int] = {}
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"param {i} is a {type(p).__name__}, not a tensor")
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"param {i}: offload='nvme' updates fp32 CPU params in place; got {p.dtype} "
                             f"on {p.device}")
        if id(p) in index:
            raise ValueError(f"param {i} is param {index[id(p)]} again (torch warns about duplicate "
                             "params and updates them twice per step); offload='nvme' with fp32 CPU params "
                             "needs each param once: remove the duplicate")
        index[id(p)] = i
    return index
