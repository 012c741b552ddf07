"""The native build's object cache (``OFFLOAD_NATIVE_CACHE``, [Note: native object cache] in
setup.py): a build of the same sources with the same compiler links the cached objects and
compiles nothing; a changed source or compiler compiles again; a cache that cannot be used
never fails the build; a damaged entry (empty, truncated, a byte changed, a link in its place)
is evicted and its unit compiled; a link that fails with cached objects is retried with every
unit compiled.

``setup.py build_ext`` runs in a copy of the build's files with a stand-in compiler (a script
that logs its calls and writes an "object" derived from its source), so each build takes a
second, not the minute of the real units; the real compiler's use of the cache is what
``make test``'s wheel test does (tests/test_wheel.py).
"""
from __future__ import annotations

import hashlib
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
if [ $shared = 1 ]; then
  for o in "${objs[@]}"; do grep -q "^object of" "$o" || { echo "$o: file format not recognized" >&2; exit 1; }; done
  cat "${objs[@]}" > "$out"
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


def _build(tree, tmp_path, out, cache, version="1", stderr=None):
    """The library built and the number of units compiled; ``stderr`` (a list) gets the
    build's messages."""
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
    if stderr is not None:
        stderr.append(proc.stderr)
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


def _entry(cache, unit):
    """``unit``'s cached object (the stand-in's objects name their source)."""
    found = [p for p in cache.glob("*.o") if p.read_bytes().startswith(f"object of {unit} ".encode())]
    assert len(found) == 1, found
    return found[0]


def _forge(entry, data: bytes):
    """Replace ``entry`` with ``data`` under a name whose integrity record matches it, where
    the name carries one (``<key>-<size>-<sha256>.o``): an entry sound to every check that
    the cache can make, yet not an object."""
    key = entry.name.split("-")[0].split(".")[0]
    entry.unlink()
    name = f"{key}-{len(data)}-{hashlib.sha256(data).hexdigest()}.o" if "-" in entry.name else entry.name
    (entry.parent / name).write_bytes(data)


def _damage(entry, how, tmp_path):
    if how == "empty":
        entry.write_bytes(b"")
    elif how == "truncated":
        entry.write_bytes(entry.read_bytes()[:20])
    elif how == "flipped byte":  # the last byte of the source's hash: still an "object"
        data = bytearray(entry.read_bytes())
        data[-2] ^= 0x01
        entry.write_bytes(bytes(data))
    elif how == "symlink to another unit's object":
        other = tmp_path / "elsewhere.o"
        shutil.copy(_entry(entry.parent, "machine.cpp"), other)
        entry.unlink()
        entry.symlink_to(other)
    elif how == "symlink to /dev/zero":  # a reader that follows it never ends
        entry.unlink()
        entry.symlink_to("/dev/zero")


@pytest.mark.parametrize("how", ["empty", "truncated", "flipped byte", "symlink to another unit's object",
                                 "symlink to /dev/zero"])
def test_a_damaged_entry_is_evicted_and_its_unit_compiled(tree, tmp_path, how):
    cache = tmp_path / "cache"
    first, _ = _build(tree, tmp_path, "b1", cache)
    _damage(_entry(cache, "adam_avx2.cpp"), how, tmp_path)
    stderr = []
    again, compiled = _build(tree, tmp_path, "b2", cache, stderr=stderr)
    assert compiled == 1 and again == first
    said = [line for line in stderr[0].splitlines() if "not used" in line]
    assert len(said) == 1 and said[0].startswith("adam_avx2.cpp.o: "), stderr[0][-2000:]
    # the unit's sound object replaced the damaged entry: the next build compiles nothing
    third, compiled = _build(tree, tmp_path, "b3", cache)
    assert compiled == 0 and third == first
    assert len(list(cache.glob("*.o"))) == _units()


def test_a_link_that_fails_with_cached_objects_is_retried_with_every_unit_compiled(tree, tmp_path):
    cache = tmp_path / "cache"
    first, _ = _build(tree, tmp_path, "b1", cache)
    _forge(_entry(cache, "adam_avx2.cpp"), b"passes every check, links nowhere\n")
    stderr = []
    again, compiled = _build(tree, tmp_path, "b2", cache, stderr=stderr)
    assert compiled == _units() and again == first
    assert "compiling every unit fresh" in stderr[0]
    third, compiled = _build(tree, tmp_path, "b3", cache)
    assert compiled == 0 and third == first


def test_an_interrupted_store_leaves_no_entry_and_old_leftovers_go(tree, tmp_path):
    cache = tmp_path / "cache"
    first, _ = _build(tree, tmp_path, "b1", cache)
    entry = _entry(cache, "adam_avx2.cpp")
    stale, recent = cache / f".{entry.name[:64]}.1.tmp", cache / f".{entry.name[:64]}.2.tmp"
    stale.write_bytes(entry.read_bytes()[:10])  # what a build killed mid-store leaves
    recent.write_bytes(b"")  # a build beside, storing right now
    os.utime(stale, (0, 0))
    entry.unlink()
    again, compiled = _build(tree, tmp_path, "b2", cache)
    assert compiled == 1 and again == first
    assert not stale.exists() and recent.exists()
