"""The compressed-state scheme (offload/kernels/quant.py) against independent formulations."""
import numpy as np
import pytest
import torch

from offload.kernels import quant
from offload.kernels.fields import ADAM, StateField


@pytest.mark.parametrize("code", quant.CODES)
def test_codes_are_the_nearest_map_value_ties_low(code):
    signed = code == "signed"
    # the levels: the map's (for "sqrt" those of sqrt(xn), whose squares it decodes to)
    table, mid = quant.code_tables(code)
    if code == "sqrt":
        table = quant.UNSIGNED_MAP
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3000, generator=g) * (2 if signed else 1) - (1 if signed else 0)
    x = torch.cat([x, mid, table])  # midpoints themselves tie: the lower code wins (not for "sqrt")
    packed = quant.encode_blocks(x, signed, code)
    nb = -(-x.numel() // quant.BLOCK)
    blocks = packed.view(nb, quant.PACKED_BLOCK)
    absmax = blocks[:, quant.BLOCK:].contiguous().view(torch.float32).view(-1)
    padded = torch.zeros(nb * quant.BLOCK)
    padded[:x.numel()] = x
    xn = padded.view(nb, -1) / absmax[:, None]
    if code == "sqrt":  # numpy's float32 square root: the instruction's, correctly rounded
        xn = torch.from_numpy(np.sqrt(xn.numpy()))
    d = (xn[..., None] - table).abs()
    nearest = d.argmin(-1)  # argmin returns the first (lowest) index on ties
    codes = blocks[:, :quant.BLOCK].long()
    live = torch.arange(nb * quant.BLOCK).view(nb, -1) < x.numel()
    assert torch.equal(codes[live], nearest[live])


@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 4097])
def test_decode_is_map_times_absmax_and_padding_is_zero_code(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    packed = quant.encode_blocks(x, True)
    assert packed.numel() == quant.packed_nbytes(n) == StateField("m", torch.int8, 256).nbytes(n)
    y = quant.decode_blocks(packed, n, True)
    assert (y - x).abs().max() <= 0.0075 * x.abs().max()  # half the widest gap of the map near 1
    codes = packed.view(-1, quant.PACKED_BLOCK)[:, :quant.BLOCK].reshape(-1)
    assert (codes[n:] == quant.zero_code(True)).all()


def test_unsigned_states_code_square_roots():
    # [Note: square-root code]: sqrt(v) keeps the map's relative step over 13 decades of v
    # below the block's absmax, where the plain unsigned code zeroed all below ~3e-7 of it
    n = 256
    v = torch.logspace(0, -13, n)  # one block, absmax 1
    y = quant.decode_blocks(quant.encode_blocks(v, False), n, False)
    assert (y > 0).all()
    rel = (y.sqrt() - v.sqrt()).abs() / v.sqrt()
    assert rel[v >= 1e-6].max() <= 0.09 and rel.max() <= 0.5, rel  # sqrt(v): the map's steps
    old = quant.decode_blocks(quant.encode_blocks(v, False, "unsigned"), n, False, "unsigned")
    assert (old[v < 1e-7] == 0).all() and (old == 0).sum() >= 0.45 * n
    assert ((old.sqrt() - v.sqrt()).abs() / v.sqrt())[v >= 1e-6].max() >= 0.2
    # decode is the squared level times the absmax, and both codes share the midpoints
    packed = quant.encode_blocks(v * 3.0, False)
    codes = packed[:n].long()
    absmax = packed[n:].view(torch.float32)
    assert torch.equal(quant.decode_blocks(packed, n, False), quant.UNSIGNED_MAP[codes] ** 2 * absmax)
    assert torch.equal(quant.SQRT_DECODE, quant.UNSIGNED_MAP * quant.UNSIGNED_MAP)
    # negative inputs (a state that should never have one) code as 0, as in the plain code
    neg = quant.encode_blocks(torch.tensor([-1.0, -0.0, 0.0, 2.0]), False)
    assert neg[:3].tolist() == [quant.zero_code(False)] * 3 and neg[3].item() == 255


def test_codes_are_checked():
    with pytest.raises(ValueError, match="unknown int8 state code"):
        quant.encode_blocks(torch.ones(3), False, "log")
    with pytest.raises(ValueError, match="is for unsigned states"):
        quant.encode_blocks(torch.ones(3), True, "sqrt")
    with pytest.raises(ValueError, match="is for signed states"):
        quant.decode_blocks(quant.encode_blocks(torch.ones(3), True), 3, False, "signed")
    assert StateField("v", torch.uint8, 256).code == "sqrt" and StateField("m", torch.int8, 256).code == "signed"
    old = StateField.from_description({"name": "v", "dtype": "uint8", "block": 256})
    assert old.code == "unsigned" and old != StateField("v", torch.uint8, 256)
    new = StateField("v", torch.uint8, 256)
    assert StateField.from_description(new.describe()) == new and new.describe()["code"] == "sqrt"
    with pytest.raises(ValueError, match="code is sqrt or unsigned"):
        StateField("v", torch.uint8, 256, "signed")
    with pytest.raises(ValueError, match="only a blocked field has a code"):
        StateField("v", torch.float32, 0, "sqrt")


def test_zero_and_nonfinite_blocks():
    x = torch.zeros(600)
    x[300] = float("nan")
    x[520] = 1e30
    y = quant.decode_blocks(quant.encode_blocks(x, True), 600, True)
    assert (y[:256] == 0).all() and torch.isnan(y[256:512]).all()
    assert y[520] == 1e30 and (y[512:520] == 0).all()


def test_stochastic_rounding_is_unbiased_and_indexed_by_element():
    x = torch.full((20000,), 1.0 + 2 ** -10)  # an eighth of the way to the next bf16
    r = quant.round_bf16_stochastic(x, 3, 0, 0).float()
    assert set(r.unique().tolist()) == {1.0, 1.0078125}
    assert abs(r.mean().item() - x[0].item()) < 2e-4
    tail = quant.round_bf16_stochastic(x[100:], 3, 100, 0)
    assert torch.equal(tail.view(torch.int16), r[100:].bfloat16().view(torch.int16))
    other = quant.round_bf16_stochastic(x, 3, 0, 1)
    assert not torch.equal(other, r.bfloat16())


@pytest.mark.parametrize("stream", range(len(quant.STREAMS)))
def test_every_stream_rounds_without_bias(stream):
    x = torch.full((40000,), 1.0 + 2 ** -10)  # an eighth of the way to the next bf16 (2**-7)
    r = quant.round_bf16_stochastic(x, 11, 5, stream).float()
    up = (r > 1.0).float().mean().item()
    assert abs(up - 0.125) < 0.01, up  # ~6 sigma at n = 40000


def test_a_pair_of_states_shares_one_hash_without_sharing_bits():
    # the scheme: the param and state 0 take the top half of their hash, state 1 the low
    # half of state 0's hash (one hash serves Adam's two moments), states 2 and 3 likewise
    n, seed, offset = 4096, 0xC0FFEE, 7
    idx = (torch.arange(n, dtype=torch.int64) + offset) ^ seed
    h01 = quant.lowbias32(idx ^ quant.STREAMS[1])
    h23 = quant.lowbias32(idx ^ quant.STREAMS[3])
    assert torch.equal(quant.random_bits16(n, seed, offset, 1), h01 >> 16)
    assert torch.equal(quant.random_bits16(n, seed, offset, 2), h01 & 0xFFFF)
    assert torch.equal(quant.random_bits16(n, seed, offset, 3), h23 >> 16)
    assert torch.equal(quant.random_bits16(n, seed, offset, 4), h23 & 0xFFFF)
    assert torch.equal(quant.random_bits16(n, seed, offset, 0), quant.lowbias32(idx ^ quant.STREAMS[0]) >> 16)
    bits = [quant.random_bits16(n, seed, offset, k) for k in range(5)]
    for a in range(5):
        for b in range(a + 1, 5):
            # independent streams agree on ~1/65536 of the elements, never on most of them
            assert (bits[a] == bits[b]).float().mean().item() < 0.01, (a, b)
    # and the two halves are not correlated: the low half's sign bit against the top half's
    top, low = bits[1] >> 15, bits[2] >> 15
    assert abs((top == low).float().mean().item() - 0.5) < 0.05
    with pytest.raises(ValueError, match="stream must be in"):
        quant.random_bits16(4, 0, 0, 5)


def test_nearest_rounding_matches_torch_for_finite_values():
    x = torch.randn(5000) * 1e3
    assert torch.equal(quant.round_bf16_nearest(x), x.bfloat16())
    nan = quant.round_bf16_nearest(torch.tensor([float("nan")]))
    assert nan.view(torch.int16).item() == -1  # 0xFFFF, as the SIMD units write it


def test_rule_with_state_dtype():
    r = ADAM.with_state_dtype("int8")
    assert [f.signed for f in r.fields] == [True, False] and r.base is ADAM
    assert r.state_dtype == "int8" and ADAM.with_state_dtype("bfloat16").state_dtype == "bfloat16"
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        ADAM.with_state_dtype("fp8")
    with pytest.raises(ValueError, match="multiples of 256"):
        r.fields[0].storage_offset(100)
    assert r.fields[0].align_elems(4096) == 256 * 1024


def test_recode_blocks_is_decode_then_encode_per_block():
    x = torch.rand(600) * torch.logspace(0, -9, 600)
    x[300] = float("nan")  # the second block is NaN in both codes
    old = quant.encode_blocks(x, False, "unsigned")
    new = old.clone()
    quant.recode_blocks(new, False, "unsigned", "sqrt")
    assert torch.equal(new, quant.encode_blocks(quant.decode_blocks(old, 768, False, "unsigned"), False))
    y = quant.decode_blocks(new, 600, False)
    assert torch.isnan(y[256:512]).all() and not torch.isnan(y[:256]).any()
    assert (new[2 * 260 + 600 - 512:2 * 260 + 256] == quant.zero_code(False)).all()  # padding stays
    with pytest.raises(ValueError, match="whole packed blocks"):
        quant.recode_blocks(old[:-1], False, "unsigned", "sqrt")
