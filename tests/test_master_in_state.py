"""The fp32 master of fp16/bf16 params in ``opt.state[p]`` ([Note: the master in opt.state] in
offload/optim/state_view.py): listed beside the states in every store that keeps one apart
from the param, equal bit for bit to ``state_dict()``'s ``"master"``, assignable (the next step
starts from it and writes the param from it), and not listed where there is none (fp32 CPU
params, a bf16 master). torch.distributed.checkpoint's flattened dicts carry it through these
keys: tests/test_dcp_state_dict.py and tests/test_dcp_ranks.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import offload

SIZES = [(3000,), (7,), (40, 61), (1,)]  # (a SIMD tail, a param smaller than a vector)
STORES = ["none", "cpu", "nvme"]


def _params(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SIZES]


def _opt(tmp_path, store, dtype=torch.bfloat16, **kw):
    params = _params(dtype)
    if store == "nvme":
        tmp_path.mkdir(exist_ok=True)
        kw.update(swap_dir=str(tmp_path), max_host_bytes=8 << 20)
    return params, offload.AdamW(params, lr=1e-2, weight_decay=0.1, offload=store, **kw)


def _step(opt, params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("store", STORES)
def test_master_listed_and_equal_to_state_dict(workdir, store, dtype, state_dtype):
    """(int8 states are read on access in RAM too, and the master after them: in the states' order)"""
    params, opt = _opt(workdir, store, dtype, state_dtype=state_dtype)
    assert all("master" not in opt.state[p] for p in params)  # nothing before the first step, as torch
    for s in range(3):
        _step(opt, params, s)
    sd = opt.state_dict()["state"]
    for i, p in enumerate(params):
        st = opt.state[p]
        assert list(st) == ["step", "exp_avg", "exp_avg_sq", "master"]
        m = st["master"]
        assert m.dtype == torch.float32 and m.shape == p.shape
        assert torch.equal(m, sd[i]["master"])
        assert not torch.equal(m.to(dtype).float(), m)  # the master holds bits the param has not
        assert torch.equal(m.to(dtype), p.detach())  # the param is its rounding
    opt.close()


@pytest.mark.parametrize("store", STORES)
def test_master_state_dict_is_a_copy(workdir, store):
    """state_dict() hands out copies: a later step changes opt.state's master, not the dict's."""
    params, opt = _opt(workdir, store)
    _step(opt, params, 0)
    sd = opt.state_dict()["state"]
    before = sd[0]["master"].clone()
    _step(opt, params, 1)
    assert torch.equal(sd[0]["master"], before)
    assert not torch.equal(opt.state[params[0]]["master"], before)
    opt.close()


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
@pytest.mark.parametrize("store", STORES)
def test_assigned_master_is_where_the_next_step_starts(workdir, store, state_dtype):
    """A master read out of opt.state and assigned back is the same bits; an assigned one is
    what state_dict() holds, and the next step (lr 0: no change) writes the params from it."""
    params, opt = _opt(workdir, store, state_dtype=state_dtype)
    for s in range(2):
        _step(opt, params, s)
    saved = [opt.state[p]["master"].clone() for p in params]
    for i, (p, m) in enumerate(zip(params, saved)):
        opt.state[p]["master"] = torch.zeros_like(m)
        assert torch.equal(opt.state[p]["master"], torch.zeros_like(m))
        assert torch.equal(opt.state_dict()["state"][i]["master"], torch.zeros_like(m))
        opt.state[p]["master"] = m
    after = [opt.state[p]["master"] for p in params]
    assert all(torch.equal(a, m) for a, m in zip(after, saved))
    new = [torch.full(p.shape, 1.0 + 2 ** -12) for p in params]  # not a bf16 value
    for p, m in zip(params, new):
        opt.state[p]["master"] = m
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0  # the step moves nothing: the params <- the masters
    _step(opt, params, 2)
    for p, m in zip(params, new):
        assert torch.equal(opt.state[p]["master"], m)
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    opt.close()


@pytest.mark.parametrize("store", STORES)
def test_master_refuses_bad_values_and_drops(workdir, store):
    params, opt = _opt(workdir, store)
    _step(opt, params, 0)
    p = params[0]
    before = opt.state[p]["master"].clone()
    with pytest.raises(ValueError, match="holds 3000 elements"):
        opt.state[p]["master"] = torch.zeros(5)
    with pytest.raises(NotImplementedError, match="cannot drop"):
        del opt.state[p]["master"]
    assert torch.equal(opt.state[p]["master"], before)
    opt.close()


@pytest.mark.parametrize("store", STORES)
def test_no_master_listed_without_one(workdir, store):
    """fp32 CPU params are their own master; a bf16 master is the param itself."""
    params, opt = _opt(workdir, store, torch.float32)
    _step(opt, params, 0)
    assert all("master" not in opt.state[p] for p in params)
    assert all("master" not in e for e in opt.state_dict()["state"].values())
    opt.close()
    params, opt = _opt(workdir / "b" if store == "nvme" else workdir, store, master_dtype="bfloat16")
    _step(opt, params, 0)
    assert all("master" not in opt.state[p] for p in params)
    assert all("master" not in e for e in opt.state_dict()["state"].values())
    opt.close()


def test_master_through_load_state_dict(workdir):
    """A loaded dict's master is what opt.state lists after the load (not the param's rounding)."""
    params, opt = _opt(workdir, "none")
    for s in range(2):
        _step(opt, params, s)
    sd = opt.state_dict()
    params2, opt2 = _opt(workdir, "none")
    for p, q in zip(params2, params):
        p.data.copy_(q.detach())
    opt2.load_state_dict(sd)
    for i, p in enumerate(params2):
        assert torch.equal(opt2.state[p]["master"], sd["state"][i]["master"])
    opt.close()
    opt2.close()


@pytest.mark.parametrize("store", ["cpu", "nvme"])
def test_master_after_load_checkpoint_and_resume(workdir, store):
    """The entries are rebuilt after a load_checkpoint (and, on nvme, a resume=True) and list
    the loaded masters, not the params' rounding."""
    params, opt = _opt(workdir / "a", store)
    for s in range(3):
        _step(opt, params, s)
    masters = [opt.state[p]["master"].clone() for p in params]
    opt.save_checkpoint(str(workdir / "ck"))
    params2, opt2 = _opt(workdir / "b", store)
    opt2.load_checkpoint(str(workdir / "ck"))
    assert all(torch.equal(opt2.state[p]["master"], m) for p, m in zip(params2, masters))
    opt2.close()
    if store == "nvme":
        opt.close(keep_swap=True)
        params3 = _params()
        for p, q in zip(params3, params):
            p.data.copy_(q.detach())
        opt3 = offload.AdamW(params3, lr=1e-2, weight_decay=0.1, offload="nvme", swap_dir=str(workdir / "a"),
                             max_host_bytes=8 << 20, resume=True)
        assert all(torch.equal(opt3.state[p]["master"], m) for p, m in zip(params3, masters))
        opt3.close()
    else:
        opt.close()
