"""Stage 3 (offload.shard) with Adam groups that differ in amsgrad: a shard whose group turned
amsgrad off keeps its max_exp_avg_sq through offload.shard's checkpoints (torch's layout: the
entry carries it, and load_state_dict keeps it) and through offload="nvme" with resume=True
(the swap commit records it: StepContext.commit_meta). Each is compared element by element
with the same run never interrupted, which turns amsgrad on again from the kept state."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import offload
from offload.shard import load_checkpoint, save_checkpoint


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(17, 17) for _ in range(3))  # one unit each: 306 elements

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _build(dtype, store, tmp_path, name, middle=True):
    """The sharded model and its optimizer: three groups, the middle one switches amsgrad."""
    torch.manual_seed(0)
    model = offload.shard(_Net().to(dtype))
    ps = list(model.parameters())
    kw = {"offload": store}
    if store == "nvme":
        (tmp_path / name).mkdir(exist_ok=True)
        kw["swap_dir"] = str(tmp_path / name)
    groups = [{"params": ps[:1], "amsgrad": True}, {"params": ps[1:2], "amsgrad": middle, "lr": 3e-3},
              {"params": ps[2:], "amsgrad": False}]
    return model, offload.AdamW(groups, lr=1e-2, **kw)


def _train(model, opt, first, end):
    """Large grads first (their max_exp_avg_sq stays above exp_avg_sq); the middle group has
    amsgrad on for steps 0-1, off for 2-3, on again from 4."""
    for t in range(first, end):
        x = torch.randn(4, 17, generator=torch.Generator().manual_seed(t)).to(next(model.parameters()).dtype)
        opt.param_groups[1]["amsgrad"] = t < 2 or t >= 4
        opt.zero_grad()
        (model(x).float().pow(2).sum() * (100.0 if t < 2 else 1.0)).backward()
        opt.step()


def _same(opt, model, ref_opt, ref_model):
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
    for k in want:
        for name, v in want[k].items():
            assert torch.equal(got[k][name], v), (k, name)
    for p, r in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.detach(), r.detach())


def _same_then_and_two_steps_on(opt, model, ref, ref_model):
    """The restored run equals the run never interrupted now and after two more steps (steps
    4 and 5); both optimizers are closed after."""
    _same(opt, model, ref, ref_model)
    _train(model, opt, 4, 6)
    _train(ref_model, ref, 4, 6)
    _same(opt, model, ref, ref_model)
    opt.close()
    ref.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_resumed_stage3_run_keeps_the_max_exp_avg_sq_of_an_amsgrad_off_group(dtype, tmp_path):
    ref_model, ref = _build(dtype, "nvme", tmp_path, "ref")
    _train(ref_model, ref, 0, 4)
    model, opt = _build(dtype, "nvme", tmp_path, "run")
    _train(model, opt, 0, 4)
    opt.close(keep_swap=True)
    opt = offload.AdamW([{**g, "params": list(g["params"])} for g in opt.param_groups], resume=True,
                        offload="nvme", swap_dir=str(tmp_path / "run"))
    assert "max_exp_avg_sq" in opt.state_dict()["state"][1]  # as the run never interrupted
    _same_then_and_two_steps_on(opt, model, ref, ref_model)


@pytest.mark.parametrize("dtype, store", [(torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float32, "nvme")])
def test_a_stage3_checkpoint_keeps_the_max_exp_avg_sq_of_an_amsgrad_off_group(dtype, store, tmp_path):
    ref_model, ref = _build(dtype, store, tmp_path, "ref")
    _train(ref_model, ref, 0, 4)
    save_checkpoint(ref_model, ref, str(tmp_path / "ckpt"))
    model, opt = _build(dtype, store, tmp_path, "run", middle=True)
    load_checkpoint(model, opt, str(tmp_path / "ckpt"))
    assert [g["amsgrad"] for g in opt.param_groups] == [True, False, False]
    _same_then_and_two_steps_on(opt, model, ref, ref_model)
