"""Stage 3 (params partitioned: ZeRO-3, FSDP) and parameter offload in the planner, and the
ZeRO-Offload device footprint of stages 0-2 (``release_grads``).

[Note: stage 3 bytes]
``offload.shard`` (issue #16) cuts the model into fetch units u_1..u_m (params each) and a
root unit u_0 (the params no unit owns: embeddings, final norm, an untied head; gathered for
the whole forward and backward, as FSDP2's root). Each unit is one flat buffer padded to
N_d x chunk_i, chunk_i = ceil(u_i / N_d) rounded up to 256 elements (so a compressed
state's 256-element block never straddles two ranks); a rank keeps chunk_i of each unit:
its shard S = sum chunk_i elements. Per rank:

- the *live window* (compute tier: the device, or host memory for CPU params): the gathered
  root and units in the param dtype, the current unit and ``prefetch`` more (default 1), the
  largest ones counted, never more than ``max_live_params`` (or ``max_live_bytes``) unless
  the root and one unit alone are bigger (then those alone); a gathered unit is N_d x chunk_i
  elements;
- the full grads of the root and of the unit being reduced (the largest, u_max elements, in
  the grad dtype: autograd's), freed once reduce-scattered; with N_d > 1 the reduction is bucketed as the
  stage-2 path's (``FlatState.bucket_numel`` elements, ``FlatState.inflight`` buckets in
  flight, summed in float32): per bucket a send buffer of N_d x c and an output of c float32
  elements, c = min(chunk_max, bucket_numel / N_d), on the collective's device; for
  device params whose shards live in host memory or on NVMe, the
  host-to-device staging of the shards being gathered (1 + prefetch) x chunk_max (param
  dtype) on the device;
- the param shards, S x param bytes: on the compute tier (``offload_params="none"``), in
  host memory (``"cpu"``: pinned with CUDA, the copy engine reads them) or in swap files
  (``"nvme"``: one copy, re-derived from the fp32 master after a crash: the flat store keeps
  one for fp32 shards too, and a bf16 master is refused), read into (1 + prefetch) x chunk_max
  host buffers (the pages of the shards being gathered);
- the grad shards, S x grad bytes, where the states live: host memory (``offload``
  ``"none"``/``"cpu"``; pinned with CUDA: the device writes them) or a swap file
  (``"nvme"``: written as each unit's grads arrive, read back by the step, through two
  chunk_max host buffers);
- the states of S elements as the flat store keeps those of one rank (the shards are the
  optimizer's params: no second partition): fp32 master + moments (12 B per element), or
  the moments only (8 B) for fp32 CPU params, which are their own master; host buffers or
  swap files as for stages 0-2 (``swap_model``); the bf16/fp16 staging of the update to
  device shards (S x param bytes) only when the shards live on the device.

Step (per rank, ideal, as the stage-2 NVMe rows): the optimizer step = max(kernel over S,
state I/O + reading the grad shards + writing the updated param shards); forward + backward
cannot beat reading the param shards twice (forward and backward gathers) and writing the
grad shards once, against the disk's rates (``fwd_bwd_io_s``).

[Note: release grads] Stages 0-2 with device params and ``release_grads``: ZeRO-Offload's
device footprint. Each grad leaves the device as soon as autograd has made it (one rank: the
post-accumulate-grad hook's copy to the pinned host buffer; several ranks: reduced in
backward, ``reduce_in_backward``, in contiguous buckets each summed into its owner rank) and
``p.grad`` is then freed, so the device holds the params (2 Ψ) plus at most
``FlatState.inflight`` buckets of grads in flight (and the in-backward send slots with
N_d > 1); the runtime: [Note: releasing grads] in offload/optim/flat/grads.py. ``p.grad`` is not readable
after backward; clip with the optimizer's ``max_grad_norm`` instead of ``clip_grad_norm_``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.kernels.fields import ADAM, MASTER, fields_bytes

from .inputs import nonneg_bytes, parse_count
from offload.swap.pipeline import paged_bound

from .placement import buffer_tiers, swap_model
from .states import host_state_bytes

__all__ = ["ShardOptions", "check_options", "unit_layout", "live_window", "place_stage3", "release_device_grads",
           "PARAM_OFFLOADS", "DEFAULT_UNITS", "CHUNK_ALIGN"]

PARAM_OFFLOADS = ("none", "cpu", "nvme")
DEFAULT_UNITS = 32        # without a unit size: a 32-layer transformer's blocks
CHUNK_ALIGN = 256         # a unit's per-rank chunk: a whole number of compressed-state blocks
DEFAULT_PREFETCH = 1
REDUCE_BYTES = 4          # a unit's grads are summed across ranks in float32


@dataclass(frozen=True)
class ShardOptions:
    """The checked stage-3 / param-offload options of one ``estimate`` call."""

    offload_params: str = "none"
    units: Optional[Tuple[int, ...]] = None     # exact unit sizes, or None
    unit_params: Optional[int] = None           # equal units of this size, or None
    max_live_params: Optional[int] = None
    max_live_bytes: Optional[int] = None
    prefetch: int = DEFAULT_PREFETCH
    release_grads: bool = False


def _positive_count(name: str, value: Any) -> int:
    try:
        n = parse_count(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return n


def _unit_sizes(value: Any) -> Tuple[Optional[Tuple[int, ...]], Optional[int]]:
    if value is None:
        return None, None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("unit_params must name at least one unit, got an empty sequence")
        sizes = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"unit_params: each unit size must be an integer >= 0, got {v!r}")
            sizes.append(v)
        return tuple(sizes), None
    return None, _positive_count("unit_params", value)


def default_unit_sizes(source: Any) -> Optional[List[int]]:
    """The units ``offload.shard(module)`` makes of a module (its default policy: each
    element of an ``nn.ModuleList``), the root's params first, or one unit per decoder layer
    of a config.json path (as ``--model-config``); None for a bare count. Without this a
    module was planned as 32 equal units: 12 blocks of 4.2M params read as 32 of 1.6M, the
    live window, its grads and the param and grad I/O buffers 2.7x too small."""
    if isinstance(source, torch.nn.Module):
        if any(hasattr(p, "_offload_shard") for p in source.parameters()):
            return None  # already sharded: its params are the flat shards, the units are gone
        from offload.shard.units import assign_params, choose_units

        owned, _ = assign_params(source, choose_units(source, None))
        return [sum(p.numel() for p, _ in unit) for unit in owned]
    if isinstance(source, (str, os.PathLike)) and os.path.exists(os.fspath(source)):
        from .hf_config import unit_sizes_from_hf_config

        return unit_sizes_from_hf_config(source)
    return None


def check_options(*, stage: int, num_params: int, offload_params: Any, unit_params: Any, max_live_params: Any,
                  max_live_bytes: Any, prefetch: Any, release_grads: Any, source: Any = None) -> ShardOptions:
    """Check the options; those of stage 3 only are refused at stages 0-2 (they would do nothing).
    ``source``: ``estimate``'s model, whose units stage 3 takes where ``unit_params`` is None."""
    if offload_params not in PARAM_OFFLOADS:
        raise ValueError(f"unknown offload_params {offload_params!r}; expected 'none', 'cpu' or 'nvme'")
    if not isinstance(release_grads, bool):
        raise TypeError(f"release_grads must be a bool, got {type(release_grads).__name__}")
    if release_grads and stage == 3:  # as the optimizer refuses it (offload/optim/options.py)
        raise ValueError("release_grads is for stages 0-2: at stage 3 offload.shard frees each unit's full grads "
                         "once reduce-scattered already (the optimizer refuses release_grads=True for its params); "
                         "drop release_grads")
    if stage == 3 and unit_params is None:
        unit_params = default_unit_sizes(source)
    units, unit = _unit_sizes(unit_params)
    if units is not None and sum(units) != num_params:
        raise ValueError(f"unit_params: the unit sizes sum to {sum(units):,} params, the model has {num_params:,}")
    live = None if max_live_params is None else _positive_count("max_live_params", max_live_params)
    live_b = nonneg_bytes("max_live_bytes", max_live_bytes)
    if live_b == 0:
        raise ValueError(f"max_live_bytes must be > 0, got {max_live_bytes!r}")
    if live is not None and live_b is not None:
        raise ValueError("give max_live_params or max_live_bytes, not both")
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
        raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
    given = [k for k, v in (("offload_params", offload_params != "none"), ("unit_params", unit_params is not None),
                            ("max_live_params", live is not None), ("max_live_bytes", live_b is not None),
                            ("prefetch", prefetch is not None)) if v]
    if stage != 3 and given:
        raise ValueError(f"{', '.join(given)}: stage 3 only (only stage 3 partitions the params), got stage={stage}")
    return ShardOptions(offload_params=offload_params, units=units, unit_params=unit, max_live_params=live,
                        max_live_bytes=live_b, prefetch=DEFAULT_PREFETCH if prefetch is None else prefetch,
                        release_grads=release_grads)


def _units(n: int, opts: ShardOptions) -> Tuple[List[int], bool]:
    """The unit sizes, the root first (the leftover of equal units), and whether they were
    assumed (no size given)."""
    if opts.units is not None:
        return list(opts.units), False
    size = opts.unit_params if opts.unit_params is not None else max(1, -(-n // DEFAULT_UNITS))
    return [n % size] + [size] * (n // size), opts.unit_params is None


def _chunk(u: int, world_size: int) -> int:
    return -(-(-(-u // world_size)) // CHUNK_ALIGN) * CHUNK_ALIGN   # ceil(u / N_d) rounded up to 256


def unit_layout(units: Sequence[int], world_size: int) -> Dict[str, Any]:
    """Per-rank chunks of the root ``units[0]`` and of the other units (see [Note: stage 3
    bytes]); ``gathered``: the padded size of each other unit when all-gathered."""
    root, others = units[0], [u for u in units[1:] if u]
    chunks = [_chunk(u, world_size) for u in others]
    rc = _chunk(root, world_size)
    return {"units": len(others), "root_numel": root, "root_gathered": world_size * rc,
            "unit_numel_max": max(others, default=0), "chunk_max": max(chunks + [rc]),
            "shard_numel": rc + sum(chunks), "gathered": [world_size * c for c in chunks], "chunks": [rc] + chunks,
            "gathered_max": world_size * max(chunks, default=0)}


def live_window(root: int, gathered: Sequence[int], prefetch: int, max_live: Optional[int]) -> Tuple[int, int]:
    """(elements, units besides the root) of the live window: the gathered root and the
    largest 1 + ``prefetch`` units, each one after the first added while the sum stays
    within ``max_live`` (the root and one unit always: they must be gathered)."""
    top = sorted(gathered, reverse=True)[:1 + prefetch]
    live = root + sum(top[:1])
    n = len(top[:1])
    for g in top[1:]:
        if max_live is None or live + g <= max_live:
            live, n = live + g, n + 1
    return live, n


def _fields(s: Any, own_master: bool):
    """The states kept per element of the shard: the rule's, and the fp32 master unless the
    fp32 CPU shard is its own master (stepped in place by the host store) or bf16 params are
    (``master_dtype="bfloat16"``). The rule and ``master_lowp`` are the setup's once it
    carries the compressed-state options (offload/plan/states.py); Adam's float32 until then."""
    rule = getattr(s, "rule", ADAM)
    return rule.fields if own_master or getattr(s, "master_lowp", False) else (MASTER,) + tuple(rule.fields)


@dataclass
class _Where:
    """The tiers of one stage-3 plan (see [Note: stage 3 bytes])."""

    compute: str      # the gathered units and their grads: the device, or host memory for CPU params
    dma: str          # host buffers the copy engine reads or writes: pinned with CUDA and device params
    tier: Dict[str, str]
    own_master: bool  # fp32 CPU shards, stepped in place by the host store
    params_master: bool  # the param shards are the only copy of the master (own_master or a bf16 master)


def _where(s: Any, opts: Any = None) -> _Where:
    # params on NVMe are never their own master: their file is not crash-safe, the flat
    # store's master (in the states) is the truth ([Note: the param tier] in offload/shard/tier.py)
    own = s.pdt == torch.float32 and s.on_cpu and getattr(opts, "offload_params", None) != "nvme"
    return _Where(compute="pageable" if s.on_cpu else "device",
                  dma="pinned" if (s.cuda and not s.on_cpu) else "pageable",
                  tier=buffer_tiers(in_place=own, device_params=not s.on_cpu, lowp=s.lowp, ranks=1, cuda=s.cuda),
                  own_master=own, params_master=own or bool(getattr(s, "master_lowp", False)))


def _max_live(s: Any, opts: ShardOptions) -> Optional[int]:
    if opts.max_live_bytes is not None:
        return opts.max_live_bytes // s.pb
    return opts.max_live_params


def _place_window(s: Any, opts: ShardOptions, lay: Dict[str, Any], w: _Where, B: Any,
                  notes: List[str]) -> Dict[str, int]:
    """The gathered units, their grads and the collective's buffers."""
    cmax, depth = lay["chunk_max"], 1 + opts.prefetch
    cap = _max_live(s, opts)
    live, nlive = live_window(lay["root_gathered"], lay["gathered"], opts.prefetch, cap)
    least = lay["root_gathered"] + lay["gathered_max"]
    if cap is not None and least > cap:
        notes.append(f"the root and the largest unit ({least:,} elements gathered) exceed the live-window bound "
                     f"({cap:,}): they are gathered without prefetch")
    B[w.compute]["live_params"] = live * s.pb
    B[w.compute]["live_grads"] = (lay["root_numel"] + lay["unit_numel_max"]) * s.gb
    if s.world_size > 1 and cmax:
        from offload.optim.flat_state import FlatState

        # the bucketed float32 reduce-scatter: send and output buffers of each bucket in flight
        c = max(1, min(cmax, FlatState.bucket_numel // s.world_size))
        B[w.compute]["comm_buffers"] += FlatState.inflight * (s.world_size * c + c) * REDUCE_BYTES
    if not s.on_cpu and opts.offload_params != "none":
        B["device"]["comm_buffers"] += depth * cmax * s.pb   # host-to-device staging of the shards
    return {"window_numel": live, "window_units": nlive}


def _place_shards(s: Any, opts: ShardOptions, lay: Dict[str, Any], w: _Where, B: Any, notes: List[str]) -> None:
    """The param and grad shards (S elements each)."""
    S, cmax, depth = lay["shard_numel"], lay["chunk_max"], 1 + opts.prefetch
    if opts.offload_params == "nvme":
        B["nvme"]["params"] = S * s.pb  # one copy: the master in the states is the truth
        B[w.dma]["io_buffers"] += depth * cmax * s.pb
    else:
        B[w.compute if opts.offload_params == "none" else w.dma]["params"] = S * s.pb
        if s.on_cpu and opts.offload_params == "cpu":
            notes.append("params on the CPU: offload_params='cpu' is the same as 'none' (the shards are in host "
                         "memory either way)")
    if s.offload == "nvme":
        B["nvme"]["grads"] = S * s.gb
        B[w.dma]["io_buffers"] += 2 * cmax * s.gb
    else:
        B["pageable" if s.on_cpu else w.dma]["grads"] = S * s.gb
    if not s.on_cpu and s.lowp and opts.offload_params == "none":
        B[w.tier["lowp_buffers"]]["lowp_buffers"] = S * s.pb   # staging of the update to the device shards


def _place_states3(s: Any, chunks: Sequence[int], w: _Where, B: Any, problems: List[str],
                   opts: Any = None) -> Optional[Dict[str, Any]]:
    """The optimizer's states of the shard (``chunks``: this rank's elements of each unit, the
    root's first): host buffers, or swap files for offload='nvme'."""
    S = sum(chunks)
    fields = _fields(s, w.own_master)
    if s.offload != "nvme":
        if w.own_master:
            # the host store: each unit's shard is one param, stepped on its own (a shard of
            # fewer than 4096 elements keeps float32 states)
            for name, nbytes in host_state_bytes(s, chunks).items():
                B[w.tier[name]][name] = nbytes
        else:
            for f in fields:
                B[w.tier[f.name]][f.name] = f.nbytes(S)
        return None
    if not S:
        return None
    try:
        paged = 3 * s.pb if getattr(opts, "offload_params", None) == "nvme" else 0  # flat/swapped.py _paged_bytes
        swap = swap_model(S, tuple(fields), paged_bound(s.mhb, tuple(fields), paged, s.sub_group_size),
                          s.sub_group_size)
    except ValueError as exc:
        problems.append(f"the swap pipeline refuses this configuration: {exc}")
        return None
    for f, nbytes in zip(fields, swap["state_disk_bytes"]):
        B["nvme"][f.name] = nbytes
    B[w.tier["io_buffers"]]["io_buffers"] += swap["host_bytes"]
    return swap


def _io_s(read: int, write: int, rg: Optional[float], wg: Optional[float]) -> Optional[float]:
    if not read and not write:
        return 0.0
    if (read and not rg) or (write and not wg):
        return None
    return (read / (rg * 1e9) if read else 0.0) + (write / (wg * 1e9) if write else 0.0)


def _step3(s: Any, opts: ShardOptions, S: int, w: _Where,
           swap: Optional[Dict[str, Any]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the optimizer step as ``Plan.step``, the per-step I/O split)."""
    kg, rg, wg = s.rates
    state = 0
    if s.offload == "nvme":
        state = swap["file_bytes"] if swap else fields_bytes(_fields(s, w.own_master), S)
    grad = S * s.gb if s.offload == "nvme" else 0
    pread = 2 * S * s.pb if opts.offload_params == "nvme" else 0      # forward and backward gathers
    pwrite = S * s.pb if opts.offload_params == "nvme" else 0         # the updated shard
    step: Dict[str, Any] = {"kernel_gparams": kg, "disk_read_gbps": rg, "disk_write_gbps": wg,
                            "kernel_s": (S / (kg * 1e9)) if kg else None,
                            "read_bytes": state + grad, "write_bytes": state + pwrite}
    step["io_s"] = _io_s(step["read_bytes"], step["write_bytes"], rg, wg)
    known = step["kernel_s"] is not None and step["io_s"] is not None
    step["step_time_s"] = max(step["kernel_s"], step["io_s"]) if known else None
    fb = _io_s(pread, grad, rg, wg)
    io = {"param_read_bytes": pread, "param_write_bytes": pwrite, "grad_write_bytes": grad, "grad_read_bytes": grad,
          "state_read_bytes": state, "state_write_bytes": state, "fwd_bwd_io_s": fb,
          "train_step_io_s": None if fb is None or step["io_s"] is None else fb + step["io_s"]}
    return step, io


def place_stage3(s: Any, opts: ShardOptions, B: Any, notes: List[str],
                 problems: List[str]) -> Tuple[Optional[Dict[str, Any]], Dict[str, Any], Dict[str, Any]]:
    """Fill ``B`` (tier -> component -> bytes) for stage 3; returns (the swap model or None,
    ``Plan.step``, ``Plan.sharding``). ``s`` is ``estimate``'s checked setup."""
    units, assumed = _units(s.n, opts)
    lay = unit_layout(units, s.world_size)
    w = _where(s, opts)
    if opts.offload_params == "nvme" and getattr(s, "master_lowp", False):
        problems.append("offload_params='nvme' with master_dtype='bfloat16': the params would be the only copy of "
                        "the master in a file that is not crash-safe; keep the fp32 master")
    if assumed and s.n:
        notes.append(f"stage 3: no unit size given; assumed {DEFAULT_UNITS} equal units of "
                     f"{lay['unit_numel_max']:,} params (give unit_params / --unit-params, or --model-config "
                     "for one unit per layer)")
    window = _place_window(s, opts, lay, w, B, notes)
    _place_shards(s, opts, lay, w, B, notes)
    swap = _place_states3(s, lay["chunks"], w, B, problems, opts)
    step, io = _step3(s, opts, lay["shard_numel"], w, swap)
    info = {"offload_params": opts.offload_params, "release_grads": True, "prefetch": opts.prefetch,
            "max_live_params": _max_live(s, opts), "units_assumed": assumed, "own_master": w.own_master,
            "nvme_slots": {"params": 1, "grads": 1},
            **{k: v for k, v in lay.items() if k not in ("gathered", "chunks")}, **window, "io": io}
    return swap, step, info


def release_device_grads(s: Any, opts: ShardOptions, B: Any, notes: List[str]) -> Dict[str, Any]:
    """Stages 0-2: ``Plan.sharding``, and with ``release_grads`` the device's grads cut to the
    buckets in flight ([Note: release grads])."""
    info: Dict[str, Any] = {"offload_params": "none", "release_grads": opts.release_grads}
    if not opts.release_grads:
        return info
    if s.on_cpu:
        raise ValueError("release_grads frees device grads once copied to the host; the params are on the CPU "
                         "(param_device='cpu'), where the grads already live")
    from offload.optim.flat_state import FlatState

    inflight, bucket = FlatState.inflight, FlatState.bucket_numel
    B["device"]["grads"] = min(s.n, inflight * bucket) * s.gb
    if s.ranks > 1 and s.shard:
        # several ranks reduce in backward, contiguous buckets of N_d x chunk summed into their
        # owners in the send slots themselves (offload/zero/backward_reduce.py): the slots are
        # counted here, so the placement's "not counted" remark about them no longer holds
        chunk = max(1, min(s.shard, bucket // s.ranks))
        B["device"]["comm_buffers"] += inflight * s.ranks * chunk * 4
        notes[:] = [n for n in notes if not n.startswith("FlatState.reduce_in_backward")]
    notes.append(f"release_grads: each grad leaves the device once copied to the host (reduced in backward with "
                 f"N_d > 1); the device keeps the params and at most {inflight} buckets of {bucket:,} grads in "
                 "flight; p.grad is not readable after backward: clip with max_grad_norm, not clip_grad_norm_")
    info["device_grad_numel"] = min(s.n, inflight * bucket)
    return info
