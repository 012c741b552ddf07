"""``offload bench-io``: what a directory's disk can do for offload, measured like swap does it.

Sweeps engine x block size x queue depth for reads and writes over a fresh test file of
random data, side by side with fio on the same file (``--fio``), and writes the best
configuration for the swap layer (``--tune``). Throughput is GB/s = 10^9 bytes/s (and GiB/s
= 2^30 bytes/s next to it). No sudo: O_DIRECT by default; with ``--buffered`` each read is
preceded by ``posix_fadvise(DONTNEED)`` on the file, and a buffered read far above the direct
rate is flagged as probably cached.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ._args import byte_size, integer
# bench/io.py uses _human, format_table and plot from here
from .bench_io_output import Progress, _human, check_outputs, format_table, plot  # noqa: F401

log = logging.getLogger(__name__)

# the test file's names and life ([Note: the test file while it runs] there)
from .bench_io_file import DATA_NAME, RUNNING_NAME, create_data_file, kept_name_problem, remove_data_file  # noqa: F401


# -- argument parsing -------------------------------------------------------------------------

def _list(parse):
    def f(text: str):
        items = [x for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        try:
            values = [parse(x.strip()) for x in items]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc))
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:  # a row measured twice in one table is a typo, not a measurement
            raise argparse.ArgumentTypeError(f"{', '.join(twice)} given more than once")
        return values
    return f


def _directory(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name the directory to measure")
    return text


# io_uring refuses rings of more entries (IORING_MAX_ENTRIES), and the sweep keeps 2 x QD
# buffers of each block size: a larger depth is a typo, not a measurement.
_MAX_QD = 32768
_queue_depth = integer(1, _MAX_QD, " (io_uring's largest ring)")


def _block_size(text: str) -> int:
    n = byte_size(minimum=1)(text)
    if n % 4096:  # O_DIRECT's alignment, and the swap layer's pages
        raise argparse.ArgumentTypeError(f"must be a multiple of 4096, got {text!r}")
    return n


def _rw(x: str) -> str:
    if x not in ("read", "write"):
        raise ValueError(f"--rw takes read and/or write, got {x!r}")
    return x


def _engine(x: str) -> str:
    from offload.io import ENGINES

    if x not in ENGINES:
        raise ValueError(f"unknown engine {x!r}; expected {', '.join(ENGINES)}")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, type=_directory,
                   help="directory to measure (the test file is created there)")
    p.add_argument("--size", type=byte_size(minimum=1), default=1 << 30, help="test file size, e.g. 4GiB (default 1GiB)")
    p.add_argument("--rw", type=_list(_rw), default=["read", "write"], help="read,write (default both)")
    p.add_argument("--block-size", type=_list(_block_size), default=[1 << 20],
                   help="e.g. 128K,1M,8M, multiples of 4096 (default 1M)")
    p.add_argument("--queue-depth", type=_list(_queue_depth), default=[32], help="e.g. 1,8,32 (default 32)")
    p.add_argument("--engine", type=_list(_engine), default=["uring", "threads", "aiofiles"],
                   help="uring,threads,aiofiles (default all)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--direct", dest="direct", action="store_true", default=True, help="O_DIRECT (default)")
    g.add_argument("--buffered", dest="direct", action="store_false", help="through the page cache")
    p.add_argument("--loops", type=integer(1), default=1, help="passes over the file per row, interleaved (default 1)")
    p.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    p.add_argument("--plot", metavar="FILE.png", help="plot throughput vs block size and queue depth")
    p.add_argument("--fio", action="store_true", help="run fio with the same parameters and print ratios")
    p.add_argument("--tune", metavar="FILE", help="write the best configuration for the swap layer")
    p.add_argument("--keep", action="store_true", help="keep the test file")
    p.add_argument("--fixed-buffers", choices=("auto", "off", "both"), default="auto",
                   help="register the I/O buffers with engines that can use them (uring, Linux 6.15+): "
                        "auto (default), off, or both (uring measured both ways; the row without is "
                        "'uring-unreg')")


def add_parser(subparsers, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name, help="measure disk throughput for offload (engines vs fio)",
        description="Measure what a directory's disk can do for offload: engines x block sizes x queue "
                    "depths on a fresh file of random data, optionally next to fio, and write the best "
                    "configuration for the swap layer (--tune).",
        epilog="GB/s = 10^9 bytes/s, GiB/s = 2^30 bytes/s. Example: offload bench-io --dir /nvme --size 4GiB "
               "--block-size 128K,1M,8M --queue-depth 1,8,32 --fio --plot io.png --tune io-tune.json")
    add_arguments(p)
    p.set_defaults(run=run)
    return p


# -- the run ----------------------------------------------------------------------------------

def _settle(f, size: int, pool, progress: Progress) -> None:
    """One untimed read pass after creating the file: on virtual disks the host is still
    writing the new data back for a while, and whoever is measured first would pay for it."""
    from offload.io import open_engine
    from offload.io.measure import measure, window_buffers

    bs = 4 << 20 if size % (4 << 20) == 0 else 1 << 20
    if size % bs:
        return
    bufs = window_buffers(pool, bs, 8)
    try:
        with open_engine("threads", queue_depth=8, block_size=bs) as eng:
            progress.step("settling: one untimed read pass")
            measure(eng, f, rw="read", nbytes=size, buffers=bufs, progress=progress.advance)
    finally:
        for b in bufs:
            pool.release(b)


def _drop_cache(f) -> None:
    """Evict the file's clean pages (no sudo needed for one's own file)."""
    f.fsync()
    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)


UNREGISTERED = "uring-unreg"  # --fixed-buffers both: the uring engine without registered buffers


def _measure_engine(name: str, args, f, rw: str, size: int, bs: int, qd: int, bufs, progress):
    """One pass of one of our engines; registers ``bufs`` with it unless told not to."""
    import dataclasses

    from offload.io import open_engine
    from offload.io.measure import measure

    engine = "uring" if name == UNREGISTERED else name
    register = name != UNREGISTERED and getattr(args, "fixed_buffers", "auto") != "off"
    with open_engine(engine, queue_depth=qd, block_size=bs, direct=args.direct) as eng:
        handle = eng.register_buffers(bufs) if register else None
        try:
            m, lat = measure(eng, f, rw=rw, nbytes=size, buffers=bufs, progress=progress.advance)
        finally:
            eng.unregister_buffers(handle)
        fixed = eng.stats().get("fixed_pieces", 0)
    m = dataclasses.replace(m, engine=name)
    if fixed:
        m = dataclasses.replace(m, note=(m.note + "; " if m.note else "") + "registered buffers")
    return m, lat


def check_usage(args) -> None:
    """The checks that relate options (``BadUsage``: status 2), before any work."""
    from ._args import distinct_outputs
    from ._outcome import BadUsage

    distinct_outputs([(f"--{flag}", getattr(args, flag, None)) for flag in ("json", "plot", "tune")])

    for bs in args.block_size:
        if bs < 4096 or bs % 4096:  # (the command's parser refuses these; bench/io.py's may not)
            raise BadUsage(f"--block-size must be a multiple of 4096, got {bs}")
        if args.size % bs:
            raise BadUsage(f"--size {args.size} is not a multiple of --block-size {bs}")


def _checked_dir(args) -> str:
    """The directory to measure, after the checks that need no test file."""
    from offload.io import probe_direct

    check_usage(args)
    directory = os.path.abspath(args.dir)
    if not os.path.isdir(directory):  # (an existing file, with errno 2, read as "No such file")
        if os.path.exists(directory):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", directory)
        raise FileNotFoundError(errno.ENOENT, "no such directory", directory)
    ok, why = probe_direct(directory)
    if args.direct and not ok:
        raise OSError(22, f"{why}; measure with --buffered instead", directory)
    # The sweep fills 2 x QD buffers of each block size with random data: --block-size 8M
    # --queue-depth 1024 asks for 16 GiB; past the memory there is, the OOM killer's SIGKILL
    # (no cleanup) would end the run and leave the test file. Refused before the file is made.
    need, avail = 2 * max(args.queue_depth) * max(args.block_size), _mem_available()
    if avail is not None and need > avail:
        raise ValueError(f"--queue-depth {max(args.queue_depth)} x --block-size {_human(max(args.block_size))} "
                         f"needs {need / 2**30:.1f} GiB of buffers (2 x QD blocks), more than the "
                         f"{avail / 2**30:.1f} GiB of memory available")
    return directory


def _mem_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _fio_variants(args) -> List[Tuple[bool, str]]:
    """(huge pages, ioengine) of the fio runs asked for; none without fio on PATH."""
    from offload.io.fio import FIO_HINT, fio_path

    if not args.fio:
        return []
    if fio_path() is None:
        print(f"offload bench-io: --fio: {FIO_HINT}; continuing without fio", file=sys.stderr)
        return []
    return [(False, "io_uring"), (True, "io_uring"), (True, "libaio")]


def _contenders(args, fio_variants, extra) -> List[tuple]:
    engines = list(args.engine)
    if getattr(args, "fixed_buffers", "auto") == "both" and "uring" in engines:
        engines.insert(engines.index("uring") + 1, UNREGISTERED)
    return [("offload", name, None) for name in engines] + \
           [("fio", ioengine, hp) for hp, ioengine in fio_variants] + \
           [("extra", label, None) for label in extra]


def _measure_one(args, contender, f, path: str, rw: str, bs: int, qd: int, bufs, extra, progress, label: str):
    """One pass of one contender: (Measurement, latencies)."""
    from offload.io.fio import run_fio

    tool, name, hp = contender
    if tool == "offload":
        progress.step(f"{name} {label}")
        return _measure_engine(name, args, f, rw, args.size, bs, qd, bufs, progress)
    if tool == "extra":
        progress.step(f"{name} {label}")
        m = extra[name](path, rw=rw, size=args.size, block_size=bs, queue_depth=qd, direct=args.direct)
    else:
        progress.step(f"fio {name}{' +THP' if hp else ''} {label}")
        # No time limit, as for our engines and fio itself: a large --size on a slow disk runs
        # longer than any fixed bound (600 s ended a sweep of 1 TiB at 1 GB/s with a traceback).
        m = run_fio(path, rw=rw, size=args.size, block_size=bs, queue_depth=qd, direct=args.direct, hugepages=hp,
                    ioengine=name, timeout=None)
    progress.advance(args.size)
    return m, []


def _sweep_rw(args, contenders, f, path: str, rw: str, bs: int, qd: int, bufs, extra, progress) -> List[dict]:
    """Every contender, ``--loops`` times, for one direction, block size and queue depth."""
    from offload.io.measure import merge

    parts: Dict[tuple, list] = {}
    for loop in range(args.loops):
        # Rotate the order each loop so no contender is always first (the first after a
        # write pays for the device flushing it).
        k = loop % len(contenders)
        label = f"{rw} bs={_human(bs)} qd={qd} loop {loop + 1}/{args.loops}"
        for contender in contenders[k:] + contenders[:k]:
            if rw == "read" and not args.direct:
                _drop_cache(f)
            try:
                m = _measure_one(args, contender, f, path, rw, bs, qd, bufs, extra, progress, label)
            except RuntimeError as exc:
                if contender[0] != "fio":
                    raise
                # A fio without this ioengine (libaio not built in, io_uring refused by a
                # container's seccomp) ended the whole sweep: drop that variant, as the engines
                # of ours that cannot run here are, and say so.
                print(f"offload bench-io: dropping fio {contender[1]}{' +THP' if contender[2] else ''}: {exc}",
                      file=sys.stderr)
                contenders.remove(contender)
                parts.pop(contender, None)
                continue
            parts.setdefault(contender, []).append(m)
    rows = []
    for ps in parts.values():
        row = merge(ps).as_dict()
        # In the order the loops ran, so ratios can be taken loop by loop.
        row["loop_gbps"] = [m.gbps for m, _ in ps]
        rows.append(row)
    return rows


def sweep(args, extra: Optional[Dict[str, Callable[..., object]]] = None) -> Tuple[List[dict], dict]:
    """Run everything ``args`` asks for; returns (rows as dicts, context).

    ``extra``: more contenders, ``{label: fn(path, rw=, size=, block_size=, queue_depth=,
    direct=) -> Measurement}``, interleaved with the others (bench/io.py adds DeepSpeed's aio).
    """
    extra = extra or {}
    import torch

    from offload.io.measure import window_buffers
    from offload.memory import BufferPool

    directory = _checked_dir(args)
    problem = args.keep and kept_name_problem(directory)
    if problem:
        raise ValueError(problem)
    skipped = _drop_unavailable_engines(args)
    size = args.size
    fio_variants = _fio_variants(args)
    contenders = _contenders(args, fio_variants, extra)
    nconf = len(args.block_size) * len(args.queue_depth) * len(args.rw)
    total = 2 * size + nconf * args.loops * size * (len(args.engine) + len(fio_variants) + len(extra))
    progress = Progress(total)
    path = os.path.join(directory, RUNNING_NAME.format(pid=os.getpid()))
    rows: List[dict] = []
    pool = BufferPool(pin=False, region_bytes=64 << 20)  # disk I/O only (and registered with io_uring)
    f = None
    try:
        f = create_data_file(path, size, args.direct, pool, progress)
        _settle(f, size, pool, progress)
        for bs in args.block_size:
            for qd in args.queue_depth:
                bufs = window_buffers(pool, bs, qd)
                for b in bufs:  # writes carry random data too
                    b.tensor(torch.int64).random_()
                try:
                    for rw in args.rw:
                        rows += _sweep_rw(args, contenders, f, path, rw, bs, qd, bufs, extra, progress)
                finally:
                    for b in bufs:
                        pool.release(b)
        progress.close()
    except BaseException:
        progress.abort()
        path = remove_data_file(f, path, args.keep)
        _close_pool_after_error(pool)
        raise
    path = remove_data_file(f, path, args.keep)
    pool.close()
    _annotate(rows)
    context = {"dir": directory, "size": size, "direct": args.direct, "kept": path if args.keep else None,
               "fio": bool(fio_variants), "skipped_engines": skipped}
    return rows, context


def _close_pool_after_error(pool) -> None:
    """Close the pool while an exception (Ctrl-C, SIGTERM, an I/O error) unwinds the sweep.
    Its traceback's frames still hold views of the buffers, so close() refuses the regions they
    map; that BufferError must not replace the exception that says what happened (Ctrl-C was
    a BufferError traceback and exit 1, not "interrupted" and 130). The pool unmaps them when
    it is collected after the views, or the process exits."""
    try:
        pool.close()
    except BufferError as exc:
        log.debug("bench-io buffers still viewed while unwinding: %s", exc)


def _drop_unavailable_engines(args) -> Dict[str, str]:
    """Take the engines that cannot run here out of ``args.engine``, each said on stderr (as the
    sweep's ``skipped_engines``): a sweep measures what runs here, as fio lists an ioengine it
    lacks and goes on. Nothing left to measure of ours is an error saying why."""
    from offload.io import engine_unavailable_reason

    skipped: Dict[str, str] = {}
    for name in args.engine:
        why = engine_unavailable_reason(name)
        if why is not None:
            skipped[name] = why
    if skipped and len(skipped) == len(args.engine):
        raise RuntimeError("none of the engines asked for can run here: "
                           + "; ".join(f"{n}: {w}" for n, w in skipped.items()))
    for name, why in skipped.items():
        print(f"offload bench-io: skipping engine {name}: {why}", file=sys.stderr)
    args.engine = [n for n in args.engine if n not in skipped]
    return skipped


def _annotate(rows: List[dict]) -> None:
    """Add ``vs_fio`` (ours / best fio of the same rw, block size, queue depth, direct) and cache flags."""
    best_fio: Dict[tuple, float] = {}
    for r in rows:
        if r["tool"] == "fio":
            k = (r["rw"], r["block_size"], r["queue_depth"], r["direct"])
            best_fio[k] = max(best_fio.get(k, 0.0), r["gbps"])
    best_direct_read = max((r["gbps"] for r in rows if r["rw"] == "read" and r["direct"]), default=None)
    for r in rows:
        k = (r["rw"], r["block_size"], r["queue_depth"], r["direct"])
        r["vs_fio"] = r["gbps"] / best_fio[k] if r["tool"] != "fio" and best_fio.get(k) else None
        if r["rw"] == "read" and not r["direct"] and best_direct_read and r["gbps"] > 1.5 * best_direct_read:
            r["note"] = (r["note"] + " " if r["note"] else "") + "probably cached"


def best_rows(rows: Sequence[dict]) -> Dict[str, dict]:
    """Fastest offload row per direction."""
    out: Dict[str, dict] = {}
    for r in rows:
        if r["tool"] == "offload" and (r["rw"] not in out or r["gbps"] > out[r["rw"]]["gbps"]):
            out[r["rw"]] = r
    return out


def best_config(rows: Sequence[dict]):
    """The configuration for the swap layer: best harmonic mean of read and write GB/s (swap does
    both every step); with one direction measured, the best of that one."""
    from offload.config import IOConfig

    by: Dict[tuple, Dict[str, float]] = {}
    for r in rows:
        # uring-unreg is uring measured without registered buffers, which the engine uses
        # whenever it can: a comparison row, not a configuration
        if r["tool"] == "offload" and r["engine"] != UNREGISTERED:
            by.setdefault((r["engine"], r["block_size"], r["queue_depth"], r["direct"]), {})[r["rw"]] = r["gbps"]
    if not by:
        raise ValueError("no offload rows to tune from")

    def score(v: Dict[str, float]) -> float:
        vals = list(v.values())
        return len(vals) / sum(1 / max(x, 1e-12) for x in vals)

    full = {k: v for k, v in by.items() if len(v) == 2} or by
    key = max(full, key=lambda k: score(full[k]))
    eng, bs, qd, direct = key
    return IOConfig(engine=eng, queue_depth=qd, block_size=bs, direct=direct), full[key]


def run(args) -> int:
    from ._signals import sigterm_raises

    with sigterm_raises():  # SIGTERM removes the test file too, as Ctrl-C does
        return _run(args)


def _run(args) -> int:
    from offload.io import save_tuning

    check_usage(args)
    check_outputs(args)
    rows, ctx = sweep(args)
    print(f"offload bench-io: {ctx['dir']}, file {_human(ctx['size'])}, "
          f"{'O_DIRECT' if ctx['direct'] else 'buffered'}, loops {args.loops}")
    print(format_table(rows))
    for rw, r in sorted(best_rows(rows).items()):
        vs = f" ({r['vs_fio']:.2f}x best fio)" if r.get("vs_fio") else ""
        print(f"best {rw}: {r['engine']} bs={_human(r['block_size'])} qd={r['queue_depth']} "
              f"{r['gbps']:.2f} GB/s{vs}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
        print(f"rows written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    if args.tune:
        cfg, measured = best_config(rows)
        save_tuning(args.tune, cfg, read_gbps=measured.get("read"), write_gbps=measured.get("write"),
                    directory=ctx["dir"])
        print(f"tuning written to {args.tune}: engine={cfg.engine} block_size={cfg.block_size} "
              f"queue_depth={cfg.queue_depth} direct={cfg.direct}")
    return 0
