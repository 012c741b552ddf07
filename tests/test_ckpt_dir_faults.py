"""A checkpoint directory on a failing disk: the pid note written into the lock, and the
directory fsync after the renames, failing with EIO. Each raises naming its path; before, the
lock note's error named nothing and left the flock held, so every later save or load of this
process there was refused as "in use by another process"."""
from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.nn as nn

import offload
from offload.swap.ckpt_dir import CKPT_LOCK


def _opt(tmp_path):
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, generator=g)) for n in (3000, 7, 1)]
    (tmp_path / "swap").mkdir()
    opt = offload.AdamW(params, lr=1e-2, offload="nvme", swap_dir=str(tmp_path / "swap"), sub_group_size=1024,
                        max_host_bytes=1 << 20)
    for s in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def _fails_once(monkeypatch, name, hits, at=1):
    """os.<name>(fd, ...) raising EIO once, on the ``at``-th call for which ``hits(path)``."""
    real, seen = getattr(os, name), [0]

    def call(fd, *a):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if hits(path, fd):
            seen[0] += 1
            if seen[0] == at:
                raise OSError(errno.EIO, "Input/output error")
        return real(fd, *a)

    monkeypatch.setattr(os, name, call)


def _states(opt):
    return {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}


def test_lock_note_failing_releases_the_lock(tmp_path, monkeypatch):
    params, opt = _opt(tmp_path)
    ck = tmp_path / "ckpt"
    _fails_once(monkeypatch, "pwrite", lambda path, fd: path.endswith(CKPT_LOCK))
    with pytest.raises(OSError) as e:
        opt.save_checkpoint(str(ck))
    monkeypatch.undo()
    want = _states(opt)
    opt.save_checkpoint(str(ck))  # not "in use by another process": the lock was let go
    assert e.value.errno == errno.EIO and e.value.filename == str(ck / "rank0" / CKPT_LOCK)
    opt.load_checkpoint(str(ck))
    got = _states(opt)
    assert all(torch.equal(got[k][n], want[k][n]) for k in want for n in want[k])
    opt.close()


def test_directory_sync_failing_names_the_directory_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    params, opt = _opt(tmp_path)
    ck = tmp_path / "ckpt"
    opt.save_checkpoint(str(ck))
    want = _states(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # (the 2nd directory sync of a save: after its data files' renames)
    _fails_once(monkeypatch, "fsync", lambda path, fd: path == str(ck / "rank0"), at=2)
    with pytest.raises(OSError) as e:
        opt.save_checkpoint(str(ck))
    monkeypatch.undo()
    assert e.value.errno == errno.EIO and e.value.filename == str(ck / "rank0")
    assert "syncing the directory failed" in str(e.value)
    opt.load_checkpoint(str(ck))  # the previous checkpoint, whole
    got = _states(opt)
    assert all(torch.equal(got[k][n], want[k][n]) for k in want for n in want[k])
    opt.close()


@pytest.mark.parametrize("previous", [True, False])
def test_manifest_and_its_put_back_both_unsynced_keep_the_previous_checkpoint(tmp_path, monkeypatch, previous):
    # the manifest's directory sync fails (the new manifest is in place), then so does the sync
    # after the previous one is put back (or, on a first save, the new one removed): that is in
    # place too, so the directory holds the previous checkpoint, or none (it said "holds the new
    # checkpoint" and removed nothing)
    params, opt = _opt(tmp_path)
    ck = tmp_path / "ckpt"
    if previous:
        opt.save_checkpoint(str(ck))
    want = _states(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    real, seen = os.fsync, [0]

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(ck / "rank0"):
            seen[0] += 1
            if seen[0] in (3, 4):  # the new manifest's directory sync, then the put-back's
                raise OSError(errno.EIO, "Input/output error")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as e:
        opt.save_checkpoint(str(ck))
    monkeypatch.undo()
    assert seen[0] >= 4, seen
    assert "holds the new checkpoint" not in str(e.value), e.value
    newer = _states(opt)
    if previous:
        opt.load_checkpoint(str(ck))  # the previous checkpoint, whole
        got = _states(opt)
        assert all(torch.equal(got[k][n], want[k][n]) for k in want for n in want[k])
    else:
        with pytest.raises(FileNotFoundError):
            opt.load_checkpoint(str(ck))
    opt.load_state_dict({"state": newer, "param_groups": opt.state_dict()["param_groups"]})
    opt.save_checkpoint(str(ck))  # a healthy disk again: the next save removes what the failed one left
    names = sorted(os.listdir(ck / "rank0"))
    opt.load_checkpoint(str(ck))
    got = _states(opt)
    assert all(torch.equal(got[k][n], newer[k][n]) for k in newer for n in newer[k])
    assert not [n for n in names if "tmp" in n or "pending" in n], names
    opt.close()
