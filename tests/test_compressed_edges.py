"""Compressed states at the edges: the numba kernel's encode / decode against quant.py bit for
bit on crafted values (ties, zeros, huge, non-finite, subnormal), poisoned blocks, and the
rule_step face's refusals (storage dtype and size, a bf16 param with a copy, the seed)."""
from __future__ import annotations

import pytest
import torch

from offload.kernels import quant
from offload.kernels.fields import ADAGRAD, ADAM, LION, SGD, Rule, StateField

from test_numba_compressed import CONFIGS, NUMBA, ORACLE, assert_same_bits, bits, run

SGD_STEP1 = dict(lr=0.1, momentum=0.9)  # step 1: the buffer becomes the grad itself
SEED, OFFSET = 0xDEADBEEF, (1 << 32) - 300  # the counter wraps inside the call


def crafted(signed: bool) -> torch.Tensor:
    """Blocks of 256 values that stress the encoder, and a ragged tail."""
    table, mid = quant.quant_map(signed)
    gen = torch.Generator().manual_seed(5)
    rnd = torch.randn(256, generator=gen)
    rnd = rnd if signed else rnd.abs()
    blocks = [
        torch.zeros(256),                                   # all zero: zero codes, absmax 0
        torch.cat([torch.ones(1), mid, ]),                  # midpoints at absmax 1: ties go low
        torch.cat([table, ]),                               # the map itself
        torch.cat([torch.full((1,), 3e38), rnd[1:]]),       # one huge value: the rest flush to 0
        rnd * 1e-40,                                        # subnormal values
        torch.cat([rnd[:100], torch.full((1,), float("nan")), rnd[101:]]),
        torch.cat([rnd[:7], torch.full((1,), float("inf")), rnd[8:]]),
        -torch.zeros(256),                                  # negative zeros
        rnd[:77],                                           # a ragged last block
    ]
    return torch.cat(blocks)


@pytest.mark.parametrize("signed", [True, False])
def test_encode_is_quant_encode(signed):
    # SGD's first step stores the grad as the buffer (signed map); Adagrad's first step from
    # a zero sum stores grad * grad (unsigned map): the stored bytes are quant's encoding
    x = crafted(signed)
    n = x.numel()
    if signed:
        rule, hp, g, want = SGD, SGD_STEP1, x, x
    else:
        rule, hp = ADAGRAD, dict(lr=0.1)
        g, want = x.sqrt(), x.sqrt() * x.sqrt()
    r = rule.with_state_dtype("int8")
    state = torch.zeros(r.fields[0].storage_numel(n), dtype=torch.uint8)
    NUMBA.rule_step(r, torch.zeros(n), g, {r.names[0]: state}, step=1, **hp)
    assert torch.equal(state, quant.encode_blocks(want, signed))


def test_decode_is_quant_decode():
    # SGD with momentum 1 and dampening 1 keeps the buffer (fma(0 * g) + buf) and steps the
    # param by -lr * buf: with p = 0 and lr = 1 the param is the decoded state, negated
    gen = torch.Generator().manual_seed(9)
    nb, n = 12, 12 * 256 - 5
    packed = torch.randint(0, 256, (nb, quant.PACKED_BLOCK), generator=gen, dtype=torch.uint8)
    absmax = torch.tensor([1.0, 0.0, float("nan"), float("inf"), 1e-40, 3e38, 2.5, 1e-3,
                           7.0, 0.25, 1e30, 1e-30])
    packed[:, quant.BLOCK:] = absmax.view(torch.uint8).view(nb, 4)
    packed = packed.view(-1)
    r = SGD.with_state_dtype("int8")
    state, p = packed.clone(), torch.zeros(n)
    NUMBA.rule_step(r, p, torch.zeros(n), {"momentum_buffer": state}, step=2, lr=1.0,
                    momentum=1.0, dampening=1.0)
    decoded = quant.decode_blocks(packed, n, True)
    assert torch.equal(p.isnan(), decoded.isnan())
    live = ~decoded.isnan()
    assert torch.equal(p[live], -decoded[live])
    assert torch.equal(state, quant.encode_blocks(decoded, True))


@pytest.mark.parametrize("stochastic", [False, True])
def test_bf16_rounding_is_quant_rounding(stochastic):
    x = crafted(True)
    x = torch.cat([x, torch.tensor([3.3895e38, -3.3895e38, 1.0 + 2 ** -9, -1.0 - 2 ** -9])])
    r = SGD.with_state_dtype("bfloat16")
    state = torch.zeros(x.numel(), dtype=torch.bfloat16)
    NUMBA.rule_step(r, torch.zeros(x.numel()), x, {"momentum_buffer": state}, step=1,
                    rounding_seed=SEED, element_offset=OFFSET, stochastic_states=stochastic,
                    **SGD_STEP1)
    want = quant.round_bf16_stochastic(x, SEED, OFFSET, 1) if stochastic else \
        quant.round_bf16_nearest(x)
    assert torch.equal(bits(state), bits(want))


def test_bf16_nearest_rounding_over_the_bit_patterns():
    """``round_bf16_nearest`` (int32 arithmetic) against the rule written out in int64, over
    every 4099th float32 bit pattern and the edges: round half to even, carries into the
    exponent, the largest finites rounding to inf, inf, subnormals (kept under
    ``torch.set_flush_denormal``), every NaN to 0xFFFF."""
    pattern = torch.arange(0, 1 << 32, 4099, dtype=torch.int64)
    edges = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0x18000, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000,
                          0x7F800001, 0x7FFFFFFF, 0x80000000, 0x807FFFFF, 0xFF7F8000, 0xFF800000, 0xFFFFFFFF])
    pattern = torch.cat([pattern, edges])
    x = torch.where(pattern >= 1 << 31, pattern - (1 << 32), pattern).to(torch.int32).view(torch.float32)
    want = ((pattern + 0x7FFF + ((pattern >> 16) & 1)) >> 16) & 0xFFFF
    want = torch.where(torch.isnan(x), torch.full_like(want, 0xFFFF), want)
    want = torch.where(want >= 0x8000, want - 0x10000, want).to(torch.int16)
    torch.set_flush_denormal(True)
    try:
        assert torch.equal(quant.round_bf16_nearest(x).view(torch.int16), want)
    finally:
        torch.set_flush_denormal(False)


def test_bf16_param_is_rounded_on_stream_zero():
    # plain SGD with lr 0 leaves the float32 value: the param is its own value rounded
    # stochastically on stream 0 (a bf16 value plus 0 rounds to itself: use a float32 view)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)).bfloat16()
    p = x.clone()
    NUMBA.rule_step("sgd_plain", p, torch.randn(1000), {}, step=1, lr=0.0,
                    rounding_seed=SEED, element_offset=OFFSET)
    assert torch.equal(bits(p), bits(x))
    # a real step: numba's float32 step of the float32 value, then quant's rounding, stream 0
    g = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    p, p32 = x.clone(), x.float()
    NUMBA.rule_step("sgd_plain", p, g, {}, step=1, lr=1e-3, rounding_seed=SEED,
                    element_offset=OFFSET)
    NUMBA.rule_step("sgd_plain", p32, g, {}, step=1, lr=1e-3)
    assert torch.equal(bits(p), bits(quant.round_bf16_stochastic(p32, SEED, OFFSET, 0)))
    assert not torch.equal(bits(p), bits(quant.round_bf16_nearest(p32)))  # it is stochastic


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_nonfinite_grads_poison_their_blocks_only(cfg, state_dtype):
    rule, hp = CONFIGS[cfg]
    n = 5 * 256 + 9
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    grads[0][300] = float("nan")
    grads[1][1100] = float("inf")
    grads[1][5 * 256 + 3] = -float("inf")
    grads[1][:256] = 0  # an all-zero grad block
    kw = dict(state_dtype=state_dtype, steps=2, grads=grads, param_dtype=torch.bfloat16)
    got = run(NUMBA, rule, hp, n, **kw)
    assert_same_bits(got, run(ORACLE, rule, hp, n, **kw), cfg)
    if state_dtype == "int8":
        absmax = got[1][rule.names[0]].view(-1, quant.PACKED_BLOCK)[:, quant.BLOCK:]
        absmax = absmax.contiguous().view(torch.float32).view(-1)
        assert absmax[1].isnan() and absmax[0].isfinite() and absmax[2].isfinite()


def _face(state_dtype="int8", n=7, **over):
    r = ADAM.with_state_dtype(state_dtype)
    args = dict(param=torch.zeros(n), grad=torch.zeros(n),
                states={f.name: torch.zeros(f.storage_numel(n), dtype=f.storage_dtype)
                        for f in r.fields})
    args.update(over)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    return lambda **more: NUMBA.rule_step(r, args["param"], args["grad"], args["states"],
                                          step=1, **{**kw, **more})


def test_face_refuses_wrong_storage():
    with pytest.raises(TypeError, match=r"exp_avg must have dtype in \(torch.uint8\), got torch.int8"):
        _face(states={"exp_avg": torch.zeros(260, dtype=torch.int8),
                      "exp_avg_sq": torch.zeros(260, dtype=torch.uint8)})()
    with pytest.raises(ValueError, match=r"exp_avg .* of a param of 7 elements takes 260 bytes "
                                         r"of packed blocks, got 7"):
        _face(states={"exp_avg": torch.zeros(7, dtype=torch.uint8),
                      "exp_avg_sq": torch.zeros(260, dtype=torch.uint8)})()
    with pytest.raises(TypeError, match=r"exp_avg_sq must have dtype in \(torch.bfloat16\)"):
        _face("bfloat16", states={"exp_avg": torch.zeros(7, dtype=torch.bfloat16),
                                  "exp_avg_sq": torch.zeros(7)})()
    with pytest.raises(ValueError, match="no kernel for rule 'adam'"):
        NUMBA.rule_step(Rule("adam", (StateField("exp_avg", torch.float16),
                                      StateField("exp_avg_sq", torch.float16))),
                        torch.zeros(3), torch.zeros(3), {}, step=1, lr=0.1)


def test_face_refuses_a_copy_of_a_bf16_param_and_bad_seeds():
    p = torch.zeros(7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a bfloat16 param is its own master: pass param_lowp=None"):
        _face(param=p)(param_lowp=torch.zeros(7, dtype=torch.bfloat16))
    step = _face()
    for bad in (-1, 1 << 32, 1.5, True):
        with pytest.raises(ValueError, match=r"rounding_seed must be an int in \[0, 2\*\*32\)"):
            step(rounding_seed=bad)
    with pytest.raises(ValueError, match="element_offset must be an int"):
        step(element_offset=-1)


def test_refused_call_touches_nothing():
    states = {"exp_avg": torch.full((260,), 7, dtype=torch.uint8),
              "exp_avg_sq": torch.full((260,), 7, dtype=torch.uint8)}
    p = torch.ones(7)
    with pytest.raises(ValueError):
        _face(param=p, states=states)(rounding_seed=-1)
    assert (states["exp_avg"] == 7).all() and (p == 1).all()


@pytest.mark.parametrize("rule", [ADAM, LION])
def test_tiny_and_huge_states_roundtrip_as_the_oracle(rule):
    # states near float32's limits and subnormal absmax: the kernel's decode -> step ->
    # encode is the oracle's
    hp = CONFIGS[rule.name][1] if rule.name != "sgd" else CONFIGS["sgd_damp"][1]
    n = 600
    r = rule.with_state_dtype("int8")
    gen = torch.Generator().manual_seed(8)
    states = {}
    for f in r.fields:
        x = torch.randn(n, generator=gen).abs()
        x[:256] *= 1e-38
        x[256:512] *= 1e37
        states[f.name] = quant.encode_blocks(x if not f.signed else x * torch.sign(torch.randn(n, generator=gen)), f.signed)
    kw = dict(states=states, grads=[torch.randn(n, generator=gen) * 1e-20], steps=1)
    assert_same_bits(run(NUMBA, rule, hp, n, **kw), run(ORACLE, rule, hp, n, **kw), rule.name)
