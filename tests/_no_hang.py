"""A guard for calls that used to block forever (a FIFO where a file was): the call fails the
test after a few seconds instead of hanging the suite."""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class Hung(Exception):
    """Not an OSError: code that catches OSError must not swallow it."""


@contextlib.contextmanager
def within(seconds: int = 5) -> Iterator[None]:
    def _raise(*_: object) -> None:
        raise Hung(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    except Hung as exc:
        # a fresh traceback: the one raised in a busy loop can hold a frame without a line
        # number, which pytest's report fails on (INTERNALERROR instead of a failed test)
        raise Hung(str(exc)) from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
