"""float64 params ([Note: float64 params] in offload/optim/host_dtypes.py): every optimizer
steps them in the host store (offload="none" / "cpu") with torch's arithmetic in float64,
states float64 in opt.state and state_dict: bit for bit torch's (foreach=False), beside
float32 params stepped by the kernels; clipping; the streamed checkpoints and every other
store refuse them by name."""
from __future__ import annotations

import copy

import pytest
import torch

import offload
from test_rules_optim import RefLion

STEPS = 8
CONFIGS = [
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, amsgrad=True, maximize=True, weight_decay=0.1)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.05)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.2, weight_decay=0.1)),
    ("Lion", dict(lr=0.01, weight_decay=0.1)),
]


def _reference(name, params, kw):
    return RefLion(params, **kw) if name == "Lion" else getattr(torch.optim, name)(params, foreach=False, **kw)


def _pair(n: int, contiguous: bool):
    """A float64 param (strided or not) and a float32 one beside it, twice."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(n, 2, dtype=torch.float64, generator=g)
    narrow = torch.randn(9, generator=g)

    def make():
        p = wide.clone()[:, 0] if not contiguous else wide[:, 0].clone()
        return [p.detach().requires_grad_(), narrow.clone().requires_grad_()]

    return make(), make()


def _run(opt, params, steps, clip=None):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()


@pytest.mark.parametrize("offload_to", ["none", "cpu"])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("n", [1, 17, 4097])
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_float64_params_step_as_torch_bit_for_bit(name, kw, n, contiguous, offload_to):
    mine, ref = _pair(n, contiguous)
    opt = getattr(offload, name)(mine, offload=offload_to, state_dtype="int8" if offload_to == "cpu" else "float32",
                                 **kw)
    theirs = _reference(name, ref, kw)
    _run(opt, mine, STEPS)
    _run(theirs, ref, STEPS)
    assert torch.equal(mine[0], ref[0])  # float64: torch's own statements, every bit
    torch.testing.assert_close(mine[1], ref[1], rtol=1e-5, atol=1e-6)  # float32: the kernels
    for key, t in theirs.state[ref[0]].items():
        ours = opt.state_dict()["state"][0][key]
        assert ours.dtype == t.dtype
        assert torch.equal(ours, t), key


def test_clipping_takes_the_float64_grads_norm():
    # float64 params only: beside a float32 param torch's clip_grad_norm_ takes that one's
    # norm in float32, ours in double, and the coefficients differ in the 7th digit
    mine, ref = _pair(4097, True)
    mine, ref = mine[:1], ref[:1]
    opt = offload.AdamW(mine, lr=0.01, max_grad_norm=0.5)
    theirs = torch.optim.AdamW(ref, lr=0.01, foreach=False)
    _run(opt, mine, 4)
    _run(theirs, ref, 4, clip=0.5)
    torch.testing.assert_close(mine[0], ref[0], rtol=1e-12, atol=1e-14)
    assert opt.last_grad_norm > 0.5  # it clipped


def test_state_dict_moves_between_torch_and_offload():
    mine, ref = _pair(17, True)
    theirs = torch.optim.Adagrad(ref, lr=0.1, foreach=False)
    _run(theirs, ref, 3)
    with torch.no_grad():
        for a, b in zip(mine, ref):
            a.copy_(b)
    opt = offload.Adagrad(mine, lr=0.1)
    opt.load_state_dict(copy.deepcopy(theirs.state_dict()))
    _run(opt, mine, 2)
    _run(theirs, ref, 2)
    assert torch.equal(mine[0], ref[0])
    back = torch.optim.Adagrad([p.detach().clone().requires_grad_() for p in mine], lr=0.1)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch.equal(back.state_dict()["state"][0]["sum"], opt.state_dict()["state"][0]["sum"])
    assert back.state_dict()["state"][0]["sum"].dtype == torch.float64


def test_streamed_checkpoints_refuse_float64(tmp_path):
    mine, _ = _pair(17, True)
    opt = offload.AdamW(mine, lr=0.01)
    _run(opt, mine, 1)
    with pytest.raises(NotImplementedError, match="save_checkpoint: parameter 0 is float64.*state_dict"):
        opt.save_checkpoint(str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()
    with pytest.raises(NotImplementedError, match="load_checkpoint: parameter 0 is float64"):
        opt.load_checkpoint(str(tmp_path / "ck"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_stores_other_than_the_host_store_refuse_them(tmp_path, dtype):
    w = torch.zeros(3, dtype=dtype, requires_grad=True)
    with pytest.raises(NotImplementedError, match=rf"parameter 0 is {dtype}.*offload='nvme'"):
        offload.AdamW([w], offload="nvme", swap_dir=str(tmp_path))
    with pytest.raises(NotImplementedError, match=rf"parameter 1 is {dtype}.*stage 2"):
        offload.SGD([torch.zeros(2, requires_grad=True), w], lr=0.1, stage=2)
    with pytest.raises(NotImplementedError, match=rf"parameter 1 is {dtype}"):  # beside a flat master
        offload.Adam([torch.zeros(2, dtype=torch.bfloat16, requires_grad=True), w])
