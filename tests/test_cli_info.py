"""``offload info``: the report a user pastes into a bug report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from offload.cli import main
from offload.kernels import backend_status


def test_info_json_reports_backends_isa_and_machine(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__
    assert set(info["backends"]) == {"native", "numba", "torch"}
    for name, (ok, _reason) in backend_status().items():
        assert info["backends"][name]["available"] == ok
    assert info["backends"]["torch"]["available"] is True
    assert info["cuda"]["available"] == torch.cuda.is_available()
    assert info["isa_supported"] and info["isa_supported"][0] == "scalar"
    assert info["transparent_hugepage"]
    assert "io" in info and info["ulimit_memlock"]


def test_info_table_and_forced_backend_in_a_fresh_process():
    env = dict(os.environ, OFFLOAD_BACKEND="torch")
    out = subprocess.run([sys.executable, "-m", "offload", "info"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kernel backend" in out.stdout and "torch" in out.stdout
    assert "transparent huge pages" in out.stdout


def test_info_reports_a_bad_isa_request_instead_of_failing():
    env = dict(os.environ, OFFLOAD_ISA="bogus")
    out = subprocess.run([sys.executable, "-m", "offload", "info", "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert "bogus" in info["isa_selected"]


def test_info_shows_the_prefetch_setting_and_a_bad_one(capsys, monkeypatch):
    if not backend_status()["native"][0]:
        return  # (no native library: nothing to prefetch; the line says why)
    for raw, want in (("", "auto"), ("off", "off"), ("on_", "unavailable (OFFLOAD_PREFETCH='on_'")):
        monkeypatch.setenv("OFFLOAD_PREFETCH", raw)
        assert main(["info", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["prefetch"].startswith(want), raw


def test_info_shows_the_thread_pool_and_a_bad_setting(capsys, monkeypatch):
    if not backend_status()["native"][0]:
        return  # (no native library: the line says why)
    for raw, want in (("", "auto (the OpenMP pool torch runs on; a call on more threads than the"), ("own", "own"),
                      ("omp", "unavailable (OFFLOAD_POOL='omp'")):
        monkeypatch.setenv("OFFLOAD_POOL", raw)
        assert main(["info", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["thread_pool"].startswith(want), raw
