"""[Note: a step the ranks agree to begin] (offload/optim/step_agreement.py): at stages 1-2
a rank whose step failed before its first collective (its closure raised, a sparse
grad Adam refuses) left the others waiting in that collective, or, stepping again, paired its
next collective with theirs (gloo aborted the process); ranks whose param_groups or step
counts differ stepped each shard with its owner's values, silently. Now every rank raises
before anything changed (the failing rank its own error), and the next step goes on."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import offload
from _ranks import group


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _backward(m, rank, s):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + s))
    m(x).square().mean().backward()


def _outcome(fn):
    try:
        fn()
    except (Exception, KeyboardInterrupt) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "stepped"


def _one_rank_fails_job(rank, world, stage, how):
    m = _model()
    opt = offload.AdamW(m.parameters(), lr=1e-2, stage=stage)
    got = []
    for s in range(3):
        opt.zero_grad()
        if s == 1 and rank == 1 and how == "closure":
            def closure():
                raise KeyboardInterrupt("closure on rank 1")
            got.append(_outcome(lambda: opt.step(closure)))
            continue
        _backward(m, rank, s)
        if s == 1 and rank == 1 and how == "sparse_grad":
            m[0].bias.grad = m[0].bias.grad.to_sparse()  # Adam refuses it, before anything changes
        got.append(_outcome(opt.step))
    params = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    steps = [int(opt.state[p]["step"]) for p in m.parameters()]
    opt.close()
    return dict(got=got, params=params, steps=steps)


@pytest.mark.parametrize("stage, how", [(2, "closure"), (1, "sparse_grad")])
def test_a_step_that_fails_on_one_rank_before_it_begins_raises_on_every_rank(stage, how):
    got = group(2).run(_one_rank_fails_job, stage, how)
    zero, one = got[0]["got"], got[1]["got"]
    assert zero[0] == one[0] == zero[2] == one[2] == "stepped", (zero, one)
    assert zero[1].startswith(f"RuntimeError: offload.Adam/AdamW step (stage {stage}, 2 ranks): it failed on "
                              "rank(s) 1 before it began"), zero
    want = "KeyboardInterrupt: closure on rank 1" if how == "closure" else "RuntimeError: Adam does not support sparse"
    assert one[1].startswith(want), one
    assert got[0]["steps"] == got[1]["steps"] == [2] * 4  # the failed step stepped no rank
    assert torch.equal(got[0]["params"], got[1]["params"])


def _divergent_job(rank, world, how):
    m = _model()
    opt = offload.AdamW(m.parameters(), lr=1e-2)
    _backward(m, rank, 0)
    opt.step()
    saved = opt.state_dict()
    _backward(m, rank, 1)
    opt.step()
    if how == "lr" and rank == 1:
        opt.param_groups[0]["lr"] = 5e-3  # a schedule stepped on one rank only
    if how == "lr_last_bits" and rank == 1:  # a schedule's cos() from another libm on another node
        opt.param_groups[0]["lr"] = math.nextafter(1e-2, 1.0)
    if how == "steps" and rank == 1:
        opt.load_state_dict(saved)  # back one step on one rank only
    before = torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])
    _backward(m, rank, 2)
    refused = _outcome(opt.step)
    unchanged = torch.equal(before, torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    opt.close()
    return dict(refused=refused, unchanged=unchanged)


@pytest.mark.parametrize("how, words", [
    ("lr", "their param_groups' hyperparameters (or max_grad_norm): group 0 lr: rank 0: 0.01, rank 1: 0.005"),
    ("steps", "their step counts: rank 0: 2, rank 1: 1"), ("lr_last_bits", None)])
def test_ranks_whose_groups_or_steps_differ_are_refused_before_the_step(how, words):
    got = group(2).run(_divergent_job, how)
    if words is None:  # within a millionth: the fingerprints differ, the values gathered agree
        assert got[0]["refused"] == got[1]["refused"] == "stepped", got
        return
    for rank in (0, 1):
        assert got[rank]["refused"].startswith("ValueError: offload.Adam/AdamW step (stage 2, 2 ranks): the ranks "
                                               f"differ in {words}"), got[rank]
        assert got[rank]["unchanged"], got[rank]


def _closed_or_sparse_job(rank, world, how):
    torch.manual_seed(0)
    emb, lin = nn.Embedding(10, 4, sparse=how == "sparse"), nn.Linear(4, 2)
    params = list(emb.parameters()) + list(lin.parameters())
    opt = offload.SGD(params, lr=0.1, momentum=0.9) if how == "sparse" else offload.AdamW(params, lr=1e-2)
    got = []
    for s in range(2):
        opt.zero_grad()
        idx = torch.tensor([1, 2, 3])
        out = lin(emb(idx)) if (how != "sparse" or s == 0 or rank == 0) else lin(torch.ones(3, 4))
        out.square().mean().backward()
        if how == "closed" and s == 1 and rank == 1:
            opt.close()  # after a step: the last step's agreement is still on record
        got.append(_outcome(opt.step))
    opt.close()
    return got


def test_a_rank_closed_after_a_step_or_with_a_sparse_grad_raises_on_every_rank():
    got = group(2).run(_closed_or_sparse_job, "closed")
    assert got[0][0] == got[1][0] == "stepped"
    assert got[0][1].startswith("RuntimeError: offload.Adam/AdamW step (stage 2, 2 ranks): it failed on rank(s) 1")
    assert "closed" in got[1][1], got[1]
    # SGD takes sparse grads at stage 0 only: refused on the rank that has one (at the first
    # step on both ranks, at the second on rank 0 alone) before any rank's collective
    got = group(2).run(_closed_or_sparse_job, "sparse")
    assert got[0][0].startswith("RuntimeError: offload.SGD: sparse grads are stepped for CPU params at stage 0 only")
    assert got[1][0].startswith("RuntimeError: offload.SGD step (stage 2, 2 ranks): it failed on rank(s) 0, 1") or \
        got[1][0].startswith("RuntimeError: offload.SGD: sparse grads"), got
    assert got[0][1].startswith("RuntimeError: offload.SGD: sparse grads are stepped"), got[0]
    assert got[1][1].startswith("RuntimeError: offload.SGD step (stage 2, 2 ranks): it failed on rank(s) 0 before"), got[1]
