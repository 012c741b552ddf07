"""Fixtures shared by the io tests (test_io.py, test_io_fixed.py)."""
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
