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
from typing import Any, Optional, Sequence

import numpy as np
import torch

__all__ = ["Samples", "sample_indices", "fingerprint"]

_SAMPLES_PER_GROUP = 8
_F32 = torch.float32


# A param of at most this many elements is gathered through one concatenation of all such
# params (its copy costs less than the ~2 us of a numpy view and ``take`` per param);
# a larger one is sampled in place, as before.
_CAT_ELEMENTS = 1024


class Samples(list):
    """``sample_indices``' list (a tensor of local indices per param), with what the gather
    needs of it made once: the indices as one numpy array, their count and largest per param."""

    def __init__(self, indices: Sequence[torch.Tensor]) -> None:
        super().__init__(indices)
        arrays = [idx.numpy().astype(np.int64, copy=False) for idx in self]
        self.arrays = arrays
        self.counts = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
        self.local = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        self.largest = np.fromiter((a.max() if a.size else -1 for a in arrays), np.int64, len(arrays))
        self.starts = np.cumsum(self.counts) - self.counts  # of each param's samples in ``local``


def sample_indices(params: Sequence[torch.Tensor], offsets: Sequence[int], layout: Any) -> Samples:
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
    return Samples(out)


def fingerprint(params: Sequence[torch.Tensor], samples: Sequence[torch.Tensor]) -> str:
    """crc32 of the params' shapes and of their sampled elements, as 8 hex digits.

    The samples are gathered through numpy and summed at once (crc32 of the concatenation is
    the crc32 chained over the pieces, so the value is the same as summing each param's
    samples in turn): a torch index per param cost ~4 us, 8 ms a step over 2000 params."""
    crc = zlib.crc32(repr([tuple(p.shape) for p in params]).encode())
    values = _gathered(params, samples if isinstance(samples, Samples) else Samples(samples))
    if values is None:
        parts = [p.detach().numpy().take(idx)  # take: of the flattened (logical order), a copy if strided
                 for p, idx in zip(params, samples.arrays if isinstance(samples, Samples) else
                                   [i.numpy() for i in samples]) if idx.size]
        values = np.concatenate(parts) if parts else None
    if values is not None:
        crc = zlib.crc32(values.tobytes(), crc)
    return f"{crc:08x}"


def _gathered(params: Sequence[torch.Tensor], samples: Samples) -> Optional[np.ndarray]:
    """The sampled values of float32 ``params`` in order, the params of at most
    ``_CAT_ELEMENTS`` elements through one ``torch.cat`` and one ``take`` (the per-param
    numpy views cost 2 of the 5 ms of a fingerprint over 2000 params); None when the
    general way must run: another dtype (its values' bytes), an index past a param's end
    (its IndexError), another number of params, no sample at all, or no small param."""
    n = len(params)
    if n != len(samples) or not samples.local.size or any(p.dtype is not _F32 for p in params):
        return None
    numels = np.fromiter(map(torch.Tensor.numel, params), np.int64, n)
    if (samples.largest >= numels).any():
        return None
    small = numels <= _CAT_ELEMENTS
    if not small.any():  # nothing to concatenate: the general way is the same loop
        return None
    if small.all():  # (no per-param mask: the usual case of many small params)
        return _cat(params).take(samples.local + np.repeat(np.cumsum(numels) - numels, samples.counts))
    out = np.empty(samples.local.size, np.float32)
    at = np.repeat(small, samples.counts)
    begins = np.cumsum(numels[small]) - numels[small]
    flat = _cat([params[i] for i in np.flatnonzero(small)])
    out[at] = flat.take(samples.local[at] + np.repeat(begins, samples.counts[small]))
    for i in np.flatnonzero(~small):
        a = samples.starts[i]
        out[a:a + samples.counts[i]] = params[i].detach().numpy().take(samples.arrays[i])
    return out


def _cat(params: Sequence[torch.Tensor]) -> np.ndarray:
    """The elements of ``params``, each in logical order, one after another."""
    with torch.no_grad():  # flatten: the param itself when 1-D, else a view (a copy if strided)
        return torch.cat([p.flatten() for p in params]).numpy()
