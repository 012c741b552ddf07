"""The search over stage and offload target: the cheapest configuration that fits."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from .estimate import _OFFLOADS, estimate
from .result import Plan

__all__ = ["cheapest_fitting"]


def cheapest_fitting(
    num_params: Any,
    *,
    stages: Sequence[int] = (0, 1, 2),
    offloads: Sequence[str] = _OFFLOADS,
    **kwargs: Any,
) -> Tuple[Optional[Plan], List[Plan]]:
    """The cheapest configuration that fits, and every candidate tried, cheapest first.

    Cost, in order: streaming states from disk (``nvme``) only when nothing in host memory
    fits; then the predicted step time (without rates: the shard each rank updates, which
    the kernel time follows); then the bytes held; then the higher stage (in this engine
    stage 2 moves fewer bytes over the network than stage 1: a reduce-scatter instead of an
    all-reduce before the same all-gather). ``none`` is left out when ``cpu`` is tried: this
    engine keeps the fp32 states on the host either way, so the two are the same plan. With
    one rank, stages 1 to 3 equal stage 0 and are skipped. Stage 3 is tried only when asked
    (``stages=(0, 1, 2, 3)``), with the param shards beside the compute (``offload_params``
    is not searched).
    """
    world = kwargs.get("world_size", 1)
    tried: List[Plan] = []
    for off in offloads:
        if off == "none" and "cpu" in offloads:
            continue
        for st in stages:
            if st > 0 and world == 1:
                continue
            # stage 3 frees the grads itself and refuses release_grads: its plan is the same without
            kw = {k: v for k, v in kwargs.items() if not (st == 3 and k == "release_grads")}
            tried.append(estimate(num_params, stage=st, offload=off, **kw))

    def cost(p: Plan) -> Tuple[Any, ...]:
        t = p.step_time_s
        return (p.inputs["offload"] == "nvme", t if t is not None else p.inputs["shard_numel"],
                sum(p.per_rank.values()), -p.inputs["stage"])

    tried.sort(key=cost)
    best = next((p for p in tried if p.fits_all), None)
    return best, tried
