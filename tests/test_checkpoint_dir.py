"""save_checkpoint / load_checkpoint and the directory they write: only the checkpoint's own
files are touched, a save or load holds the directory's lock, param_groups travel with the
checkpoint, and checkpoints written by the previous release still load."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import offload

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 5, generator=g)).square().mean().backward()
        opt.step()


def _opt(model, kind, tmp_path, **kw):
    if kind == "nvme":
        swap = tmp_path / f"swap{len(os.listdir(tmp_path))}"
        swap.mkdir()
        kw.update(offload="nvme", swap_dir=str(swap), max_host_bytes="8MiB", sub_group_size=16)
    elif kind == "cpu":
        kw.update(offload="cpu")
    elif kind == "flat":
        kw.update(stage=2)
    elif kind == "flat-nvme":
        swap = tmp_path / f"swap{len(os.listdir(tmp_path))}"
        swap.mkdir()
        kw.update(stage=2, offload="nvme", swap_dir=str(swap), max_host_bytes="8MiB")
    return offload.AdamW(model.parameters(), lr=kw.pop("lr", 1e-2), **kw)


# ------------------------------------------------------------------ the previous release's format
@pytest.mark.parametrize("fixture,kind", [("ckpt_v1_single", "cpu"), ("ckpt_v1_single", "nvme"),
                                          ("ckpt_v1_shards", "flat"), ("ckpt_v1_shards", "flat-nvme")])
def test_checkpoints_of_the_previous_release_still_load(tmp_path, fixture, kind):
    # Written by tests/fixtures/make_ckpt_v1.py before the format changed; copied, as a load
    # takes the directory's lock (a file in it).
    src = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURES, fixture), src)
    want = torch.load(src / "expected.pt")
    model = _model()
    opt = _opt(model, kind, tmp_path)
    opt.load_checkpoint(str(src))
    sd = opt.state_dict()["state"]
    assert sorted(sd) == sorted(want["state"])
    for i, st in want["state"].items():
        assert float(sd[i]["step"]) == float(st["step"]) == 3.0
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[i][k], st[k])
    if kind.startswith("flat"):  # the masters travel in the shards: the params follow them
        for p, w in zip(model.parameters(), want["params"]):
            assert torch.equal(p.detach(), w)
    opt.close()
