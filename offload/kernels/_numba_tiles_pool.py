"""Python threads that run numba_compressed's serial kernel over runs of a call's tiles.

Why not a ``prange`` kernel: the compressed kernel is generic (one specialisation per kind
of param, state, grad and rule), and each specialisation of a ``parallel=True`` wrapper
around the serial kernel cost another 1.6-2 s of compile beside the serial one's 1.2-1.5 s,
for no arithmetic of its own. The serial kernel is ``nogil``, so plain threads run it in
parallel just as well, and the tiles are independent (each tile's bits depend on its own
elements and their indices only), so the bits do not depend on how the runs are cut.

The calling thread works too: ``threads`` - 1 pool threads join it, each taking the next
run from a shared counter (even ends when the threads' shares are uneven). The pool is
started on first use and again in a forked child (a fork keeps no other thread, and the
child's copy of the pool's lock may have been taken by one of them: it gets a new one).

[Note: an interrupt during a parallel call] A Ctrl-C (or a signal handler's exception) that
arrives while the caller waits for the pool threads is held until every run has finished,
then raised: a kernel call is never left half-done by the caller while threads still write
its arrays, as with a native call, whose interrupt Python raises after it returns.
"""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Optional

__all__ = ["run_tiles"]

_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = -1
_pool_size = 0
_pool_lock = threading.Lock()


def _forget_parent_pool() -> None:
    global _pool, _pool_pid, _pool_size, _pool_lock
    _pool, _pool_pid, _pool_size, _pool_lock = None, -1, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_pool)


def _executor(workers: int) -> ThreadPoolExecutor:
    """The pool, with at least ``workers`` threads, in this process."""
    global _pool, _pool_pid, _pool_size
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid() or _pool_size < workers:
            old = _pool if _pool_pid == os.getpid() else None
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="offload-numba")
            _pool_pid, _pool_size = os.getpid(), workers
            if old is not None:
                old.shutdown(wait=False)  # its threads finish what they hold, then exit
        return _pool


def _take_runs(kernel: Callable, runs, counter, nb: int, args: tuple) -> None:
    while True:
        c = next(counter)  # atomic under the GIL: each run is taken once
        if c >= runs:
            return
        kernel(c * nb // runs, (c + 1) * nb // runs, *args)


def run_tiles(kernel: Callable, nb: int, threads: int, args: tuple) -> None:
    """``kernel(lo, hi, *args)`` over tiles 0 .. ``nb`` - 1 on ``threads`` threads, the
    calling thread one of them; a few runs per thread."""
    if threads <= 1 or nb <= 1:
        kernel(0, nb, *args)
        return
    runs = min(nb, 4 * threads)
    counter = itertools.count()
    pool = _executor(threads - 1)
    helpers = [pool.submit(_take_runs, kernel, runs, counter, nb, args)
               for _ in range(min(threads, runs) - 1)]
    held: Optional[BaseException] = None
    try:
        _take_runs(kernel, runs, counter, nb, args)
    except BaseException as e:  # the helpers still write the arrays: wait first
        held = e
    while True:
        try:
            wait(helpers)
            break
        except BaseException as e:  # [Note: an interrupt during a parallel call]
            held = held or e
    for f in helpers:
        f.result()  # a helper's own error, if any
    if held is not None:
        raise held
