"""``RuleOptimizer.close``, with the params cleared since their last step settled first.

[Note: cleared before a kept close] ``close(keep_swap=True)`` commits the ``opt.state``
writes made since the last step (SwappedState.close flushes them), but not a clear():
``opt.state[p].clear()`` is seen at the next step (state_io's [Note: cleared before a save]),
so the kept swap files held the cleared param's last commit, count, moments and ``holding``,
and ``resume=True`` showed its entry again and went on from it (history fuzz seed 131: SGD,
a frozen param cleared, then closed and resumed). The cleared params are restarted first,
as ``save_checkpoint`` does, and the store's close commits them with the writes.
"""
from __future__ import annotations

from typing import Any

from offload.optim.state_view import detach as detach_state_views

__all__ = ["close_optimizer"]


def close_optimizer(opt: Any, keep_swap: bool) -> None:
    """``RuleOptimizer.close``: its refusals, then the store closed (see the note)."""
    if keep_swap and opt.config.offload != "nvme":
        raise ValueError(f"close(keep_swap=True) needs offload='nvme' (offload={opt.config.offload!r} keeps no swap files)")
    if keep_swap and opt._closed is True:  # (it was silently a no-op: the caller thought the files kept)
        raise RuntimeError("close(keep_swap=True) after close(): the first close removed the swap files")
    if opt._store is not None and not opt._closed:
        if keep_swap and not getattr(opt._store, "_broken", None):
            from offload.optim.state_io import restart_all_cleared

            restart_all_cleared(opt)  # (committed by the store's close, with the writes)
        detach_state_views(opt)  # before the buffers they view are freed
        opt._store.close(keep_swap=keep_swap) if keep_swap else opt._store.close()
    opt._closed = opt._closed or ("kept" if keep_swap else True)
