"""Late steps, where Adam's bias correction of the second moment rounds to one.

Once beta2**step < ~2**-25 the folded ``bc2_sqrt`` is exactly 1.0f, and the native units skip
the division by it ([Note: a bias correction of one] in native/kernel.h). x / 1.0f is x for
every float, so the bits must not move: each ISA against numba (which divides) and, for
float32 states, against torch.optim (foreach=False) itself (the moments bit for bit), on the
steps on both sides of the switch. Every case asserts the constant it means to exercise, so a change in folding
cannot turn the test into one that never takes the skip.
"""
from __future__ import annotations

import pytest
import torch

import offload.kernels as K
from offload.kernels import quant
from offload.kernels.adam_consts import fold_adam
from offload.kernels.fields import ADAM, ADAM_AMSGRAD

from test_kernels import _native_or_none

NATIVE = _native_or_none()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="native library not built")
ISAS = NATIVE.supported if NATIVE is not None else []
SIZES = [1, 17, 4097, 70_003]

# (hyperparameters, the last step whose bc2_sqrt is below one, the first where it is one)
LATE = {
    "adamw-0.95": (dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True), 324, 325),
    "adam-l2-0.999": (dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, decoupled=False,
                           maximize=True, grad_scale=0.5), 16_627, 16_628),
}
STATES = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}


def _bc2(hp, step):
    return fold_adam(step=step, **hp).bc2_sqrt


@pytest.mark.parametrize("case", list(LATE))
def test_the_cases_straddle_the_switch(case):
    hp, before, first = LATE[case]
    assert _bc2(hp, before) < 1.0
    assert _bc2(hp, first) == 1.0 and _bc2(hp, first + 10**6) == 1.0


def _states(rule, n, gen):
    m = torch.randn(n, generator=gen) * 0.01
    v = torch.rand(n, generator=gen) * 1e-4
    out = {}
    for f, x in zip(rule.fields, (m, v, v * 1.5)):
        out[f.name] = quant.encode_blocks(x, f.signed) if f.blocked else x.to(f.dtype)
    return out


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _steps(be, rule, hp, n, steps, stochastic):
    gen = torch.Generator().manual_seed(n + steps[0])
    p = torch.randn(n, generator=gen)
    st = _states(rule, n, gen)
    for step in steps:
        g = torch.randn(n, generator=gen) * 0.1
        g[: min(n, 3)] = torch.tensor([0.0, 1e30, -1e-30])[: min(n, 3)]  # 0, a huge and a tiny grad
        be.rule_step(rule, p, g, st, step=step, num_threads=2, rounding_seed=quant.rounding_seed(step, 3),
                     element_offset=0, stochastic_states=stochastic, **hp)
    return [p] + [st[k] for k in sorted(st)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", list(STATES))
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("case", list(LATE))
def test_native_equals_numba_across_the_switch(monkeypatch, isa, kind, amsgrad, case):
    hp, before, first = LATE[case]
    rule = (ADAM_AMSGRAD if amsgrad else ADAM).with_state_dtype(STATES[kind])
    numba = K.get_backend("numba")
    monkeypatch.setenv("OFFLOAD_ISA", isa)
    for n in SIZES:
        for stochastic in ((False, True) if kind == "bf16" else (False,)):
            steps = [before - 1, before, first, first + 1]
            a = _steps(NATIVE, rule, hp, n, steps, stochastic)
            b = _steps(numba, rule, hp, n, steps, stochastic)
            for i, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(_bytes(x), _bytes(y)), (n, stochastic, i)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("case", list(LATE))
def test_fp32_native_gives_torch_bits_after_the_switch(monkeypatch, isa, amsgrad, case):
    hp, before, first = LATE[case]
    if hp["decoupled"] is False and hp["weight_decay"]:
        hp = dict(hp, weight_decay=0.0)  # torch's L2 add is not an FMA: the contract is rtol there
    hp = {k: v for k, v in hp.items() if k != "grad_scale"}
    monkeypatch.setenv("OFFLOAD_ISA", isa)
    n = 4097
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(n, generator=gen)
    m0, v0 = torch.randn(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 1e-4
    grads = [torch.randn(n, generator=gen) * 0.1 for _ in range(3)]
    ref = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if hp["decoupled"] else torch.optim.Adam
    opt = cls([ref], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
              weight_decay=hp["weight_decay"], maximize=hp.get("maximize", False), amsgrad=amsgrad,
              foreach=False)
    opt.state[ref] = {"step": torch.tensor(float(first - 2)), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    if amsgrad:
        opt.state[ref]["max_exp_avg_sq"] = v0.clone()
    rule = ADAM_AMSGRAD if amsgrad else ADAM
    p = p0.clone()
    st = {"exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    if amsgrad:
        st["max_exp_avg_sq"] = v0.clone()
    for step, g in zip(range(first - 1, first + 2), grads):
        ref.grad = g.clone()
        opt.step()
        NATIVE.rule_step(rule, p, g, st, step=step, num_threads=1, **hp)
    # the moments are torch's bits; the param is held to the numerics contract (a few
    # elements in 4097 differ in the last bit before the switch too: torch's addcdiv)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=0)
    for k, t in st.items():
        assert torch.equal(_bytes(t), _bytes(opt.state[ref][k])), k
