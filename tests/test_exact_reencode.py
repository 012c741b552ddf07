"""Loading int8 states encodes them exactly where a block's scale can give the values back
([Note: exact re-encoding] in kernels/quant.py): an int8 optimizer's state_dict() loads into
another int8 optimizer, in every store, and both go on bit for bit (torchao's test_optim_smoke
flow: step, torch.save the state_dict, load it into a copy, step both)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import offload
from offload.kernels import quant

SIZES = (1, 7, 255, 256, 257, 4097, 3 * 256 + 17)


def _values(n, signed, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4 * scale
    x[:: 97] *= 1e3  # a few large values: blocks with one huge value
    return x if signed else x * x


def _decoded(x, signed):
    return quant.decode_blocks(quant.encode_blocks(x, signed), x.numel(), signed)


@pytest.mark.parametrize("scale", [1e-39, 1e-30, 1e-6, 1.0, 1e15])  # 1e-39: subnormal scales
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "sqrt"])
def test_decoded_values_encode_back_to_themselves(signed, n, scale):
    d = _decoded(_values(n, signed, n, scale), signed)
    back = quant.decode_blocks(quant.encode_blocks_exact(d, signed), n, signed)
    assert torch.equal(back.view(torch.int32), d.view(torch.int32))


def test_the_plain_encoder_re_scales_negative_peaks_which_the_exact_one_does_not():
    # a test that can tell: the signed map's most negative level is -0.99297, so re-encoding
    # a block whose peak is negative with the plain encoder moves its values
    x = torch.linspace(-1.0, 0.5, 256)
    d = _decoded(x, True)
    plain = quant.decode_blocks(quant.encode_blocks(d, True), 256, True)
    assert not torch.equal(plain, d) and d.abs().max() == -d.min()
    assert torch.equal(quant.decode_blocks(quant.encode_blocks_exact(d, True), 256, True), d)


def test_a_tie_of_a_positive_and_a_negative_peak_finds_its_scale():
    x = torch.zeros(256)
    x[0], x[1], x[2] = -1.0, 0.995, 0.3  # decode to -0.99297 and +0.99297 (the level below 1)
    d = _decoded(x, True)
    assert d[0] == -d[1]
    assert torch.equal(quant.decode_blocks(quant.encode_blocks_exact(d, True), 256, True), d)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "sqrt"])
def test_other_values_are_encoded_as_the_scheme_does(signed):
    # full blocks of values that did not come from the codes: no scale gives them back
    x = _values(64 * 256, signed, 5)
    assert torch.equal(quant.encode_blocks_exact(x, signed), quant.encode_blocks(x, signed))


def test_zero_nan_and_inf_blocks_are_the_schemes():
    x = torch.randn(4 * 256)
    x[:256] = 0.0
    x[300] = float("nan")
    x[600] = float("-inf")
    assert torch.equal(quant.encode_blocks_exact(x, True), quant.encode_blocks(x, True))
    one = torch.tensor([-3.0])  # a lone negative value: exact at the scale 3 / 0.99297
    packed = quant.encode_blocks_exact(one, True)
    assert quant.decode_blocks(packed, 1, True).item() == -3.0
    assert torch.equal(packed[1:256], quant.encode_blocks(one, True)[1:256])  # padding: the zero code


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))


STORES = {
    "host": ({}, torch.float32),
    "nvme": ({"offload": "nvme"}, torch.float32),
    "flat-bf16": ({}, torch.bfloat16),
    "bf16-master": ({"master_dtype": "bfloat16"}, torch.bfloat16),
}


@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("cls", [offload.AdamW, offload.SGD, offload.Lion, "amsgrad"],
                         ids=lambda c: c if isinstance(c, str) else c.__name__)
def test_a_state_dict_round_trip_changes_nothing(cls, store, tmp_path):
    extra, dtype = STORES[store]
    hyper = {"momentum": 0.9} if cls is offload.SGD else {"amsgrad": True} if cls == "amsgrad" else {}
    cls = offload.AdamW if cls == "amsgrad" else cls

    def swap(name):
        if extra.get("offload") != "nvme":
            return {}
        (tmp_path / name).mkdir()
        return {"swap_dir": str(tmp_path / name)}

    model = _model().to(dtype)
    o1 = cls(model.parameters(), lr=1e-2, state_dtype="int8", **hyper, **extra, **swap("a"))
    model(torch.randn(4, 32, dtype=dtype)).sum().backward()
    o1.step()
    o1.zero_grad()
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    model2 = copy.deepcopy(model)
    o2 = cls(model2.parameters(), lr=1e-2, state_dtype="int8", **hyper, **extra, **swap("b"))
    o2.load_state_dict(sd)
    for i, entry in o2.state_dict()["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, sd["state"][i][k]), (i, k)
    for _ in range(2):
        x = torch.randn(4, 32, dtype=dtype)
        for m, o in ((model, o1), (model2, o2)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    o1.close()
    o2.close()


def test_chunks_give_the_bytes_of_one_pass(monkeypatch):
    d = _decoded(_values(5 * 256 + 3, True, 9), True)
    whole = quant.encode_blocks_exact(d, True)
    monkeypatch.setattr(quant, "_EXACT_CHUNK", 2 * 256)
    assert torch.equal(quant.encode_blocks_exact(d, True), whole)
    assert torch.equal(quant.decode_blocks(whole, d.numel(), True), d)


def test_subnormal_scales_with_negative_peaks_come_back():
    # scales below float32's normal range: decoded values sit on the subnormal grid, where a
    # relative tolerance alone would not let the block be retried
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2000, 256, generator=gen)
    x[:, 0] = -x.abs().amax(1) * 1.5
    x = (x.double() * 10 ** (torch.rand(2000, 1, generator=gen).double() * -6.5 - 38)).float().view(-1)
    d = _decoded(x, True)
    back = quant.decode_blocks(quant.encode_blocks_exact(d, True), d.numel(), True)
    assert torch.equal(back.view(torch.int32), d.view(torch.int32))
