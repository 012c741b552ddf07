"""Without a working C++ compiler the build still succeeds and keeps the compiler's reason.

``setup.py build_ext`` is what ``pip install`` runs; here it runs with a compiler that is
missing and with one that fails, into a scratch build directory, so the checkout's own
library is untouched.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("cxx, expect", [
    ("/nonexistent/c++", "no C++ compiler"),
    ("false", "exit status 1"),
])
def test_build_without_a_working_compiler_succeeds_and_says_why(tmp_path, cxx, expect):
    env = dict(os.environ, CXX=cxx)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kernels = tmp_path / "offload" / "kernels"
    assert not (kernels / "liboffload_native.so").exists()
    reason = (kernels / "native_build_error.txt").read_text()
    assert expect in reason
    assert "numba will serve" in proc.stderr
