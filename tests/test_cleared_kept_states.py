"""``opt.state[p].clear()`` in the flat and swapped stores: the param starts afresh at its next
step as torch's does, holding only what its group's rule makes then. Adam's max_exp_avg_sq
(kept by a param that stepped with amsgrad) and SGD's momentum buffer (kept by one that
stepped with momentum) went with the clear in torch; these stores still listed them, zeros,
after a step with amsgrad off / momentum 0 (found by tools/history_fuzz.py); and SGD's
restarted buffer was damped as an old one."""
from __future__ import annotations

import pytest
import torch

import offload

SIZES = (4097, 17, 7)
STORES = {"flat": (torch.bfloat16, "cpu"), "nvme": (torch.float32, "nvme"), "flat-nvme": (torch.bfloat16, "nvme")}


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen).to(dtype).requires_grad_() for n in SIZES]


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 3).to(torch.bfloat16).to(p.dtype)


def _kwargs(store, tmp_path):
    if STORES[store][1] != "nvme":
        return {"offload": "cpu"}
    (tmp_path / "swap").mkdir()
    return {"offload": "nvme", "swap_dir": str(tmp_path / "swap")}


def _run(opt, params, flag, off):
    """A step, ``flag`` turned ``off``, param 1 cleared, a step: state_dict() keys per param."""
    _grads(params, 1)
    opt.step()
    opt.param_groups[0][flag] = off
    opt.state[params[1]].clear()
    _grads(params, 2)
    opt.step()
    return {i: sorted(set(e) - {"master"}) for i, e in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("store", sorted(STORES))
def test_a_cleared_param_stepped_with_amsgrad_off_shows_no_max_exp_avg_sq(store, tmp_path):
    params = _params(STORES[store][0])
    opt = offload.Adam(params, lr=1e-2, amsgrad=True, **_kwargs(store, tmp_path))
    ref_params = _params()
    ref = torch.optim.Adam(ref_params, lr=1e-2, amsgrad=True, foreach=False)
    want = _run(ref, ref_params, "amsgrad", False)
    assert "max_exp_avg_sq" not in want[1] and "max_exp_avg_sq" in want[0]
    assert _run(opt, params, "amsgrad", False) == want
    assert "max_exp_avg_sq" not in opt.state[params[1]]
    opt.param_groups[0]["amsgrad"] = True  # back on: it starts at zeros, the others go on
    _grads(params, 3)
    opt.step()
    got = opt.state_dict()["state"]
    assert torch.equal(got[1]["max_exp_avg_sq"], got[1]["exp_avg_sq"])
    opt.close()


@pytest.mark.parametrize("store", sorted(STORES))
def test_a_cleared_sgd_param_restarts_its_buffer_as_torch(store, tmp_path):
    params = _params(STORES[store][0])
    kw = dict(lr=0.1, momentum=0.9, dampening=0.3)
    opt = offload.SGD(params, **kw, **_kwargs(store, tmp_path))
    ref_params = _params()
    ref = torch.optim.SGD(ref_params, **kw, foreach=False)
    want = _run(ref, ref_params, "momentum", 0.0)
    assert want[1] == [] and want[0] == ["momentum_buffer"]
    assert {i: e for i, e in _run(opt, params, "momentum", 0.0).items() if e} == {i: e for i, e in want.items() if e}
    for o in (opt, ref):  # momentum back: param 1's buffer starts as its grad, undamped
        o.param_groups[0]["momentum"] = 0.9
        o.state[(params if o is opt else ref_params)[2]].clear()
    for o, ps in ((opt, params), (ref, ref_params)):
        _grads(ps, 3)
        o.step()
    got, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in range(3):
        torch.testing.assert_close(got[i]["momentum_buffer"], theirs[i]["momentum_buffer"], rtol=1e-6, atol=1e-6)
    opt.close()
