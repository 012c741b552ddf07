"""One rank on the CPU: the unit's full buffer is its shard ([Note: one rank's full buffer is
its shard] in offload/shard/flat_unit.py) and its grads go straight into the shard grads
([Note: one rank's grads] in offload/shard/grads.py). Checked here: no copy of the params
exists, an eviction by someone else does not drop a live unit's pages, an in-place op between
forward and backward raises torch's error, a view without a grad leaves zeros (not
stale bytes) in a fresh shard grad, and a backward interrupted part-way leaves no grads behind
once zero_grad() ran."""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn as nn

import offload
from offload.memory import paging
from offload.shard import gathered_params, runtime_of


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(33, 33), nn.Linear(33, 33)

    def forward(self, x, skip_first=False):
        return self.b(x if skip_first else torch.tanh(self.a(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(33, 5)

    def forward(self, x, skip_first=False):
        for b in self.blocks:
            x = b(x, skip_first)
        return self.head(x)


def _pair(offload_params, tmp):
    torch.manual_seed(0)
    ref = _Net()
    torch.manual_seed(0)
    model = offload.shard(_Net(), offload_params=offload_params, swap_dir=tmp if offload_params == "nvme" else None)
    return ref, model


def _flat(model, i):
    return runtime_of(model).units[i].flats[0]


@pytest.mark.parametrize("offload_params", ["none", "nvme"])
def test_the_views_are_the_shard_itself(offload_params):
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        _, model = _pair(offload_params, tmp)
        for u in runtime_of(model).units:
            for flat in u.flats:
                base = flat.shard.data_ptr()
                for leaf, (o, _n) in zip(flat.leaves, flat.slots):
                    assert leaf.data_ptr() == base + o * flat.shard.element_size()
        del model


@pytest.mark.parametrize("offload_params", ["none", "nvme"])
def test_training_equals_plain_torch(offload_params):
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        ref, model = _pair(offload_params, tmp)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            x = torch.randn(7, 33, generator=g)
            for m, o in ((ref, opt_ref), (model, opt)):
                for _micro in range(2):  # accumulation: the second grads are added
                    m(x).square().mean().backward()
                o.step()
                o.zero_grad()
        got = gathered_params(model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6)
        opt.close()
        del model


@pytest.mark.parametrize("grads_on_disk", [False, True])
def test_a_fresh_shard_grad_is_zero_where_a_view_has_none(grads_on_disk, monkeypatch):
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        _, model = _pair("none", None)
        opt = offload.AdamW(model.parameters(), offload="nvme" if grads_on_disk else "none",
                            swap_dir=tmp if grads_on_disk else None)
        x = torch.randn(4, 33)
        model(x).sum().backward()
        flat = _flat(model, 1)
        if grads_on_disk:  # the last grad's bytes stay in the swap file: a fresh one must not show them
            assert flat.shard.grad is flat.grad_standin
            paging.load([flat.grad_area])
            assert flat.grad_area.abs().sum() > 0
            paging.evict([flat.grad_area])
        else:
            flat.shard.grad.fill_(7.0)  # what a reused allocation might hold
        opt.zero_grad()
        empty = torch.empty

        def poisoned(*a, **k):  # what torch.empty may hand out: anything
            t = empty(*a, **k)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, "empty", poisoned)
        model(x, skip_first=True).sum().backward()
        monkeypatch.setattr(torch, "empty", empty)
        grad = flat.disk_grad() if grads_on_disk else flat.shard.grad
        paging.load([grad])
        o, n = flat.slots[2]
        assert grad[o:o + n].abs().sum() > 0
        o, n = flat.slots[0]  # the block's first Linear's weight: not used in this forward
        assert not grad[o:o + n].any()
        assert not grad[sum(s[1] for s in flat.slots):].any()  # the padding
        paging.evict([grad])
        opt.close()


def test_an_eviction_by_someone_else_keeps_a_live_units_pages():
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        ref, model = _pair("nvme", tmp)
        root = _flat(model, 0)
        seen = []

        def peek(_m, _args):  # the root is live through the forward: reading its shard evicts
            seen.append(root.shard_values().clone())

        h = model.blocks[2].register_forward_pre_hook(peek)
        x = torch.randn(5, 33)
        out = model(x)
        h.remove()
        assert torch.equal(out, ref(x))
        assert seen and seen[0].abs().sum() > 0
        out.sum().backward()
        assert runtime_of(model).tier.resident_bytes() == 0  # released after the backward: held no more
        del model


def test_an_inplace_op_between_forward_and_backward_raises_as_in_torch():
    _, model = _pair("none", None)
    loss = model(torch.randn(3, 33)).square().sum()
    with torch.no_grad():
        _flat(model, 1).shard.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("offload_params", ["none", "nvme"])
def test_a_backward_interrupted_then_zero_grad_leaves_no_partial_grads(offload_params):
    """A Ctrl-C in the middle of a backward (here a KeyboardInterrupt from a grad hook, after
    the head's grads were accumulated into its views), zero_grad() and the step again: as in
    torch, nothing of the interrupted backward reaches the step."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        ref, model = _pair(offload_params, tmp)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        opt = offload.AdamW(model.parameters(), lr=1e-2, offload="nvme" if offload_params == "nvme" else "none",
                            swap_dir=tmp if offload_params == "nvme" else None)

        def interrupt(_m, _args, out):
            def raise_(_g):
                raise KeyboardInterrupt

            out.register_hook(raise_)

        g = torch.Generator().manual_seed(1)
        for step in range(3):
            x = torch.randn(7, 33, generator=g)
            if step == 1:
                h = model.blocks[1].register_forward_hook(interrupt)
                loss = model(x).square().mean()
                h.remove()
                with pytest.raises(KeyboardInterrupt):
                    loss.backward()
                opt.zero_grad()
            for m, o in ((ref, opt_ref), (model, opt)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
        got = gathered_params(model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6)
        opt.close()
        del model


@pytest.mark.parametrize("how", ["two_forwards", "no_grad_forward_between", "retain_graph"])
def test_a_backward_whose_units_were_spent_raises_instead_of_losing_grads(how):
    """[Note: one backward per forward] in offload/shard/hooks.py: these backwards found the
    units' uses spent and left their grads unreduced (a step then differed from torch's by
    ~3e-2, silently); they raise, nothing changes, and training goes on as torch's."""
    ref, model = _pair("none", None)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(7, 33, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean()
    if how == "retain_graph":
        loss.backward(retain_graph=True)
    elif how == "two_forwards":
        loss = loss + model(x).square().mean()
    else:
        with torch.no_grad():
            model(x)
    with pytest.raises(RuntimeError, match="before this backward" if how != "retain_graph" else "retain_graph"):
        loss.backward()
    opt.zero_grad()
    for m, o in ((ref, opt_ref), (model, opt)):
        m(x).square().mean().backward()
        o.step()
    got = gathered_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6)
