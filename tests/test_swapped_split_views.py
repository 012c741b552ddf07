"""``_split_views`` (optim/swapped_compute.py): each piece's views of a sub-group's states,
in the pieces' order (given out of order, with gaps, at the edges), are the slices of its
range; overlapping pieces give None; a rule without states gives empty tuples."""
from __future__ import annotations

import random

import pytest
import torch

from offload.optim.swapped_compute import _split_views


def _pieces(seed, s=1000, n=600):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(s + 1, s + n), 30)) + [s + n]
    out, at = [], s
    for k, c in enumerate(cuts):
        if k % 4 != 3:  # every fourth a gap: no range of this step there
            out.append((at, c, at, None))
        at = c
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("states", [[0, 1], [1], [2, 0, 1]])
def test_views_are_the_slices_of_each_range(seed, states):
    s, n = 1000, 600
    tensors = [torch.arange(n, dtype=torch.float32) + 1000 * j for j in range(3)]
    pieces = _pieces(seed, s, n)
    got = _split_views(pieces, s, n, tensors, states)
    assert len(got) == len(pieces)
    for (a, b, _, _), views in zip(pieces, got):
        assert len(views) == len(states)
        for j, v in zip(states, views):
            want = tensors[j][a - s:b - s]
            assert v.data_ptr() == want.data_ptr() and v.shape == want.shape


def test_one_piece_no_states_and_overlaps():
    tensors = [torch.zeros(100)]
    (one,) = _split_views([(10, 50, 10, None)], 0, 100, tensors, [0])
    assert one[0].data_ptr() == tensors[0][10:50].data_ptr() and one[0].numel() == 40
    assert _split_views([(0, 10, 0, None), (10, 20, 10, None)], 0, 100, tensors, []) == [(), ()]
    assert _split_views([(0, 10, 0, None), (5, 20, 5, None)], 0, 100, tensors, [0]) is None
