"""What every engine shares: requests, tickets, splitting into blocks, per-request results.

An engine receives a batch of ``IORequest``s, splits each into pieces of at most
``block_size`` bytes, keeps at most ``queue_depth`` pieces in flight, and completes a
``Ticket`` when all pieces of the batch are done. Subclasses only *issue* pieces and report
each piece's outcome through ``_piece_done``; the bookkeeping (results, the first error,
latencies, statistics) lives here once.

[Note: threads] ``submit`` may be called from one thread (say the training loop) while
another waits, and waiting never holds the GIL: engines complete tickets from their own
threads and ``wait`` blocks on a ``threading.Event``.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from .files import ALIGN, IOFile

__all__ = ["IORequest", "Ticket", "Engine", "as_bytes_view", "MAX_QUEUE_DEPTH"]

MAX_QUEUE_DEPTH = 32768
"""The most requests an engine keeps in flight: the kernel's largest io_uring
(IORING_MAX_ENTRIES). A deeper queue failed in the ring's set-up, with python-liburing as an
OverflowError past 2**32; the thread engines would start that many threads."""

_OPS = ("read", "write")
_MAX_OFFSET = 1 << 63  # off_t: a larger offset would wrap in a 64-bit field (an SQE's) and hit offset 0


def as_bytes_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat, C-contiguous byte memoryview of ``buf``, zero-copy.

    Accepts ``memoryview``, ``bytearray``, ``mmap``, ``bytes`` (writes only), a ``HostBuffer``
    (or a slice of one, which is a memoryview), numpy arrays and contiguous CPU torch tensors.
    """
    if hasattr(buf, "memoryview") and hasattr(buf, "data_ptr") and hasattr(buf, "capacity"):
        buf = buf.memoryview  # HostBuffer
    elif type(buf).__module__.startswith("torch"):
        import torch

        if not isinstance(buf, torch.Tensor):
            raise ValueError(f"unsupported buffer type {type(buf).__name__}")
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("a tensor used as an I/O buffer must be a contiguous CPU tensor "
                             f"(got device={buf.device}, contiguous={buf.is_contiguous()})")
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ValueError(f"unsupported buffer type {type(buf).__name__}; pass a memoryview, "
                         "bytearray, HostBuffer or contiguous CPU tensor") from None
    if not mv.c_contiguous:
        raise ValueError("I/O buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError("a read needs a writable buffer (got a read-only one, e.g. bytes)")
    return mv


def _address(mv: memoryview) -> int:
    if len(mv) == 0:
        return 0
    if not mv.readonly:
        c = ctypes.c_char.from_buffer(mv)
        try:
            return ctypes.addressof(c)
        finally:
            del c
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


@dataclass
class IORequest:
    """Read into / write from ``buf`` at byte ``offset`` of ``file``; ``len(buf)`` bytes."""

    op: str
    file: IOFile
    offset: int
    buf: Any

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"IORequest.op must be 'read' or 'write', got {self.op!r}")
        if not isinstance(self.file, IOFile):
            raise ValueError(f"IORequest.file must be an IOFile from open_file(), got {type(self.file).__name__}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or not 0 <= self.offset < _MAX_OFFSET:
            raise ValueError(f"IORequest.offset must be an int in [0, 2**63), a file offset, got {self.offset!r}")


class _Piece:
    """At most ``block_size`` bytes of one request; advanced in place after a short transfer."""

    __slots__ = ("ticket", "index", "write", "file", "offset", "view", "addr", "nbytes", "done",
                 "t_issue", "keep")

    def __init__(self, ticket: "Ticket", index: int, write: bool, file: IOFile, offset: int,
                 view: memoryview, addr: int) -> None:
        self.ticket = ticket
        self.index = index
        self.write = write
        self.file = file
        self.offset = offset
        self.view = view
        self.addr = addr
        self.nbytes = len(view)
        self.done = 0
        self.t_issue = 0
        self.keep: Any = None  # objects the kernel reads until completion (e.g. an Iovec)

    @property
    def remaining(self) -> memoryview:
        return self.view[self.done:]

    def unaligned(self) -> bool:
        """True when the rest of this piece cannot go through O_DIRECT (not 4 KiB-aligned)."""
        return bool((self.offset + self.done) % ALIGN or (self.addr + self.done) % ALIGN
                    or (self.nbytes - self.done) % ALIGN)

    def fd(self) -> int:
        """The direct descriptor when the rest of this piece is 4 KiB-aligned, else the buffered one."""
        f = self.file
        if f.direct and self.unaligned():
            return f.buffered_fd
        return f.fileno()

    def error(self, err: int) -> OSError:
        op = "write" if self.write else "read"
        return OSError(err, f"{op} of {self.nbytes - self.done} bytes at offset {self.offset + self.done} failed: "
                            f"{os.strerror(err)}", self.file.path)


class Ticket:
    """A submitted batch. ``results[i]`` is the byte count of request ``i`` once done."""

    def __init__(self, engine: "Engine", nreq: int) -> None:
        self.engine = engine
        self.results: List[int] = [0] * nreq
        self.error: Optional[OSError] = None
        self.latencies_ns: List[int] = []
        """Per piece: from issue to completion (for benchmarks; one entry per block)."""
        self._pending = 0
        self._event = threading.Event()

    @property
    def done(self) -> bool:
        return self._event.is_set()


class Engine:
    """Base of the engines; see the module docstring. Subclasses implement ``_issue``."""

    name = "base"

    def __init__(self, *, queue_depth: int = 32, block_size: int = 1 << 20, direct: Optional[bool] = None) -> None:
        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
            raise ValueError(f"queue_depth must be an int in [1, {MAX_QUEUE_DEPTH}], got {queue_depth!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < ALIGN or block_size % ALIGN:
            raise ValueError(f"block_size must be a positive multiple of {ALIGN}, got {block_size!r}")
        self.queue_depth = queue_depth
        self.block_size = block_size
        self.direct = direct
        """What files opened through ``open()`` use: True/False/None as in ``open_file``."""
        self.reason = ""
        """Why ``open_engine`` picked this engine (set by ``open_engine``)."""
        self._stats_lock = threading.Lock()
        self._stats: Dict[str, int] = dict(requests=0, pieces=0, bytes_read=0, bytes_written=0,
                                           resubmits=0, unaligned_pieces=0, max_inflight=0, errors=0)
        self._closed = False
        # A forked child inherits the engine object but not its completion threads (nor, for
        # io_uring, a ring it may share with the parent): I/O submitted there would never
        # complete, or complete in the parent. The child must open its own.
        self._owner_pid = os.getpid()

    # -- public API -------------------------------------------------------------------------

    def submit(self, requests: Sequence[IORequest]) -> Ticket:
        """Start ``requests``; returns at once with a ticket for ``wait``/``poll``.

        Buffers must stay alive and untouched until the ticket is done.
        """
        ticket, pieces = self._prepare(requests)
        if pieces:
            self._issue(pieces)
        return ticket

    def _prepare(self, requests: Sequence[IORequest]) -> "tuple[Ticket, List[_Piece]]":
        """Validate ``requests`` and split them into pieces of at most ``block_size`` bytes."""
        if self._closed:
            raise ValueError(f"{self.name} engine is closed")
        if os.getpid() != self._owner_pid:
            raise RuntimeError(f"{self.name} engine: opened by process {self._owner_pid}, used in process "
                               f"{os.getpid()}, a child forked from it, which has none of its completion threads "
                               "or ring; an offloaded optimizer (or engine) belongs to the process that made it: "
                               "make a new one in the child, or fork before making it")
        reqs = list(requests)
        ticket = Ticket(self, len(reqs))
        pieces: List[_Piece] = []
        for i, req in enumerate(reqs):
            if not isinstance(req, IORequest):
                raise ValueError(f"submit() takes IORequest objects, got {type(req).__name__}")
            write = req.op == "write"
            req.file._check_open()
            if write and not req.file.writable:
                raise OSError(errno.EBADF, "write to a file opened read-only", req.file.path)
            mv = as_bytes_view(req.buf, writable=not write)
            addr = _address(mv)
            for start in range(0, len(mv), self.block_size):
                view = mv[start:start + self.block_size]
                pieces.append(_Piece(ticket, i, write, req.file, req.offset + start, view, addr + start))
        ticket._pending = len(pieces)
        with self._stats_lock:
            self._stats["requests"] += len(reqs)
            self._stats["pieces"] += len(pieces)
            self._stats["unaligned_pieces"] += sum(1 for p in pieces if p.file.direct and p.unaligned())
        if not pieces:
            ticket._event.set()
        return ticket, pieces

    def wait(self, ticket: Ticket, timeout: Optional[float] = None) -> List[int]:
        """Block (GIL released) until ``ticket`` is done; bytes per request.

        Raises the first ``OSError(errno, msg, path)`` of the batch, only after every piece of
        it has finished (so no buffer is still in the kernel's hands), or ``TimeoutError``.
        """
        if ticket.engine is not self:
            raise ValueError("ticket belongs to another engine")
        if not ticket._event.wait(timeout):
            raise TimeoutError(f"{self.name} engine: I/O not done after {timeout} s")
        if ticket.error is not None:
            raise ticket.error
        return list(ticket.results)

    def poll(self, ticket: Ticket) -> bool:
        """True once ``ticket`` is done (then ``wait`` returns at once)."""
        if ticket.engine is not self:
            raise ValueError("ticket belongs to another engine")
        return ticket.done

    def read(self, file: IOFile, offset: int, buf: Any) -> int:
        """Read into ``buf`` at ``offset``; bytes read (fewer only at end of file)."""
        return self.wait(self.submit([IORequest("read", file, offset, buf)]))[0]

    def write(self, file: IOFile, offset: int, buf: Any) -> int:
        """Write all of ``buf`` at ``offset``; bytes written."""
        return self.wait(self.submit([IORequest("write", file, offset, buf)]))[0]

    def open(self, path: "str | os.PathLike[str]", **kwargs: Any) -> IOFile:
        """``open_file`` with this engine's ``direct`` setting unless given."""
        from .files import open_file

        kwargs.setdefault("direct", self.direct)
        return open_file(path, **kwargs)

    def register_buffers(self, buffers: Sequence[Any]) -> Optional[int]:
        """Pin long-lived ``buffers`` with the engine, if it can use that; returns a handle or None.

        Only ``uring`` does (registered buffers, see its [Note: fixed buffers]); others return
        None and need nothing. Pass the handle to :meth:`unregister_buffers` before the memory
        is unmapped.
        """
        return None

    def unregister_buffers(self, handle: Optional[int]) -> None:
        """Undo :meth:`register_buffers` (None is accepted and ignored)."""

    def stats(self) -> Dict[str, int]:
        """Counters since the engine opened: requests, pieces, bytes, resubmits, max in flight."""
        with self._stats_lock:
            return dict(self._stats)

    def close(self) -> None:
        """Stop accepting work and release resources; in-flight batches are finished first."""
        self._closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} qd={self.queue_depth} bs={self.block_size} direct={self.direct}>"

    # -- for subclasses ---------------------------------------------------------------------

    def _issue(self, pieces: List[_Piece]) -> None:
        raise NotImplementedError

    def _note_inflight(self, n: int) -> None:
        if n > self._stats["max_inflight"]:
            with self._stats_lock:
                self._stats["max_inflight"] = max(self._stats["max_inflight"], n)

    def _piece_done(self, piece: _Piece, error: Optional[OSError]) -> bool:
        """Record a finished piece (``piece.done`` bytes, or ``error``); True if its ticket completed.

        Called from the engine's completion thread; never raises.
        """
        t = piece.ticket
        now = time.perf_counter_ns()
        with self._stats_lock:
            if error is not None:
                self._stats["errors"] += 1
                if t.error is None:
                    t.error = error
            else:
                t.results[piece.index] += piece.done
                self._stats["bytes_written" if piece.write else "bytes_read"] += piece.done
            if piece.t_issue:
                t.latencies_ns.append(now - piece.t_issue)
            # Drop our views of the caller's buffer before the ticket completes: the thread
            # that finished this piece may hold the piece a moment longer, and a caller that
            # closes its pool right after wait() must find no export left.
            piece.keep = None
            piece.view = None
            t._pending -= 1
            finished = t._pending == 0
        if finished:
            t._event.set()
        return finished

    def _count_resubmit(self) -> None:
        with self._stats_lock:
            self._stats["resubmits"] += 1
