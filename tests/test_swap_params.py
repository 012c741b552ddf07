"""offload="nvme" with fp32 CPU params (the in-place store) and the flat store: params of 0
elements as torch takes them, and clear refusals for what the in-place store cannot do."""
from __future__ import annotations

import os

import pytest
import torch

import offload

HP = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_empty_params_step_as_torch(tmp_path, dtype):
    p = torch.zeros(0, 3, dtype=dtype, requires_grad=True)
    q = torch.zeros(0, 3, dtype=dtype, requires_grad=True)
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), **HP)
    ref = torch.optim.AdamW([q], foreach=False, **HP)
    for _ in range(2):
        p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
        opt.step()
        ref.step()
    ours, theirs = opt.state_dict()["state"][0], ref.state_dict()["state"][0]
    assert float(ours["step"]) == float(theirs["step"]) == 2.0
    assert ours["exp_avg"].numel() == ours["exp_avg_sq"].numel() == 0
    opt.close()
    assert os.listdir(tmp_path) == []


def test_a_group_of_empty_params_next_to_others_matches_torch(tmp_path):
    torch.manual_seed(0)
    a, e = torch.randn(3000), torch.zeros(0)
    ours = [a.clone().requires_grad_(True), e.clone().requires_grad_(True)]
    refs = [a.clone().requires_grad_(True), e.clone().requires_grad_(True)]
    opt = offload.AdamW([{"params": [ours[1]]}, {"params": [ours[0]]}], offload="nvme", swap_dir=str(tmp_path), **HP)
    ref = torch.optim.AdamW([{"params": [refs[1]]}, {"params": [refs[0]]}], foreach=False, **HP)
    for k in range(3):
        g = torch.randn(3000, generator=torch.Generator().manual_seed(k))
        ours[0].grad, refs[0].grad = g.clone(), g.clone()
        ours[1].grad, refs[1].grad = torch.zeros(0), torch.zeros(0)
        opt.step()
        ref.step()
    torch.testing.assert_close(ours[0].detach(), refs[0].detach(), rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state_dict()["state"][1][key], ref.state_dict()["state"][1][key],
                                   rtol=1e-5, atol=1e-6)
    opt.close()


@pytest.mark.parametrize("cls,hyper", [(offload.AdamW, {}), (offload.SGD, {"momentum": 0.9}),
                                       (offload.Adagrad, {}), (offload.Lion, {})], ids=lambda c: getattr(c, "__name__", ""))
def test_non_contiguous_params_step_as_torchs(cls, hyper, tmp_path):
    """A transposed weight (torch's test_forloop_goes_right_direction[contiguous=False]) steps
    through a contiguous copy, written back; checkpoints keep working."""
    base = torch.randn(64, 80, generator=torch.Generator().manual_seed(0))
    p = torch.nn.Parameter(base.clone().t())
    q = torch.nn.Parameter(base.clone().t())
    assert not p.is_contiguous()
    opt = cls([p], lr=1e-2, offload="nvme", swap_dir=str(tmp_path), **hyper)
    ref = cls([q], lr=1e-2, **hyper)  # the host store: non-contiguous params were always stepped
    for k in range(3):
        g = torch.randn(80, 64, generator=torch.Generator().manual_seed(k))
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert torch.equal(p, q) and not p.is_contiguous(), k
    for key, v in ref.state_dict()["state"][0].items():
        assert torch.equal(opt.state_dict()["state"][0][key], v), key
    opt.save_checkpoint(str(tmp_path / "ck"))
    opt.load_checkpoint(str(tmp_path / "ck"))
    opt.close()


def test_refusals_are_clear(tmp_path):
    a = torch.randn(10, requires_grad=True)
    with pytest.raises(ValueError, match="param 1 is param 0 again .*remove the duplicate"):
        offload.AdamW([a, a], offload="nvme", swap_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []
    opt = offload.AdamW([a], offload="nvme", swap_dir=str(tmp_path))
    b = torch.randn(5, requires_grad=True)
    with pytest.raises(NotImplementedError, match="pass every param group to the constructor"):
        opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1
    opt.close()
