"""Param groups of different rules in the flat and swapped stores ([Note: groups of different
rules] in offload/kernels/fields.py): Adam groups that differ in amsgrad, SGD groups with and
without momentum, also when a group turns to the bigger rule mid-run. Each store is compared
bit for bit with the host store (fp32 CPU params, which keeps torch's per-param dicts) on the
same grads, and with torch.optim within the numerics contract."""
from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.kernels.fields import ADAGRAD, ADAM, ADAM_AMSGRAD, LION, SGD, SGD_PLAIN, union_rule

TOL = dict(rtol=1e-5, atol=1e-6)
SIZES = (1, 7, 17, 4097)  # SIMD tails
STORES = ("nvme", "flat", "flat-nvme")  # fp32 CPU params on NVMe; bf16 params in RAM / on NVMe


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype).requires_grad_() for n in SIZES]


def _adam_groups(params, flags=(True, False)):
    return [{"params": params[:2], "amsgrad": flags[0]}, {"params": params[2:], "amsgrad": flags[1], "lr": 3e-3}]


def _sgd_groups(params, momentum=(0.9, 0.0)):
    return [{"params": params[:2], "momentum": momentum[0], "dampening": 0.1},
            {"params": params[2:], "momentum": momentum[1], "lr": 3e-3}]


def _store_kwargs(store, tmp_path, name="run"):
    if store == "nvme" or store == "flat-nvme":
        (tmp_path / name).mkdir(exist_ok=True)
        return {"offload": "nvme", "swap_dir": str(tmp_path / name)}
    return {"offload": "cpu"}


def _pair(store, tmp_path):
    """(our params, the host store's fp32 params holding the same values)."""
    params = _params(torch.float32 if store == "nvme" else torch.bfloat16)
    return params, [p.detach().float().clone().requires_grad_() for p in params]


def _step(opts_params, gen):
    """One step of each (optimizer, params) on the same grads (bf16-exact values)."""
    grads = [(torch.randn(n, generator=gen) * 3).to(torch.bfloat16) for n in SIZES]
    for opt, params in opts_params:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        opt.step()


def _masters(opt, params):
    sd = opt.state_dict()["state"]
    return [sd[i]["master"] if "master" in sd.get(i, {}) else p.detach() for i, p in enumerate(params)]


def _same_states(ours, host, params):
    """Bit for bit: each param's fp32 values (the master of a bf16 param) and state_dict()
    entries (the same keys: torch's layout)."""
    a, b = ours.state_dict()["state"], host.state_dict()["state"]
    assert {i: sorted(set(e) - {"master"}) for i, e in a.items()} == {i: sorted(e) for i, e in b.items()}
    for i in b:
        for k, v in b[i].items():
            assert torch.equal(a[i][k], v), (i, k)
    for m, p in zip(_masters(ours, params), host.param_groups[0]["params"] + host.param_groups[1]["params"]):
        assert torch.equal(m, p.detach())


@pytest.mark.parametrize("store", STORES)
def test_adam_groups_that_differ_in_amsgrad_step_as_the_host_store(store, tmp_path):
    """Group 0 with amsgrad, group 1 without; group 1 turns amsgrad on after step 3 (its
    max_exp_avg_sq starts as zeros then: the store's untouched field)."""
    params, host_params = _pair(store, tmp_path)
    opt = offload.AdamW(_adam_groups(params), lr=1e-2, **_store_kwargs(store, tmp_path))
    host = offload.AdamW(_adam_groups(host_params), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for t in range(3):
        _step([(opt, params), (host, host_params)], gen)
    sd = opt.state_dict()["state"]
    assert ["max_exp_avg_sq" in sd[i] for i in range(4)] == [True, True, False, False]  # as torch
    assert "max_exp_avg_sq" not in opt.state[params[2]] and opt.state[params[0]]["max_exp_avg_sq"] is not None
    _same_states(opt, host, params)
    opt.param_groups[1]["amsgrad"] = host.param_groups[1]["amsgrad"] = True
    for t in range(3):
        _step([(opt, params), (host, host_params)], gen)
    assert all("max_exp_avg_sq" in e for e in opt.state_dict()["state"].values())
    _same_states(opt, host, params)
    opt.close()


def test_nvme_adam_groups_that_differ_in_amsgrad_train_as_torch(tmp_path):
    """fp32 CPU params on NVMe against torch.optim.AdamW; torch's KeyError when a group turns
    amsgrad on mid-run is stood in for by its lazy zeros (what the host store does)."""
    params, ref_params = _params(), _params()
    opt = offload.AdamW(_adam_groups(params), lr=1e-2, **_store_kwargs("nvme", tmp_path))
    ref = torch.optim.AdamW(_adam_groups(ref_params), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for t in range(6):
        if t == 3:
            opt.param_groups[1]["amsgrad"] = ref.param_groups[1]["amsgrad"] = True
            for r in ref_params[2:]:
                ref.state[r]["max_exp_avg_sq"] = torch.zeros_like(r)
        _step([(opt, params), (ref, ref_params)], gen)
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    for i, (p, r) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(p, r, **TOL)
        assert set(got[i]) == set(want[i])
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            torch.testing.assert_close(got[i][k], want[i][k], **TOL)
    opt.close()


@pytest.mark.parametrize("store", STORES)
def test_sgd_groups_with_and_without_momentum_step_as_the_host_store(store, tmp_path):
    """Group 1 without momentum, then with momentum 0.9 from step 3 (its buffer starts as the
    grad, undamped, as torch's)."""
    params, host_params = _pair(store, tmp_path)
    opt = offload.SGD(_sgd_groups(params), lr=1e-2, **_store_kwargs(store, tmp_path))
    host = offload.SGD(_sgd_groups(host_params), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for t in range(6):
        if t == 3:
            opt.param_groups[1]["momentum"] = host.param_groups[1]["momentum"] = 0.9
            opt.param_groups[1]["dampening"] = host.param_groups[1]["dampening"] = 0.5
        _step([(opt, params), (host, host_params)], gen)
        if t == 2:
            sd = opt.state_dict()["state"]  # no buffer without momentum, as torch (a bf16 param's master stays)
            assert ["momentum_buffer" in sd.get(i, {}) for i in range(4)] == [True, True, False, False]
    _same_states(opt, host, params)
    opt.close()


def test_nvme_sgd_groups_with_and_without_momentum_train_as_torch(tmp_path):
    params, ref_params = _params(), _params()
    opt = offload.SGD(_sgd_groups(params), lr=1e-2, **_store_kwargs("nvme", tmp_path))
    ref = torch.optim.SGD(_sgd_groups(ref_params), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for t in range(6):
        if t == 3:
            opt.param_groups[1]["momentum"] = ref.param_groups[1]["momentum"] = 0.9
        _step([(opt, params), (ref, ref_params)], gen)
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    assert sorted(got) == sorted(want)
    for i, (p, r) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(p, r, **TOL)
        torch.testing.assert_close(got[i]["momentum_buffer"], want[i]["momentum_buffer"], **TOL)
    opt.close()


def test_nvme_resume_of_groups_that_differ_in_amsgrad_continues_the_run(tmp_path):
    """A run stopped after step 3 (``close(keep_swap=True)``, as a kill -9 leaves it) and
    resumed takes steps 4-5 exactly as the run that went on."""
    params, host_params = _params(), _params()
    opt = offload.AdamW(_adam_groups(params), lr=1e-2, **_store_kwargs("nvme", tmp_path))
    host = offload.AdamW(_adam_groups(host_params), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for t in range(3):
        _step([(opt, params), (host, host_params)], gen)
    opt.close(keep_swap=True)
    opt = offload.AdamW(_adam_groups(params), lr=1e-2, resume=True, **_store_kwargs("nvme", tmp_path))
    for t in range(2):
        _step([(opt, params), (host, host_params)], gen)
    _same_states(opt, host, params)
    opt.close()


@pytest.mark.parametrize("dst", ["nvme", "host"])
def test_nvme_checkpoint_of_groups_that_differ_in_amsgrad_loads(dst, tmp_path):
    params, host_params = _params(), _params()
    opt = offload.AdamW(_adam_groups(params), lr=1e-2, **_store_kwargs("nvme", tmp_path))
    host = offload.AdamW(_adam_groups(host_params), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for t in range(3):
        _step([(opt, params), (host, host_params)], gen)
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    back_params = [p.detach().clone().requires_grad_() for p in params]
    # a checkpoint holds every state of the store's rule (as the host store's checkpoints of
    # such groups do): it loads into an optimizer of the same groups, either store
    extra = _store_kwargs("nvme", tmp_path, "back") if dst == "nvme" else {}
    back = offload.AdamW(_adam_groups(back_params), lr=0.5, **extra)
    back.load_checkpoint(str(tmp_path / "ckpt"))  # the groups' hyperparameters come with it
    assert [g["lr"] for g in back.param_groups] == [1e-2, 3e-3]
    for t in range(2):
        _step([(back, back_params), (host, host_params)], gen)
    _same_states(back, host, back_params)
    back.close()
    opt.close()


@pytest.mark.parametrize("store", ["nvme", "flat"])
def test_state_dict_round_trips_with_torch_adam_for_groups_that_differ_in_amsgrad(store, tmp_path):
    """Our dict into torch.optim.Adam and torch's into ours, mid-run: both go on as one run
    (torch's keys: no max_exp_avg_sq in a plain Adam group's entries)."""
    params, ref_params = _pair(store, tmp_path)
    opt = offload.Adam(_adam_groups(params), lr=1e-2, **_store_kwargs(store, tmp_path))
    ref = torch.optim.Adam(_adam_groups(ref_params), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    _step([(opt, params), (ref, ref_params)], gen)
    mine = opt.state_dict()
    torch_copy = torch.optim.Adam(_adam_groups([p.detach().float().clone().requires_grad_() for p in params]),
                                  lr=0.5, foreach=False)
    torch_copy.load_state_dict(copy.deepcopy(mine))
    want = ref.state_dict()["state"]
    assert {i: sorted(set(e) - {"master"}) for i, e in torch_copy.state_dict()["state"].items()} == \
        {i: sorted(e) for i, e in want.items()}  # (a bf16 param's fp32 master is ours: torch carries it)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # a plain group's max_exp_avg_sq: zeros again
    for p, r in zip(params, ref_params):
        p.data.copy_(r)  # (a bf16 param's master is its rounded value now: the same for ref)
        r.data.copy_(p.float())
    for t in range(2):
        _step([(opt, params), (ref, ref_params)], gen)
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    for i, (m, r) in enumerate(zip(_masters(opt, params), ref_params)):
        torch.testing.assert_close(m, r.detach(), **TOL)
        assert set(got[i]) - {"master"} == set(want[i])
        for k in want[i]:
            torch.testing.assert_close(got[i][k], want[i][k], **TOL)
    opt.close()


def test_memory_report_counts_the_union_fields_for_every_param(tmp_path):
    mixed = offload.Adam(_adam_groups(_params()), lr=1e-2, **_store_kwargs("nvme", tmp_path, "a"))
    ams = offload.Adam(_adam_groups(_params(), (True, True)), lr=1e-2, **_store_kwargs("nvme", tmp_path, "b"))
    plain = offload.Adam(_adam_groups(_params(), (False, False)), lr=1e-2, **_store_kwargs("nvme", tmp_path, "c"))
    nvme = [o.memory_report()["tiers"]["nvme"] for o in (mixed, ams, plain)]
    assert nvme[0] == nvme[1] > nvme[2]
    for o in (mixed, ams, plain):
        o.close()


def test_union_rule_takes_a_chain_of_fields_only():
    assert union_rule([ADAM, ADAM_AMSGRAD]) is ADAM_AMSGRAD and union_rule([SGD_PLAIN, SGD]) is SGD
    assert union_rule([ADAM]) is ADAM and union_rule([LION, ADAGRAD]) is None
    i8 = ADAM_AMSGRAD.with_state_dtype("int8")
    assert union_rule([ADAM.with_state_dtype("int8"), i8]) == i8
    assert i8.narrowed(ADAM) == ADAM.with_state_dtype("int8") and ADAM_AMSGRAD.narrowed(ADAM) is ADAM
    with pytest.raises(ValueError, match="does not hold rule 'adam_amsgrad'"):
        ADAM.narrowed(ADAM_AMSGRAD)


@pytest.mark.parametrize("how", ["flag", "add_param_group"])
def test_a_group_that_needs_a_field_the_store_lacks_is_refused(how, tmp_path):
    """Built without amsgrad in any group, the swap files hold no max_exp_avg_sq: refused
    before anything changes, and the optimizer steps on."""
    params = _params()
    opt = offload.Adam(params[:2], lr=1e-2, **_store_kwargs("nvme", tmp_path))
    gen = torch.Generator().manual_seed(1)
    for p in params[:2]:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    msg = r"needs rule 'adam_amsgrad'.*keeps the states of rule 'adam'.*amsgrad, or SGD momentum"
    if how == "flag":
        opt.param_groups[0]["amsgrad"] = True
        with pytest.raises(ValueError, match="a group now " + msg):
            opt.step()
        opt.param_groups[0]["amsgrad"] = False
    else:
        with pytest.raises(ValueError, match="the new group " + msg):
            opt.add_param_group({"params": params[2:], "amsgrad": True})
        assert len(opt.param_groups) == 1
    opt.step()
    opt.close()
