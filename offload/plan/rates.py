"""Measured rates the planner turns into a predicted step: CPU Adam Gparam/s and disk GB/s.

Each rate comes from a short probe on this machine or from a file a benchmark wrote
(``bench/adam.py``'s JSON line, ``offload bench-io --tune``'s file). A ``Rate`` keeps where
it came from, because a predicted step is only as good as the rate behind it and the user
must be able to see which one was used. Files are read defensively (their schemas belong to
other layers and may grow): unknown keys are ignored, a file without any usable figure is a
``ValueError`` naming it.
"""
from __future__ import annotations

import errno
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional, Tuple

import torch

__all__ = [
    "Rate",
    "KernelProbe",
    "DiskProbe",
    "probe_kernel_rate",
    "kernel_rate_from_bench",
    "probe_disk_rate",
    "disk_rate_from_tune",
]


@dataclass(frozen=True)
class Rate:
    """A measured rate: ``value`` in ``unit`` (``Gparam/s``: 10^9 params/s; ``GB/s``: 10^9 B/s)."""

    value: float
    unit: str
    source: str


def _read_json_any(path: str) -> Any:
    """A JSON document, or the last line of a file that parses as JSON (benchmarks print a
    table and then one JSON line)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "rates file not found", path)
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:  # alone it named neither the file nor what it should be
        raise ValueError(f"{path}: not a text file ({exc.reason} at byte {exc.start}); expected JSON, "
                         "or a benchmark's output ending with a JSON line") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") or line.startswith("["):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError(f"{path}: no JSON document or JSON line found")


def _walk(obj: Any, trail: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], dict]]:
    """Every dict inside ``obj`` with the keys leading to it."""
    if isinstance(obj, dict):
        yield trail, obj
        for k, v in obj.items():
            yield from _walk(v, trail + (str(k),))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, trail + (str(i),))


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
        return float(v)
    return None


# --------------------------------------------------------------------------- kernel

class KernelProbe:
    """``numel`` fp32 params with grads and moments, ready to time one Adam step at a time.

    ``time_once()`` runs one ``offload.kernels`` Adam ``rule_step`` (torch's fused AdamW when the
    kernels package is missing or fails to load; ``source`` says which) and returns seconds.
    Reusable, so a benchmark can interleave probe steps with the steps it predicts.
    """

    def __init__(self, numel: int = 10_000_000, *, num_threads: Optional[int] = None,
                 backend: Optional[str] = None, state_dtype: str = "float32") -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"probe numel must be a positive integer, got {numel!r}")
        self.numel = numel
        self._compressed = None
        if state_dtype != "float32":  # the fused decode / encode kernel, through the host store
            self._compressed = _compressed_step(numel, state_dtype, num_threads, backend)
            self.source = f"{state_dtype} states, offload.AdamW(state_dtype={state_dtype!r}).step"
            self.time_once()  # warm-up
            return
        g = torch.Generator().manual_seed(0)
        self._p = torch.randn(numel, generator=g)
        self._g = torch.randn(numel, generator=g)
        self._m = torch.zeros(numel)
        self._v = torch.zeros(numel)
        self._step = 0
        self._threads = num_threads
        try:
            from offload.kernels import get_backend
            from offload.kernels.fields import ADAM
            self._b = get_backend(backend)
            self._rule, self._states = ADAM, {"exp_avg": self._m, "exp_avg_sq": self._v}
            self.source = f"{self._b.name} adam_step"
        except ImportError as exc:
            self._b, self.source = None, f"torch AdamW(fused=True) (offload.kernels unavailable: {exc})"
        except (RuntimeError, OSError) as exc:
            if backend is not None:
                raise
            self._b, self.source = None, f"torch AdamW(fused=True) (offload.kernels failed to load: {exc})"
        if self._b is None:
            param = torch.nn.Parameter(self._p)
            param.grad = self._g
            self._opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
        self.time_once()  # warm-up: first touch of the moments and any JIT compilation

    def time_once(self) -> float:
        t0 = time.perf_counter()
        if self._compressed is not None:
            self._compressed()
            return time.perf_counter() - t0
        self._step += 1
        if self._b is not None:
            self._b.rule_step(self._rule, self._p, self._g, self._states, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.01, step=self._step, decoupled=True, num_threads=self._threads)
        else:
            self._opt.step()
        return time.perf_counter() - t0


def _compressed_step(numel: int, state_dtype: str, num_threads: Optional[int], backend: Optional[str]):
    """One AdamW step over ``numel`` fp32 params with ``state_dtype`` states (their kernel is
    compute-bound: 0.2-0.6x the fp32 one's params/s, bench/RESULTS.md), as a callable."""
    import offload

    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=g))
    param.grad = torch.randn(numel, generator=g)
    opt = offload.AdamW([param], lr=1e-3, weight_decay=0.01, state_dtype=state_dtype, num_threads=num_threads,
                        backend=backend)
    return opt.step


def probe_kernel_rate(numel: int = 10_000_000, *, repeats: int = 5, num_threads: Optional[int] = None,
                      backend: Optional[str] = None, state_dtype: str = "float32") -> Rate:
    """Gparam/s of one Adam step on ``numel`` fp32 params: median of ``repeats`` after a warm-up.

    Times ``offload.kernels.get_backend().rule_step(ADAM, ...)``; without the kernels package (or if it
    fails to load) torch's fused AdamW, and the source says so: the prediction then describes
    torch, not this engine. With compressed states (``state_dtype`` "bfloat16" or "int8") it
    times their fused kernel, through ``offload.AdamW``.
    """
    probe = KernelProbe(numel, num_threads=num_threads, backend=backend, state_dtype=state_dtype)
    times = [probe.time_once() for _ in range(repeats)]
    t = statistics.median(times)
    # the spread goes with the figure: on a shared machine back-to-back plans measured 0.6 to 1.9
    spread = f" ({numel / max(times) / 1e9:.2f}-{numel / min(times) / 1e9:.2f})" if repeats > 1 else ""
    return Rate(numel / t / 1e9, "Gparam/s", f"probe: {probe.source}, {numel:,} fp32 params, median of {repeats}{spread}")


def kernel_rate_from_bench(path: str, *, prefer: Iterable[str] = ("native", "numba")) -> Rate:
    """Gparam/s from ``bench/adam.py`` output (its JSON line or a JSON file).

    Reads its ``results`` rows (``n`` and ``seconds`` per contender; fp32 AdamW rows only) or
    any row with a ``gparam*`` figure; prefers contenders naming one of ``prefer`` (in that
    order), then the largest N, then the highest rate (the best thread count measured).
    """
    data = _read_json_any(path)
    rows = []
    for trail, d in _walk(data):
        # bench/adam.py's rows: {"n": N, "threads": T, "kind": ..., "seconds": {contender: s}}
        secs, size = d.get("seconds"), _num(d.get("n"))
        if isinstance(secs, dict) and size and str(d.get("kind", "adamw_fp32")) == "adamw_fp32":
            for name, t in secs.items():
                if _num(t) and "probe" not in str(name):
                    label = f"{name} threads={d.get('threads', '?')}"
                    rows.append((label.lower(), size, size / t / 1e9))
            continue
        rate = None
        for k, v in d.items():
            if "gparam" in str(k).lower() and _num(v) is not None:
                rate = _num(v)
                break
        if rate is None:
            continue
        label = " ".join([*trail, *[str(v) for v in d.values() if isinstance(v, str)]]).lower()
        size = next((_num(d[k]) for k in ("n", "N", "numel", "params", "num_params", "size") if _num(d.get(k))), 0.0)
        rows.append((label, size or 0.0, rate))
    if not rows:
        raise ValueError(f"{path}: no Gparam/s figure found (expected bench/adam.py output)")
    for want in prefer:
        chosen = [r for r in rows if want in r[0]]
        if chosen:
            break
    else:
        chosen = rows
    big = max(r[1] for r in chosen)
    label, size, rate = max((r for r in chosen if r[1] == big), key=lambda r: r[2])
    return Rate(rate, "Gparam/s", f"file {path}: {label.strip()}" + (f" (N={int(size):,})" if size else ""))


# --------------------------------------------------------------------------- disk

class DiskProbe:
    """A preallocated probe file in ``directory`` and buffers, to time O_DIRECT passes.

    ``measure()`` writes then reads ``nbytes`` through the io layer and returns (read, write)
    seconds. The file is written once when opened, because overwriting is what swap files do
    (a fresh file writes 2-3x slower on this machine's disk). ``close()`` removes the file.
    """

    def __init__(self, directory: str, *, nbytes: int = 256 << 20, chunk: int = 8 << 20, buffers: int = 4) -> None:
        directory = os.fspath(directory)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError(errno.ENOTDIR, "disk probe directory is a file, not a directory", directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, "disk probe directory does not exist", directory)
        try:
            from offload.io import IORequest, open_engine, open_file
            from offload.memory import BufferPool
        except ImportError as exc:
            raise RuntimeError(f"the disk probe needs offload.io ({exc}); pass --disk-gbps instead") from None
        self._IORequest = IORequest
        self.directory = directory
        self.nbytes = max(chunk, nbytes // chunk * chunk)
        self.chunk = chunk
        self.path = os.path.join(directory, f".offload-plan-probe-{os.getpid()}-{id(self):x}")
        self._pool = BufferPool(pin=False)  # disk I/O only: pinning would buy nothing
        self._eng = self._file = None
        self._bufs = []
        try:
            self._eng = open_engine("auto", directory=directory)
            self._bufs = [self._pool.acquire(chunk) for _ in range(buffers)]
            for b in self._bufs:  # fresh data, not zeros (some devices compress or skip zero pages)
                t = b.tensor(torch.uint8)
                try:
                    t.copy_(torch.randint(0, 256, (chunk,), dtype=torch.uint8))
                finally:
                    del t  # no view may outlive the buffer (the pool refuses to unmap otherwise), Ctrl-C or not
            self._file = open_file(self.path, write=True, create=True, exclusive=True)
            self._file.preallocate(self.nbytes)
            self._pass("write")
        except BaseException:
            self._close(unwinding=True)
            raise
        self.source = (f"probe: {self._eng.name} engine, "
                       f"{'O_DIRECT' if self._file.direct else 'buffered (page cache may flatter reads)'}, "
                       f"{self.nbytes >> 20} MiB in {chunk >> 20} MiB requests, {directory}")

    def _pass(self, op: str) -> float:
        f, bufs = self._file, self._bufs
        reqs = [self._IORequest(op=op, file=f, offset=off, buf=bufs[(off // self.chunk) % len(bufs)].memoryview)
                for off in range(0, self.nbytes, self.chunk)]
        t0 = time.perf_counter()
        for i in range(0, len(reqs), len(bufs)):  # one request per buffer in flight
            self._eng.wait(self._eng.submit(reqs[i:i + len(bufs)]))
        if op == "write":
            f.fsync()
        return time.perf_counter() - t0

    def measure(self) -> Tuple[float, float]:
        """(read seconds, write seconds) for ``nbytes`` each."""
        tw = self._pass("write")
        return self._pass("read"), tw

    def close(self) -> None:
        self._close(unwinding=False)

    def _close(self, unwinding: bool) -> None:
        """``unwinding``: an exception (Ctrl-C, SIGTERM, an I/O error) is on its way out, and
        its traceback's frames may still hold views of the buffers (the requests of an
        interrupted pass); the pool then refuses to unmap them, and its BufferError must not
        replace the exception that says what happened (Ctrl-C was a BufferError traceback and
        exit 1). The pool unmaps them when it is collected after the views."""
        if self._file is not None:
            self._file.close()
            self._file = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        for b in self._bufs:
            self._pool.release(b)
        self._bufs = []
        try:
            self._pool.close()
        except BufferError:
            if not unwinding:
                raise
        finally:
            if self._eng is not None:
                self._eng.close()
                self._eng = None

    def __enter__(self) -> "DiskProbe":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._close(unwinding=exc_type is not None)


def probe_disk_rate(directory: str, *, nbytes: int = 256 << 20, chunk: int = 8 << 20) -> Tuple[Rate, Rate]:
    """(read, write) GB/s of ``nbytes`` O_DIRECT passes in ``directory`` (see ``DiskProbe``)."""
    with DiskProbe(directory, nbytes=nbytes, chunk=chunk) as probe:
        tr, tw = probe.measure()
        return (Rate(probe.nbytes / tr / 1e9, "GB/s", probe.source),
                Rate(probe.nbytes / tw / 1e9, "GB/s", probe.source))


def disk_rate_from_tune(path: str) -> Tuple[Optional[Rate], Optional[Rate]]:
    """(read, write) GB/s from the file ``offload bench-io --tune`` writes, or its ``--json`` rows.

    Accepted shapes (the io layer owns the schema): ``{"read": {..."gbps"}, "write": {...}}``
    (possibly nested, e.g. under ``"best"``), ``{"read_gbps": x, "write_gbps": y}``, or a list
    of rows ``{"rw": "read", "gbps": x, ...}`` of which the best per direction is taken.
    """
    data = _read_json_any(path)
    best = {"read": None, "write": None}

    def offer(rw: str, v: Optional[float], label: str) -> None:
        if v is None:
            return
        if best[rw] is None or v > best[rw][0]:
            best[rw] = (v, label)

    for trail, d in _walk(data):
        for rw in ("read", "write"):
            offer(rw, _num(d.get(f"{rw}_gbps")), "/".join(trail + (f"{rw}_gbps",)))
        rw = str(d.get("rw", d.get("direction", ""))).lower()
        if rw in ("read", "write", "randread", "randwrite"):
            if str(d.get("tool", "offload")) != "offload":
                continue  # fio rows are the reference, not what the engine will do
            offer("write" if "write" in rw else "read", _num(d.get("gbps")), "/".join(trail) or rw)
        elif trail and trail[-1] in ("read", "write"):
            offer(trail[-1], _num(d.get("gbps")), "/".join(trail))
    if best["read"] is None and best["write"] is None:
        raise ValueError(f"{path}: no read/write GB/s found (expected an `offload bench-io --tune` file)")
    out: List[Optional[Rate]] = []
    for rw in ("read", "write"):
        out.append(None if best[rw] is None else Rate(best[rw][0], "GB/s", f"file {path}: {best[rw][1]}"))
    return out[0], out[1]
