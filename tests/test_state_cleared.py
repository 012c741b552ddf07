"""A param whose state the user cleared between steps (``del opt.state[p]``,
``opt.state[p].clear()``, a new ``opt.state``) starts afresh, as in torch: zero moments
(Adagrad: its sum at initial_accumulator_value) and step 1, not the moments the store kept
outside ``opt.state`` (the flat store's buffers, the swap files). Each case runs the same
inputs through ``torch.optim.X`` and ``offload.X`` and compares the params element by element;
sizes 17 and 4097 break the SIMD tails."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import _torch_compat
import offload
from test_torch_parity_edges import HP, TORCH, _grads, _pair, store  # noqa: F401 (the fixture)

STORES = ["none", "cpu", "nvme", "stage1", "stage1-nvme"]


def _clear(opt, params, how):
    if how == "del":
        del opt.state[params[1]]
    elif how == "clear":
        opt.state[params[1]].clear()
    else:  # a new opt.state: every param starts afresh
        opt.state = defaultdict(dict)


@pytest.mark.parametrize("how", ["del", "clear", "new"])
@pytest.mark.parametrize("store", STORES, indirect=True)
@pytest.mark.parametrize("name", sorted(TORCH))
def test_a_param_whose_state_was_cleared_starts_afresh(name, store, how):
    if name == "Adagrad" and not _torch_compat.adagrad_steps_a_param_without_sum():
        pytest.skip("torch's Adagrad here (2.6) fails on a param without a 'sum' itself: no reference")
    ours, theirs = _pair()
    opt, ref = getattr(offload, name)(ours, **HP[name], **store), TORCH[name](theirs, **HP[name])
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 2:
            _clear(opt, ours, how)
            _clear(ref, theirs, how)
        _grads(ours, theirs, g)
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    if name != "SGD":  # torch's SGD counts no steps
        assert int(opt.state_dict()["state"][1]["step"]) == int(ref.state[theirs[1]]["step"]) == 3
    opt.close()


@pytest.mark.parametrize("store", ["cpu", "nvme"], indirect=True)
def test_a_param_without_a_grad_keeps_its_moments_until_it_steps_again(store):
    # clearing restarts a param at its next step, as torch's lazy state: one without a grad
    # meanwhile is not stepped, and keeps what the store holds until then
    ours, theirs = _pair()
    opt, ref = offload.Adam(ours, **HP["Adam"], **store), torch.optim.Adam(theirs, **HP["Adam"])
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        if step == 2:
            del opt.state[ours[1]]
            del ref.state[theirs[1]]
        _grads(ours, theirs, g, skip=(1,) if step == 2 else ())
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    opt.close()


@pytest.mark.parametrize("store, state_dtype", [("nvme", "bfloat16"), ("nvme", "int8"), ("stage1-nvme", "int8")],
                         indirect=["store"])
def test_compressed_states_cleared_restart_as_the_host_store_does(store, state_dtype):
    # the host store keeps its (encoded) states in opt.state itself: clearing them is a fresh
    # start there by construction, and the other stores must match it (not the flat store's
    # bf16 states: their stochastic rounding is seeded by the flat offset, the host's by param)
    ours, theirs = _pair()
    hp = dict(HP["AdamW"], state_dtype=state_dtype)
    opt, host = offload.AdamW(ours, **hp, **store), offload.AdamW(theirs, **hp)
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        if step == 2:
            del opt.state[ours[1]]
            del host.state[theirs[1]]
        _grads(ours, theirs, g)
        opt.step()
        host.step()
    # the cleared param (4097 elements, encoded in every store) bit for bit; the host store
    # keeps a param under 4096 elements in fp32 states, the swapped ones encode it too
    assert torch.equal(ours[1].detach(), theirs[1].detach())
    opt.close()


# A clear() between a step and save_checkpoint / a crash: the flat and swapped stores still held
# the cleared moments, which the checkpoint saved with step 0 and a loading optimizer stepped
# on from (offload="nvme", bf16 params in every store), and which resume=True went on from
# when the param was cleared while frozen ([Note: cleared before a save] in state_io.py;
# found by tools/history_fuzz.py).
@pytest.mark.parametrize("store", STORES, indirect=True)
@pytest.mark.parametrize("name", sorted(TORCH))
def test_a_checkpoint_saved_after_a_clear_holds_the_param_afresh(name, store, tmp_path):
    if name == "Adagrad" and not _torch_compat.adagrad_steps_a_param_without_sum():
        pytest.skip("torch's Adagrad here (2.6) fails on a param without a 'sum' itself: no reference")
    ours, theirs = _pair()
    opt, ref = getattr(offload, name)(ours, **HP[name], **store), TORCH[name](theirs, **HP[name])
    g = torch.Generator().manual_seed(7)
    for step in range(4):
        if step == 2:
            opt.state[ours[1]].clear()
            ref.state[theirs[1]].clear()
            opt.save_checkpoint(str(tmp_path / "ck"))
            opt.close()
            (tmp_path / "again").mkdir()
            again = dict(store, swap_dir=str(tmp_path / "again")) if "swap_dir" in store else store
            opt = getattr(offload, name)(ours, **HP[name], **again)
            opt.load_checkpoint(str(tmp_path / "ck"))
        _grads(ours, theirs, g)
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    opt.close()


def _grads_in(dtype, ours, theirs, g, skip=()):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        grad = None if i in skip else torch.randn(a.shape, generator=g).to(dtype)
        a.grad = None if grad is None else grad.clone()
        b.grad = None if grad is None else grad.to(b.dtype)


@pytest.mark.parametrize("kind", ["none", "cpu", "nvme"])
def test_bf16_params_cleared_then_saved_load_as_the_uninterrupted_run(kind, tmp_path):
    def make(ps, sub):
        (tmp_path / sub).mkdir()
        kw = {"offload": "nvme", "swap_dir": str(tmp_path / sub)} if kind == "nvme" else {"offload": kind}
        return offload.Adam(ps, lr=1e-2, **kw)
    ours, twin = ([p.detach().to(torch.bfloat16).requires_grad_() for p in _pair()[0]] for _ in range(2))
    opt, uninterrupted = make(ours, "a"), make(twin, "b")
    g = torch.Generator().manual_seed(9)
    for step in range(4):
        if step == 2:
            opt.state[ours[1]].clear()
            uninterrupted.state[twin[1]].clear()
            opt.save_checkpoint(str(tmp_path / "ck"))
            opt.close()
            opt = make(ours, "c")
            opt.load_checkpoint(str(tmp_path / "ck"))
        _grads_in(torch.bfloat16, ours, twin, g)
        opt.step()
        uninterrupted.step()
        for a, b in zip(ours, twin):
            assert torch.equal(a.detach(), b.detach())
    opt.close()
    uninterrupted.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_param_cleared_while_frozen_is_resumed_afresh(dtype, tmp_path):
    ours, theirs = _pair()
    ours = [p.detach().to(dtype).requires_grad_() for p in ours]
    theirs = [p.detach().float().clone().requires_grad_() for p in ours]
    opt = offload.Adam(ours, **HP["Adam"], offload="nvme", swap_dir=str(tmp_path))
    ref = torch.optim.Adam(theirs, **HP["Adam"])
    g = torch.Generator().manual_seed(11)
    for step in range(5):
        if step == 2:
            opt.state[ours[1]].clear()
            ref.state[theirs[1]].clear()
        _grads_in(dtype, ours, theirs, g, skip=(1,) if step == 2 else ())
        if step == 3:  # a crash after the step that did not reach the cleared param
            opt.close(keep_swap=True)
            opt = offload.Adam(ours, **HP["Adam"], offload="nvme", swap_dir=str(tmp_path), resume=True)
        opt.step()
        ref.step()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach().float(), b.detach(), **tol)
    if dtype == torch.bfloat16:  # the masters within float32 rounding
        torch.testing.assert_close(opt.state[ours[1]]["master"].reshape(-1), theirs[1].detach(), rtol=1e-5, atol=1e-6)
    opt.close()
