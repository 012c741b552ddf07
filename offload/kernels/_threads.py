"""The kernel thread count, kept apart from torch's intra-op pool.

The native kernels run a parallel call on the OpenMP pool torch loaded, when there is one
([Note: torch's OpenMP pool] in native/parallel.h; ``OFFLOAD_POOL=own``: threads of each
call's own), and numba uses its own pool. The default count follows torch's setting so a
user who limits torch limits us too.

[Note: OpenMP spin] torch's OpenMP threads keep spinning for a few ms after each parallel
region (libgomp's default wait policy), so a kernel thread of its own that starts right
after a torch op on the CPU shares its core with one of them: measured here (bench/adam.py,
RESULTS.md) that cost up to 2x at 10M params with 2 threads. On torch's pool the spinning
threads are the ones that take the work.

libgomp's pool does not survive fork(): ``forked()`` says whether this process is a child
forked since offload was imported (the library itself sees forks after it was loaded).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["MAX_THREADS", "set_num_threads", "get_num_threads", "resolve_threads", "forked"]

from offload._fork import _FORKED, forked  # registered at `import offload`, see offload/_fork.py

# The native kernels take the count as a C int: a larger one was refused by the packer with
# struct.error, on every step, long after set_num_threads had taken it.
MAX_THREADS = 2**31 - 1

_num_threads: Optional[int] = None


_cpus: Optional[int] = None


def _cpu_count() -> int:
    """CPUs this process may run on, read once (a syscall is too slow per kernel call)."""
    global _cpus
    if _cpus is None:
        try:
            _cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            _cpus = os.cpu_count() or 1
    return _cpus


def set_num_threads(n: Optional[int]) -> None:
    """Set the kernel thread count; ``None`` restores the default."""
    global _num_threads
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS):
        raise ValueError(f"num_threads must be a positive int (at most {MAX_THREADS}) or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    """The kernel thread count: the value set, else min(torch threads, usable CPUs)."""
    if _num_threads is not None:
        return _num_threads
    return max(1, min(torch.get_num_threads(), _cpu_count()))


def resolve_threads(num_threads: Optional[int]) -> int:
    return get_num_threads() if num_threads is None else num_threads
