"""torch.distributed.checkpoint's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
on a partitioned optimizer (stage 1 and 2 over two gloo ranks), plain and flattened: a rank
that holds no slice of a param has no state view of it in ``opt.state[p]``, so the flattened
dict it rebuilds lacks that param's moments; it loses nothing (the owner loads them) and must
load (state_io._check_not_bare refuses only where the rank holds the states). Every rank gives
the same grads, so the run matches one ``torch.optim.AdamW`` on them element by element. With
bf16 params the fp32 masters come back too: the resumed run is the uninterrupted one."""
from __future__ import annotations

import copy

import pytest
import torch

import offload
from _ranks import group
from _lazy import lazy_import

dcp_sd = lazy_import("torch.distributed.checkpoint.state_dict")  # on first use: tests/_lazy.py


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        model(torch.randn(4, 7, generator=gen).to(dtype)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _resume_job(rank, world, stage, flatten):
    options = dcp_sd.StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = _model()
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=stage)
    _train(model, opt, 3, 1)
    saved = copy.deepcopy(dcp_sd.get_optimizer_state_dict(model, opt, options=options))  # collective
    opt.close()
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = offload.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1, stage=stage)
    dcp_sd.set_optimizer_state_dict(model2, opt2, saved, options=options)
    _train(model2, opt2, 3, 2)
    opt2.close()
    return [p.detach().tolist() for p in model2.parameters()]


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_resume_through_dcp_helpers(stage, flatten):
    got = group(2).run(_resume_job, stage, flatten)
    ref_model = _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    _train(ref_model, ref, 3, 1)
    _train(ref_model, ref, 3, 2)
    for rank in range(2):
        for value, p in zip(got[rank], ref_model.parameters()):
            torch.testing.assert_close(torch.tensor(value), p.detach(), rtol=1e-5, atol=1e-6)


def _bf16_resume_job(rank, world, stage):
    """bf16 params: (uninterrupted, resumed through a flattened dict) params after 3 + 3 steps."""
    options = dcp_sd.StateDictOptions(flatten_optimizer_state_dict=True)
    model = _model().to(torch.bfloat16)
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=stage)
    _train(model, opt, 3, 1)
    saved = copy.deepcopy(dcp_sd.get_optimizer_state_dict(model, opt, options=options))  # collective
    model2 = _model().to(torch.bfloat16)
    model2.load_state_dict(model.state_dict())
    opt2 = offload.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1, stage=stage)
    dcp_sd.set_optimizer_state_dict(model2, opt2, saved, options=options)
    _train(model, opt, 3, 2)
    _train(model2, opt2, 3, 2)
    opt.close()
    opt2.close()
    return [(p.detach().float().tolist(), q.detach().float().tolist())
            for p, q in zip(model.parameters(), model2.parameters())]


@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_bf16_masters_through_flattened_dict(stage):
    """Each rank lists the master of its slices only ([Note: the master in opt.state]); the
    flattened dict brings every slice's master back: the resumed run is the uninterrupted one."""
    got = group(2).run(_bf16_resume_job, stage)
    for rank in range(2):
        for uninterrupted, resumed in got[rank]:
            assert resumed == uninterrupted


def _sgd_resume_job(rank, world, stage):
    """SGD with momentum through a flattened dict: a rank that holds no slice of a param lists
    no buffer in ``opt.state[p]``, so its rebuilt entry is a bare "step" hole; the owner loads
    the buffer (fuzz seed 150: that rank refused, "lost its 'momentum_buffer'", the other went on)."""
    options = dcp_sd.StateDictOptions(flatten_optimizer_state_dict=True)
    hp = dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1, stage=stage)
    model = _model()
    opt = offload.SGD(model.parameters(), **hp)
    _train(model, opt, 3, 1)
    saved = copy.deepcopy(dcp_sd.get_optimizer_state_dict(model, opt, options=options))  # collective
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = offload.SGD(model2.parameters(), **hp)
    dcp_sd.set_optimizer_state_dict(model2, opt2, saved, options=options)
    keys = [sorted(st) for st in opt2.state_dict()["state"].values()]
    _train(model2, opt2, 3, 2)
    opt.close()
    opt2.close()
    return keys, [p.detach().tolist() for p in model2.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_sgd_momentum_through_flattened_dict(stage):
    got = group(2).run(_sgd_resume_job, stage)
    ref_model = _model()
    ref = torch.optim.SGD(ref_model.parameters(), lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1,
                          foreach=False)
    _train(ref_model, ref, 3, 1)
    _train(ref_model, ref, 3, 2)
    for rank in range(2):
        keys, params = got[rank]
        assert keys == [["momentum_buffer"]] * 4
        for value, p in zip(params, ref_model.parameters()):
            torch.testing.assert_close(torch.tensor(value), p.detach(), rtol=1e-5, atol=1e-6)
