"""The ZeRO stage an optimizer takes when nothing names one.

[Note: inside ZeroRedundancyOptimizer] With several ranks an offload optimizer partitions its
states itself (stage 2): every rank must pass the same params (comm.agree_on_params checks
their shapes, dtypes and order). torch's ``ZeroRedundancyOptimizer(params,
optimizer_class=offload.AdamW)`` instead builds the inner optimizer over each rank's own part
of the params, so the ranks pass different tensors; where those parts have the same shapes
(two equal layers split between two ranks) the agreement could not tell, and stage 2 averaged
and sharded one rank's layer with the other's, silently wrong (forty-fourth session). Built
from ZeroRedundancyOptimizer's ``_init_local_optimizer`` (found by a frame walk, as
shard/callers.py finds DCP), the default is stage 0: the wrapper is the partitioning. Another
stage is refused, and so is ``max_grad_norm``, which would clip each rank's part by its own
norm (clip the whole model's grads before ``step()`` instead)."""
from __future__ import annotations

from typing import Optional

__all__ = ["default_stage"]

_ZERO = "torch.distributed.optim.zero_redundancy_optimizer"
_ZERO_BUILDS = frozenset({"_init_local_optimizer"})


def default_stage(stage: Optional[int], world: int, max_grad_norm: Optional[float], cls_name: str) -> int:
    """``stage``, or the default for ``world`` ranks: see the note above."""
    if world <= 1:
        return 0 if stage is None else stage
    from offload.shard.callers import caller

    if caller(_ZERO_BUILDS, _ZERO) is None:
        return 2 if stage is None else stage
    where = (f"inside torch's ZeroRedundancyOptimizer each of the {world} ranks builds its "
             f"offload.{cls_name} over its own part of the params")
    if stage not in (None, 0):
        raise ValueError(f"stage={stage}: {where}, which stage 1-3 would partition again across the ranks as if "
                         "they held the same params; leave stage out (stage 0 there), or drop the wrapper and "
                         f"pass all the params to offload.{cls_name} with stage={stage}")
    if max_grad_norm is not None:
        raise ValueError(f"max_grad_norm={max_grad_norm}: {where}, so it would clip each part by its own norm, "
                         "not the model's; clip the grads of the whole model before step() "
                         "(torch.nn.utils.clip_grad_norm_), or drop the wrapper")
    return 0
