"""The swap store: private directory, lock, symlinks, manifest, cleanup, `offload clean`."""
from __future__ import annotations

import errno
import json
import os
import signal
import stat
import time

import pytest

from offload.swap import SwapLayout, SwapStore
from offload.swap.cleanup import clean_dir
from test_swap_util import run_python
from offload.swap import fsutil

NAMES = ["exp_avg", "exp_avg_sq"]


def _store(tmp_path, **kw):
    return SwapStore(str(tmp_path), SwapLayout(5000, 2048, 2), state_names=NAMES, **kw)


def test_private_dir_files_and_manifest_then_nothing_left(tmp_path):
    st = _store(tmp_path, verify=True)
    d = st.path
    assert os.path.basename(d) == "offload-run.rank0"
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    names = sorted(os.listdir(d))
    assert names == ["lock", "manifest.json", "reserve.bin", "slot0.bin", "slot1.bin"]
    for n in names:
        assert stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode) == 0o600, n
    for n in ("slot0.bin", "slot1.bin"):
        size = os.path.getsize(os.path.join(d, n))
        assert size == st.layout.file_bytes and size % 4096 == 0
        assert os.stat(os.path.join(d, n)).st_blocks * 512 >= size  # preallocated
    m = json.load(open(os.path.join(d, "manifest.json")))
    assert m["version"] == 1 and m["numel"] == 5000 and m["dtype"] == "float32"
    assert m["ranges"] == [[0, 2048], [2048, 4096], [4096, 5000]] and m["step"] == 0
    assert int(open(os.path.join(d, "lock")).read()) == os.getpid()
    st.close()
    assert os.listdir(tmp_path) == []


def test_bad_swap_dirs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        _store(tmp_path / "missing")
    assert e.value.filename == str(tmp_path / "missing")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError):
        _store(tmp_path / "afile")


def test_read_only_swap_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o500)
        with pytest.raises(PermissionError, match="not writable"):
            _store(ro)
        return
    # root ignores mode bits: use a read-only mount when the sandbox lets us make one
    if os.system(f"mount -t tmpfs -o ro,size=1m tmpfs {ro} 2>/dev/null") != 0:
        pytest.skip("running as root and cannot mount a read-only file system here")
    try:
        with pytest.raises(OSError) as e:
            _store(ro)
        assert e.value.errno == errno.EROFS and e.value.filename == str(ro)
    finally:
        os.system(f"umount {ro}")


def test_planted_symlink_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    swap = tmp_path / "swap"
    swap.mkdir()
    os.symlink(victim, swap / "offload-run.rank0")
    with pytest.raises(OSError) as e:
        _store(swap)
    assert e.value.errno == errno.ELOOP
    assert os.listdir(victim) == []


def test_foreign_mode_dir_is_refused(tmp_path):
    os.mkdir(tmp_path / "offload-run.rank0", 0o755)
    os.chmod(tmp_path / "offload-run.rank0", 0o755)
    with pytest.raises(PermissionError, match="mode 755"):
        _store(tmp_path)


class _Holder:
    """A forked child that opens a store and sleeps (forking is much faster than starting an
    interpreter that imports torch). It leaves with os._exit or SIGKILL, so no cleanup of the
    parent's stores (inherited in its registry) can run in it."""

    def __init__(self, swap_dir, run="run"):
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child
            try:
                os.close(r)
                SwapStore(str(swap_dir), SwapLayout(5000, 2048, 2), state_names=NAMES, run_name=run)
                os.write(w, b"ready")
                time.sleep(60)
            finally:
                os._exit(0)
        os.close(w)
        ok = os.read(r, 5)
        os.close(r)
        assert ok == b"ready"

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def _start_holder(tmp_path, run="run", mode="sleep"):
    proc = run_python(_HOLD, str(tmp_path), run, mode)
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read()
    return proc


_HOLD = """
import sys, time
from offload.swap import SwapLayout, SwapStore
st = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"], run_name=sys.argv[2])
print("ready", flush=True)
if sys.argv[3] == "sleep":
    time.sleep(60)
"""


def test_second_process_refused_then_clean(tmp_path, capsys):
    holder = _Holder(tmp_path)
    try:
        with pytest.raises(BlockingIOError, match=f"in use by process {holder.pid}"):
            _store(tmp_path)
        res = clean_dir(str(tmp_path))
        assert res["held"] == [(str(tmp_path / "offload-run.rank0"), holder.pid)] and res["removed"] == []
    finally:
        holder.kill()  # SIGKILL: no cleanup runs
    assert os.listdir(tmp_path) == ["offload-run.rank0"]  # left behind, lock now free
    with pytest.raises(FileExistsError, match="resume=True"):
        _store(tmp_path)
    from offload.cli import main

    assert main(["clean", "--dry-run", str(tmp_path)]) == 0
    assert "would remove " + str(tmp_path / "offload-run.rank0") in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["offload-run.rank0"]
    assert main(["clean", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "removed " + str(tmp_path / "offload-run.rank0") in out and "1 directory" in out
    assert os.listdir(tmp_path) == []
    _store(tmp_path).close()


def test_clean_keeps_live_and_foreign(tmp_path, capsys):
    holder = _Holder(tmp_path, run="live")
    try:
        os.mkdir(tmp_path / "unrelated")
        from offload.cli import main

        assert main(["clean", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"in use by live process {holder.pid}" in out
        assert sorted(os.listdir(tmp_path)) == ["offload-live.rank0", "unrelated"]
    finally:
        holder.kill()


def test_atexit_removes_files_sigterm_keeps_them(tmp_path):
    p = _start_holder(tmp_path, run="exits", mode="exit")
    assert p.wait(timeout=30) == 0
    assert not os.path.exists(tmp_path / "offload-exits.rank0")
    p = _start_holder(tmp_path, run="term")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM  # default action still happens (chained)
    assert os.path.exists(tmp_path / "offload-term.rank0")  # kept for resume=True


_CHAIN = """
import os, signal, sys, time
calls = []
def mine(s, f):  # a framework's graceful shutdown: first SIGTERM sets a flag, the second exits
    calls.append(s)
    if len(calls) == 2:
        open(sys.argv[2], "w").write("called twice")
        sys.exit(7)
signal.signal(signal.SIGTERM, mine)
from offload.swap import SwapLayout, SwapStore
st = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
print("ready", flush=True)
while not calls:
    time.sleep(0.01)
print("alive", os.path.exists(st.path), flush=True)
for _ in range(6000):  # short sleeps: a Python handler runs between them
    time.sleep(0.01)
"""


def test_sigterm_chains_to_previous_handler(tmp_path):
    marker = tmp_path / "marker"
    swap = tmp_path / "swap"
    swap.mkdir()
    p = run_python(_CHAIN, str(swap), str(marker))
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    p.send_signal(signal.SIGTERM)
    # the previous handler returned: the process goes on, and so do its swap files
    assert p.stdout.readline().strip() == "alive True", p.stderr.read()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 7  # it exited (SystemExit) after SIGTERM: the files stay for resume
    assert marker.read_text() == "called twice" and os.listdir(swap) == ["offload-run.rank0"]


def test_resume_checks_version_and_layout(tmp_path):
    st = _store(tmp_path)
    path = st.path
    st.close(remove=False)
    m = json.load(open(os.path.join(path, "manifest.json")))
    # another layout (another run's directory under the same name)
    with pytest.raises(ValueError, match="numel is 5000, expected 6000"):
        SwapStore(str(tmp_path), SwapLayout(6000, 2048, 2), state_names=NAMES, resume=True).close()
    m["version"] = 99
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(fsutil.sealed(m), f)  # a later release's, sealed
    with pytest.raises(ValueError, match="format version 99"):
        _store(tmp_path, resume=True)
    assert os.path.exists(path)  # a refused resume deletes nothing
    clean_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nothing|no swap directory"):
        _store(tmp_path, resume=True)
    assert os.listdir(tmp_path) == []


def test_no_o_direct_falls_back_to_buffered_with_warning(tmp_path):
    """tmpfs refused O_DIRECT before Linux 6.6; ramfs still does. Use whichever is at hand."""
    from offload.io import probe_direct

    d, mounted = None, False
    if os.path.isdir("/dev/shm") and not probe_direct("/dev/shm")[0]:
        d = os.path.join("/dev/shm", f"offload-test-{os.getpid()}")
        os.mkdir(d)
    else:
        d = str(tmp_path / "ramfs")
        os.mkdir(d)
        if os.system(f"mount -t ramfs ramfs {d} 2>/dev/null") != 0:
            pytest.skip("tmpfs takes O_DIRECT on this kernel and ramfs cannot be mounted here")
        mounted = True
    try:
        assert not probe_direct(d)[0]
        with pytest.warns(RuntimeWarning, match="does not support O_DIRECT"):
            st = _store(d)
        assert not st.files[0].direct
        st.close()
        assert os.listdir(d) == []
    finally:
        if mounted:
            os.system(f"umount {d}")
        os.rmdir(d)


def test_an_atomic_write_removes_the_temporary_files_of_killed_writers(tmp_path):
    # a kill -9 inside write_json_atomic leaves .<name>.tmp-<pid>: the next write of that name
    # removes those of pids that no longer run (a checkpoint directory otherwise kept them)
    import subprocess
    import sys

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    try:
        for n in (f".m.json.tmp-{gone}", f".m.json.tmp-{live.pid}", f".other.json.tmp-{gone}", f".m.json.tmp-x"):
            (tmp_path / n).write_text("{")
        fsutil.write_json_atomic(str(tmp_path), "m.json", {"a": 1})
        assert sorted(os.listdir(tmp_path)) == sorted(["m.json", f".m.json.tmp-{live.pid}", f".other.json.tmp-{gone}",
                                                       ".m.json.tmp-x"])
        assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1}
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("committed", [False, "extra", "data"])
def test_a_directory_kept_by_a_ctrl_c_says_whether_it_can_be_resumed(tmp_path, caplog, committed):
    # one kept before its first commit said "step 0, resumable with resume=True", which then refused it;
    # one whose commits carry no ``extra`` (it is optional) then said "never committed" at step 1
    store = _store(tmp_path)
    if committed == "extra":
        store.commit({}, {"steps": []})
    elif committed == "data":
        store.commit({0: None})
    try:
        raise KeyboardInterrupt  # closed while it propagates: kept
    except KeyboardInterrupt:
        with caplog.at_level("WARNING", logger="offload"):
            store.close()
    assert os.path.isdir(store.path)
    said = "step 1, resumable with resume=True" if committed else "never committed: nothing to resume"
    assert said in caplog.text, caplog.text
    fsutil.remove_private_dir(store.path)
