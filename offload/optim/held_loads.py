"""Loads that a Ctrl-C does not cut in half: ``load_checkpoint`` and ``load_state_dict``.

[Note: loads hold Ctrl-C] A step holds a Ctrl-C until it is whole (step_guard.defer_sigint);
the loads did not. With ``offload="nvme"`` and bf16 params a checkpoint's states are committed
to the swap files first and the params rewritten from the loaded masters after: a Ctrl-C
between the two left the later params at their pre-load values beside the loaded states, the
optimizer not failed, and training went on from them (a failing-environment sweep hit it in 1
of 6 random Ctrl-Cs). So a load holds the Ctrl-C as a step does, and raises it once whole. A
second Ctrl-C still interrupts at once (the way out of a hung disk); the optimizer is then in
the failed state (step_guard [Note: failed steps]) until a load ends.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from offload.optim.protocol import optional
from offload.optim.state_view import attach as attach_state_views
from offload.optim.state_versions import bump
from offload.optim.step_guard import defer_sigint

__all__ = ["held_load", "load_checkpoint_into"]


def held_load(opt: Any, call: str, load: Callable[[], None]) -> None:
    """``load()`` with a Ctrl-C held until it returns (see the note); ``call`` names it."""
    cut = False  # a KeyboardInterrupt out of load() itself: the second Ctrl-C cut it short
    bump(opt._store)  # copies read before are stale, loaded or not ([Note: state versions])
    try:
        with defer_sigint():
            try:
                load()
            except KeyboardInterrupt:
                cut = True
                raise
    except KeyboardInterrupt:
        # (the held first Ctrl-C is raised after load() returned, or over the error it
        # raised, which says for itself what it loaded: an all-or-nothing load changed nothing)
        if cut:
            opt._failure = (f"{call} was interrupted by a second Ctrl-C: the states, the param_groups and the "
                            "params may be partly loaded; load again (load_checkpoint() or load_state_dict())")
        raise


def load_checkpoint_into(opt: Any, directory: str) -> None:
    """``opt.load_checkpoint(directory)``: see its docstring."""
    from offload.swap.ckpt_groups import apply_groups, checkpoint_groups
    from offload.zero.checkpoint import reading_shards

    opt._check_open()
    load = optional(opt._store, "load_checkpoint")
    if load is None:
        raise NotImplementedError(
            f"load_checkpoint is not available for this store ({type(opt._store).__name__}); use "
            "opt.load_state_dict(torch.load(...))")
    shards = getattr(opt._store, "kind", "") == "flat"
    groups = checkpoint_groups(directory, opt.param_groups, shards=shards, check=getattr(opt, "check_group", None))

    def whole() -> None:
        # per-rank shards: every rank directory's lock for the whole load (check, then copy)
        with (reading_shards(directory) if shards else contextlib.nullcontext()):
            load(directory)
        if groups is not None:
            apply_groups(opt.param_groups, groups)
        opt._failure = None  # every state was replaced (step_guard [Note: failed steps])
        attach_state_views(opt)
    held_load(opt, f"load_checkpoint({directory!r})", whole)
