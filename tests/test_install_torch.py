"""tools/install_torch.py (make setup): no CUDA build of torch onto a machine without a GPU.

Python 3.12 on this machine kind made `make setup` install torch 2.13.0 from PyPI, the CUDA
build (a 5.2 GB environment), because the local CPU wheel is for CPython 3.11 only.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "install_torch.py")
_spec = importlib.util.spec_from_file_location("install_torch", _PATH)
install_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install_torch)

# requires_dist of PyPI's torch 2.13.0 Linux wheel (pip's --report, abridged) and of the CPU wheel
PYPI_CUDA = {"name": "torch", "version": "2.13.0", "requires_dist": [
    "filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3",
    'cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
    'pyyaml; extra == "pyyaml"']}
LOCAL_CPU = {"name": "torch", "version": "2.13.0+cpu", "requires_dist": [
    "filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3", 'pyyaml; extra == "pyyaml"']}


@pytest.mark.parametrize("meta,cuda", [
    (PYPI_CUDA, True),
    (LOCAL_CPU, False),
    ({"name": "torch", "version": "2.13.0+cu130", "requires_dist": []}, True),
    ({"name": "torch", "version": "2.13.0", "requires_dist": ["NVIDIA_nccl_cu12>=2"]}, True),
    ({"name": "torch", "version": "2.13.0", "requires_dist": None}, False),
])
def test_cuda_builds_are_told_from_cpu_ones(meta, cuda):
    assert install_torch.is_cuda_build(meta) is cuda


def _run(monkeypatch, *, gpu, plan, cpu_index_rc=0, allow=None):
    calls = []

    def pip(args):
        calls.append(args)

        class Done:
            returncode = cpu_index_rc if "--index-url" in args else 0
        return Done()

    monkeypatch.setattr(install_torch, "_pip", pip)
    monkeypatch.setattr(install_torch, "has_nvidia_gpu", lambda: gpu)
    monkeypatch.setattr(install_torch, "planned_torch", lambda spec: plan)
    if allow is None:
        monkeypatch.delenv(install_torch.ALLOW_ENV, raising=False)
    else:
        monkeypatch.setenv(install_torch.ALLOW_ENV, allow)
    return install_torch.main(["torch==2.13.0"]), calls


def test_without_a_gpu_a_cuda_plan_takes_the_cpu_index_then_the_requirements(monkeypatch):
    rc, calls = _run(monkeypatch, gpu=False, plan=PYPI_CUDA)
    assert rc == 0 and len(calls) == 2
    assert calls[0][calls[0].index("--index-url") + 1] == install_torch.CPU_INDEX and "--no-deps" in calls[0]
    assert "--index-url" not in calls[1]  # torch's own requirements, torch itself already there


def test_without_a_gpu_and_no_cpu_build_the_setup_stops_before_any_cuda_download(monkeypatch, capsys):
    rc, calls = _run(monkeypatch, gpu=False, plan=PYPI_CUDA, cpu_index_rc=1)
    assert rc == 1 and len(calls) == 1 and "--index-url" in calls[0]
    err = capsys.readouterr().err
    assert "no CPU build of torch==2.13.0" in err and install_torch.ALLOW_ENV in err


@pytest.mark.parametrize("gpu,plan,allow", [
    (False, LOCAL_CPU, None),  # the local CPU wheel: installed as before
    (False, None, None),       # torch already there, or pip cannot say (its install then says why)
    (True, PYPI_CUDA, None),   # a GPU machine takes the CUDA build
    (False, PYPI_CUDA, "1"),   # asked for
])
def test_otherwise_pip_installs_what_it_picks(monkeypatch, gpu, plan, allow):
    rc, calls = _run(monkeypatch, gpu=gpu, plan=plan, allow=allow)
    assert rc == 0 and calls == [["install", "--quiet", "torch==2.13.0"]]


def test_requirement_names():
    assert install_torch._name('nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"') == "nvidia-cudnn-cu13"
    assert install_torch._name("cuda-toolkit[cublas]==13.0.3") == "cuda-toolkit"
    assert install_torch._name("Typing_Extensions (>=4)") == "typing-extensions"
