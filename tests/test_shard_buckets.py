"""offload.shard's bucketed grad reduction (offload/shard/grads.py [Note: reduce buckets]):
with buckets far smaller than a unit (each bucket a slice of every rank's chunk, crossing
the views' boundaries), the shard grads are those of one whole-flat reduce-scatter bit for
bit (sign of zero included) on 1 and 2 gloo ranks, with accumulation, and training meets
the contract against torch.optim.AdamW on 1, 2 and 3; the float32 temporaries stay within
the bucket size and the window of buckets in flight.

[Note: three ranks are not bit for bit] gloo's reduce-scatter adds three ranks' values in an
order that depends on the collective's size and the element's place in it (measured: a
whole-flat reduce-scatter of 3 x 4352 random floats differs from a sequential sum, and from
37-element buckets, in the last bit of 25-50 elements per rank). So over 3 ranks no two
bucket sizes, nor the whole flat, agree bit for bit; what holds is the contract. Two values
add the same either way round, hence bit for bit on 2 ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import offload
from offload.shard import gathered_params, runtime_of
from offload.shard.grads import GradReducer
from test_shard_train import HP, _assert_params, _loss, _model, _reference, pools  # noqa: F401  (pools: the fixture)

WHOLE = 1 << 40  # one bucket per flat: the unbucketed reduction


def _world():
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _train(group, bucket_numel, inflight, steps, accumulate, plan=None):
    world, rank = _world()
    model = offload.shard(_model(tie=True), process_group=group)
    rt = runtime_of(model)
    rt.reducer.bucket_numel, rt.reducer.inflight = bucket_numel, inflight
    issued, biggest = [], [0]
    orig = rt.reducer._issue

    def issue(job):  # count the buckets, measure each float32 input
        before = job.lo
        orig(job)
        issued.append(job.lo - before)
        biggest[0] = max(biggest[0], world * (job.lo - before))

    rt.reducer._issue = issue
    opt = offload.AdamW(model.parameters(), **HP)
    grads = []
    for step in range(steps):
        for micro in range(accumulate):
            _loss(model, step, micro, world, rank, plan or {}).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "params": gathered_params(model), "buckets": len(issued), "biggest": biggest[0],
            "peak_inflight": rt.reducer.peak_inflight, "chunks": [f.chunk for u in rt.units for f in u.flats]}


def job_buckets(group, steps, accumulate, sizes, plan=None):
    return {size: _train(group, *size, steps, accumulate, plan) for size in sizes}


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_buckets_equal_the_whole_flat_reduction_bit_for_bit(pools, world):  # noqa: F811
    # 37 elements of each rank's chunk per bucket: the buckets cross every view's boundary
    sizes = [(WHOLE, 2), (37 * world, 2), (301 * world, 1), (1000 * world, 3)]
    kw = dict(steps=2, accumulate=2, sizes=sizes)
    ref = _reference(2, world, accumulate=2, tie=True)
    outs = [job_buckets(None, **kw)] if world == 1 else pools(world).run("test_shard_buckets:job_buckets", **kw)
    for out in outs:
        whole = out[sizes[0]]
        _assert_params(whole["params"], ref)
        # one rank: the grads go straight into the shard grads, no bucket ([Note: one rank's grads])
        assert whole["buckets"] == (2 * 2 * len(whole["chunks"]) if world > 1 else 0)  # one per flat, per backward
        for size in sizes[1:]:
            got = out[size]
            per_rank = size[0] // world
            if world == 1:
                assert got["buckets"] == 0 and got["peak_inflight"] == 0
            else:
                assert got["buckets"] == 2 * 2 * sum(-(-c // per_rank) for c in got["chunks"])
                assert got["biggest"] <= size[0]
                assert 1 <= got["peak_inflight"] <= size[1]
            _assert_params(got["params"], ref)
            if world == 3:  # see the note
                for k, v in whole["grads"][0].items():
                    torch.testing.assert_close(got["grads"][0][k], v, rtol=1e-5, atol=1e-8)
                continue
            for step, (g, want) in enumerate(zip(got["grads"], whole["grads"])):
                for k, v in want.items():
                    assert torch.equal(_bits(g[k]), _bits(v)), (size, step, k)
            for k, v in whole["params"].items():
                assert torch.equal(got["params"][k], v), (size, k)


def test_the_default_bucket_is_the_stage2_paths():
    from offload.optim.flat.store import FlatState

    assert GradReducer.bucket_numel == FlatState.bucket_numel and GradReducer.inflight == FlatState.inflight


# block 1 out on rank 0 at step 2 (that rank leaves the gather plan for rounds while the
# other reduces on the plan), the order reversed at step 3, block 0 twice on rank 1 at step 4
REORDER = {(2, 0): [0, 2], (3, None): [2, 1, 0], (4, 1): [0, 0, 1, 2]}


@pytest.mark.parametrize("world", [2, 3])
def test_buckets_behind_a_full_window_never_wait_in_backward(pools, world):  # noqa: F811
    # one bucket in flight, 101 elements a rank: nearly every bucket is queued behind another,
    # while a rank that left the plan waits in a round (grads.py [Note: reduce buckets])
    sizes = [(WHOLE, 2), (101 * world, 1)]
    kw = dict(steps=5, accumulate=1, sizes=sizes, plan=REORDER)
    ref = _reference(5, world, plan=REORDER, tie=True)
    for out in pools(world).run("test_shard_buckets:job_buckets", **kw):
        for size in sizes:
            _assert_params(out[size]["params"], ref)
        if world == 2:
            for k, v in out[sizes[0]]["params"].items():
                assert torch.equal(out[sizes[1]]["params"][k], v), k
