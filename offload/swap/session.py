"""A swap step as a session: sub-groups move through host buffers in named steps.

[Note: pipeline] The caller's thread drives a :class:`SwapSession` over an ordered list of
sub-groups. For each sub-group it calls ``acquire(g)``, which first *prefetches* (keeps the
reads of the next sub-groups in flight, as many as free buffers allow, at least g+1), then
waits for the read of g, checks it and hands out the buffer; the caller computes on it (the
kernel releases the GIL, so the engine's completions progress meanwhile) and calls
``finish(g)``, which submits the write-back. A buffer goes back to the free list only when
the engine reports its write complete. With three buffers that is exactly read g+1 /
compute g / write g-1; more buffers read further ahead. ``drain()`` waits for the last
writes; :class:`~offload.swap.step.StepSession` adds the store's commit (with the ranks'
agreement) on top. After any failure ``abort()`` waits for everything still in flight, so
no engine or helper thread keeps using a buffer the next session reuses.

Each group moves QUEUED -> READING -> COMPUTING -> WRITING -> DONE (``GroupState``); the
session holds all of its state (no globals), so a step could open one while backward still
produces the grads of later sub-groups.

Where a group is read from and written to is the session's *route* (request callables): the
swap step reads the committed slot and writes the other one, a checkpoint save reads the
store and writes checkpoint files, a load the reverse; the random-access group cache uses
one-group sessions. [Note: no read races a write] The session also keeps the (file, offset)
ranges with a write in flight and refuses to submit a read of one (a guard against engines
that complete the wrong ticket; see TensorNVMe's read/write wait mix-up).
"""
from __future__ import annotations

import enum
import errno
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

__all__ = ["SwapSession", "GroupState", "Transfer", "StepTimes", "Requests", "check_counts", "nbytes"]

Requests = Callable[[int, Any], List[Any]]
"""``(sub-group, buffer) -> [IORequest]`` of one direction of a route; ``[]``: nothing to move."""


class GroupState(enum.Enum):
    QUEUED = "queued"        # not read yet
    READING = "reading"      # its read is in flight (or its buffer is being filled)
    COMPUTING = "computing"  # acquired: the caller holds its buffer
    WRITING = "writing"      # its write-back is in flight
    DONE = "done"            # written back, buffer free again


class Transfer(NamedTuple):
    """A read or write in flight. ``ticket``: the engine's, or with checksums the helper
    thread's Future (a read's resolves to (completion time, verify s); a write's to (the
    engine's ticket, checksums, verify s))."""
    g: int
    buf: Any
    ticket: Any
    t0: float
    reqs: List[Any]


class _Interval:
    """Union of time intervals, to report how long some read (or write) was in flight."""

    def __init__(self) -> None:
        self.spans: List[Tuple[float, float]] = []

    def add(self, a: float, b: float) -> None:
        self.spans.append((a, b))

    def total(self) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.spans):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total


@dataclass
class StepTimes:
    """What a session measured (see ``SwapPipeline.run`` for each figure's meaning)."""
    read: _Interval = field(default_factory=_Interval)
    write: _Interval = field(default_factory=_Interval)
    io: _Interval = field(default_factory=_Interval)
    kernel_s: float = 0.0
    wait_read_s: float = 0.0
    wait_write_s: float = 0.0
    verify_s: float = 0.0
    read_bytes: int = 0
    write_bytes: int = 0

    def done(self, span: _Interval, t0: float, t1: float) -> None:
        span.add(t0, t1)
        self.io.add(t0, t1)

    def stats(self, commit_s: float, step_s: float, groups: int) -> Dict[str, float]:
        return {
            "swap_read_s": self.read.total(), "swap_write_s": self.write.total(), "io_busy_s": self.io.total(),
            "kernel_s": self.kernel_s,
            "wait_read_s": self.wait_read_s, "wait_write_s": self.wait_write_s, "verify_s": self.verify_s,
            "commit_s": commit_s, "step_s": step_s,
            "read_bytes": float(self.read_bytes), "write_bytes": float(self.write_bytes), "groups": float(groups),
        }


class SwapSession:
    """Move ``groups`` (in this order) through ``buffers``: ``acquire(g)`` / ``finish(g)``
    for each, then ``drain()``; ``abort()`` after a failure.

    ``reads`` / ``writes``: the route. ``fill(g, buf)``: called when ``reads`` has nothing
    for ``g`` (a sub-group never written: zeros). ``check(g, buf)``: after each read;
    ``checksum(g, buf)``: before each write, its result kept in ``written[g]``. ``helpers``:
    (read, write) executors that run those two off the caller's thread (see [Note: verify
    off the critical path] in pipeline.py); without them they run inline.
    """

    def __init__(self, engine: Any, buffers: Sequence[Any], groups: Sequence[int], *, reads: Requests,
                 writes: Requests, fill: Optional[Callable[[int, Any], None]] = None,
                 check: Optional[Callable[[int, Any], None]] = None,
                 checksum: Optional[Callable[[int, Any], Any]] = None,
                 helpers: Optional[Tuple[ThreadPoolExecutor, ThreadPoolExecutor]] = None) -> None:
        self.engine = engine
        self.groups: List[int] = list(groups)
        self.reads, self.writes, self.fill = reads, writes, fill
        self.check, self.checksum, self.helpers = check, checksum, helpers
        self.free: List[Any] = list(buffers)
        self.state: Dict[int, GroupState] = {g: GroupState.QUEUED for g in self.groups}
        self.times = StepTimes()
        self.written: Dict[int, Any] = {}    # g -> checksums (or None): what the commit needs
        self.computed: List[int] = []        # sub-groups whose compute ran, in order
        self._reads: Dict[int, Transfer] = {}         # position in ``groups`` -> its read
        self._writes: Deque[Transfer] = deque()       # in submission order
        self._writing: Set[Tuple[Any, int]] = set()   # (file, offset) with a write in flight
        self._held: Dict[int, Any] = {}               # g -> buffer, while COMPUTING
        self._next_read = 0
        self._pos = 0
        self._t_kernel = 0.0

    # ------------------------------------------------------------------ named steps
    def prefetch(self) -> None:
        """Keep reads in flight: the current group's and the next one's at least, more while
        buffers are free (completed writes hand theirs back first)."""
        while self._next_read < len(self.groups):
            while self._writes and self._finish_write(block=False):
                pass
            if not self.free:
                if self._next_read > self._pos + 1:
                    break
                self._finish_write(block=True)
            self._submit_read(self._next_read)
            self._next_read += 1

    def acquire(self, g: int) -> Any:
        """Prefetch, then wait for ``g``'s states (checked) and hand out its buffer."""
        if self._pos >= len(self.groups) or self.groups[self._pos] != g:
            raise RuntimeError(f"internal error: sub-group {g} acquired out of the session's order {self.groups}")
        self.prefetch()
        tr = self._reads.pop(self._pos)
        t = self.times
        if isinstance(tr.ticket, Future):
            tw = time.perf_counter()
            t1, vt = tr.ticket.result()
            t.wait_read_s += time.perf_counter() - tw
            t.verify_s += vt
            t.done(t.read, tr.t0, t1)
        elif tr.ticket is not None:
            tw = time.perf_counter()
            done = self.engine.wait(tr.ticket)
            t1 = time.perf_counter()
            t.wait_read_s += t1 - tw
            check_counts(done, tr.reqs, "read")
            t.done(t.read, tr.t0, t1)
        self.state[g] = GroupState.COMPUTING
        self._held[g] = tr.buf
        self._t_kernel = time.perf_counter()
        return tr.buf

    def finish(self, g: int) -> None:
        """The caller is done with ``g``'s buffer: submit its write-back (with checksums:
        checksum first, on the write helper)."""
        if self.state.get(g) is not GroupState.COMPUTING:
            raise RuntimeError(f"internal error: sub-group {g} finished while {self.state.get(g)}")
        self.times.kernel_s += time.perf_counter() - self._t_kernel
        buf = self._held.pop(g)
        self.computed.append(g)
        self.written[g] = None
        self._pos += 1
        wreqs = self.writes(g, buf)
        self.times.write_bytes += sum(nbytes(r.buf) for r in wreqs)
        self._writing.update(_ranges(wreqs))
        if self.checksum is not None:
            ticket: Any = self._on_helper(1, self._checksum_and_submit, wreqs, g, buf)
        else:
            ticket = self.engine.submit(wreqs)
        self.state[g] = GroupState.WRITING
        self._writes.append(Transfer(g, buf, ticket, time.perf_counter(), wreqs))

    def drain(self) -> None:
        """Wait for every write-back: afterwards each finished group is DONE."""
        while self._writes:
            self._finish_write(block=True)

    def abort(self) -> None:
        """After a failure: wait for everything still in flight (errors ignored: the first
        one is the one reported) so that no engine or helper keeps using a buffer."""
        pending = [tr.ticket for tr in self._reads.values() if tr.ticket is not None]
        pending += [tr.ticket for tr in self._writes]
        for ticket in pending:
            try:
                if isinstance(ticket, Future):
                    res = ticket.result()
                    if isinstance(res, tuple) and len(res) == 3:  # a write: now wait for the I/O
                        self.engine.wait(res[0])
                else:
                    self.engine.wait(ticket)
            except Exception:
                pass
        self.free.extend(tr.buf for tr in self._reads.values())
        self.free.extend(tr.buf for tr in self._writes)
        self.free.extend(self._held.values())
        self._reads.clear()
        self._writes.clear()
        self._held.clear()
        self._writing.clear()

    # ------------------------------------------------------------------ I/O
    def _submit_read(self, i: int) -> None:
        g = self.groups[i]
        buf = self.free.pop()
        self.state[g] = GroupState.READING
        reqs = self.reads(g, buf)
        if not reqs:
            if self.fill is not None:
                self.fill(g, buf)
            self._reads[i] = Transfer(g, buf, None, 0.0, reqs)
            return
        if self._writing.intersection(_ranges(reqs)):  # see [Note: no read races a write]
            self.free.append(buf)
            raise RuntimeError(f"internal error: read of sub-group {g} submitted while a write of it is in flight")
        self.times.read_bytes += sum(nbytes(r.buf) for r in reqs)
        ticket = self.engine.submit(reqs)
        if self.check is not None:  # wait and check on the read helper, while this thread computes
            ticket = self._on_helper(0, self._wait_and_check, ticket, reqs, g, buf)
        self._reads[i] = Transfer(g, buf, ticket, time.perf_counter(), reqs)

    def _finish_write(self, block: bool) -> bool:
        tr, t = self._writes[0], self.times
        ticket = tr.ticket
        if isinstance(ticket, Future):  # checksummed on the write helper, which then submitted
            if not block and not ticket.done():
                return False
            tw = time.perf_counter()
            ticket, self.written[tr.g], vt = ticket.result()
            t.wait_write_s += time.perf_counter() - tw
            t.verify_s += vt
            self._writes[0] = tr = tr._replace(ticket=ticket)
        if not block and not self.engine.poll(ticket):
            return False
        tw = time.perf_counter()
        done = self.engine.wait(ticket)
        t1 = time.perf_counter()
        if block:
            t.wait_write_s += t1 - tw
        check_counts(done, tr.reqs, "write")
        t.done(t.write, tr.t0, t1)
        self._writes.popleft()
        self._writing.difference_update(_ranges(tr.reqs))
        self.state[tr.g] = GroupState.DONE
        self.free.append(tr.buf)
        return True

    def _on_helper(self, k: int, fn: Callable[..., Any], *args: Any) -> Future:
        if self.helpers is not None:
            return self.helpers[k].submit(fn, *args)
        fut: Future = Future()  # inline: the same bookkeeping, already resolved
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def _wait_and_check(self, ticket: Any, reqs: List[Any], g: int, buf: Any) -> Tuple[float, float]:
        """Read helper: wait for the read of ``g``, check its counts and checksums."""
        check_counts(self.engine.wait(ticket), reqs, "read")
        t1 = time.perf_counter()
        self.check(g, buf)
        return t1, time.perf_counter() - t1

    def _checksum_and_submit(self, wreqs: List[Any], g: int, buf: Any) -> Tuple[Any, Any, float]:
        """Write helper: checksum ``g``'s states, then submit their write."""
        t0 = time.perf_counter()
        sums = self.checksum(g, buf)
        vt = time.perf_counter() - t0
        return self.engine.submit(wreqs), sums, vt


def _ranges(reqs: List[Any]) -> Set[Tuple[Any, int]]:
    return {(getattr(r.file, "path", r.file), r.offset) for r in reqs}


def check_counts(done: List[int], reqs: List[Any], what: str) -> None:
    """The engine retries short transfers; a count that still falls short is an error."""
    if len(done) != len(reqs):
        raise OSError(errno.EIO, f"engine returned {len(done)} results for {len(reqs)} {what} requests",
                      reqs[0].file.path if reqs else None)
    for n, r in zip(done, reqs):
        if n != nbytes(r.buf):
            raise OSError(errno.EIO, f"short {what}: {n} of {nbytes(r.buf)} bytes at offset {r.offset}", r.file.path)


def nbytes(buf: Any) -> int:
    return int(getattr(buf, "nbytes", None) or len(buf))
