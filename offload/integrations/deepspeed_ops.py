"""DeepSpeed's CPU optimizers by their own names and arguments, on offload's kernels and stores.

A script (or a test suite) written for ``deepspeed.ops.adam.DeepSpeedCPUAdam``,
``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`` or ``deepspeed.ops.lion.DeepSpeedCPULion``
changes its import only::

    from offload.integrations.deepspeed_ops import DeepSpeedCPUAdam
    opt = DeepSpeedCPUAdam(model.parameters(), lr=3e-4, weight_decay=0.1)   # AdamW, as DeepSpeed's

Each class takes DeepSpeed's positional arguments and defaults (``adamw_mode=True``: decoupled
weight decay; ``weight_decay=0``; Adagrad ``lr=1e-2, eps=1e-10``; Lion ``lr=1e-3,
betas=(0.9, 0.999)``), and every keyword of the offload optimizer it is (``offload="nvme"``,
``swap_dir``, ``max_grad_norm``, ``stage``, ...). Where it differs from DeepSpeed's, on purpose:

- ``fp32_optimizer_states=False`` keeps the states in bfloat16 (``state_dtype="bfloat16"``)
  when every param is bfloat16 or float16 (DeepSpeed keeps them in each param's dtype, float16
  for float16 params; bfloat16 holds float16's range and more); float32 params keep float32
  states, as DeepSpeed's; float32 and low-precision params together are refused (one state
  dtype per optimizer here): pass ``state_dtype`` instead.
- bfloat16 / float16 params get an fp32 master (DeepSpeed's CPU optimizers update such params
  in place with nothing kept between steps but the rounded param); ``master_dtype="bfloat16"``
  keeps none, rounding stochastically.
- ``stage=0`` unless given: each rank steps the params it is given and talks to no other,
  as DeepSpeed's CPU optimizers do under DeepSpeed's engine, which hands each rank its own
  partition (flat tensors of one size on every rank: at the default stage 2 of several ranks
  they were averaged and sharded together, silently wrong). Pass ``stage=2`` to have the
  optimizer partition the states of params that every rank holds whole.
- ``amsgrad=True`` is Adam's AMSGrad (DeepSpeed's CPU Adam accepts the flag and ignores it);
  DeepSpeedCPUAdagrad's ``amsgrad``, which DeepSpeed ignores too, must stay False here.
- ``bias_correction`` is the optimizer's, for every group (DeepSpeed's may differ per group: a
  group that asks for another value is refused).
- the states are torch's: every ``"step"`` a tensor, ``state_dict()`` torch's layout (Adagrad's
  ``"sum"``, which ``opt.state[p]["exp_avg_sq"]`` reads too, and ``load_state_dict`` takes
  DeepSpeed's layout: [Note: DeepSpeed's state names] in deepspeed_names.py); params on a GPU
  are stepped (their states on the host), where DeepSpeed's CPU optimizers assert.

``DeepSpeedCPUAdam.step_subgroup`` / ``rollback_subgroup`` are DeepSpeed's sub-group calls:
[Note: DeepSpeed's sub-group steps] in deepspeed_subgroups.py.
"""
from __future__ import annotations

from typing import Any, Iterable, Tuple

import torch

from offload.integrations.deepspeed_names import NamedState, deepspeed_layout_to_torch
from offload.integrations.deepspeed_subgroups import SubgroupSteps
from offload.optim import Adagrad, Adam, Lion

__all__ = ["DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion"]

_LOW = (torch.bfloat16, torch.float16)


def _once(x: Any) -> bool:
    """Whether ``x`` is an iterator that reading the dtypes would use up (a generator,
    ``model.parameters()``): not a tensor, list, tuple, set or dict, which torch judges itself."""
    return isinstance(x, Iterable) and not isinstance(x, (torch.Tensor, list, tuple, set, frozenset, dict))


def _listed(model_params: Any) -> Any:
    """``model_params`` with every one-shot iterator made a list, so that the dtypes can be
    read before the optimizer takes them; anything else as given, for torch's own errors."""
    if not (_once(model_params) or isinstance(model_params, (list, tuple))):
        return model_params
    out = []
    for item in model_params:
        if isinstance(item, dict) and _once(item.get("params")):
            item = {**item, "params": list(item["params"])}
        out.append(item)
    return out


def _dtypes(params: Any) -> set:
    """The dtypes of the tensors among ``params`` (a list of tensors or of param groups)."""
    found = set()
    for item in params if isinstance(params, list) else ():
        group = item.get("params", ()) if isinstance(item, dict) else [item]
        group = [group] if isinstance(group, torch.Tensor) else group
        if isinstance(group, Iterable):
            found.update(p.dtype for p in group if isinstance(p, torch.Tensor))
    return found


def _states(cls_name: str, params: Any, fp32_optimizer_states: Any, kwargs: dict) -> Tuple[Any, dict]:
    """(params as a list, the offload keywords with ``state_dtype`` from
    ``fp32_optimizer_states``): the module docstring's first point."""
    if not isinstance(fp32_optimizer_states, bool):
        raise TypeError(f"{cls_name}: fp32_optimizer_states must be True or False, got {fp32_optimizer_states!r}")
    params = _listed(params)
    kwargs = {"stage": 0, **kwargs}  # each rank steps what it is given, as DeepSpeed's: the module docstring
    if fp32_optimizer_states:
        return params, kwargs
    if "state_dtype" in kwargs:
        raise ValueError(f"{cls_name}: give fp32_optimizer_states=False or state_dtype, not both")
    dtypes = _dtypes(params)
    low = dtypes & set(_LOW)
    if low and dtypes - set(_LOW):
        raise ValueError(f"{cls_name}: fp32_optimizer_states=False keeps the states in the params' dtype, and these "
                         f"params mix {sorted(str(d) for d in dtypes)}; offload keeps one state dtype per "
                         "optimizer: pass state_dtype='bfloat16' (or 'float32', 'int8') instead")
    return params, {**kwargs, "state_dtype": "bfloat16"} if low else kwargs


def _one_bias_correction(params: Any, bias_correction: Any) -> None:
    """DeepSpeed reads ``bias_correction`` per param group; offload's Adam has one for the
    optimizer: a group that asks for another is refused, not stepped with the wrong one."""
    for i, item in enumerate(params if isinstance(params, list) else ()):
        if isinstance(item, dict) and "bias_correction" in item and item["bias_correction"] != bias_correction:
            raise ValueError(f"DeepSpeedCPUAdam: param group {i} has bias_correction={item['bias_correction']!r}, "
                             f"the optimizer {bias_correction!r}; offload applies one bias_correction to every "
                             "group: build one optimizer per setting")


class DeepSpeedCPUAdam(SubgroupSteps, Adam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``'s arguments on :class:`offload.Adam`
    (``adamw_mode=True``: AdamW); the module docstring says where it differs."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True,
                 **offload_kwargs: Any) -> None:
        if not isinstance(adamw_mode, bool):
            raise TypeError(f"DeepSpeedCPUAdam: adamw_mode must be True or False, got {adamw_mode!r}")
        params, offload_kwargs = _states("DeepSpeedCPUAdam", model_params, fp32_optimizer_states, offload_kwargs)
        _one_bias_correction(params, bias_correction)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay=adamw_mode,
                         bias_correction=bias_correction, **offload_kwargs)
        self.adam_w_mode = adamw_mode  # (DeepSpeed's attribute names)
        self.fp32_optimizer_states = fp32_optimizer_states


class DeepSpeedCPUAdagrad(Adagrad):
    """``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``'s arguments on :class:`offload.Adagrad`."""

    def __init__(self, model_params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True, **offload_kwargs: Any) -> None:
        if amsgrad is not False:
            raise ValueError("DeepSpeedCPUAdagrad: amsgrad has no meaning for Adagrad (DeepSpeed ignores it); "
                             "leave it False")
        params, offload_kwargs = _states("DeepSpeedCPUAdagrad", model_params, fp32_optimizer_states, offload_kwargs)
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, **offload_kwargs)
        self.fp32_optimizer_states = fp32_optimizer_states

    # [Note: DeepSpeed's state names]: opt.state is a NamedState wherever torch sets it
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and isinstance(value, dict) and not isinstance(value, NamedState):
            value = NamedState(value)
        super().__setattr__(name, value)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # (torch's __dict__.update: __setattr__ did not see it)
        if not isinstance(self.__dict__.get("state"), NamedState):
            self.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(deepspeed_layout_to_torch(state_dict, self.defaults))


class DeepSpeedCPULion(Lion):
    """``deepspeed.ops.lion.DeepSpeedCPULion``'s arguments on :class:`offload.Lion`."""

    def __init__(self, model_params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True, **offload_kwargs: Any) -> None:
        params, offload_kwargs = _states("DeepSpeedCPULion", model_params, fp32_optimizer_states, offload_kwargs)
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, **offload_kwargs)
        self.fp32_optimizer_states = fp32_optimizer_states
