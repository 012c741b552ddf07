"""SGD, Adagrad and Lion kernels (issue #15): every backend and ISA against torch.

References: torch.optim.SGD / Adagrad with foreach=False (torch's _single_tensor_* code) and
a plain-torch Lion (lion-pytorch's update_fn in its lerp form), 20+ steps, held to the
numerics contract (DESIGN.md: rtol 1e-5, atol 1e-6). The SIMD units must agree bit for bit
with each other and with the numba kernels (same single roundings: FMA where torch's
vectorized kernels fuse), so a drift in one of them shows here before it shows in training.
"""
from __future__ import annotations

import pytest
import torch

import offload.kernels as K
from offload.kernels.fields import ADAGRAD, ADAM, LION, SGD, SGD_PLAIN

from test_kernels import backend, _native_or_none  # noqa: F401  (the backend fixture)

BIG = 2**20 + 3
SIZES = [1, 7, 15, 16, 17, 4097]
STEPS = 21
RTOL, ATOL = 1e-5, 1e-6

# (rule, hyperparameters): flags and both lerp directions of Lion (w = 1 - beta < 0.5
# lerps from the start, >= 0.5 from the end)
CONFIGS = [
    (SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (SGD, dict(lr=0.05, momentum=0.8, nesterov=True, maximize=True, grad_scale=0.5)),
    (SGD, dict(lr=0.05, momentum=0.0, weight_decay=0.1)),
    (SGD_PLAIN, dict(lr=0.05, weight_decay=0.1, grad_scale=2.0)),
    (ADAGRAD, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1)),
    (ADAGRAD, dict(lr=0.1, eps=1e-6, maximize=True, grad_scale=0.25)),
    (LION, dict(lr=1e-3, weight_decay=0.1)),
    (LION, dict(lr=1e-3, beta1=0.3, beta2=0.2, maximize=True, grad_scale=0.5)),
]
CONFIG_IDS = [f"{r.name}{i}" for i, (r, _) in enumerate(CONFIGS)]


def _grads(n, steps, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(steps)]


def _torch_optim(rule, hp, p0, grads):
    """torch.optim's result and states, each grad given as float(grad) * grad_scale (the
    kernels' multiply, in float32, before maximize's negation)."""
    hp = dict(hp)
    gs = hp.pop("grad_scale", 1.0)
    p = p0.clone().requires_grad_(True)
    if rule in (SGD, SGD_PLAIN):
        opt = torch.optim.SGD([p], foreach=False, **hp)
    else:
        opt = torch.optim.Adagrad([p], foreach=False, **hp)
    for g in grads:
        p.grad = g.float() * gs
        opt.step()
    state = opt.state[p]
    states = {f.name: state[f.name] for f in rule.fields if f.name in state}
    return p.detach(), states


def _torch_lion(hp, p0, grads):
    """lion-pytorch's update_fn (lerp form), plus maximize and grad_scale."""
    lr, wd = hp["lr"], hp.get("weight_decay", 0.0)
    beta1, beta2 = hp.get("beta1", 0.9), hp.get("beta2", 0.99)
    p, exp_avg = p0.clone(), torch.zeros_like(p0)
    for g in grads:
        g = g.float() * hp.get("grad_scale", 1.0)
        if hp.get("maximize"):
            g = -g
        p.mul_(1 - lr * wd)
        update = exp_avg.clone().lerp_(g, 1 - beta1).sign_()
        p.add_(update, alpha=-lr)
        exp_avg.lerp_(g, 1 - beta2)
    return p, {"exp_avg": exp_avg}


def _reference(rule, hp, p0, grads):
    return _torch_lion(hp, p0, grads) if rule is LION else _torch_optim(rule, hp, p0, grads)


def _fresh_states(rule, n):
    # Adagrad's sum starts at initial_accumulator_value (0 by default), as torch's
    return {f.name: torch.zeros(n) for f in rule.fields}


def _run(be, rule, hp, p0, grads, *, lowp_dtype=None, num_threads=None):
    p = p0.clone()
    states = _fresh_states(rule, p.numel())
    lowp = None if lowp_dtype is None else torch.empty(p.numel(), dtype=lowp_dtype)
    for step, g in enumerate(grads, start=1):
        be.rule_step(rule, p, g, states, step=step, param_lowp=lowp, num_threads=num_threads, **hp)
    return p, states, lowp


def _assert_close(ours, ref, what):
    bad = ~torch.isclose(ours, ref, rtol=RTOL, atol=ATOL)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, e.g. index "
                           f"{int(bad.nonzero()[0])}: {ours[bad][0].item()} vs {ref[bad][0].item()}")


_inputs_cache = {}


def _inputs(rule, hp, n, seed, grad_dtype):
    """(p0, grads, reference result): the same for every backend, so built once per run."""
    key = (rule.name, repr(sorted(hp.items())), n, seed, grad_dtype)
    if key not in _inputs_cache:
        if len(_inputs_cache) > 4:  # keep a few (the big ones hold ~100 MB each)
            _inputs_cache.clear()
        p0 = torch.randn(n, generator=torch.Generator().manual_seed(1000 + n))
        grads = _grads(n, STEPS, seed + n, grad_dtype)
        _inputs_cache[key] = (p0, grads, _reference(rule, hp, p0, grads))
    return _inputs_cache[key]


def _check(be, rule, hp, n, seed=0, grad_dtype=torch.float32, lowp_dtype=None):
    p0, grads, (ref_p, ref_states) = _inputs(rule, hp, n, seed, grad_dtype)
    p, states, lowp = _run(be, rule, hp, p0, grads, lowp_dtype=lowp_dtype)
    _assert_close(p, ref_p, f"{rule.name} param n={n}")
    for name, ref in ref_states.items():
        _assert_close(states[name], ref, f"{rule.name} {name} n={n}")
    if lowp is not None:  # the copy is our own param rounded, bit for bit
        assert torch.equal(lowp.view(torch.int16), p.to(lowp_dtype).view(torch.int16))
    return p, states


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rule,hp", CONFIGS, ids=CONFIG_IDS)
def test_matches_torch(backend, rule, hp, n):
    _check(backend, rule, hp, n)


@pytest.mark.parametrize("rule,hp", [CONFIGS[0], CONFIGS[4], CONFIGS[7]], ids=["sgd", "adagrad", "lion"])
def test_matches_torch_large(backend, rule, hp):
    _check(backend, rule, hp, BIG)


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16], ids=["lbf16", "lf16"])
@pytest.mark.parametrize("rule,hp", CONFIGS, ids=CONFIG_IDS)
def test_bf16_grad_and_lowp_copy(backend, rule, hp, lowp_dtype):
    _check(backend, rule, hp, 4097 + 5, grad_dtype=torch.bfloat16, lowp_dtype=lowp_dtype)


@pytest.mark.parametrize("rule,hp", [CONFIGS[0], CONFIGS[4], CONFIGS[6]], ids=["sgd", "adagrad", "lion"])
def test_fp16_grad(backend, rule, hp):
    _check(backend, rule, hp, 333, grad_dtype=torch.float16)


def test_sgd_without_momentum_leaves_the_buffer(backend):
    # torch keeps no buffer at momentum 0 and leaves an existing one untouched
    buf = torch.full((17,), 3.0)
    p = torch.randn(17)
    backend.rule_step(SGD, p, torch.randn(17), {"momentum_buffer": buf}, step=5, lr=0.1,
                      momentum=0.0)
    assert torch.equal(buf, torch.full((17,), 3.0))


def test_sgd_first_step_copies_d_p_without_dampening(backend):
    p, g = torch.randn(4099), torch.randn(4099)
    buf = torch.full((4099,), 7.0)  # whatever it held: step 1 overwrites it
    backend.rule_step(SGD, p.clone(), g, {"momentum_buffer": buf}, step=1, lr=0.1,
                      momentum=0.9, dampening=0.5, weight_decay=0.0)
    assert torch.equal(buf, g)


def _bit_runs(native, monkeypatch, isa, rule, hp, n, grad_dtype, lowp_dtype):
    if isa is None:
        be = K.get_backend("numba")
    else:
        monkeypatch.setenv("OFFLOAD_ISA", isa)
        be = native
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    grads = _grads(n, 5, n + 7, grad_dtype)
    p, states, lowp = _run(be, rule, hp, p0, grads, lowp_dtype=lowp_dtype)
    return [p] + list(states.values()) + ([] if lowp is None else [lowp.view(torch.int16)])


# Adam too: the scalar unit once wrote its FMAs as a multiply and an add, and alone differed
ADAM_BIT_CONFIGS = [
    (ADAM, dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, decoupled=True)),
    (ADAM, dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, decoupled=False,
                maximize=True, grad_scale=0.5)),
]


# Lion lerping from the start (betas > 0.5, its defaults) with a scaled grad: numba's "contract"
# fused the caller's grad * scale into the moment's subtraction, one ulp off from step 2
LION_BIT_CONFIGS = [(LION, dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_scale=0.7))]


@pytest.mark.parametrize("rule,hp", CONFIGS + ADAM_BIT_CONFIGS + LION_BIT_CONFIGS,
                         ids=CONFIG_IDS + ["adamw", "adam_l2", "lion_scaled"])
def test_units_and_numba_give_identical_bits(monkeypatch, rule, hp):
    # AVX-512, AVX2 and the scalar unit use one rounding per FMA (std::fma in the scalar
    # one), and numba calls llvm.fma: the same bits, tails and streamed copies included.
    # Every unit this CPU has (an AVX2-only one compares AVX2, scalar and numba).
    native = _native_or_none()
    if native is None:
        pytest.skip("needs the native library")
    impls = [isa for isa in ("avx512", "avx2", "scalar") if isa in native.supported]
    try:
        K.get_backend("numba")
        impls.append(None)
    except RuntimeError:
        pass
    for n, gd, ld in [(1, torch.float32, None), (15, torch.bfloat16, torch.bfloat16),
                      (4097, torch.float16, torch.float16), (70001, torch.float32, None),
                      ((1 << 20) + 9, torch.bfloat16, torch.bfloat16)]:
        runs = [_bit_runs(native, monkeypatch, isa, rule, hp, n, gd, ld) for isa in impls]
        for isa, run in zip(impls[1:], runs[1:]):
            for a, b in zip(runs[0], run):
                assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                   b.view(torch.int32) if b.dtype == torch.float32 else b), \
                    (rule.name, n, isa or "numba")


@pytest.mark.parametrize("rule,hp", [CONFIGS[1], CONFIGS[5], CONFIGS[7]], ids=["sgd", "adagrad", "lion"])
def test_threads_give_identical_results(backend, rule, hp):
    n = 3 * (1 << 16) + 5
    p0, grads = torch.randn(n), _grads(n, 3, 5)
    one = _run(backend, rule, hp, p0, grads, num_threads=1)
    two = _run(backend, rule, hp, p0, grads, num_threads=2)
    assert torch.equal(one[0], two[0])
    for name in one[1]:
        assert torch.equal(one[1][name], two[1][name])


BAD_HYPER = [
    (SGD, dict(lr=-0.1, momentum=0.9), ValueError, "Invalid learning rate: -0.1"),
    (SGD, dict(lr=0.1, momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
    (SGD, dict(lr=0.1, momentum=0.9, weight_decay=-1.0), ValueError, "Invalid weight_decay value: -1.0"),
    (SGD, dict(lr=0.1), TypeError, "missing ['momentum']"),
    (SGD, dict(lr=0.1, momentum=0.9, betas=(0.9, 0.99)), TypeError, "unexpected ['betas']"),
    (SGD, dict(lr=0.1, momentum="0.9"), TypeError, "momentum must be a float"),
    (SGD_PLAIN, dict(lr=0.1, momentum=0.9), TypeError, "unexpected ['momentum']"),
    (ADAGRAD, dict(lr=0.1, lr_decay=-0.1), ValueError, "Invalid lr_decay value: -0.1"),
    (ADAGRAD, dict(lr=0.1, eps=-1e-10), ValueError, "Invalid epsilon value: -1e-10"),
    (ADAGRAD, dict(lr=float("nan")), ValueError, "Invalid learning rate: nan"),
    (ADAGRAD, dict(lr=0.1, maximize=1), TypeError, "maximize must be a bool"),
    (ADAGRAD, dict(lr=0.1, grad_scale=-1.0), ValueError, "grad_scale must be a finite number"),
    (LION, dict(lr=1e-4, beta1=1.5), ValueError, "Invalid beta parameter at index 0: 1.5"),
    (LION, dict(lr=1e-4, beta2=-0.1), ValueError, "Invalid beta parameter at index 1: -0.1"),
    (LION, dict(beta1=0.9), TypeError, "missing ['lr']"),
]


@pytest.mark.parametrize("edit", [dict(dampening=0.3), dict(momentum=0.0)], ids=["dampening", "no_momentum"])
def test_sgd_nesterov_edited_past_torch_constructor_check_steps_as_torch(backend, edit):
    # torch.optim.SGD refuses these in its constructor only; its step takes a group edited so
    hp = dict(lr=0.05, momentum=0.9, nesterov=True, dampening=0.0, weight_decay=0.1)
    for n in (17, 4097):
        p0, grads = torch.randn(n, generator=torch.Generator().manual_seed(n)), _grads(n, STEPS, n)
        ref = p0.clone().requires_grad_(True)
        opt = torch.optim.SGD([ref], foreach=False, **hp)
        opt.param_groups[0].update(edit)
        for g in grads:
            ref.grad = g.clone()
            opt.step()
        p, states, _ = _run(backend, SGD, {**hp, **edit}, p0, grads)
        _assert_close(p, ref.detach(), f"sgd nesterov {edit} n={n}")
        if edit.get("momentum", 0.9):
            _assert_close(states["momentum_buffer"], opt.state[ref]["momentum_buffer"], f"buffer n={n}")


@pytest.mark.parametrize("rule,hp,exc,words", BAD_HYPER, ids=[str(i) for i in range(len(BAD_HYPER))])
def test_bad_hyperparameters_refused_by_name(backend, rule, hp, exc, words):
    p, g = torch.randn(9), torch.randn(9)
    before = p.clone()
    states = _fresh_states(rule, 9)
    with pytest.raises(exc) as info:
        backend.rule_step(rule, p, g, states, step=1, **hp)
    assert words in str(info.value)
    assert torch.equal(p, before)  # refused before any memory is touched


def test_bad_states_refused_by_name(backend):
    p, g = torch.randn(9), torch.randn(9)
    with pytest.raises(ValueError, match=r"keeps the states \['sum'\]; missing \['sum'\], "
                                         r"unexpected \['exp_avg'\]"):
        backend.rule_step(ADAGRAD, p, g, {"exp_avg": torch.zeros(9)}, step=1, lr=0.1)
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['momentum_buffer'\]"):
        backend.rule_step(SGD_PLAIN, p, g, {"momentum_buffer": torch.zeros(9)}, step=1, lr=0.1)
    with pytest.raises(TypeError, match=r"exp_avg must have dtype in \(torch.float32\), got torch.bfloat16"):
        backend.rule_step(LION, p, g, {"exp_avg": torch.zeros(9, dtype=torch.bfloat16)}, step=1, lr=0.1)
    with pytest.raises(ValueError, match="momentum_buffer has 8 elements, param has 9"):
        backend.rule_step(SGD, p, g, {"momentum_buffer": torch.zeros(8)}, step=1, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="step must be an integer >= 1"):
        backend.rule_step("lion", p, g, {"exp_avg": torch.zeros(9)}, step=0, lr=0.1)
    with pytest.raises(ValueError, match="unknown optimizer rule 'rmsprop'"):
        backend.rule_step("rmsprop", p, g, {}, step=1, lr=0.1)


def test_rules_by_name():
    from offload.kernels.fields import RULES
    assert RULES["sgd"] is SGD and RULES["sgd_plain"] is SGD_PLAIN
    assert RULES["adagrad"].names == ("sum",) and RULES["lion"].names == ("exp_avg",)
    assert SGD_PLAIN.fields == ()


def test_lion_sign_of_zero_is_zero(backend):
    # torch's sign(0) is 0: a zero grad on a zero moment moves the param by its decay only
    n = 4099
    p = torch.randn(n)
    g = torch.zeros(n)
    g[::3] = torch.randn(len(range(0, n, 3)))
    ours = p.clone()
    backend.rule_step(LION, ours, g, {"exp_avg": torch.zeros(n)}, step=1, lr=0.5, weight_decay=0.1)
    ref, _ = _torch_lion(dict(lr=0.5, weight_decay=0.1), p, [g])
    assert torch.equal(ours, ref)
    assert torch.equal(ours[1::3], p[1::3] * (1 - 0.5 * 0.1))


def test_numpy_and_tensor_hyperparameters_read_as_floats(backend):
    # torch.optim takes a tensor lr; numpy scalars come from configs: both are numbers here
    import numpy as np
    n = 33
    p0, grads = torch.randn(n), _grads(n, 3, 11)
    plain = _run(backend, ADAGRAD, dict(lr=0.1, eps=1e-6), p0, grads)[0]
    odd = _run(backend, ADAGRAD, dict(lr=torch.tensor(0.1), eps=np.float64(1e-6)), p0, grads)[0]
    assert torch.equal(plain, odd)
    with pytest.raises(TypeError, match="lr must be a float, got Tensor"):
        backend.rule_step(LION, torch.randn(3), torch.randn(3), {"exp_avg": torch.zeros(3)},
                          step=1, lr=torch.ones(2))


def test_folds_round_once_to_float32():
    from array import array

    from offload.kernels.rule_consts import fold_adagrad, fold_lion, fold_sgd

    def f32(x):
        return array("f", [x])[0]

    c = fold_adagrad(0.1, 0.01, 0.0, 1e-10, False, 1.0, 11)
    assert c.neg_clr == f32(-(0.1 / (1 + 10 * 0.01))) and c.eps == f32(1e-10) and not c.use_wd
    # Lion's lerps: w = 1 - beta; from the start below 0.5, else w - 1 from the end
    c = fold_lion(1e-4, 0.9, 0.3, 0.1, True, 0.5)
    assert (c.coeff1, c.from_end1) == (f32(1 - 0.9), False)
    assert (c.coeff2, c.from_end2) == (f32(f32(1 - 0.3) - 1.0), True)
    assert c.grad_scale == -0.5 and c.decay == f32(1 - 1e-4 * 0.1) and c.neg_lr == f32(-1e-4)
    # SGD's buffer modes: none at momentum 0, torch's clone on step 1, then the update
    assert [fold_sgd(0.1, m, 0.0, 0.0, False, False, 1.0, s).momentum_mode
            for m, s in ((0.0, 1), (0.9, 1), (0.9, 2))] == [0, 1, 2]
    # past float32's range: an infinity, as C's cast (not struct's OverflowError)
    assert fold_sgd(0.1, 0.9, 0.0, 1e300, False, False, 1.0, 3).weight_decay == float("inf")


@pytest.mark.parametrize("n", [17, 4097])
@pytest.mark.parametrize("rule,hp", [CONFIGS[0], CONFIGS[1], CONFIGS[4], CONFIGS[6], CONFIGS[7]],
                         ids=["sgd", "sgd-nesterov", "adagrad", "lion", "lion-from-end"])
def test_nonfinite_grads_propagate_like_torch(backend, rule, hp, n):
    # NaN and infinities in the vector body and in the tail; Lion's sign of a NaN is 0, so
    # its param keeps moving by its decay while its moment turns NaN, as in torch
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    grads = _grads(n, 4, n)
    for k, bad in zip((0, n // 2, n - 1), (float("nan"), float("inf"), -float("inf"))):
        grads[1][k] = bad
    p, states, _ = _run(backend, rule, hp, p0, grads)
    ref_p, ref_states = _reference(rule, hp, p0, grads)
    assert torch.isclose(p, ref_p, rtol=RTOL, atol=ATOL, equal_nan=True).all()
    for name, ref in ref_states.items():
        assert torch.isclose(states[name], ref, rtol=RTOL, atol=ATOL, equal_nan=True).all()
    assert not torch.isfinite(p).all() or rule is LION


@pytest.mark.parametrize("offset", [0, 1, 7, 9, 15])
@pytest.mark.parametrize("rule,hp", [CONFIGS[0], CONFIGS[5], CONFIGS[7]], ids=["sgd", "adagrad", "lion"])
def test_streamed_lowp_copy_at_any_alignment(backend, rule, hp, offset):
    # a copy of >= 2**20 elements is written with non-temporal stores after a peel to the
    # first aligned address: every element right, nothing written outside the view
    n = (1 << 20) + 37
    sentinel = torch.full((n + 32,), 0x1234, dtype=torch.int16)
    buf = sentinel.clone().view(torch.bfloat16)
    lowp = buf[offset:offset + n]
    p = torch.randn(n, generator=torch.Generator().manual_seed(offset))
    backend.rule_step(rule, p, torch.randn(n), _fresh_states(rule, n), step=2,
                      param_lowp=lowp, num_threads=2, **hp)
    assert torch.equal(lowp.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
    raw = buf.view(torch.int16)
    assert torch.equal(raw[:offset], sentinel[:offset])
    assert torch.equal(raw[offset + n:], sentinel[offset + n:])
