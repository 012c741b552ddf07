"""What a disk that refuses refuses, on real file systems where mounting is permitted (CI runs
as root; elsewhere these skip): found by the forty-fourth session's probes on loop-mounted
ext4 file systems, full and gone read-only (ext4's errors=remount-ro).

- ``load_checkpoint`` from a directory it cannot write (a read-only mount, another user's
  checkpoint): with ``offload="cpu"`` its I/O set-up probed O_DIRECT by creating a file there,
  and failed with EROFS; a load needs no write access (io/files.py probe_direct).
- a swap directory with room for both slots but not for the first manifest and its reserve:
  the manifest's own write failed, naming a temporary file that no longer existed; now the
  construction's check counts them (swap/reserve.py RESERVE_ROOM).
- ``close()`` on a disk that refuses the removal: a bare "Read-only file system: 'slot0.bin'";
  now the whole path, and whether the directory still holds its step for ``resume=True``.
- a disk that frees exactly the reserve's room each step said "the file system is full" at
  every step; once, until a manifest fits without the reserve again.
"""
from __future__ import annotations

import errno
import logging
import os
import subprocess

import pytest
import torch

import _internals as internals
import offload
from offload.io import files as io_files
from offload.swap import fsutil
from offload.swap import SwapStepError, readonly
from offload.swap.reserve import RESERVE_ROOM
from test_swap_util import swapped_state

HP = dict(lr=1e-2, weight_decay=0.01)


def _mount(target, *args):
    target.mkdir(exist_ok=True)
    r = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mounting is not permitted here: mount {' '.join(args)}: {r.stderr.strip()}")
    return target


def _remount(target, mode):
    r = subprocess.run(["mount", "-o", f"remount,{mode}", str(target)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _umount(target):
    subprocess.run(["umount", str(target)], capture_output=True)


def _train(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5)).to(dtype)


def _states(model, opt):
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("loader", ["cpu", "none", "nvme"])
def test_a_checkpoint_on_a_read_only_mount_loads(tmp_path, monkeypatch, dtype, loader):
    mnt = _mount(tmp_path / "ro", "-t", "tmpfs", "-o", "size=8m", "tmpfs")
    try:
        model = _model(dtype)
        opt = offload.AdamW(model.parameters(), offload="cpu", **HP)
        _train(model, opt, 2)
        opt.save_checkpoint(str(mnt / "ckpt"))
        saved = _states(model, opt)
        opt.close()
        _remount(mnt, "ro")
        # a fresh process has probed nothing yet (within one, the save's probe was cached)
        monkeypatch.setattr(io_files, "_probe_cache", {})
        model2 = _model(dtype)
        kw = dict(offload="nvme", swap_dir=str(tmp_path)) if loader == "nvme" else dict(offload=loader)
        opt2 = offload.AdamW(model2.parameters(), **HP, **kw)
        opt2.load_checkpoint(str(mnt / "ckpt"))
        for want, got in zip(saved, _states(model2, opt2)):
            assert set(want) <= set(got)
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=0)
        opt2.close()
        # a save into it is still refused, before anything is written
        opt3 = offload.AdamW(model2.parameters(), offload="cpu", **HP)
        with pytest.raises(OSError) as e:
            opt3.save_checkpoint(str(mnt / "ckpt2"))
        assert e.value.errno == errno.EROFS
        opt3.close()
    finally:
        _umount(mnt)


def test_probe_direct_on_a_read_only_directory(tmp_path, monkeypatch):
    mnt = _mount(tmp_path / "ro", "-t", "tmpfs", "-o", "size=1m", "tmpfs")
    try:
        (mnt / "held").write_bytes(b"x" * 4096)
        ok_rw, _ = io_files.probe_direct(mnt, refresh=True)
        _remount(mnt, "ro")
        assert io_files.probe_direct(mnt, refresh=True)[0] == ok_rw  # probed on the file it holds
        _remount(mnt, "rw")
        os.remove(mnt / "held")
        _remount(mnt, "ro")
        with pytest.raises(OSError) as e:  # nothing to probe on: the directory's own error
            io_files.probe_direct(mnt, refresh=True)
        assert e.value.errno == errno.EROFS and e.value.filename == str(mnt)
    finally:
        _umount(mnt)


def _small_ext4(tmp_path, mib):
    img = tmp_path / "img"
    with open(img, "wb") as f:
        f.truncate(mib << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr[:200]}")
    return _mount(tmp_path / "mnt", "-o", "loop", str(img))


def test_room_for_the_slots_but_not_the_manifest_is_refused_up_front(tmp_path):
    mnt = _small_ext4(tmp_path, 16)
    try:
        swap = mnt / "swap"
        swap.mkdir()
        free = fsutil.free_bytes(str(swap))
        # one param: two states of 4 bytes per element in each of two slots, rounded to 1024
        # elements; the slots leave half the reserve's room free
        n = int(free - RESERVE_ROOM // 2) // 16 // 1024 * 1024
        slot = 8 * n
        assert 2 * slot < free < 2 * slot + RESERVE_ROOM
        with pytest.raises(OSError) as e:
            swapped_state(swap, [torch.randn(n)], sub_group_size=None)
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(swap / "offload-run.rank0")
        assert f"swap files need {2 * slot + RESERVE_ROOM} bytes" in str(e.value)
        assert "for the manifest" in str(e.value)
        assert os.listdir(swap) == []
        # with the room, it is built and steps
        st = swapped_state(swap, [torch.randn(n - 64 * 1024)], sub_group_size=None)
        st.close()
        assert os.listdir(swap) == []
    finally:
        _umount(mnt)


@pytest.mark.parametrize("fail_at", [0, 1], ids=["first_file", "second_file"])
def test_close_on_a_disk_that_refuses_the_removal(tmp_path, monkeypatch, fail_at):
    model = _model(torch.float32)
    opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), max_host_bytes="1MiB", **HP)
    _train(model, opt, 2)
    path = internals.swap(opt).swap_path
    real_unlink, calls = os.unlink, []

    def unlink(name, *args, dir_fd=None, **kw):
        if dir_fd is not None:
            calls.append(name)
            if len(calls) > fail_at:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), name)
        return real_unlink(name, *args, dir_fd=dir_fd, **kw)

    monkeypatch.setattr(fsutil.os, "unlink", unlink)
    with pytest.raises(OSError) as e:
        opt.close()
    monkeypatch.setattr(fsutil.os, "unlink", real_unlink)
    msg = str(e.value)
    assert e.value.errno == errno.EROFS and e.value.filename == path
    assert f"could not remove the swap directory: Read-only file system ({calls[-1]})" in msg
    assert f"`offload clean {tmp_path}` removes it" in msg
    if fail_at == 0:
        assert "it is kept whole at step 2, resumable with resume=True" in msg
        # and it is: the next run goes on from it as if nothing happened
        ref = _model(torch.float32)
        ref_opt = offload.AdamW(ref.parameters(), offload="cpu", **HP)
        _train(ref, ref_opt, 2)
        resumed = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), max_host_bytes="1MiB",
                                resume=True, **HP)
        for want, got in zip(_states(ref, ref_opt), _states(model, resumed)):
            for k in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
        resumed.close()
    else:
        assert "part of its files are gone: nothing to resume from it" in msg
    opt.close()  # closed already: nothing more to say
    from offload.swap.cleanup import clean_dir
    clean_dir(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_disk_full_at_every_commit_says_so_once(tmp_path, monkeypatch, caplog):
    # ext4 without reserved clusters frees exactly the reserve's room at each commit: the
    # manifest went into the reserve and the reserve was made again, step after step
    model = _model(torch.float32)
    opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), max_host_bytes="1MiB", **HP)
    _train(model, opt, 1)
    real = fsutil.write_json_atomic
    full = {"on": True}

    def write_json_atomic(directory, name, obj, *a, **kw):
        if full["on"] and name == "manifest.json" and os.path.exists(os.path.join(directory, "reserve.bin")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(directory, name))
        return real(directory, name, obj, *a, **kw)

    monkeypatch.setattr(fsutil, "write_json_atomic", write_json_atomic)
    with caplog.at_level(logging.WARNING):
        _train(model, opt, 4, seed=1)
        assert caplog.text.count("the file system is full") == 1
        full["on"] = False
        _train(model, opt, 1, seed=2)  # a manifest fits without the reserve: the disk has room again
        full["on"] = True
        _train(model, opt, 2, seed=3)
        assert caplog.text.count("the file system is full") == 2
    opt.close()
    assert os.listdir(tmp_path) == []


def test_a_step_on_a_file_system_gone_read_only_says_what_to_do(tmp_path, monkeypatch):
    # ext4 aborting its journal (errors=remount-ro) turns read-only without a remount on
    # recent kernels ("emergency_ro": statvfs does not show it), and the step failed with a
    # bare "Read-only file system": the EROFS now says that the swap files keep their step and
    # that the file system needs repair before resume=True (forty-fifth session, a loop ext4)
    model = _model(torch.float32)
    opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), max_host_bytes="1MiB", **HP)
    _train(model, opt, 2)
    store = internals.swap(opt).store

    def commit(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), store.path)
    monkeypatch.setattr(store, "commit", commit)
    with pytest.raises(SwapStepError) as e:
        _train(model, opt, 1, seed=1)
    assert e.value.errno == errno.EROFS
    assert "the swap files still hold step 2 [the file system of" in str(e.value)
    assert "is read-only now" in str(e.value) and "fsck" in str(e.value) and "before resume=True" in str(e.value)
    monkeypatch.undo()
    opt.close(keep_swap=True)


def test_the_read_only_hint_takes_statvfs_or_the_errno(tmp_path, monkeypatch):
    assert readonly.read_only_now(str(tmp_path), errno.EIO) == ""
    assert "is read-only now" in readonly.read_only_now(str(tmp_path), errno.EROFS)

    class ReadOnly:
        f_flag = os.ST_RDONLY
    monkeypatch.setattr(readonly.os, "statvfs", lambda path: ReadOnly())
    assert "is read-only now" in readonly.read_only_now(str(tmp_path), errno.EIO)
