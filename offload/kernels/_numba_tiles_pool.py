"""Python threads that run numba_compressed's serial kernel over runs of a call's tiles.

Why not a ``prange`` kernel: the compressed kernel is generic (one specialisation per kind
of param, state, grad and rule), and each specialisation of a ``parallel=True`` wrapper
around the serial kernel cost another 1.6-2 s of compile beside the serial one's 1.2-1.5 s,
for no arithmetic of its own. The serial kernel is ``nogil``, so plain threads run it in
parallel just as well, and the tiles are independent (each tile's bits depend on its own
elements and their indices only), so the bits do not depend on how the runs are cut.

``threads`` pool threads each take the next run from a shared counter (even ends when the
threads' shares are uneven) while the calling thread waits: a signal's exception (Ctrl-C)
is raised in the calling thread only, between any two bytecodes, so a caller taking runs too
could drop the run it had just taken. The pool is started on first use and again in a
forked child (a fork keeps no other thread, and the child's copy of the pool's lock may
have been taken by one of them: it gets a new one).

[Note: an interrupt during a parallel call] A Ctrl-C (or a signal handler's exception) that
arrives while the caller waits for the pool threads is held until every run has finished,
then raised: a kernel call is never left half-done by the caller while threads still write
its arrays, as with a native call, whose interrupt Python raises after it returns. One that
lands while the takers are being submitted is held too, as those submitted take every run;
left is the instant between a submit and the note of its future (a taker then unwaited
for). The optimizers hold a first Ctrl-C for the whole step anyway (step_guard.py); this is
for the second one, which fails the step, and for a signal handler's own exception.
"""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, List, Optional

__all__ = ["run_tiles"]

_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0
_pool_lock = threading.Lock()


def _forget_parent_pool() -> None:
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_pool)


def _executor(workers: int) -> ThreadPoolExecutor:
    """The pool, with at least ``workers`` threads, in this process."""
    global _pool, _pool_size
    with _pool_lock:  # a forked child starts with none (_forget_parent_pool)
        if _pool is None or _pool_size < workers:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="offload-numba")
            _pool_size = workers
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
    """``kernel(lo, hi, *args)`` over tiles 0 .. ``nb`` - 1 on ``threads`` threads, a few
    runs per thread; on one thread (or one tile) in the calling thread."""
    if threads <= 1 or nb <= 1:
        kernel(0, nb, *args)  # a numba call: an interrupt is raised after it returns
        return
    runs = min(nb, 4 * threads)
    counter = itertools.count()
    pool = _executor(threads)
    takers: List[Future] = []
    held: Optional[BaseException] = None
    try:
        for _ in range(min(threads, runs)):
            takers.append(pool.submit(_take_runs, kernel, runs, counter, nb, args))
    except BaseException as e:  # the takers submitted so far take every run: wait for them
        held = e
    while takers:
        try:
            wait(takers)
            break
        except BaseException as e:  # [Note: an interrupt during a parallel call]
            held = held or e
    for f in takers:
        f.result()  # a taker's own error, if any
    if held is not None:
        raise held
