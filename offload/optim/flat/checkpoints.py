"""The flat store's checkpoints: per-rank shards + meta ([Note: flat checkpoints] in
offload/zero/checkpoint.py), streamed from / into the swap files with offload="nvme",
and the per-param step counts they carry."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from offload.optim.context import StepCounts
from offload.optim.flat.swapped import swap_fields
from offload.zero import comm
from offload.zero.checkpoint import check_shards, fill_store_from_shards, load_shards, save_shards, save_shards_from_store

if TYPE_CHECKING:
    from offload.optim.flat.store import FlatState

__all__ = ["ckpt_steps", "set_steps", "save_checkpoint", "load_checkpoint"]


def _counts(st: "FlatState") -> StepCounts:
    """The step counts, through the store's StepContext when it has one (the optimizer's
    ``opt.state[p]["step"]`` either way: StepCounts keeps them there)."""
    ctx = getattr(st, "ctx", None)
    if ctx is not None:
        return ctx.steps
    opt = st._opt  # a weak reference, until the store is given a StepContext
    return StepCounts(lambda: opt().state)


def ckpt_steps(st: "FlatState") -> List[int]:
    counts = _counts(st)
    return [counts.get(p) for p in st._order]


def set_steps(st: "FlatState", steps: List[int]) -> None:
    if len(steps) != len(st._order):
        raise ValueError(f"{len(steps)} step counts for {len(st._order)} params")
    counts = _counts(st)
    for p, step in zip(st._order, steps):
        counts.set(p, 0)  # a new tensor, not the old one filled: that may be shared with a state_dict
        counts.set(p, int(step))


def save_checkpoint(st: "FlatState", directory: str, extra: Optional[Dict[str, Any]] = None) -> None:
    """Per-rank shards + meta; with offload="nvme" streamed from the swap files; all ranks
    or none ([Note: shards saved all or none])."""
    meta = dict(extra or {}, steps=ckpt_steps(st))
    if st._swap is not None:
        swap, layouts = st._swap, [fg.layout for fg in st._groups]  # flushed in the voted half
        save_shards_from_store(directory, swap.store, swap.pipeline.buffers, layouts=layouts, meta=meta,
                               process_group=st.group, before=lambda: swap.save(lambda s, b: None))
        return
    save_shards(directory, st._groups, world=st.world, rank=st.rank, meta=meta, process_group=st.group)


def load_checkpoint(st: "FlatState", directory: str) -> None:
    """See ``FlatState.load_checkpoint``."""
    st._drain()
    steps_before = ckpt_steps(st)
    layouts = [fg.layout for fg in st._groups]

    def loaded_steps(meta: Dict[str, Any]) -> None:
        set_steps(st, meta.get("steps") or [0] * len(st._order))

    if st._swap is not None:
        try:
            fields = swap_fields(st)
            st._swap.load_checkpoint(lambda store, bufs: fill_store_from_shards(directory, layouts, store, bufs,
                                                                                fields),
                                     loaded_steps, vote=st._swap_vote)
        except BaseException:
            # The steps the swap files hold: the old ones, unless undoing a commit failed
            # (then the checkpoint's; the error says to load again).
            held = st._swap.store.extra.get("steps")
            set_steps(st, held if held is not None else steps_before)
            raise
        st._params_from_swap()
        return
    what = f"load_checkpoint({directory!r})"
    if st._nvme:  # offload="nvme", no element on this rank: only the steps, voted as the others
        def undo() -> str:
            set_steps(st, steps_before)
            return "nothing was loaded on any rank"

        comm.all_or_none(lambda: check_shards(directory, layouts, fields=swap_fields(st)), loaded_steps, undo, what, st._swap_vote)
        return
    _load_host(st, directory, layouts, what, loaded_steps)


def _load_host(st: "FlatState", directory: str, layouts, what: str, loaded_steps) -> None:
    """Host buffers: every file checked on every rank first, then read into the buffers."""
    comm.on_every_rank(lambda: check_shards(directory, layouts, fields=swap_fields(st)), what + " (nothing was loaded on any rank)",
                       st.group, st.world)
    half = "the optimizer state is incomplete until it is loaded again"

    def load() -> None:
        try:
            meta = load_shards(directory, st._groups)
        except Exception as exc:  # after the check passed: a read error, or files changed since
            raise _with_hint(exc, half) from exc
        loaded_steps(meta)

    comm.on_every_rank(load, f"{what} ({half})", st.group, st.world)
    for fg in st._groups:
        fg.write_params(st.group)


def _with_hint(exc: Exception, hint: str) -> Exception:
    """``exc`` again, of its own type where that is simple, with ``hint`` added to its text."""
    if isinstance(exc, OSError):
        return type(exc)(exc.errno, f"{exc.strerror or exc}; {hint}", exc.filename)
    if type(exc) in (ValueError, RuntimeError, KeyError, TypeError):
        return type(exc)(f"{exc}; {hint}")
    return RuntimeError(f"{type(exc).__name__}: {exc}; {hint}")
