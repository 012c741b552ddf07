"""The memory planner: bytes per tier and a predicted optimizer step, before any training.

[Note: the model]
The ZeRO paper (Rajbhandari et al., 2020, section 3 and table 1) counts the model states of
mixed-precision Adam as 2Ψ (fp16/bf16 params) + 2Ψ (grads) + KΨ (fp32 master, exp_avg,
exp_avg_sq: K = 12) and divides them per stage over the N_d data-parallel ranks:

    stage 0 (DP):        (2 + 2 + K) Ψ
    stage 1 (P_os):      (2 + 2) Ψ + K Ψ / N_d
    stage 2 (P_os+g):    2 Ψ + (2 + K) Ψ / N_d
    stage 3 (P_os+g+p):  (2 + 2 + K) Ψ / N_d            (not offered yet: no param offload)

This module keeps that arithmetic (``zero_paper_bytes``) and then places each piece on the
tier where *this* engine keeps it, adding the buffers the engine itself allocates:

- fp32 CPU params at stage 0 are their own master: the kernel updates them in place, so
  there is no third copy (K drops to 8) and exp_avg + exp_avg_sq (8 B/param) are ordinary
  host tensors (``offload="none"`` and ``"cpu"``) or swap files (``"nvme"``, with the
  pipeline's buffers bounded by ``max_host_bytes``, 1 GiB by default);
- everything else (fp16/bf16 params, device params, stage >= 1) goes to the flat store: a
  flat fp32 master + moments, 12 B per element of this rank's shard, in host pool buffers,
  also with ``offload="none"`` (the engine keeps the states of device params on the host);
  with ``offload="nvme"`` all three (12 B) go to swap files. Plus host buffers for the grads and the low-precision copy of the updated params,
  and per-bucket buffers for the collectives when N_d > 1;
- only buffers a DMA engine touches are pinned, and only when CUDA is present (see
  ``buffer_tiers``): the moments and the shards of several ranks stay pageable;
- the model's params and grads stay whole on every rank: ``p.grad`` keeps torch's meaning
  and is not freed after the reduce-scatter, so stage 2 saves host memory, not device memory.

See [Note: which store] in ``estimate`` for the exact rules, taken from offload/optim.

Activations, the CUDA context and the allocator's fragmentation are not model states and are
not counted; ``explain()`` says so. The swap layer is asked directly how it will cut and
buffer the states (``swap_model``), and the plan-then-run tests compare a plan with the
optimizer's own ``memory_report()``, so a drift between engine and plan fails a test.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .inputs import dtype_name, nonneg_bytes, parse_dtype, positive_rate, resolve_params

__all__ = [
    "Plan",
    "SWAP_SLOTS",
    "swap_model",
    "buffer_tiers",
    "TIERS",
    "COMPONENTS",
    "estimate",
    "cheapest_fitting",
    "zero_paper_bytes",
]

TIERS = ("device", "pinned", "pageable", "nvme")
COMPONENTS = (
    "params",        # the model's own parameters (user tensors)
    "grads",         # the model's own .grad tensors
    "master",        # fp32 master copy, when the param is not itself the fp32 master
    "exp_avg",
    "exp_avg_sq",
    "grad_buffers",  # host buffers the grads are copied into (device params)
    "lowp_buffers",  # host buffers holding the fp16/bf16 copy of updated params (device params)
    "io_buffers",    # swap pipeline buffers (offload="nvme")
    "comm_buffers",  # per-bucket send/gather/reduce-scatter-out buffers of the collectives (stage >= 1, N_d > 1)
)
# Pieces the optimizer allocates itself (what ``memory_report()`` can see); params and grads
# belong to the user's model.
OPTIMIZER_COMPONENTS = COMPONENTS[2:]

GiB = 1 << 30
_OFFLOADS = ("none", "cpu", "nvme")
_OPTIMIZERS = {"adam": 12, "adamw": 12}    # K of the ZeRO paper: master + two moments, fp32


SWAP_SLOTS = 2
"""Each sub-group has two slots on disk, written alternately, so that a crash leaves one
complete step (offload/swap/store.py, [Note: two slots])."""


def swap_model(numel: int, nstates: int, max_host_bytes: Optional[int], sub_group_size: Optional[int]) -> Dict[str, Any]:
    """What the swap layer will allocate for ``nstates`` fp32 states of ``numel`` elements.

    Asks the swap layer itself (``plan_sub_groups`` and ``SwapLayout``) rather than copying
    its rules, so the plan follows the engine when the engine changes. Raises ``ValueError``
    (the engine's own message) when ``max_host_bytes`` cannot hold the pipeline.
    """
    from offload.swap import SwapLayout, pipeline_host_bytes, plan_sub_groups

    sg, nbuf = plan_sub_groups(numel, nstates, max_host_bytes, sub_group_size)
    layout = SwapLayout(numel, sg, nstates)
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
        "nstates": nstates,
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


# --------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    """Bytes per rank and tier, what fits, and the predicted optimizer step."""

    inputs: Dict[str, Any]
    """Normalised inputs (dtype names as strings, sizes in bytes)."""
    breakdown: Dict[str, Dict[str, int]]
    """tier -> component -> bytes per rank (components in ``COMPONENTS``)."""
    capacity: Dict[str, Optional[int]]
    """``device``, ``host`` (per rank share of the node's memory) and ``nvme`` (free space)."""
    step: Dict[str, Any]
    """Predicted optimizer step: ``kernel_s``, ``io_s``, ``read_bytes``, ``write_bytes``,
    ``step_time_s`` (``None`` where a rate is unknown), and the rates used."""
    supported: bool = True
    """False for stage 3, which this engine does not offer yet."""
    notes: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    """Reasons the engine would refuse this configuration (it then does not fit)."""

    # derived views -------------------------------------------------------------------------
    @property
    def per_rank(self) -> Dict[str, int]:
        """tier -> bytes per rank."""
        return {t: sum(self.breakdown[t].values()) for t in TIERS}

    @property
    def optimizer_bytes(self) -> Dict[str, int]:
        """tier -> bytes the optimizer allocates itself (no user params or grads)."""
        return {t: sum(v for c, v in self.breakdown[t].items() if c in OPTIMIZER_COMPONENTS) for t in TIERS}

    @property
    def host_bytes(self) -> int:
        return self.per_rank["pinned"] + self.per_rank["pageable"]

    @property
    def fits(self) -> Dict[str, Optional[bool]]:
        """``device``/``host``/``nvme`` -> True, False or None (capacity not given)."""
        need = {"device": self.per_rank["device"], "host": self.host_bytes, "nvme": self.per_rank["nvme"]}
        out: Dict[str, Optional[bool]] = {}
        for k, n in need.items():
            cap = self.capacity.get(k)
            out[k] = None if cap is None else n <= cap
        return out

    @property
    def fits_all(self) -> bool:
        """Supported and no tier known to overflow (an unknown capacity counts as fitting)."""
        return self.supported and not self.problems and all(v is not False for v in self.fits.values())

    @property
    def step_time_s(self) -> Optional[float]:
        return self.step.get("step_time_s")

    @property
    def zero_paper_bytes(self) -> float:
        i = self.inputs
        return zero_paper_bytes(i["num_params"], i["world_size"], i["stage"], i["k"])

    def to_dict(self) -> Dict[str, Any]:
        """The stable JSON form (``offload plan --json``); keys pinned by a test."""
        return {
            "schema": "offload.plan/1",
            "inputs": dict(self.inputs),
            "supported": self.supported,
            "per_rank": self.per_rank,
            "breakdown": {t: dict(self.breakdown[t]) for t in TIERS},
            "optimizer_bytes": self.optimizer_bytes,
            "capacity": dict(self.capacity),
            "fits": self.fits,
            "fits_all": self.fits_all,
            "step": dict(self.step),
            "zero_paper_bytes": int(round(self.zero_paper_bytes)),
            "notes": list(self.notes),
            "problems": list(self.problems),
        }

    def explain(self) -> str:
        from .render import explain_text
        return explain_text(self)

    def table(self) -> str:
        from .render import plan_table
        return plan_table(self)


def estimate(
    num_params: Any,
    *,
    world_size: int = 1,
    stage: int = 0,
    offload: str = "none",
    param_dtype: Union[str, torch.dtype, None] = None,
    grad_dtype: Union[str, torch.dtype, None] = None,
    optimizer: str = "adamw",
    param_device: Optional[str] = None,
    cuda: Optional[bool] = None,
    device_memory: Union[int, str, None] = None,
    host_memory: Union[int, str, None] = None,
    ranks_per_node: Optional[int] = None,
    max_host_bytes: Union[int, str, None] = None,
    sub_group_size: Optional[int] = None,
    swap_dir: Union[str, "os.PathLike[str]", None] = None,
    nvme_capacity: Union[int, str, None] = None,
    disk_gbps: Optional[float] = None,
    disk_read_gbps: Optional[float] = None,
    disk_write_gbps: Optional[float] = None,
    kernel_gparams: Optional[float] = None,
    lowp_buffers: str = "shard",
) -> Plan:
    """Plan the bytes per rank and tier for training ``num_params`` parameters.

    ``num_params``: a count (``7_500_000_000`` or ``"7.5B"``), a ``torch.nn.Module`` (its
    trainable params, tied ones once; its dtype and device are used unless given) or the
    path of a Hugging Face ``config.json`` (read locally).

    ``param_dtype`` defaults to bfloat16 (the module's dtype for a module); ``grad_dtype`` to
    ``param_dtype``. ``param_device`` is where the model's params live: ``"cuda"`` (the
    default; any accelerator) or ``"cpu"`` (fp32 CPU params are then their own master).
    ``cuda`` says whether host buffers can be pinned (default: ``param_device != "cpu"``).
    ``device_memory`` and ``host_memory`` are per accelerator and per node (``host_memory``
    is shared by ``ranks_per_node`` ranks, default ``min(world_size, 8)``). ``nvme_capacity``
    defaults to the free space of ``swap_dir`` when given. Rates: ``kernel_gparams`` (CPU
    Adam, 10^9 params/s) and ``disk_gbps`` (10^9 B/s, or separate read and write rates).
    ``lowp_buffers``: ``"shard"`` (one host buffer for the rank's whole shard of fp16/bf16
    params, the default) or ``"none"``.
    """
    n, source_desc, module = resolve_params(num_params)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload not in _OFFLOADS:
        raise ValueError(f"unknown offload target {offload!r}; expected 'none', 'cpu' or 'nvme'")
    if lowp_buffers not in ("shard", "none"):
        raise ValueError(f"lowp_buffers must be 'shard' or 'none', got {lowp_buffers!r}")
    opt = str(optimizer).lower()
    if opt not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected 'adam' or 'adamw'")
    k = _OPTIMIZERS[opt]

    if module is not None:
        first = next((p for p in module.parameters()), None)
        if param_dtype is None and first is not None and first.is_floating_point():
            param_dtype = first.dtype
        if param_device is None and first is not None and first.device.type != "meta":
            # a model built on the meta device (to count a big model without memory) says
            # nothing about where it will train: keep the default
            param_device = first.device.type
    pdt = parse_dtype(param_dtype if param_dtype is not None else torch.bfloat16)
    gdt = parse_dtype(grad_dtype) if grad_dtype is not None else pdt
    pdev = str(param_device or "cuda").lower().split(":")[0]
    if pdev == "gpu":
        pdev = "cuda"
    if pdev not in ("cpu", "cuda"):
        raise ValueError(f"param_device must be 'cpu' or 'cuda', got {param_device!r}")
    on_cpu = pdev == "cpu"
    if cuda is None:
        cuda = not on_cpu
    pb = torch.tensor([], dtype=pdt).element_size()
    gb = torch.tensor([], dtype=gdt).element_size()

    dev_mem = nonneg_bytes("device_memory", device_memory)
    host_mem = nonneg_bytes("host_memory", host_memory)
    mhb = nonneg_bytes("max_host_bytes", max_host_bytes)
    if mhb is not None and mhb == 0:
        raise ValueError(f"max_host_bytes must be > 0, got {max_host_bytes!r}")
    if sub_group_size is not None and (isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size <= 0):
        raise ValueError(f"sub_group_size must be a positive integer, got {sub_group_size!r}")
    if ranks_per_node is None:
        ranks_per_node = min(world_size, 8)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be an integer >= 1, got {ranks_per_node!r}")
    nvme_cap = nonneg_bytes("nvme_capacity", nvme_capacity)
    if nvme_cap is None and swap_dir is not None:
        try:
            nvme_cap = shutil.disk_usage(os.fspath(swap_dir)).free
        except FileNotFoundError:
            raise FileNotFoundError(2, "swap directory does not exist", os.fspath(swap_dir)) from None
    kg = positive_rate("kernel_gparams", kernel_gparams)
    dg = positive_rate("disk_gbps", disk_gbps)
    rg = positive_rate("disk_read_gbps", disk_read_gbps) or dg
    wg = positive_rate("disk_write_gbps", disk_write_gbps) or dg

    notes: List[str] = []
    problems: List[str] = []
    B: Dict[str, Dict[str, int]] = {t: {c: 0 for c in COMPONENTS} for t in TIERS}
    user_tier = "pageable" if on_cpu else "device"
    lowp = pdt != torch.float32

    # [Note: which store] offload/optim/adam.py (``_make_store``) picks the state store:
    # fp32 CPU params at stage 0 (any number of ranks: stage 0 partitions nothing) are
    # updated in place (HostState: moments in opt.state; SwappedState: moments in swap files
    # for offload="nvme"); everything else goes to the flat store (FlatState: a flat fp32
    # master + moments in pool buffers, sharded over the ranks when stage >= 1). With
    # offload="nvme" the flat store streams master, exp_avg and exp_avg_sq of this rank's
    # shard through one swap store (SwappedShards, offload/optim/flat_state.py [Note: nvme]).
    in_place = stage == 0 and pdt == torch.float32 and on_cpu
    ranks = world_size if stage >= 1 else 1            # stage 0 with N ranks: plain DP
    shard = -(-n // ranks) if n else 0                 # flat buffers padded to the world size
    separate_master = not in_place
    tier = buffer_tiers(in_place=in_place, device_params=not on_cpu, lowp=lowp, ranks=ranks, cuda=bool(cuda))
    if stage >= 1 and world_size == 1:
        notes.append("world_size 1: stages 1 and 2 partition nothing (same bytes as stage 0)")

    # The model's own params and grads: full on every rank (p.grad keeps torch's meaning;
    # the engine reads it and does not free it, so stage 2 does not shrink it).
    B[user_tier]["params"] = n * pb
    B[user_tier]["grads"] = n * gb
    if stage == 2 and not on_cpu:
        notes.append("stage 2: the ZeRO paper counts 2Ψ/N_d of grads on the device; this engine keeps "
                     "p.grad whole (reduce-scatter at step time), so the device holds 2Ψ of grads")

    state_elems = {"master": shard if separate_master else 0, "exp_avg": shard, "exp_avg_sq": shard}
    swap: Optional[Dict[str, Any]] = None
    if separate_master and offload != "nvme":
        # The flat store's fp32 master is a host buffer unless it is swapped.
        B[tier["master"]]["master"] = 4 * shard
    if offload == "nvme":
        # Swapped: the moments, and the master unless the params are their own master (the
        # in-place store). The swapped elements are the whole shard on every rank (the flat
        # buffer is padded to the world size).
        streamed = (["master"] if separate_master else []) + ["exp_avg", "exp_avg_sq"]
        if shard:
            try:
                swap = swap_model(shard, len(streamed), mhb, sub_group_size)
            except ValueError as exc:
                problems.append(f"the swap pipeline refuses this configuration: {exc}")
        if swap is not None:
            # the swap files hold the states one after the other per sub-group: equal shares
            for c in streamed:
                B["nvme"][c] = swap["disk_bytes"] // len(streamed)
            B[tier["io_buffers"]]["io_buffers"] = swap["host_bytes"]
        if separate_master:
            notes.append("offload='nvme' with the flat store: the fp32 master, exp_avg and exp_avg_sq of this "
                         "rank's shard in swap files; host memory holds the pipeline buffers")
    else:
        # HostState: moments in opt.state, ordinary tensors; flat store: pool buffers.
        for c in ("exp_avg", "exp_avg_sq"):
            B[tier[c]][c] = 4 * state_elems[c]
        if separate_master and offload == "none" and not on_cpu:
            notes.append("offload='none' with device params: this engine keeps the fp32 states of device "
                         "params on the host anyway (same bytes as offload='cpu'); the ZeRO paper's "
                         "baseline keeps them on the device")

    if not in_place:
        if ranks == 1:
            # One rank: device grads are copied into a host buffer of their own dtype as they
            # are produced (CPU grads are read in place); bf16/fp16 updates are staged in a
            # host buffer on their way to the device (CPU low-precision params are written
            # directly; fp32 device params are sent from the master itself).
            if not on_cpu:
                B[tier["grad_buffers"]]["grad_buffers"] = n * gb
                if lowp and lowp_buffers == "shard":
                    B[tier["lowp_buffers"]]["lowp_buffers"] = shard * pb
        else:
            # Several ranks: the fp32 sum of this rank's shard of the grads, the low-precision
            # shard that is all-gathered, and per-bucket buffers on the collective's device
            # (NCCL: the GPU; gloo: the CPU): send (ranks x chunk fp32), gather (ranks x chunk
            # of the param dtype) and the reduce-scatter output (chunk fp32), which FlatGroup
            # allocates (and its memory_report counts) even where gloo reduces straight into
            # the grad shard.
            from offload.optim.flat_state import FlatState

            B[tier["grad_buffers"]]["grad_buffers"] = 4 * shard
            if lowp:
                B[tier["lowp_buffers"]]["lowp_buffers"] = shard * pb
            chunk = max(1, min(shard, FlatState.bucket_numel // ranks)) if shard else 0
            B[tier["comm_buffers"]]["comm_buffers"] = ranks * chunk * 4 + ranks * chunk * pb + chunk * 4
            notes.append(f"FlatState.reduce_in_backward (off by default) would add {FlatState.inflight} more send "
                         "buffers (and reduce-scatter outputs on a GPU) per flat group; not counted")
    if on_cpu and pdt != torch.float32:
        notes.append("low-precision CPU params: the kernel writes the rounded copy into the param itself")

    supported = True
    if stage == 3:
        supported = False
        notes.append(
            "stage 3 (parameter partitioning) is not yet offered by this engine; the ZeRO "
            f"paper's figure would be {zero_paper_bytes(n, world_size, 3, k) / 1e9:.2f} GB per rank"
        )

    # Host memory is shared by the ranks of a node: each rank's share.
    host_cap = None if host_mem is None else host_mem // ranks_per_node
    nvme_share = None if nvme_cap is None else nvme_cap // ranks_per_node
    capacity = {"device": None if on_cpu else dev_mem, "host": host_cap, "nvme": nvme_share}
    if on_cpu and dev_mem is not None:
        notes.append("params live on the CPU: device_memory is not used")

    # Predicted optimizer step: the ideal max(I/O, kernel) of the pipelined step.
    step: Dict[str, Any] = {"kernel_gparams": kg, "disk_read_gbps": rg, "disk_write_gbps": wg}
    step["kernel_s"] = (shard / (kg * 1e9)) if kg else None
    if offload == "nvme":
        # every sub-group of the swapped states is read from one slot and written to the
        # other once per step
        io_bytes = swap["file_bytes"] if swap else 4 * (3 if separate_master else 2) * shard
        step["read_bytes"] = io_bytes
        step["write_bytes"] = io_bytes
        step["io_s"] = (io_bytes / (rg * 1e9) + io_bytes / (wg * 1e9)) if (rg and wg) else None
    else:
        step["read_bytes"] = step["write_bytes"] = 0
        step["io_s"] = 0.0
    if step["kernel_s"] is None or step["io_s"] is None:
        step["step_time_s"] = None
    else:
        step["step_time_s"] = max(step["kernel_s"], step["io_s"])

    inputs = {
        "source": source_desc,
        "num_params": n,
        "world_size": world_size,
        "stage": stage,
        "offload": offload,
        "optimizer": opt,
        "k": k,
        "param_dtype": dtype_name(pdt),
        "grad_dtype": dtype_name(gdt),
        "param_device": pdev,
        "cuda": bool(cuda),
        "ranks_per_node": ranks_per_node,
        "max_host_bytes": mhb,
        "sub_group_size": sub_group_size,
        "swap_dir": os.fspath(swap_dir) if swap_dir is not None else None,
        "shard_numel": shard,
        "separate_master": separate_master,
        "lowp_buffers": lowp_buffers,
        "swap": swap,
    }
    return Plan(inputs=inputs, breakdown=B, capacity=capacity, step=step, supported=supported, notes=notes,
                problems=problems)


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
    one rank, stages 1 and 2 equal stage 0 and are skipped.
    """
    world = kwargs.get("world_size", 1)
    tried: List[Plan] = []
    for off in offloads:
        if off == "none" and "cpu" in offloads:
            continue
        for st in stages:
            if st == 3 or (st > 0 and world == 1):
                continue
            tried.append(estimate(num_params, stage=st, offload=off, **kwargs))

    def cost(p: Plan) -> Tuple[Any, ...]:
        t = p.step_time_s
        return (p.inputs["offload"] == "nvme", t if t is not None else p.inputs["shard_numel"],
                sum(p.per_rank.values()), -p.inputs["stage"])

    tried.sort(key=cost)
    best = next((p for p in tried if p.fits_all), None)
    return best, tried
