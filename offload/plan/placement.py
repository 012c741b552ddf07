"""Where this engine keeps each piece of a model's state: the tiers, the components, the
swap layer's own view of the bytes it will use, and the ZeRO paper's arithmetic.

The leaf of the planner: ``estimate`` (the bill), ``result`` (the ``Plan``) and ``render``
(its text) all read these; this module imports none of them.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["TIERS", "COMPONENTS", "OPTIMIZER_COMPONENTS", "SWAP_SLOTS", "swap_model", "buffer_tiers",
           "zero_paper_bytes"]

TIERS = ("device", "pinned", "pageable", "nvme")
COMPONENTS = (
    "params",        # the model's own parameters (user tensors)
    "grads",         # the model's own .grad tensors
    "master",        # fp32 master copy, when the param is not itself the fp32 master
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",  # Adam's amsgrad only
    "momentum_buffer",  # SGD with momentum
    "sum",           # Adagrad
    "grad_buffers",  # host buffers the grads are copied into (device params)
    "lowp_buffers",  # host buffers holding the fp16/bf16 copy of updated params (device params)
    "io_buffers",    # swap pipeline buffers (offload="nvme")
    "comm_buffers",  # per-bucket send/gather/reduce-scatter-out buffers of the collectives (stage >= 1, N_d > 1)
    "live_params",   # stage 3: the gathered units of the live window, in the param dtype
    "live_grads",    # stage 3: the full grads of the unit being reduce-scattered
)
# Pieces the optimizer allocates itself (what ``memory_report()`` can see); params and grads
# belong to the user's model, the live window and its grads to offload.shard's units (at
# stage 3 "params" and "grads" are this rank's shards of them).
OPTIMIZER_COMPONENTS = tuple(c for c in COMPONENTS[2:] if not c.startswith("live_"))

SWAP_SLOTS = 2
"""Each sub-group has two slots on disk, written alternately, so that a crash leaves one
complete step (offload/swap/store.py, [Note: two slots])."""


def swap_model(numel: int, nstates: Any, max_host_bytes: Optional[int], sub_group_size: Optional[int]) -> Dict[str, Any]:
    """What the swap layer will allocate for the states ``nstates`` (a count of fp32 states,
    or their typed fields: bf16 and packed int8 states take their own bytes) of ``numel``
    elements.

    Asks the swap layer itself (``plan_sub_groups`` and ``SwapLayout``) rather than copying
    its rules, so the plan follows the engine when the engine changes. Raises ``ValueError``
    (the engine's own message) when ``max_host_bytes`` cannot hold the pipeline.
    """
    from offload.swap import SwapLayout, pipeline_host_bytes, plan_sub_groups

    sg, nbuf = plan_sub_groups(numel, nstates, max_host_bytes, sub_group_size)
    layout = SwapLayout(numel, sg, nstates)
    # Every sub-group but the last is full: its padded bytes times their count, plus the last
    # (closed form: a tiny sub_group_size makes millions of sub-groups).
    g, full = layout.num_groups, layout.sub_group_size
    first, last = layout.group_range(g - 1)
    per_state = [SWAP_SLOTS * ((g - 1) * layout.padded_bytes(k, full) + layout.padded_bytes(k, last - first))
                 for k in range(layout.nstates)]
    # The pipeline maps one pool region for its buffers, rounded up to 2 MiB (huge pages).
    return {
        "sub_group_size": layout.sub_group_size,
        "num_groups": layout.num_groups,
        "buffers": nbuf,
        "region_bytes": layout.region_bytes,
        "host_bytes": pipeline_host_bytes(nbuf, layout.region_bytes),
        "file_bytes": layout.file_bytes,
        "slots": SWAP_SLOTS,
        "disk_bytes": SWAP_SLOTS * layout.file_bytes,
        "state_disk_bytes": per_state,
        "nstates": layout.nstates,
    }


def buffer_tiers(*, in_place: bool, device_params: bool, lowp: bool, ranks: int, cuda: bool) -> Dict[str, str]:
    """The tier of each buffer the optimizer allocates itself (``OPTIMIZER_COMPONENTS``).

    ``in_place``: fp32 CPU params at stage 0 (HostState / SwappedState); otherwise the flat
    store. ``device_params``: the params live on the accelerator. ``lowp``: fp16/bf16 params.
    ``ranks``: the ranks the states are partitioned over (1 at stage 0). ``cuda``: CUDA is
    present, so the memory layer can pin (``BufferPool(pin=None)``).

    The rules are the engine's (offload/zero/flat_group.py, ``FlatGroup.__init__``): the flat
    store pins only what a DMA engine reads or writes, i.e. for params on the device the
    host grad copies (one rank), the staging of the low-precision update (one rank) and the
    fp32 master when it is itself copied to fp32 device params; the moments, the master of
    fp16/bf16 params and the shards of several ranks (fp32 grad sum, low-precision shard) are
    pageable. The swap pipeline's buffers (a pool of their own, offload/swap/pipeline.py) are
    never pinned: they only travel between the disk and the CPU kernel. The collective buffers live on the collective's
    device: the GPU for device params (NCCL), else host memory (gloo, plain torch tensors).
    """
    dma = "pinned" if (cuda and device_params) else "pageable"
    tiers = {c: "pageable" for c in OPTIMIZER_COMPONENTS}
    if in_place:
        return tiers  # HostState's moments are ordinary tensors; no flat buffers
    if not lowp:
        tiers["master"] = dma
    if ranks == 1:
        tiers["grad_buffers"] = tiers["lowp_buffers"] = dma
    tiers["comm_buffers"] = "device" if device_params else "pageable"
    return tiers


# --------------------------------------------------------------------------- the paper

def zero_paper_bytes(num_params: int, world_size: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per rank as in the ZeRO paper (fp16 params and grads, K=12)."""
    psi, n = float(num_params), float(world_size)
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return (2 + 2) * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
