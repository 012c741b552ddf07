"""The per-param checks of SwappedState (fp32 CPU params updated in place), the kernel
keywords of a step's hyperparameters (an ``AdamHyper``/``RuleHyper`` or a dict of Adam's) and
a step's work items."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from offload.kernels.quant import rounding_seed
from offload.optim.swapped_shards import WorkItem

__all__ = ["check_params", "kernel_kwargs", "work_items"]

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


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as one dimension."""
    return t if t.dim() == 1 else t.view(-1)


def work_items(batches: Sequence[Tuple[Any, Sequence[Tuple[torch.Tensor, torch.Tensor, int]]]],
               params: List[torch.Tensor], index: Dict[int, int], offsets: List[int], rule: Any, rounds: bool,
               param_index: Callable[[torch.Tensor], int]) -> Dict[int, WorkItem]:
    """SwappedState's work item of each param that has a grad (param ``i`` at ``offsets[i]``
    of its one shard): its whole range, its output the param. The params of a group at one
    step share one kwargs dict: the core steps them in one kernel call ([Note: one kernel call
    per sub-group] in swapped_compute.py). ``param_index(p)`` raises for a foreign tensor."""
    work: Dict[int, WorkItem] = {}
    for hyper, items in batches:
        mine = getattr(hyper, "rule", rule.base)
        if not rule.holds(mine):
            raise ValueError(f"a step of rule {mine.name!r} in a swap store of rule {rule.name!r} "
                             f"(states {list(rule.names)}); build a new optimizer after changing "
                             "what the groups need (e.g. SGD's momentum from 0, amsgrad)")
        mine = None if mine is rule.base else mine  # another group's rule: on its own fields
        shared: Dict[int, Dict[str, Any]] = {}  # step -> its kwargs
        for p, grad, step in items:
            i = index.get(id(p))
            if i is None or params[i] is not p:
                i = param_index(p)
            if i in work:
                raise ValueError(f"param {i} appears twice in one step")
            n, step = p.numel(), int(step)
            if grad.numel() != n or not grad.is_cpu:
                raise ValueError(f"param {i}: grad of {grad.numel()} elements on {grad.device}, expected {n} on cpu")
            if step < 1:
                raise ValueError(f"param {i}: step must be >= 1, got {step}")
            kw = shared.get(step)
            if kw is None or rounds:
                kw = shared[step] = kernel_kwargs(hyper, step)
            if rounds:  # the host store's streams: the param's index, its own elements
                kw.update(rounding_seed=rounding_seed(step, i), element_offset=0)
            # a non-contiguous param steps through a contiguous copy, written back once the
            # step went through (a failed step leaves it as it was)
            # (a contiguous 1-D tensor detached is its flat view already: a view(-1) costs ~0.9 us)
            out = _flat(p.detach()) if p.is_contiguous() else p.detach().reshape(-1).contiguous()  # one copy
            g = _flat(grad.detach()) if grad.is_contiguous() else grad.detach().reshape(-1).contiguous()
            work[i] = WorkItem(0, offsets[i], offsets[i] + n, g, kw, out, "master", None, mine)
    return work
