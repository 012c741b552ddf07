"""Which params hold a state beyond their group's rule, written into a checkpoint's meta.

[Note: kept states in checkpoints] torch keeps an Adam param's ``max_exp_avg_sq`` once it
exists, whatever its group's ``amsgrad`` says later: its state_dict carries it, and a group
that turns amsgrad back on goes on from it. A checkpoint holds every state of the store's
fields for every param that stepped (the initial values where a param holds none: the host
store's and the swapped stores' files have one set of fields), so its files cannot tell a
kept ``max_exp_avg_sq`` from such a filler, and the load used to decide by the group's rule:
a group with amsgrad off lost it (the host store restarted it from zeros; the flat and
swapped stores hid it from opt.state and state_dict). The meta now says, under ``holding``:
``{name: [the indices, in param_groups order, of the params that hold it]}``. The key is
optional: a checkpoint written before it has none, and the load decides by the rule as
before. SGD's ``momentum_buffer`` is the same case (torch keeps it when a group's momentum
goes to 0, and goes on from it when momentum comes back): its checkpoints say which params
hold one too. ``offload="nvme"`` records the same map with each swap commit
(``StepContext.commit_meta``), so that ``resume=True`` shows what the run showed.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Sequence, Set

from offload.optim.protocol import optional
from offload.swap.ckpt_groups import saved_meta

__all__ = ["HOLDING", "holding_ids", "holding_in", "holding_meta", "holding_of", "record_now", "saved_holding",
           "without_cleared"]

HOLDING = "holding"


def holding_meta(name: str, indices: Iterable[int]) -> Dict[str, Any]:
    """The meta entry saying that the params at ``indices`` hold state ``name``."""
    return {HOLDING: {name: sorted(int(i) for i in indices)}}


def holding_of(name: str, params: Sequence[Any], kept: Set[int]) -> Dict[str, Any]:
    """``holding_meta`` of the ``params`` (in param_groups order) whose id is in ``kept``."""
    return holding_meta(name, (i for i, p in enumerate(params) if id(p) in kept))


def record_now(store: Any) -> None:
    """A swapped store commits the optimizer's changed commit_meta now: after a load, whose
    own commit recorded the one before it, so that a resume before the next step sees it."""
    commit = optional(store, "commit_writes")
    if commit is not None:
        commit()


def without_cleared(opt: Any, held: Set[int], work: Any) -> Set[int]:
    """``held`` (ids of the params holding a state beyond their group's rule: Adam's
    ``_ams_kept``, SGD's ``_buf_started``) less the params stepping in ``work`` whose state
    the user cleared since their last step (``opt.state[p].clear()``): their step starts them
    afresh, as torch's (step_guard's restart_cleared), holding only what their group's rule
    makes. ``held`` itself when none was (the host store's states went with the entry)."""
    if not held or getattr(opt._store, "kind", None) == "host":
        return held
    cleared = opt._ctx.steps.cleared(item[0] for _, items in work for item in items)
    return held - {id(p) for p in cleared} if cleared else held


def holding_ids(meta: Any, name: str, params: Sequence[Any], path: str) -> Optional[Set[int]]:
    """id(p) of the ``params`` that ``meta`` (a resumed swap commit's: StepContext.commit_meta)
    says hold ``name``; None when it does not say (swap files written before it did)."""
    held = holding_in(meta, name, len(params), path)
    return None if held is None else {id(params[i]) for i in held}


def saved_holding(directory: str, name: str, nparams: int) -> Optional[Set[int]]:
    """The indices of the params that hold ``name`` in checkpoint ``directory``, or None when
    its meta does not say (a checkpoint written before ``holding``, or of other params: the
    load refuses those, saying why). Checked before anything is loaded: ValueError."""
    meta, path = saved_meta(directory)
    return holding_in(meta, name, nparams, path)


def holding_in(meta: Any, name: str, nparams: int, path: str) -> Optional[Set[int]]:
    """``saved_holding`` of a meta dict already read (``path`` names it in the error); also
    what a resumed swap commit recorded (StepContext.commit_meta)."""
    holding = meta.get(HOLDING) if isinstance(meta, dict) else None
    if holding is None:
        return None
    listed: Any = holding.get(name, []) if isinstance(holding, dict) else None
    if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
        raise ValueError(f"{path}: meta.{HOLDING} is not a map of state name to a list of param indices")
    if any(not 0 <= i < nparams for i in listed):
        return None  # a checkpoint of more params: the store's load refuses it, naming both
    return set(listed)
