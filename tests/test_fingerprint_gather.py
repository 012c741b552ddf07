"""The fingerprint's gather ([Note: fingerprint] in optim/fingerprint.py): small float32
params through one concatenation, the others one by one, and the general way for what the
gather does not take; each gives the value of the per-param crc32 chain."""
from __future__ import annotations

import zlib

import pytest
import torch

from offload.optim import fingerprint as fp
from offload.swap import SwapLayout


def _reference(params, samples):
    """The fingerprint as first written: one torch index and crc32 per param."""
    crc = zlib.crc32(repr([tuple(p.shape) for p in params]).encode())
    for p, idx in zip(params, samples):
        if idx.numel():
            crc = zlib.crc32(p.detach().reshape(-1)[idx].numpy().tobytes(), crc)
    return f"{crc:08x}"


def _previous(params, samples):
    """The fingerprint of the previous release: one concatenation of the per-param samples
    (numpy's: of float64 when any param is, where the per-param chain differs)."""
    import numpy as np

    crc = zlib.crc32(repr([tuple(p.shape) for p in params]).encode())
    parts = [p.detach().numpy().reshape(-1).take(idx.numpy()) for p, idx in zip(params, samples) if idx.numel()]
    return f"{zlib.crc32(np.concatenate(parts).tobytes(), crc) if parts else crc:08x}"


def _samples(ps, sub_group_size=1024):
    offsets, at = [], 0
    for p in ps:
        offsets.append(at)
        at += p.numel()
    return fp.sample_indices(ps, offsets, SwapLayout(max(at, 1), sub_group_size, 2))


def _small(seed=0):
    """Small params only: 1-D, 2-D, a transposed one, a scalar, one of 0 elements, one that
    spans sub-groups."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g) for n in (64, 1, 7, 0, 300, 1000, 1024)]
    ps += [torch.randn(5, 6, generator=g), torch.randn(9, 13, generator=g).t(), torch.randn((), generator=g)]
    return [p.requires_grad_() for p in ps]


def test_small_params_gather_the_reference_values_and_see_each_change():
    ps = _small()
    samples = _samples(ps)
    before = fp.fingerprint(ps, samples)
    assert before == _reference(ps, samples)
    for i, p in enumerate(ps):
        if not p.numel():
            continue
        p.detach().view(-1)[-1:].add_(1.0) if p.is_contiguous() else p.detach()[-1, -1].add_(1.0)
        now = fp.fingerprint(ps, samples)
        assert now == _reference(ps, samples) != before, i
        before = now


def test_small_params_take_one_numpy_view(monkeypatch):
    ps = [torch.randn(64).requires_grad_() for _ in range(50)] + [torch.randn(5000).requires_grad_()]
    samples = _samples(ps, 1024)
    want, calls = _reference(ps, samples), []
    real = torch.Tensor.numpy
    monkeypatch.setattr(torch.Tensor, "numpy", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert fp.fingerprint(ps, samples) == want
    assert len(calls) == 2  # the 50 small params' concatenation, and the large one


def test_a_plain_list_of_samples_gives_the_same_value():
    ps = _small(1) + [torch.randn(3000)]
    samples = _samples(ps)
    assert fp.fingerprint(ps, list(samples)) == fp.fingerprint(ps, samples) == _reference(ps, samples)
    assert fp.fingerprint([], []) == _reference([], [])


def test_what_the_gather_does_not_take_goes_the_general_way():
    ps = _small(2)
    samples = _samples(ps)
    ps[0].data = ps[0].data.double()  # replaced behind the optimizer's back: the value as before
    assert fp.fingerprint(ps, samples) == _previous(ps, samples) != _previous(_small(2), samples)
    ps[0].data = torch.randn(3, dtype=torch.float32)  # shrunk: an index past its end
    with pytest.raises(IndexError):
        fp.fingerprint(ps, samples)


def test_large_params_only_are_sampled_one_by_one():
    ps = [torch.randn(3000).requires_grad_(), torch.randn(40, 50).t().requires_grad_()]
    samples = _samples(ps)
    assert fp.fingerprint(ps, samples) == _reference(ps, samples)
