"""`pip wheel .` gives one py3-none-manylinux wheel that runs the native kernels with no
compiler on the target machine (issue 17, s.5)."""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "native", "offload")

pytestmark = pytest.mark.slow


def _copy_sources(dst):
    # Built from a copy: `pip wheel .` writes build/ and *.egg-info into the tree it builds,
    # and the tree's own liboffload_native.so must not stand in for the one the build makes.
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "native_build_error.txt", "*.egg-info")
    for name in SOURCES:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, name), ignore=ignore)
        else:
            shutil.copy2(src, dst)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if shutil.which(os.environ.get("CXX", "c++").split()[0]) is None:
        pytest.skip("no C++ compiler here to build the wheel's native library")
    src = tmp_path_factory.mktemp("src")
    out = tmp_path_factory.mktemp("dist")
    _copy_sources(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(src), "-w", str(out)], check=True, cwd=str(src), timeout=300)
    (whl,) = out.glob("*.whl")
    return whl


def _glibc_floor(data: bytes):
    return max((int(a), int(b)) for a, b in re.findall(rb"GLIBC_(\d+)\.(\d+)", data))


def test_wheel_tag_is_python_and_abi_independent(wheel):
    with zipfile.ZipFile(wheel) as z:
        lib = z.read("offload/kernels/liboffload_native.so")
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
    major, minor = _glibc_floor(lib)
    machine = sysconfig.get_platform().split("-", 1)[1]
    tag = f"py3-none-manylinux_{major}_{minor}_{machine}"
    assert wheel.name.endswith(f"-{tag}.whl"), wheel.name
    assert f"Tag: {tag}\n" in meta
    # No Python ABI in the library: it links no libpython and calls no Py* function.
    assert b"libpython" not in lib and not re.search(rb"\bPy[A-Z][A-Za-z]+_[A-Za-z]", lib)


def _fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # torch, numpy, numba from this venv, after the fresh venv's own site-packages: a plain
    # path line (no `import`), so this venv's .pth files (an editable offload) are not run.
    here = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site, "zz_host_packages.pth"), "w") as f:
        f.write(here + "\n")
    return venv, py


def test_wheel_installs_and_runs_native_without_a_compiler(wheel, tmp_path):
    venv, py = _fresh_venv(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=120)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CXX", "CC", "OFFLOAD_BACKEND")}
    env["PATH"] = str(empty)  # no c++, cc or g++ to fall back on
    probe = ("import offload, offload.kernels as k, torch; "
             "assert offload.__file__.startswith(%r), offload.__file__; "
             "b = k.get_backend('native'); p = torch.zeros(5, requires_grad=True); p.grad = torch.ones(5); "
             "offload.AdamW([p], lr=0.1, weight_decay=0.0, backend='native').step(); "
             "assert torch.allclose(p.detach(), torch.full((5,), -0.1)), p; print(b.name)") % str(venv)
    run = subprocess.run([str(py), "-c", probe], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "native"
    info = subprocess.run([str(venv / "bin" / "offload"), "info", "--json"], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    report = json.loads(info.stdout)
    assert report["backend_selected"] == "native" and report["backends"]["native"]["available"]
