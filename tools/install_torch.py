#!/usr/bin/env python3
"""Install torch for ``make setup`` without pulling a CUDA build onto a machine without a GPU.

    python tools/install_torch.py 'torch==2.13.0'      # the Makefile's $(TORCH)

pip's choice for ``torch==2.13.0`` depends on the Python: where a CPU wheel of that release
lies in pip's sources (this machine kind keeps ``torch-2.13.0+cpu`` for CPython 3.11 in
``/opt/wheels``), ``2.13.0+cpu`` sorts above PyPI's ``2.13.0`` and wins; for any other Python
(3.12, say) PyPI's wheel wins, and on Linux x86_64 that is the CUDA build: ~5 GB of nvidia-*
and cuda-* packages, of no use without a GPU. So, on a machine without an NVIDIA GPU, this
asks pip first (``--dry-run --report``) which build it would take; a CUDA one is replaced by
the same release from PyTorch's CPU index, and where that index cannot be reached the set-up
stops, saying how to go on, instead of downloading the CUDA build. On a machine with a GPU,
or with ``OFFLOAD_CUDA_TORCH=1``, pip installs what it picks, as before. Standard library
only: it runs before anything else is installed.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ALLOW_ENV = "OFFLOAD_CUDA_TORCH"


def has_nvidia_gpu() -> bool:
    """The NVIDIA kernel driver is loaded, or a device node exists (a container given a GPU)."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def _name(requirement: str) -> str:
    """The distribution name of a requirement string ('nvidia-nccl-cu13==2.29.7; marker')."""
    end = len(requirement)
    for ch in " ;<>=!~[(":
        at = requirement.find(ch)
        if at != -1:
            end = min(end, at)
    return requirement[:end].strip().lower().replace("_", "-")


def is_cuda_build(metadata: Dict[str, Any]) -> bool:
    """Whether a torch wheel's metadata (pip's install report) is a CUDA build: a ``+cuXXX``
    local version, or nvidia-* / cuda-* packages among its requirements (PyPI's Linux wheels
    carry no local version but require the CUDA runtime's packages)."""
    if "+cu" in str(metadata.get("version", "")):
        return True
    return any(_name(r).startswith(("nvidia-", "cuda-")) for r in metadata.get("requires_dist") or [])


def _pip(args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args])


def planned_torch(spec: str) -> Optional[Dict[str, Any]]:
    """The metadata of the torch wheel pip would install for ``spec``; None when torch already
    satisfies it (nothing to install) or when pip cannot say (its own install then reports why)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet",
                               "--report", report, spec], stdout=subprocess.DEVNULL)
        if done.returncode != 0 or not os.path.exists(report):
            return None
        with open(report) as f:
            items = json.load(f).get("install", [])
    for item in items:
        meta = item.get("metadata", {})
        if _name(meta.get("name", "")) == "torch":
            return meta
    return None


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    spec = argv[0]
    if os.environ.get(ALLOW_ENV) != "1" and not has_nvidia_gpu():
        meta = planned_torch(spec)
        if meta is not None and is_cuda_build(meta):
            print(f"install_torch: pip would take torch {meta.get('version')}, a CUDA build (several GB), and "
                  f"this machine has no NVIDIA GPU: trying {CPU_INDEX}", file=sys.stderr)
            cpu = _pip(["install", "--quiet", "--no-deps", "--retries", "1", "--timeout", "30",
                        "--index-url", CPU_INDEX, spec])
            if cpu.returncode != 0:
                py = f"{sys.version_info.major}.{sys.version_info.minor}"
                print(f"install_torch: no CPU build of {spec} for Python {py} in pip's sources or at {CPU_INDEX}, "
                      f"and the set-up does not download the CUDA build onto a machine without a GPU. Either "
                      f"install a CPU build into this environment yourself ({sys.executable} -m pip install "
                      f"'{spec}' --index-url {CPU_INDEX}) and run make again, "
                      f"use the Python the CPU wheel is for (rm -r {sys.prefix}, then make PYTHON=python3.11 ...), or "
                      f"take the CUDA build anyway with {ALLOW_ENV}=1.", file=sys.stderr)
                return 1
    # torch's own requirements (and torch itself where the CPU build above did not install it)
    return _pip(["install", "--quiet", spec]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
