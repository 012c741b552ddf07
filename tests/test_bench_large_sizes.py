"""bench/large_sizes.py (the checks of sizes past 32 bits, run by hand at n = 2**31 + 17 and
4 GiB requests; bench/RESULTS.md) at a tiny size, so the script keeps running: every check
it makes (kernels, compressed, io, nvme, host) reports "ok" (or an engine "skipped") and the
files it made are gone."""
from __future__ import annotations

import os

from test_bench_scripts import run_script


def test_large_sizes_script_runs_small(tmp_path):
    work = tmp_path / "big"
    proc = run_script("large_sizes.py", "--dir", str(work), "--n", "70001", "--io-bytes", str(17 * 4096),
                      "--state-dtype", "int8", "kernels", "compressed", "io", "nvme", "host", timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 10, proc.stdout
    assert all(" ok " in line or " skipped: " in line for line in lines), proc.stdout
    assert sum(" ok " in line for line in lines) >= 8  # the threads and aiofiles engines always run
    assert os.listdir(work) == []
