"""The params side of ``from_deepspeed_config``: which tensors a call was given, whether a
model is sharded already and as the config says, their dtype against the config's precision,
and the optimizer's own checks run before a model is sharded in place (a shard is not undone)."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

__all__ = ["flat_params", "is_sharded", "check_dtypes", "check_options", "check_shard_matches"]


def flat_params(params: list) -> list:
    """The tensors of ``params`` (tensors or param groups), in order."""
    return [p for item in params for p in (item["params"] if isinstance(item, Mapping) else [item])]


def is_sharded(params: list) -> bool:
    """Whether ``params`` (tensors or groups) hold params of a model ``offload.shard`` changed."""
    return any(hasattr(p, "_offload_shard") for p in flat_params(params))


def check_dtypes(params: list, dtype: Optional[torch.dtype]) -> None:
    if dtype is None:  # "auto": the params' dtype is the precision
        return
    flat = flat_params(params)
    for i, p in enumerate(flat):
        if isinstance(p, torch.Tensor) and p.is_floating_point() and p.dtype != dtype:
            want = {torch.bfloat16: "bf16.enabled is true", torch.float16: "fp16.enabled is true"}.get(
                dtype, "neither bf16.enabled nor fp16.enabled is true")
            raise ValueError(
                f"param {i} is {p.dtype} but {want}: DeepSpeed casts the model itself, offload does not; "
                f"cast the model (model.to({dtype})) before building the optimizer, or change the config")


def check_options(cls: type, kwargs: Dict[str, Any]) -> None:
    """The optimizer's own checks of its hyperparameters and options (values, types, unknown
    keywords), run on one bf16 param before anything is sharded. What depends on the params
    (the host budget of the swap pipeline) is checked by the real constructor after."""
    placement = ("offload", "swap_dir", "max_host_bytes", "io_engine", "stage", "resume", "verify",
                 "process_group")
    probe = {k: v for k, v in kwargs.items() if k not in placement}
    cls([torch.zeros(1, dtype=torch.bfloat16, requires_grad=True)], **probe).close()


def check_shard_matches(model: torch.nn.Module, shard_kwargs: Dict[str, Any]) -> None:
    """A model sharded before keeps its settings; one the config would shard elsewhere is refused."""
    from offload.shard import runtime_of

    rt = runtime_of(model)
    on_disk = bool(getattr(rt, "params_on_disk", False)) if rt is not None else None
    if on_disk is not None and on_disk != (shard_kwargs.get("offload_params") == "nvme"):
        where = "in a file (offload_params='nvme')" if on_disk else "in memory"
        raise ValueError(f"zero_optimization.offload_param: the model was sharded already, with its param shards "
                         f"{where}, and the config says device {shard_kwargs.get('offload_params')!r}; build the "
                         "model anew to shard it otherwise")
