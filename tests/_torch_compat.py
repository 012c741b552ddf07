"""What the installed torch does where its releases differ, probed (not read from a version
number). Tests compare with torch, and the oldest torch setup.cfg allows (2.6) does these
few things otherwise than the torch the set-up installs (2.13); offload keeps the newer
behaviour, and a test compares with the older only where it says so."""
from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["adam_group_keys_missing", "adagrad_steps_a_param_without_sum", "adamw_is_adam",
           "dcp_unflatten_tolerates_missing_keys", "adam_steps_with_tensor_hyperparameters", "plain_hyperparameters"]


@functools.lru_cache(maxsize=None)
def adam_group_keys_missing() -> frozenset:
    """Group keys of offload.Adam that torch's Adam lacks (torch 2.6: decoupled_weight_decay,
    an argument of later releases)."""
    if "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters:
        return frozenset()
    return frozenset({"decoupled_weight_decay"})


@functools.lru_cache(maxsize=None)
def adagrad_steps_a_param_without_sum() -> bool:
    """torch's Adagrad makes a param's "sum" at its first step (later releases) rather than
    only at construction (2.6: a param whose state was cleared or not loaded is a KeyError)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adagrad([p])
    opt.state.clear()
    p.grad = torch.ones(2)
    try:
        opt.step()
    except KeyError:
        return False
    return True


def adamw_is_adam() -> bool:
    """torch's AdamW is Adam with decoupled weight decay (later releases: Adam's messages),
    not a class of its own (2.6: "AdamW does not support sparse gradients")."""
    return issubclass(torch.optim.AdamW, torch.optim.Adam)


def dcp_unflatten_tolerates_missing_keys() -> bool:
    """torch.distributed.checkpoint's unflatten of an optimizer dict rebuilds a key that
    opt.state[p] lists and the flattened dict lacks (later releases); 2.6 raises KeyError."""
    try:
        from torch.distributed.checkpoint import state_dict as dcp_sd
    except ImportError:
        return False
    return "_reconstruct_nested_dict" in inspect.getsource(dcp_sd._unflatten_optim_state_dict)


@functools.lru_cache(maxsize=None)
def adam_steps_with_tensor_hyperparameters() -> bool:
    """torch's Adam (foreach=False, not capturable) steps a CPU param with a Tensor lr and
    Tensor betas of any shape of one element, as Python numbers (later releases); 2.6 fails
    (addcdiv_ wants a Number; a [1, 1] beta broadcasts the moments to 2-D)."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01), betas=(torch.tensor([0.9]), torch.tensor([[0.99]])),
                           foreach=False)
    p.grad = torch.ones(3)
    try:
        opt.step()
    except (TypeError, RuntimeError):
        return False
    return True


def plain_hyperparameters(kwargs: dict) -> dict:
    """``kwargs`` with a Tensor lr and betas as the Python floats later torch releases step
    with, for a torch that cannot step with them (adam_steps_with_tensor_hyperparameters)."""
    if adam_steps_with_tensor_hyperparameters():
        return kwargs
    out = dict(kwargs)
    if isinstance(out.get("lr"), torch.Tensor):
        out["lr"] = float(out["lr"].item())
    if "betas" in out:
        out["betas"] = tuple(float(b.item()) if isinstance(b, torch.Tensor) else b for b in out["betas"])
    return out
