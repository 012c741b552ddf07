"""The fingerprint of fp32 params that are their own master (the in-place nvme store).

[Note: fingerprint] The fp32 params are the user's tensors, not ours: after a crash they come
back from the user's own checkpoint. The manifest records, with each step, a crc32 of the
param shapes and of a sample of elements (a few per sub-group and per param, so every
sub-group a step touches changes it); ``resume=True`` with params from another step (or a
half-applied step) is refused instead of silently mixing moments of step k with params of
step j.
"""
from __future__ import annotations

import zlib
from typing import Any, List, Sequence

import numpy as np
import torch

__all__ = ["sample_indices", "fingerprint"]

_SAMPLES_PER_GROUP = 8


def sample_indices(params: Sequence[torch.Tensor], offsets: Sequence[int], layout: Any) -> List[torch.Tensor]:
    """Per param, the local indices whose values enter the fingerprint: its first and last
    element and a few spread over each sub-group (of ``layout``) it overlaps."""
    out = []
    for p, off in zip(params, offsets):
        n = p.numel()
        idx = {0, n - 1} if n else set()
        for g in layout.groups_overlapping(off, off + n):
            s, e = layout.group_range(g)
            a, b = max(s, off) - off, min(e, off + n) - off
            k = min(_SAMPLES_PER_GROUP, b - a)
            idx.update(a + (b - a - 1) * j // max(1, k - 1) for j in range(k))
        out.append(torch.tensor(sorted(idx), dtype=torch.int64))
    return out


def fingerprint(params: Sequence[torch.Tensor], samples: Sequence[torch.Tensor]) -> str:
    """crc32 of the params' shapes and of their sampled elements, as 8 hex digits.

    The samples are gathered through numpy and summed at once (crc32 of the concatenation is
    the crc32 chained over the pieces, so the value is the same as summing each param's
    samples in turn): a torch index per param cost ~4 us, 8 ms a step over 2000 params."""
    crc = zlib.crc32(repr([tuple(p.shape) for p in params]).encode())
    parts = [p.detach().numpy().reshape(-1).take(idx.numpy())  # reshape: logical order, a copy if strided
             for p, idx in zip(params, samples) if idx.numel()]
    if parts:
        crc = zlib.crc32(np.concatenate(parts).tobytes(), crc)
    return f"{crc:08x}"
