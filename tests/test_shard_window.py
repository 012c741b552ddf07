"""offload.shard's live-window budget (max_live_params / max_live_bytes; schedule.py [Note:
live window budget]): prefetch stops where the root and the units gathered ahead would pass
the budget, the unit in use is gathered anyway (one warning), the peak stays within
max(budget, root + largest unit) on 1, 2 and 3 gloo ranks, and training is the same as
without a budget, bit for bit (the budget only delays gathers)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import offload
from offload.shard import gathered_params, runtime_of
from offload.shard.schedule import horizons
from test_shard_train import HP, _assert_params, _loss, _model, _reference, pools  # noqa: F401  (pools: the fixture)


def _world():
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _sizes(group, in_bytes):
    """(root, block) gathered sizes at this world size, from a model sharded to look."""
    rt = runtime_of(offload.shard(_model(), process_group=group))
    size = [sum(f.nbytes if in_bytes else f.padded for f in u.flats) for u in rt.units]
    assert len(set(size[1:])) == 1  # TinyGPT's blocks are alike
    return size[0], size[1]


def job_window(group, steps, prefetch, budget, in_bytes=True, plan=None):
    """``budget``: (root count, blocks count, extra) -> root + blocks * block + extra, or None."""
    world, rank = _world()
    root, block = _sizes(group, in_bytes)
    cap = None if budget is None else int(budget[0] * root + budget[1] * block + budget[2])
    key = "max_live_bytes" if in_bytes else "max_live_params"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = offload.shard(_model(), process_group=group, prefetch=prefetch, **{key: cap})
        rt = runtime_of(model)
        opt = offload.AdamW(model.parameters(), **HP)
        for step in range(steps):
            _loss(model, step, 0, world, rank, plan or {}).backward()
            opt.step()
            opt.zero_grad()
    ours = [str(w.message) for w in caught if "offload.shard: unit" in str(w.message)]
    s = rt.schedule
    return {"params": gathered_params(model), "peak": s.peak_live if in_bytes else s.peak_live_params,
            "root": root, "block": block, "cap": cap, "warnings": ours, "rounds": s.rounds}


def _run(pools, world, **kw):  # noqa: F811
    if world == 1:
        return [job_window(None, **kw)]
    return pools(world).run("test_shard_window:job_window", **kw)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_budget_caps_the_peak_and_training_is_unchanged(pools, world):  # noqa: F811
    steps = 4
    free = _run(pools, world, steps=steps, prefetch=2, budget=None)
    ref = _reference(steps, world)
    for out in free:
        _assert_params(out["params"], ref)
        # no budget: the root, the unit in use and two prefetched (one rank never prefetches)
        assert out["peak"] == out["root"] + (3 if world > 1 else 1) * out["block"]
    cases = [
        (dict(prefetch=2, budget=(1, 2, 0)), 2, []),              # prefetch cut from 2 to 1
        (dict(prefetch=2, budget=(1, 2, 0), in_bytes=False), 2, []),
        (dict(prefetch=1, budget=(1, 1.5, 0)), 1, []),            # no room for a prefetch
        (dict(prefetch=1, budget=(1, 1, -1)), 1, ["warn"]),       # the unit in use alone is over
    ]
    for kw, blocks, warns in cases:
        outs = _run(pools, world, steps=steps, **kw)
        for out, base in zip(outs, free):
            if kw.get("in_bytes", True):
                assert out["root"] == base["root"] and out["block"] == base["block"]
            assert out["peak"] <= max(out["cap"], out["root"] + out["block"]), kw
            assert out["peak"] == out["root"] + (blocks if world > 1 else 1) * out["block"], kw
            assert len(out["warnings"]) == len(warns), (kw, out["warnings"])
            for k, v in base["params"].items():
                assert torch.equal(out["params"][k], v), (kw, k)


def test_a_reordered_step_under_a_budget(pools):  # noqa: F811
    plan = {(2, 1): [2, 0, 1], (3, None): [2, 1, 0]}
    outs = _run(pools, 2, steps=5, prefetch=2, budget=(1, 2, 0), plan=plan)
    _assert_params(outs[0]["params"], _reference(5, 2, plan=plan))
    for out in outs:
        assert out["peak"] <= out["cap"]


def test_horizons_count_the_root_once_and_each_unit_once():
    cost = [10, 4, 4, 8, 1]
    assert horizons([0, 1, 2, 3, 4], cost, 0, None, 2) == [2, 3, 4, 4, 4]
    assert horizons([0, 1, 2, 3, 4], cost, 0, 18, 2) == [2, 2, 2, 3, 4]
    assert horizons([1, 2, 3, 4], cost, 0, 18, 3) == [1, 1, 2, 3]
    assert horizons([1, 1, 2, 1, 3], cost, 0, 18, 4) == [3, 3, 3, 3, 4]  # a unit twice costs once
    assert horizons([3, 1], cost, 0, 5, 1) == [0, 1]  # over alone: no prefetch, still itself


def test_shard_refuses_bad_budgets():
    with pytest.raises(ValueError, match="not both"):
        offload.shard(nn.Linear(2, 2), max_live_params=10, max_live_bytes=10)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_live_params must be an int >= 1"):
            offload.shard(nn.Linear(2, 2), max_live_params=bad)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="max_live_bytes must be a byte count"):
            offload.shard(nn.Linear(2, 2), max_live_bytes=bad)
    with pytest.raises(ValueError, match="invalid byte size"):
        offload.shard(nn.Linear(2, 2), max_live_bytes="lots")
    m = offload.shard(nn.Linear(2, 2), max_live_bytes="512MiB")
    assert runtime_of(m).schedule.budget == 512 << 20 and runtime_of(m).schedule.in_bytes
