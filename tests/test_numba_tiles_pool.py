"""The Python threads that run the numba compressed kernel over runs of tiles
(offload/kernels/_numba_tiles_pool.py): every tile once, on several threads, an interrupt
held until the helpers are done, a helper's error raised, and a pool again after a fork.
The kernels here are plain Python functions with the kernel's calling convention; the bits
of the real kernel on 1 and 2 threads are test_numba_compressed's."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from _fork_child import run_child
from offload.kernels import _numba_tiles_pool as pool_module
from offload.kernels._numba_tiles_pool import run_tiles


class Recorder:
    """A kernel that notes the runs it was given and the threads that ran them."""

    def __init__(self, delay=0.0):
        self.delay = delay
        self.runs, self.threads = [], set()
        self.active = 0
        self.lock = threading.Lock()

    def __call__(self, lo, hi, tag):
        assert tag == "args"
        with self.lock:
            self.active += 1
        try:
            time.sleep(self.delay)
            with self.lock:
                self.runs.append((lo, hi))
                self.threads.add(threading.get_ident())
        finally:
            with self.lock:
                self.active -= 1

    def tiles(self):
        return sorted(t for lo, hi in self.runs for t in range(lo, hi))


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("nb", [1, 2, 3, 7, 64, 1001])
def test_every_tile_is_run_once(threads, nb):
    k = Recorder()
    run_tiles(k, nb, threads, ("args",))
    assert k.tiles() == list(range(nb))
    assert all(lo < hi for lo, hi in k.runs)
    assert len(k.runs) == (1 if threads == 1 else min(nb, 4 * threads))


def test_the_work_is_spread_over_threads():
    """Each thread's first run waits for the other two at a barrier: the call finishes only
    if three threads take runs at once; the caller only waits (a signal's exception lands in
    it and would drop the run it held)."""
    barrier, seen = threading.Barrier(3, timeout=30), set()
    k = Recorder()

    def kernel(lo, hi, tag):
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            barrier.wait()
        k(lo, hi, tag)

    run_tiles(kernel, 64, 3, ("args",))
    assert k.tiles() == list(range(64))
    assert len(k.threads) == 3 and threading.get_ident() not in k.threads


@pytest.mark.parametrize("at_run", [0, 5, 11])
def test_an_interrupt_waits_for_every_run(at_run):
    """A Ctrl-C while the call runs is raised once every run is done: no tile is skipped,
    and nothing writes the arrays once the caller sees the interrupt. The signal is sent by
    the run ``at_run`` of 12, after the three takers have met at a barrier (so the caller
    has submitted them all and waits)."""
    barrier, seen = threading.Barrier(3, timeout=30), set()
    k = Recorder(delay=0.02)

    def kernel(lo, hi, tag):
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            barrier.wait()
        if lo == at_run * 64 // 12:
            os.kill(os.getpid(), signal.SIGINT)
        k(lo, hi, tag)

    with pytest.raises(KeyboardInterrupt):
        run_tiles(kernel, 64, 3, ("args",))
    assert k.active == 0
    assert k.tiles() == list(range(64))


def test_a_runs_error_is_raised_after_the_others():
    k = Recorder(delay=0.02)

    def kernel(lo, hi, tag):
        if lo == 0:
            raise ValueError(f"tiles {lo}..{hi}")
        k(lo, hi, tag)

    with pytest.raises(ValueError, match="tiles 0"):
        run_tiles(kernel, 16, 2, ("args",))
    assert k.active == 0


def _in_a_forked_child_runs_tiles() -> None:
    """A call on 3 threads in a forked child: every tile, on more than one thread."""
    def body():
        k = Recorder(delay=0.01)
        run_tiles(k, 16, 3, ("args",))
        return k.tiles() == list(range(16)) and len(k.threads) > 1

    run_child(body, "the forked child's call did not finish in 60 s (a pool thread or lock of the parent's)")


def test_a_forked_child_gets_a_pool_of_its_own():
    run_tiles(Recorder(), 16, 3, ("args",))  # the parent's pool exists before the fork
    _in_a_forked_child_runs_tiles()


def test_a_fork_while_the_pool_lock_is_held():
    """Another thread of the parent may hold the pool's lock when it forks: the child's
    copy stays taken, so the child must make a lock of its own."""
    with pool_module._pool_lock:
        _in_a_forked_child_runs_tiles()
