"""Faults: injected EIO and short transfers, a flipped bit, ENOSPC on a small file system,
and kill -9 of a process in the middle of a step, then resume."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import pytest
import torch

from offload.swap import SwapStepError
from offload.swap.reserve import RESERVE_ROOM
from test_swap_util import SIZES, SPLIT, FaultyEngine, Reference, batches_for, swapped_state, run_python, threads_engine




def _moments(st, params):
    return [st.read_state(p) for p in params]


def _same(a, b):
    return all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.mark.parametrize("op,mode,fail_at", [("read", "eio", 4), ("write", "eio", 2), ("read", "short", 3),
                                             ("write", "short", 7)])
def test_io_error_aborts_step_without_applying_it(tmp_path, op, mode, fail_at):
    inner = threads_engine()
    faulty = FaultyEngine(inner, op=op, fail_at=0, mode=mode)
    params = [torch.randn(n) for n in SIZES]
    ref = Reference(params)
    st = swapped_state(tmp_path, params, io_engine=faulty)
    steps = [0] * len(params)
    for s in range(2):
        st.step(batches_for(params, steps, s, SPLIT))
        ref.step(s, SPLIT)
    before = _moments(st, params)
    saved = [p.clone() for p in params]
    faulty.arm(fail_at)
    with pytest.raises(SwapStepError) as e:
        st.step(batches_for(params, list(steps), 2, SPLIT))
    msg = str(e.value)
    assert "the swap files still hold step 2" in msg and "restore them" in msg
    assert ("injected" in msg) if mode == "eio" else (f"short {op}" in msg)
    assert e.value.filename and e.value.filename.startswith(st.swap_path)
    assert st.store.step == 2
    assert _same(_moments(st, params), before)  # no partial step in the swap state
    assert [st.step_of(p) for p in params] == steps
    with pytest.raises(RuntimeError, match="restore them"):
        st.step(batches_for(params, list(steps), 2, SPLIT))
    with pytest.raises(ValueError, match="not those of step 2"):
        if any(not torch.equal(p, q) for p, q in zip(params, saved)):
            st.clear_failure()
        else:  # the failure came before any param changed
            raise ValueError("not those of step 2 (nothing changed)")
    for p, q in zip(params, saved):
        p.copy_(q)
    st.clear_failure()
    for s in range(2, 4):
        st.step(batches_for(params, steps, s, SPLIT))
        ref.step(s, SPLIT)
    assert all(torch.equal(p, q) for p, q in zip(params, ref.params))
    assert _same(_moments(st, params), list(zip(ref.m, ref.v)))
    st.close()
    inner.close()


def test_flipped_bit_is_detected_with_verify(tmp_path):
    params = [torch.randn(n) for n in SIZES]
    st = swapped_state(tmp_path, params, verify=True)
    steps = [0] * len(params)
    for s in range(2):
        st.step(batches_for(params, steps, s, SPLIT))
    lay = st.layout
    path = st.store.read_slot_file(1)
    off = lay.group_offset(1) + lay.state_bytes(1) + 100  # exp_avg_sq of sub-group 1, block 0
    fd = os.open(path, os.O_RDWR)
    b = os.pread(fd, 1, off)
    os.pwrite(fd, bytes([b[0] ^ 0x04]), off)
    os.close(fd)
    with pytest.raises(OSError) as e:
        st.read_state(params[2])  # param 2 spans sub-groups 0..4
    assert e.value.filename == path
    assert "checksum mismatch in block 0" in str(e.value) and "exp_avg_sq of sub-group 1" in str(e.value)
    with pytest.raises(SwapStepError, match="checksum mismatch in block 0") as e:
        st.step(batches_for(params, steps, 3, SPLIT))  # param 2 (all of sub-group 1) has a grad in step 3
    assert e.value.filename == path
    st.close()


def _mount_small_ext4(tmp_path, mib):
    img, mnt = tmp_path / "img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(mib << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.decode()[:200]}")
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image here: {r.stderr.decode()[:200]}")
    return mnt


def test_enospc_names_directory_and_bytes(tmp_path):
    mnt = _mount_small_ext4(tmp_path, 16)
    try:
        swap, ckpt = mnt / "swap", mnt / "ckpt"
        swap.mkdir()
        st0 = os.statvfs(mnt)
        free = st0.f_bavail * st0.f_frsize
        # too big for two slots
        with pytest.raises(OSError) as e:
            swapped_state(swap, [torch.randn(free // 8)], sub_group_size=None, max_host_bytes=1 << 20)
        assert e.value.errno == 28 and e.value.filename == str(swap / "offload-run.rank0")
        slot = 2 * 4 * (-(-(free // 8) // 1024) * 1024)  # exp_avg and exp_avg_sq of the one param
        assert f"swap files need {2 * slot + RESERVE_ROOM} bytes" in str(e.value)
        assert f"two slots of {slot} and {RESERVE_ROOM} for the manifest" in str(e.value)
        assert os.listdir(swap) == []
        # room for both slots and one checkpoint, not two
        n = free // 28 // 1024 * 1024
        params = [torch.randn(n)]
        st = swapped_state(swap, params, sub_group_size=None, max_host_bytes=1 << 20)
        steps = [0]
        st.step(batches_for(params, steps, 0, 1))
        st.save_checkpoint(str(ckpt))
        first = _moments(st, params)
        st.step(batches_for(params, steps, 1, 1))
        second = _moments(st, params)
        with pytest.raises(OSError) as e:
            st.save_checkpoint(str(ckpt))
        assert e.value.errno == 28 and e.value.filename == str(ckpt / "rank0")  # the one format: DIR/rank<r>/
        assert f"needs {2 * 4 * n} bytes" in str(e.value) and "previous checkpoint is untouched" in str(e.value)
        assert _same(_moments(st, params), second)  # the swap state is still readable
        st.load_checkpoint(str(ckpt))  # and so is the previous checkpoint
        assert _same(_moments(st, params), first)
        st.close()
    finally:
        subprocess.run(["umount", str(mnt)])


_CHILD = r"""
import os, sys, time, torch
from test_swap_util import SlowEngine, batches_for, threads_engine
from offload.optim.swapped_state import SwappedState
swap, out, kill_step, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
SIZES, SPLIT = [1, 7, 4097, 3000, 1, 2500, 1030], 3
torch.manual_seed(seed)
params = [torch.randn(n) for n in SIZES]

class Hang(SlowEngine):
    # hangs forever after the 3rd write of step `kill_step` completed: killed mid-step
    step, writes = -1, 0
    def submit(self, reqs):
        t = super().submit(reqs)
        if self.step == kill_step and reqs[0].op == "write":
            self.writes += 1
            if self.writes == 3:
                self.wait(t)
                print("mid", flush=True)
                time.sleep(600)
        return t

eng = Hang(threads_engine(), read_delay=0.002, write_delay=0.002)
st = SwappedState(params, swap_dir=swap, io_engine=eng, sub_group_size=1024, max_host_bytes=1 << 20)

def save(k):
    torch.save([p.clone() for p in params], out + f"/tmp.pt")
    os.replace(out + "/tmp.pt", out + f"/params_{k}.pt")

save(0)
print("ready", flush=True)
steps = [0] * len(params)
for step in range(100):
    eng.step = step
    st.step(batches_for(params, steps, step, SPLIT))
    save(step + 1)
"""


def _run_child(tmp_path, kill_step, seed, delay=None):
    swap, out = tmp_path / "swap", tmp_path / "out"
    swap.mkdir()
    out.mkdir()
    p = run_python(_CHILD, str(swap), str(out), str(kill_step), str(seed))
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    if delay is None:
        assert p.stdout.readline().strip() == "mid", p.stderr.read()
    else:
        import time

        time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait()
    return swap, out


def _resume_and_compare(swap, out, k, seed, total):
    torch.manual_seed(seed)
    ref = Reference([torch.randn(n) for n in SIZES])
    params = torch.load(out / f"params_{k}.pt")
    st = swapped_state(swap, params, resume=True)
    steps = [st.step_of(p) for p in params]
    for s in range(k):
        ref.step(s, SPLIT)
    assert steps == ref.steps
    for s in range(k, total):
        st.step(batches_for(params, steps, s, SPLIT))
        ref.step(s, SPLIT)
    for i, p in enumerate(params):
        assert torch.equal(p, ref.params[i])
        m, v = st.read_state(p)
        assert torch.equal(m, ref.m[i]) and torch.equal(v, ref.v[i])
    st.close()
    assert os.listdir(swap) == []


def test_kill_9_mid_step_then_resume_is_bit_exact(tmp_path):
    swap, out = _run_child(tmp_path, kill_step=3, seed=1)
    m = json.load(open(swap / "offload-run.rank0" / "manifest.json"))
    assert m["step"] == 3  # steps 0, 1, 2 finished; step 3 was cut in the middle
    _resume_and_compare(swap, out, 3, seed=1, total=6)


def test_kill_9_at_a_random_moment(tmp_path):
    seed = random.randrange(1000)
    swap, out = _run_child(tmp_path, kill_step=-5, seed=seed, delay=random.uniform(0.2, 1.0))
    m = json.load(open(swap / "offload-run.rank0" / "manifest.json"))
    k = m["step"]
    if not (out / f"params_{k}.pt").exists():  # killed between the commit and the user's save
        params = torch.load(out / f"params_{k - 1}.pt")
        with pytest.raises(ValueError, match=f"not those of step {k}"):
            swapped_state(swap, params, resume=True)
        return
    _resume_and_compare(swap, out, k, seed=seed, total=k + 2)


def test_failed_commit_keeps_previous_step(tmp_path, monkeypatch):
    """ENOSPC (or EIO) while replacing the manifest: the step is not applied to the swap state."""
    import errno as _errno

    from offload.swap import fsutil

    params = [torch.randn(n) for n in SIZES]
    st = swapped_state(tmp_path, params)
    steps = [0] * len(params)
    st.step(batches_for(params, steps, 0, SPLIT))
    before = _moments(st, params)
    real = fsutil.write_json_atomic

    def full(directory, name, obj):
        raise OSError(_errno.ENOSPC, "No space left on device", os.path.join(directory, name))

    monkeypatch.setattr(fsutil, "write_json_atomic", full)
    with pytest.raises(SwapStepError, match="could not be committed.*still hold step 1"):
        st.step(batches_for(params, list(steps), 1, SPLIT))
    monkeypatch.setattr(fsutil, "write_json_atomic", real)
    assert st.store.step == 1 and _same(_moments(st, params), before)
    assert json.load(open(os.path.join(st.swap_path, "manifest.json")))["step"] == 1
    st.close()
