"""``opt.state[p]["exp_avg"] = t`` reaches the store in every store (state_view.py): the next
step reads ``t``, as torch's would, exactly as if ``t`` had come in through load_state_dict.
Before, the flat and swapped stores kept their own states and the assigned tensor only hid
them from later reads; and the flat store's int8 states were shown as a byte slice of the
packed blocks instead of their values."""
from __future__ import annotations

import pytest
import torch

import offload
from offload.kernels.fields import ADAM
from offload.optim.read_copy import ReadCopy
from offload.optim.state_codec import to_torch_layout

CASES = [("float32", "nvme"), ("bfloat16", "cpu"), ("bfloat16", "nvme")]


def _values(t, p, key):
    """A state as read, float32 of p's shape: the packed int8 blocks that fp32 CPU params'
    states read as on NVMe (as in the host store) decoded."""
    if t.dtype != torch.uint8:
        return t.float()
    return to_torch_layout(ADAM.with_state_dtype("int8").fields[("exp_avg", "exp_avg_sq").index(key)], t,
                           p.numel(), p.shape)


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(40, 300).to(dtype)  # 12000 weights: several int8 blocks, a 300 bias


def _step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    m(torch.randn(4, 40, generator=g).to(m.weight.dtype)).float().square().mean().backward()
    opt.step()


def _opt(m, offload_kind, state_dtype, tmp_path, name):
    kw = {}
    if offload_kind == "nvme":
        (tmp_path / name).mkdir()
        kw["swap_dir"] = str(tmp_path / name)
    return offload.AdamW(m.parameters(), lr=1e-2, offload=offload_kind, state_dtype=state_dtype, **kw)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dtype,offload_kind", CASES, ids=[f"{d}-{o}" for d, o in CASES])
def test_an_assigned_state_is_the_one_the_next_step_reads(dtype, offload_kind, state_dtype, tmp_path):
    dtype = getattr(torch, dtype)
    m1, m2 = _model(dtype), _model(dtype)
    a, b = _opt(m1, offload_kind, state_dtype, tmp_path, "a"), _opt(m2, offload_kind, state_dtype, tmp_path, "b")
    try:
        _step(m1, a, 1)
        _step(m2, b, 1)
        new = torch.linspace(-1e-3, 1e-3, m1.weight.numel()).view_as(m1.weight)
        a.state[m1.weight]["exp_avg"] = new
        sd = b.state_dict()
        sd["state"][0]["exp_avg"] = new.clone()
        b.load_state_dict(sd)
        got = a.state[m1.weight]["exp_avg"]
        packed = state_dtype == "int8" and dtype == torch.float32  # as the host store holds them
        assert got.shape == (m1.weight.shape if not packed else (12220,))
        assert got.dtype in ((torch.float32, torch.bfloat16) if not packed else (torch.uint8,))
        assert torch.equal(got, b.state[m2.weight]["exp_avg"])
        got = _values(got, m1.weight, "exp_avg")
        assert torch.allclose(got, new, atol=1e-5, rtol=0.02)  # as stored: bf16 / int8 rounding
        _step(m1, a, 2)
        _step(m2, b, 2)
        assert torch.equal(m1.weight, m2.weight) and torch.equal(m1.bias, m2.bias)
        assert torch.equal(a.state_dict()["state"][0]["exp_avg"], b.state_dict()["state"][0]["exp_avg"])
    finally:
        del got
        a.close()
        b.close()


@pytest.mark.parametrize("dtype,offload_kind", CASES, ids=[f"{d}-{o}" for d, o in CASES])
def test_a_state_of_the_wrong_size_is_refused_and_changes_nothing(dtype, offload_kind, tmp_path):
    m = _model(getattr(torch, dtype))
    opt = _opt(m, offload_kind, "float32", tmp_path, "a")
    try:
        _step(m, opt, 1)
        before = opt.state_dict()["state"][0]["exp_avg"].clone()
        with pytest.raises(ValueError, match="12000 elements"):
            opt.state[m.weight]["exp_avg"] = torch.zeros(3)
        with pytest.raises(TypeError, match="must be a tensor"):
            opt.state[m.weight]["exp_avg_sq"] = 0.5
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before)
        opt.state[m.weight]["note"] = "kept"  # keys the store does not keep are the dict's, as in torch
        assert opt.state[m.weight]["note"] == "kept"
    finally:
        opt.close()


def test_flat_int8_states_read_as_their_values(tmp_path):
    m = _model(torch.bfloat16)
    opt = _opt(m, "cpu", "int8", tmp_path, "a")
    try:
        _step(m, opt, 1)
        sd = opt.state_dict()["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            got = opt.state[m.weight][key]
            assert got.dtype == torch.float32 and got.shape == m.weight.shape
            assert torch.equal(got, sd[key])
    finally:
        opt.close()


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dtype,offload_kind", CASES, ids=[f"{d}-{o}" for d, o in CASES])
def test_an_in_place_change_of_a_read_copy_is_written_back_not_dropped(dtype, offload_kind, state_dtype, tmp_path):
    """``opt.state[p]["exp_avg"].zero_()`` on a state that is read as a copy (swap files, int8
    blocks decoded) changed only the copy: the next step went on with the old moments, where the
    same line with bf16 states in RAM (a live view) reset them. It was refused, and is written
    back now; assigning still writes through. [Note: an in-place change of a read copy is
    written back] in write_back.py"""
    m = _model(getattr(torch, dtype))
    opt = _opt(m, offload_kind, state_dtype, tmp_path, "a")
    _step(m, opt, 1)
    before = opt.state_dict()["state"][0]["exp_avg"].clone()
    got = opt.state[m.weight]["exp_avg"]
    if not isinstance(got, ReadCopy):  # a live view (bf16 params in RAM, float32 or bf16 states)
        got.zero_()
        assert not opt.state_dict()["state"][0]["exp_avg"].any()
    else:
        assert before.any()
        got.zero_()  # (packed int8 blocks: zero bytes, zero scales, so zeros)
        assert not opt.state_dict()["state"][0]["exp_avg"].any()
        opt.state[m.weight]["exp_avg"] = _values(got, m.weight, "exp_avg") * 0.5  # arithmetic on it, and assigning, work
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"],
                           _values(opt.state[m.weight]["exp_avg"], m.weight, "exp_avg").to(before.dtype))
    opt.close()


@pytest.mark.parametrize("how", ["assign", "in_place"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_state_written_before_close_keep_swap_is_what_resume_goes_on_from(dtype, how, tmp_path):
    """close(keep_swap=True) commits the states written since the last step: the flat store
    (bf16 params, whose fp32 master is in the swap files too) dropped them, so resume=True went
    on from the step's own moments, where fp32 params' swap files kept the write (found by
    tools/history_fuzz.py)."""
    m = _model(getattr(torch, dtype))
    a = _opt(m, "nvme", "float32", tmp_path, "a")
    _step(m, a, 1)
    keys = ["exp_avg", "exp_avg_sq"] + (["master"] if dtype == "bfloat16" else [])
    for k in keys:
        if how == "assign":
            a.state[m.weight][k] = a.state[m.weight][k] * 0.5
        else:
            a.state[m.weight][k].mul_(0.5)
    written = {k: a.state[m.weight][k].clone() for k in keys}
    a.close(keep_swap=True)
    b = offload.AdamW(m.parameters(), lr=1e-2, offload="nvme", swap_dir=str(tmp_path / "a"), resume=True)
    try:
        for k in keys:
            assert torch.equal(b.state[m.weight][k], written[k]), k
    finally:
        b.close()
