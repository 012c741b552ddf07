"""A lock that a finalizer on the holding thread does not deadlock on.

[Note: finalizers re-enter] An owner's finalizer (``BufferPool.__del__``, a ``weakref.finalize``
of the param tier, a swap store's close) gives back what it registered. The garbage collector
may run it in the middle of any allocation, also one made while this thread holds the lock of
the registry it gives back to (a dict insert, a list insert, a sum over a dict): a plain lock
then deadlocks the thread on itself (seen in CI: a test stuck in ``Accounting.add`` -> gc ->
``BufferPool.__del__`` -> ``clear_owner``), and a re-entrant one would change the registry in
the middle of the holder's own update. So a call that the thread holding the lock makes again
is queued (``defer``) and run when the holder is done, still under the lock.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Tuple

__all__ = ["FinalizerSafeLock"]


class FinalizerSafeLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: Optional[int] = None
        self._deferred: List[Tuple[Callable[..., Any], Tuple[Any, ...]]] = []

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                err = None
                while self._deferred:  # a deferred call may queue more (its own allocations collect too)
                    fn, args = self._deferred.pop(0)
                    try:
                        fn(*args)
                    except Exception as exc:  # the others still run; the first error is raised
                        err = err or exc
                self._holder = None
                if err is not None:
                    raise err

    def defer(self, fn: Callable[..., Any], *args: Any) -> bool:
        """When this thread holds the lock already, queue ``fn(*args)`` for when it lets go
        and return True; else False (the caller takes the lock itself). ``fn`` is the work
        itself, which must not take this lock (it runs under it)."""
        if self._holder == threading.get_ident():
            self._deferred.append((fn, args))
            return True
        return False
