"""Batched steps (``checked_rule_steps``; native: ``offload_rule_steps``, [Note: batched
steps] in native/dispatch.cpp) against each tensor stepped alone, bit for bit.

A batch cuts large tensors into blocks and runs small ones together; the sizes below
interleave the two (a run of small tensors on both sides of a large one, a size one short of
a block, an empty tensor) so that a tensor stepped twice, or not at all, shows here. Steps
differ per tensor: the hyperparameters are bound once per distinct step.
"""
from __future__ import annotations

import ctypes
import errno

import pytest
import torch

from offload.kernels._native_abi import ADAM_STEP, BLOCK_ELEMS
from offload.kernels.fields import ADAGRAD, ADAM, ADAM_AMSGRAD, LION, SGD
from offload.kernels.quant import encode_blocks, rounding_seed
from offload.optim.functional import RuleHyper, rule_step

from test_kernels import backend, _native_or_none  # noqa: F401  (the backend fixture)

BLOCK = BLOCK_ELEMS  # OFFLOAD_BLOCK_ELEMS
SIZES = [300, BLOCK + 5, 7, 0, 17, 2 * BLOCK, 1, BLOCK - 1, BLOCK + BLOCK // 2, 4096, 5000, 3]
STEPS = [3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]

CONFIGS = {
    "adamw": (ADAM, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)),
    "amsgrad": (ADAM_AMSGRAD, dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
                                   decoupled=False)),
    "sgd": (SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)),
    "adagrad": (ADAGRAD, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1)),
    "lion": (LION, dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)),
}


def _initial(field, n):
    if field.blocked:
        return encode_blocks(torch.full((n,), 0.01), field.signed)
    return torch.full((n,), 0.01, dtype=field.dtype)


def _case(rule, param_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(param_dtype) for n in SIZES]
    grads = [torch.randn(n, generator=gen) for n in SIZES]
    states = [[_initial(f, n) for f in rule.fields] for n in SIZES]
    return params, grads, states


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("state_dtype,param_dtype", [("float32", torch.float32), ("bfloat16", torch.float32),
                                                     ("int8", torch.float32), ("float32", torch.bfloat16)])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_equals_each_tensor_alone(backend, name, state_dtype, param_dtype, threads):  # noqa: F811
    if backend.name == "torch":
        pytest.skip("the torch backend steps a batch one tensor at a time (the default loop)")
    base, hp = CONFIGS[name]
    rule = base.with_state_dtype(state_dtype)
    compressed = state_dtype != "float32" or param_dtype != torch.float32
    params, grads, states = _case(rule, param_dtype)
    orig = [p.clone() for p in params]
    ref_p = [p.clone() for p in params]
    ref_s = [[s.clone() for s in st] for st in states]
    seeds = [rounding_seed(s, i) for i, s in enumerate(STEPS)] if compressed else None
    hyper = RuleHyper(base, tuple(hp.items()), grad_scale=0.5)
    rule_step(params, grads, {f.name: [st[j] for st in states] for j, f in enumerate(rule.fields)}, STEPS,
              hyper, backend=backend.name, num_threads=threads, rule=rule, rounding_seeds=seeds)
    for i, n in enumerate(SIZES):
        if n == 0:
            continue
        extra = dict(rounding_seed=seeds[i]) if compressed else {}
        backend.rule_step(rule, ref_p[i], grads[i], {f.name: t for f, t in zip(rule.fields, ref_s[i])},
                          step=STEPS[i], num_threads=1, grad_scale=0.5, **dict(hp, **extra))
    for i, n in enumerate(SIZES):
        assert torch.equal(_bits(params[i]), _bits(ref_p[i])), f"param {i} ({n} elements)"
        for f, got, want in zip(rule.fields, states[i], ref_s[i]):
            assert torch.equal(_bits(got), _bits(want)), f"{f.name} of param {i} ({n} elements)"
        if n >= 7:  # (a 1-element bf16 param's update may round away)
            assert not torch.equal(params[i], orig[i]), f"param {i} was not stepped"


def _bits(t):
    """The raw bits (NaN-safe equality)."""
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(t.dtype, t.dtype))


def test_batch_with_noncontiguous_tensors_writes_them_back(backend):  # noqa: F811
    base, hp = CONFIGS["adamw"]
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(300, 200, generator=gen).t(), torch.randn(BLOCK + 3, generator=gen),
              torch.randn(40, 30, generator=gen)[:, ::2]]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    states = [[torch.zeros(p.shape).t().contiguous().t() if p.dim() == 2 else torch.zeros(p.shape)
               for _ in base.fields] for p in params]
    ref_p = [p.contiguous() for p in params]
    ref_s = [[s.contiguous() for s in st] for st in states]
    hyper = RuleHyper(base, tuple(hp.items()))
    rule_step(params, grads, {f.name: [st[j] for st in states] for j, f in enumerate(base.fields)}, [1, 1, 1],
              hyper, backend=backend.name, num_threads=2)
    for i in range(3):
        backend.rule_step(base, ref_p[i].view(-1), grads[i].contiguous().view(-1),
                          {f.name: t.view(-1) for f, t in zip(base.fields, ref_s[i])}, step=1, **hp)
        assert torch.equal(params[i], ref_p[i]), f"param {i}"
        for f, got, want in zip(base.fields, states[i], ref_s[i]):
            assert torch.equal(got, want), f"{f.name} of param {i}"


def _raw(native, p, g, m, v, grad_dtype=None):
    from offload.kernels.native_backend import GRAD_DTYPES, ISA_CODES
    consts = native._fold((1e-2, 0.9, 0.999, 1e-8, 0.0, 1, True, True, False, 1.0))
    return ADAM_STEP.pack(0, 2, p.numel(), p.data_ptr(), 0, g.data_ptr(),
                          GRAD_DTYPES[g.dtype] if grad_dtype is None else grad_dtype, 0, -1,
                          m.data_ptr(), 0, v.data_ptr(), 0, consts, ISA_CODES[native.isa()], 1, 0, 0)


def test_a_bad_struct_leaves_every_tensor_untouched():
    native = _native_or_none()
    if native is None:
        pytest.skip("native library not built")
    lib = native._lib
    ts = [[torch.randn(n) for _ in range(4)] for n in (BLOCK * 2, 100, 7)]
    before = [[t.clone() for t in four] for four in ts]
    structs = [_raw(native, *ts[0]), _raw(native, *ts[1]), _raw(native, *ts[2], grad_dtype=99)]
    bad = ctypes.c_int64(0)
    rc = lib.offload_rule_steps(b"".join(structs), 3, 2, ctypes.byref(bad))
    assert rc == -errno.EINVAL and bad.value == 2
    for four, was in zip(ts, before):
        for t, w in zip(four, was):
            assert torch.equal(t, w)
    # the call's own arguments
    assert lib.offload_rule_steps(b"".join(structs[:2]), -1, 1, ctypes.byref(bad)) == -errno.EINVAL
    assert bad.value == -1
    assert lib.offload_rule_steps(b"".join(structs[:2]), 2, 0, None) == -errno.EINVAL
    assert lib.offload_rule_steps(None, 0, 1, None) == 0
    assert lib.offload_rule_steps(b"".join(structs[:2]), 2, 2, ctypes.byref(bad)) == 0 and bad.value == -1
    assert not torch.equal(ts[0][0], before[0][0]) and not torch.equal(ts[1][0], before[1][0])


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512vbmi"])
def test_prefetch_on_and_off_give_the_same_bits(monkeypatch, isa):
    """Prefetch is a hint ([Note: software prefetch] in native/kernel.h): forced on and off,
    every loop that issues it (fp32 Adam, AMSGrad, the one-state rules, the fused bf16 Adam)
    gives the same bits, including over a range's last 512 elements."""
    native = _native_or_none()
    if native is None or isa not in native.supported:
        pytest.skip(f"native library not built or CPU lacks {isa}")
    monkeypatch.setenv("OFFLOAD_ISA", isa)
    results = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("OFFLOAD_PREFETCH", mode)
        out = []
        for name, (base, hp) in CONFIGS.items():
            for state_dtype in ("float32", "bfloat16") if name == "adamw" else ("float32",):
                rule = base.with_state_dtype(state_dtype)
                params, grads, states = _case(rule, torch.float32, seed=3)
                seeds = [rounding_seed(2, i) for i in range(len(SIZES))] if state_dtype != "float32" else None
                rule_step(params, grads, {f.name: [st[j] for st in states] for j, f in enumerate(rule.fields)},
                          [2] * len(SIZES), RuleHyper(base, tuple(hp.items())), backend="native", num_threads=2,
                          rule=rule, rounding_seeds=seeds)
                out += [_bits(t) for t in params] + [_bits(t) for st in states for t in st]
        results[mode] = out
    assert len(results["on"]) == len(results["off"])
    for k, (a, b) in enumerate(zip(results["on"], results["off"])):
        assert torch.equal(a, b), f"tensor {k}"


def test_prefetch_switch_refuses_unknown_values(monkeypatch):
    native = _native_or_none()
    if native is None:
        pytest.skip("native library not built")
    monkeypatch.setenv("OFFLOAD_PREFETCH", "sometimes")
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    with pytest.raises(ValueError, match="OFFLOAD_PREFETCH='sometimes' is not one of auto, on, off"):
        native.rule_step(ADAM, p, g, {"exp_avg": m, "exp_avg_sq": v}, step=1, lr=1e-3, beta1=0.9,
                         beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    monkeypatch.delenv("OFFLOAD_PREFETCH")
    raw = bytearray(_raw(native, p, g, m, v))
    from offload.kernels._native_abi import StepArgs
    raw[StepArgs.prefetch.offset:StepArgs.prefetch.offset + 4] = (7).to_bytes(4, "little")
    assert native._lib.offload_rule_step(bytes(raw)) == -errno.EINVAL
    assert torch.equal(p, torch.zeros(8))
