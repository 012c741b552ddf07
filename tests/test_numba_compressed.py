"""The numba compressed-state kernel (offload/kernels/numba_compressed.py) against the scheme.

The oracle is ``compressed_ref.compose_step`` around the numba backend's own float32 rule
method (decode, the float32 step, encode): the fused kernel must give its bits exactly, for
every rule, state dtype (bf16 nearest / stochastic, packed int8), param dtype, grad dtype,
with and without the low-precision copy, at sizes on and off the 256-element block grid and
on both the serial and the parallel path (2**20 + 3).
"""
from __future__ import annotations

import pytest
import torch

from offload.kernels import quant
from offload.kernels.compressed_ref import compose_step
from offload.kernels.fields import ADAGRAD, ADAM, LION, SGD, SGD_PLAIN

numba_backend = pytest.importorskip("offload.kernels.numba_backend")

# 20000: past the serial kernel's limit (16384), the parallel path; 2**20 + 3 (slow in the
# torch oracle) for the cases that touch every code path at once (BIG_CASES)
SIZES = [1, 7, 15, 16, 17, 255, 256, 257, 4097, 20000]
BIG = (1 << 20) + 3
BIG_CASES = {("int8", False, torch.bfloat16), ("bfloat16", True, torch.float32)}
GRADS = [torch.float32, torch.bfloat16, torch.float16]
CONFIGS = {
    "adam": (ADAM, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                        decoupled=True)),
    "adam_l2_max": (ADAM, dict(lr=1e-2, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.01,
                               decoupled=False, maximize=True, grad_scale=0.5)),
    "sgd_nesterov": (SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    "sgd_damp": (SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    "adagrad": (ADAGRAD, dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, eps=1e-10)),
    "lion": (LION, dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)),
}
# (state_dtype, stochastic_states)
STATE_KINDS = [("bfloat16", False), ("bfloat16", True), ("int8", False)]


class Oracle(numba_backend.NumbaBackend):
    """The numba backend with the scheme's composed step in place of the fused kernel."""

    def _compressed(self, method, *args):
        compose_step(getattr(self, method), *args)


NUMBA = numba_backend.NumbaBackend()
ORACLE = Oracle()


def init_state(field, n, gen):
    """A state of ``n`` values stored as ``field`` (never all zero: decoding matters)."""
    x = torch.randn(n, generator=gen) * 0.1
    if field.name in ("exp_avg_sq", "sum"):
        x = x.abs() * 0.1
    if field.blocked:
        return quant.encode_blocks(x, field.signed)
    return quant.round_bf16_nearest(x) if field.dtype == torch.bfloat16 else x


def run(be, rule, hp, n, *, state_dtype="int8", stochastic=False, param_dtype=torch.float32,
        grad_dtype=torch.float32, lowp_dtype=None, steps=3, grads=None, offset=0, seed=11,
        num_threads=None, states=None, param=None):
    """``steps`` steps of ``rule`` stored as ``state_dtype`` on ``be``; (param, states, lowp).
    Inputs come from a generator seeded by ``n``, so two backends see the same ones."""
    r = rule.with_state_dtype(state_dtype)
    gen = torch.Generator().manual_seed(n + seed)
    p = torch.randn(n, generator=gen).to(param_dtype) if param is None else param.clone()
    st = {f.name: init_state(f, n, gen) for f in r.fields} if states is None else \
        {k: v.clone() for k, v in states.items()}
    lowp = None if lowp_dtype is None else torch.zeros(n, dtype=lowp_dtype)
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * 2).to(grad_dtype) if grads is None else grads[step - 1]
        be.rule_step(r, p, g, st, step=step, param_lowp=lowp, num_threads=num_threads,
                     rounding_seed=quant.rounding_seed(step, seed), element_offset=offset,
                     stochastic_states=stochastic, **hp)
    return p, st, lowp


def bits(t):
    """A tensor's bits, so NaNs and signed zeros compare exactly."""
    if t is None:
        return None
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def assert_same_bits(a, b, what):
    pa, sa, la = a
    pb, sb, lb = b
    assert torch.equal(bits(pa), bits(pb)), f"{what}: param"
    for name in sa:
        assert torch.equal(bits(sa[name]), bits(sb[name])), f"{what}: {name}"
    if la is not None:
        assert torch.equal(bits(la), bits(lb)), f"{what}: param_lowp"


def cases():
    for cfg in CONFIGS:
        for state_dtype, stochastic in STATE_KINDS:
            for param_dtype in (torch.float32, torch.bfloat16):
                yield pytest.param(cfg, state_dtype, stochastic, param_dtype,
                                   id=f"{cfg}-{state_dtype}{'-sr' if stochastic else ''}-"
                                      f"{str(param_dtype)[6:]}")
        # float32 states with a bf16 param (its own master) also take the compressed path
        yield pytest.param(cfg, "float32", False, torch.bfloat16, id=f"{cfg}-float32-bfloat16")


@pytest.mark.parametrize("cfg,state_dtype,stochastic,param_dtype", list(cases()))
def test_numba_equals_composed_step_bit_for_bit(cfg, state_dtype, stochastic, param_dtype):
    rule, hp = CONFIGS[cfg]
    big = (state_dtype, stochastic, param_dtype) in BIG_CASES
    for k, n in enumerate(SIZES + [BIG] * big):
        lowp = torch.bfloat16 if param_dtype == torch.float32 and k % 2 else None
        if lowp is not None and k % 4 == 3:
            lowp = torch.float16
        kw = dict(state_dtype=state_dtype, stochastic=stochastic, param_dtype=param_dtype,
                  grad_dtype=GRADS[k % 3], lowp_dtype=lowp, offset=5 * k,
                  steps=2 if n == BIG else 3)
        assert_same_bits(run(NUMBA, rule, hp, n, **kw), run(ORACLE, rule, hp, n, **kw),
                         f"{cfg} n={n}")


@pytest.mark.parametrize("n", [1, 300, (1 << 20) + 3])
def test_plain_sgd_with_a_bf16_param(n):
    hp = dict(lr=0.1, weight_decay=0.01)
    kw = dict(param_dtype=torch.bfloat16, grad_dtype=torch.bfloat16, offset=n)
    assert_same_bits(run(NUMBA, SGD_PLAIN, hp, n, **kw), run(ORACLE, SGD_PLAIN, hp, n, **kw),
                     f"sgd_plain n={n}")


@pytest.mark.parametrize("state_dtype,stochastic", STATE_KINDS)
def test_threads_and_cuts_do_not_change_bits(state_dtype, stochastic):
    """One call == the same call on 1 or 2 threads == two calls cut at a block boundary
    (the second with element_offset): what shards and sub-groups rely on."""
    rule, hp = CONFIGS["adam"]
    n, cut = (1 << 20) + 3, 3 * 256 * 1024
    kw = dict(state_dtype=state_dtype, stochastic=stochastic, param_dtype=torch.bfloat16,
              steps=1)
    whole = run(NUMBA, rule, hp, n, num_threads=2, **kw)
    assert_same_bits(whole, run(NUMBA, rule, hp, n, num_threads=1, **kw), "threads")
    r = rule.with_state_dtype(state_dtype)
    gen = torch.Generator().manual_seed(n + 11)
    p = torch.randn(n, generator=gen).bfloat16()
    st = {f.name: init_state(f, n, gen) for f in r.fields}
    g = torch.randn(n, generator=gen) * 2
    for lo, hi in ((0, cut), (cut, n)):
        part = {f.name: st[f.name][f.storage_offset(lo):f.storage_numel(hi)] for f in r.fields}
        NUMBA.rule_step(r, p[lo:hi], g[lo:hi], part, step=1, rounding_seed=quant.rounding_seed(1, 11),
                        element_offset=lo, stochastic_states=stochastic, **hp)
    assert_same_bits(whole, (p, st, None), "cut")


@pytest.mark.parametrize("cfg", ["adam", "lion"])
def test_torch_and_numba_agree(cfg):
    """The torch backend's compressed step is the scheme around torch's float32 rule: with
    states the float32 paths compute alike (Adam's decoupled moments, Lion's lerp), the
    stored states are identical and the params within the numerics contract."""
    rule, hp = CONFIGS[cfg]
    import offload.kernels as K
    torch_be = K.get_backend("torch")
    for n in (17, 4097):
        for state_dtype, stochastic in STATE_KINDS:
            kw = dict(state_dtype=state_dtype, stochastic=stochastic, steps=5)
            pn, sn, _ = run(NUMBA, rule, hp, n, **kw)
            pt, st, _ = run(torch_be, rule, hp, n, **kw)
            torch.testing.assert_close(pn, pt, rtol=1e-5, atol=1e-6)
            for name in sn:
                assert torch.equal(bits(sn[name]), bits(st[name])), (cfg, n, state_dtype, name)
