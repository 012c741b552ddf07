"""[Note: the optimizer's own checkpoint at stage 3] (offload/optim/shard_store.py): on two
ranks ``opt.save_checkpoint(DIR)`` over ``offload.shard`` params wrote every rank's shards into
the one ``DIR/rank0`` (a CheckpointBusy when the saves met, else one rank's shards kept for
both) and ``opt.load_checkpoint`` gave every rank rank 0's shard states, silently. Both are
refused now on every rank, before a file is written, pointing at offload.shard's checkpoint."""
from __future__ import annotations

import os

import torch

import offload
from _ranks import group


def _job(rank, world, directory):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(2)])
    offload.shard(model, unit={torch.nn.Linear})
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    opt.step()
    got = []
    for what in ("save_checkpoint", "load_checkpoint"):
        try:
            getattr(opt, what)(directory)
            got.append("done")
        except ValueError as exc:
            got.append(str(exc))
    written = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    offload.shard.save_checkpoint(model, opt, directory)  # the way that works
    opt2 = offload.AdamW(model.parameters(), lr=1e-2)
    offload.shard.load_checkpoint(model, opt2, directory)
    same = all(torch.equal(a, b) for a, b in zip(_states(opt), _states(opt2)))
    opt.close()
    opt2.close()
    return dict(got=got, written=written, same=same)


def _states(opt):
    return [opt.state[p][k] for p in opt.param_groups[0]["params"] for k in ("exp_avg", "exp_avg_sq")]


def test_the_optimizers_own_checkpoint_at_stage3_on_two_ranks_is_refused(tmp_path):
    directory = str(tmp_path / "ck")
    got = group(2).run(_job, directory)
    for rank in (0, 1):
        save, load = got[rank]["got"]
        assert save.startswith("opt.save_checkpoint() at stage 3 on 2 ranks") and "offload.shard.save_checkpoint(" in save
        assert load.startswith("opt.load_checkpoint() at stage 3 on 2 ranks") and "offload.shard.load_checkpoint(" in load
        assert got[rank]["written"] == []  # refused before anything was written
        assert got[rank]["same"]


def _sgd_job(rank, world, swap_dir):
    """SGD without momentum, offload="nvme", at stage 3: nothing to swap, so the host store steps
    the shards in place with p.grad; the grad shards were placed in a swap file anyway (p.grad
    the zero stand-in) and no param moved, silently (forty-eighth session's history fuzz)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2)])
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    offload.shard(model, unit={torch.nn.Linear})
    opt = offload.SGD(model.parameters(), lr=1.0, offload="nvme", swap_dir=swap_dir)
    model(torch.zeros(1, 4)).sum().backward()  # the last bias's grad: ones on every rank
    opt.step()
    got = {k: v.tolist() for k, v in offload.shard.gathered_params(model).items()}
    opt.close()
    return got


def test_stage3_sgd_without_momentum_on_nvme_steps_on_two_ranks(tmp_path):
    got = group(2).run(_sgd_job, str(tmp_path))
    assert got[0] == got[1]
    assert got[0]["1.bias"] == [-1.0] * 4, got[0]  # torch: the averaged grad of ones, lr 1
