"""A swap step over many small params ([Note: one kernel call per sub-group] in
optim/swapped_compute.py, [Note: fingerprint] in optim/fingerprint.py): the batched kernel
gives the bits of the per-range path, the fingerprint the value of the per-param sums, and
the counts the optimizer advanced are not made again."""
from __future__ import annotations

import zlib

import pytest
import torch

import offload
from offload.kernels import get_backend
from offload.optim.context import StepCounts
from offload.optim.fingerprint import fingerprint, sample_indices
from offload.swap import SwapLayout


def _params(seed=0):
    """Params of many sizes (SIMD tails, 1 element, a few across sub-groups), one transposed
    (non-contiguous) and one of 0 elements."""
    g = torch.Generator().manual_seed(seed)
    sizes = [64] * 40 + [1, 7, 4097, 33, 2500, 3, 0]
    ps = [torch.randn(n, generator=g) for n in sizes]
    ps.append(torch.randn(13, 9, generator=g).t())
    return [p.requires_grad_() for p in ps]


def _groups(ps):
    return [{"params": ps[:20]}, {"params": ps[20:30], "lr": 3e-3, "weight_decay": 0.0}, {"params": ps[30:]}]


def _train(ps, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for k in range(steps):
        for i, p in enumerate(ps):
            # param 5 joins at the second step (its own step count, its own kernel batch) and
            # param 6 sits the third out
            skip = (i == 5 and k == 0) or (i == 6 and k == 2)
            p.grad = None if skip else torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("sub_group_size", [1024, None])
def test_nvme_over_small_params_equals_the_host_store_bit_for_bit(tmp_path, sub_group_size):
    a, b = _params(), _params()
    host = offload.AdamW(_groups(a), lr=1e-2, weight_decay=0.1)
    nvme = offload.AdamW(_groups(b), lr=1e-2, weight_decay=0.1, offload="nvme", swap_dir=str(tmp_path),
                         sub_group_size=sub_group_size, max_host_bytes=1 << 22)
    _train(a, host, 4)
    _train(b, nvme, 4)
    sa, sb = host.state_dict()["state"], nvme.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), i
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    nvme.close()


def test_one_kernel_call_per_sub_group_and_hyperparameters(tmp_path, monkeypatch):
    ps = [torch.randn(64).requires_grad_() for _ in range(300)]
    opt = offload.AdamW([{"params": ps[:200]}, {"params": ps[200:], "lr": 1e-3}], lr=1e-2, offload="nvme",
                        swap_dir=str(tmp_path))
    kernel = get_backend(opt.backend)
    calls = {"rule_step": 0, "checked_rule_steps": 0}
    for name in calls:
        real = getattr(kernel, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*args, **kw)
        monkeypatch.setattr(kernel, name, counted)
    for p in ps:
        p.grad = torch.ones(64)
    opt.step()
    assert opt._store.layout.num_groups == 1
    assert calls == {"rule_step": 0, "checked_rule_steps": 2}  # one per group's hyperparameters
    opt.close()


def test_the_counts_the_optimizer_advanced_are_not_made_again(tmp_path, monkeypatch):
    ps = [torch.randn(64).requires_grad_() for _ in range(50)]
    opt = offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=str(tmp_path))
    for p in ps:
        p.grad = torch.ones(64)
    opt.step()
    made = []
    real = StepCounts.set
    monkeypatch.setattr(StepCounts, "set", lambda self, p, n: (made.append(n), real(self, p, n)))
    opt.step()
    assert made == [] and all(opt.state[p]["step"].item() == 2 for p in ps)
    assert opt._store.store.extra["steps"] == [2] * 50
    opt.close()


def _reference_fingerprint(params, samples):
    """The fingerprint as written before the numpy gather: one torch index and crc32 per param."""
    crc = zlib.crc32(repr([tuple(p.shape) for p in params]).encode())
    for p, idx in zip(params, samples):
        if idx.numel():
            flat = p.detach().view(-1) if p.is_contiguous() else p.detach().reshape(-1)
            crc = zlib.crc32(flat[idx].numpy().tobytes(), crc)
    return f"{crc:08x}"


def test_fingerprint_is_the_per_param_crc_chain():
    ps = _params(3)
    offsets, at = [], 0
    for p in ps:
        offsets.append(at)
        at += p.numel()
    samples = sample_indices(ps, offsets, SwapLayout(at, 1024, 2))
    before = fingerprint(ps, samples)
    assert before == _reference_fingerprint(ps, samples)
    ps[-1].detach()[0, 2] += 1.0  # logical element 2 of the transposed param: its second sample
    assert 2 in samples[-1].tolist()
    assert fingerprint(ps, samples) == _reference_fingerprint(ps, samples) != before
    assert fingerprint([], []) == _reference_fingerprint([], [])


def _overlapping_views_run(make):
    """Overlapping views of one tensor (pb and pc share four elements) in one group, pb
    sitting the first step out: another count, so another kernel batch than px and pc."""
    base = torch.arange(12, dtype=torch.float32) / 10
    ps = [torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(base[0:8]), torch.nn.Parameter(base[4:12])]
    opt = make(ps)
    for k in range(2):
        for i, p in enumerate(ps):
            p.grad = None if (i == 1 and k == 0) else torch.full((8,), 1.0 + 3 * i)
        opt.step()
    return opt, [p.detach().clone() for p in ps]


def test_overlapping_params_in_batches_of_other_counts_step_one_after_another(tmp_path):
    # [Note: pieces that share memory] in swapped_compute.py: merging the batches ran pc's
    # step before pb's, which came first (with weight decay the order changes the result)
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.5)
    _, want = _overlapping_views_run(lambda ps: torch.optim.SGD(ps, foreach=False, **kw))
    opt, got = _overlapping_views_run(lambda ps: offload.SGD(ps, offload="nvme", swap_dir=str(tmp_path), **kw))
    opt.close()
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), (i, (a - b).abs().max().item())
