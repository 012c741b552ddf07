"""A state read as a copy (``offload="nvme"``, int8 states decoded) writes an in-place change
back to its store (or refuses it, test_state_write_back.py) and is otherwise a plain tensor ([Note: a read copy refuses in-place changes] in offload/optim/state_view.py,
offload/optim/read_copy.py).

It was an inference tensor at first, which refused more: a penalty weighted by Adam's second
moment, ``(opt.state[p]["exp_avg_sq"] * (w - w0) ** 2).sum().backward()``, raised "Inference
tensors cannot be saved for backward" where the same line on torch's states ran; and less:
``.data.zero_()`` and ``.detach().zero_()`` went through and were silently lost."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import offload

# (param dtype, offload, state_dtype): read from the swap files; decoded from int8 blocks in RAM
CASES = [("float32", "nvme", "float32"), ("bfloat16", "nvme", "bfloat16"), ("bfloat16", "cpu", "int8")]
IDS = ["-".join(c) for c in CASES]


def _stepped(tmp_path, dtype, kind, state_dtype):
    torch.manual_seed(0)
    m = torch.nn.Linear(40, 300).to(getattr(torch, dtype))  # 12000 weights: several int8 blocks
    kw = {"swap_dir": str(tmp_path)} if kind == "nvme" else {}
    opt = offload.AdamW(m.parameters(), lr=1e-2, offload=kind, state_dtype=state_dtype, **kw)
    m(torch.randn(4, 40).to(m.weight.dtype)).float().square().mean().backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("dtype,kind,state_dtype", CASES, ids=IDS)
def test_a_read_copy_takes_part_in_autograd_as_torchs_state_does(tmp_path, dtype, kind, state_dtype):
    m, opt = _stepped(tmp_path, dtype, kind, state_dtype)
    try:
        v = opt.state[m.weight]["exp_avg_sq"]
        plain = opt.state_dict()["state"][0]["exp_avg_sq"]
        w0 = torch.randn(m.weight.shape)
        w = torch.randn(m.weight.shape, requires_grad=True)
        (v * (w - w0) ** 2).sum().backward()  # an EWC-like penalty: v is saved for backward
        assert type(w.grad) is torch.Tensor
        assert torch.equal(w.grad, 2 * plain * (w.detach() - w0))
        assert torch.equal(v, plain)  # and the read itself is the stored state
    finally:
        opt.close()


CHANGES = {
    "zero_": lambda t: t.zero_(),
    "data.zero_": lambda t: t.data.zero_(),
    "detach.zero_": lambda t: t.detach().zero_(),
    "view.fill_": lambda t: t.view(-1)[:5].fill_(1.0),
    "iadd": lambda t: t.__iadd__(1.0),
    "setitem": lambda t: t.__setitem__(0, 1.0),
    "out=": lambda t: torch.mul(t, 2.0, out=t),
    "relu inplace": lambda t: torch.nn.functional.relu(t, inplace=True),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("dtype,kind,state_dtype", CASES, ids=IDS)
def test_an_in_place_change_of_a_read_copy_is_written_back_however_spelled(tmp_path, dtype, kind, state_dtype, change):
    """The store then holds what assigning the changed copy stores (int8: re-encoded), bit for
    bit ([Note: an in-place change of a read copy is written back] in write_back.py)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    m, opt = _stepped(tmp_path / "a", dtype, kind, state_dtype)
    m2, opt2 = _stepped(tmp_path / "b", dtype, kind, state_dtype)
    try:
        got = opt.state[m.weight]["exp_avg"]
        was = got.clone()
        CHANGES[change](got)
        assert not torch.equal(got, was)  # the copy changed
        opt2.state[m2.weight]["exp_avg"] = got.clone()
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    finally:
        opt.close()
        opt2.close()


@pytest.mark.parametrize("dtype,kind,state_dtype", CASES, ids=IDS)
def test_a_read_copy_saves_and_copies_as_a_plain_tensor(tmp_path, dtype, kind, state_dtype):
    m, opt = _stepped(tmp_path, dtype, kind, state_dtype)
    try:
        got = opt.state[m.weight]["exp_avg"]
        buf = io.BytesIO()
        torch.save({"exp_avg": got}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)["exp_avg"]  # knows no class of ours
        mine = copy.deepcopy(got)
        for t in (loaded, mine, got * 1.0, got.clone()):
            assert type(t) is torch.Tensor and torch.equal(t, got)
        mine.zero_()  # a tensor of the user's own
        assert repr(got).startswith("tensor(")
    finally:
        opt.close()


@pytest.mark.parametrize("dtype,kind,state_dtype", CASES, ids=IDS)
def test_a_read_copy_is_a_read_only_numpy_array(tmp_path, dtype, kind, state_dtype):
    np = pytest.importorskip("numpy")
    m, opt = _stepped(tmp_path, dtype, kind, state_dtype)
    try:
        got = opt.state[m.weight]["exp_avg"]
        if got.dtype == torch.bfloat16:  # NumPy has no bf16: .numpy() refuses it anyway
            with pytest.raises(TypeError):
                got.numpy()
            return
        was = got.clone()
        for arr in (got.numpy(), np.asarray(got), got.detach().numpy(), got.view(-1)[:5].numpy()):
            with pytest.raises(ValueError, match="read-only"):
                arr[0] = 1.0  # the write went into the copy and was silently lost
            assert np.array_equal(arr.reshape(-1), was.view(-1)[:arr.size].numpy())  # reads work
        assert torch.equal(got, was)
        mine = got.clone().numpy()  # a copy of the user's own stays writable
        mine[0] = 1.0
        # so does numpy's conversion to another dtype: a new array, not the copy's memory
        # (it was made read-only too, and `a *= 2` on it, which worked before, failed)
        wide = np.asarray(got, dtype=np.float64)
        wide[0] = 1.0
        assert torch.equal(got, was)
    finally:
        opt.close()
