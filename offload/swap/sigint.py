"""A Ctrl-C (and, for removals, a SIGTERM) held until a block is over: the optimizer's step
(step_guard.py [Note: failed steps]), the removal of a directory of ours ([Note: a removal is
whole] below) and each call of the NVMe param pager (offload/shard/tier.py), whose bookkeeping of a
page and the page itself change in two statements that a KeyboardInterrupt must not separate.

Python raises KeyboardInterrupt in the main thread between any two bytecodes. In the pager,
one landing after ``madvise(MADV_DONTNEED)`` and before the page was marked on disk left a
page of zeros marked valid: the params read as zeros from then on, and training went on
with them, silently; one landing after a read and before its pages were marked valid left
the params' bytes in pages marked on disk, which the next call took for a write past the
pager and refused with an error that blamed the user ([Note: writes past the pager]).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator, List

try:  # signal's own functions without its enum wrappers: 0.2 us a call instead of 2-3 (a
    import _signal as _raw_signal  # step holds Ctrl-C twice; 20 us of a 96 us small step)
except ImportError:  # pragma: no cover - not CPython
    _raw_signal = signal  # type: ignore[assignment]

__all__ = ["sigint_held", "sigterm_held", "removal_held"]


@contextlib.contextmanager
def sigint_held(second_raises: bool = True) -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT with Python's default handler, main thread only) until the
    block ends, then raise KeyboardInterrupt; with ``second_raises``, a second Ctrl-C raises
    at once. Also when the block raises an Exception (a failed step, a removal's EIO): the
    KeyboardInterrupt replaces it, chained (its ``__context__``), where it used to be dropped,
    and a loop that caught the block's error (a retry) went on as if no Ctrl-C came. Not over
    a BaseException (SystemExit from a SIGTERM handler, the second Ctrl-C's own
    KeyboardInterrupt): the process is stopping already. Left alone: another thread (Python
    runs handlers in the main one only, so none lands there), or a handler that is not
    Python's default (the program's own, or an outer block's hold: nested blocks are held by
    the outermost)."""
    if (threading.current_thread() is not threading.main_thread()
            or _raw_signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending: List[Any] = []

    def hold(signum: int, frame: Any) -> None:
        if pending and second_raises:
            raise KeyboardInterrupt
        pending.append(signum)

    hold.offload_sigint_hold = True  # type: ignore[attr-defined]  (see _after_fork_in_child)
    _raw_signal.signal(signal.SIGINT, hold)
    try:
        yield
    except Exception:
        _raw_signal.signal(signal.SIGINT, signal.default_int_handler)
        if pending:
            raise KeyboardInterrupt  # (raised while handling it: the block's exception is its context)
        raise
    finally:
        _raw_signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """Hold a SIGTERM until the block ends, then deliver it to the handler that was there
    (its default action ends the process; a Python one, a framework's ``sys.exit`` or the
    CLI's ``Terminated``, raises); a second SIGTERM is delivered at once. Also when the block
    raises: a removal that fails (EIO, a replaced directory) must not lose the SIGTERM, or
    the process outlived it (a handler's exception then replaces the block's, chained). Left
    alone: another thread, SIG_IGN, a C handler, or an outer block's hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = _raw_signal.getsignal(signal.SIGTERM)
    if before is None or before == signal.SIG_IGN or getattr(before, "offload_sigterm_hold", None) is not None:
        yield
        return
    pending: List[Any] = []

    def hold(signum: int, frame: Any) -> None:
        pending.append(signum)
        if len(pending) > 1:  # (a handler, not the block: deliver it now)
            _raw_signal.signal(signal.SIGTERM, before)
            signal.raise_signal(signal.SIGTERM)

    hold.offload_sigterm_hold = before  # type: ignore[attr-defined]  (see _after_fork_in_child)
    _raw_signal.signal(signal.SIGTERM, hold)
    try:
        yield
    finally:
        if _raw_signal.getsignal(signal.SIGTERM) is hold:
            _raw_signal.signal(signal.SIGTERM, before)
        if len(pending) == 1:
            signal.raise_signal(signal.SIGTERM)  # runs a Python handler before it returns


@contextlib.contextmanager
def removal_held() -> Iterator[None]:
    """[Note: a removal is whole] A directory of ours being removed file by file must end
    whole or gone: a Ctrl-C or a SIGTERM between two unlinks left one missing its manifest or
    a slot file, neither resumable nor removed (``offload clean`` Ctrl-C'd or terminated, a
    framework's SIGTERM handler that exits during ``close()``, the param tier's clean-up).
    Both are held until the block ends, then delivered."""
    with sigint_held(), sigterm_held():
        yield


def _after_fork_in_child() -> None:
    """A child forked (by another thread) while the main thread held a Ctrl-C inherits the
    hold's handler, but not the block that would restore Python's: its first Ctrl-C would be
    swallowed, and its own steps would not hold one. The child starts with Python's (and with
    the SIGTERM handler a removal's hold replaced)."""
    try:
        if getattr(_raw_signal.getsignal(signal.SIGINT), "offload_sigint_hold", False):
            _raw_signal.signal(signal.SIGINT, signal.default_int_handler)
        before = getattr(_raw_signal.getsignal(signal.SIGTERM), "offload_sigterm_hold", None)
        if before is not None:  # (the hold of sigterm_held: the handler it replaced)
            _raw_signal.signal(signal.SIGTERM, before)
    except (ValueError, OSError):  # pragma: no cover - not the main thread of the main interpreter
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
