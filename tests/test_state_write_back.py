"""An in-place change of a state read from the store (``offload="nvme"``, int8 states decoded)
is written back, as torch's state would change; a stale copy, one in another thread or a
forked child, or one of a closed optimizer refuses it and changes nothing ([Note: an in-place
change of a read copy is written back] in offload/optim/write_back.py)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import offload

STALE = "stale: read it again"


def _pair(tmp_path, dtype="float32", kind="nvme", state_dtype="float32", n=2):
    """(ours, torch's AdamW or None, our params, torch's params) after one step on the same grads."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(700, generator=g) for _ in range(n)]  # 700: more than one int8 block
    ours = [torch.nn.Parameter(t.clone().to(getattr(torch, dtype))) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    tmp_path.mkdir(exist_ok=True)
    kw = {"swap_dir": str(tmp_path)} if kind == "nvme" else {}
    opt = offload.AdamW(ours, lr=1e-2, offload=kind, state_dtype=state_dtype, **kw)
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    _step([(opt, ours), (ref, theirs)], 1)
    return opt, ref, ours, theirs


def _step(pairs, seed):
    for opt, params in pairs:
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


CHANGES = {
    "mul_": lambda t: t.mul_(0.5),
    "zero_": lambda t: t.zero_(),
    "copy_": lambda t: t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) / 1000),
    "data.add_": lambda t: t.data.add_(1.0),
    "detach.zero_": lambda t: t.detach().zero_(),
    "view.fill_": lambda t: t.view(-1)[:5].fill_(1.0),
    "imul": lambda t: t.__imul__(2.0),
    "setitem": lambda t: t.__setitem__(slice(3, 9), 0.25),
    "out=": lambda t: torch.mul(t, 2.0, out=t),
    "relu inplace": lambda t: torch.nn.functional.relu(t, inplace=True),
    "twice": lambda t: (t.mul_(0.5), t.add_(1.0)),  # the first write-back keeps the copy current
    "foreach": lambda t: torch._foreach_mul_([t], 3.0),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_an_in_place_change_lands_as_on_torchs_state(tmp_path, change):
    opt, ref, ours, theirs = _pair(tmp_path)
    try:
        for key in ("exp_avg", "exp_avg_sq"):
            CHANGES[change](opt.state[ours[0]][key])
            CHANGES[change](ref.state[theirs[0]][key])
            torch.testing.assert_close(opt.state[ours[0]][key], ref.state[theirs[0]][key], rtol=0, atol=0)
        for s in (2, 3):
            _step([(opt, ours), (ref, theirs)], s)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[a][key], ref.state[b][key], rtol=0, atol=1e-6)
    finally:
        opt.close()


# compressed states: a write-back stores what assigning the changed copy stores, bit for bit
COMPRESSED = [("bfloat16", "nvme", "bfloat16"), ("bfloat16", "cpu", "int8"), ("float32", "nvme", "int8")]


@pytest.mark.parametrize("dtype,kind,state_dtype", COMPRESSED, ids=["-".join(c) for c in COMPRESSED])
def test_a_compressed_state_is_written_back_as_assigning_it_is(tmp_path, dtype, kind, state_dtype):
    opt, _, ours, _ = _pair(tmp_path / "a", dtype, kind, state_dtype)
    opt2, _, ours2, _ = _pair(tmp_path / "b", dtype, kind, state_dtype)
    try:
        for key in ("exp_avg", "exp_avg_sq"):
            got = opt.state[ours[0]][key]
            bump = 3 if got.dtype == torch.uint8 else 0.5  # packed int8 blocks: change the bytes
            got.view(-1)[:40].add_(bump)
            opt2.state[ours2[0]][key] = opt2.state[ours2[0]][key].clone().view(-1).index_add_(
                0, torch.arange(40), torch.full((40,), bump, dtype=got.dtype)).view(got.shape)
            assert torch.equal(opt.state[ours[0]][key], opt2.state[ours2[0]][key])
        _step([(opt, ours), (opt2, ours2)], 2)
        assert all(torch.equal(a, b) for a, b in zip(ours, ours2))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[ours[0]][key], opt2.state[ours2[0]][key])
    finally:
        opt.close()
        opt2.close()


def _assign_other(opt, p, key, a):
    opt.state[p][key] = torch.ones_like(a)


def _write_back_other(opt, p, key, a):
    opt.state[p][key].mul_(2.0)


def _load_same_step(opt, p, key, a):
    sd = opt.state_dict()
    sd["state"][0][key] = torch.full_like(sd["state"][0][key], 0.125)
    opt.load_state_dict(sd)  # the same step count, other states


def _checkpoint(opt, p, key, a):
    d = os.path.join(opt.config.swap_dir, "ckpt")
    opt.save_checkpoint(d)
    opt.load_checkpoint(d)


def _step_again(opt, p, key, a):
    p.grad = torch.ones_like(p)
    opt.step()


STALERS = {"assign": _assign_other, "another copy": _write_back_other, "load_state_dict": _load_same_step,
           "load_checkpoint": _checkpoint, "step": _step_again}


@pytest.mark.parametrize("stale", list(STALERS))
def test_a_stale_copy_refuses_and_changes_nothing(tmp_path, stale):
    opt, _, ours, _ = _pair(tmp_path)
    try:
        p = ours[0]
        a = opt.state[p]["exp_avg"]
        other = opt.state[ours[1]]["exp_avg"]  # another param's copy stays current (but a step)
        STALERS[stale](opt, p, "exp_avg", a)
        now, a_was = opt.state[p]["exp_avg"].clone(), a.clone()
        # (a load gives p a new entry: the old one lists nothing, stale either way)
        why = STALE if stale in ("assign", "another copy", "step") else f"{STALE}|no longer listed"
        with pytest.raises(RuntimeError, match=why):
            a.mul_(0.5)
        with pytest.raises(RuntimeError, match=why):
            a.view(-1)[:3].zero_()
        assert torch.equal(a, a_was)  # not even the copy changed
        assert torch.equal(opt.state[p]["exp_avg"], now)
        if stale in ("assign", "another copy"):
            other.mul_(0.5)  # (a versions per param and state: p's assignment leaves it current)
        fresh = opt.state[p]["exp_avg"]
        fresh.mul_(0.5)  # read again: it lands
        assert torch.equal(opt.state[p]["exp_avg"], now * 0.5)
    finally:
        opt.close()


def test_a_failed_step_makes_copies_stale(tmp_path, monkeypatch):
    opt, _, ours, _ = _pair(tmp_path)
    try:
        a = opt.state[ours[0]]["exp_avg"]
        was = opt.state[ours[0]]["exp_avg"].clone()

        def fail(batches):
            raise OSError(5, "injected")
        monkeypatch.setattr(opt._store, "step", fail)
        with pytest.raises(OSError):
            _step([(opt, ours)], 2)
        monkeypatch.undo()
        opt.clear_failure(accept_params=True)
        with pytest.raises(RuntimeError, match=STALE):
            a.zero_()
        assert torch.equal(opt.state[ours[0]]["exp_avg"], was)
    finally:
        opt.close()


def test_a_cleared_entry_or_closed_optimizer_refuses(tmp_path):
    opt, _, ours, _ = _pair(tmp_path)
    a, b = opt.state[ours[0]]["exp_avg"], opt.state[ours[1]]["exp_avg"]
    opt.state[ours[0]].clear()  # torch: a is no longer p's state
    with pytest.raises(RuntimeError, match="no longer listed"):
        a.zero_()
    opt.close()
    with pytest.raises(RuntimeError, match="no longer listed"):
        b.zero_()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # SwappedState; the flat store's swap files
def test_a_copy_from_before_a_resume_refuses(tmp_path, dtype):
    opt, _, ours, _ = _pair(tmp_path, dtype)
    a = opt.state[ours[0]]["exp_avg"]
    was = a.clone()
    opt.close(keep_swap=True)
    opt2 = offload.AdamW(ours, lr=1e-2, offload="nvme", swap_dir=str(tmp_path), resume=True)
    try:
        with pytest.raises(RuntimeError, match="no longer listed"):
            a.zero_()
        _step([(opt2, ours)], 2)  # (attaches opt2's entries)
        a2 = opt2.state[ours[0]]["exp_avg"]
        with pytest.raises(RuntimeError, match="no longer listed"):
            a.zero_()
        assert torch.equal(opt2.state[ours[0]]["exp_avg"], a2) and torch.equal(a, was)
    finally:
        opt2.close()


def test_a_copy_changed_in_another_thread_refuses(tmp_path):
    opt, _, ours, _ = _pair(tmp_path)
    try:
        a = opt.state[ours[0]]["exp_avg"]
        was = a.clone()
        errors = []

        def change():
            try:
                a.zero_()
            except RuntimeError as exc:
                errors.append(str(exc))
        t = threading.Thread(target=change)
        t.start()
        t.join()
        assert len(errors) == 1 and "another thread" in errors[0]
        assert torch.equal(a, was) and torch.equal(opt.state[ours[0]]["exp_avg"], was)
    finally:
        opt.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
@pytest.mark.parametrize("read_in", ["parent", "child"])
def test_a_forked_child_refuses_to_write_the_parents_files(tmp_path, read_in):
    # read in the child: the flat store's int8 states in RAM (a swap read in a forked child
    # crashes: the io engine's ring is the parent's)
    opt, _, ours, _ = _pair(tmp_path, *(() if read_in == "parent" else ("bfloat16", "cpu", "int8")))
    try:
        was = opt.state[ours[0]]["exp_avg"].clone()
        a = opt.state[ours[0]]["exp_avg"]
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if refused with the fork named
            code = 1
            try:
                (a if read_in == "parent" else opt.state[ours[0]]["exp_avg"]).zero_()
            except RuntimeError as exc:
                code = 0 if "forked" in str(exc) else 2
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert torch.equal(opt.state[ours[0]]["exp_avg"], was)
        a.zero_()  # the parent's own copy is still current
        assert torch.equal(opt.state[ours[0]]["exp_avg"], torch.zeros_like(was))
    finally:
        opt.close()


def test_one_op_over_two_params_states_writes_both_back(tmp_path):
    opt, ref, ours, theirs = _pair(tmp_path)
    try:
        torch._foreach_mul_([opt.state[p]["exp_avg"] for p in ours], 0.5)  # as torch's foreach code
        torch._foreach_mul_([ref.state[p]["exp_avg"] for p in theirs], 0.5)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(opt.state[a]["exp_avg"], ref.state[b]["exp_avg"], rtol=0, atol=0)
        a, a2 = opt.state[ours[0]]["exp_avg"], opt.state[ours[0]]["exp_avg"]
        was = a.clone()
        with pytest.raises(RuntimeError, match="two copies of one state"):
            torch._foreach_zero_([a, a2])  # (the second write-back would undo the first)
        assert torch.equal(a, was) and torch.equal(opt.state[ours[0]]["exp_avg"], was)
    finally:
        opt.close()
