"""Running fio with the parameters of a measured row, for side-by-side ratios.

fio is the reference every disk claim is checked against. ``hugepages=True`` runs it with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` so that its malloc'ed I/O buffers get transparent
huge pages like our pool's do (on our virtio disk that alone doubles read throughput, because
contiguous buffers let the block layer merge requests); the best fio variant is the bar.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Optional

from .measure import Measurement

__all__ = ["fio_path", "FIO_HINT", "run_fio"]

FIO_HINT = ("fio is not installed: `apt-get install fio` (Debian/Ubuntu), `dnf install fio` (Fedora), "
            "or see https://github.com/axboe/fio")


def fio_path() -> Optional[str]:
    return shutil.which("fio")


def run_fio(path: str, *, rw: str, size: int, block_size: int, queue_depth: int, direct: bool, loops: int = 1,
            hugepages: bool = False, ioengine: str = "io_uring", timeout: Optional[float] = 600.0) -> Measurement:
    """One fio job over ``size`` bytes of the existing file ``path``; raises RuntimeError on failure
    (a run past ``timeout`` seconds too; None: no limit)."""
    exe = fio_path()
    if exe is None:
        raise RuntimeError(FIO_HINT)
    cmd = [exe, "--name=offload-bench-io", f"--filename={path}", f"--size={size}", f"--rw={rw}",
           f"--bs={block_size}", f"--iodepth={queue_depth}", f"--ioengine={ioengine}", f"--direct={int(direct)}",
           f"--loops={loops}", "--lat_percentiles=1", "--percentile_list=50:99:99.9", "--output-format=json"]
    env = dict(os.environ)
    if hugepages:
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    if not direct and rw == "read":
        # Buffered reads would be served from the page cache fio itself just filled.
        cmd.append("--invalidate=1")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        # subprocess.run killed fio; a SubprocessError is none of the errors callers (the CLI) report
        raise RuntimeError(f"fio ran past its {timeout:g} s limit and was stopped: {' '.join(cmd)}") from None
    if r.returncode != 0:
        raise RuntimeError(f"fio failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr.strip()[-2000:]}")
    out = r.stdout[r.stdout.find("{"):]
    job = json.loads(out)["jobs"][0]
    side = job[rw]
    nbytes = int(side["io_bytes"])
    # bw_bytes is fio's own bytes/second (runtime is rounded to whole milliseconds).
    bw = float(side["bw_bytes"]) or nbytes / max(side["runtime"] / 1e3, 1e-9)
    seconds = nbytes / bw if bw else 0.0
    pct = (side.get("lat_ns") or {}).get("percentile") or side["clat_ns"].get("percentile", {})

    def p(key: str) -> float:
        return float(pct.get(key, 0.0)) / 1e3

    return Measurement(
        tool="fio", engine=ioengine, rw=rw, block_size=block_size, queue_depth=queue_depth, direct=direct,
        bytes=nbytes, seconds=seconds, gbps=bw / 1e9, gibps=bw / 2 ** 30, iops=float(side["iops"]),
        lat_p50_us=p("50.000000"), lat_p99_us=p("99.000000"), lat_p999_us=p("99.900000"),
        cpu_usr_pct=float(job["usr_cpu"]), cpu_sys_pct=float(job["sys_cpu"]), loops=loops, hugepages=hugepages,
        note="GLIBC_TUNABLES=glibc.malloc.hugetlb=1" if hugepages else "")
