"""SIGTERM as an exception, for commands that must clean up what they made when stopped.

By default SIGTERM ends the process at once: no ``finally`` runs. ``offload bench-io`` then
left its test file (as large as ``--size``) behind. Inside :func:`sigterm_raises` the signal
raises :class:`Terminated` in the main thread instead, the command's ``finally`` blocks remove
what it made, and ``offload`` exits 143 (128 + 15, what a shell reports for SIGTERM).

Only for commands that own nothing meant to outlive a SIGTERM: the swap directory of an
optimizer is kept on purpose ([Note: SIGTERM keeps the swap files] in offload/swap/cleanup.py).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["Terminated", "sigterm_raises"]


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, as KeyboardInterrupt, so ``except Exception`` in the
    code it interrupts does not swallow it."""


def _raise_terminated(signum, frame) -> None:
    # A second SIGTERM while the first unwinds would interrupt the cleanup it waits for:
    # ignore it (SIGKILL still ends the process).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` within the block; the handler before is restored
    after. Left alone: outside the main thread (Python delivers signals only there), where
    SIGTERM is ignored (``nohup``-like launchers mean that), or where a C handler was set
    (it could not be put back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    if before is None or before == signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
