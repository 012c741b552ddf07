"""offload.Adam/AdamW(amsgrad=True) where groups or files differ in amsgrad (the stores,
state_dict and checkpoints of one amsgrad setting are in test_rules_optim.py's "amsgrad" case
and test_torch_optim_db.py)."""
from __future__ import annotations

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
            p.grad = torch.randn(p.shape, generator=gen) * 3
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
def test_groups_that_differ_in_amsgrad_are_refused_where_one_rule_serves_all(store, tmp_path):
    dtype = torch.bfloat16 if store == "cpu-bf16" else torch.float32
    params = [p.detach().to(dtype).requires_grad_() for p in _params()]
    extra = {"offload": "nvme", "swap_dir": str(tmp_path)} if store == "nvme" else {"offload": "cpu"}
    with pytest.raises(ValueError, match=r"param groups of different rules \(\['adam_amsgrad', 'adam'\]\)"):
        offload.AdamW(_groups(params, (True, False)), lr=1e-2, **extra)
    assert not list(tmp_path.iterdir())  # nothing left behind


@pytest.mark.parametrize("src_ams", [True, False], ids=["amsgrad_to_adam", "adam_to_amsgrad"])
@pytest.mark.parametrize("store", ["cpu", "nvme"])
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
    with pytest.raises(ValueError, match=f"the checkpoint holds exp_avg \\(float32\\), {held}"):
        dst.load_checkpoint(str(tmp_path / "ckpt"))
    after = dst.state_dict()
    for i, entry in before["state"].items():
        assert all(torch.equal(v, after["state"][i][k]) for k, v in entry.items())
    _train(dst, dst_params, 1)  # and it still steps
    src.close()
    dst.close()
