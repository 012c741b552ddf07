"""The swap steps running on a store, so that closing it waits for them.

[Note: a close meets a step] ``close()`` closes the slot files' descriptors. A step running in
another thread at that moment (a daemon training thread when the interpreter exits and the
atexit cleanup closes every store; a user's ``close()`` from a monitoring thread) then
submitted reads and writes on descriptors already closed: it died with an ``IndexError`` or
EBADF, and a descriptor number that another file (a user's atexit checkpoint) had reused in
between could have taken its writes. So the pipeline's step runs inside :meth:`StepsInFlight.held`
and ``close()``, once the store is marked closed (no step starts after it), waits for the
steps of other threads to end before it closes anything. A step in the closing thread itself
(a signal handler that closes) is not waited for: it cannot end while its thread waits.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Dict, Iterator

__all__ = ["StepsInFlight", "CLOSE_WAIT_S"]

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 120.0
"""How long a close waits for another thread's step (a swap step of a large model takes
seconds; one stuck in a collective would otherwise hold the process's exit forever)."""


class StepsInFlight:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._threads: Dict[int, int] = {}  # thread ident -> steps it runs (nested: 1 at most in practice)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            self._threads[me] = self._threads.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                left = self._threads.pop(me) - 1
                if left:
                    self._threads[me] = left
                self._cond.notify_all()

    def wait_others(self, what: str, timeout: float = CLOSE_WAIT_S) -> bool:
        """Wait until no thread but this one runs a step; False (logged) after ``timeout``."""
        me = threading.get_ident()
        with self._cond:
            if self._cond.wait_for(lambda: not any(t != me for t in self._threads), timeout):
                return True
        log.warning("%s: a swap step still runs in another thread after %.0f s; closing under it", what, timeout)
        return False
