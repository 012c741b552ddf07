"""Adam moments of fp32 CPU params kept in NVMe swap files (``offload="nvme"``).

Interface (the store behind ``offload.Adam/AdamW(..., offload="nvme")``)::

    st = SwappedState(params, *, swap_dir, max_host_bytes=None, sub_group_size=None,
                      verify=False, resume=False, io_engine=None, backend=None,
                      num_threads=None, run_name="run", rank=None, pool=None)
        params: the fp32, contiguous CPU params (all groups, in a fixed order, each once; params
            of 0 elements are fine, even all of them). They are their own fp32 master and are
            updated in place; only exp_avg and exp_avg_sq are swapped.
        max_host_bytes: bound on the pipeline buffers (None: 1 GiB); ValueError when it
            cannot hold 3 buffers of one sub-group. sub_group_size: elements per sub-group
            (rounded up to 1024; None: derived from the bound).
        resume: continue from the last consistent step in swap_dir (FileNotFoundError if
            none; ValueError if the params are not those of that step), in the directory whose
            params match and with its sub_group_size (see offload/swap/runs.py).
        io_engine: None/"auto"/"uring"/"threads"/"aiofiles", an IOConfig, or an engine object.
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
    st.read_state(p) -> (exp_avg, exp_avg_sq)        new tensors shaped like p
    st.write_state(p, exp_avg, exp_avg_sq, step=None)
    st.export_state(p) -> {"exp_avg", "exp_avg_sq"} ({} before p's first step)
    st.import_state(p, {"exp_avg", "exp_avg_sq"[, "step"]})
    st.step_of(p) -> int                             step count recorded for p (0: none yet)
    SwappedState.for_optimizer(opt)                  built from opt.config (OffloadConfig), opt.backend,
                                                     opt.num_threads; keeps opt.state[p]["step"] in
                                                     step with resume/load_checkpoint
    st.flush()                                       commit pending write_state() changes
    st.clear_failure(accept_params=False)            after a failed step and restored params
    with st.atomic_writes(): ...                     write_state()s committed at once at the end
    st.save_checkpoint(dir) / st.load_checkpoint(dir) streamed, see offload.swap.checkpoint; the
        same format is written from / read into host tensors by offload.swap.checkpoint
        save_tensors(dir, {"exp_avg": [...], "exp_avg_sq": [...]}, meta) / load_tensors(dir, ...)
        (meta: {"steps": [int per param], "shapes": [[...] per param]}), so offload="cpu" can
        save a checkpoint that offload="nvme" loads, and back
    st.memory_report() -> {"device", "pinned", "pageable", "nvme"} bytes
    st.last_stats                                     timings of the last step
    st.close(keep_swap=False)                         removes the swap directory (also done when st
                                                     is garbage-collected and at exit; not after
                                                     SIGTERM, nor in a forked child: see swap/cleanup.py);
                                                     keep_swap=True keeps it, unlocked, for resume=True
    st.swap_path, st.sub_group_size, st.num_buffers, st.host_bytes

[Note: fingerprint] in ``offload/optim/fingerprint.py``.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from offload.optim.fingerprint import fingerprint, sample_indices
from offload.optim.stats import swap_phases
from offload.optim.step_guard import failure_text, mark_consistent
from offload.swap import SwapPipeline, SwapStepError, SwapStore
from offload.swap.cache import GroupCache
from offload.swap.manifest_check import check_steps
from offload.swap.checkpoint import load_store, save_store
from offload.swap.runs import make_identity, open_store

__all__ = ["SwappedState", "STATE_NAMES"]

STATE_NAMES = ("exp_avg", "exp_avg_sq")
_HYPER_KEYS = {"lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "bias_correction", "maximize",
               "grad_scale"}


def _kernel_kwargs(hyper: Any, step: int) -> Dict[str, Any]:
    if hasattr(hyper, "kernel_kwargs"):
        return hyper.kernel_kwargs(step)
    if not isinstance(hyper, dict):
        raise ValueError(f"hyper must be an AdamHyper or a dict, got {type(hyper).__name__}")
    unknown = set(hyper) - _HYPER_KEYS
    missing = {"lr", "beta1", "beta2", "eps", "weight_decay", "decoupled"} - set(hyper)
    if unknown or missing:
        raise ValueError(f"hyper: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    return dict(hyper, step=step)


def _close_quietly(pipeline: SwapPipeline, store: SwapStore) -> None:
    """Close (also from the garbage collector): buffers first, then files and directory.
    Nothing in a forked child: the buffers' io_uring registration is the parent's too."""
    if getattr(store, "owner_pid", None) not in (None, os.getpid()):
        store.close()  # marks it closed; touches nothing
        return
    try:
        pipeline.close()
    finally:
        store.close()


class SwappedState:
    """See the module docstring for the interface."""

    kind = "nvme"

    def __init__(self, params: Sequence[torch.Tensor], *, swap_dir: str, max_host_bytes: Optional[int] = None,
                 sub_group_size: Optional[int] = None, verify: bool = False, resume: bool = False,
                 io_engine: Any = None, backend: Optional[str] = None, num_threads: Optional[int] = None,
                 run_name: str = "run", rank: Optional[int] = None, pool: Any = None) -> None:
        from offload.kernels import get_backend

        self._kernel = get_backend(backend)
        self._num_threads = num_threads
        self.params: List[torch.Tensor] = list(params)
        if not self.params:
            raise ValueError("SwappedState needs at least one param")
        self._index: Dict[int, int] = {}
        self._offsets: List[int] = []
        total = 0
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"param {i} is a {type(p).__name__}, not a tensor")
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"param {i}: offload='nvme' updates fp32 CPU params in place; got {p.dtype} "
                                 f"on {p.device}")
            if not p.is_contiguous():
                raise ValueError(f"param {i}: offload='nvme' updates fp32 CPU params in place and needs them "
                                 f"contiguous (this one has shape {tuple(p.shape)}, strides {p.stride()}); make "
                                 "it contiguous before building the optimizer (p.data = p.data.contiguous()) or "
                                 "use offload='cpu'")
            if id(p) in self._index:
                raise ValueError(f"param {i} is param {self._index[id(p)]} again (torch warns about duplicate "
                                 "params and updates them twice per step); offload='nvme' with fp32 CPU params "
                                 "needs each param once: remove the duplicate")
            self._index[id(p)] = i
            self._offsets.append(total)
            total += p.numel()
        self.numel = total
        if rank is None:
            rank = torch.distributed.get_rank() if (torch.distributed.is_available()
                                                    and torch.distributed.is_initialized()) else 0
        self._steps = [0] * len(self.params)
        self._broken: Optional[str] = None
        self._opt: Any = None  # weakref to the optimizer when built by for_optimizer()
        self._meta_dirty = False
        self.last_stats: Dict[str, float] = {}
        # Params of 0 elements only (torch accepts them): a one-page store that no param
        # touches still records the step counts, so resume and checkpoints work the same.
        self.store, nbuf = open_store(swap_dir, max(total, 1), STATE_NAMES, identity=self._identity(),
                                      max_host_bytes=max_host_bytes, sub_group_size=sub_group_size,
                                      run_name=run_name, rank=rank, verify=verify, resume=resume, io_engine=io_engine)
        self.layout = self.store.layout  # on resume: the manifest's sub_group_size ([Note: layout on resume])
        self._group_params = self._params_per_group()
        self._samples = self._sample_indices()
        try:
            if self.store.resumed:  # resume="auto" chose; "discard" never resumes ([Note: restarts] in swap/runs)
                self._check_resume()
            else:
                self.store.commit({}, self._extra(self._steps), advance=False)
            self.pipeline = SwapPipeline(self.store, buffers=nbuf, pool=pool)
            self._cache = GroupCache(self.pipeline)
        except BaseException:
            self.store.close(remove=not self.store.resumed)
            raise
        # an optimizer dropped without close() still frees its buffers and swap files
        self._finalizer = weakref.finalize(self, _close_quietly, self.pipeline, self.store)

    @classmethod
    def for_optimizer(cls, opt: Any) -> "SwappedState":
        """The store of ``offload.Adam/AdamW(..., offload="nvme")``: all params of ``opt``
        in param_groups order, options from ``opt.config`` (an OffloadConfig). With
        ``resume=True`` the step counts found in the swap directory go to ``opt.state``."""
        cfg = opt.config
        params = [p for g in opt.param_groups for p in g["params"]]
        st = cls(params, swap_dir=cfg.swap_dir, max_host_bytes=cfg.max_host_bytes,
                 sub_group_size=cfg.sub_group_size, verify=cfg.verify, resume=cfg.resume, io_engine=cfg.io,
                 backend=opt.backend, num_threads=opt.num_threads)
        st._opt = weakref.ref(opt)
        st._sync_opt_steps()
        return st

    def _sync_opt_steps(self) -> None:
        """Mirror our per-param step counts into ``opt.state[p]["step"]`` (torch's layout)."""
        opt = self._opt() if self._opt is not None else None
        if opt is None:
            return
        for p, n in zip(self.params, self._steps):
            if n:
                opt.state[p]["step"] = torch.tensor(float(n), dtype=torch.float32)
            elif "step" in opt.state.get(p, {}):
                del opt.state[p]["step"]

    # ------------------------------------------------------------------ bookkeeping
    @property
    def swap_path(self) -> str:
        return self.store.path

    @property
    def sub_group_size(self) -> int:
        return self.layout.sub_group_size

    @property
    def num_buffers(self) -> int:
        return len(self.pipeline.buffers)

    @property
    def host_bytes(self) -> int:
        return self.pipeline.host_bytes

    def _params_per_group(self) -> List[List[int]]:
        out: List[List[int]] = [[] for _ in range(self.layout.num_groups)]
        for i, p in enumerate(self.params):
            off = self._offsets[i]
            for g in self.layout.groups_overlapping(off, off + p.numel()):
                out[g].append(i)
        return out

    def _sample_indices(self) -> List[torch.Tensor]:
        return sample_indices(self.params, self._offsets, self.layout)

    def fingerprint(self) -> str:
        return fingerprint(self.params, self._samples)

    def _extra(self, steps: List[int]) -> Dict[str, Any]:
        return {"steps": list(steps), "fingerprint": self.fingerprint(),
                "shapes": [list(p.shape) for p in self.params]}

    def add_param_group(self, group: Dict[str, Any]) -> None:
        """Refused: the swap files are laid out for the params given at construction."""
        raise NotImplementedError(
            "add_param_group after construction is not supported with offload='nvme' (the swap files are laid out "
            "for the params given at construction): pass every param group to the constructor (a group can start "
            "with lr=0), or use offload='cpu'")

    def _identity(self) -> Dict[str, str]:
        """The params' identity in the manifest ([Note: identity] in offload/swap/runs.py)."""
        facts = {"kind": "fp32-in-place", "shapes": [list(p.shape) for p in self.params],
                 "dtypes": [str(p.dtype) for p in self.params]}
        return make_identity(facts, f"{len(self.params)} fp32 params, {self.numel} elements")

    def _check_resume(self) -> None:
        extra = self.store.extra
        check_steps(extra, os.path.join(self.store.path, "manifest.json"), len(self.params))
        shapes = [list(p.shape) for p in self.params]
        if extra.get("shapes") != shapes:
            raise ValueError(f"{self.store.path}: the swap directory holds states of other params "
                             f"({len(extra.get('shapes') or [])} params of other shapes)")
        if extra.get("fingerprint") != self.fingerprint():
            raise ValueError(f"{self.store.path}: the params given are not those of step {self.store.step} "
                             f"in the swap directory (fingerprint {self.fingerprint()} != {extra.get('fingerprint')}):"
                             " load the params saved right after it, or start afresh with resume='discard'")
        self._steps = [int(s) for s in extra["steps"]]

    def _param_index(self, p: torch.Tensor) -> int:
        i = self._index.get(id(p))
        if i is None or self.params[i] is not p:
            raise ValueError(f"tensor of shape {tuple(p.shape)} is not one of this optimizer's params")
        return i

    def step_of(self, p: torch.Tensor) -> int:
        return self._steps[self._param_index(p)]

    # ------------------------------------------------------------------ the step
    def step(self, batches: Sequence[Tuple[Any, Sequence[Tuple[torch.Tensor, torch.Tensor, int]]]]) -> Dict[str, float]:
        if self._broken:
            raise RuntimeError(self._broken)
        work: Dict[int, Tuple[torch.Tensor, Dict[str, Any], int]] = {}
        for hyper, items in batches:
            for p, grad, step in items:
                i = self._param_index(p)
                if i in work:
                    raise ValueError(f"param {i} appears twice in one step")
                if grad.numel() != p.numel() or grad.device.type != "cpu":
                    raise ValueError(f"param {i}: grad of {grad.numel()} elements on {grad.device}, "
                                     f"expected {p.numel()} on cpu")
                if int(step) < 1:
                    raise ValueError(f"param {i}: step must be >= 1, got {step}")
                work[i] = (grad.detach().reshape(-1).contiguous(), _kernel_kwargs(hyper, int(step)), int(step))
        if not work:
            return {}
        self.flush()
        self._cache.invalidate()  # the pipeline reuses the cache buffer
        groups = sorted({g for i in work for g in self.layout.groups_overlapping(
            self._offsets[i], self._offsets[i] + self.params[i].numel())})
        kernel, threads = self._kernel, self._num_threads
        params, offsets, group_params = self.params, self._offsets, self._group_params

        done: List[int] = []

        def compute(g: int, s: int, e: int, tensors: List[torch.Tensor]) -> None:
            m_all, v_all = tensors
            done.append(g)  # before the kernel: an exception inside it may have changed params
            for i in group_params[g]:
                w = work.get(i)
                if w is None:
                    continue
                grad, kw, _ = w
                off = offsets[i]
                a, b = max(s, off), min(e, off + params[i].numel())
                kernel.adam_step(params[i].detach().view(-1)[a - off:b - off], grad[a - off:b - off],
                                 m_all[a - s:b - s], v_all[a - s:b - s], num_threads=threads, **kw)

        steps = list(self._steps)
        for i, (_, _, st) in work.items():
            steps[i] = st
        try:
            with torch.no_grad():
                stats = self.pipeline.run(groups, compute, extra=lambda: self._extra(steps))
        except BaseException as exc:
            raise self._failed(exc, sorted({i for g in done for i in group_params[g] if i in work}))
        self._steps = steps
        self.last_stats = stats
        return swap_phases(stats)

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
            self.store.commit({}, self._extra(self._steps), advance=False)
        elif self.store.extra.get("fingerprint") != self.fingerprint():
            raise ValueError(f"the params are not those of step {self.store.step} held in {self.store.path}; "
                             "restore them first (or load_checkpoint(), or clear_failure(accept_params=True))")
        self._broken = None

    # ------------------------------------------------------------------ one param's states
    def read_state(self, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        i = self._param_index(p)
        n, off = p.numel(), self._offsets[i]
        out = (torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32))
        for g in self.layout.groups_overlapping(off, off + n):
            s, e = self.layout.group_range(g)
            a, b = max(s, off), min(e, off + n)
            tensors = self._cache.load(g, self._extra_now)
            for k in range(2):
                out[k][a - off:b - off].copy_(tensors[k][a - s:b - s])
        return out[0].view(p.shape), out[1].view(p.shape)

    def write_state(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    step: Optional[int] = None) -> None:
        i = self._param_index(p)
        n, off = p.numel(), self._offsets[i]
        src = []
        for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if not isinstance(t, torch.Tensor) or t.numel() != n:
                raise ValueError(f"param {i}: {name} must be a tensor of {n} elements, got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
            src.append(t.detach().reshape(-1).to(device="cpu", dtype=torch.float32))
        for g in self.layout.groups_overlapping(off, off + n):
            s, e = self.layout.group_range(g)
            a, b = max(s, off), min(e, off + n)
            tensors = self._cache.load(g, self._extra_now)
            for k in range(2):
                tensors[k][a - s:b - s].copy_(src[k][a - off:b - off])
            self._cache.mark_dirty()
        if step is not None:
            self._steps[i] = int(step)
            self._meta_dirty = True

    def export_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        if self.step_of(p) == 0:
            return {}
        m, v = self.read_state(p)
        return {"exp_avg": m, "exp_avg_sq": v}

    def import_state(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        step = state.get("step")
        opt = self._opt() if self._opt is not None else None
        if step is None and opt is not None:  # the optimizer keeps torch's "step" in opt.state
            step = opt.state.get(p, {}).get("step")
        if isinstance(step, torch.Tensor):
            step = int(step.item())
        self.write_state(p, state["exp_avg"], state["exp_avg_sq"], None if step is None else int(step))

    def _extra_now(self) -> Dict[str, Any]:
        self._meta_dirty = False  # committed with the data
        return self._extra(self._steps)

    def reset_state(self, p: torch.Tensor) -> None:
        """Zero moments and step 0 for ``p`` (loading a state_dict without state for it)."""
        if self.step_of(p) == 0:
            return  # never stepped: its moments are zeros already
        z = torch.zeros(p.numel(), dtype=torch.float32)
        self.write_state(p, z, z, step=0)

    @contextlib.contextmanager
    def atomic_writes(self) -> Iterator[None]:
        """The write_state()s inside go to the free slots and are committed once at the end,
        with the steps: a kill or an error at any point leaves every state as before."""
        self.flush()
        steps = list(self._steps)
        self._cache.begin_batch()
        try:
            yield
            self._cache.commit_batch(self._extra(self._steps))
        except BaseException:
            self._cache.abort_batch()
            self._steps = steps
            raise
        self._meta_dirty = False

    def flush(self) -> None:
        """Write the cached sub-group changed by write_state() into its free slot and commit
        (the manifest flips only that sub-group; the step count does not advance)."""
        if not self._cache.flush(self._extra_now) and self._meta_dirty:
            self.store.commit({}, self._extra(self._steps), advance=False)
            self._meta_dirty = False

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str, extra: Optional[Dict[str, Any]] = None) -> str:
        """Stream the moments (and per-param steps, shapes, ``extra``) to ``directory``; see
        offload.swap.checkpoint. Peak extra host memory: the pipeline buffers."""
        self.flush()
        self._cache.invalidate()
        meta = dict(extra or {}, steps=list(self._steps), shapes=[list(p.shape) for p in self.params],
                    fingerprint=self.fingerprint(), swap_step=self.store.step)
        return save_store(self.store, self.pipeline.buffers, directory, meta)

    def load_checkpoint(self, directory: str) -> None:
        """Replace the moments and steps with those of checkpoint ``directory`` (same param
        shapes; any sub_group_size). The params themselves are the caller's."""
        self.flush()
        self._cache.invalidate()
        meta, written = load_store(self.store, self.pipeline.buffers, directory)
        shapes = [list(p.shape) for p in self.params]
        if meta.get("shapes") != shapes:
            raise ValueError(f"{directory}: checkpoint of params with other shapes")
        steps = [int(s) for s in meta["steps"]]
        self.store.commit(written, self._extra(steps), advance=False)
        self._steps = steps
        self._broken = None
        self._sync_opt_steps()

    # ------------------------------------------------------------------ reporting, closing
    def memory_report(self) -> Dict[str, int]:
        pinned, pageable = self.pipeline.host_bytes_by_kind()
        return {"device": 0, "pinned": pinned, "pageable": pageable, "nvme": self.store.disk_bytes(),
                "io_locked_bytes": self.pipeline.io_locked_bytes}

    def close(self, keep_swap: bool = False) -> None:
        """Release buffers and remove the swap directory (use save_checkpoint() first to keep
        the states). ``keep_swap=True``: keep it, unlocked, at its last committed step (pending
        write_state() changes committed first), for a new store with ``resume=True``."""
        if keep_swap and not self._broken and not self.store.closed:
            self.flush()
        self._cache.dirty = False  # the directory goes with close(), or stays as committed
        self._cache.group = None
        if not keep_swap:
            self._finalizer()
        elif self._finalizer.detach() is not None:
            try:
                self.pipeline.close()
            finally:
                self.store.close(remove=False)

    def __enter__(self) -> "SwappedState":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
