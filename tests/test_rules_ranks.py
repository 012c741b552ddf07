"""offload.SGD, Adagrad, Lion and AdamW(amsgrad=True) partitioned over two gloo ranks (stage 2, the flat store's
shards) against the single-process reference of test_rules_optim.py: every rank gives the
same grads, so their average is the grad the reference steps with."""
from __future__ import annotations

import pytest
import torch

from test_rules_optim import CASES, STEPS, TOL, _groups, _need, _ref_kwargs
from _ranks import group

SIZES = (1, 7, 15, 16, 17, 4097)


def _grads(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=gen).to(dtype) for n in SIZES] for _ in range(STEPS)]


def _init(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen).to(dtype) for n in SIZES]


def _rank_job(rank, world, case, dtype, offload_kw):
    cls, _, _, hypers = CASES[case]
    params = _init(dtype)
    opt = cls(_groups(params, hypers), stage=2, **offload_kw)
    for grads in _grads(dtype, 1):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    sd = opt.state_dict()  # collective: every rank
    opt.close()  # the ranks live on for the next job: leave no swap files open
    masters = [sd["state"].get(i, {}).get("master") for i in range(len(params))]
    # plain lists: a tensor sent through the queue lives in shared memory tied to its sender
    return [p.float().tolist() for p in params], [None if m is None else m.tolist() for m in masters]


def _two_ranks(case, dtype, offload_kw):
    # One group of two ranks for the session (tests/_ranks.py): a spawn per case cost ~3 s.
    return group(2).run(_rank_job, case, dtype, offload_kw)


def _reference(case, dtype):
    _, ref_cls, _, hypers = CASES[case]
    ref = [p.float() for p in _init(dtype)]
    rop = ref_cls(_groups(ref, hypers), **_ref_kwargs(ref_cls))
    for grads in _grads(dtype, 1):
        for r, g in zip(ref, grads):
            r.grad = g.float()
        rop.step()
    return ref


@pytest.mark.parametrize("dtype, store", [(torch.float32, "cpu"), (torch.bfloat16, "cpu"),
                                          (torch.float32, "nvme")])
@pytest.mark.parametrize("case", ["sgd-mixed", "adagrad", "lion", "amsgrad"])
def test_two_ranks_stage2_match_reference(case, dtype, store, tmp_path):
    _need(CASES[case][2])
    kw = dict(offload=store, swap_dir=str(tmp_path)) if store == "nvme" else dict(offload=store)
    got = _two_ranks(case, dtype, kw)
    ref = _reference(case, dtype)
    for rank in (0, 1):
        params, masters = got[rank]
        for p, m, r in zip(params, masters, ref):
            p = torch.tensor(p, dtype=torch.float32).to(dtype)  # exact: the values were dtype's
            m = None if m is None else torch.tensor(m, dtype=torch.float32)
            if dtype == torch.float32:
                torch.testing.assert_close(p, r, **TOL)
            else:
                torch.testing.assert_close(m, r, **TOL)  # the fp32 master, gathered
                assert torch.equal(p, r.to(dtype))
