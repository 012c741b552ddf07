"""The native build's object cache (``OFFLOAD_NATIVE_CACHE``, [Note: native object cache] in
setup.py): a build of the same sources with the same compiler links the cached objects and
compiles nothing; a changed source or compiler compiles again; a cache that cannot be used
never fails the build.

``setup.py build_ext`` runs in a copy of the build's files with a stand-in compiler (a script
that logs its calls and writes an "object" derived from its source), so each build takes a
second, not the minute of the real units; the real compiler's use of the cache is what
``make test``'s wheel test does (tests/test_wheel.py).
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_CXX = """#!/bin/bash
echo "$*" >> "$FAKE_LOG"
if [ "$1" = --version ]; then echo "fake c++ $FAKE_VERSION"; exit 0; fi
out=""; src=""; shared=0; objs=()
while [ $# -gt 0 ]; do
  case "$1" in -o) out=$2; shift;; -c) src=$2; shift;; -shared) shared=1;; *.o) objs+=("$1");; esac
  shift
done
if [ $shared = 1 ]; then cat "${objs[@]}" > "$out"
else { echo "object of $(basename "$src") $FAKE_VERSION"; sha256sum < "$src"; } > "$out"; fi
"""


@pytest.fixture
def tree(tmp_path):
    """setup.py, its metadata and native/ (the digest's input), and the stand-in compiler."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "native"), src / "native")
    (src / "offload").mkdir()
    (src / "offload" / "__init__.py").write_text("")
    shutil.copy2(os.path.join(ROOT, "offload", "_version.py"), src / "offload" / "_version.py")
    cxx = tmp_path / "fake-c++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    return src


def _build(tree, tmp_path, out, cache, version="1"):
    log = tmp_path / "calls.log"
    log.write_text("")
    env = dict(os.environ, CXX=str(tmp_path / "fake-c++"), FAKE_LOG=str(log), FAKE_VERSION=version)
    env.pop("OFFLOAD_NATIVE_CACHE", None)
    if cache is not None:
        env["OFFLOAD_NATIVE_CACHE"] = str(cache)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / out)],
                          cwd=str(tree), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kernels = tmp_path / out / "offload" / "kernels"
    assert not (kernels / "native_build_error.txt").exists(), (kernels / "native_build_error.txt").read_text()
    compiles = [line for line in log.read_text().splitlines() if " -c " in f" {line} "]
    return (kernels / "liboffload_native.so").read_bytes(), len(compiles)


def _units() -> int:
    with open(os.path.join(ROOT, "setup.py")) as f:
        return f.read().count('.cpp": [')  # setup.py's UNITS table, one line per unit


def test_a_second_build_of_the_same_sources_compiles_nothing_and_links_the_same_library(tree, tmp_path):
    cache = tmp_path / "cache"
    first, compiled = _build(tree, tmp_path, "b1", cache)
    units = _units()
    assert compiled == units >= 5
    assert len(list(cache.glob("*.o"))) == units
    again, compiled = _build(tree, tmp_path, "b2", cache)
    assert compiled == 0
    assert again == first


def test_a_changed_header_or_compiler_compiles_every_unit_again(tree, tmp_path):
    cache = tmp_path / "cache"
    first, _ = _build(tree, tmp_path, "b1", cache)
    units = _units()
    other_compiler, compiled = _build(tree, tmp_path, "b2", cache, version="2")
    assert compiled == units and other_compiler != first
    with open(tree / "native" / "kernel.h", "a") as f:
        f.write("\n// changed\n")
    _, compiled = _build(tree, tmp_path, "b3", cache, version="2")
    assert compiled == units  # a header no unit's own digest names: every unit again
    # only the last build's objects are kept
    assert len(list(cache.glob("*.o"))) == units


def test_without_the_variable_nothing_is_cached(tree, tmp_path):
    _, compiled = _build(tree, tmp_path, "b1", None)
    _, again = _build(tree, tmp_path, "b2", None)
    assert compiled == again == _units()


def test_a_cache_that_cannot_be_written_only_costs_the_compile(tree, tmp_path):
    if os.geteuid() == 0:
        cache = tmp_path / "a-file"  # root writes anywhere: a file where the folder should be
        cache.write_text("")
    else:
        cache = tmp_path / "ro"
        cache.mkdir()
        cache.chmod(0o500)
    first, compiled = _build(tree, tmp_path, "b1", cache)
    again, compiled_again = _build(tree, tmp_path, "b2", cache)
    assert compiled == compiled_again == _units() and again == first
