"""Builds the native kernels (``native/``) into ``offload/kernels/liboffload_native.so``.

The library is a plain ``extern "C"`` shared object loaded with ctypes: it links neither
libtorch nor the Python C API, so one binary serves every Python. Each instruction set is its
own translation unit compiled with its own flags and chosen at run time; nothing installed is
built with ``-march=native``.

A missing or failing compiler does not fail the install: the compiler's message is written
to ``offload/kernels/native_build_error.txt`` and the native backend raises it when asked
for, while the numba backend serves.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from typing import Iterable

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE = os.path.join(HERE, "native")
LIB_NAME = "liboffload_native.so"
ERROR_NAME = "native_build_error.txt"

# Translation unit -> its own flags. Only these files see wider instruction sets.
# -ffp-contract=off: every FMA in the kernels is an explicit fmadd intrinsic ([Note: explicit
# FMAs] in native/avx512_adam.h). GCC's default for C++ (fast) may fuse a multiply and an add
# the code keeps apart (intrinsics are vector arithmetic to it), and the bits then depend on
# how a function was inlined: the fused int8 tile (q8_avx512vbmi.cpp) came out 1 ulp off the
# tile path in the param that way.
COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden", "-Wall"]
UNITS = {
    "dispatch.cpp": [],
    "machine.cpp": [],
    "uring_ring.cpp": [],
    "adam_scalar.cpp": [],
    "adam_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "adam_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "q8_avx512vbmi.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi",
                          "-mfma", "-mf16c"],
}


def compile_native(out_dir: str) -> "str | None":
    """Compile and link the library into ``out_dir``; returns an error text or None."""
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    if shutil.which(cxx[0]) is None:
        return f"no C++ compiler: {cxx[0]!r} not found on PATH (set CXX, or install g++)"
    for unit in UNITS:
        if not os.path.exists(os.path.join(NATIVE, unit)):
            return f"missing native source {os.path.join(NATIVE, unit)}"
    os.makedirs(out_dir, exist_ok=True)
    cache = ObjectCache.from_env(cxx)
    # Link next to the target, then rename over it: an atomic replace, so a process that has
    # the old library mapped keeps it intact (a copy over it, which shutil.move does across
    # file systems, would rewrite the pages under a running process).
    tmp_lib = os.path.join(out_dir, f".{LIB_NAME}.{os.getpid()}.tmp")
    with tempfile.TemporaryDirectory() as tmp:
        link = cxx + ["-shared", "-o", tmp_lib]
        objects, fresh, err = _compile_units(cxx, tmp, cache)
        if err:
            return err
        err = _run_or_remove(link + objects + ["-pthread", "-ldl"], tmp_lib)
        if err and len(fresh) < len(objects):
            # An entry can pass its integrity check and still not link (stored by a build
            # whose compiler misbehaved): the cache must never be what fails the build.
            print(f"link with {len(objects) - len(fresh)} cached object(s) failed; compiling every unit fresh",
                  file=sys.stderr)
            objects, fresh, err = _compile_units(cxx, tmp, None)
            err = err or _run_or_remove(link + objects + ["-pthread", "-ldl"], tmp_lib)
        if err:
            return err
        if cache:  # only objects that linked are kept
            for unit, obj in fresh.items():
                cache.store(cache.key(COMMON_FLAGS + UNITS[unit] + [unit]), obj)
            cache.keep_only(cache.key(COMMON_FLAGS + flags + [unit]) for unit, flags in UNITS.items())
        os.replace(tmp_lib, os.path.join(out_dir, LIB_NAME))
    return None


def _compile_units(cxx: "list[str]", tmp: str,
                   cache: "ObjectCache | None") -> "tuple[list[str], dict[str, str], str | None]":
    """Each unit's object in ``tmp``, from ``cache`` where it holds a sound one, else compiled.
    Returns (every object in link order, {unit: object} of those compiled, first error)."""
    objects, cmds = [], {}
    for unit, flags in UNITS.items():
        obj = os.path.join(tmp, unit + ".o")
        objects.append(obj)
        if not (cache and cache.fetch(cache.key(COMMON_FLAGS + flags + [unit]), obj)):
            cmds[unit] = cxx + COMMON_FLAGS + flags + ["-I", NATIVE, "-c", os.path.join(NATIVE, unit), "-o", obj]
    # The units are independent: compile them at once, one per CPU (the AVX-512 unit alone
    # takes most of the time), and report the first failure in unit order.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(cmds), os.cpu_count() or 1))) as pool:
        errors = list(pool.map(_run, cmds.values()))
    fresh = {unit: cmd[-1] for unit, cmd in cmds.items()}
    return objects, fresh, next((e for e in errors if e), None)


class ObjectCache:
    """[Note: native object cache] ``OFFLOAD_NATIVE_CACHE=DIR`` keeps each unit's object file
    in DIR under a digest of all that decides its bytes: the compiler (its path and its own
    ``--version``), the unit's flags and every file of ``native/`` (a header changed rebuilds
    every unit). A build of the same sources with the same compiler links those objects
    instead of compiling them again. ``make`` sets it (``build/native-objects``): the wheel
    test's ``pip wheel`` of a copy of the tree then links what ``make setup`` compiled, ~45 s
    of CPU less on CI's two cores. Unset, nothing is cached. A missing compiler is still
    reported: the cache is consulted only once the compiler was found and answered
    ``--version``. System headers are not in the digest (a compiler upgrade changes
    ``--version``; libc headers changed alone would not): ``make clean`` drops the cache with
    ``build/``.

    The cache only ever costs a compile, never the build nor the library's soundness: an
    entry is named ``<key>-<size>-<sha256>.o``, the record of the bytes it was stored with,
    and is written whole under a temporary name then renamed (a crash leaves no half entry).
    A hit is used only if it is a regular file (not a link, device or FIFO) of that size and
    hash; anything else is evicted and the unit compiled, with one line saying why. Objects
    are stored only once the library linked, and a link with cached objects that fails
    anyway is retried once with every unit compiled fresh (compile_native)."""

    ENTRY = re.compile(r"([0-9a-f]{64})-([0-9]+)-([0-9a-f]{64})\.o")

    def __init__(self, folder: str, digest: "hashlib._Hash") -> None:
        self.folder, self.digest = folder, digest

    @classmethod
    def from_env(cls, cxx: "list[str]") -> "ObjectCache | None":
        folder = os.environ.get("OFFLOAD_NATIVE_CACHE", "").strip()
        if not folder:
            return None
        try:
            version = subprocess.run(cxx + ["--version"], capture_output=True, text=True, timeout=60)
            if version.returncode != 0:
                return None
            digest = hashlib.sha256()
            digest.update(f"{os.path.realpath(shutil.which(cxx[0]))}\0{cxx}\0{version.stdout}\0".encode())
            for name in sorted(os.listdir(NATIVE)):
                path = os.path.join(NATIVE, name)
                if os.path.isfile(path):
                    with open(path, "rb") as fh:
                        digest.update(name.encode() + b"\0" + fh.read() + b"\0")
            os.makedirs(folder, exist_ok=True)
        except (OSError, subprocess.SubprocessError, TypeError):
            return None
        return cls(folder, digest)

    def key(self, flags: "list[str]") -> str:
        h = self.digest.copy()
        h.update("\0".join(flags).encode())
        return h.hexdigest()

    def _names(self) -> "list[str]":
        try:
            return os.listdir(self.folder)
        except OSError:
            return []

    def fetch(self, key: str, obj: str) -> bool:
        """Copy ``key``'s entry to ``obj`` if it is sound; evict it otherwise."""
        for name in self._names():
            entry = self.ENTRY.fullmatch(name)
            if not entry or entry.group(1) != key:
                continue
            path = os.path.join(self.folder, name)
            try:
                data = _read_recorded(path, int(entry.group(2)), entry.group(3))
            except (OSError, ValueError) as exc:
                print(f"{os.path.basename(obj)}: cached {path} not used ({exc}); evicting it and compiling",
                      file=sys.stderr)
                _remove(path)
                continue
            try:
                with open(obj, "wb") as fh:
                    fh.write(data)
            except OSError:
                return False
            print(f"{os.path.basename(obj)}: from {self.folder}", file=sys.stderr)
            return True
        return False

    def store(self, key: str, obj: str) -> None:
        """Keep ``obj`` as ``key``'s entry, replacing any other (best effort)."""
        tmp = os.path.join(self.folder, f".{key}.{os.getpid()}.tmp")
        try:
            with open(obj, "rb") as fh:
                data = fh.read()
            name = f"{key}-{len(data)}-{hashlib.sha256(data).hexdigest()}.o"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, os.path.join(self.folder, name))  # whole or absent, for a build beside
        except OSError:
            _remove(tmp)
            return
        for other in self._names():
            if other != name and other.startswith(key + "-"):
                _remove(os.path.join(self.folder, other))

    def keep_only(self, keys: "Iterable[str]") -> None:
        """Remove the objects of older sources or compilers (the cache would only grow), and
        what a build that died while storing left an hour ago or more."""
        wanted, now = set(keys), time.time()
        for name in self._names():
            path = os.path.join(self.folder, name)
            entry = self.ENTRY.fullmatch(name)
            if name.endswith(".o") and not (entry and entry.group(1) in wanted):
                _remove(path)
            elif name.endswith(".tmp"):
                try:
                    if now - os.lstat(path).st_mtime > 3600:
                        _remove(path)
                except OSError:
                    pass


def _read_recorded(path: str, size: int, sha256: str) -> bytes:
    """The bytes of ``path`` if it is a regular file of ``size`` bytes and hash ``sha256``;
    raises OSError or ValueError saying what is wrong otherwise. Never reads more than
    ``size`` + 1 bytes, never follows a link, never waits on a FIFO."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size != size:
        raise ValueError(f"{st.st_size} bytes, {size} recorded")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the lstat
            raise ValueError("not a regular file")
        data = fh.read(size + 1)
    if len(data) != size:
        raise ValueError(f"{len(data)} bytes, {size} recorded")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError("sha256 differs from the one recorded")
    return data


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _run_or_remove(cmd: "list[str]", output: str) -> "str | None":
    """``_run(cmd)``, removing ``output`` if it failed."""
    err = _run(cmd)
    if err:
        _remove(output)
    return err


def _run(cmd: "list[str]") -> "str | None":
    print(" ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        return f"{' '.join(cmd)}\n{exc}"
    if proc.returncode != 0:
        return f"{' '.join(cmd)}\nexit status {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return None


class BuildNative(build_ext):
    """``build_ext`` that builds the ctypes library (in place for editable installs)."""

    def run(self) -> None:
        if self.inplace:
            out_dir = os.path.join(HERE, "offload", "kernels")
        else:
            out_dir = os.path.join(os.path.abspath(self.build_lib), "offload", "kernels")
        error_file = os.path.join(out_dir, ERROR_NAME)
        err = compile_native(out_dir)
        if err:
            os.makedirs(out_dir, exist_ok=True)
            with open(error_file, "w") as fh:
                fh.write(err)
            print(f"warning: native kernels not built; numba will serve.\n{err}", file=sys.stderr)
        elif os.path.exists(error_file):
            os.remove(error_file)

    def get_outputs(self) -> "list[str]":
        return []


def glibc_floor(lib_path: str) -> "tuple[int, int]":
    """The newest ``GLIBC_x.y`` symbol version ``lib_path`` needs: the version names it
    binds to are plain strings in its ``.dynstr`` (what ``objdump -T`` lists)."""
    with open(lib_path, "rb") as fh:
        found = {(int(a), int(b)) for a, b in re.findall(rb"GLIBC_(\d+)\.(\d+)", fh.read())}
    return max(found, default=(2, 17))


class BdistWheel(bdist_wheel):
    """Tag the wheel ``py3-none-<platform>``: the library is loaded with ctypes and uses no
    Python ABI, so one wheel serves every CPython 3. The platform is PEP 600's
    ``manylinux_X_Y`` with X.Y the newest glibc symbol version the built library needs (its
    other needs, libstdc++, libgcc_s and libm, are in every manylinux policy); a wheel built
    without a compiler carries no library and is ``py3-none-any``."""

    def get_tag(self) -> "tuple[str, str, str]":
        build_lib = self.get_finalized_command("build").build_lib
        lib = os.path.join(build_lib, "offload", "kernels", LIB_NAME)
        if not os.path.exists(lib):
            return "py3", "none", "any"
        plat = self.plat_name or ""
        if not plat.startswith("linux-"):
            return "py3", "none", plat.replace("-", "_").replace(".", "_")
        major, minor = glibc_floor(lib)
        return "py3", "none", f"manylinux_{major}_{minor}_{plat[len('linux-'):]}"


class BinaryDistribution(Distribution):
    """The wheel carries a shared object, so it is platform-specific and build_ext runs."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_ext": BuildNative, "bdist_wheel": BdistWheel}, distclass=BinaryDistribution)
