"""Checkpoints written by ``opt.save_checkpoint`` move between offload="cpu" and "nvme"."""
from __future__ import annotations

import copy

import pytest
import torch

import offload


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.ReLU(), torch.nn.Linear(29, 3))


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 13, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _opt(model, target, swap_dir):
    swap_dir.mkdir(exist_ok=True)
    kw = dict(offload="nvme", swap_dir=str(swap_dir), max_host_bytes="8MiB", sub_group_size=100) if target == "nvme" else dict(offload="cpu")
    return offload.AdamW(model.parameters(), lr=1e-2, **kw)


@pytest.mark.parametrize("src,dst", [("cpu", "nvme"), ("nvme", "cpu"), ("cpu", "cpu")])
def test_checkpoint_moves_between_offload_targets(tmp_path, src, dst):
    model = _model()
    opt = _opt(model, src, tmp_path / "swap_a")
    _train(model, opt, 5, seed=1)
    opt.save_checkpoint(str(tmp_path / "ckpt"))

    resumed_model = copy.deepcopy(model)
    resumed = _opt(resumed_model, dst, tmp_path / "swap_b")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert [float(resumed.state[p]["step"]) for p in resumed_model.parameters()] == [5.0] * 4

    _train(model, opt, 5, seed=2)
    _train(resumed_model, resumed, 5, seed=2)
    # Same kernel on both sides: bit for bit.
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    sd_a, sd_b = opt.state_dict()["state"], resumed.state_dict()["state"]
    for i in sd_a:
        assert torch.equal(sd_a[i]["exp_avg"], sd_b[i]["exp_avg"])
        assert torch.equal(sd_a[i]["exp_avg_sq"], sd_b[i]["exp_avg_sq"])
    opt.close()
    resumed.close()


def test_checkpoint_of_other_shapes_is_refused_and_state_kept(tmp_path):
    model = _model()
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed=1)
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    other = torch.nn.Sequential(torch.nn.Linear(13, 30), torch.nn.ReLU(), torch.nn.Linear(30, 3))
    opt2 = offload.AdamW(other.parameters(), lr=1e-2)
    _train(other, opt2, 1, seed=1)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match="other shapes|elements per state"):
        opt2.load_checkpoint(str(tmp_path / "ckpt"))
    after = opt2.state_dict()
    for i in before["state"]:
        assert torch.equal(before["state"][i]["exp_avg"], after["state"][i]["exp_avg"])


def test_a_checkpoint_of_the_other_kind_is_named_in_the_error(tmp_path):
    # Every store saves the one format (rank<r>/ with typed fields): the flat store (stage=2
    # here) keeps an fp32 master beside the moments, the stage-0 host store updates the
    # params in place; loading one into the other names both sets of fields.
    model = _model()
    flat = offload.AdamW(model.parameters(), lr=1e-2, stage=2)
    _train(model, flat, 1, seed=1)
    flat.save_checkpoint(str(tmp_path / "flat"))
    plain = _opt(model, "cpu", tmp_path / "swap")
    _train(model, plain, 1, seed=1)
    plain.save_checkpoint(str(tmp_path / "plain"))
    for target, source in ((plain, "flat"), (flat, "plain")):
        with pytest.raises(ValueError, match=r"the checkpoint holds (master \(float32\), )?exp_avg \(float32\), "
                           r"exp_avg_sq \(float32\): .*this optimizer keeps"):
            target.load_checkpoint(str(tmp_path / source))
    # the flat store's checkpoint of fp32 CPU params into a stage-0 optimizer: says how to load it
    with pytest.raises(ValueError, match=r"fp32 CPU params: pass stage=1 or 2"):
        plain.load_checkpoint(str(tmp_path / "flat"))
    flat.load_checkpoint(str(tmp_path / "flat"))  # each still loads its own
    plain.load_checkpoint(str(tmp_path / "plain"))
    flat.close()
    plain.close()
