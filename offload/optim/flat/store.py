"""Flat fp32 states on the host for device or fp16/bf16 params, optionally partitioned (ZeRO 1/2).

This is the store behind ``offload.Adam``/``AdamW`` whenever params are not fp32 CPU tensors
updated in place (see ``offload/optim/protocol.py``): fp16/bf16 params on the CPU, params on
CUDA, and any params partitioned at stage 1 or 2.

Params are grouped by (device, dtype) into *flat groups* (see [Note: flat layout] in
``offload/zero/partition.py``). For each, this rank keeps its shard of a flat fp32 master,
``exp_avg`` and ``exp_avg_sq`` in host buffers from the memory layer (with CUDA, only the
buffers DMA touches are pinned; with ``offload="nvme"`` master and moments go to swap files,
[Note: nvme] in ``swapped.py``). One step runs the fused kernel per (param ∩ shard) piece
(cut into sub-groups for CUDA params or when ``sub_group_size`` is given); the kernel
upcasts the grad and writes the fp16/bf16 copy of the updated master in the same pass.

``FlatState`` composes collaborators with one job each (``offload/optim/flat/``): the grads
come from a ``GradSource`` (``grads.py``), the updated params go through a ``ParamSink``
(``sinks.py``), the states are host buffers (``HostBacking``, ``steps.py``) or swap files
(``SwapBacking``, ``swapped.py``), one step loop drives them ([Note: one step loop] in
``steps.py``), and the state_dict and checkpoint sides are ``load_hooks.py`` and
``checkpoints.py``. It is built from explicit arguments and reads what it needs of its
optimizer from the step context (``offload/optim/context.py``), never the optimizer itself.

Stage 1 vs 2: both keep 1/N of the fp32 states and of the host grad buffer per rank; they
differ in the collective (all-reduce vs reduce-scatter). ``p.grad`` itself stays full on
every rank ([Note: what p.grad holds] in ``grads.py``) unless ``release_grads=True`` frees
it in backward ([Note: releasing grads] there).

[Note: compressed states in the flat store] The store's rule (the optimizer's
``_store_rule``) says how each state is stored: fp32, bf16, or packed int8 blocks. The
buffers hold that storage, a blocked field makes the layout block-aligned ([Note:
block-aligned flat layout] in offload/zero/partition.py) and every cut of a state (shards,
buckets, sub-groups) falls on a block boundary. A step of group ``k`` rounds with
``quant.rounding_seed(step, k)`` at ``element_offset`` = the item's index in the whole flat
group, so an element's random bits do not depend on the number of ranks.

[Note: bf16 master] ``master_dtype="bfloat16"`` with bf16 params: the group keeps no fp32
master. The bf16 flat param values are the master and the kernel steps them in place,
rounding stochastically (stream 0): the param itself (CPU, one rank), the pinned staging
buffer that then goes to the device (CUDA, one rank), or this rank's bf16 shard that is then
all-gathered (several ranks). 2 bytes per param plus the states, instead of 4 + 2 + states.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.kernels import get_backend
from offload.kernels.fields import ADAM, Rule
from offload.kernels.quant import BLOCK
from offload.memory import BufferPool
from offload.optim.context import StepContext
from offload.optim.flat import checkpoints, load_hooks, param_sync, swapped
from offload.optim.flat.grads import GradSource
from offload.optim.flat.sinks import ParamSink, drain_at_collection, drain_streams
from offload.optim.flat.steps import HostBacking, run_step
from offload.optim.state_codec import STOCHASTIC_BF16_STATES
from offload.zero import SideStream, comm
from offload.zero.backward_reduce import BackwardReducer
from offload.zero.flat_group import LOWP, FlatGroup

__all__ = ["FlatState"]

log = logging.getLogger("offload.optim")


class FlatState:
    """Flat fp32 master and moments on the host, sharded over data-parallel ranks."""

    kind = "flat"

    @property
    def resumed(self) -> bool:
        """Whether the states came from a swap directory a previous run left (resume=)."""
        return self._swap is not None and bool(self._swap.resumed)

    copy_cpu_grads = False
    """Run the hook + host-grad-buffer path for CPU params too (tests; CUDA always uses it)."""
    overlap = True
    """False: host-to-device copies on the compute stream, synchronous (for comparisons)."""
    stage_cpu_params = False
    """Send CPU bf16/fp16 params through the staging buffer and a copy, as CUDA params go
    (tests: the CUDA path's indexing runs on the CPU too)."""
    side_streams: Optional[Callable[[torch.device], Tuple[Any, Any]]] = None
    """Tests: makes the (grad, copy) pair of stream-like objects for CPU params (an emulation
    of CUDA streams that defers async copies: tests/stream_emulation.py), so the CUDA path's
    stream logic runs in CI. CUDA params always get real ``SideStream`` pairs."""
    reduce_in_backward = False
    """Several ranks: start each bucket's reduction from the grad hooks, during backward (see
    [Note: reduce in backward] in offload/zero/backward_reduce.py); the default of the
    constructor's ``reduce_in_backward``, read when the store is built. Off by default."""
    inflight = 2
    """Buckets in flight at once when reducing in backward (send buffers kept)."""
    bucket_numel = 1 << 22
    """Elements of each rank's shard moved per collective (bounds the send buffers)."""
    default_sub_group = 1 << 22
    """Elements per kernel call / host-to-device copy when ``sub_group_size`` is not given."""

    def __init__(self, param_groups: List[Dict[str, Any]], *, config: Any, ctx: StepContext, stage: int,
                 backend: Optional[str] = None, num_threads: Optional[int] = None, process_group: Any = None,
                 reduce_in_backward: Optional[bool] = None, rule: Rule = ADAM,
                 master_dtype: Optional[str] = None, release_grads: bool = False) -> None:
        """``param_groups``: torch's param groups (only their "params" are read); ``config``:
        the optimizer's OffloadConfig; ``ctx``: its step context; ``rule``: the kernel rule
        whose fields every flat group keeps beside the master (stored as its fields say:
        [Note: compressed states in the flat store]); ``master_dtype="bfloat16"``: bf16
        params are their own master ([Note: bf16 master]); ``release_grads``: device grads
        leave in backward ([Note: releasing grads] in grads.py; several ranks reduce in backward)."""
        self.ctx = ctx
        self.rule = rule
        self.stochastic_states = STOCHASTIC_BF16_STATES  # bf16 states (state_codec says why)
        self.master_lowp = master_dtype == "bfloat16"
        self.stage = stage
        self.group = process_group
        world, rank = comm.world_and_rank(process_group) if stage > 0 else (1, 0)
        self.world, self.rank = world, rank
        if world > 1:  # before anything is laid out: [Note: the same params on every rank] (comm.py)
            comm.agree_on_params([g["params"] for g in param_groups], stage, process_group)
        self.release_grads = release_grads
        if release_grads:
            self._check_release([p for g in param_groups for p in g["params"]])
            reduce_in_backward = world > 1  # several ranks: the grads leave with the reduction in backward
        self._backend = backend
        self._threads = num_threads
        # Sub-groups pace the host-to-device pipeline; for CPU params they would only add
        # kernel calls (each call has a fixed cost: bench/RESULTS.md), so CPU params are cut
        # only when the user asked for a sub_group_size.
        self._sub_user = config.sub_group_size
        self._sub = config.sub_group_size or self.default_sub_group
        if any(f.blocked for f in rule.fields):  # sub-groups cut states at whole blocks
            self._sub = -(-self._sub // BLOCK) * BLOCK
        self._comm_dev = comm.comm_device(process_group) if world > 1 else torch.device("cpu")
        # Not prefaulted: the pool maps 64 MiB regions, and a small model's 24 MiB of states held
        # the whole region resident (its buffers are written at once anyway: nothing to gain).
        self._pools = (BufferPool(pin=False, prefault=False, name=f"flat-state:{id(self):x}"),
                       BufferPool(name=f"flat-state-pinned:{id(self):x}"))  # pinned when CUDA is present
        self._groups: List[FlatGroup] = []
        self._where: Dict[torch.Tensor, Tuple[FlatGroup, int]] = {}
        self._order: List[torch.Tensor] = []  # every param, in param_groups order
        self._hooks = []
        self._streams: Dict[torch.device, Tuple[SideStream, SideStream]] = {}
        weakref.finalize(self, drain_at_collection, self._streams).atexit = False
        me = weakref.ref(self)

        def overlap() -> bool:  # read at each copy: bench/offload_step.py flips it between steps
            return me().overlap
        self._grads = GradSource(ctx=ctx, groups=self._groups, where=self._where, order=self._order,
                                 streams=self._streams, zero_stage=stage, world=world, group=process_group,
                                 comm_dev=self._comm_dev, backend=self._backend, threads=self._threads,
                                 overlap=overlap)
        self._grads.release = release_grads
        self._grads.release_bound = self.inflight * self.bucket_numel  # the planner's ([Note: release grads])
        self._nvme = config.offload == "nvme"
        self._stash: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        self._stepped: frozenset = frozenset()  # params with moments when a load began (reset_state)
        self._closed = False
        self._swap = None
        self._swap_vote = None
        for group in param_groups:
            self.add_param_group(group)
        self._settle_nvme(config, overlap)
        param_sync.record(self)  # the masters are the params' values now
        if reduce_in_backward is None:
            reduce_in_backward = self.reduce_in_backward
        self._backward_reduction: Optional[BackwardReducer] = None
        if reduce_in_backward and self.world > 1 and self._groups:
            self._backward_reduction = self._grads.reducer = self._backward_reducer()
            self._hooks.extend(self._backward_reduction.register())

    def _settle_nvme(self, config: Any, overlap: Callable[[], bool]) -> None:
        """Whether the states go to swap files after all, then the param sink for that."""
        if self._nvme and self._groups and not any(fg.fields for fg in self._groups):
            # Nothing per element to swap (SGD without momentum over bf16 params that are their
            # own master): stepped in RAM as offload="cpu" does, as the host store does for fp32
            # params (host_state.nothing_to_swap); checkpoints and state_dict carry the steps.
            log.warning("no state to swap (the rule keeps none per element and the bf16 params are their own "
                        "master): offload='nvme' steps them as offload='cpu' does, and writes no swap files")
            self._nvme = False
            for fg in self._groups:
                fg.swapped = False
        # Built once nvme is settled: in RAM, several ranks gather each bucket as it is stepped;
        # the swapped step gathers whole shards after its commit (gather_all), and a store that
        # fell back to RAM above has no such commit (built before, it gathered nothing at all).
        self._sink = ParamSink(self._streams, world=self.world, group=self.group, gather_per_bucket=not self._nvme,
                               overlap=overlap)
        if self._nvme:
            swapped.open_swap(self, config)

    def _backward_reducer(self) -> BackwardReducer:
        me = weakref.ref(self)  # hooks live on the params, which outlive us: never a strong ref
        ctx = self.ctx

        def disabled() -> bool:
            return me() is None or ctx.grads_already_averaged or ctx.no_sync
        return BackwardReducer(self._groups, group=self.group, stage=self.stage, comm_dev=self._comm_dev,
                               inflight=self.inflight, disabled=disabled, release=self.release_grads)

    def _check_release(self, params: List[torch.Tensor]) -> None:
        """release_grads frees device grads; CPU params' grads are host memory the step reads in
        place (``copy_cpu_grads``: tests run the device path with CPU params)."""
        cpu = [i for i, p in enumerate(params) if p.device.type == "cpu"]
        if cpu and not self.copy_cpu_grads:
            raise ValueError(f"release_grads=True frees device grads once copied to the host; parameter {cpu[0]} "
                             "is on the CPU, where its grad already lives and is read in place: drop "
                             "release_grads (it is for CUDA params)")

    # ------------------------------------------------------------------ construction
    def add_param_group(self, group: Dict[str, Any]) -> None:
        if self._swap is not None:
            raise NotImplementedError("add_param_group is not supported with offload='nvme': give the constructor every group")
        params = [p for p in group["params"] if p not in self._where]
        if self.release_grads:
            if self.world > 1 and getattr(self, "_backward_reduction", None) is not None:
                raise NotImplementedError("add_param_group with release_grads on several ranks: the reduction in "
                                          "backward is laid out for the constructor's groups; give it every group")
            self._check_release(params)
        for p in params:
            _check_param(p)
        self._order.extend(params)
        keys: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        for p in params:
            keys.setdefault((p.device, p.dtype), []).append(p)
        for (device, _), members in keys.items():
            hook_path = self.world == 1 and (device.type == "cuda" or self.copy_cpu_grads)
            fg = FlatGroup(members, world=self.world, rank=self.rank, pools=self._pools,
                           comm_dev=self._comm_dev, bucket_numel=self.bucket_numel,
                           need_host_grad=hook_path, stage_cpu=self.stage_cpu_params, swapped=self._nvme,
                           rule=self.rule, master_lowp=self.master_lowp)
            self._groups.append(fg)
            for i, p in enumerate(members):
                self._where[p] = (fg, i)
                if hook_path and p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(_weak_hook(self._grads)))
            if device not in self._streams:
                pair = self._make_side_streams(device)
                if pair is not None:
                    self._streams[device] = pair
        if hasattr(self, "_versions"):  # a group added later: its masters are its values now
            self._versions.update((p, param_sync.mark(p)) for p in params)

    def _make_side_streams(self, device: torch.device) -> Optional[Tuple[Any, Any]]:
        # grad: D2H grad copies, overlapping the rest of backward. copy: H2D param copies,
        # overlapping the CPU kernel of the next sub-group. [Note: streams of the flat
        # store] in offload/zero/streams.py.
        if device.type == "cuda":
            return SideStream(device), SideStream(device)
        if self.side_streams is not None:
            return self.side_streams(device)
        return None

    # ------------------------------------------------------------------ grads in (GradSource)
    def _drain(self) -> None:
        """Wait for every side-stream copy. step() returns with param copies still queued
        that read the pinned master / staging buffers: any host write to those outside
        step() (a load) must come after them, or the device gets the new bytes half-way."""
        drain_streams(self._streams)

    def begin_step(self) -> None:
        """A new step: the context holds GradScaler's facts (with several ranks its found_inf
        is agreed by ``agree_on_grads``, the step's first collective; none here)."""
        self._grads.begin_step()

    def agree_on_grads(self, failed: bool = False, facts: Tuple[int, int] = (0, 0)) -> Optional[List[Tuple[int, ...]]]:
        """Several ranks: settle which params have a grad this step, and found_inf; each rank's
        (failed, *facts) (a collective, on every rank: GradSource.agree)."""
        return self._grads.agree(failed, facts)

    def grads(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        return self._grads.grads(p)

    def drop_released_grads(self) -> None:
        """[Note: releasing grads]: a step consumed the grads backward released, or zero_grad dropped them."""
        self._grads.drop_released()

    def prepare_grads(self) -> None:
        """Make this step's grads ready where the kernel reads them (the optimizer times this
        as grad_transfer): the cross-rank reduction, or the pending host copies."""
        self._grads.prepare()

    def global_grad_sumsq(self, work) -> Tuple[float, bool]:
        return self._grads.global_sumsq(work)

    # ------------------------------------------------------------------ the step
    def step(self, batches) -> Dict[str, float]:
        """[Note: one step loop] in steps.py, over the host buffers or the swap files."""
        t0 = time.perf_counter()
        param_sync.refresh_changed(self)  # [Note: params written by others]
        self._grads.prepare()
        phases = {"grad_transfer": time.perf_counter() - t0, "kernel": 0.0, "h2d": 0.0, "allgather": 0.0}
        self._sink.begin()
        if self._nvme:
            backing: Any = swapped.SwapBacking(self)
        else:
            backing = HostBacking(self, get_backend(self._backend), phases)
        try:
            return run_step(self, backing, batches, phases)
        finally:
            param_sync.record(self)  # the params as this step wrote them

    def params_written(self) -> None:
        """The step's params were marked written (step_guard.mark_written): not another's write."""
        param_sync.record(self)

    def _params_from_swap(self) -> None:
        swapped.params_from_swap(self)

    # ------------------------------------------------------------------ state_dict (load_hooks)
    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The full fp32 master of ``p`` (gathered across ranks: call on every rank); with a
        bf16 master ([Note: bf16 master]) the param's own values."""
        if self._where[p][0].master_lowp:
            return p.detach().float().clone()
        return load_hooks.gather_full(self, p, ("master",))["master"]

    def export_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        return load_hooks.export_state(self, p)

    def import_state(self, p: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        load_hooks.import_state(self, p, state)

    def reset_state(self, p: torch.Tensor) -> None:
        """Zero moments for ``p`` (loading a state_dict without state for it; as torch)."""
        load_hooks.reset_state(self, p)

    def before_load(self, state_dict: Dict[str, Any], params: List[torch.Tensor]) -> None:
        """torch's load_state_dict is about to replace opt.state (``params``: the optimizer's, in order)."""
        load_hooks.pre_load(self, params, state_dict)

    def after_load(self) -> None:
        """torch's load_state_dict is done: masters from the loaded dict, or from the params."""
        load_hooks.post_load(self)
        param_sync.record(self)

    def end_load(self) -> None:
        """The load is over (done or failed): drop what ``before_load`` kept for import_state."""
        self._stash = {}

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_steps(self) -> List[int]:
        return checkpoints.ckpt_steps(self)

    def _set_steps(self, steps: List[int]) -> None:
        checkpoints.set_steps(self, steps)

    def save_checkpoint(self, directory: str, extra: Optional[Dict[str, Any]] = None) -> None:
        """Per-rank shards + meta (see [Note: flat checkpoints] in offload/zero/checkpoint.py);
        with offload="nvme" streamed from the swap files; all ranks or none ([Note: shards saved all or none])."""
        checkpoints.save_checkpoint(self, directory, extra)

    def load_checkpoint(self, directory: str) -> None:
        """Masters, moments and steps from a checkpoint of any world size; params follow.

        All or nothing, on every rank: a rank that cannot load (a missing or corrupt file, a
        full swap disk) makes every rank raise with its optimizer as it was, instead of
        leaving the others in the params' all-gather or half loaded. With offload="nvme" the
        checkpoint streams into the free swap slots, and the ranks vote before and after the
        commit as for a step ([Note: ranks vote before commit] in swap/pipeline.py). In host
        memory, every file this rank needs is read through and its crc32 checked first, the
        ranks agree, and only then are the states overwritten; only an I/O error in that
        second read (or a file changed between the two) can still leave them half loaded, and
        the error says so."""
        checkpoints.load_checkpoint(self, directory)
        param_sync.record(self)  # the params follow the loaded masters

    # ------------------------------------------------------------------ reports
    def commit_writes(self) -> None:
        """The protocol's: states written since the last step, committed with the counts as they are."""
        if self._swap is not None:
            self._swap.flush()  # (the metadata too where it changed since the last commit)

    def memory_report(self) -> Dict[str, int]:
        host = {"states": 0, "grads": 0, "lowp": 0}
        device = 0
        for fg in self._groups:
            nb = fg.nbytes()
            for k in host:
                host[k] += nb[k]
            if self._comm_dev.type == "cuda":
                device += nb["comm"]
            else:
                host["grads"] += nb["comm"]
        total = sum(host.values())
        pinned = sum(buf.nbytes for fg in self._groups for _, buf in fg._bufs if buf.pinned)
        nvme = io_locked = 0
        if self._swap is not None:
            sw = self._swap.memory_report()
            pinned += sw["pinned"]
            total += sw["pinned"] + sw["pageable"]
            nvme, io_locked = sw["nvme"], sw["io_locked_bytes"]
        return {"device": device, "pinned": pinned, "pageable": total - pinned, "nvme": nvme,
                "io_locked_bytes": io_locked,
                "state_bytes": host["states"], "grad_bytes": host["grads"], "lowp_bytes": host["lowp"],
                "world": self.world, "rank": self.rank, "stage": self.stage, "release_grads": self.release_grads,
                "grad_peak_numel": self._grad_peak_numel(),
                "shard_numel": sum(fg.layout.shard for fg in self._groups)}

    def _grad_peak_numel(self) -> int:
        """release_grads: the most grad elements seen alive in backward (on the device, for CUDA
        params), measured by the hooks; 0 without release_grads."""
        if self._backward_reduction is not None:
            return self._backward_reduction.peak_numel
        return self._grads.grad_peak_numel

    def close(self, keep_swap: bool = False) -> None:
        if self._closed:
            return
        if keep_swap and self._swap is not None and not self._swap.store.closed:
            # states written since the last step (an assigned or changed opt.state[p] entry)
            # are committed first, as SwappedState.close does: resume=True goes on from them
            self._swap.flush()
        self._closed = self._grads.closed = True
        if getattr(self, "_backward_reduction", None) is not None:
            self._backward_reduction.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drain()
        if self._swap is not None:
            self._swap.close(remove=not keep_swap)  # keep_swap: for resume=True
            self._swap = None
        for fg in self._groups:
            fg.close()
        self._groups = []
        self._stash = {}
        try:
            for pool in self._pools:
                pool.close()
        except BufferError:  # a caller still holds a view: the region goes with its last one
            log.warning("flat store closed while tensors viewing its host buffers are alive (opt.state[p] "
                        "entries kept after close(), say): that memory stays mapped until they go")


def _check_param(p: torch.Tensor) -> None:
    if p.dtype not in (torch.float32,) + LOWP:
        raise ValueError(f"parameter of dtype {p.dtype}: only float32, float16 and bfloat16 are supported")
    if p.device.type == "meta":  # the flat store copies the params' values when it is built
        raise ValueError("parameter on meta (no values): this store copies the params when it is built (fp16/bf16 "
                         "or device params, stages 1-3, offload='nvme'); build the optimizer after materializing the "
                         "model (module.to_empty(device=...), then its init or a load)")
    if p.device.type not in ("cpu", "cuda"):
        raise ValueError(f"parameter on {p.device}: only CPU and CUDA params are supported")
    if p.device.type == "cuda" and not p.is_contiguous():
        raise ValueError(f"CUDA parameter of shape {tuple(p.shape)} is not contiguous; "
                         "the flat store copies updated values into it as one range")


def _weak_hook(grads: GradSource):
    """A grad hook that reaches the grad source through a weak reference: a param (which
    outlives the optimizer) must not keep the store, its buffers and its swap files alive."""
    ref = weakref.ref(grads)

    def hook(p: torch.Tensor) -> None:
        s = ref()
        if s is not None:
            s.grad_ready(p)
    return hook
