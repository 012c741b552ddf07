"""offload.shard() makes a gloo group of its own for the reduce-scatters when world > 1;
it goes with the model (hooks.py [Note: the reduce group's end]): a program that shards
many models (tests, sweeps) keeps no group, socket or thread per model."""
import gc
import os

import pytest
import torch

import _ranks


def _one(step_it=True):
    """A small sharded model, trained one step (so its reduce group carried traffic)."""
    import offload

    torch.manual_seed(0)
    model = offload.shard(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = offload.SGD(model.parameters(), lr=0.1)
    if step_it:
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
    return model, opt


def _counts():
    import torch.distributed.distributed_c10d as c10d

    gc.collect()  # the runtime sits in a cycle (module -> hooks -> runtime -> units -> module)
    return {"groups": len(c10d._world.pg_map), "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task"))}


def job_many(rank, world, n):
    import torch.distributed as dist

    model, opt = _one()
    del model, opt
    base = _counts()  # after one: the lazily made pools and imports are there
    for _ in range(n):
        model, opt = _one()
        del model, opt
    after = _counts()
    dist.barrier()  # both ranks done before the next job's groups
    return base, after


def job_remove(rank, world):
    import torch.distributed as dist

    from offload.shard import runtime_of

    base = _counts()["groups"]
    model, opt = _one()
    held = _counts()["groups"]  # model and optimizer alive: the group stays
    runtime_of(model).remove()  # the explicit path: every rank calls it
    gone = _counts()["groups"]
    runtime_of(model).remove()  # twice: nothing more
    del model, opt
    end = _counts()["groups"]
    dist.barrier()
    return base, held, gone, end


def job_alive(rank, world):
    """A model whose optimizer lives on keeps its group: training goes on after a GC."""
    import torch.distributed as dist

    model, opt = _one()
    ref = model
    del model
    gc.collect()
    ref(torch.randn(3, 8)).sum().backward()  # reduces on its group
    opt.step()
    n = _counts()["groups"]
    del ref, opt
    dist.barrier()
    return n


def test_sharding_many_models_keeps_no_group_per_model():
    got = _ranks.group(2).run(job_many, 6, timeout=240)  # each new_group costs ~1-3 s of rendezvous here
    for rank, (base, after) in got.items():
        assert after["groups"] == base["groups"], (rank, base, after)
        assert after["fds"] <= base["fds"] + 2, (rank, base, after)  # 6 groups leaked would be 6+ sockets
        assert after["threads"] <= base["threads"] + 2, (rank, base, after)


def test_remove_destroys_the_group_at_once():
    got = _ranks.group(2).run(job_remove, timeout=120)
    for rank, (base, held, gone, end) in got.items():
        assert (held, gone, end) == (base + 1, base, base), (rank, base, held, gone, end)


def test_a_live_model_keeps_its_group():
    got = _ranks.group(2).run(job_alive, timeout=120)
    assert got[0] == got[1]


def test_one_rank_makes_no_group(tmp_path):
    # world 1 (no torch.distributed): no group to make nor destroy
    from offload.shard import runtime_of

    model, _ = _one()
    assert runtime_of(model)._group_end is None
    runtime_of(model).remove()
