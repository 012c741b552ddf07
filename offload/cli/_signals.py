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
from collections.abc import Iterator  # (not typing: ~5 ms before main() holds signals)

__all__ = ["CommandSignals", "Terminated", "exit_at_once", "sigterm_raises"]


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


class CommandSignals:
    """[Note: signals while the command starts] From the start of ``main`` until
    :meth:`ready`, SIGINT and SIGTERM are only recorded: the command is importing torch
    (~1.5 s) and owns nothing yet. A KeyboardInterrupt raised there lands inside a third-party
    import: a traceback, a C++ abort (-6) from torch's init, or nothing at all when it lands in
    the NumPy import that torch's C++ init makes, which catches the failure, warns and goes
    on without NumPy (the command then ran to the end: about one early Ctrl-C in eight). A
    second signal while held stops the wait at once (an import that hangs): the ``offload``
    command (``own_process``) exits with its one line; ``offload.cli.main([...])`` called in a
    process of its own (a notebook) hands it to the handler before, now (Python's raises
    KeyboardInterrupt in the import), and exits only where that is the signal's default action:
    ending the caller's interpreter was not ours to do.

    :meth:`ready` installs the handlers of the command proper (SIGINT: the one before,
    Python's KeyboardInterrupt; SIGTERM: :class:`Terminated`, as :func:`sigterm_raises`) and
    only then delivers what was recorded to them, so a signal in between is never lost. The
    handlers before are restored on exit. A signal ignored (``nohup``), a C handler, or another
    thread than the main one: left alone.

    Delivered, not raised: ``offload.cli.main([...])`` called in a process with a SIGINT
    handler of its own (a notebook, a training loop that stops at the end of its step) got a
    KeyboardInterrupt and exit status 130 for a Ctrl-C held here, and that handler never ran,
    where the same Ctrl-C a moment later went to it."""

    def __init__(self, own_process: bool = False) -> None:
        self.caught: list = []
        self._before: dict = {}
        self._own_process = own_process

    def __enter__(self) -> "CommandSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                before = signal.getsignal(signum)
                if before is not None and before != signal.SIG_IGN:
                    self._before[signum] = before
                    signal.signal(signum, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        if not self.caught:
            self.caught.append(signum)
            return
        before = self._before[signum]
        if self._own_process or not callable(before):
            exit_at_once(signum)
        # in-process: the handlers before, back now; the one held first goes to its own (a
        # SIGTERM then a Ctrl-C: the SIGTERM's default action still ends the process), then this
        for held, handler in self._before.items():
            signal.signal(held, handler)
        if self.caught[0] != signum:
            signal.raise_signal(self.caught[0])
        before(signum, frame)

    def ready(self) -> None:
        if signal.SIGINT in self._before:
            signal.signal(signal.SIGINT, self._before[signal.SIGINT])
        if signal.SIGTERM in self._before:
            signal.signal(signal.SIGTERM, _raise_terminated)
        if self.caught:
            # raise_signal runs the handler now (it checks for signals before it returns):
            # Python's raises KeyboardInterrupt, ours Terminated, one of the caller's its own
            signal.raise_signal(self.caught[0])

    def __exit__(self, *exc) -> None:
        for signum, before in self._before.items():
            signal.signal(signum, before)


def exit_at_once(signum: int) -> None:
    """End the process now, as a signal's default action would, with the command's one line."""
    import os
    import sys

    word = "interrupted" if signum == signal.SIGINT else "terminated"
    try:
        sys.stderr.write(f"offload: {word}\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)
