"""A commit whose manifest was renamed into place but whose directory fsync failed (EIO): the
step's error says the swap files hold the previous step, so they must ([Note: a manifest
replaced, not synced] in offload/swap/store.py). Before, the new manifest stayed: a resume
took the failed step as done (bf16 params: silently applied twice once the loop retried it;
fp32 params: the params the error asked for refused), and a retry wrote into the slots that
manifest names. Reference: the same steps with no fault, bit for bit."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch

import offload
from offload.swap import SwapStepError, fsutil
from test_step_failures import HP, _grads, _params  # the same params and grads as the other failed steps


def _opt(params, swap, resume=False):
    return offload.AdamW(params, **HP, offload="nvme", swap_dir=str(swap), sub_group_size=1024,
                         max_host_bytes=1 << 20, resume=resume)


def _train(opt, params, start, stop):
    for s in range(start, stop):
        _grads(params, s)
        opt.step()


def _state(opt, params):
    sd = opt.state_dict()["state"]
    return [p.detach().clone() for p in params], {k: {n: v.clone() for n, v in s.items()} for k, s in sd.items()}


def _assert_same(got, want):
    for p, q in zip(got[0], want[0]):
        assert torch.equal(p, q)
    assert sorted(got[1]) == sorted(want[1])
    for k in want[1]:
        for n in want[1][k]:
            assert torch.equal(got[1][k][n], want[1][k][n]), (k, n)


def _reference(tmp_path, dtype, steps):
    params = _params(dtype)
    (tmp_path / "ref").mkdir()
    opt = _opt(params, tmp_path / "ref")
    _train(opt, params, 0, steps)
    out = _state(opt, params)
    opt.close()
    return out


def _manifest_step(swap):
    (d,) = [e for e in os.listdir(swap) if e.startswith("offload-")]
    return json.load(open(os.path.join(swap, d, "manifest.json")))["step"]


class _DirSyncFails:
    """fsutil.fsync_dir raising EIO on its ``at``-th call under ``root`` (as the kernel says it:
    no file name)."""

    def __init__(self, root, at):
        self.root, self.at, self.calls, self.real = str(root), at, 0, fsutil.fsync_dir

    def __call__(self, path):
        if path.startswith(self.root):
            self.calls += 1
            if self.calls in self.at:
                raise OSError(errno.EIO, "Input/output error")
        return self.real(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("after", ["retry", "resume"])
def test_failed_dir_sync_after_manifest_rename_keeps_the_previous_step(tmp_path, monkeypatch, dtype, after):
    ref = _reference(tmp_path, dtype, 5)
    params = _params(dtype)
    swap = tmp_path / "swap"
    swap.mkdir()
    opt = _opt(params, swap)
    _train(opt, params, 0, 2)
    saved = [p.detach().clone() for p in params]
    monkeypatch.setattr(fsutil, "fsync_dir", _DirSyncFails(swap, {1}))
    _grads(params, 2)
    with pytest.raises(SwapStepError) as e:
        opt.step()
    monkeypatch.undo()
    assert _manifest_step(swap) == 2  # what the error says: a resume reads this
    assert "the swap files still hold step 2" in str(e.value) and e.value.filename.startswith(str(swap))
    assert "manifest.json was replaced, but syncing its directory failed" in str(e.value)
    with torch.no_grad():
        for p, q in zip(params, saved):
            p.copy_(q)
    if after == "retry":
        if dtype == torch.float32:
            opt.clear_failure()  # the params of step 2 are back: checked against the manifest
    else:
        opt.close(keep_swap=True)
        opt = _opt(params, swap, resume=True)
    _train(opt, params, 2, 5)
    _assert_same(_state(opt, params), ref)
    opt.close()


def test_dir_sync_and_the_put_back_failing_refuses_to_write(tmp_path, monkeypatch):
    """The previous manifest cannot be put back (its write fails before its rename): the
    error says the files hold the new step, and the store writes nothing more into its slots."""
    params = _params(torch.bfloat16)
    swap = tmp_path / "swap"
    swap.mkdir()
    opt = _opt(params, swap)
    _train(opt, params, 0, 2)
    real_write = fsutil.write_json_atomic
    calls = []

    def write_once(directory, name, obj):
        calls.append(name)
        if len(calls) > 1:
            raise OSError(errno.EIO, "Input/output error", os.path.join(directory, name))
        return real_write(directory, name, obj)

    monkeypatch.setattr(fsutil, "fsync_dir", _DirSyncFails(swap, {1}))
    monkeypatch.setattr(fsutil, "write_json_atomic", write_once)
    _grads(params, 2)
    with pytest.raises(SwapStepError, match="the swap files hold step 3; this store writes no more"):
        opt.step()
    monkeypatch.undo()
    assert _manifest_step(swap) == 3
    with pytest.raises((RuntimeError, OSError), match="writes no more"):
        opt.clear_failure(accept_params=True)
        _grads(params, 2)
        opt.step()
    opt.close(keep_swap=True)
    opt = _opt(params, swap, resume=True)
    assert all(int(opt.state[p]["step"]) == 3 for p in params)
    opt.close()


def test_a_put_back_failing_after_a_commit_that_does_not_advance_names_no_later_step(tmp_path, monkeypatch):
    """load_state_dict's and the param cache's commits keep the step number (advance=False):
    the error said the files hold the step after, which no manifest there names."""
    from offload.swap import SwapLayout, SwapStore

    st = SwapStore(str(tmp_path), SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
    st.commit({}, {"k": 1})
    real_write, calls = fsutil.write_json_atomic, []

    def write_once(directory, name, obj):
        calls.append(name)
        if len(calls) > 1:
            raise OSError(errno.EIO, "Input/output error", os.path.join(directory, name))
        return real_write(directory, name, obj)

    monkeypatch.setattr(fsutil, "fsync_dir", _DirSyncFails(tmp_path, {1}))
    monkeypatch.setattr(fsutil, "write_json_atomic", write_once)
    with pytest.raises(fsutil.ReplacedNotDurable):
        st.commit({0: None}, {"k": 2}, advance=False)
    monkeypatch.undo()
    assert _manifest_step(tmp_path) == 1
    assert "the swap files hold the failed commit's states (step 1 too)" in st.held()
    assert "step 2" not in st.held()
    st.close()
