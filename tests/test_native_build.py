"""The native build keeps wide instructions inside their own units.

One library serves every x86-64 CPU only if the baseline units (dispatch.cpp, which runs
first on any CPU, adam_scalar.cpp, the fallback, and uring_ring.cpp, the io engine's ring)
contain no VEX/EVEX instruction: a
single AVX instruction leaked there (a global -mavx512 flag, -march=native, or an inline
helper merged across units by the linker) is an illegal instruction on an older CPU.
The flags are read from setup.py itself, so the test checks what is installed.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "native")
CXX = os.environ.get("CXX", "c++").split()[0]

pytestmark = pytest.mark.skipif(
    shutil.which(CXX) is None or shutil.which("objdump") is None,
    reason="needs a C++ compiler and objdump")


def _setup_constants():
    """COMMON_FLAGS and UNITS as literally written in setup.py (not by running it)."""
    with open(os.path.join(ROOT, "setup.py")) as fh:
        tree = ast.parse(fh.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in ("COMMON_FLAGS", "UNITS"):
                found[name] = ast.literal_eval(node.value)
    return found["COMMON_FLAGS"], found["UNITS"]


def _mnemonics(obj):
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], capture_output=True,
                         text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and re.match(r"^\s*[0-9a-f]+:$", parts[0]):
            yield parts[1].split()[0] if parts[1].split() else "", line


def test_no_native_arch_flags():
    common, units = _setup_constants()
    for flags in [common] + list(units.values()):
        assert not any(f.startswith(("-march", "-mtune=native")) for f in flags), flags


@pytest.mark.parametrize("unit", ["dispatch.cpp", "machine.cpp", "adam_scalar.cpp", "uring_ring.cpp"])
def test_baseline_units_have_no_vex_instructions(unit, tmp_path):
    common, units = _setup_constants()
    obj = str(tmp_path / (unit + ".o"))
    subprocess.run([CXX, *common, *units[unit], "-I", NATIVE, "-c",
                    os.path.join(NATIVE, unit), "-o", obj], check=True)
    wide = [line for mnem, line in _mnemonics(obj)
            if mnem.startswith("v") or "%ymm" in line or "%zmm" in line or "%k" in line]
    assert not wide, f"{unit} contains VEX/EVEX instructions:\n" + "\n".join(wide[:10])


def test_avx512_unit_uses_avx512(tmp_path):
    # guards the test above against a disassembly it cannot read. At -O0 (the last -O wins):
    # the unit's intrinsics are zmm instructions at any level, and -O3 took 6 s of CPU, -O0 2 s
    # (the library built at -O3 is checked by test_wheel and every kernel test).
    common, units = _setup_constants()
    obj = str(tmp_path / "adam_avx512.o")
    subprocess.run([CXX, *common, *units["adam_avx512.cpp"], "-O0", "-I", NATIVE, "-c",
                    os.path.join(NATIVE, "adam_avx512.cpp"), "-o", obj], check=True)
    assert any("%zmm" in line for _, line in _mnemonics(obj))


def test_library_exports_only_the_c_face():
    lib = os.path.join(ROOT, "offload", "kernels", "liboffload_native.so")
    if not os.path.exists(lib) or shutil.which("nm") is None:
        pytest.skip("library not built or nm missing")
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                         check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if " T " in line}
    assert names == {"offload_abi_version", "offload_isa_supported", "offload_isa_best",
                     "offload_step_args_size", "offload_rule_step", "offload_rule_steps", "offload_grad_sumsq",
                     "offload_omp_pool",  # [Note: torch's OpenMP pool]
                     "offload_block_elems",
                     # the io engine's ring (native/uring_ring.cpp)
                     "offload_uring_open", "offload_uring_queue", "offload_uring_submit",
                     "offload_uring_reap", "offload_uring_fd", "offload_uring_close"}
