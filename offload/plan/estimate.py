"""The memory planner: bytes per tier and a predicted optimizer step, before any training.

[Note: the model]
The ZeRO paper (Rajbhandari et al., 2020, section 3 and table 1) counts the model states of
mixed-precision Adam as 2Ψ (fp16/bf16 params) + 2Ψ (grads) + KΨ (fp32 master, exp_avg,
exp_avg_sq: K = 12) and divides them per stage over the N_d data-parallel ranks:

    stage 0 (DP):        (2 + 2 + K) Ψ
    stage 1 (P_os):      (2 + 2) Ψ + K Ψ / N_d
    stage 2 (P_os+g):    2 Ψ + (2 + K) Ψ / N_d
    stage 3 (P_os+g+p):  (2 + 2 + K) Ψ / N_d

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
- at stages 0-2 the model's params and grads stay whole on every rank: ``p.grad`` keeps
  torch's meaning and is not freed after the reduce-scatter, so stage 2 saves host memory,
  not device memory, unless ``release_grads`` ([Note: release grads] in ``stage3``);
- stage 3 (``offload.shard``: params, grads and states partitioned, params optionally
  offloaded) is placed by ``stage3.place_stage3``, see [Note: stage 3 bytes] there.

See [Note: which store] in ``estimate`` for the exact rules, taken from offload/optim.

Activations, the CUDA context and the allocator's fragmentation are not model states and are
not counted; ``explain()`` says so. The swap layer is asked directly how it will cut and
buffer the states (``swap_model``), and the plan-then-run tests compare a plan with the
optimizer's own ``memory_report()``, so a drift between engine and plan fails a test.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from offload.kernels.fields import ADAM_AMSGRAD, MASTER, bytes_per_element, fields_bytes

from .inputs import check_amsgrad, dtype_name, nonneg_bytes, parse_dtype, positive_rate, resolve_params, swap_dir_path
from .placement import (  # noqa: F401  (OPTIMIZER_COMPONENTS: re-exported, tests import it here)
    COMPONENTS,
    OPTIMIZER_COMPONENTS,
    SWAP_SLOTS,
    TIERS,
    buffer_tiers,
    swap_model,
    zero_paper_bytes,
)
from .result import Plan
from .stage3 import ShardOptions, check_options, place_stage3, release_device_grads
from .states import (OPTIMIZER_RULES, StatesLayout, check_compression, held_state_bytes, kernel_bytes_ratio, listed,
                     param_numels, state_fields, state_notes)

__all__ = [
    "Plan",
    "SWAP_SLOTS",
    "swap_model",
    "buffer_tiers",
    "TIERS",
    "COMPONENTS",
    "estimate",
    "zero_paper_bytes",
]

GiB = 1 << 30
_OFFLOADS = ("none", "cpu", "nvme")
# each optimizer's rule; K of the ZeRO paper: bytes per param of the fp32 master + its states (Adam: 12)
_OPTIMIZERS = OPTIMIZER_RULES

Bytes = Dict[str, Dict[str, int]]  # tier -> component -> bytes per rank


@dataclass
class _Setup(StatesLayout):
    """The checked inputs of one ``estimate`` call and what follows from them."""

    n: int
    source: str
    world_size: int
    stage: int
    offload: str
    optimizer: str
    k: int
    pdt: torch.dtype
    gdt: torch.dtype
    pdev: str
    cuda: bool
    dev_mem: Optional[int]
    host_mem: Optional[int]
    mhb: Optional[int]
    sub_group_size: Optional[int]
    ranks_per_node: int
    nvme_cap: Optional[int]
    swap_dir: Optional[str]
    rates: Tuple[Optional[float], Optional[float], Optional[float]]  # kernel, disk read, disk write
    lowp_buffers: str
    state_dtype: str = "float32"
    master_dtype: Optional[str] = None
    numels: Optional[Tuple[int, ...]] = None
    """Each param's elements (a module was given): see ``StatesLayout``."""
    amsgrad: bool = False
    """Adam's amsgrad: a third fp32 state per element (max_exp_avg_sq), K 16 instead of 12;
    in one group is enough ([Note: groups of different rules] in kernels/fields.py)."""

    @property
    def on_cpu(self) -> bool:
        return self.pdev == "cpu"

    @property
    def lowp(self) -> bool:
        return self.pdt != torch.float32

    @property
    def pb(self) -> int:
        return torch.tensor([], dtype=self.pdt).element_size()

    @property
    def gb(self) -> int:
        return torch.tensor([], dtype=self.gdt).element_size()

    @property
    def in_place(self) -> bool:
        # [Note: which store] offload/optim/adam.py (``_make_store``) picks the state store:
        # fp32 CPU params at stage 0 (any number of ranks: stage 0 partitions nothing) are
        # updated in place (HostState: moments in opt.state; SwappedState: moments in swap
        # files for offload="nvme"); everything else goes to the flat store (FlatState: a flat
        # fp32 master + moments in pool buffers, sharded over the ranks when stage >= 1). With
        # offload="nvme" the flat store streams master, exp_avg and exp_avg_sq of this rank's
        # shard through one swap store (SwappedShards, offload/optim/flat/swapped.py [Note: nvme]).
        return self.stage == 0 and self.pdt == torch.float32 and self.on_cpu

    @property
    def separate_master(self) -> bool:
        return not self.in_place and not self.master_lowp

    @property
    def ranks(self) -> int:
        return self.world_size if self.stage >= 1 else 1   # stage 0 with N ranks: plain DP

    @property
    def tier(self) -> Dict[str, str]:
        return buffer_tiers(in_place=self.in_place, device_params=not self.on_cpu, lowp=self.lowp,
                            ranks=self.ranks, cuda=self.cuda)


def _check_choices(world_size: Any, stage: Any, offload: Any, lowp_buffers: Any, optimizer: Any) -> str:
    """The options that take one of a few values; returns the optimizer's name."""
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
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(map(repr, _OPTIMIZERS))}")
    return opt


def _param_defaults(module: Optional[torch.nn.Module], param_dtype: Any, param_device: Any) -> Tuple[Any, Any]:
    """A module's dtype and device, where the caller gave none."""
    first = next((p for p in module.parameters()), None) if module is not None else None
    if first is None:
        return param_dtype, param_device
    if param_dtype is None and first.is_floating_point():
        param_dtype = first.dtype
    if param_device is None and first.device.type != "meta":
        # a model built on the meta device (to count a big model without memory) says
        # nothing about where it will train: keep the default
        param_device = first.device.type
    return param_dtype, param_device


def _device_name(param_device: Any) -> str:
    pdev = str(param_device or "cuda").lower().split(":")[0]
    if pdev == "gpu":
        pdev = "cuda"
    if pdev not in ("cpu", "cuda"):
        raise ValueError(f"param_device must be 'cpu' or 'cuda', got {param_device!r}")
    return pdev


def _sizes(device_memory: Any, host_memory: Any, max_host_bytes: Any, sub_group_size: Any,
           ranks_per_node: Any, world_size: int, nvme_capacity: Any, swap_dir: Any) -> Dict[str, Any]:
    """The byte sizes and counts, checked; NVMe capacity from ``swap_dir`` unless given."""
    out: Dict[str, Any] = {"dev_mem": nonneg_bytes("device_memory", device_memory),
                           "host_mem": nonneg_bytes("host_memory", host_memory)}
    mhb = out["mhb"] = nonneg_bytes("max_host_bytes", max_host_bytes)
    if mhb is not None and mhb == 0:
        raise ValueError(f"max_host_bytes must be > 0, got {max_host_bytes!r}")
    if sub_group_size is not None and (isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int)
                                       or sub_group_size <= 0):
        raise ValueError(f"sub_group_size must be a positive integer, got {sub_group_size!r}")
    if ranks_per_node is None:
        ranks_per_node = min(world_size, 8)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be an integer >= 1, got {ranks_per_node!r}")
    out["ranks_per_node"] = ranks_per_node
    nvme_cap = nonneg_bytes("nvme_capacity", nvme_capacity)
    swap_dir = swap_dir_path(swap_dir)  # checked also where the capacity is given
    if nvme_cap is None and swap_dir is not None:
        nvme_cap = shutil.disk_usage(swap_dir).free
    out["nvme_cap"] = nvme_cap
    return out


def _rates(kernel_gparams: Any, disk_gbps: Any, disk_read_gbps: Any,
           disk_write_gbps: Any) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    kg = positive_rate("kernel_gparams", kernel_gparams)
    dg = positive_rate("disk_gbps", disk_gbps)
    rg = positive_rate("disk_read_gbps", disk_read_gbps) or dg
    wg = positive_rate("disk_write_gbps", disk_write_gbps) or dg
    return kg, rg, wg


def _place_model(s: _Setup, B: Bytes, notes: List[str], release_grads: bool = False) -> None:
    """The model's own params and grads: full on every rank (p.grad keeps torch's meaning;
    the engine reads it and does not free it, so stage 2 does not shrink it)."""
    if s.stage >= 1 and s.world_size == 1:
        notes.append("world_size 1: stages 1 and 2 partition nothing (same bytes as stage 0)")
    user_tier = "pageable" if s.on_cpu else "device"
    B[user_tier]["params"] = s.n * s.pb
    B[user_tier]["grads"] = s.n * s.gb
    if s.stage == 2 and not s.on_cpu and not release_grads:
        notes.append("stage 2: the ZeRO paper counts 2Ψ/N_d of grads on the device; this engine keeps "
                     "p.grad whole (reduce-scatter at step time), so the device holds 2Ψ of grads")


def _place_swapped(s: _Setup, B: Bytes, notes: List[str], problems: List[str]) -> Optional[Dict[str, Any]]:
    """offload="nvme": the moments, and the master unless the params are their own master
    (the in-place store), in swap files; the swapped elements are the whole shard on every
    rank (the flat buffer is padded to the world size)."""
    fields = tuple(state_fields(s))
    swap = None
    if not fields:  # nothing per element (SGD without momentum, params their own master)
        notes.append("offload='nvme': no state and no master to swap: stepped in host memory as with 'cpu'")
    elif s.shard:
        try:
            swap = swap_model(s.swap_numel, fields, s.mhb, s.sub_group_size)
        except ValueError as exc:
            problems.append(f"the swap pipeline refuses this configuration: {exc}")
    if swap is not None:
        # the swap files hold the states one after the other per sub-group, each its own bytes
        for f, nbytes in zip(fields, swap["state_disk_bytes"]):
            B["nvme"][f.name] = nbytes
        B[s.tier["io_buffers"]]["io_buffers"] = swap["host_bytes"]
    if s.separate_master:
        notes.append(f"offload='nvme' with the flat store: the fp32 master, {listed(s.rule.names)} of "
                     "this rank's shard in swap files; host memory holds the pipeline buffers")
    return swap


def _place_states(s: _Setup, B: Bytes, notes: List[str], problems: List[str]) -> Optional[Dict[str, Any]]:
    """The fp32 master (flat store only) and the moments; returns the swap model for nvme."""
    tier = s.tier
    if s.separate_master and s.offload != "nvme":
        # The flat store's fp32 master is a host buffer unless it is swapped.
        B[tier[MASTER.name]][MASTER.name] = MASTER.nbytes(s.shard)
    if s.offload == "nvme":
        return _place_swapped(s, B, notes, problems)
    # HostState: moments in opt.state, ordinary tensors, each param's its own (small params'
    # float32); flat store: pool buffers. Their bytes are the fields' (bf16: 2 B, int8: 260 B
    # per block of 256).
    for name, nbytes in held_state_bytes(s).items():
        B[tier[name]][name] = nbytes
    if s.separate_master and s.offload == "none" and not s.on_cpu:
        notes.append("offload='none' with device params: this engine keeps the fp32 states of device "
                     "params on the host anyway (same bytes as offload='cpu'); the ZeRO paper's "
                     "baseline keeps them on the device")
    return None


def _place_buffers(s: _Setup, B: Bytes, notes: List[str]) -> None:
    """The flat store's grad, low-precision and collective buffers."""
    tier, shard, pb = s.tier, s.shard, s.pb
    if s.in_place:
        pass
    elif s.ranks == 1:
        # One rank: device grads are copied into a host buffer of their own dtype as they
        # are produced (CPU grads are read in place); bf16/fp16 updates are staged in a
        # host buffer on their way to the device (CPU low-precision params are written
        # directly; fp32 device params are sent from the master itself).
        if not s.on_cpu:
            B[tier["grad_buffers"]]["grad_buffers"] = s.flat_total * s.gb
            if s.lowp and s.lowp_buffers == "shard":
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
        if s.lowp:
            B[tier["lowp_buffers"]]["lowp_buffers"] = shard * pb
        a = s.align  # (FlatGroup: buckets of whole blocks)
        chunk = max(a, min(shard, FlatState.bucket_numel // s.ranks) // a * a) if shard else 0
        B[tier["comm_buffers"]]["comm_buffers"] = s.ranks * chunk * 4 + s.ranks * chunk * pb + chunk * 4
        notes.append(f"FlatState.reduce_in_backward (off by default) would add {FlatState.inflight} more send "
                     "buffers (and reduce-scatter outputs on a GPU) per flat group; not counted")
    if s.on_cpu and s.lowp:
        notes.append("low-precision CPU params: the kernel writes the rounded copy into the param itself")


def _capacity(s: _Setup, notes: List[str]) -> Dict[str, Optional[int]]:
    """Each rank's share: host memory and the disk are shared by the ranks of a node."""
    host_cap = None if s.host_mem is None else s.host_mem // s.ranks_per_node
    nvme_share = None if s.nvme_cap is None else s.nvme_cap // s.ranks_per_node
    if s.on_cpu and s.dev_mem is not None:
        notes.append("params live on the CPU: device_memory is not used")
    return {"device": None if s.on_cpu else s.dev_mem, "host": host_cap, "nvme": nvme_share}


def _predict_step(s: _Setup, swap: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The ideal max(I/O, kernel) of the pipelined step."""
    kg, rg, wg = s.rates
    step: Dict[str, Any] = {"kernel_gparams": kg, "disk_read_gbps": rg, "disk_write_gbps": wg}
    step["kernel_s"] = (s.shard / (kg * 1e9) * kernel_bytes_ratio(s)) if kg else None
    if s.offload == "nvme":
        # every sub-group of the swapped states is read from one slot and written to the
        # other once per step
        io_bytes = swap["file_bytes"] if swap else fields_bytes(state_fields(s), s.swap_numel)
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
    return step


def _inputs(s: _Setup, swap: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``Plan.inputs``: the normalised inputs (keys pinned by the JSON schema test)."""
    return {
        "source": s.source,
        "num_params": s.n,
        "world_size": s.world_size,
        "stage": s.stage,
        "offload": s.offload,
        "optimizer": s.optimizer,
        "amsgrad": s.amsgrad,
        "k": s.k,
        "param_dtype": dtype_name(s.pdt),
        "grad_dtype": dtype_name(s.gdt),
        "param_device": s.pdev,
        "cuda": s.cuda,
        "ranks_per_node": s.ranks_per_node,
        "max_host_bytes": s.mhb,
        "sub_group_size": s.sub_group_size,
        "swap_dir": s.swap_dir,
        "shard_numel": s.shard,
        "separate_master": s.separate_master,
        "lowp_buffers": s.lowp_buffers,
        "state_dtype": s.state_dtype,
        "master_dtype": s.master_dtype,
        "swap": swap,
    }


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
    state_dtype: str = "float32",
    master_dtype: Optional[str] = None,
    offload_params: str = "none",
    unit_params: Union[int, str, Sequence[int], None] = None,
    max_live_params: Union[int, str, None] = None,
    max_live_bytes: Union[int, str, None] = None,
    prefetch: Optional[int] = None,
    release_grads: bool = False,
    amsgrad: bool = False,
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
    params, the default) or ``"none"``. ``state_dtype`` / ``master_dtype``: as the optimizers
    take them; the states' bytes are their fields' (offload/plan/states.py).

    Stage 3 ([Note: stage 3 bytes] in ``stage3``): ``offload_params`` (``"none"``, ``"cpu"``,
    ``"nvme"``: where this rank's param shards live), ``unit_params`` (the fetch units: one size,
    the leftover being the root unit; or every unit's size, the root's first; default: a module's
    units as offload.shard makes them, a config's decoder layers, else 32 equal), ``max_live_params``
    or ``max_live_bytes`` and its ``prefetch`` depth (default 1). ``release_grads`` (stages 0-2,
    device params): grads leave the device once copied to the host ([Note: release grads]).
    ``amsgrad``: Adam's amsgrad=True (in any group: flat and swapped stores keep it for all
    params), a third state per element (max_exp_avg_sq).
    """
    s = _setup(num_params, world_size=world_size, stage=stage, offload=offload, param_dtype=param_dtype,
               grad_dtype=grad_dtype, optimizer=optimizer, param_device=param_device, cuda=cuda,
               device_memory=device_memory, host_memory=host_memory, ranks_per_node=ranks_per_node,
               max_host_bytes=max_host_bytes, sub_group_size=sub_group_size, swap_dir=swap_dir,
               nvme_capacity=nvme_capacity, disk_gbps=disk_gbps, disk_read_gbps=disk_read_gbps,
               disk_write_gbps=disk_write_gbps, kernel_gparams=kernel_gparams, lowp_buffers=lowp_buffers,
               state_dtype=state_dtype, master_dtype=master_dtype, amsgrad=amsgrad)
    opts = check_options(stage=s.stage, num_params=s.n, offload_params=offload_params, unit_params=unit_params,
                         max_live_params=max_live_params, max_live_bytes=max_live_bytes, prefetch=prefetch,
                         release_grads=release_grads, source=num_params)
    return _bill(s, opts)


def _bill(s: _Setup, opts: ShardOptions) -> Plan:
    """Place every piece on its tier (stage 3: ``stage3.place_stage3``) and predict the step."""
    notes: List[str] = []
    problems: List[str] = []
    B: Bytes = {t: {c: 0 for c in COMPONENTS} for t in TIERS}
    if s.stage == 3:
        swap, step, sharding = place_stage3(s, opts, B, notes, problems)
    else:
        _place_model(s, B, notes, opts.release_grads)
        swap = _place_states(s, B, notes, problems)
        _place_buffers(s, B, notes)
        sharding = release_device_grads(s, opts, B, notes)
        step = _predict_step(s, swap)
    notes.extend(state_notes(s))
    inputs = _inputs(s, swap)
    if s.stage == 3:  # the shard of the padded units; the fp32 CPU shard is its own master
        inputs.update(shard_numel=sharding["shard_numel"], separate_master=not sharding["own_master"])
    return Plan(inputs=inputs, breakdown=B, capacity=_capacity(s, notes), step=step, notes=notes,
                problems=problems, sharding=sharding)


def _setup(num_params: Any, *, world_size: Any, stage: Any, offload: Any, param_dtype: Any, grad_dtype: Any,
           optimizer: Any, param_device: Any, cuda: Optional[bool], device_memory: Any, host_memory: Any,
           ranks_per_node: Any, max_host_bytes: Any, sub_group_size: Any, swap_dir: Any, nvme_capacity: Any,
           disk_gbps: Any, disk_read_gbps: Any, disk_write_gbps: Any, kernel_gparams: Any,
           lowp_buffers: str, state_dtype: Any = "float32", master_dtype: Any = None,
           amsgrad: Any = False) -> _Setup:
    """Check ``estimate``'s arguments in the order they are documented (the first bad one is
    the one reported)."""
    n, source_desc, module = resolve_params(num_params)
    opt = _check_choices(world_size, stage, offload, lowp_buffers, optimizer)
    param_dtype, param_device = _param_defaults(module, param_dtype, param_device)
    pdt = parse_dtype(param_dtype if param_dtype is not None else torch.bfloat16)
    gdt = parse_dtype(grad_dtype) if grad_dtype is not None else pdt
    pdev = _device_name(param_device)
    sizes = _sizes(device_memory, host_memory, max_host_bytes, sub_group_size, ranks_per_node, world_size,
                   nvme_capacity, swap_dir)
    rates = _rates(kernel_gparams, disk_gbps, disk_read_gbps, disk_write_gbps)
    check_compression(state_dtype, master_dtype, pdt)
    check_amsgrad(amsgrad, opt)
    k = bytes_per_element((ADAM_AMSGRAD if amsgrad else _OPTIMIZERS[opt]).with_master())
    return _Setup(state_dtype=state_dtype, master_dtype=master_dtype, numels=param_numels(module), amsgrad=amsgrad,
                  n=n, source=source_desc, world_size=world_size, stage=stage, offload=offload, optimizer=opt,
                  k=k, pdt=pdt, gdt=gdt, pdev=pdev, cuda=bool(pdev != "cpu" if cuda is None else cuda),
                  sub_group_size=sub_group_size, swap_dir=os.fspath(swap_dir) if swap_dir is not None else None,
                  rates=rates, lowp_buffers=lowp_buffers, **sizes)
