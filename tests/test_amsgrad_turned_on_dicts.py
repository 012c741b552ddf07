"""A group that turns amsgrad on after its params stepped: torch's state then holds exp_avg
and exp_avg_sq without max_exp_avg_sq (torch's own step fails on it, KeyError; ours starts it
at zeros). Such a dict, ours or torch's, loads in every store that keeps a max_exp_avg_sq and
goes on as the step that started it would have (found by tools/history_fuzz.py); a store
built without one refuses it, saying why; a dict damaged otherwise is still refused."""
from __future__ import annotations

import copy

import pytest
import torch

import offload

SIZES = (4097, 17, 7)
TOL = dict(rtol=1e-6, atol=1e-7)


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen).to(dtype).requires_grad_() for n in SIZES]


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:  # bf16-exact values: every dtype sees the same grads
        p.grad = (torch.randn(p.shape, generator=gen) * 3).to(torch.bfloat16).to(p.dtype)


def _reference():
    """torch's Adam: one step, amsgrad turned on, its dict; then the step ours takes (the
    missing max_exp_avg_sq started at zeros, where torch's step would raise KeyError)."""
    params = _params()
    ref = torch.optim.Adam(params, lr=1e-2, foreach=False)
    _grads(params, 1)
    ref.step()
    ref.param_groups[0]["amsgrad"] = True
    sd = copy.deepcopy(ref.state_dict())
    mid = [p.detach().clone() for p in params]
    for p in params:
        ref.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
    _grads(params, 2)
    ref.step()
    return sd, ref, params, mid


def _ours_turned_on():
    params = _params()
    opt = offload.Adam(params, lr=1e-2)  # the host store: a group may turn amsgrad on
    _grads(params, 1)
    opt.step()
    opt.param_groups[0]["amsgrad"] = True
    return opt.state_dict()


STORES = {"host": (torch.float32, {"offload": "cpu"}), "host-none": (torch.float32, {"offload": "none"}),
          "host-int8": (torch.float32, {"offload": "cpu", "state_dtype": "int8"}),
          "flat": (torch.bfloat16, {"offload": "cpu", "amsgrad": True}),
          "nvme": (torch.float32, {"offload": "nvme", "amsgrad": True}),
          "flat-nvme": (torch.bfloat16, {"offload": "nvme", "amsgrad": True})}


@pytest.mark.parametrize("whose", ["ours", "torch"])
@pytest.mark.parametrize("store", sorted(STORES))
def test_a_dict_taken_right_after_amsgrad_was_turned_on_loads_and_goes_on(store, whose, tmp_path):
    want_sd, ref, ref_params, mid = _reference()
    sd = copy.deepcopy(_ours_turned_on() if whose == "ours" else want_sd)
    assert all("max_exp_avg_sq" not in e for e in sd["state"].values())
    dtype, kw = STORES[store]
    if kw["offload"] == "nvme":
        (tmp_path / "swap").mkdir()
        kw = dict(kw, swap_dir=str(tmp_path / "swap"))
    params = _params(dtype)
    with torch.no_grad():
        for p, r in zip(params, _params()):
            p.copy_(r - 1.0)  # (the load replaces the states, not the params: ours differ)
    opt = offload.Adam(params, lr=1e-2, **kw)
    if kw.get("amsgrad"):  # a max_exp_avg_sq held before the load does not survive it
        for seed in (5, 6):
            _grads(params, seed)
            opt.step()
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["amsgrad"]
    with torch.no_grad():
        for p, m in zip(params, mid):
            p.copy_(m.to(dtype))
    start = [p.detach().clone() for p in params]
    _grads(params, 2)
    opt.step()
    got = opt.state_dict()["state"]
    for i, r in enumerate(ref_params):
        want = ref.state[r]
        assert float(got[i]["step"]) == 2
        if kw.get("state_dtype") == "int8" and r.numel() >= 4096:
            continue  # (compressed: compared in value by the tests of int8 states)
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            torch.testing.assert_close(got[i][k].reshape(r.shape), want[k], **TOL)
        if dtype == torch.float32:
            torch.testing.assert_close(params[i].detach(), r.detach(), **TOL)
        else:  # from the bf16 param (the dict has no master): the same update as torch's
            torch.testing.assert_close(got[i]["master"] - start[i].float(), r.detach() - mid[i], rtol=1e-4, atol=1e-6)
    opt.close()


def test_a_store_built_without_amsgrad_refuses_it_saying_why(tmp_path):
    (tmp_path / "swap").mkdir()
    opt = offload.Adam(_params(), lr=1e-2, offload="nvme", swap_dir=str(tmp_path / "swap"))
    with pytest.raises(ValueError, match=r"needs rule 'adam_amsgrad'.*keeps the states of rule 'adam'"):
        opt.load_state_dict(copy.deepcopy(_ours_turned_on()))
    opt.close()


@pytest.mark.parametrize("drop, kept", [("exp_avg_sq", "exp_avg"), ("exp_avg", "exp_avg_sq"),
                                        ("exp_avg_sq", "max_exp_avg_sq")])
def test_a_dict_damaged_otherwise_is_still_refused(drop, kept):
    """max_exp_avg_sq alone may be missing (it starts late); the others never."""
    params = _params()
    src = offload.Adam(params, lr=1e-2, amsgrad=True)
    _grads(params, 1)
    src.step()
    bad = copy.deepcopy(src.state_dict())
    del bad["state"][1][drop]
    if kept != "max_exp_avg_sq":
        del bad["state"][1]["max_exp_avg_sq"]
    opt = offload.Adam(_params(), lr=1e-2)
    with pytest.raises(ValueError, match=rf"state\[1\] has '{kept}' without '{drop}'|"
                                         rf"state\[1\] has 'exp_avg' without '{drop}'"):
        opt.load_state_dict(bad)
    assert not opt.state_dict()["state"]
