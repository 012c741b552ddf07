"""Adam moments of fp32 CPU params kept in NVMe swap files (``offload="nvme"``).

Interface (the store behind ``offload.Adam/AdamW(..., offload="nvme")``)::

    st = SwappedState(params, *, swap_dir, max_host_bytes=None, sub_group_size=None,
                      verify=False, resume=False, io_engine=None, backend=None,
                      num_threads=None, run_name="run", rank=None, pool=None, ctx=None, rule=ADAM,
                      stochastic_states=False)
        params: the fp32, contiguous CPU params (all groups, in a fixed order, each once; params
            of 0 elements are fine, even all of them). They are their own fp32 master and are
            updated in place; only the rule's states are swapped (Adam: exp_avg, exp_avg_sq;
            a rule without states is refused: nothing to swap). A rule of compressed states
            (Rule.with_state_dtype) keeps them so on disk, each param's blocks its own;
            stochastic_states: bf16 states rounded stochastically (else to nearest).
        max_host_bytes: bound on the pipeline buffers (None: 1 GiB); ValueError when it
            cannot hold 3 buffers of one sub-group. sub_group_size: elements per sub-group
            (rounded up to 1024; None: derived from the bound).
        resume: continue from the last consistent step in swap_dir (FileNotFoundError if
            none; ValueError if the params are not those of that step), in the directory whose
            params match and with its sub_group_size (see offload/swap/runs.py).
        io_engine: None/"auto"/"uring"/"threads"/"aiofiles", an IOConfig, or an engine object.
        ctx: the optimizer's StepContext (offload/optim/context.py): the step counts are read
            and set through ctx.steps, their one place (opt.state[p]["step"]); None: counts
            of this store's own (a store used without an optimizer).
        rank: None -> torch.distributed rank when initialised, else 0. The directory is
            SWAP_DIR/offload-<run_name>.rank<rank>; further stores of the same process on the
            same swap_dir take run_name-2, run_name-3, ... (in creation order).
    st.step(batches) -> dict of phase seconds for opt.step_stats()
        batches: [(hyper, [(param, grad, step), ...]), ...], one entry per param group;
        hyper an offload.optim.functional.AdamHyper (or a dict with lr, beta1, beta2, eps,
        weight_decay, decoupled and optionally bias_correction, maximize, grad_scale);
        step = the param's step number after incrementing (1 on the first step). Params
        without a grad are simply left out. Returns {kernel, swap_read, swap_write (the disk's
        busy time beyond reads, so that swap_read + swap_write = time with I/O in flight),
        wait_read, wait_write, verify, commit}; st.last_stats has the pipeline's full dict
        (swap_read_s, swap_write_s, io_busy_s, kernel_s, wait_read_s, wait_write_s, verify_s,
        commit_s, step_s, read_bytes, write_bytes, groups). Any failure (an I/O error raises
        SwapStepError, an OSError) leaves the swap state at the previous step; if params of
        sub-groups already computed were updated in place (listed in the message) further
        steps are refused until clear_failure() (params restored and checked, or
        accept_params=True) or load_checkpoint().
    st.read_state(p) -> (exp_avg, exp_avg_sq)        the rule's states (Adam's here), new tensors shaped like p
    st.write_state(p, exp_avg, exp_avg_sq, step=None)
    st.export_state(p) -> {"exp_avg", "exp_avg_sq"} ({} where opt.state[p] has no "step")
    st.import_state(p, {"exp_avg", "exp_avg_sq"[, "step"]})   (rule=: its fields, in order)
    st.step_of(p) -> int                             step count recorded for p (0: none yet)
    SwappedState.for_optimizer(opt, ctx=None)        built from opt.config (OffloadConfig), opt.backend,
                                                     opt.num_threads; counts in opt.state[p]["step"]
                                                     (set on resume and load_checkpoint)
    st.flush()                                       commit pending write_state() changes
    st.clear_failure(accept_params=False)            after a failed step and restored params
    with st.atomic_writes(): ...                     write_state()s committed at once at the end
    st.save_checkpoint(dir) / st.load_checkpoint(dir) streamed into / from dir/rank0/, the
        one checkpoint format ([Note: one checkpoint format] in offload/zero/ckpt_states.py),
        which offload="cpu" writes from / reads into host tensors too, so a checkpoint moves
        between offload="cpu" and "nvme" both ways
    st.memory_report() -> {"device", "pinned", "pageable", "nvme"} bytes
    st.last_stats                                     timings of the last step
    st.close(keep_swap=False)                         removes the swap directory (also done when st
                                                     is garbage-collected and at exit; not after
                                                     SIGTERM, nor in a forked child: see swap/cleanup.py);
                                                     keep_swap=True keeps it, unlocked, for resume=True
    st.swap_path, st.sub_group_size, st.num_buffers, st.host_bytes
[Note: fingerprint] in ``offload/optim/fingerprint.py``.

[Note: one swapped store] This is a face over ``SwappedShards`` (swapped_shards.py), the
store the flat store swaps with too: the fp32 CPU params laid end to end are its one shard,
its fields are the rule's only (Adam's ``IN_PLACE_FIELDS`` by default: the params are their own master), and each
param a step touches is one work item whose output, in mode ``"master"``, is the param
itself. What is left here is what fp32 params the user owns need: the per-param checks and
index, the fingerprint, and the failed state (a failed step may have changed params that
no swap file can restore).
"""
from __future__ import annotations

import collections
import contextlib
import os
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from offload.optim.context import OPT_META, StepContext, StepCounts
from offload.optim.fingerprint import Samples, fingerprint, sample_indices
from offload.optim.step_guard import failure_text, mark_consistent
from offload.optim.swapped_params import check_params as _check_params, work_items as _work_items
from offload.optim.swapped_ranges import compressed
from offload.optim.swapped_shards import IN_PLACE_FIELDS, SwappedShards, WorkItem
from offload.kernels.fields import ADAM, Rule, field_names
from offload.kernels.quant import BLOCK
from offload.swap import SwapStepError
from offload.swap.ckpt_dir import check_covers
from offload.swap.manifest_check import check_steps
from offload.swap.runs import ParamsMismatch

__all__ = ["SwappedState", "MOMENTS"]

MOMENTS = field_names(IN_PLACE_FIELDS)


class SwappedState:
    """See the module docstring for the interface."""

    kind = "nvme"

    def __init__(self, params: Sequence[torch.Tensor], *, swap_dir: str, max_host_bytes: Optional[int] = None,
                 sub_group_size: Optional[int] = None, verify: bool = False, resume: Any = False,
                 io_engine: Any = None, backend: Optional[str] = None, num_threads: Optional[int] = None,
                 run_name: str = "run", rank: Optional[int] = None, pool: Any = None,
                 ctx: Optional[StepContext] = None, rule: Rule = ADAM, stochastic_states: bool = False) -> None:
        self.params: List[torch.Tensor] = list(params)
        self.rule = rule
        self.names = rule.names  # the swapped states (the params are their own master)
        if not self.names:
            raise ValueError(f"rule {rule.name!r} keeps no state per element: offload='nvme' would swap "
                             "nothing; use offload='none' or 'cpu'")
        if not self.params:
            raise ValueError("offload='nvme' needs at least one param at construction (the swap files are laid "
                             "out for the params given then, and add_param_group() is not supported with "
                             "offload='nvme'): pass every param group, with its params, to the constructor, "
                             "or use offload='cpu'")
        self._index = _check_params(self.params)
        self._offsets: List[int] = []
        # packed int8 states: each param starts on a block (its blocks its own, as in the host
        # store); fp32/bf16 end to end ([Note: blocks in the swap space] in swapped_shards.py)
        unit = BLOCK if any(f.blocked for f in rule.fields) else 1
        total = 0
        for p in self.params:
            total = -(-total // unit) * unit
            self._offsets.append(total)
            total += p.numel()
        self.numel = total
        if rank is None:
            rank = torch.distributed.get_rank() if (torch.distributed.is_available()
                                                    and torch.distributed.is_initialized()) else 0
        # The counts live in ctx.steps; without an optimizer, in a state mapping of our own.
        self._own_counts = ctx is None
        self.ctx = ctx if ctx is not None else StepContext(StepCounts(lambda s=collections.defaultdict(dict): s))
        self._pending: Dict[int, int] = {}  # a step's new counts, until its commit went through
        self._broken: Optional[str] = None
        self._samples: Samples = Samples([])
        facts = {"kind": "fp32-in-place", "shapes": [list(p.shape) for p in self.params],
                 "dtypes": [str(p.dtype) for p in self.params]}
        # Params of 0 elements only (torch accepts them): a one-page store that no param
        # touches still records the step counts, so resume and checkpoints work the same.
        me = weakref.ref(self)  # the core's finalizer frees the files when we go: no cycle back to us
        self.core = SwappedShards([max(total, 1)], swap_dir=swap_dir, identity=facts, extra=lambda: me()._extra(),
                                  fields=rule.fields, rule=rule, summary=f"{len(self.params)} fp32 params, {total} elements",
                                  check_resume=self._check_resume, max_host_bytes=max_host_bytes,
                                  sub_group_size=sub_group_size, verify=verify, resume=resume, io_engine=io_engine,
                                  backend=backend, num_threads=num_threads, rank=rank, run_name=run_name, pool=pool,
                                  stochastic_states=stochastic_states)
        self.core.meta_dirty = False  # committed when a count changed (not when the params did)
        self._samples = sample_indices(self.params, self._offsets, self.core.layout)
        self._group_params = self._params_per_group()
        if self.core.resumed:  # resume="auto" chose; "discard" never resumes ([Note: restarts] in swap/runs)
            self.resume_counts()
            return
        try:
            self.core.initialise(None)
        except BaseException:
            self.core.close(remove=True)
            raise

    @classmethod
    def for_optimizer(cls, opt: Any, ctx: Optional[StepContext] = None) -> "SwappedState":
        """The store of ``offload.Adam/AdamW(..., offload="nvme")``: all params of ``opt``
        in param_groups order, options from ``opt.config`` (an OffloadConfig). The only place
        that reads ``opt``; without ``ctx``, one whose counts are ``opt.state[p]["step"]``.
        With ``resume=True`` the step counts found in the swap directory go there."""
        cfg = opt.config
        if ctx is None:
            ref = weakref.ref(opt)  # the optimizer holds the store: no cycle back to it
            ctx = StepContext(StepCounts(lambda: ref().state))
        params = [p for g in opt.param_groups for p in g["params"]]
        st = cls(params, swap_dir=cfg.swap_dir, max_host_bytes=cfg.max_host_bytes,
                 sub_group_size=cfg.sub_group_size, verify=cfg.verify, resume=cfg.resume, io_engine=cfg.io,
                 backend=opt.backend, num_threads=opt.num_threads, ctx=ctx)
        return st

    # ------------------------------------------------------------------ the core's parts
    @property
    def resumed(self) -> bool:
        """Whether the states came from a swap directory a previous run left (resume=)."""
        return bool(self.core.resumed)

    @property
    def store(self) -> Any:
        return self.core.store

    @property
    def _closed(self) -> bool:  # (as the flat store's: opt.state[p] of a closed store lists and reads none)
        return bool(self.core.store.closed)

    @property
    def pipeline(self) -> Any:
        return self.core.pipeline

    @property
    def layout(self) -> Any:
        return self.core.layout

    @property
    def _finalizer(self) -> Any:
        return self.core._finalizer

    @property
    def last_stats(self) -> Dict[str, float]:
        return self.core.last_stats

    @property
    def swap_path(self) -> str:
        return self.core.store.path

    @property
    def sub_group_size(self) -> int:
        return self.core.layout.sub_group_size

    @property
    def num_buffers(self) -> int:
        return len(self.core.pipeline.buffers)

    @property
    def host_bytes(self) -> int:
        return self.core.pipeline.host_bytes

    def memory_report(self) -> Dict[str, int]:
        return self.core.memory_report()

    # ------------------------------------------------------------------ bookkeeping
    def _params_per_group(self) -> List[List[int]]:
        out: List[List[int]] = [[] for _ in range(self.layout.num_groups)]
        for i, p in enumerate(self.params):
            off = self._offsets[i]
            for g in self.layout.groups_overlapping(off, off + p.numel()):
                out[g].append(i)
        return out

    def fingerprint(self) -> str:
        return fingerprint(self.params, self._samples)

    def _counts(self) -> List[int]:
        """The step count of each param: a step's new ones while it commits, else ctx's."""
        get, pending = self.ctx.steps.get, self._pending
        return [pending[i] if i in pending else get(p) for i, p in enumerate(self.params)]

    def _set_counts(self, steps: Sequence[Any]) -> None:
        """Counts from a manifest or a checkpoint: new step tensors, not the old ones filled
        (``state_dict()`` hands out those very tensors, and torch's ``load_state_dict`` shares
        them with the dict it loaded)."""
        for p, n in zip(self.params, steps):
            self.ctx.steps.set(p, 0)
            self.ctx.steps.set(p, int(n))

    def resume_counts(self) -> None:
        """The step counts (and the optimizer's commit_meta) of the resumed commit."""
        self._set_counts(self.core.store.extra["steps"])
        self.ctx.resumed_from(self.core.store.extra)

    def _extra(self) -> Dict[str, Any]:
        """What each commit records with the moments (the core adds the identity)."""
        # (the shapes too, in the identity: made once, not at each commit)
        return {"steps": self._counts(), "fingerprint": self.fingerprint(), **self.ctx.commit_extra()}

    def add_param_group(self, group: Dict[str, Any]) -> None:
        """Refused: the swap files are laid out for the params given at construction."""
        raise NotImplementedError(
            "add_param_group after construction is not supported with offload='nvme' (the swap files are laid out "
            "for the params given at construction): pass every param group to the constructor (a group can start "
            "with lr=0), or use offload='cpu'")

    def _check_resume(self, extra: Dict[str, Any], store: Any) -> bool:
        """The core's resume check of each directory of these shapes (called while it is built):
        these params, at that step; ParamsMismatch for other values, and the next directory of
        the shapes is tried ([Note: same identity] in swap/runs.py)."""
        self._samples = sample_indices(self.params, self._offsets, store.layout)
        path = store.path
        check_steps(extra, os.path.join(path, "manifest.json"), len(self.params))
        shapes = [list(p.shape) for p in self.params]
        if extra.get("shapes") != shapes:
            raise ValueError(f"{path}: the swap directory holds states of other params "
                             f"({len(extra.get('shapes') or [])} params of other shapes)")
        if extra.get("fingerprint") != self.fingerprint():
            raise ParamsMismatch(f"{path}: the params given are not those of step {store.step} in the swap directory "
                                 f"(fingerprint {self.fingerprint()} != {extra.get('fingerprint')}): load the params "
                                 "saved right after it, or start afresh with resume='discard'")
        return True

    def _param_index(self, p: torch.Tensor) -> int:
        i = self._index.get(id(p))
        if i is None or self.params[i] is not p:
            raise ValueError(f"tensor of shape {tuple(p.shape)} is not one of this optimizer's params")
        return i

    def step_of(self, p: torch.Tensor) -> int:
        return self.ctx.steps.get(self.params[self._param_index(p)])

    # ------------------------------------------------------------------ the step
    def _work(self, batches: Sequence[Tuple[Any, Sequence[Tuple[torch.Tensor, torch.Tensor, int]]]]
              ) -> Dict[int, WorkItem]:
        """One work item per param that has a grad (``swapped_params.work_items``)."""
        return _work_items(batches, self.params, self._index, self._offsets, self.rule, self.core.rounds,
                           self._param_index)

    def step(self, batches: Sequence[Tuple[Any, Sequence[Tuple[torch.Tensor, torch.Tensor, int]]]]) -> Dict[str, float]:
        if self._broken:
            raise RuntimeError(self._broken)
        work = self._work(batches)
        if not work:
            return {}
        self.flush()
        # the new counts go into the commit of the step, and to ctx once it went through
        self._pending = {i: int(it.kwargs["step"]) for i, it in work.items()}
        try:
            phases = self.core.step(list(work.values()))
        except BaseException as exc:
            groups = set(self.core.computed)
            raise self._failed(exc, sorted(i for i in work if any(g in groups for g in self._groups_of(i))))
        finally:
            pending, self._pending = self._pending, {}
        for i, it in work.items():
            p = self.params[i]
            if not p.is_contiguous():
                p.detach().copy_(it.out.view(p.shape))
        self.ctx.steps.settle((self.params[i], n) for i, n in pending.items())
        return phases

    def _groups_of(self, i: int) -> range:
        off = self._offsets[i]
        return self.layout.groups_overlapping(off, off + self.params[i].numel())

    def _failed(self, exc: BaseException, touched: List[int]) -> BaseException:
        """The exception a failed step raises. The swap files hold the previous step (a
        step commits last); params untouched: nothing to undo and the step can be retried;
        else the store is broken until clear_failure() (see [Note: failed steps] in
        offload/optim/step_guard.py)."""
        if not touched:
            return mark_consistent(exc)
        held = (f"the in-place fp32 params {touched} of the sub-groups already computed hold step-"
                f"{self.store.step + 1} values, their moments and step counts step {self.store.step}")
        self._broken = failure_text(exc, "nvme", held)
        if isinstance(exc, SwapStepError):
            # exc.strerror, not str(exc): OSError's str already adds "[Errno n]" and the path
            msg = f"{exc.strerror}; {failure_text(exc, 'nvme', held, cause=False)}"
            return SwapStepError(exc.errno, msg, exc.filename, exc.computed)
        return exc

    def clear_failure(self, accept_params: bool = False) -> None:
        """After a failed step: accept the params again once they are back at the step the
        swap files hold (checked with the fingerprint), so training can go on;
        ``accept_params=True``: go on from the params as they are (recorded as that step's)."""
        if not self._broken:
            return
        if accept_params:
            self.store.commit({}, self.core._meta(), advance=False)
        elif self.store.extra.get("fingerprint") != self.fingerprint():
            raise ValueError(f"the params are not those of step {self.store.step} held in {self.store.path}; "
                             "restore them first (or load_checkpoint(), or clear_failure(accept_params=True))")
        self._broken = None

    # ------------------------------------------------------------------ one param's states
    def read_state(self, p: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``p``'s states in field order (Adam: exp_avg, exp_avg_sq), new tensors shaped like p."""
        i = self._param_index(p)
        off = self._offsets[i]
        got = self.core.read(0, off, off + p.numel(), self.names)
        return tuple(got[k].view(p.shape) for k in self.names)

    def read_stored(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """``p``'s state ``name`` as stored, a new tensor: what ``opt.state[p][name]`` reads
        (state_view.py), as the host store holds it: float32 or bf16 shaped like p, int8 as
        p's own packed blocks (1-D uint8)."""
        off = self._offsets[self._param_index(p)]
        t = self.core.read_storage(0, off, off + p.numel(), name)
        return t if self.core.fields[self.names.index(name)].blocked else t.view(p.shape)

    def write_state(self, p: torch.Tensor, *states: torch.Tensor, step: Optional[int] = None) -> None:
        """``p``'s states, in field order (Adam: exp_avg, exp_avg_sq)."""
        i = self._param_index(p)
        n, off = p.numel(), self._offsets[i]
        if len(states) != len(self.names):
            raise ValueError(f"param {i}: {len(states)} states given, the rule keeps {list(self.names)}")
        src = {}
        for f, t in zip(self.core.fields, states):
            if not isinstance(t, torch.Tensor) or t.numel() != n:
                raise ValueError(f"param {i}: {f.name} must be a tensor of {n} elements, got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
            src[f.name] = t.detach().reshape(-1).to(device="cpu",  # compressed: the store encodes fp32
                                                    dtype=torch.float32 if compressed(f) else f.dtype)
        self.core.write(0, off, off + n, src)
        if step is not None:
            self.ctx.steps.set(p, int(step))
            self.core.meta_dirty = True

    def export_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        # (by the entry's "step", as the flat store's: Adagrad's unstepped sums are torch's too)
        if not self.ctx.steps.has(self.params[self._param_index(p)]):
            return {}
        return dict(zip(self.names, self.read_state(p)))

    def import_state(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        step = state.get("step")
        if step is None and self.ctx.steps.has(p):  # the optimizer keeps torch's "step" in opt.state
            step = self.ctx.steps.get(p)
        if isinstance(step, torch.Tensor):
            step = int(step.item())
        self.write_state(p, *[state[k] for k in self.names], step=None if step is None else int(step))

    def reset_state(self, p: torch.Tensor) -> None:
        """Zero moments and step 0 for ``p`` (loading a state_dict without state for it)."""
        z = torch.zeros(p.numel(), dtype=torch.float32)
        self.write_state(p, *[z] * len(self.names), step=0)

    @contextlib.contextmanager
    def atomic_writes(self) -> Iterator[None]:
        """The write_state()s inside go to the free slots and are committed once at the end,
        with the steps: a kill or an error at any point leaves every state as before. The
        counts too: ours put back here; an optimizer's ``load_state_dict`` puts its whole
        ``opt.state`` back itself (setting counts here would write into the dict it loaded)."""
        before = self._counts() if self._own_counts else None
        try:
            with self.core.atomic_writes():
                yield
        except BaseException:
            if before is not None:
                self._set_counts(before)
            raise

    def flush(self) -> None:
        """Write the cached sub-group changed by write_state() into its free slot and commit
        (the manifest flips only that sub-group; the step count does not advance)."""
        if self.core.store.extra.get(OPT_META) != (self.ctx.commit_meta or None):
            self.core.meta_dirty = True  # the optimizer's record changed (a load): committed too
        self.core.flush()
    commit_writes = flush  # the protocol's name, called before the counts advance

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str, extra: Optional[Dict[str, Any]] = None) -> str:
        """Stream the moments (and per-param steps, shapes, ``extra``) to ``directory/rank0/``
        ([Note: one checkpoint format] in offload/zero/ckpt_states.py). Peak extra host
        memory: the pipeline buffers."""
        from offload.zero.ckpt_states import save_store_states

        meta = dict(extra or {}, steps=self._counts(), shapes=[list(p.shape) for p in self.params],
                    fingerprint=self.fingerprint(), swap_step=self.store.step)
        numels = [p.numel() for p in self.params]
        return self.core.save(lambda store, buffers: save_store_states(directory, numels, store, buffers, meta))

    def load_checkpoint(self, directory: str) -> None:
        """Replace the moments and steps with those of checkpoint ``directory`` (same param
        shapes; any sub_group_size; the previous release's format too). The params
        themselves are the caller's."""
        from offload.zero.ckpt_convert import read_converted
        from offload.zero.ckpt_states import fill_store_states

        shapes, numels = [list(p.shape) for p in self.params], [p.numel() for p in self.params]
        converted = read_converted(directory, numels, self.core.fields)
        if converted is not None:  # other state dtypes: [Note: converting loads] in offload/zero/ckpt_convert.py
            self._load_converted(directory, shapes, *converted)
            return

        def fill(store: Any, buffers: List[Any]) -> Tuple[Dict[str, Any], Dict[int, Any]]:
            meta, written = fill_store_states(directory, numels, store, buffers, self.core.fields)
            check_covers(meta, shapes, directory)  # (before the commit)
            return meta, written

        before = self._counts()
        try:
            self.core.load_checkpoint(fill, lambda meta: self._set_counts(meta["steps"]))
        except BaseException:
            self._set_counts(before)  # the swap files hold the moments of these counts still
            raise
        self._broken = None

    def _load_converted(self, directory: str, shapes: List[List[int]], meta: Dict[str, Any],
                        states: Dict[str, List[torch.Tensor]]) -> None:
        """Float32 states per param (decoded from a checkpoint of other dtypes), encoded as
        this store keeps them and committed at once."""
        check_covers(meta, shapes, directory)
        with self.atomic_writes():
            for i, p in enumerate(self.params):
                step = int(meta["steps"][i])
                self.write_state(p, *[states[k][i] for k in self.names], step=step)
        self._broken = None

    # ------------------------------------------------------------------ closing
    def close(self, keep_swap: bool = False) -> None:
        """Release buffers and remove the swap directory (use save_checkpoint() first to keep
        the states). ``keep_swap=True``: keep it, unlocked, at its last committed step (pending
        write_state() changes committed first), for a new store with ``resume=True``."""
        if keep_swap and not self._broken and not self.store.closed:
            self.flush()
        self.core.close(remove=not keep_swap)

    def __enter__(self) -> "SwappedState":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
