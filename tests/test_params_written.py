"""[Note: params written by others] (offload/optim/flat/param_sync.py): weights written into
the params after the optimizer was built (``model.load_state_dict``, ``offload.shard``'s
checkpoint and weight loads) are what the next step starts from, as with torch's optimizers.
The flat store's master kept the construction-time weights and the first step undid the load."""
from __future__ import annotations

import pytest
import torch

import offload
from offload.optim.flat import param_sync


def _net(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(dtype)


def _step(m, opt, s):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s)).to(next(m.parameters()).dtype)
    m(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


CASES = [("bfloat16", "cpu", None), ("bfloat16", "nvme", None), ("float32", "cpu", 2), ("float32", "nvme", 1)]


@pytest.mark.parametrize("dtype,where,stage", CASES, ids=[f"{d}-{w}-stage{s}" for d, w, s in CASES])
def test_weights_loaded_after_construction_are_stepped_from(dtype, where, stage, tmp_path):
    dtype = getattr(torch, dtype)

    def make(m, name):
        kw = {"stage": stage} if stage is not None else {}
        if where == "nvme":
            (tmp_path / name).mkdir()
            kw["swap_dir"] = str(tmp_path / name)
        return offload.AdamW(m.parameters(), lr=1e-2, offload=where, **kw)

    m = _net(0, dtype)
    opt = make(m, "a")
    assert opt._store.kind == "flat" or stage is not None
    _step(m, opt, 0)
    m.load_state_dict(_net(1, dtype).state_dict())  # new weights, after a step even
    ref = _net(1, dtype)
    ref_opt = make(ref, "b")  # the same optimizer, built on the new weights
    ref_opt.load_state_dict(opt.state_dict())  # the same moments and step; its masters: the dict's
    ref.load_state_dict(_net(1, dtype).state_dict())
    for s in (1, 2):
        _step(m, opt, s)
        _step(ref, ref_opt, s)
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    opt.close()
    ref_opt.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_store_own_writes_are_not_taken_for_a_load(dtype):
    m = _net(0, getattr(torch, dtype))
    opt = offload.AdamW(m.parameters(), lr=1e-2, offload="cpu", stage=2)
    for s in range(3):
        _step(m, opt, s)
        assert param_sync.changed(opt._store) == []  # the fp32 master is never rounded to the param
    with torch.no_grad():
        m[0].weight.add_(1.0)
    assert param_sync.changed(opt._store) == [m[0].weight]
    opt.close()


def test_stage3_checkpoint_with_params_on_disk_steps_from_the_loaded_weights(tmp_path):
    def make(tag):
        m = _net(0)
        (tmp_path / tag).mkdir()
        offload.shard(m, offload_params="nvme", swap_dir=str(tmp_path / tag), unit={torch.nn.Linear})
        return m, offload.AdamW(m.parameters(), lr=1e-2)

    m, opt = make("a")
    for s in range(2):
        _step(m, opt, s)
    offload.shard.save_checkpoint(m, opt, str(tmp_path / "ck"))
    m2, opt2 = make("b")
    offload.shard.load_checkpoint(m2, opt2, str(tmp_path / "ck"))
    for mm, oo in ((m, opt), (m2, opt2)):
        _step(mm, oo, 2)
    a, b = offload.shard.gathered_params(m), offload.shard.gathered_params(m2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt.close()
    opt2.close()
