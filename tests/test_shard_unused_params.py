"""Stage 3 steps a shard's params as one tensor: a param that got no grad on any rank while
others of its shard did is stepped with a zero grad, where torch.optim skips it
(offload/optim/shard_store.py [Note: a param without a grad]). That is said, once per param,
and only for such params: not for one with a grad from one micro-batch of two, nor for one
with a grad on one rank of two (the flags are agreed in the backward's final round)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import offload
from test_shard_train import pools  # noqa: F401  (the fixture)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(8, 8)
        self.sometimes = torch.nn.Linear(8, 8)  # micro-batch 1 only, or rank 0 only
        self.unused = torch.nn.Linear(8, 8)     # in the root unit with the others, never called

    def forward(self, x: torch.Tensor, take: bool) -> torch.Tensor:
        y = self.used(x)
        return self.sometimes(y) if take else y


def _said(caught) -> list:
    return sorted(str(w.message).split("'")[1] for w in caught if "got no grad" in str(w.message))


def job_unused(group=None, by_rank: bool = False) -> list:
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = offload.shard(_Net(), process_group=group)
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    said = []
    try:
        for step in range(3):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for micro in range(2):
                    take = rank == 0 if by_rank else micro == 1
                    model(torch.randn(4, 8), take).square().mean().backward()
                opt.step()
            said.append(_said(caught))
            opt.zero_grad()
    finally:
        opt.close()
    return said


def test_one_rank_warns_once_for_the_param_without_a_grad():
    said = job_unused()
    assert said == [["unused.bias", "unused.weight"], [], []], said  # once per param


def test_the_warning_says_what_happens_and_what_to_do():
    torch.manual_seed(0)
    model = offload.shard(_Net())
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.randn(4, 8), False).sum().backward()
    with pytest.warns(RuntimeWarning, match="got no grad on any rank") as caught:
        opt.step()
    text = str(caught[0].message)
    assert "torch.optim skips" in text and "requires_grad_(False)" in text and "unit=" in text
    opt.close()


def test_two_ranks_agree_a_param_with_a_grad_on_one_of_them(pools):  # noqa: F811
    said = pools(2).run("test_shard_unused_params:job_unused", by_rank=True)
    assert said == [[["unused.bias", "unused.weight"], [], []]] * 2, said
