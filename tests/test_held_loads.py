"""[Note: loads hold Ctrl-C] (offload/optim/held_loads.py): a Ctrl-C during load_checkpoint
(offload="nvme", bf16 params: the params are rewritten from the loaded masters after the swap
commit) left the later params at their pre-load values beside the checkpoint's states, and
training went on; during load_state_dict it left torch's part loaded and the states not. A
load now holds it until whole, as a step does; a second Ctrl-C leaves the failed state."""
import os
import signal

import pytest
import torch

import offload
from offload.optim import swapped_shards


def _train(opt, ps, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = (p.detach().float() * 0.5 + torch.randn(p.shape, generator=g)).to(torch.bfloat16)
        opt.step()


def _make(d):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4096, dtype=torch.bfloat16)) for _ in range(3)]
    os.makedirs(d)
    return ps, offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=d)


@pytest.fixture
def setup(tmp_path):
    ps, opt = _make(str(tmp_path / "a"))
    _train(opt, ps, 2, 1)
    ck = str(tmp_path / "ck")
    opt.save_checkpoint(ck)
    _train(opt, ps, 2, 2)
    ref_ps, ref = _make(str(tmp_path / "b"))
    ref.load_checkpoint(ck)
    yield ps, opt, ref_ps, ref, ck
    opt.close()
    ref.close()


def _sigint_at_copy(monkeypatch, at):
    orig, calls = swapped_shards.paged_copy, []

    def paged_copy(*a, **k):
        calls.append(1)
        if len(calls) in at:
            os.kill(os.getpid(), signal.SIGINT)
        return orig(*a, **k)
    monkeypatch.setattr(swapped_shards, "paged_copy", paged_copy)


needs_default_sigint = pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                                          reason="needs Python's default SIGINT handler")


def _go_on_equal(opt, ps, ref, ref_ps):
    """The params equal now, and after two more steps of each on the same grads."""
    assert all(torch.equal(a, b) for a, b in zip(ps, ref_ps))
    _train(opt, ps, 2, 3)
    _train(ref, ref_ps, 2, 3)
    assert all(torch.equal(a, b) for a, b in zip(ps, ref_ps))


@needs_default_sigint
def test_a_ctrl_c_during_load_checkpoint_is_held_until_the_params_follow(setup, monkeypatch):
    ps, opt, ref_ps, ref, ck = setup
    _sigint_at_copy(monkeypatch, {2})
    with pytest.raises(KeyboardInterrupt):
        opt.load_checkpoint(ck)
    monkeypatch.undo()
    assert opt.state_dict()["state"][0]["step"].item() == 2
    _go_on_equal(opt, ps, ref, ref_ps)  # every param follows the loaded masters


@needs_default_sigint
def test_a_second_ctrl_c_during_load_checkpoint_leaves_the_failed_state(setup, monkeypatch):
    ps, opt, ref_ps, ref, ck = setup
    _sigint_at_copy(monkeypatch, {2, 3})
    with pytest.raises(KeyboardInterrupt):
        opt.load_checkpoint(ck)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="load_checkpoint"):
        _train(opt, ps, 1, 3)
    opt.load_checkpoint(ck)  # loading again ends it
    _go_on_equal(opt, ps, ref, ref_ps)


@needs_default_sigint
def test_a_ctrl_c_during_load_state_dict_is_held_until_the_load_is_whole(setup, monkeypatch):
    ps, opt, ref_ps, ref, ck = setup
    sd = ref.state_dict()
    with torch.no_grad():
        for p, r in zip(ps, ref_ps):
            p.copy_(r)   # as a resume does: the params of the state_dict's step, then the load
    clean_ps, clean = _make(os.path.join(os.path.dirname(ck), "c"))
    with torch.no_grad():
        for p, r in zip(clean_ps, ref_ps):
            p.copy_(r)
    clean.load_state_dict(sd)
    from offload.optim import state_io
    orig = state_io._import_all

    def import_all(*a, **k):  # the Ctrl-C lands after torch's load, before the states are imported
        os.kill(os.getpid(), signal.SIGINT)
        return orig(*a, **k)
    monkeypatch.setattr(state_io, "_import_all", import_all)
    with pytest.raises(KeyboardInterrupt):
        opt.load_state_dict(sd)
    monkeypatch.undo()
    _go_on_equal(opt, ps, clean, clean_ps)
    clean.close()
