"""The kernels' step faces: ``rule_step`` (states by field name) and the typed C struct.

``rule_step(ADAM, ...)`` must give the bits ``adam_step`` gives, on every backend; bad
states are refused by name before any memory is touched; the native library is refused when
its ``struct offload_step_args`` is not the layout ``offload.kernels._native_abi`` mirrors.
"""
from __future__ import annotations

import ctypes
import errno

import pytest
import torch

import offload.kernels as K
from offload.kernels import native_backend, registry
from offload.kernels._native_abi import ADAM_CONSTS, ADAM_STEP, MAX_STATES, StepArgs
from offload.kernels.adam_consts import fold_adam
from offload.kernels.fields import ADAM, Rule, StateField

from test_kernels import backend, _native_or_none  # noqa: F401  (the backend fixture, every backend and ISA)

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _native():
    return _native_or_none()


def _tensors(n, seed, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
    return p, g, torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01


CASES = {
    "adamw-bf16-lowp": dict(grad_dtype=torch.bfloat16, lowp=torch.bfloat16,
                            kw=dict(weight_decay=0.1, decoupled=True)),
    "adam_l2-f16-maximize": dict(grad_dtype=torch.float16, lowp=torch.float16,
                                 kw=dict(weight_decay=0.05, decoupled=False, maximize=True)),
    "f32-scaled-nobc": dict(grad_dtype=torch.float32, lowp=None,
                            kw=dict(weight_decay=0.0, decoupled=True, grad_scale=0.25,
                                    bias_correction=False)),
}


@pytest.mark.parametrize("n", [1, 17, 4097, 2**20 + 3])
@pytest.mark.parametrize("case", list(CASES))
def test_rule_step_gives_the_bits_of_adam_step(backend, case, n):
    c = CASES[case]
    a = _tensors(n, n, c["grad_dtype"])
    b = [t.clone() for t in a]
    lowp = [None if c["lowp"] is None else torch.empty(n, dtype=c["lowp"]) for _ in range(2)]
    for step in (1, 2, 3):
        backend.adam_step(*a, step=step, param_lowp=lowp[0], num_threads=2, **HP, **c["kw"])
        # the states in the other order: the rule's field names place them, not the order
        backend.rule_step(ADAM, b[0], b[1], {"exp_avg_sq": b[3], "exp_avg": b[2]}, step=step,
                          param_lowp=lowp[1], num_threads=2, **HP, **c["kw"])
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int32 if x.dtype == torch.float32 else torch.int16),
                           y.view(torch.int32 if y.dtype == torch.float32 else torch.int16))
    if lowp[0] is not None:
        assert torch.equal(lowp[0].view(torch.int16), lowp[1].view(torch.int16))


def test_rule_step_takes_the_rule_by_name(backend):
    a = _tensors(33, 1)
    b = [t.clone() for t in a]
    backend.rule_step(ADAM, a[0], a[1], {"exp_avg": a[2], "exp_avg_sq": a[3]}, step=4,
                      weight_decay=0.1, decoupled=True, **HP)
    backend.rule_step("adam", b[0], b[1], {"exp_avg": b[2], "exp_avg_sq": b[3]}, step=4,
                      weight_decay=0.1, decoupled=True, **HP)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _bad(backend, states=None, rule=ADAM, **kw):
    p, g, m, v = _tensors(8, 2)
    states = {"exp_avg": m, "exp_avg_sq": v} if states is None else states
    before = [t.clone() for t in (p, m, v)]
    hyper = {**HP, "weight_decay": 0.0, "decoupled": True, **kw}
    try:
        backend.rule_step(rule, p, g, states, step=1, **hyper)
    finally:  # refused before any memory is touched
        assert all(torch.equal(x, y) for x, y in zip(before, (p, m, v)))


def test_rule_step_refuses_bad_states_by_name(backend):
    m, v = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"rule 'adam' keeps the states \['exp_avg', 'exp_avg_sq'\]; "
                                         r"missing \['exp_avg_sq'\], unexpected \[\]"):
        _bad(backend, {"exp_avg": m})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['momentum'\]"):
        _bad(backend, {"exp_avg": m, "exp_avg_sq": v, "momentum": v})
    with pytest.raises(ValueError, match=r"missing \['exp_avg_sq'\], unexpected \['exp_avg_sqr'\]"):
        _bad(backend, {"exp_avg": m, "exp_avg_sqr": v})
    with pytest.raises(TypeError, match=r"exp_avg_sq must have dtype in \(torch.float32\), got torch.bfloat16"):
        _bad(backend, {"exp_avg": m, "exp_avg_sq": v.bfloat16()})
    with pytest.raises(ValueError, match="exp_avg has 9 elements, param has 8"):
        _bad(backend, {"exp_avg": torch.zeros(9), "exp_avg_sq": v})
    with pytest.raises(ValueError, match=r"exp_avg_sq must be contiguous"):
        _bad(backend, {"exp_avg": m, "exp_avg_sq": torch.zeros(16)[::2]})
    with pytest.raises(ValueError, match=r"exp_avg_sq carries torch's lazy negation"):  # memory holds -v
        _bad(backend, {"exp_avg": m, "exp_avg_sq": torch._neg_view(v)})
    with pytest.raises(TypeError, match="states must be a mapping of state name to tensor, got tuple"):
        _bad(backend, (m, v))


def test_rule_step_refuses_rules_and_hyperparameters_it_lacks(backend):
    with pytest.raises(ValueError, match=r"unknown optimizer rule 'rmsprop'; the kernels implement "
                                         r"\['adagrad', 'adam', 'adam_amsgrad', 'lion', 'sgd', 'sgd_plain'\]"):
        _bad(backend, rule="rmsprop")
    # bf16 and int8 states are kernels' forms (Rule.with_state_dtype); fp16 states, or a
    # mix of forms, are not
    fp16_adam = Rule("adam", (StateField("exp_avg", torch.float16), StateField("exp_avg_sq", torch.float16)))
    with pytest.raises(ValueError, match="no kernel for rule 'adam' with fields .*float16"):
        _bad(backend, rule=fp16_adam)
    mixed = Rule("adam", (StateField("exp_avg", torch.bfloat16), StateField("exp_avg_sq")))
    with pytest.raises(ValueError, match="no kernel for rule 'adam' with fields .*bfloat16"):
        _bad(backend, rule=mixed)
    with pytest.raises(TypeError, match="rule must be an offload.kernels.fields.Rule or its name, got int"):
        _bad(backend, rule=0)
    with pytest.raises(TypeError, match=r"rule 'adam' takes .*; missing \['eps'\], unexpected \['betas'\]"):
        p, g, m, v = _tensors(8, 2)
        backend.rule_step(ADAM, p, g, {"exp_avg": m, "exp_avg_sq": v}, step=1, lr=1e-3,
                          beta1=0.9, beta2=0.999, weight_decay=0.0, decoupled=True, betas=(0.9, 0.99))


# ---------------------------------------------------------------- the C struct


def test_packer_writes_the_fields_of_the_ctypes_mirror():
    c = fold_adam(lr=1e-3, beta1=0.3, beta2=0.99, eps=1e-8, weight_decay=0.1, step=5,
                  decoupled=False, maximize=True, grad_scale=0.5)
    raw = ADAM_STEP.pack(0, 2, 12345, 0x1000, 0, 0x2000, 2, 0x3000, 1, 0x4000, 0, 0x5000, 0,
                         ADAM_CONSTS.pack(*c), 1, 3, 2, 1)
    assert len(raw) == ctypes.sizeof(StepArgs)
    a = StepArgs.from_buffer_copy(raw)
    assert (a.rule, a.num_states, a.n, a.isa, a.num_threads, a.prefetch, a.pool) == (0, 2, 12345, 1, 3, 2, 1)
    arrays = [a.param, a.grad, a.lowp] + [a.states[k] for k in range(MAX_STATES)]
    assert [(x.data or 0, x.dtype) for x in arrays] == [
        (0x1000, 0), (0x2000, 2), (0x3000, 1), (0x4000, 0), (0x5000, 0), (0, 0), (0, 0)]
    adam = a.consts.adam
    for name, value in zip(c._fields, c):
        assert getattr(adam, name) == value, name
    # the reserved bytes after Adam's constants stay zero, room for later rules
    used = ctypes.sizeof(type(adam))
    start = StepArgs.consts.offset + used
    assert raw[start:StepArgs.isa.offset] == bytes(StepArgs.isa.offset - start)


def test_step_struct_is_the_size_the_library_was_built_with():
    native = _native()
    if native is None:
        pytest.skip("native library not built")
    assert native._lib.offload_step_args_size() == ctypes.sizeof(StepArgs) == 256


class _Wider(ctypes.Structure):
    _fields_ = StepArgs._fields_ + [("extra", ctypes.c_int64)]


@pytest.mark.parametrize("change", ["layout", "abi", "block"])
def test_library_of_another_layout_is_refused(monkeypatch, change):
    if _native() is None:
        pytest.skip("native library not built")
    if change == "layout":
        monkeypatch.setattr(native_backend, "StepArgs", _Wider)
        match = r"struct offload_step_args has 256 bytes, this package's mirror 264; rebuild"
    elif change == "block":  # a library built with -DOFFLOAD_BLOCK_ELEMS=...: numba's grad norm would differ
        monkeypatch.setattr(native_backend, "BLOCK_ELEMS", 1 << 15)
        match = r"hands threads ranges of 65536 elements \(OFFLOAD_BLOCK_ELEMS\), this package's backends 32768"
    else:
        monkeypatch.setattr(native_backend, "ABI_VERSION", 1)
        match = r"has ABI 7, this package expects 1; rebuild it"
    with pytest.raises(OSError, match=match) as info:
        native_backend.load_library()
    assert info.value.errno == errno.ENOEXEC
    monkeypatch.setattr(registry, "_loaded", {})
    monkeypatch.setattr(registry, "_errors", {})
    with pytest.raises(RuntimeError, match="'native' is not available: .*" + match):
        K.get_backend("native")
