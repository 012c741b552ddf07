"""SIGINT and SIGTERM held while llvmlite may call back into Python, raised again after.

[Note: signals in llvmlite's callbacks] numba compiles a kernel on its first call with a new
kind of argument (and loads it from its disk cache on the first call of a process), and
llvmlite calls back into Python from C while it does (ctypes callbacks: the object cache's
``_raw_object_cache_notify`` and ``_raw_object_cache_getbuffer``). Python runs a signal's
handler in the main thread between any two bytecodes, so also inside such a callback; an
exception the handler raises there cannot leave the callback: ctypes prints "Exception
ignored on calling ctypes callback function" and drops it. A SIGTERM sent to ``offload
demo`` on the numba backend while it compiled was lost that way, and the demo trained on to
its end and exited 0 (tests/test_cli_adversarial.py); a Ctrl-C there was lost alike.

Every callback runs under llvmlite's lock, which numba reports as the "numba:llvm_lock"
event. While the main thread holds that lock, the Python handlers of SIGINT and SIGTERM are
replaced by one that only notes the signal (``install``'s listener); when it lets go they
are put back. The noted signals are raised again where an exception propagates: when the
numba backend's kernel call returns (``signals_held`` around it, which costs a counter in
steady state: no compile, no lock, no handler swapped), or, for a compile outside those
calls (another library's kernel), when that compile ends. A handler that is not a Python
function (SIG_DFL, SIG_IGN) is left alone: the default action ends the process without any
Python. Main thread only: handlers run there.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any, List, Tuple

try:  # signal's functions without the enum wrappers
    import _signal as _raw_signal
except ImportError:  # pragma: no cover - not CPython
    _raw_signal = signal  # type: ignore[assignment]

__all__ = ["signals_held", "install"]

_HELD = (signal.SIGINT, signal.SIGTERM)
_pending: List[int] = []
_saved: List[Tuple[int, Any]] = []
_state = {"lock_depth": 0, "calls": 0}


def _after_fork_in_child() -> None:
    """A child forked by another thread while the main one held llvmlite's lock: its main
    thread holds no lock, so its handlers go back and the count starts over."""
    while _saved:
        sig, h = _saved.pop()
        _raw_signal.signal(sig, h)
    _state["lock_depth"] = _state["calls"] = 0
    del _pending[:]  # the parent's, not for the child


os.register_at_fork(after_in_child=_after_fork_in_child)


def _main() -> bool:
    return threading.get_ident() == threading.main_thread().ident


def _note(signum: int, frame: Any) -> None:
    _pending.append(signum)


def hold() -> None:
    """Note, not run, the Python handlers' signals (the start of llvmlite's lock)."""
    if not _main():
        return
    _state["lock_depth"] += 1
    if _state["lock_depth"] > 1:
        return
    for sig in _HELD:
        h = _raw_signal.getsignal(sig)
        if callable(h) and h is not _note:
            _saved.append((sig, h))
            _raw_signal.signal(sig, _note)


def release() -> None:
    """Put the handlers back (the end of llvmlite's lock); the noted signals stay noted."""
    if not _main() or _state["lock_depth"] == 0:
        return
    _state["lock_depth"] -= 1
    if _state["lock_depth"]:
        return
    while _saved:
        sig, h = _saved.pop()
        _raw_signal.signal(sig, h)


def deliver() -> None:
    """Raise the noted signals again, each to the handler now set. Raised while blocked and
    then unblocked at once: every one is pending before the first handler runs (one that
    raises does not drop the others)."""
    if not _pending or _state["lock_depth"] or not _main():
        return
    sigs = sorted(set(_pending))
    del _pending[:]
    old = _raw_signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        for sig in sigs:
            _raw_signal.raise_signal(sig)
    finally:
        _raw_signal.pthread_sigmask(signal.SIG_SETMASK, old)


class signals_held:  # noqa: N801 (a context manager, used as a function)
    """``with signals_held(): kernel(...)``: signals noted during the call (its compile)
    are raised when it returns (see the note)."""

    __slots__ = ("_counted",)

    def __enter__(self) -> "signals_held":
        self._counted = _main()
        if self._counted:
            _state["calls"] += 1
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._counted:
            _state["calls"] -= 1
            if _pending and not _state["calls"]:
                deliver()
        return False


def install() -> None:
    """Listen to numba's events (once per process): the lock holds, a compile's end
    delivers when no kernel call of ours will."""
    if _state.get("installed"):
        return
    from numba.core import event

    class _LockListener(event.Listener):
        def on_start(self, ev: Any) -> None:
            hold()

        def on_end(self, ev: Any) -> None:
            release()

    class _CompileListener(event.Listener):
        def on_start(self, ev: Any) -> None:
            pass

        def on_end(self, ev: Any) -> None:
            if not _state["calls"]:
                deliver()

    event.register("numba:llvm_lock", _LockListener())
    event.register("numba:compile", _CompileListener())
    _state["installed"] = True
