"""offload.AdamW(offload="nvme") through the optimizer class: equal to offload="cpu" bit for
bit, state_dict both ways, checkpoints and resume restore torch's "step"."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import offload
import _internals as internals


def _model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(40, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))
    m[0].bias.requires_grad_(False)  # frozen: never gets a grad
    return m


def _groups(m):
    return [{"params": [m[0].weight, m[0].bias]}, {"params": list(m[2].parameters()), "lr": 3e-3, "weight_decay": 0.0}]


def _train(m, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 40, generator=g)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


def _nvme(m, swap, **kw):
    kw.setdefault("max_host_bytes", 1 << 20)
    kw.setdefault("sub_group_size", 1000)
    return offload.AdamW(_groups(m), lr=1e-2, offload="nvme", swap_dir=str(swap), **kw)


def _equal_sd(a, b):
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for n in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][k][n], b["state"][k][n]), (k, n)


def test_nvme_equals_cpu_and_state_dict_both_ways(tmp_path):
    m1 = _model()
    m2 = copy.deepcopy(m1)
    o1 = offload.AdamW(_groups(m1), lr=1e-2, offload="cpu")
    o2 = _nvme(m2, tmp_path, verify=True)
    _train(m1, o1, 4)
    _train(m2, o2, 4)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    sd1, sd2 = o1.state_dict(), o2.state_dict()
    _equal_sd(sd1, sd2)
    assert o2.memory_report()["tiers"]["nvme"] > 0 and o2.step_stats()["last"]["swap_write"] >= 0
    # cpu -> nvme and nvme -> cpu
    m3, m4 = copy.deepcopy(m1), copy.deepcopy(m1)
    (tmp_path / "b").mkdir()
    o3 = _nvme(m3, tmp_path / "b", sub_group_size=2048)
    o3.load_state_dict(copy.deepcopy(sd1))  # torch shares the "step" tensors otherwise
    o4 = offload.AdamW(_groups(m4), lr=1e-2, offload="cpu")
    o4.load_state_dict(copy.deepcopy(sd2))
    for m, o in ((m1, o1), (m3, o3), (m4, o4)):
        _train(m, o, 2, seed=2)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(m1.parameters(), m3.parameters(),
                                                                           m4.parameters()))
    _equal_sd(o1.state_dict(), o3.state_dict())
    o2.close()
    o3.close()
    assert os.listdir(tmp_path) == ["b"] and os.listdir(tmp_path / "b") == []


def test_checkpoint_and_resume_through_the_optimizer(tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    m1 = _model()
    ref_m = copy.deepcopy(m1)
    ref = offload.AdamW(_groups(ref_m), lr=1e-2, offload="cpu")
    o1 = _nvme(m1, swap)
    _train(m1, o1, 3)
    _train(ref_m, ref, 3)
    o1.save_checkpoint(str(ckpt))
    params_at_3 = copy.deepcopy(m1.state_dict())
    # as if killed: leave the swap directory behind
    internals.leave_swap_as_killed(o1)
    m2 = _model(seed=5)
    m2.load_state_dict(params_at_3)
    o2 = _nvme(m2, swap, resume=True)
    _equal_sd(o2.state_dict(), ref.state_dict())  # steps came back into opt.state too
    _train(m2, o2, 2, seed=2)
    _train(ref_m, ref, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), ref_m.parameters()))
    # load the step-3 checkpoint into a fresh optimizer with other sub-groups
    m3 = _model(seed=6)
    m3.load_state_dict(params_at_3)
    (tmp_path / "s3").mkdir()
    o3 = _nvme(m3, tmp_path / "s3", sub_group_size=4096)
    o3.load_checkpoint(str(ckpt))
    assert o3.state_dict()["state"][0]["step"].item() == 3
    _train(m3, o3, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(m3.parameters(), ref_m.parameters()))
    o2.close()
    o3.close()


def test_resume_with_params_of_another_step_is_refused(tmp_path):
    m1 = _model()
    o1 = _nvme(m1, tmp_path)
    _train(m1, o1, 2)
    before = copy.deepcopy(m1.state_dict())
    _train(m1, o1, 1)
    internals.leave_swap_as_killed(o1)
    m2 = _model()
    m2.load_state_dict(before)  # params of step 2, swap files of step 3
    with pytest.raises(ValueError, match="not those of step 3"):
        _nvme(m2, tmp_path, resume=True)
