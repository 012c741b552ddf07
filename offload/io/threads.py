"""The ``threads`` engine: a pool of threads doing ``os.preadv`` / ``os.pwritev``.

For machines where io_uring is blocked (containers with seccomp filters do this) and file
systems that refuse O_DIRECT. ``preadv``/``pwritev`` release the GIL, so ``queue_depth``
threads keep ``queue_depth`` requests in the kernel, the way an io_uring queue would.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

from .engine import Engine, _Piece

__all__ = ["ThreadEngine", "transfer_blocking"]


def transfer_blocking(engine: Engine, piece: _Piece) -> Optional[OSError]:
    """Move all of ``piece`` with blocking syscalls, resubmitting the rest of short transfers.

    Returns the error to report (or None); a read that hits end of file stops early with
    ``piece.done`` bytes, which is the exact count the caller reports.
    """
    while piece.done < piece.nbytes:
        if piece.ticket.error is not None:  # a sibling failed: do not start more of this batch
            return None
        off = piece.offset + piece.done
        try:
            fd = piece.fd()
            if piece.write:
                n = os.pwritev(fd, [piece.remaining], off)
            else:
                n = os.preadv(fd, [piece.remaining], off)
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            return piece.error(exc.errno or errno.EIO)
        if n == 0:
            # pwrite returning 0 for a non-empty buffer means the device took nothing: an
            # error, not a loop. A read returning 0 is end of file.
            return piece.error(errno.EIO) if piece.write else None
        piece.done += n
        if piece.done < piece.nbytes:
            engine._count_resubmit()
    return None


class ThreadEngine(Engine):
    """``queue_depth`` worker threads; each piece is one task."""

    name = "threads"

    def __init__(self, *, queue_depth: int = 32, block_size: int = 1 << 20, direct: Optional[bool] = None) -> None:
        super().__init__(queue_depth=queue_depth, block_size=block_size, direct=direct)
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="offload-io")
        self._lock = threading.Lock()
        self._inflight = 0

    def _issue(self, pieces: List[_Piece]) -> None:
        for piece in pieces:
            self._pool.submit(self._run, piece)

    def _run(self, piece: _Piece) -> None:
        with self._lock:
            self._inflight += 1
            self._note_inflight(self._inflight)
        piece.t_issue = time.perf_counter_ns()
        try:
            err = transfer_blocking(self, piece)
        except BaseException as exc:  # never leave a ticket hanging
            err = OSError(errno.EIO, f"threads engine: unexpected {type(exc).__name__}: {exc}", piece.file.path)
        with self._lock:
            self._inflight -= 1
        self._piece_done(piece, err)

    def close(self) -> None:
        if not self._closed:
            super().close()
            self._pool.shutdown(wait=True)
