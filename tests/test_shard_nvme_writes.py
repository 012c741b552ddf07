"""Writes into params on NVMe that bypass the pager ([Note: writes past the pager] in
offload/shard/tier_writes.py): a torch optimizer over ``model.parameters()``, ``p.data.add_()``
or a fused step used to be lost silently (the update read zeros where the pages were on disk,
and the next read of the swap file overwrote it); each now raises naming the param, the
values on disk stay, and training goes on. A write that read the true values is kept."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import offload
from offload.memory import PAGE, paging
from offload.shard import gathered_params, runtime_of


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _errors(call, limit=10):
    """Call until it does not raise (each param on disk that was written raises once): the
    shard names the errors gave."""
    names = []
    for _ in range(limit):
        try:
            call()
            return names
        except RuntimeError as e:
            assert "written in place outside offload" in str(e), e
            names.append(str(e).split("'")[1])
    raise AssertionError(f"still raising after {limit} calls: {names}")


def _write_torch_sgd(model):
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def _write_torch_sgd_foreach(model):
    torch.optim.SGD(model.parameters(), lr=0.1, foreach=True).step()


def _write_fused_adamw(model):  # a fused step bumps no version counter: seen in the pages
    torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step()


def _write_data_add(model):  # .data has a version counter of its own: seen in the pages
    for p in model.parameters():
        p.data.add_(1.0)


def _write_no_grad_mul(model):  # zeros * 2 is zeros: seen by the version counter
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)


@pytest.mark.parametrize("write", [_write_torch_sgd, _write_torch_sgd_foreach, _write_fused_adamw, _write_data_add,
                                   _write_no_grad_mul], ids=lambda f: f.__name__[7:])
def test_a_write_past_the_pager_raises_naming_the_param_and_the_values_on_disk_stay(tmp_path, write):
    torch.manual_seed(0)
    model = offload.shard(_Net(), offload_params="nvme", swap_dir=str(tmp_path))
    shards = sorted(n for n, _ in model.named_parameters())
    before = gathered_params(model)
    x = torch.randn(4, 64)
    model(x).sum().backward()
    write(model)
    named = _errors(lambda: model(x).sum().backward())
    named += _errors(lambda: gathered_params(model))
    assert sorted(named) == shards  # every written shard, once, by the name model.named_parameters() gives
    after = gathered_params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt = offload.AdamW(model.parameters(), lr=0.1)  # offload's own step writes through the pager
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()
    opt.step()
    stepped = gathered_params(model)
    assert all(not torch.equal(before[k], stepped[k]) for k in before)
    model(x).sum().backward()  # and raises nothing
    opt.close()
    runtime_of(model).tier.close()


def test_module_state_dict_after_a_torch_step_raises_instead_of_saving_stale_values(tmp_path):
    model = offload.shard(_Net(), offload_params="nvme", swap_dir=str(tmp_path))
    model(torch.randn(4, 64)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match=r"the shard param '(blocks\.\d\.)?_shard_float32' .*written in place"):
        model.state_dict()
    runtime_of(model).tier.close()


def _tier_area(tmp_path, n):
    from offload.shard.tier import ParamTier

    tier = ParamTier(str(tmp_path), 0)
    t = tier.area(n, torch.float32)
    paging.will_write([t])
    t.copy_(torch.arange(n, dtype=torch.float32))
    paging.store([t])
    paging.evict([t])
    return tier, t


def test_a_write_that_read_the_true_values_is_kept(tmp_path):
    # every page in RAM (loaded, or held by a live unit) when an in-place op wrote it: stored
    tier, t = _tier_area(tmp_path, 3 * PAGE)
    paging.load([t])
    with torch.no_grad():
        t.mul_(2.0)
    paging.evict([t])
    paging.load([t])
    assert torch.equal(t, 2 * torch.arange(3 * PAGE, dtype=torch.float32))
    paging.evict([t])
    tier.close()


def test_a_write_over_pages_partly_on_disk_raises_and_the_disk_stays(tmp_path):
    tier, t = _tier_area(tmp_path, 3 * PAGE)
    paging.load([t[:PAGE]])  # the first page only: the others read zeros
    with torch.no_grad():
        t.add_(1.0)
    with pytest.raises(RuntimeError, match="a paged tensor of .*offload-params.* was written in place outside offload"):
        paging.evict([t])
    paging.load([t])
    assert torch.equal(t, torch.arange(3 * PAGE, dtype=torch.float32))
    paging.evict([t])
    assert tier.resident_bytes() == 0
    tier.close()


@pytest.mark.parametrize("states", ["none", "nvme"])
def test_offloads_step_after_a_write_past_the_pager_refuses_before_changing_anything(tmp_path, states):
    # the step's checks see it (paging.check): not a failed step half applied, the next step runs
    torch.manual_seed(0)
    model = offload.shard(_Net(), offload_params="nvme", swap_dir=str(tmp_path))
    swap = str(tmp_path) if states == "nvme" else None
    opt = offload.AdamW(model.parameters(), lr=0.1, offload=states, swap_dir=swap)
    x = torch.randn(4, 64)
    model(x).sum().backward()
    before = gathered_params(model)
    name, last = list(model.named_parameters())[-1]  # stepped last: the others would be stepped first
    last.data.add_(1.0)
    with pytest.raises(RuntimeError, match=rf"the shard param '{name}' .*written in place outside offload"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in gathered_params(model).items())
    opt.step()
    after = gathered_params(model)
    assert all(not torch.equal(before[k], after[k]) for k in before)
    opt.close()
    runtime_of(model).tier.close()
