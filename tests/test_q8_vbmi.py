"""The avx512vbmi level (native/q8_avx512vbmi.cpp): the AVX-512 unit with VBMI byte permutes
for int8 states must give the AVX-512 unit's bits, and be offered exactly where the CPU has
VBMI.

- Same input, OFFLOAD_ISA=avx512 (today's path: 16-bit decode, gathered bucket table) and
  OFFLOAD_ISA=avx512vbmi: the raw bytes of param and states equal after several steps, for
  every rule with int8 states (Adam also bf16 states, stochastic), fp32 and bf16 params,
  edge blocks (zeros, NaN, one huge value) and partial last blocks.
- Every ISA reachable here (and numba) encodes a strided sample of every float32 in [-1, 1]
  as the midpoint count (tools/q8_exhaustive.py's own comparison; the script runs all of
  them, about 2**31 per map).
- A map whose bucket table fits the AVX-512 unit but not the VBMI tables (8 mantissa bits in
  one exponent) still encodes right at the avx512vbmi level (dispatch.cpp falls back).
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

import offload.kernels as K
from offload.kernels import native_backend, q8_buckets, quant
from offload.kernels.fields import ADAGRAD, ADAM, LION, SGD

from test_kernels import _native_or_none

NATIVE = _native_or_none()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(NATIVE is None, reason="native library not built")


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
HAS_VBMI = NATIVE is not None and "avx512vbmi" in NATIVE.supported
needs_vbmi = pytest.mark.skipif(not HAS_VBMI, reason="CPU without AVX512_VBMI: the level is not offered")


@pytest.mark.skipif(not FLAGS, reason="no /proc/cpuinfo flags to compare with")
def test_the_level_is_offered_exactly_with_vbmi():
    want = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi"} <= FLAGS
    assert ("avx512vbmi" in NATIVE.supported) == want
    if want:
        assert "avx512" in NATIVE.supported and NATIVE.best == "avx512vbmi"


def test_an_unsupported_vbmi_level_names_itself(monkeypatch):
    monkeypatch.setattr(NATIVE, "supported", ["scalar", "avx2", "avx512"])
    monkeypatch.setattr(NATIVE, "_isa_cache", None)
    monkeypatch.setenv("OFFLOAD_ISA", "avx512vbmi")
    with pytest.raises(RuntimeError, match="OFFLOAD_ISA=avx512vbmi: this CPU does not support avx512vbmi"):
        NATIVE.isa()


def _inputs(n: int, gen: torch.Generator, grad_dtype: torch.dtype):
    g = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 4, (n,), generator=gen).float())
    if n >= 1024:  # edge blocks: all zero, one huge value, a NaN (blocks 0, 1, 2)
        g[:256] = 0.0
        g[256 + 17] = 3e38
        g[512 + 100] = float("nan")
    return g.to(grad_dtype)


CASES = [
    (ADAM, "int8", dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)),
    (ADAM, "int8", dict(lr=1e-2, beta1=0.3, beta2=0.99, eps=1e-6, weight_decay=0.01, decoupled=False,
                        maximize=True, grad_scale=0.5)),
    (ADAM, "bfloat16", dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)),
    (SGD, "int8", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (ADAGRAD, "int8", dict(lr=0.1, lr_decay=0.01, weight_decay=0.1)),
    (LION, "int8", dict(lr=1e-3, weight_decay=0.1)),
]


def _steps(rule, state_dtype, hyper, isa, n, param_dtype, grad_dtype, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ISA", isa)
    crule = rule.with_state_dtype(state_dtype)
    gen = torch.Generator().manual_seed(n)
    param = (torch.randn(n, generator=gen)).to(param_dtype)
    states = {f.name: torch.zeros(f.storage_numel(n), dtype=f.storage_dtype) for f in crule.fields}
    for step in range(1, 4):
        NATIVE.rule_step(crule, param, _inputs(n, gen, grad_dtype), states, step=step, num_threads=2,
                         rounding_seed=step, stochastic_states=True, **hyper)
    return [param.view(-1).view(torch.uint8)] + [t.view(-1).view(torch.uint8) for t in states.values()]


@needs_vbmi
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 4097, 2**20 + 3])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{r.name}{i}" for i, (r, _, _) in enumerate(CASES)])
def test_vbmi_and_avx512_give_the_same_bits(case, n, monkeypatch):
    rule, state_dtype, hyper = CASES[case]
    for param_dtype, grad_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]:
        if n > 4097 and param_dtype == torch.bfloat16 and case > 0:
            continue  # the big size once per rule (fp32 param) and for Adam's bf16 master
        want = _steps(rule, state_dtype, hyper, "avx512", n, param_dtype, grad_dtype, monkeypatch)
        got = _steps(rule, state_dtype, hyper, "avx512vbmi", n, param_dtype, grad_dtype, monkeypatch)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"array {i} differs ({param_dtype}, {grad_dtype})"


def _exhaustive_tool():
    spec = importlib.util.spec_from_file_location("q8_exhaustive", os.path.join(ROOT, "tools", "q8_exhaustive.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _encoders():
    out = [pytest.param(("native", isa), id=f"native-{isa}") for isa in (NATIVE.supported if NATIVE else [])]
    return out + [pytest.param(("numba", ""), id="numba")]


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("encoder", _encoders())
def test_a_sample_of_every_float_in_the_unit_interval(encoder, signed, monkeypatch):
    # every 4099th float32 of [-1, 1] (~1M values, both signs, every exponent) as the script
    # checks all of them; a prime stride so that the sample walks every mantissa position
    name, isa = encoder
    try:
        backend = K.get_backend(name)
    except RuntimeError as exc:
        pytest.skip(f"{name}: {exc}")
    if isa:
        monkeypatch.setenv("OFFLOAD_ISA", isa)
    tool = _exhaustive_tool()
    if signed:
        assert tool.check([(f"{name} {isa}", backend, isa)], True, 2, 4099)
    else:
        with tool.unsigned_tables():
            assert tool.check([(f"{name} {isa}", backend, isa)], False, 2, 4099)


def _fine_map() -> torch.Tensor:
    """A sorted map with an exact 0 whose midpoints in [0.5, 1) are 2^-9 apart: the bucket
    table needs 8 mantissa bits there, one more than the VBMI tables hold."""
    t = torch.cat([torch.tensor([-1.0, -0.25, 0.0, 0.125]), 0.5 + torch.arange(251, dtype=torch.float32) * 2.0**-9,
                   torch.tensor([1.0])])
    assert t.numel() == 256 and bool((t[1:] > t[:-1]).all())
    return t


def test_the_fine_map_fits_the_buckets_but_not_the_vbmi_tables():
    table = _fine_map()
    b = q8_buckets.build(((table[:-1] + table[1:]) * 0.5).numpy())
    assert b is not None
    bits = 23 - (b[:64].view(np.int32) & 31)
    assert bits.max() == 8 and (1 << bits.astype(np.int64)).sum() <= 512


@needs_vbmi
def test_a_map_outside_the_vbmi_tables_falls_back(monkeypatch):
    table = _fine_map()
    mid = (table[:-1] + table[1:]) * 0.5
    keep = (table.contiguous(), mid.contiguous())  # the library reads raw pointers
    ptrs = native_backend._TABLE_PTRS
    monkeypatch.setattr(native_backend, "_TABLE_PTRS", (keep[0].data_ptr(), keep[1].data_ptr()) + ptrs[2:])
    gen = torch.Generator().manual_seed(3)
    vals = torch.cat([torch.rand(200_000, generator=gen) * 2 - 1, mid, torch.nextafter(mid, torch.tensor(2.0)),
                      torch.nextafter(mid, torch.tensor(-2.0))])
    m = -(-vals.numel() // 255)
    g = torch.zeros(m, 256)
    padded = torch.zeros(m * 255)
    padded[:vals.numel()] = vals
    g[:, :255] = padded.view(m, 255)
    g[:, 255] = 1.0  # each block's absmax: the codes are of the values themselves
    crule = SGD.with_state_dtype("int8")
    f = crule.fields[0]
    codes = {}
    for isa in ("avx512", "avx512vbmi"):
        monkeypatch.setenv("OFFLOAD_ISA", isa)
        buf = torch.zeros(f.storage_numel(g.numel()), dtype=f.storage_dtype)
        NATIVE.rule_step(crule, torch.zeros(g.numel()), g.view(-1), {"momentum_buffer": buf}, step=1,
                         lr=0.0, momentum=0.9, num_threads=2)
        codes[isa] = buf.view(torch.uint8).view(m, quant.PACKED_BLOCK)[:, :255].reshape(-1)[:vals.numel()]
    want = torch.searchsorted(mid, vals, right=False).to(torch.uint8)
    assert torch.equal(codes["avx512"], want)
    assert torch.equal(codes["avx512vbmi"], want)
    del keep
