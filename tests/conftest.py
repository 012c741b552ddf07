"""Fixtures shared by the io tests (test_io.py, test_io_fixed.py), and which modules the
``OFFLOAD_BACKEND=numba`` pass of ``make test`` leaves to the native pass."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

from offload.io import probe_direct


@pytest.fixture
def workdir(tmp_path):
    """A directory that accepts O_DIRECT: tmp_path, else one under /var/tmp (tmp_path may be
    a tmpfs that refuses it on kernels before 6.6)."""
    ok, why = probe_direct(tmp_path)
    if ok:
        yield tmp_path
        return
    if os.path.isdir("/var/tmp") and probe_direct("/var/tmp")[0]:
        d = tempfile.mkdtemp(prefix="offload-test-io-", dir="/var/tmp")
        yield pathlib.Path(d)
        shutil.rmtree(d, ignore_errors=True)
        return
    pytest.skip(f"{tmp_path} refuses O_DIRECT ({why}) and so does /var/tmp; these tests exercise the direct path")


# These modules run no optimizer kernel (io engines, the planner and its CLI, the step log,
# swap files stepped with a compute they are given, the wheel, the code's shape, the README's
# commands), so the second pass of `make test` (OFFLOAD_BACKEND=numba, which exists to run the
# kernels' fallback through everything that steps) would only repeat them: they run once, in
# the native pass, and keep the two passes within the suite's time budget.
_NO_KERNEL = {
    "test_bench_io", "test_cli_numeric", "test_code_shape", "test_io", "test_io_fixed", "test_memory",
    "test_plan", "test_plan_slots", "test_readme", "test_report_cli", "test_report_robust",
    "test_swap_clean", "test_swap_pipeline", "test_swap_store", "test_wheel",
    "test_agreement", "test_swap_session", "test_state_fields", "test_step_context", "test_report_append",
    "test_kernel_bits",
}


def pytest_collection_modifyitems(config, items):
    if os.environ.get("OFFLOAD_BACKEND", "").strip().lower() != "numba":
        return
    skip = pytest.mark.skip(reason="runs no kernel: covered by the native pass of `make test`")
    for item in items:
        if pathlib.Path(str(item.fspath)).stem in _NO_KERNEL:
            item.add_marker(skip)
