"""The global grad norm gives the same bits on every backend ([Note: sumsq in fp32 blocks]
in native/unit_dispatch.h): the native units (AVX-512, AVX2, scalar) and numba at 1 and 2
threads run one blocked fp32 algorithm with the same cuts, lanes, FMAs, folds and redo
rules, so ``grad_sumsq`` returns identical doubles, and a step clipped by
``max_grad_norm`` gives identical params. Before, the scalar unit and numba summed in
double (numba's bits even depended on the thread count) and the AVX-512 unit's exact path
(blocks redone in double) joined its lanes in another order than AVX2's.
"""
from __future__ import annotations

import math

import pytest
import torch

import offload
import offload.kernels as K
from offload.kernels._native_abi import BLOCK_ELEMS

pytestmark = pytest.mark.backends_by_name

SUB = 512  # kSumsqSub
BLOCK = BLOCK_ELEMS  # the dispatch ranges (OFFLOAD_BLOCK_ELEMS)
# every cut: steps of 16, sub-blocks, the 4 streams of sub-blocks, the dispatch ranges
SIZES = [1, 15, 16, 17, 511, 512, 513, 2047, 2048, 2049, 3 * 4 * SUB - 1, 3 * 4 * SUB + 17,
         BLOCK - 1, BLOCK, BLOCK + 1, BLOCK + 4 * SUB - 1, 2 * BLOCK + 2049, 2**20 + 3]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _data(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 3
    if kind == "tiny":  # squares below fp32's range: every block redone in double
        x = x * 2.0**-70
    elif kind == "mixed":  # a run of tiny values, a tiny value alone among zeros, and -0
        x[n // 3: n // 3 + 3000] *= 2.0**-70
        x[-1500:] = 0.0
        x[n - min(n, 700)] = 2.0**-66
        x[: min(n, 600)] = -0.0
    elif kind == "huge":  # 1e20's square overflows fp32 (fp16: inf)
        x[::3001] = 1e20
    elif kind == "zeros":  # all-zero blocks between normal ones
        x[: min(n, 4 * SUB)] = 0.0
        x[BLOCK: BLOCK + 3 * SUB] = 0.0
    elif kind == "inf":
        x[n // 2] = math.inf
    elif kind == "nan":
        x[n - 1] = math.nan
    return x.to(dtype)


def _sumsq_everywhere(g: torch.Tensor, monkeypatch) -> dict:
    out = {}
    try:
        native = K.get_backend("native")
    except RuntimeError:
        native = None
    for isa in ("avx512", "avx2", "scalar"):
        if native is not None and isa in native.supported:
            monkeypatch.setenv("OFFLOAD_ISA", isa)
            out[f"native-{isa}"] = native.grad_sumsq(g, num_threads=2)
    monkeypatch.delenv("OFFLOAD_ISA", raising=False)
    numba_backend = K.get_backend("numba")
    for threads in (1, 2):
        out[f"numba-{threads}"] = numba_backend.grad_sumsq(g, num_threads=threads)
    return out


def _key(result) -> tuple:
    total, nonfinite = result
    return ("nan" if math.isnan(total) else total.hex(), nonfinite)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["random", "tiny", "mixed", "huge", "zeros", "inf", "nan"])
@pytest.mark.parametrize("n", SIZES)
def test_grad_sumsq_same_bits_on_every_backend(monkeypatch, n, kind, dtype):
    g = _data(kind, n, DTYPES[dtype])
    results = _sumsq_everywhere(g, monkeypatch)
    got = {name: _key(r) for name, r in results.items()}
    assert len(set(got.values())) == 1, got
    total, nonfinite = next(iter(results.values()))
    exact = float(torch.dot(g.double(), g.double()))
    assert nonfinite == (not math.isfinite(exact))
    if math.isfinite(exact) and exact > 0:
        assert math.isclose(total, exact, rel_tol=2.1e-6), (total, exact)


@pytest.mark.parametrize("kind", ["random", "mixed"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_clipped_adamw_step_same_bits_native_and_numba(dtype, kind):
    # the params in the grads' dtype (a 16-bit param keeps an fp32 master): the clip's norm
    # is that of the 16-bit grads, the same on both backends, and so is every step after it
    try:
        K.get_backend("native")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    n = 2**20 + 3
    start = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(DTYPES[dtype])
    grads = [_data(kind, n + i, torch.float32)[:n].to(DTYPES[dtype]) for i in range(2)]
    got = {}
    for backend in ("native", "numba"):
        p = torch.nn.Parameter(start.clone())
        opt = offload.AdamW([p], lr=1e-2, max_grad_norm=1.0, backend=backend, num_threads=2)
        norms = []
        for g in grads:
            p.grad = g.clone()
            opt.step()
            norms.append(float(opt.last_grad_norm).hex())
        bits = p.detach().view(torch.int32 if p.dtype == torch.float32 else torch.int16)
        got[backend] = (bits.clone(), norms)
    assert got["native"][1] == got["numba"][1]
    assert torch.equal(got["native"][0], got["numba"][0])
