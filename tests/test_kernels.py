"""Kernel backends against torch, element by element.

Every implementation (native at each ISA the CPU supports, numba, torch) is held to
torch.optim.Adam / AdamW with foreach=False: params and both moments within rtol 1e-5,
atol 1e-6 after 100 steps (10 steps at 2**20 + 3 elements, to keep the file fast). The
low-precision copy must equal ``master.to(dtype)`` bit for bit.

Under ``OFFLOAD_BACKEND=numba`` (the second pass of ``make test``) only the numba backend is
exercised here (the torch one, picked by name, runs in the native pass); the default run covers
all of them.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import math
import os

import pytest
import torch

import offload
import offload.kernels as K
from offload.kernels import registry

BIG = 2**20 + 3
SIZES = [1, 7, 15, 16, 17, 4097, BIG]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _native_or_none():
    try:
        return K.get_backend("native")
    except RuntimeError:
        return None


def _impls():
    forced = os.environ.get("OFFLOAD_BACKEND", "").strip().lower()
    out = []
    native = _native_or_none()
    for isa in ("scalar", "avx2", "avx512"):
        marks = []
        if native is None:
            marks.append(pytest.mark.skip(reason="native library not built"))
        elif isa not in native.supported:
            marks.append(pytest.mark.skip(reason=f"CPU lacks {isa}"))
        elif forced not in ("", "auto", "native"):
            marks.append(pytest.mark.skip(reason=f"suite run for OFFLOAD_BACKEND={forced}"))
        out.append(pytest.param(("native", isa), id=f"native-{isa}", marks=marks))
    numba_marks = []
    if forced not in ("", "auto", "numba"):
        numba_marks.append(pytest.mark.skip(reason=f"suite run for OFFLOAD_BACKEND={forced}"))
    out.append(pytest.param(("numba", None), id="numba", marks=numba_marks))
    # The torch reference is picked by name, so the numba pass would run it again unchanged
    # (make test runs both passes; this was half of these files' time in the numba pass).
    torch_marks = [pytest.mark.skip(reason="the torch backend runs in the native pass of `make test`")] \
        if forced == "numba" else []
    out.append(pytest.param(("torch", None), id="torch", marks=torch_marks))
    return out


@pytest.fixture(params=_impls())
def backend(request, monkeypatch):
    name, isa = request.param
    if isa is None:
        monkeypatch.delenv("OFFLOAD_ISA", raising=False)
    else:
        monkeypatch.setenv("OFFLOAD_ISA", isa)
    try:
        return K.get_backend(name)
    except RuntimeError as exc:
        pytest.skip(str(exc))


_grad_cache = {}


def _grads(n, steps, seed, dtype=torch.float32):
    """The grads of a run, generated once and shared by the reference and every backend."""
    key = (n, steps, seed, dtype)
    if key not in _grad_cache:
        gen = torch.Generator().manual_seed(seed)
        _grad_cache[key] = [(torch.randn(n, generator=gen) * 0.5).to(dtype)
                            for _ in range(steps)]
    return _grad_cache[key]


def _torch_optim(n, steps, *, cls, betas=(0.9, 0.999), weight_decay=0.0, maximize=False,
                 seed=0, grad_dtype=torch.float32):
    """Reference trajectory: torch.optim with foreach=False on the (upcast) grads."""
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    p = p0.clone().requires_grad_(True)
    opt = cls([p], lr=HP["lr"], betas=betas, eps=HP["eps"], weight_decay=weight_decay,
              maximize=maximize, foreach=False)
    for g in _grads(n, steps, seed, grad_dtype):
        p.grad = g.float().clone()  # the cached grads stay untouched
        opt.step()
    st = opt.state[p]
    return p0, p.detach(), st["exp_avg"], st["exp_avg_sq"]


def _run(backend, p0, n, steps, *, decoupled, betas=(0.9, 0.999), weight_decay=0.0, seed=0,
         grad_dtype=torch.float32, grad_mult=1.0, **kw):
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for s, g in enumerate(_grads(n, steps, seed, grad_dtype), start=1):
        if grad_mult != 1.0:
            g = g * grad_mult
        backend.adam_step(p, g, m, v, lr=HP["lr"], beta1=betas[0], beta2=betas[1],
                          eps=HP["eps"], weight_decay=weight_decay, step=s,
                          decoupled=decoupled, **kw)
    return p, m, v


def _close(ours, ref):
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


CONFIGS = {
    "adam": dict(cls=torch.optim.Adam, weight_decay=0.0, decoupled=False),
    "adam_l2": dict(cls=torch.optim.Adam, weight_decay=0.1, decoupled=False),
    "adamw": dict(cls=torch.optim.AdamW, weight_decay=0.1, decoupled=True),
    "adamw_wd0": dict(cls=torch.optim.AdamW, weight_decay=0.0, decoupled=True),
    # beta1 < 0.5 takes the other branch of torch.lerp (weight >= 0.5)
    "adamw_low_beta1": dict(cls=torch.optim.AdamW, weight_decay=0.1, decoupled=True,
                            betas=(0.3, 0.99)),
}

_ref_cache = {}


def _reference(n, config, steps):
    key = (n, config, steps)
    if key not in _ref_cache:
        c = CONFIGS[config]
        _ref_cache[key] = _torch_optim(n, steps, cls=c["cls"], weight_decay=c["weight_decay"],
                                       betas=c.get("betas", (0.9, 0.999)))
    return _ref_cache[key]


# Every config at 4097 (full vectors plus a tail); the two decay modes at every size.
CASES = [(n, c) for n in SIZES for c in (CONFIGS if n == 4097 else ("adam_l2", "adamw"))]


@pytest.mark.parametrize("n,config", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_matches_torch_optim(backend, n, config):
    steps = 10 if n == BIG else 100
    p0, *ref = _reference(n, config, steps)
    c = CONFIGS[config]
    ours = _run(backend, p0, n, steps, decoupled=c["decoupled"],
                weight_decay=c["weight_decay"], betas=c.get("betas", (0.9, 0.999)))
    _close(ours, ref)


@pytest.mark.parametrize("n", [17, 4097])
def test_maximize(backend, n):
    p0, *ref = _torch_optim(n, 50, cls=torch.optim.AdamW, weight_decay=0.1, maximize=True)
    _close(_run(backend, p0, n, 50, decoupled=True, weight_decay=0.1, maximize=True), ref)


def test_grad_scale(backend):
    # grads fed 1024x too large with grad_scale = 1/1024 (exact in binary): torch's result
    n = 4097
    p0, *ref = _torch_optim(n, 50, cls=torch.optim.Adam, weight_decay=0.1)
    ours = _run(backend, p0, n, 50, decoupled=False, weight_decay=0.1, grad_mult=1024.0,
                grad_scale=1.0 / 1024)
    _close(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_grads(backend, dtype):
    n = 4097
    p0, *ref = _torch_optim(n, 100, cls=torch.optim.AdamW, weight_decay=0.1, grad_dtype=dtype)
    _close(_run(backend, p0, n, 100, decoupled=True, weight_decay=0.1, grad_dtype=dtype), ref)


@pytest.mark.parametrize("n", [17, 4097])
def test_nonfinite_grads_propagate_like_torch(backend, n):
    # NaN and Inf in the SIMD tail and the body poison exactly the elements torch poisons
    p0 = torch.randn(n)
    g = torch.randn(n)
    for pos, bad in ((n - 1, float("nan")), (n - 3, float("inf")), (1, -float("inf"))):
        g[pos] = bad
    ref = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    ours = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    K.get_backend("torch").adam_step(ref[0], g, ref[1], ref[2], weight_decay=0.1, step=1,
                                     decoupled=True, **HP)
    backend.adam_step(ours[0], g, ours[1], ours[2], weight_decay=0.1, step=1, decoupled=True,
                      **HP)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.isnan(ours[0][[1, n - 3, n - 1]]).all()


def test_bias_correction_off(backend):
    # hand reference: no bias correction means step_size = lr and denom = sqrt(v) + eps
    n, lr, b1, b2, eps = 4097, 1e-2, 0.9, 0.999, 1e-8
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(5))
    rp, rm, rv = p0.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for g in _grads(n, 30, 3):
        g = g.double()
        rm = b1 * rm + (1 - b1) * g
        rv = b2 * rv + (1 - b2) * g * g
        rp = rp - lr * rm / (rv.sqrt() + eps)
    ours = _run(backend, p0, n, 30, seed=3, decoupled=True, bias_correction=False)
    _close(ours, (rp.float(), rm.float(), rv.float()))


def test_views_into_flat_buffer(backend):
    # contiguous slices of larger buffers at odd offsets: only their range is touched
    n, off = 4097, 3
    flat = [torch.randn(n + 10), torch.randn(n + 10), torch.randn(n + 10), torch.rand(n + 10)]
    before = [t.clone() for t in flat]
    views = [t[off:off + n] for t in flat]
    p, g, m, v = views
    ref = [t.clone() for t in (p, m, v)]
    K.get_backend("torch").adam_step(ref[0], g, ref[1], ref[2], weight_decay=0.1, step=3,
                                     decoupled=True, **HP)
    backend.adam_step(p, g, m, v, weight_decay=0.1, step=3, decoupled=True, **HP)
    _close((p, m, v), ref)
    for t, b in zip(flat, before):
        assert torch.equal(t[:off], b[:off]) and torch.equal(t[off + n:], b[off + n:])


# ---------------------------------------------------------------- low-precision copy


def _special_floats(n):
    """Random bit patterns (all classes) plus values at and next to rounding ties."""
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).clone()
    ties = [65504.0, 65519.0, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26,
            1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 6.1035156e-05,
            6.097555e-05, 3.3895314e38, float("inf"), float("nan"), 0.0, 1e-40]
    t = torch.tensor(ties, dtype=torch.float32)
    # the float32 neighbours of each tie too
    ti = t.view(torch.int32)
    near = torch.cat([t, (ti + 1).view(torch.float32), (ti - 1).view(torch.float32)])
    near = torch.cat([near, -near])
    x[: near.numel()] = near
    x[-near.numel():] = near  # in the SIMD tail as well
    return x


@functools.lru_cache(maxsize=None)
def _torch_nan_bits_vary(dtype) -> bool:
    """torch's own copy of a NaN depends on the tensor's length (torch 2.6: a short fp16
    tensor's NaNs come out 0x7FFF, a long one's keep their sign and payload, as ours do)."""
    x = _special_floats(245)
    short = x.to(dtype).view(torch.int16)
    long = torch.cat([x, torch.zeros(8192)]).to(dtype)[: x.numel()].view(torch.int16)
    return not torch.equal(short, long)


def _bits_equal(ours, ref):
    a = ours.view(torch.int16)
    b = ref.view(torch.int16)
    scalar_bf16 = torch.backends.cpu.get_cpu_capability() == "DEFAULT" and ref.dtype == torch.bfloat16
    if scalar_bf16 or _torch_nan_bits_vary(ref.dtype):
        # torch's scalar build writes NaN as 0x7FC0, its vector builds 0xFFFF (as we do); and
        # where torch's own NaN bits depend on the length, only NaN-ness is torch's to compare
        nan = torch.isnan(ref.float())
        assert torch.equal(torch.isnan(ours.float()), nan)
        a, b = a[~nan], b[~nan]
    bad = (a != b).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} lowp mismatches, first at {bad[:5].tolist()}: "
        f"ours {[hex(int(v) & 0xFFFF) for v in a[bad[:5]]]} "
        f"torch {[hex(int(v) & 0xFFFF) for v in b[bad[:5]]]}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n", [245, 4097, 70003])
def test_lowp_copy_special_values(backend, dtype, n):
    # lr = 0 and g = 0 leave finite params unchanged, so the copy sees the crafted values
    p = _special_floats(n)
    g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    lowp = torch.empty(n, dtype=dtype)
    backend.adam_step(p, g, m, v, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.0, step=1, decoupled=True, param_lowp=lowp)
    _bits_equal(lowp, p.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
def test_lowp_copy_after_steps(backend, dtype, grad_dtype):
    n = 4097
    p0 = torch.randn(n) * 100
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    lowp = torch.empty(n, dtype=dtype)
    for s, g in enumerate(_grads(n, 5, 2, grad_dtype), start=1):
        backend.adam_step(p, g, m, v, weight_decay=0.1, step=s, decoupled=True,
                          param_lowp=lowp, **HP)
        _bits_equal(lowp, p.to(dtype))
    ref = _run(K.get_backend("torch"), p0, n, 5, seed=2, decoupled=True, weight_decay=0.1,
               grad_dtype=grad_dtype)
    _close((p, m, v), ref)


# Native SIMD units write copies of >= 2**20 elements with non-temporal stores, peeling to
# the first aligned address ([Note: streamed lowp copy] in native/dispatch.cpp). The copy
# starts at every alignment class here, with neighbours that must stay untouched, and the
# update itself must be the one without a copy, bit for bit.
STREAMED = 2**20 + 19


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("offset", [0, 1, 7, 9, 15])
def test_streamed_lowp_copy_at_any_alignment(backend, dtype, offset):
    p = _special_floats(STREAMED)
    g, m, v = torch.zeros(STREAMED), torch.zeros(STREAMED), torch.zeros(STREAMED)
    sentinel = torch.full((STREAMED + 32,), 0x1234, dtype=torch.int16)
    buf = sentinel.clone().view(dtype)
    lowp = buf[offset:offset + STREAMED]
    backend.adam_step(p, g, m, v, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                      step=1, decoupled=True, param_lowp=lowp, num_threads=2)
    _bits_equal(lowp, p.to(dtype))
    raw = buf.view(torch.int16)
    assert torch.equal(raw[:offset], sentinel[:offset])
    assert torch.equal(raw[offset + STREAMED:], sentinel[offset + STREAMED:])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
def test_streamed_lowp_copy_leaves_the_update_unchanged(backend, grad_dtype):
    n = STREAMED
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(5))
    with_copy = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    without = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    lowp = torch.empty(n + 3, dtype=torch.bfloat16)[3:]  # misaligned on purpose
    for s, g in enumerate(_grads(n, 3, 7, grad_dtype), start=1):
        backend.adam_step(*with_copy[:1], g, *with_copy[1:], weight_decay=0.1, step=s, decoupled=True,
                          param_lowp=lowp, num_threads=2, **HP)
        backend.adam_step(*without[:1], g, *without[1:], weight_decay=0.1, step=s, decoupled=True,
                          num_threads=2, **HP)
        _bits_equal(lowp, with_copy[0].to(torch.bfloat16))
    for a, b in zip(with_copy, without):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---------------------------------------------------------------- sum of squares


# The native units (AVX-512, AVX2, scalar) and numba add at most 32 squares per fp32 lane
# (plus 3 adds joining 8 accumulators) before folding into double, so their sums are within
# gamma_35 of exact ([Note: sumsq in fp32 blocks] in native/unit_dispatch.h): memory-bound
# instead of widening every element to double, and the same bits on every one of them
# (tests/test_sumsq_bits.py). That is looser than the torch backend's double sum (1e-9) but
# far tighter than torch's own vector_norm of fp32/bf16 tensors, which accumulates in fp32
# over whole rows (~2e-5 at 2**20 elements).
SUMSQ_FP32_BLOCK_RTOL = 35 * 2**-24 / (1 - 35 * 2**-24)  # ~2.09e-6


def _sumsq_rtol(backend, double_rtol=1e-9):
    return double_rtol if backend.name == "torch" else SUMSQ_FP32_BLOCK_RTOL


GRAD_DTYPES_ALL = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])


@GRAD_DTYPES_ALL
@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, 33, 513, 2561, 4097, BIG])
def test_grad_sumsq(backend, n, dtype):
    g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    total, nonfinite = backend.grad_sumsq(g)
    assert nonfinite is False
    exact = float(torch.linalg.vector_norm(g.double())) ** 2
    assert math.isclose(total, exact, rel_tol=_sumsq_rtol(backend)), (total, exact)
    # torch's own float32 norm drifts by ~2e-5 relative at 2**20 + 3 elements (float
    # accumulation); every backend is closer to the exact value above
    torch_f32 = float(torch.linalg.vector_norm(g.float())) ** 2
    assert math.isclose(total, torch_f32, rel_tol=1e-5 if n < BIG else 1e-4), (total, torch_f32)


@GRAD_DTYPES_ALL
def test_grad_sumsq_constant_input_within_bound(backend, dtype):
    # a constant input is the worst case for a long fp32 sum: every rounding leans the
    # same way, so the error grows with the run length (32 squares per lane stay within
    # the bound; 1024 per lane breaks it for the f16 and bf16 cases, checked by hand)
    g = torch.full((BIG,), 1.1).to(dtype)
    total, nonfinite = backend.grad_sumsq(g)
    exact = float(torch.linalg.vector_norm(g.double())) ** 2
    assert nonfinite is False
    assert math.isclose(total, exact, rel_tol=_sumsq_rtol(backend)), (total, exact)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("n,pos", [(1, 0), (17, 16), (17, 14), (4097, 4096), (4097, 4094),
                                   (4097, 0), (BIG, BIG - 1), (BIG, BIG - 3)])
def test_grad_sumsq_nonfinite(backend, n, pos, bad):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        g = torch.ones(n, dtype=dtype)
        g[pos] = bad
        total, nonfinite = backend.grad_sumsq(g)
        assert nonfinite is True, (dtype, n, pos)
        assert not math.isfinite(total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_grad_sumsq_huge_finite_values_are_finite(backend, dtype):
    # squares of fp32 max overflow float32 but not the double accumulator (the SIMD units
    # redo such a block in double); 1e20 overflows the fp32 square too, in one block only
    g = torch.full((4097,), 3.0e38).to(dtype)
    total, nonfinite = backend.grad_sumsq(g)
    assert nonfinite is False
    exact = float(torch.linalg.vector_norm(g.double())) ** 2
    assert math.isclose(total, exact, rel_tol=1e-9), (total, exact)
    g = torch.randn(BIG, generator=torch.Generator().manual_seed(1)).to(dtype)
    g[5000] = 1e20
    total, nonfinite = backend.grad_sumsq(g)
    assert nonfinite is False and math.isfinite(total)
    exact = float(torch.dot(g.double(), g.double()))
    assert math.isclose(total, exact, rel_tol=1e-9), (total, exact)


@GRAD_DTYPES_ALL
def test_grad_sumsq_tiny_values_are_exact(backend, dtype):
    # squares of |x| < 2**-63 underflow in fp32; the SIMD units redo such blocks in double,
    # and skip only blocks that are exactly zero (one tiny element in a block of zeros
    # must still count). fp16's smallest values (subnormal, ~6e-8) square exactly in fp32.
    scale = 6e-8 if dtype == torch.float16 else 1e-25
    g = (torch.randn(4097, generator=torch.Generator().manual_seed(2)) * scale).to(dtype)
    z = torch.zeros(4097, dtype=dtype)
    z[2000] = g[1]
    for x in (g, z):
        total, nonfinite = backend.grad_sumsq(x)
        exact = float(torch.dot(x.double(), x.double()))
        assert exact > 0 and nonfinite is False
        assert math.isclose(total, exact, rel_tol=1e-9), (total, exact)


# ---------------------------------------------------------------- threads


def test_threads_give_identical_adam_results(backend):
    n = BIG
    g = torch.randn(n)
    outs = []
    for threads in (1, 2, 3):
        p, m, v = torch.linspace(-1, 1, n), torch.full((n,), 0.1), torch.full((n,), 0.2)
        backend.adam_step(p, g, m, v, weight_decay=0.1, step=7, decoupled=True,
                          num_threads=threads, **HP)
        outs.append((p, m, v))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@GRAD_DTYPES_ALL
def test_threads_give_identical_sumsq(backend, dtype):
    g = torch.randn(BIG).to(dtype)
    if dtype != torch.float16:
        g[70000] = 1e20  # its square overflows fp32: the SIMD units redo that block in double
    sums = {backend.grad_sumsq(g, num_threads=t)[0] for t in (1, 2, 3)}
    if backend.name == "native":  # fixed blocks summed in order: bit-reproducible
        assert len(sums) == 1, sums
    else:
        assert max(sums) - min(sums) <= 1e-12 * max(sums), sums


@GRAD_DTYPES_ALL
def test_simd_units_give_identical_sumsq(monkeypatch, dtype):
    # AVX2 and AVX-512 share lanes, fp32 blocks and folds: the same bits, tails included
    native = _native_or_none()
    if native is None or not {"avx2", "avx512"} <= set(native.supported):
        pytest.skip("needs the native library on a CPU with AVX2 and AVX-512")
    for n in (1, 7, 15, 16, 17, 31, 33, 513, 2561, 4097, BIG):
        g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
        sums = []
        for isa in ("avx2", "avx512"):
            monkeypatch.setenv("OFFLOAD_ISA", isa)
            sums.append(native.grad_sumsq(g, num_threads=2)[0])
        assert sums[0] == sums[1], (n, sums)


def test_concurrent_calls_from_python_threads(backend):
    # the swap pipeline updates one sub-group while another thread computes a norm: calls
    # from several Python threads at once (the GIL is released) must not interfere
    import threading
    n, jobs = 3 * 65536 + 7, 4
    gens = [torch.Generator().manual_seed(i) for i in range(jobs)]
    bufs = [[torch.randn(n, generator=gn) for _ in range(2)] + [torch.zeros(n), torch.zeros(n)]
            for gn in gens]
    expected = []
    for p, g, m, v in bufs:
        ref = [p.clone(), m.clone(), v.clone()]
        for s in range(1, 4):
            K.get_backend("torch").adam_step(ref[0], g, ref[1], ref[2], weight_decay=0.1,
                                             step=s, decoupled=True, **HP)
        expected.append((ref, K.get_backend("torch").grad_sumsq(g)[0]))
    errors, sums = [], [None] * jobs

    def work(i):
        try:
            p, g, m, v = bufs[i]
            for s in range(1, 4):
                backend.adam_step(p, g, m, v, weight_decay=0.1, step=s, decoupled=True,
                                  num_threads=2, **HP)
                sums[i] = backend.grad_sumsq(g, num_threads=2)[0]
        except Exception as exc:  # reported below, with the thread's index
            errors.append((i, exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, ((ref, ref_sum), (p, g, m, v)) in enumerate(zip(expected, bufs)):
        _close((p, m, v), ref)
        assert math.isclose(sums[i], ref_sum, rel_tol=_sumsq_rtol(backend, 1e-12))


def test_set_num_threads():
    try:
        K.set_num_threads(3)
        assert K.get_num_threads() == 3
        K.set_num_threads(None)
        assert K.get_num_threads() == max(1, min(torch.get_num_threads(),
                                                 len(os.sched_getaffinity(0))))
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="num_threads"):
                K.set_num_threads(bad)
    finally:
        K.set_num_threads(None)


# ---------------------------------------------------------------- errors


def _args(n=8):
    return [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)]


def _step(backend, p, g, m, v, **kw):
    kw = {**dict(weight_decay=0.0, step=1, decoupled=True, **HP), **kw}
    backend.adam_step(p, g, m, v, **kw)


def test_rejects_wrong_dtypes(backend):
    p, g, m, v = _args()
    with pytest.raises(TypeError, match="param must have dtype.*float16"):
        _step(backend, p.half(), g, m, v)
    with pytest.raises(TypeError, match="grad must have dtype.*float64"):
        _step(backend, p, g.double(), m, v)
    with pytest.raises(TypeError, match="exp_avg_sq must have dtype.*bfloat16"):
        _step(backend, p, g, m, v.bfloat16())
    with pytest.raises(TypeError, match="param_lowp must have dtype.*float32"):
        _step(backend, p, g, m, v, param_lowp=torch.zeros(8))
    with pytest.raises(TypeError, match="grad must be a torch.Tensor, got ndarray"):
        _step(backend, p, g.numpy(), m, v)
    with pytest.raises(TypeError, match="grad must have dtype.*int32"):
        backend.grad_sumsq(torch.zeros(8, dtype=torch.int32))


def test_rejects_non_contiguous_and_mismatched(backend):
    p, g, m, v = _args()
    with pytest.raises(ValueError, match=r"exp_avg must be contiguous, got strides \(2,\)"):
        _step(backend, p, g, torch.zeros(16)[::2], v)
    with pytest.raises(ValueError, match="grad has 7 elements, param has 8"):
        _step(backend, p, torch.zeros(7), m, v)
    with pytest.raises(ValueError, match="param_lowp has 9 elements, param has 8"):
        _step(backend, p, g, m, v, param_lowp=torch.zeros(9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be on the CPU, got device meta"):
        _step(backend, p, torch.zeros(8, device="meta"), m, v)
    with pytest.raises(ValueError, match="step must be an integer >= 1, got 0"):
        _step(backend, p, g, m, v, step=0)
    with pytest.raises(ValueError, match="num_threads must be a positive int"):
        _step(backend, p, g, m, v, num_threads=0)
    with pytest.raises(ValueError, match="grad must be contiguous"):
        backend.grad_sumsq(torch.zeros(16)[::2])


def test_empty_tensors(backend):
    p, g, m, v = _args(0)
    _step(backend, p, g, m, v, param_lowp=torch.empty(0, dtype=torch.float16))
    assert backend.grad_sumsq(g) == (0.0, False)


# ---------------------------------------------------------------- selection


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        K.get_backend("cuda")


@pytest.mark.parametrize("cls", [offload.AdamW, offload.SGD, offload.Adagrad, offload.Lion])
@pytest.mark.parametrize("backend", [1, True, ["native"]])
def test_a_backend_that_is_no_name_is_a_type_error(cls, backend):
    # (an AttributeError "'int' object has no attribute 'strip'" named neither the option nor its values)
    with pytest.raises(TypeError, match=r"backend must be one of native, numba, torch, auto or None, got"):
        cls([torch.nn.Parameter(torch.randn(3))], lr=0.1, backend=backend)


def test_forced_backend_env(monkeypatch):
    monkeypatch.setenv("OFFLOAD_BACKEND", "torch")
    assert K.get_backend().name == "torch"


def test_auto_prefers_native(monkeypatch):
    monkeypatch.delenv("OFFLOAD_BACKEND", raising=False)
    expected = "native" if _native_or_none() is not None else "numba"
    assert K.get_backend("auto").name == expected


def test_forced_native_reports_build_error(monkeypatch, tmp_path):
    # a library that was never built: the compiler's message is the reason, not an AttributeError
    from offload.kernels import native_backend
    err = tmp_path / "native_build_error.txt"
    err.write_text("c++: fatal error: no input files (simulated)")
    monkeypatch.setattr(native_backend, "LIB_PATH", str(tmp_path / "missing.so"))
    monkeypatch.setattr(native_backend, "ERROR_PATH", str(err))
    monkeypatch.setattr(registry, "_loaded", {})
    monkeypatch.setattr(registry, "_errors", {})
    with pytest.raises(RuntimeError, match="(?s)'native' is not available.*missing.so not found.*simulated"):
        K.get_backend("native")
    monkeypatch.setenv("OFFLOAD_BACKEND", "native")
    with pytest.raises(RuntimeError, match="no input files"):
        K.get_backend()
    status = K.backend_status()
    assert status["native"][0] is False and "simulated" in status["native"][1]
    assert status["torch"] == (True, "ok")
    assert K.get_backend("auto").name in ("numba", "torch")


def test_forced_native_reports_dlopen_error(monkeypatch, tmp_path):
    from offload.kernels import native_backend
    bogus = tmp_path / "liboffload_native.so"
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setattr(native_backend, "LIB_PATH", str(bogus))
    monkeypatch.setattr(registry, "_loaded", {})
    monkeypatch.setattr(registry, "_errors", {})
    with pytest.raises(RuntimeError, match="cannot load .*liboffload_native.so"):
        K.get_backend("native")


needs_native = pytest.mark.skipif(_native_or_none() is None, reason="native library not built")


@needs_native
def test_unsupported_isa_is_an_error_naming_it(monkeypatch):
    native = K.get_backend("native")
    monkeypatch.setattr(native, "supported", ["scalar"])
    monkeypatch.setattr(native, "_isa_cache", None)  # resolved ISA is cached per $OFFLOAD_ISA
    monkeypatch.setenv("OFFLOAD_ISA", "avx512")
    p, g, m, v = _args()
    with pytest.raises(RuntimeError, match="OFFLOAD_ISA=avx512: this CPU does not support avx512"):
        _step(native, p, g, m, v)
    monkeypatch.setenv("OFFLOAD_ISA", "sse9")
    with pytest.raises(ValueError, match="OFFLOAD_ISA='sse9'"):
        native.grad_sumsq(g)


@needs_native
def test_isa_info():
    assert K.supported_isas()[0] == "scalar"
    assert K.native_isa() in K.supported_isas()


@needs_native
def test_c_face_returns_negative_errno():
    from offload.kernels._native_abi import StepArgs
    lib = K.get_backend("native")._lib
    p, g, m, v = _args()

    def call(**fields):
        """offload_rule_step on a valid Adam step of 8 elements with ``fields`` changed
        ("grad.dtype": 7 sets a.grad.dtype)."""
        a = StepArgs(rule=0, num_states=2, n=8, isa=-1, num_threads=1)
        a.param.data, a.grad.data = p.data_ptr(), g.data_ptr()
        a.states[0].data, a.states[1].data = m.data_ptr(), v.data_ptr()
        a.consts.adam.bc2_sqrt = a.consts.adam.decay = 1.0
        for path, value in fields.items():
            *outer, last = path.split(".")
            obj = a
            for name in outer:
                obj = obj[int(name)] if name.isdigit() else getattr(obj, name)
            setattr(obj, last, value)
        return lib.offload_rule_step(bytes(a))

    assert call() == 0
    assert call(**{"grad.dtype": 7}) == -errno.EINVAL
    assert call(**{"lowp.data": p.data_ptr(), "lowp.dtype": 0}) == -errno.EINVAL
    # ABI 3 takes bf16 params and bf16 / int8 states (tests/test_native_compressed.py);
    # fp16 is neither a param nor a state type
    assert call(**{"param.dtype": 1}) == -errno.EINVAL
    assert call(**{"states.1.dtype": 1}) == -errno.EINVAL
    assert call(**{"states.0.data": None}) == -errno.EINVAL
    assert call(**{"states.0.data": None, "n": 0}) == 0  # nothing to touch
    assert call(num_states=3) == -errno.EINVAL
    assert call(rule=1) == -errno.EINVAL
    assert call(n=-1) == -errno.EINVAL
    assert call(num_threads=0) == -errno.EINVAL
    assert call(isa=9) == -errno.EINVAL
    assert lib.offload_rule_step(None) == -errno.EINVAL
    out, flag = ctypes.c_double(), ctypes.c_int()
    assert lib.offload_grad_sumsq(g.data_ptr(), 5, 8, ctypes.byref(out), ctypes.byref(flag),
                                  -1, 1, 0) == -errno.EINVAL
    assert lib.offload_grad_sumsq(g.data_ptr(), 0, 8, ctypes.byref(out), ctypes.byref(flag),
                                  -1, 1, 2) == -errno.EINVAL  # no such pool
    assert call(pool=2) == -errno.EINVAL
    for isa in range(3):
        if not lib.offload_isa_supported(isa):
            assert call(isa=isa) == -errno.ENOTSUP
