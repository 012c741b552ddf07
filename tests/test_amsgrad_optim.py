"""offload.Adam/AdamW(amsgrad=True) where groups or files differ in amsgrad (the stores,
state_dict and checkpoints of one amsgrad setting are in test_rules_optim.py's "amsgrad" case
and test_torch_optim_db.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import offload

TOL = dict(rtol=1e-5, atol=1e-6)


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).requires_grad_() for n in (4097, 17, 7)]


def _groups(params, flags):
    return [{"params": params[:1], "amsgrad": flags[0]}, {"params": params[1:], "amsgrad": flags[1], "lr": 3e-3}]


def _train(opt, params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 3).to(p.dtype)
        opt.step()


def test_groups_that_differ_in_amsgrad_train_as_torch_in_the_host_store():
    params, ref_params = _params(), _params()
    opt = offload.AdamW(_groups(params, (True, False)), lr=1e-2)
    ref = torch.optim.AdamW(_groups(ref_params, (True, False)), lr=1e-2, foreach=False)
    _train(opt, params, 5)
    _train(ref, ref_params, 5)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, **TOL)
        assert set(opt.state[p]) == set(ref.state[r])  # max_exp_avg_sq for the amsgrad group only
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


@pytest.mark.parametrize("store", ["cpu-bf16", "nvme"])
def test_groups_that_differ_in_amsgrad_train_as_torch_where_one_rule_serves_all(store, tmp_path):
    """The flat and swapped stores keep the union of the fields (tests/test_mixed_rule_stores.py)."""
    dtype = torch.bfloat16 if store == "cpu-bf16" else torch.float32
    params = [p.detach().to(dtype).requires_grad_() for p in _params()]
    ref_params = [p.detach().float().clone().requires_grad_() for p in params]
    extra = {"offload": "nvme", "swap_dir": str(tmp_path)} if store == "nvme" else {"offload": "cpu"}
    opt = offload.AdamW(_groups(params, (True, False)), lr=1e-2, **extra)
    ref = torch.optim.AdamW(_groups(ref_params, (True, False)), lr=1e-2, foreach=False)
    for p, r in zip(params, ref_params):  # the same grads (bf16 values) for both
        p.grad = (torch.randn(p.shape) * 3).to(dtype)
        r.grad = p.grad.float()
    opt.step()
    ref.step()
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    assert {i: sorted(set(e) - {"master"}) for i, e in got.items()} == {i: sorted(e) for i, e in want.items()}
    for i in want:
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k in want[i]:
                torch.testing.assert_close(got[i][k], want[i][k], **TOL)
    opt.close()


@pytest.mark.parametrize("src_ams, store", [(True, "nvme"), (False, "nvme"), (False, "cpu")],
                         ids=["amsgrad_to_adam-nvme", "adam_to_amsgrad-nvme", "adam_to_amsgrad-cpu"])
def test_a_checkpoint_of_the_other_setting_is_refused_naming_its_states(src_ams, store, tmp_path):
    def make(ams, name):
        extra = {"offload": store}
        if store == "nvme":
            (tmp_path / name).mkdir()
            extra["swap_dir"] = str(tmp_path / name)
        params = _params()
        return offload.AdamW(params, lr=1e-2, amsgrad=ams, **extra), params

    src, src_params = make(src_ams, "a")
    _train(src, src_params, 2)
    src.save_checkpoint(str(tmp_path / "ckpt"))
    dst, dst_params = make(not src_ams, "b")
    _train(dst, dst_params, 1)
    before = dst.state_dict()
    held = "exp_avg_sq \\(float32\\), max_exp_avg_sq" if src_ams else "exp_avg_sq \\(float32\\):"
    with pytest.raises(ValueError, match=f"the checkpoint holds exp_avg \\(float32\\), {held}") as refused:
        dst.load_checkpoint(str(tmp_path / "ckpt"))
    # what to do: an optimizer built with amsgrad in a group (its load_state_dict refuses too)
    assert ("amsgrad=True in at least one param group" in str(refused.value)) == src_ams
    after = dst.state_dict()
    for i, entry in before["state"].items():
        assert all(torch.equal(v, after["state"][i][k]) for k, v in entry.items())
    _train(dst, dst_params, 1)  # and it still steps
    src.close()
    dst.close()


def test_the_host_store_built_without_amsgrad_loads_a_checkpoint_of_amsgrad_as_torch_loads_its_dict(tmp_path):
    """As ``load_state_dict`` of torch's (the group comes with amsgrad on, each param with its
    max_exp_avg_sq): the host store keeps per-param dicts, so nothing needs refusing
    ([Note: kept states in checkpoints] in offload/optim/ckpt_holding.py; the swap files of
    offload="nvme" have no room for it and refuse it, above)."""
    src_params, dst_params = _params(), _params()
    src = offload.AdamW(src_params, lr=1e-2, amsgrad=True)
    _train(src, src_params, 2)
    src.save_checkpoint(str(tmp_path / "ckpt"))
    dst = offload.AdamW(dst_params, lr=0.5)
    _train(dst, dst_params, 1)
    dst.load_checkpoint(str(tmp_path / "ckpt"))
    assert dst.param_groups[0]["amsgrad"] and dst.param_groups[0]["lr"] == 1e-2
    want, got = src.state_dict()["state"], dst.state_dict()["state"]
    for i, entry in want.items():
        assert list(got[i]) == list(entry) and all(torch.equal(v, got[i][k]) for k, v in entry.items())
    for p, q in zip(src_params, dst_params):
        q.data.copy_(p)  # (the params are the caller's)
    _train(src, src_params, 2, seed=2)
    _train(dst, dst_params, 2, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(src_params, dst_params))


# ---------------------------------------------------------------- groups that differ, loaded
def test_the_host_store_loads_dicts_whose_groups_differ_in_amsgrad():
    """Its own state_dict (an Adam group's entries hold no max_exp_avg_sq), and a plain Adam
    dict into an amsgrad optimizer (the groups follow the dict, as torch's load does); a dict
    whose amsgrad group lacks max_exp_avg_sq loads (torch's state right after the group
    turned amsgrad on: test_amsgrad_turned_on_dicts.py), one that lacks exp_avg_sq is refused
    with nothing changed."""
    params, ref_params = _params(), _params()
    opt = offload.AdamW(_groups(params, (True, False)), lr=1e-2)
    ref = torch.optim.AdamW(_groups(ref_params, (True, False)), lr=1e-2, foreach=False)
    _train(opt, params, 2)
    _train(ref, ref_params, 2)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    _train(opt, params, 2, seed=2)
    _train(ref, ref_params, 2, seed=2)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, **TOL)
    plain = torch.optim.AdamW(_groups(_params(), (False, False)), lr=1e-2)
    _train(plain, plain.param_groups[0]["params"] + plain.param_groups[1]["params"], 1)
    ams = offload.AdamW(_groups(_params(), (True, True)), lr=1e-2)
    ams.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert [g["amsgrad"] for g in ams.param_groups] == [False, False]
    bad = copy.deepcopy(plain.state_dict())
    bad["param_groups"][0]["amsgrad"] = True
    del bad["state"][0]["exp_avg_sq"]
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"state\[0\] has 'exp_avg' without 'exp_avg_sq'"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert [g["amsgrad"] for g in opt.param_groups] == [True, False]
    assert all(torch.equal(v, after["state"][i][k]) for i, e in before["state"].items() for k, v in e.items()
               if torch.is_tensor(v))


def test_a_host_checkpoint_of_groups_that_differ_in_amsgrad_keeps_torchs_keys(tmp_path):
    params = _params()
    opt = offload.AdamW(_groups(params, (True, False)), lr=1e-2)
    _train(opt, params, 2)
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    back = offload.AdamW(_groups(_params(), (True, False)), lr=1e-2)
    back.load_checkpoint(str(tmp_path / "ckpt"))
    a, b = opt.state_dict()["state"], back.state_dict()["state"]
    assert {i: sorted(e) for i, e in a.items()} == {i: sorted(e) for i, e in b.items()}
    assert "max_exp_avg_sq" in b[0] and "max_exp_avg_sq" not in b[1]
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def test_stage3_checkpoint_of_groups_that_differ_in_amsgrad_loads(tmp_path):
    """offload.shard (one process, fp32 CPU shards: the host store takes groups that differ)."""

    class Net(torch.nn.Module):  # a root unit and two child units
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 24)
            self.b = torch.nn.ModuleList([torch.nn.Linear(24, 24), torch.nn.Linear(24, 4)])

        def forward(self, x):
            return self.b[1](torch.relu(self.b[0](self.a(x))))

    def build():
        torch.manual_seed(0)
        model = Net()
        offload.shard(model)
        ps = list(model.parameters())
        opt = offload.AdamW([{"params": ps[:1], "amsgrad": True}, {"params": ps[1:], "amsgrad": False}],
                            lr=1e-2, stage=3, offload="cpu")
        return model, opt

    model, opt = build()
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    offload.shard.save_checkpoint(model, opt, str(tmp_path / "ckpt"))
    model2, opt2 = build()
    offload.shard.load_checkpoint(model2, opt2, str(tmp_path / "ckpt"))
    x = torch.randn(4, 16)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_add_param_group_of_the_other_setting_is_refused_by_a_flat_store():
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in _params()]
    opt = offload.AdamW(params[:1], lr=1e-2, offload="cpu")
    _train(opt, params[:1], 1)
    with pytest.raises(ValueError, match=r"the new group needs rule 'adam_amsgrad'.*"
                                         r"keeps the states of rule 'adam'.*amsgrad, or SGD momentum"):
        opt.add_param_group({"params": params[1:], "amsgrad": True})
    assert len(opt.param_groups) == 1
    _train(opt, params[:1], 1)  # still steps
    opt.add_param_group({"params": params[1:], "amsgrad": False})
    _train(opt, params, 1)
    opt.close()
