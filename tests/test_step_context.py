"""offload.optim.context: step counts kept in torch's place, read and set through StepCounts."""
from collections import defaultdict

import torch

from offload.optim.context import StepContext, StepCounts


def test_step_counts_live_in_torch_state_layout():
    state = defaultdict(dict)
    counts = StepCounts(lambda: state)
    p, q = torch.zeros(3), torch.zeros(2)
    assert counts.get(p) == 0 and not counts.has(p)
    assert p not in state  # reading creates no entry
    before, new = counts.advance([p, p, q])
    assert new == [1, 2, 1] and [b for _, b in before][:1] == [None]  # each count as it comes
    assert counts.get(p) == 2 and counts.get(q) == 1
    held = state[p]["step"]
    assert torch.is_tensor(held) and held.dtype == torch.float32 and held.shape == ()
    counts.set(p, 7)
    assert counts.get(p) == 7
    # a new tensor, never an in-place change: a state_dict taken (or loaded) earlier shares
    # the old one and must not change under its holder
    assert float(held) == 2.0 and state[p]["step"] is not held
    # a param listed twice counts twice, and restore undoes both
    before, new = counts.advance([p, q, p])
    assert new == [8, 2, 9] and counts.get(p) == 9 and counts.get(q) == 2
    counts.restore(before)
    assert counts.get(p) == 7 and counts.get(q) == 1
    counts.set(q, 0)
    assert q not in state  # a count of 0 leaves no entry, as torch before the first step
    state[p]["exp_avg"] = torch.zeros(3)
    counts.set(p, 0)
    assert "step" not in state[p] and "exp_avg" in state[p]


def test_counts_follow_a_replaced_state_dict():
    holder = {"state": defaultdict(dict)}
    counts = StepCounts(lambda: holder["state"])
    p = torch.zeros(1)
    counts.set(p, 3)
    holder["state"] = defaultdict(dict, {p: {"step": torch.tensor(9.0)}})  # torch's load_state_dict
    assert counts.get(p) == 9
    ctx = StepContext(steps=counts)
    assert not ctx.no_sync and ctx.found_inf is None and ctx.max_grad_norm is None
