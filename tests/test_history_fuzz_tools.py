"""tools/history_fuzz.py and tools/history_fuzz_ranks.py (the differential fuzzers over training
histories, run by hand for thousands of seeds: bench/RESULTS.md, forty-eighth session) on a
few seeds, so they keep running as the library changes: each passes its seeds, in a scratch
directory it makes itself, and reports the count."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fuzz(script, seeds, tmp_path):
    scratch = tmp_path / "scratch"  # (not made here: the fuzzer makes a missing one)
    env = {**os.environ, "FUZZ_SCRATCH": str(scratch), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", script), "--seeds", seeds],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_history_fuzz_passes_a_few_seeds(tmp_path):
    assert "3 seeds, 0 failed" in _fuzz("history_fuzz.py", "0:3", tmp_path)


def test_history_fuzz_ranks_passes_a_few_seeds(tmp_path):
    assert "2 seeds, 0 failed" in _fuzz("history_fuzz_ranks.py", "0:2", tmp_path)
