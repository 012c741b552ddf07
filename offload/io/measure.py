"""Measuring an engine on a file the way the swap layer uses it: a sliding window of batches.

``measure`` streams ``nbytes`` of a file through ``engine`` in ``block_size`` requests with up
to ``queue_depth`` in flight, from a window of ``2 * queue_depth`` pool buffers that are
reused only after their batch completed (what a pipeline does, and what fio does with its
``iodepth`` buffers). It reports throughput, per-request latency percentiles and the CPU time
the process spent (user and system, as % of one CPU, like fio's ``usr_cpu``/``sys_cpu``).
"""
from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

from offload.memory import BufferPool, HostBuffer

from .engine import Engine, IORequest
from .files import IOFile

__all__ = ["Measurement", "measure", "percentile", "merge"]


@dataclass
class Measurement:
    """One measured row. ``gbps`` is 10^9 B/s, ``gibps`` 2^30 B/s; latencies in microseconds."""

    tool: str
    engine: str
    rw: str
    block_size: int
    queue_depth: int
    direct: bool
    bytes: int
    seconds: float
    gbps: float
    gibps: float
    iops: float
    lat_p50_us: float
    lat_p99_us: float
    lat_p999_us: float
    cpu_usr_pct: float
    cpu_sys_pct: float
    loops: int = 1
    hugepages: Optional[bool] = None
    """fio rows: whether fio ran with glibc's huge-page malloc (``GLIBC_TUNABLES``), the
    variant asked for, not what the kernel gave. None for offload's engines: there is no such
    variant, their buffers always come from ``BufferPool`` regions advised ``MADV_HUGEPAGE``."""
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of already sorted values; 0.0 for none."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 100)) - 1))
    return float(sorted_values[k])


def window_buffers(pool: BufferPool, block_size: int, queue_depth: int) -> List[HostBuffer]:
    """The ``2 * queue_depth`` buffers ``measure`` cycles through."""
    return [pool.acquire(block_size) for _ in range(2 * queue_depth)]


def measure(engine: Engine, file: IOFile, *, rw: str, nbytes: int, buffers: Sequence[HostBuffer],
            progress: Optional[Callable[[int], None]] = None) -> "tuple[Measurement, List[int]]":
    """Stream ``nbytes`` (a multiple of ``engine.block_size``) of ``file`` from offset 0.

    Returns the measurement and the raw per-request latencies (ns) so loops can be merged.
    ``progress(nbytes_done_since_last_call)`` is called as batches complete.
    """
    if rw not in ("read", "write"):
        raise ValueError(f"rw must be 'read' or 'write', got {rw!r}")
    bs, qd = engine.block_size, engine.queue_depth
    if nbytes <= 0 or nbytes % bs:
        raise ValueError(f"nbytes ({nbytes}) must be a positive multiple of block_size ({bs})")
    if len(buffers) < 2 * qd or any(b.nbytes < bs for b in buffers):
        raise ValueError(f"need {2 * qd} buffers of >= {bs} bytes")
    batch = max(1, qd // 4)
    window = len(buffers) // batch
    nreq = nbytes // bs
    lat: List[int] = []
    tickets = []
    slot = 0
    i = 0
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    while i < nreq or tickets:
        while i < nreq and len(tickets) < window:
            n = min(batch, nreq - i)
            reqs = [IORequest(rw, file, (i + j) * bs, buffers[(slot * batch + j) % len(buffers)][0:bs])
                    for j in range(n)]
            tickets.append((engine.submit(reqs), n))
            slot = (slot + 1) % window
            i += n
        ticket, n = tickets.pop(0)
        counts = engine.wait(ticket)
        if rw == "read" and sum(counts) != n * bs:
            raise OSError(0, f"short read during benchmark ({sum(counts)} of {n * bs} bytes): file too small?",
                          file.path)
        lat.extend(ticket.latencies_ns)
        if progress is not None:
            progress(n * bs)
    seconds = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return _summarise("offload", engine.name, rw, bs, qd, file.direct, nbytes, seconds, lat,
                      r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime), lat


def _summarise(tool: str, engine: str, rw: str, bs: int, qd: int, direct: bool, nbytes: int, seconds: float,
               lat_ns: List[int], usr: float, sys: float, loops: int = 1) -> Measurement:
    s = sorted(lat_ns)
    seconds = max(seconds, 1e-9)
    return Measurement(
        tool=tool, engine=engine, rw=rw, block_size=bs, queue_depth=qd, direct=direct, bytes=nbytes,
        seconds=seconds, gbps=nbytes / seconds / 1e9, gibps=nbytes / seconds / 2 ** 30, iops=nbytes / bs / seconds,
        lat_p50_us=percentile(s, 50) / 1e3, lat_p99_us=percentile(s, 99) / 1e3, lat_p999_us=percentile(s, 99.9) / 1e3,
        cpu_usr_pct=100.0 * usr / seconds, cpu_sys_pct=100.0 * sys / seconds, loops=loops)


def merge(parts: Sequence["tuple[Measurement, List[int]]"]) -> Measurement:
    """One row from several loops of the same configuration: total bytes over total time."""
    first = parts[0][0]
    nbytes = sum(m.bytes for m, _ in parts)
    seconds = sum(m.seconds for m, _ in parts)
    lat = [x for _, ls in parts for x in ls]
    usr = sum(m.cpu_usr_pct * m.seconds / 100 for m, _ in parts)
    sys = sum(m.cpu_sys_pct * m.seconds / 100 for m, _ in parts)
    out = _summarise(first.tool, first.engine, first.rw, first.block_size, first.queue_depth, first.direct,
                     nbytes, seconds, lat, usr, sys, loops=len(parts))
    out.hugepages = first.hugepages
    out.note = first.note
    if not lat:  # rows from fio carry percentiles, not samples: take the median over loops
        for key in ("lat_p50_us", "lat_p99_us", "lat_p999_us"):
            vals = sorted(getattr(m, key) for m, _ in parts)
            setattr(out, key, vals[len(vals) // 2])
    return out
