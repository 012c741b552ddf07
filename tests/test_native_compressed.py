"""The native fused kernel for compressed states (issue #15 part 1) against the scheme.

Every ISA unit and every rule, with bfloat16 states (nearest even, stochastic), packed int8
states, a float32 or bfloat16 param, float32/bfloat16/float16 grads, with and without the
low-precision copy: ``native._compressed`` must equal ``compressed_ref.compose_step`` around
the same unit's own float32 rule BIT FOR BIT (raw bytes of param, copy and every state),
over several steps. The encoder and the stochastic rounding are also held directly to
quant.py on inputs built to hit every midpoint tie, and edge blocks (zeros, one huge value,
NaN / inf, subnormals) and thread counts are covered.
"""
from __future__ import annotations

import ctypes
import errno

import numpy as np
import pytest
import torch

import offload.kernels as K
from offload.kernels import quant
from offload.kernels._rule_step import _KERNELS
from offload.kernels.compressed_ref import compose_step
from offload.kernels.fields import ADAGRAD, ADAM, LION, SGD, SGD_PLAIN

from test_kernels import _native_or_none

NATIVE = _native_or_none()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="native library not built")
ISAS = NATIVE.supported if NATIVE is not None else []
SIZES = [1, 7, 15, 16, 17, 255, 256, 257, 4097]
BIG = 2**20 + 3
STEPS = 3

CONFIGS = [
    (ADAM, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)),
    (ADAM, dict(lr=1e-2, beta1=0.3, beta2=0.99, eps=1e-6, weight_decay=0.01, decoupled=False,
                maximize=True, grad_scale=0.5)),
    (SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (SGD, dict(lr=0.05, momentum=0.8, nesterov=True, maximize=True, grad_scale=0.5)),
    (SGD, dict(lr=0.05, momentum=0.0, weight_decay=0.1)),  # buffer kept, not read
    (SGD_PLAIN, dict(lr=0.05, weight_decay=0.1)),
    (ADAGRAD, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1)),
    (LION, dict(lr=1e-3, weight_decay=0.1)),
    (LION, dict(lr=1e-3, beta1=0.3, beta2=0.2, maximize=True, grad_scale=0.5)),
]
CONFIG_IDS = [f"{r.name}{i}" for i, (r, _) in enumerate(CONFIGS)]
KINDS = {"bf16_nearest": ("bfloat16", False), "bf16_stochastic": ("bfloat16", True),
         "int8": ("int8", False), "fp32": ("float32", False)}


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ISA", request.param)
    return request.param


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _initial_states(rule, n, seed):
    """Nonzero starting states in the rule's storage (so step 1 decodes real values)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f in rule.fields:
        x = torch.randn(n, generator=gen) * 0.1
        if f.name in ("exp_avg_sq", "sum"):
            x = x.abs()
        if f.blocked:
            out[f.name] = quant.encode_blocks(x, f.signed)
        else:
            out[f.name] = x.to(f.dtype)
    return out


def _run_pair(rule, hp, n, *, param_dtype, grad_dtype, lowp_dtype, stochastic, steps=STEPS,
              threads=1, offset=0, seed=7, grads=None, p0=None, modes=(True, False)):
    """(native run, compose_step run) as lists of tensors: param, copy, states; ``modes=(True,)``:
    the native run only."""
    gen = torch.Generator().manual_seed(n * 31 + 5)
    if p0 is None:
        p0 = torch.randn(n, generator=gen)
    if grads is None:
        grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(steps)]
    s0 = _initial_states(rule, n, seed + n)
    runs = []
    for fused in modes:
        p = p0.to(param_dtype).clone()
        st = {k: v.clone() for k, v in s0.items()}
        lowp = None if lowp_dtype is None else torch.zeros(n, dtype=lowp_dtype)
        for step, g in enumerate(grads, start=1):
            q = quant.QuantArgs(quant.rounding_seed(step, seed), offset + 1000 * step, stochastic)
            if fused:
                NATIVE.rule_step(rule, p, g, st, step=step, param_lowp=lowp, num_threads=threads,
                                 rounding_seed=q.seed, element_offset=q.offset,
                                 stochastic_states=stochastic, **hp)
            else:
                k = _KERNELS[rule.base]
                compose_step(getattr(NATIVE, k.method), rule.fields, p, g,
                             tuple(st[name] for name in k.names), lowp, threads,
                             k.args(step, **hp), q)
        runs.append([p] + ([] if lowp is None else [lowp]) + [st[k] for k in sorted(st)])
    return runs


def _assert_same_bits(runs, what):
    fused, ref = runs
    for i, (a, b) in enumerate(zip(fused, ref)):
        assert a.dtype == b.dtype
        ab, bb = _bytes(a), _bytes(b)
        if not torch.equal(ab, bb):
            bad = (ab != bb).nonzero()[0].item()
            pytest.fail(f"{what}: array {i} ({a.dtype}) differs first at byte {bad} "
                        f"of {ab.numel()}")


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rule,hp", CONFIGS, ids=CONFIG_IDS)
def test_fused_step_equals_compose_step(isa, rule, hp, kind):
    state_dtype, stochastic = KINDS[kind]
    crule = rule.with_state_dtype(state_dtype)
    for i, n in enumerate(SIZES):
        for param_dtype in (torch.float32, torch.bfloat16):
            if kind == "fp32" and param_dtype == torch.float32:
                continue  # the plain float32 kernels: test_kernel_rules
            for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
                lowp = None
                if param_dtype == torch.float32:
                    lowp = (None, torch.bfloat16, torch.float16)[(i + len(str(grad_dtype))) % 3]
                runs = _run_pair(crule, hp, n, param_dtype=param_dtype, grad_dtype=grad_dtype,
                                 lowp_dtype=lowp, stochastic=stochastic)
                _assert_same_bits(runs, f"{isa} {rule.name} {kind} n={n} param {param_dtype} "
                                        f"grad {grad_dtype} lowp {lowp}")


MID = 3 * 65536 + 17  # three threads' chunks of 65536 elements, then a partial block
# Every rule with each kind, at 2**20+3 for half of the pairs (each rule and each kind meets it)
# and at MID for the other half: the same chunked path, a fifth of the elements.
BIG_CASES = {  # id: (rule and hyperparameters, kind, size)
    "adam-int8-big": (CONFIGS[0], "int8", BIG), "adam-bf16_stochastic-mid": (CONFIGS[0], "bf16_stochastic", MID),
    "sgd-int8-mid": (CONFIGS[2], "int8", MID), "sgd-bf16_stochastic-big": (CONFIGS[2], "bf16_stochastic", BIG),
    "adagrad-int8-big": (CONFIGS[6], "int8", BIG), "adagrad-bf16_stochastic-mid": (CONFIGS[6], "bf16_stochastic", MID),
    "lion-int8-mid": (CONFIGS[8], "int8", MID), "lion-bf16_stochastic-big": (CONFIGS[8], "bf16_stochastic", BIG),
}


@pytest.mark.parametrize("config,kind,n", list(BIG_CASES.values()), ids=list(BIG_CASES))
def test_big_multithreaded_equals_compose_and_threads_agree(isa, config, kind, n):
    rule, hp = config
    state_dtype, stochastic = KINDS[kind]
    crule = rule.with_state_dtype(state_dtype)
    # offset near 2**32: the stream index wraps inside the call
    common = dict(param_dtype=torch.bfloat16, grad_dtype=torch.bfloat16, lowp_dtype=None,
                  stochastic=stochastic, steps=2, offset=2**32 - 5000)
    two = _run_pair(crule, hp, n, threads=2, **common)
    _assert_same_bits(two, f"{isa} {rule.name} {kind} n={n} 2 threads")
    one = _run_pair(crule, hp, n, threads=1, modes=(True,), **common)  # (only the native run is compared)
    _assert_same_bits([two[0], one[0]], "1 vs 2 threads")


def test_big_fp32_param_with_copy(isa):
    crule = ADAM.with_state_dtype("int8")
    runs = _run_pair(crule, CONFIGS[0][1], BIG, param_dtype=torch.float32,
                     grad_dtype=torch.float16, lowp_dtype=torch.bfloat16, stochastic=False,
                     steps=2, threads=2)
    _assert_same_bits(runs, f"{isa} adam int8 fp32 param n={BIG}")


def _edge_grads(n):
    """Blocks of 256: zeros, one huge value, a NaN, an inf, subnormals, ordinary; then a
    partial block."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    g[0:256] = 0.0
    g[256 + 17] = 3e38
    g[512 + 5] = float("nan")
    g[768 + 200] = float("-inf")
    g[1024:1280] = torch.randn(256) * 1e-41  # subnormal float32
    return g


@pytest.mark.parametrize("kind", ["int8", "bf16_nearest", "bf16_stochastic"])
@pytest.mark.parametrize("rule,hp", [CONFIGS[0], CONFIGS[2], CONFIGS[6], CONFIGS[7]],
                         ids=["adam", "sgd", "adagrad", "lion"])
def test_edge_blocks(isa, rule, hp, kind):
    state_dtype, stochastic = KINDS[kind]
    crule = rule.with_state_dtype(state_dtype)
    n = 6 * 256 + 100
    grads = [_edge_grads(n), torch.randn(n), _edge_grads(n).flip(0)]
    p0 = torch.randn(n)
    p0[1024:1280] = 1e-39  # subnormal params
    for param_dtype in (torch.float32, torch.bfloat16):
        runs = _run_pair(crule, hp, n, param_dtype=param_dtype, grad_dtype=torch.float32,
                         lowp_dtype=None, stochastic=stochastic, grads=grads, p0=p0)
        _assert_same_bits(runs, f"{isa} {rule.name} {kind} edge blocks {param_dtype}")
    if kind == "int8":  # the poisoned blocks are NaN blocks, the clean zero block is not
        st = runs[0][-1]
        absmax = st.view(-1, quant.PACKED_BLOCK)[:, 256:].contiguous().view(torch.float32).view(-1)
        assert torch.isnan(absmax[2]) and torch.isnan(absmax[3])


def _sgd_first_step_buffer(state_dtype, g, *, stochastic=False, seed=0, offset=0):
    """The momentum buffer after SGD's first step (buf = g): the encoder on chosen values."""
    crule = SGD.with_state_dtype(state_dtype)
    f = crule.fields[0]
    n = g.numel()
    buf = torch.full((f.storage_numel(n),), 0x5A, dtype=torch.uint8).view(f.storage_dtype) \
        if f.blocked else torch.zeros(n, dtype=f.storage_dtype)
    NATIVE.rule_step(crule, torch.zeros(n), g, {"momentum_buffer": buf}, step=1, lr=0.0,
                     momentum=0.9, rounding_seed=seed, element_offset=offset,
                     stochastic_states=stochastic, num_threads=2)
    return buf


def test_encoder_ties_and_neighbours_of_every_midpoint(isa):
    # values exactly on each midpoint (a tie: the lower code), just below and just above,
    # with absmax 1 (an element 1.0 per block): every code boundary of the signed map
    mid = quant.SIGNED_MID
    vals = torch.cat([mid, torch.nextafter(mid, torch.tensor(-2.0)),
                      torch.nextafter(mid, torch.tensor(2.0)), torch.tensor([-0.0, 0.0])])
    blocks = vals.split(255)
    g = torch.cat([torch.cat([b, torch.ones(1)]) for b in blocks])[:-1]  # last block partial
    buf = _sgd_first_step_buffer("int8", g)
    assert torch.equal(buf, quant.encode_blocks(g, True))
    # the same through the unsigned map (Adagrad's sum is never negative), which codes
    # square roots: values whose roots fall on and beside each midpoint, and scaled blocks
    # Adagrad's first sum is g * g: grads on and beside each midpoint (with a 1.0 per block
    # for absmax 1) give sums whose roots fall on and beside it (on it for most: ties)
    umid = quant.UNSIGNED_MID
    near = torch.cat([umid, torch.nextafter(umid, torch.tensor(2.0)), torch.nextafter(umid, torch.tensor(-2.0))])
    assert (torch.from_numpy(np.sqrt((umid * umid).numpy())) == umid).sum() > 100
    g = torch.cat([b for c in near.split(255) for b in (c, torch.ones(1))])
    g = torch.cat([g, torch.cat([umid, torch.nextafter(umid, torch.tensor(2.0)), torch.ones(1)]).sqrt() * 3.0])
    x = g * g
    enc = quant.encode_blocks(x, False)
    dec = quant.decode_blocks(enc, x.numel(), False)
    assert torch.equal(quant.encode_blocks(dec, False), enc)  # the reference is stable
    s = ADAGRAD.with_state_dtype("int8")
    st = {"sum": quant.encode_blocks(torch.zeros(x.numel()), False)}
    NATIVE.rule_step(s, torch.zeros(x.numel()), g, st, step=1, lr=0.0, num_threads=1)
    assert torch.equal(st["sum"], enc)
    ref = {"sum": quant.encode_blocks(torch.zeros(x.numel()), False)}
    compose_step(NATIVE._adagrad, s.fields, torch.zeros(x.numel()), g, (ref["sum"],),
                 None, 1, _KERNELS[ADAGRAD].args(1, lr=0.0), quant.QuantArgs())
    assert torch.equal(st["sum"], ref["sum"])


def test_stochastic_rounding_is_quant_scheme(isa):
    n = 5000
    g = torch.randn(n) * 3.7
    g[10] = float("nan")
    g[11] = float("inf")
    for offset in (0, 2**32 - 100, 2**40 + 3):
        buf = _sgd_first_step_buffer("bfloat16", g, stochastic=True, seed=0xDEADBEEF, offset=offset)
        ref = quant.round_bf16_stochastic(g, 0xDEADBEEF, offset, 1)
        assert torch.equal(_bytes(buf), _bytes(ref)), offset
    buf = _sgd_first_step_buffer("bfloat16", g)
    assert torch.equal(_bytes(buf), _bytes(quant.round_bf16_nearest(g)))


def test_c_face_refuses_bad_compressed_args():
    from offload.kernels._native_abi import StepArgs
    lib = NATIVE._lib
    n = 300
    p, g = torch.zeros(n), torch.zeros(n)
    m = torch.zeros(quant.packed_nbytes(n), dtype=torch.uint8)
    v = torch.zeros(quant.packed_nbytes(n), dtype=torch.uint8)
    maps = [t.contiguous() for t in (quant.SIGNED_MAP, quant.SIGNED_MID, quant.UNSIGNED_MAP,
                                     quant.UNSIGNED_MID)]

    def call(**change):
        a = StepArgs(rule=0, num_states=2, n=n, isa=-1, num_threads=1)
        a.param.data, a.grad.data = p.data_ptr(), g.data_ptr()
        a.states[0].data, a.states[0].dtype = m.data_ptr(), 3
        a.states[1].data, a.states[1].dtype = v.data_ptr(), 4
        a.consts.adam.bc2_sqrt = a.consts.adam.decay = 1.0
        a.quant.signed_map, a.quant.signed_mid = maps[0].data_ptr(), maps[1].data_ptr()
        a.quant.unsigned_map, a.quant.unsigned_mid = maps[2].data_ptr(), maps[3].data_ptr()
        for path, value in change.items():
            obj_name, field = path.split(".")
            obj = a.states[int(obj_name[-1])] if obj_name.startswith("s") else getattr(a, obj_name)
            setattr(obj, field, value)
        return lib.offload_rule_step(bytes(a))

    assert call() == 0
    assert call(**{"quant.signed_map": None}) == -errno.EINVAL
    assert call(**{"quant.unsigned_mid": None}) == -errno.EINVAL
    assert call(**{"s0.dtype": 5}) == -errno.EINVAL
    assert call(**{"s1.dtype": 1}) == -errno.EINVAL  # F16 states: not a state dtype
    assert call(**{"s0.dtype": 2, "s0.rounding": 2}) == -errno.EINVAL
    assert call(**{"param.dtype": 1}) == -errno.EINVAL
    lowp = torch.zeros(n, dtype=torch.bfloat16)
    pb = torch.zeros(n, dtype=torch.bfloat16)
    assert call(**{"param.dtype": 2, "param.data": pb.data_ptr(), "lowp.data": lowp.data_ptr(),
                   "lowp.dtype": 2}) == -errno.EINVAL  # a bf16 param has no copy
    assert call(**{"param.dtype": 2, "param.data": pb.data_ptr(), "param.rounding": 1}) == 0
    assert ctypes.sizeof(StepArgs) == NATIVE._lib.offload_step_args_size()
