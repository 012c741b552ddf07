"""Text for stage 3 and parameter offload: the lines ``render`` adds to a plan's table and
its ``--explain`` derivation (see [Note: stage 3 bytes] in ``stage3``)."""
from __future__ import annotations

from typing import Any, List, Optional

__all__ = ["sharding_table_lines", "sharding_explain_lines"]

_GiB = float(1 << 30)


def _gib(n: float) -> str:
    return f"{n / _GiB:.2f}"


def _ms(t: Optional[float]) -> str:
    return "?" if t is None else f"{t * 1e3:.1f} ms"


def _io_lines(plan: Any) -> List[str]:
    io, st = plan.sharding["io"], plan.step
    pr, gw = io["param_read_bytes"], io["grad_write_bytes"]
    if not (pr or gw):
        return []
    parts = []
    if pr:
        parts.append(f"param reads {_gib(pr)} GiB (forward and backward gathers)")
    if gw:
        parts.append(f"grad writes {_gib(gw)} GiB")
    rates = ("" if st.get("disk_read_gbps") is None or st.get("disk_write_gbps") is None
             else f" at {st['disk_read_gbps']:.2f} / {st['disk_write_gbps']:.2f} GB/s read / write")
    return [f"forward + backward on NVMe: {' + '.join(parts)}: at least {_ms(io['fwd_bwd_io_s'])}{rates}",
            f"NVMe I/O per training step: {_ms(io['train_step_io_s'])} (forward + backward, then the optimizer "
            f"step's state I/O {_gib(io['state_read_bytes'])} GiB read and written, grad reads "
            f"{_gib(io['grad_read_bytes'])} GiB, param writes {_gib(io['param_write_bytes'])} GiB)"]


def sharding_table_lines(plan: Any) -> List[str]:
    """Stage 3: the units, the shard, the live window and the NVMe traffic (nothing otherwise)."""
    sh = plan.sharding
    if "units" not in sh:
        return []
    bound = "" if sh["max_live_params"] is None else f", bounded by {sh['max_live_params']:,} elements"
    assumed = " (assumed: no unit size given)" if sh["units_assumed"] else ""
    return [
        f"stage 3: a root unit of {sh['root_numel']:,} params and {sh['units']:,} units, the largest "
        f"{sh['unit_numel_max']:,} params{assumed}; this rank's shard {sh['shard_numel']:,} elements; "
        f"param shards offload_params={sh['offload_params']}",
        f"live window: the root and {sh['window_units']} gathered unit(s) = {sh['window_numel']:,} elements "
        f"(prefetch {sh['prefetch']}{bound})",
    ] + _io_lines(plan)


def sharding_explain_lines(plan: Any) -> List[str]:
    """The stage-3 formulas with this plan's values, in place of the stage 0-2 lines."""
    sh, i = plan.sharding, plan.inputs
    states = "exp_avg + exp_avg_sq (8 B x S: the fp32 CPU shard is its own master)" if sh["own_master"] else \
        "fp32 master + exp_avg + exp_avg_sq (12 B x S)"
    return [
        f"  stage 3: a root unit u_0 = {sh['root_numel']:,} params (gathered for the whole forward and backward) "
        f"and {sh['units']:,} fetch units; chunk_i = ceil(u_i / N_d) rounded up to 256 elements; "
        f"S = sum chunk_i = {sh['shard_numel']:,} elements per rank (largest chunk {sh['chunk_max']:,})",
        f"  live window ({'device' if i['param_device'] != 'cpu' else 'host memory'}): the root and the 1 + "
        f"prefetch largest gathered units (N_d x chunk_i, {i['param_dtype']}), bounded by max_live: "
        f"{sh['window_numel']:,} elements; "
        f"plus the full grads of the root and the largest unit while reduce-scattered "
        f"({sh['root_numel'] + sh['unit_numel_max']:,} elements, "
        f"{i['grad_dtype']}) and, with N_d > 1, the float32 buckets of the reduce-scatter in flight",
        f"  param shards S x param bytes where offload_params={sh['offload_params']} puts them; grad shards "
        f"S x grad bytes where the states live (offload={i['offload']}); {states}",
        "  NVMe per step: param shards read twice (forward and backward gathers) and written once (the update), "
        "grad shards written in backward and read by the step, states read and written once",
    ]
