"""Forwards entered below the root (offload/shard/entries.py [Note: forwards entered below the
root]): an encoder called alone, as ``generate()`` of T5, BART and Whisper calls
``model.get_encoder()(...)``, and a root-unit module read after it, as CLIP's
``get_text_features`` runs ``text_model`` and then ``text_projection``. Before, the encoder's
blocks raised "called outside the forward"; the projection alone read released root params
(zeros on several ranks or on NVMe)."""
from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import offload
from _ranks import group


class _Stack(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed  # shared by both stacks: a root param
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)


class _EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        embed = nn.Embedding(16, 8)
        self.encoder, self.decoder = _Stack(embed), _Stack(embed)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.decoder(ids) + self.encoder(ids))

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        """As CLIP's get_text_features: a container, then a root holder, outside forward()."""
        return self.proj(self.encoder(ids))


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(seed))


def _pair(**kw):
    torch.manual_seed(0)
    ref = _EncDec()
    torch.manual_seed(0)
    return ref, offload.shard(_EncDec(), **kw)


@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_an_encoder_and_a_projection_called_alone_equal_the_unsharded_model(params):
    swap = tempfile.mkdtemp()
    try:
        ref, model = _pair(**(dict(offload_params="nvme", swap_dir=swap) if params == "nvme" else {}))
        with torch.no_grad():
            torch.testing.assert_close(model.encoder(_ids(1)), ref.encoder(_ids(1)), rtol=0, atol=0)
            torch.testing.assert_close(model.features(_ids(2)), ref.features(_ids(2)), rtol=0, atol=0)
            torch.testing.assert_close(model(_ids(3)), ref(_ids(3)), rtol=0, atol=0)
        assert offload.shard.runtime_of(model).live_bytes() == 0  # released again
        del model
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def _train(model, opt, steps=3):
    for s in range(steps):
        model.features(_ids(10 + s)).square().mean().backward()  # the encoder and proj only
        opt.step()
        opt.zero_grad()


def test_training_through_an_encoder_called_alone_equals_torch():
    # no weight decay: the decoder's norm, a root param, gets no grad here and is stepped with a
    # zero one (README: a param without a grad), which moves it by its decay only
    ref, model = _pair()
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0))
    with pytest.warns(RuntimeWarning, match="decoder.norm"):
        _train(model, offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0))
    with torch.no_grad():
        torch.testing.assert_close(model(_ids(6)), ref(_ids(6)), rtol=1e-5, atol=1e-6)
    got = offload.shard.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_an_encoder_that_raised_leaves_the_next_call_working():
    ref, model = _pair()
    with pytest.raises(IndexError):
        model.encoder(torch.tensor([[99]]))  # out of the embedding's range, inside the forward
    with torch.no_grad():
        torch.testing.assert_close(model.features(_ids(4)), ref.features(_ids(4)), rtol=0, atol=0)
        torch.testing.assert_close(model(_ids(5)), ref(_ids(5)), rtol=0, atol=0)


def job_entries(rank, world):
    torch.manual_seed(0)
    ref = _EncDec()
    torch.manual_seed(0)
    model = offload.shard(_EncDec())
    with torch.no_grad():
        x = torch.randn(2, 8)
        out = [(model.features(_ids(1)) - ref.features(_ids(1))).abs().max().item(),
               (model.encoder(_ids(2)) - ref.encoder(_ids(2))).abs().max().item(),
               (model.proj(x) - ref.proj(x)).abs().max().item()]  # was zeros: the root released
    offload.shard.runtime_of(model).remove()
    dist.barrier()
    return out


def test_two_ranks_call_an_encoder_and_a_projection_alone():
    for rank, diffs in group(2).run(job_entries).items():
        assert diffs == [0.0, 0.0, 0.0], (rank, diffs)
