"""AMSGrad (Adam/AdamW with amsgrad=True): the ADAM_AMSGRAD rule in every backend and ISA.

References: torch.optim.Adam / AdamW(amsgrad=True, foreach=False), torch's
_single_tensor_adam, 21 steps, held to the numerics contract (rtol 1e-5, atol 1e-6). The SIMD
units and numba must agree bit for bit (Adam's FMAs, torch.maximum's NaN), and the torch
backend is torch's own arithmetic, so it must give torch's bits. The fused compressed kernel
(bf16 / int8 states, a bf16 param) must equal the scheme, compose_step around the same
backend's float32 AMSGrad, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

import offload.kernels as K
from offload.kernels import quant
from offload.kernels._rule_step import _KERNELS, _bind
from offload.kernels.compressed_ref import compose_step
from offload.kernels.fields import ADAM, ADAM_AMSGRAD

from test_kernels import backend, _native_or_none  # noqa: F401  (the backend fixture)

SIZES = [1, 7, 15, 16, 17, 4097]
BIG = 2**20 + 3
STEPS = 21
RTOL, ATOL = 1e-5, 1e-6
CONFIGS = {
    "adamw": dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True),
    "adam_l2_max": dict(lr=1e-2, beta1=0.3, beta2=0.999, eps=1e-6, weight_decay=0.01,
                        decoupled=False, maximize=True, grad_scale=0.5),
}


def _grads(n, seed, dtype=torch.float32):
    """Grads whose scale jumps up then down, so the running maximum differs from exp_avg_sq."""
    gen = torch.Generator().manual_seed(seed)
    scales = [1.0, 30.0, 0.1] + [0.5] * (STEPS - 3)
    return [(torch.randn(n, generator=gen) * s).to(dtype) for s in scales]


def _torch_amsgrad(hp, p0, grads):
    hp = dict(hp)
    gs, decoupled = hp.pop("grad_scale", 1.0), hp.pop("decoupled")
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    p = p0.clone().requires_grad_(True)
    opt = cls([p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
              weight_decay=hp["weight_decay"], maximize=hp.get("maximize", False), amsgrad=True,
              foreach=False)
    for g in grads:
        p.grad = g.float() * gs
        opt.step()
    st = opt.state[p]
    return p.detach(), {k: st[k] for k in ADAM_AMSGRAD.names}


def _run(be, hp, p0, grads, lowp_dtype=None, num_threads=None):
    p = p0.clone()
    states = {name: torch.zeros(p.numel()) for name in ADAM_AMSGRAD.names}
    lowp = None if lowp_dtype is None else torch.empty(p.numel(), dtype=lowp_dtype)
    for step, g in enumerate(grads, start=1):
        be.rule_step(ADAM_AMSGRAD, p, g, states, step=step, param_lowp=lowp, num_threads=num_threads, **hp)
    return p, states, lowp


def _close(ours, ref, what):
    bad = ~torch.isclose(ours, ref, rtol=RTOL, atol=ATOL)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_torch_amsgrad(backend, config, n):
    hp = CONFIGS[config]
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    grads = _grads(n, 7 + n)
    ref_p, ref_states = _torch_amsgrad(hp, p0, grads)
    p, states, _ = _run(backend, hp, p0, grads)
    _close(p, ref_p, "param")
    for name in ADAM_AMSGRAD.names:
        _close(states[name], ref_states[name], name)
    if backend.name == "torch":  # the reference's own ops: torch's bits
        assert torch.equal(p, ref_p) and all(torch.equal(states[k], ref_states[k]) for k in states)


def test_matches_torch_amsgrad_large(backend):
    hp = CONFIGS["adamw"]
    p0 = torch.randn(BIG, generator=torch.Generator().manual_seed(3))
    grads = _grads(BIG, 11)[:4]
    ref_p, ref_states = _torch_amsgrad(hp, p0, grads)
    p, states, _ = _run(backend, hp, p0, grads, num_threads=2)
    _close(p, ref_p, "param")
    _close(states["max_exp_avg_sq"], ref_states["max_exp_avg_sq"], "max_exp_avg_sq")


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _simd_runs():
    """(name, backend, isa): every native ISA unit and numba, the runs that must agree."""
    runs = []
    native = _native_or_none()
    for isa in (native.supported if native is not None else []):
        if isa != "avx512vbmi":  # the AVX-512 unit's float32 rules (VBMI differs for int8 only)
            runs.append((isa, native, isa))
    try:
        runs.append(("numba", K.get_backend("numba"), None))
    except RuntimeError:
        pass
    return runs


@pytest.mark.backends_by_name
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
def test_units_and_numba_agree_bit_for_bit(grad_dtype, monkeypatch):
    """Every ISA unit and numba, with NaN/inf grads, the low-precision copy and the parallel
    path: the same bytes of param, copy and the three states."""
    runs = _simd_runs()
    if len(runs) < 2:
        pytest.skip("fewer than two of native/numba here")
    hp = CONFIGS["adam_l2_max"]
    for n in (17, 4097, BIG):
        p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
        grads = _grads(n, n, grad_dtype)[:3]
        grads[1][3] = float("nan")
        grads[1][5] = float("inf")
        out = {}
        for name, be, isa in runs:
            if isa is not None:
                monkeypatch.setenv("OFFLOAD_ISA", isa)
            p, states, lowp = _run(be, hp, p0, grads, lowp_dtype=torch.bfloat16, num_threads=2)
            out[name] = [_bits(t) for t in (p, lowp, *states.values())]
        first = next(iter(out))
        for name, got in out.items():
            assert all(torch.equal(a, b) for a, b in zip(got, out[first])), (n, name, first)


def test_nan_where_either_is_nan(monkeypatch):
    """torch.maximum's NaN: a NaN grad gives a NaN max_exp_avg_sq, and a NaN stored maximum
    stays NaN; elsewhere the maximum is exact (max of the stored and the new exp_avg_sq)."""
    for name, be, isa in _simd_runs() + [("torch", K.get_backend("torch"), None)]:
        if isa is not None:
            monkeypatch.setenv("OFFLOAD_ISA", isa)
        p = torch.ones(9)
        m, v, vmax = torch.zeros(9), torch.full((9,), 0.5), torch.full((9,), 0.25)
        vmax[4] = float("nan")
        g = torch.ones(9)
        g[2] = float("nan")
        be.rule_step(ADAM_AMSGRAD, p, g, {"exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": vmax},
                     step=1, lr=0.1, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0, decoupled=True)
        assert torch.isnan(vmax[2]) and torch.isnan(vmax[4]) and torch.isnan(p[2]) and torch.isnan(p[4]), name
        keep = [i for i in range(9) if i not in (2, 4)]
        assert torch.equal(vmax[keep], torch.maximum(torch.full((len(keep),), 0.25), v[keep])), name


def test_without_a_larger_maximum_amsgrad_is_adam(backend):
    """With max_exp_avg_sq never above exp_avg_sq (zeros, then each element's grad 10x larger
    every step), AMSGrad's step is Adam's, bit for bit, in every backend."""
    hp = CONFIGS["adamw"]
    n = 4097
    p_a, p_b = torch.randn(n), None
    p_b = p_a.clone()
    m_a, v_a = torch.zeros(n), torch.zeros(n)
    st = {name: torch.zeros(n) for name in ADAM_AMSGRAD.names}
    base = torch.randn(n, generator=torch.Generator().manual_seed(5))
    for step in range(1, 4):
        g = base * 10 ** step
        backend.rule_step(ADAM, p_a, g, {"exp_avg": m_a, "exp_avg_sq": v_a}, step=step, **hp)
        backend.rule_step(ADAM_AMSGRAD, p_b, g, st, step=step, **hp)
        assert torch.equal(st["max_exp_avg_sq"], v_a), step
    assert torch.equal(p_a, p_b) and torch.equal(st["exp_avg_sq"], v_a) and torch.equal(st["exp_avg"], m_a)


# ---------------------------------------------------------------- compressed states
KINDS = {"bf16_nearest": ("bfloat16", False), "bf16_stochastic": ("bfloat16", True), "int8": ("int8", False)}


def _initial(rule, n, seed):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f in rule.fields:
        x = torch.randn(n, generator=gen) * 0.1
        if f.name != "exp_avg":
            x = x.abs()
        out[f.name] = quant.encode_blocks(x, f.signed) if f.blocked else x.to(f.dtype)
    return out


def test_int8_amsgrad_keeps_max_in_the_unsigned_map():
    rule = ADAM_AMSGRAD.with_state_dtype("int8")
    assert [f.signed for f in rule.fields] == [True, False, False]


def _compressed_runs(be, rule, kind, param_dtype, n, use_compose):
    """Three steps of the compressed AMSGrad: the backend's fused path, or compose_step
    around its float32 rule; the bytes of param and states."""
    state_dtype, stochastic = KINDS[kind]
    fields = rule.fields
    args = _bind(_KERNELS[ADAM_AMSGRAD], 1, CONFIGS["adam_l2_max"])
    p = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(param_dtype)
    states = _initial(rule, n, n)
    for step, g in enumerate(_grads(n, n + 1, torch.bfloat16)[:3], start=1):
        q = quant.QuantArgs(1234 + step, 0, stochastic)
        ordered = tuple(states[f.name] for f in fields)
        step_args = (args[:5] + (step,) + args[6:])
        if use_compose:
            compose_step(be._adam_amsgrad, fields, p, g, ordered, None, 2, step_args, q)
        else:
            be._compressed("_adam_amsgrad", fields, p, g, ordered, None, 2, step_args, q)
    return [_bits(p)] + [_bits(states[f.name]) for f in fields]


@pytest.mark.backends_by_name
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["p32", "pbf16"])
def test_compressed_equals_the_scheme(kind, param_dtype, monkeypatch):
    """The native fused step, every ISA unit, against compose_step around the same backend's
    float32 AMSGrad, bit for bit, 3 steps, sizes on and off the 256-element block grid, the
    parallel path included. (numba's compressed AMSGrad *is* compose_step: it is checked
    against native's bytes below, not against itself.)"""
    be = _native_or_none()
    if be is None:
        pytest.skip("no native library")
    rule = ADAM_AMSGRAD.with_state_dtype(KINDS[kind][0])
    for isa in be.supported:
        monkeypatch.setenv("OFFLOAD_ISA", isa)
        for n in (7, 256, 257, 4097, BIG if isa == "avx2" else 20000):
            fused = _compressed_runs(be, rule, kind, param_dtype, n, use_compose=False)
            scheme = _compressed_runs(be, rule, kind, param_dtype, n, use_compose=True)
            assert all(torch.equal(a, b) for a, b in zip(fused, scheme)), (isa, n)


@pytest.mark.backends_by_name
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["p32", "pbf16"])
def test_numba_compressed_equals_native(kind, param_dtype):
    """numba's compressed AMSGrad gives the native kernel's bytes (serial and parallel sizes)."""
    native = _native_or_none()
    try:
        numba_be = K.get_backend("numba")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    if native is None:
        pytest.skip("no native library")
    rule = ADAM_AMSGRAD.with_state_dtype(KINDS[kind][0])
    for n in (7, 257, 70001):
        got = _compressed_runs(numba_be, rule, kind, param_dtype, n, use_compose=False)
        want = _compressed_runs(native, rule, kind, param_dtype, n, use_compose=False)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n
