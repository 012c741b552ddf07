"""A unit's params read by its parent, never through the unit's own forward
(offload/shard/units.py [Note: parents that read their children's params], grads.py [Note:
grads of a unit whose forward never ran]), and a shard frozen after ``shard()``."""
from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import offload
from offload.shard.units import choose_units
from test_shard_train import pools  # noqa: F401  (the fixture)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.mha(h, h, h)[0]


class _ReadsChild(nn.Module):
    """Reads ``lin``'s params itself: ``lin``'s forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.first(x)), self.lin.weight, self.lin.bias)


def _train(model: nn.Module, opt, steps: int = 3, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g) if isinstance(model, _ReadsChild) else torch.randn(2, 5, 16, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


# a large eps: the key bias's grad is zero up to rounding (softmax ignores a shift), which Adam
# with a small eps turns into steps of whole lr
HP = dict(lr=1e-2, eps=1e-3)


def _vs_torch(make, steps: int = 3, **shard_kw) -> None:
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = offload.shard(make(), **shard_kw)
    _train(ref, torch.optim.AdamW(ref.parameters(), **HP), steps)
    opt = offload.AdamW(model.parameters(), **HP)
    try:
        _train(model, opt, steps)
    finally:
        opt.close()
    got = offload.shard.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_no_unit_under_multihead_attention():
    model = _Attn()
    for policy in ({nn.Linear}, 200):  # out_proj is a Linear of 272 params
        units = choose_units(model, policy)
        assert model.mha.out_proj not in units, policy
        assert model.inp in units, policy
    assert model.mha in choose_units(model, {nn.MultiheadAttention})


def test_multihead_attention_under_a_linear_policy_trains_as_torch():
    _vs_torch(_Attn, unit={nn.Linear})  # out_proj was never stepped


def job_attn_two_ranks(group=None) -> dict:
    torch.manual_seed(0)
    model = offload.shard(_Attn(), unit={nn.Linear}, process_group=group)
    opt = offload.AdamW(model.parameters(), **HP)
    try:
        _train(model, opt)  # the same batches on both ranks: the average is torch's grad
    finally:
        opt.close()
    out = offload.shard.full_state_dict(model)
    return out if dist.get_rank() == 0 else {}


def test_multihead_attention_on_two_ranks_reads_its_out_proj(pools):  # noqa: F811
    got = pools(2).run("test_shard_parent_reads:job_attn_two_ranks")[0]
    torch.manual_seed(0)
    ref = _Attn()
    _train(ref, torch.optim.AdamW(ref.parameters(), **HP))
    for k, v in ref.state_dict().items():  # the forward read a released out_proj: zeros
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_one_rank_reduces_the_grads_of_a_unit_its_parent_read():
    _vs_torch(_ReadsChild, unit={nn.Linear})  # the views are the shard in RAM: the values read were true


def test_params_on_nvme_refuse_a_unit_its_parent_read():
    swap = tempfile.mkdtemp(prefix="shard-parent-", dir="/var/tmp")
    try:
        model = offload.shard(_ReadsChild(), unit={nn.Linear}, offload_params="nvme", swap_dir=swap)
        with pytest.raises(RuntimeError, match=r"'lin.weight'.*never ran.*reads zeros.*Make the parent the unit"):
            model(torch.randn(4, 8)).square().mean().backward()
        assert model.lin.weight.grad is None  # dropped: the next backward starts clean
        model(torch.randn(4, 8)).sum()  # no backward: the model is still usable
        offload.shard.runtime_of(model).remove()
    finally:
        shutil.rmtree(swap, ignore_errors=True)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def test_a_shard_frozen_after_shard_gets_no_grad_and_does_not_move():
    torch.manual_seed(0)
    model = offload.shard(_Blocks())
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    try:
        _train(model, opt, steps=1)
        model.blocks[0].requires_grad_(False)  # a fine-tuning schedule
        before = {k: v.clone() for k, v in offload.shard.gathered_params(model).items()}
        model(torch.randn(4, 16)).square().mean().backward()
        assert model.blocks[0]._shard_float32.grad is None
        assert model.blocks[1]._shard_float32.grad is not None
        opt.step()
    finally:
        opt.close()
    after = offload.shard.gathered_params(model)
    assert torch.equal(after["blocks.0.weight"], before["blocks.0.weight"])
    assert torch.equal(after["blocks.0.bias"], before["blocks.0.bias"])
    assert not torch.equal(after["blocks.1.weight"], before["blocks.1.weight"])


def test_a_gradient_penalty_is_refused_naming_create_graph():
    model = offload.shard(_Blocks())
    x = torch.randn(4, 16, requires_grad=True)
    y = model(x)
    g, = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"autograd\.grad\(\.\.\., create_graph=True\).*gradient penalty"):
        (y.square().mean() + g.square().sum()).backward()
