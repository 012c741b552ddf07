"""Two gaps to torch closed in offload.SGD and offload.Adagrad, in every store.

1. SGD: a param's momentum buffer starts as ``d_p`` (torch: ``buf is None`` -> clone) on its
   first step with momentum, also when that is not its first step (a group's momentum
   0 -> 0.9 mid-run, with dampening != 0 where the old code started it as ``(1-d) * d_p``).
2. Adagrad: ``"step"`` (0) and ``"sum"`` exist from construction in ``state_dict()`` and
   ``opt.state[p]`` with every store (the swap and flat stores had none before the first step).

Stores: fp32 CPU params with offload "none" / "cpu" (host) and "nvme" (swapped), bf16
params (the flat store) with "cpu" and "nvme". Compared with torch element by element
(DESIGN.md's numerics contract); the bf16 cases compare the fp32 masters and states, torch
running on the same fp32 values.
"""
from __future__ import annotations

import copy

import pytest
import torch

import offload

STORES = [("none", torch.float32), ("cpu", torch.float32), ("nvme", torch.float32),
          ("cpu", torch.bfloat16), ("nvme", torch.bfloat16)]
IDS = ["host-none", "host-cpu", "swapped", "flat-cpu", "flat-nvme"]
SIZES = (1, 7, 4097)


def _kw(offl, tmp_path):
    return dict(offload=offl, swap_dir=str(tmp_path)) if offl == "nvme" else dict(offload=offl)


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    ours = [t.clone().requires_grad_() for t in start]
    ref = [t.float().requires_grad_() for t in start]  # torch on the same (rounded) values
    return ours, ref


def _grads(ours, ref, dtype, gen):
    for p, t in zip(ours, ref):
        g = torch.randn(p.shape, generator=gen).to(dtype)
        p.grad, t.grad = g.clone(), g.float()


def _close(a, b, what):
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _state_of(opt, i, key):
    return opt.state_dict()["state"][i][key]


def _master(opt, p, i):
    sd = opt.state_dict()["state"].get(i, {})
    return sd["master"] if "master" in sd else p.detach()


# ---------------------------------------------------------------- 1. SGD buffer start
def _sgd_groups(params, momentum0, dampening):
    return [{"params": params[:2], "momentum": momentum0}, {"params": params[2:], "momentum": 0.9}], \
        dict(lr=0.05, dampening=dampening, weight_decay=0.01)


def _assert_buffers_and_params_match(opt, topt, ours, ref):
    """Every momentum buffer and param of ours equals torch's (the contract's tolerances)."""
    tsd = topt.state_dict()["state"]
    for i, (p, t) in enumerate(zip(ours, ref)):
        _close(_state_of(opt, i, "momentum_buffer"), tsd[i]["momentum_buffer"], f"buf {i}")
        _close(_master(opt, p, i), t.detach(), f"param {i}")


@pytest.mark.parametrize("dampening", [0.0, 0.5])
@pytest.mark.parametrize("offl,dtype", STORES, ids=IDS)
def test_sgd_momentum_turned_on_mid_run_matches_torch(offl, dtype, dampening, tmp_path):
    ours, ref = _params(dtype)
    groups, hyper = _sgd_groups(ours, 0.0, dampening)
    opt = offload.SGD(groups, **hyper, **_kw(offl, tmp_path))
    tgroups, _ = _sgd_groups(ref, 0.0, dampening)
    topt = torch.optim.SGD(tgroups, **hyper, foreach=False)
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(8):
            if step == 3:  # the buffers of group 0 start now, at count 4
                opt.param_groups[0]["momentum"] = topt.param_groups[0]["momentum"] = 0.9
            _grads(ours, ref, dtype, gen)
            opt.step()
            topt.step()
            sd, tsd = opt.state_dict()["state"], topt.state_dict()["state"]
            for i, (p, t) in enumerate(zip(ours, ref)):
                assert ("momentum_buffer" in sd.get(i, {})) == ("momentum_buffer" in tsd.get(i, {})), (step, i)
                if "momentum_buffer" in tsd.get(i, {}):
                    _close(sd[i]["momentum_buffer"], tsd[i]["momentum_buffer"], f"step {step} buf {i}")
                _close(_master(opt, p, i), t.detach(), f"step {step} param {i}")
    finally:
        opt.close()


@pytest.mark.parametrize("offl,dtype", STORES, ids=IDS)
def test_sgd_started_buffers_follow_a_torch_state_dict(offl, dtype, tmp_path):
    """Loaded from torch mid-run (group 0 without momentum so far: no buffers), then momentum
    on: the loaded dict says which buffers started, in every store."""
    ours, ref = _params(dtype)
    tgroups, hyper = _sgd_groups(ref, 0.0, 0.5)
    topt = torch.optim.SGD(tgroups, **hyper, foreach=False)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        _grads(ours, ref, dtype, gen)
        topt.step()
    with torch.no_grad():
        for p, t in zip(ours, ref):
            p.copy_(t)  # (bf16: rounded; the master then comes from the param, both sides)
            t.copy_(p.float())
    groups, _ = _sgd_groups(ours, 0.0, 0.5)
    opt = offload.SGD(groups, **hyper, **_kw(offl, tmp_path))
    try:
        opt.load_state_dict(copy.deepcopy(topt.state_dict()))  # (torch shares the tensors)
        assert sorted(opt.state_dict()["state"]) == sorted(topt.state_dict()["state"]) or dtype != torch.float32
        opt.param_groups[0]["momentum"] = topt.param_groups[0]["momentum"] = 0.9
        for step in range(3):
            _grads(ours, ref, dtype, gen)
            opt.step()
            topt.step()
        _assert_buffers_and_params_match(opt, topt, ours, ref)
    finally:
        opt.close()


# ---------------------------------------------------------------- 2. Adagrad from construction
def _check_like_torch(sd, tsd, fill):
    assert sorted(sd["state"]) == sorted(tsd["state"])
    for i, tst in tsd["state"].items():
        st = sd["state"][i]
        assert list(st)[:2] == ["step", "sum"], list(st)
        assert st["step"].dtype == tst["step"].dtype and st["step"].shape == tst["step"].shape
        assert float(st["step"]) == float(tst["step"])
        assert st["sum"].dtype == torch.float32 and st["sum"].shape == tst["sum"].shape
        assert torch.equal(st["sum"], torch.full_like(tst["sum"], fill))


@pytest.mark.parametrize("offl,dtype", STORES, ids=IDS)
def test_adagrad_state_exists_before_the_first_step(offl, dtype, tmp_path):
    ours, ref = _params(dtype)
    kw = dict(lr=0.1, initial_accumulator_value=0.1, lr_decay=0.01, weight_decay=0.1)
    opt = offload.Adagrad(ours, **kw, **_kw(offl, tmp_path))
    topt = torch.optim.Adagrad(ref, **kw, foreach=False)
    try:
        _check_like_torch(opt.state_dict(), topt.state_dict(), 0.1)
        for p in ours:  # the views (swap readers with offload="nvme") are there too
            assert float(opt.state[p]["step"]) == 0.0
            assert torch.equal(opt.state[p]["sum"].reshape(-1), torch.full((p.numel(),), 0.1))
        # our dict loads into torch, and torch's into ours (a fresh one each way)
        other = torch.optim.Adagrad([t.detach().clone().requires_grad_() for t in ref], **kw)
        other.load_state_dict(copy.deepcopy(opt.state_dict()))
        _check_like_torch(other.state_dict(), topt.state_dict(), 0.1)
        opt.load_state_dict(copy.deepcopy(topt.state_dict()))  # (torch shares the tensors)
        _check_like_torch(opt.state_dict(), topt.state_dict(), 0.1)
        gen = torch.Generator().manual_seed(3)
        for step in range(5):  # and the steps from there match torch's
            _grads(ours, ref, dtype, gen)
            opt.step()
            topt.step()
        tsd = topt.state_dict()["state"]
        for i, (p, t) in enumerate(zip(ours, ref)):
            assert float(_state_of(opt, i, "step")) == 5.0
            _close(_state_of(opt, i, "sum"), tsd[i]["sum"], f"sum {i}")
            _close(_master(opt, p, i), t.detach(), f"param {i}")
    finally:
        opt.close()


@pytest.mark.parametrize("offl,dtype", STORES, ids=IDS)
def test_adagrad_unstepped_param_keeps_torch_entry_after_steps_and_checkpoint(offl, dtype, tmp_path):
    """A param without a grad so far has torch's step 0 / filled sum, also after a checkpoint
    round trip (whose loader drops the entries of params that never stepped)."""
    ours, _ = _params(dtype)
    swap = tmp_path / "swap"
    swap.mkdir()
    opt = offload.Adagrad(ours, lr=0.1, initial_accumulator_value=0.5, **_kw(offl, swap))
    try:
        ours[0].grad = torch.ones_like(ours[0])
        opt.step()
        for _ in range(2):
            sd = opt.state_dict()["state"]
            assert float(sd[0]["step"]) == 1.0
            for i in (1, 2):
                assert float(sd[i]["step"]) == 0.0 and torch.equal(sd[i]["sum"], torch.full(SIZES[i:i + 1], 0.5))
                assert float(opt.state[ours[i]]["step"]) == 0.0
            opt.save_checkpoint(str(tmp_path / "ckpt"))
            opt.load_checkpoint(str(tmp_path / "ckpt"))
    finally:
        opt.close()


@pytest.mark.parametrize("offl", ["cpu", "nvme"])
def test_sgd_flat_store_without_any_momentum_refuses_momentum_later(offl, tmp_path):
    """The README's limit: no group had momentum at construction, so the flat store keeps no
    buffer; switching momentum on is refused at the step, before anything changes."""
    p = torch.randn(7).bfloat16().requires_grad_()
    before = p.detach().clone()
    opt = offload.SGD([p], lr=0.1, momentum=0.0, dampening=0.5, **_kw(offl, tmp_path))
    try:
        opt.param_groups[0]["momentum"] = 0.9
        p.grad = torch.ones_like(p)
        with pytest.raises(ValueError, match=r"a group now needs rule 'sgd' \['momentum_buffer'\].*build a new optimizer"):
            opt.step()
        assert torch.equal(p.detach(), before) and opt.state_dict()["state"] == {}
        opt.param_groups[0]["momentum"] = 0.0  # back as built: it steps again
        opt.step()
        assert not torch.equal(p.detach(), before)
    finally:
        opt.close()


def test_sgd_started_buffers_follow_saved_param_ids():
    """A dict whose param ids are not 0..n-1 (torch pairs them with ours in order)."""
    ref_p = [torch.randn(5, requires_grad=True) for _ in range(2)]
    ref = torch.optim.SGD([{"params": ref_p[:1]}, {"params": ref_p[1:], "momentum": 0.0}], lr=0.1,
                          momentum=0.9, dampening=0.5)
    for t in ref_p:
        t.grad = torch.ones_like(t)
    ref.step()
    sd = copy.deepcopy(ref.state_dict())
    sd["state"] = {10 + k: v for k, v in sd["state"].items()}
    sd["param_groups"][0]["params"], sd["param_groups"][1]["params"] = [10], [11]
    ours = [t.detach().bfloat16().requires_grad_() for t in ref_p]
    opt = offload.SGD([{"params": ours[:1]}, {"params": ours[1:], "momentum": 0.0}], lr=0.1, momentum=0.9,
                      dampening=0.5, offload="cpu")
    try:
        opt.load_state_dict(sd)
        state = opt.state_dict()["state"]
        assert "momentum_buffer" in state[0] and "momentum_buffer" not in state.get(1, {})
        _close(state[0]["momentum_buffer"], ref.state_dict()["state"][0]["momentum_buffer"], "loaded buffer")
    finally:
        opt.close()


@pytest.mark.parametrize("offl,dtype", STORES, ids=IDS)
def test_sgd_checkpoint_round_trip_keeps_unstarted_buffers_unstarted(offl, dtype, tmp_path):
    """save_checkpoint / load_checkpoint mid-run (group 0 without momentum so far), then
    momentum on: group 0's buffers start as d_p, as torch's (whose state never had them)."""
    ours, ref = _params(dtype)
    groups, hyper = _sgd_groups(ours, 0.0, 0.5)
    swap = tmp_path / "swap"
    swap.mkdir()
    opt = offload.SGD(groups, **hyper, **_kw(offl, swap))
    tgroups, _ = _sgd_groups(ref, 0.0, 0.5)
    topt = torch.optim.SGD(tgroups, **hyper, foreach=False)
    gen = torch.Generator().manual_seed(4)
    try:
        for step in range(5):
            if step == 2:
                opt.save_checkpoint(str(tmp_path / "ckpt"))
                opt.load_checkpoint(str(tmp_path / "ckpt"))
                assert sorted(opt.state_dict()["state"]) == sorted(topt.state_dict()["state"]) \
                    or dtype != torch.float32  # (bf16: every param has its "master")
                opt.param_groups[0]["momentum"] = topt.param_groups[0]["momentum"] = 0.9
            _grads(ours, ref, dtype, gen)
            opt.step()
            topt.step()
        _assert_buffers_and_params_match(opt, topt, ours, ref)
    finally:
        opt.close()


@pytest.mark.parametrize("into", [("none", 0.0, "float32"), ("cpu", 0.9, "float32"), ("nvme", 0.9, "float32"),
                                  ("cpu", 0.0, "int8")], ids=["none-plain", "cpu-momentum", "nvme-momentum", "cpu-int8"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_sgd_checkpoint_of_a_host_store_that_turned_momentum_on_keeps_its_buffers(state_dtype, into, tmp_path):
    """Built without momentum, fp32 CPU params (the host store), momentum turned on mid-run:
    the checkpoint held no buffer (the store's fields were those of SGD without momentum), so a
    load started every buffer afresh from d_p, or was refused with momentum at construction
    (found by tools/history_fuzz.py). Now it holds them, as Adam's checkpoints hold a
    max_exp_avg_sq turned on mid-run, and the loaded run goes on as torch's."""
    ours, ref = _params(torch.float32)
    opt = offload.SGD(ours, lr=0.1, momentum=0.0, dampening=0.5, offload="cpu", state_dtype=state_dtype)
    topt = torch.optim.SGD(ref, lr=0.1, momentum=0.0, dampening=0.5, foreach=False)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        if step == 1:
            opt.param_groups[0]["momentum"] = topt.param_groups[0]["momentum"] = 0.9
        _grads(ours, ref, torch.float32, gen)
        opt.step()
        topt.step()
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    offl, momentum, sd = into
    (tmp_path / "swap").mkdir()
    new = offload.SGD(ours, lr=0.1, momentum=momentum, dampening=0.5, state_dtype=sd, **_kw(offl, tmp_path / "swap"))
    try:
        new.load_checkpoint(str(tmp_path / "ckpt"))
        assert new.param_groups[0]["momentum"] == 0.9
        assert sorted(new.state_dict()["state"]) == [0, 1, 2]
        _grads(ours, ref, torch.float32, gen)
        new.step()
        topt.step()
        if state_dtype == "float32" and sd == "float32":
            _assert_buffers_and_params_match(new, topt, ours, ref)
        else:  # compressed buffers: within their rounding of torch's
            for i, p in enumerate(ours):
                torch.testing.assert_close(p.detach(), ref[i].detach(), rtol=0.02, atol=0.02)
    finally:
        new.close()
        opt.close()
