"""`offload clean`: all or nothing per directory, and no empty path."""
from __future__ import annotations

import os

import pytest

from offload.cli import main
from offload.swap import SwapLayout, SwapStore
from offload.swap.cleanup import clean_dir


def _left(d):
    st = SwapStore(str(d), SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
    path = st.path
    st.close(remove=False)
    return path


@pytest.mark.parametrize("dry_run", [False, True])
def test_clean_skips_a_directory_with_a_subdirectory_whole(tmp_path, capsys, dry_run):
    path = _left(tmp_path)
    before = sorted(os.listdir(path))
    os.mkdir(os.path.join(path, "extra"))
    assert main(["clean"] + (["--dry-run"] if dry_run else []) + [str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"skipped {path}: unexpected non-file entry in a swap directory; removed nothing" in out
    assert sorted(os.listdir(path)) == sorted(before + ["extra"])  # nothing was removed
    os.rmdir(os.path.join(path, "extra"))
    res = clean_dir(str(tmp_path))
    assert [p for p, _ in res["removed"]] == [path] and os.listdir(tmp_path) == []


def test_clean_refuses_an_empty_path(tmp_path, capsys, monkeypatch):
    _left(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["clean", ""]) == 1
    assert "swap_dir must name a directory, got ''" in capsys.readouterr().err
    assert len(os.listdir(tmp_path)) == 1  # the current directory was not scanned
    with pytest.raises(ValueError, match="must name a directory"):
        clean_dir("")
    clean_dir(str(tmp_path))


@pytest.mark.parametrize("dry_run", [False, True])
def test_clean_keeps_a_directory_holding_a_foreign_file(tmp_path, capsys, dry_run):
    path = _left(tmp_path)
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("mine, not offload's")
    before = sorted(os.listdir(path))
    assert main(["clean"] + (["--dry-run"] if dry_run else []) + [str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"skipped {path}: a file the library did not write is in this swap directory; removed nothing" in out
    assert sorted(os.listdir(path)) == before
    os.unlink(os.path.join(path, "notes.txt"))
    assert [p for p, _ in clean_dir(str(tmp_path))["removed"]] == [path]


def test_close_and_discard_keep_a_foreign_file(tmp_path, caplog):
    st = SwapStore(str(tmp_path), SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
    foreign = os.path.join(st.path, "notes.txt")
    with open(foreign, "w") as f:
        f.write("mine")
    st.close()  # removing the directory: kept whole, with a warning naming the file
    assert os.path.exists(foreign) and "did not write" in caplog.text
    os.unlink(foreign)
    clean_dir(str(tmp_path))


def test_the_store_files_are_the_library_own():
    from offload.swap import fsutil, store

    for name in store.SLOT_FILES + (store.MANIFEST, store.RESERVE, fsutil.LOCK_NAME, ".manifest.json.tmp-123"):
        assert fsutil.own_file(name), name
    for name in ("notes.txt", "slot2.bin", ".manifest.json.tmp-", "manifest.json~"):
        assert not fsutil.own_file(name), name


@pytest.mark.parametrize("dry_run", [False, True])
def test_clean_removes_the_test_file_of_a_killed_bench_io(tmp_path, capsys, dry_run):
    """[Note: the test file while it runs] in offload/cli/bench_io.py: an unlocked
    offload-bench-io.<pid>.dat goes, a locked one (a live run) and a kept one stay."""
    import fcntl
    import subprocess
    import sys


    dead = tmp_path / "offload-bench-io.424242.dat"
    dead.write_bytes(b"\0" * 8192)
    user = tmp_path / "offload-bench-io.05.dat"  # no pid has a leading zero: a user's file
    user.write_bytes(b"z")
    kept = tmp_path / "offload-bench-io.dat"  # what --keep leaves
    kept.write_bytes(b"x")
    live = tmp_path / "offload-bench-io.1.dat"
    live.write_bytes(b"y")
    # a live run holds its file's flock: another process, as bench-io holds it
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(live)!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = ["clean", str(tmp_path)] + (["--dry-run"] if dry_run else [])
        assert main(args) == 0
        out = capsys.readouterr().out
    finally:
        holder.kill()
        holder.wait()
    assert dead.exists() is dry_run and kept.exists() and live.exists() and user.exists()
    verb = "would remove" if dry_run else "removed"
    assert f"{verb} {dead}" in out and f"kept {live}: in use by live process 1" in out
    assert f"{verb} 0 directories and 1 bench-io test file" in out
    fd = os.open(live, os.O_RDONLY)  # the lock went with the holder: the next clean removes it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def _being_made(tmp_path, lock_file: bool):
    path = os.path.join(str(tmp_path), "offload-run.rank0")
    os.mkdir(path, 0o700)
    if lock_file:
        open(os.path.join(path, "lock"), "w").close()  # made, not yet locked: empty
    return path


def _age(path, seconds):
    t = os.stat(path).st_mtime - seconds
    os.utime(path, (t, t))


@pytest.mark.parametrize("lock_file", [False, True])
def test_clean_leaves_a_directory_being_made(tmp_path, capsys, lock_file):
    """[Note: a directory being made] in offload/swap/fsutil.py: a young directory with no
    lock, or a free empty one, is its maker's; an old one is a dead maker's and goes."""
    path = _being_made(tmp_path, lock_file)
    assert main(["clean", str(tmp_path)]) == 0
    assert f"kept {path}: being made" in capsys.readouterr().out and os.path.isdir(path)
    _age(os.path.join(path, "lock") if lock_file else path, 120)
    assert [p for p, _ in clean_dir(str(tmp_path))["removed"]] == [path]


def test_the_maker_waits_for_a_probe_and_refuses_a_removed_lock(tmp_path, monkeypatch):
    import fcntl
    import threading

    from offload.swap import fsutil

    path = _being_made(tmp_path, lock_file=True)
    probe = os.open(os.path.join(path, "lock"), os.O_RDWR)
    fcntl.flock(probe, fcntl.LOCK_EX)  # a clean's try_lock at this very moment
    threading.Timer(0.1, os.close, (probe,)).start()
    lock = fsutil.Lock(path)  # waits for the probe, then holds it
    assert fsutil.lock_holder(lock.path) == os.getpid()
    lock.release()

    real = fsutil._flock_briefly

    def removed_first(fd, lock_path):
        os.unlink(lock_path)  # a clean removed the directory's files in between
        real(fd, lock_path)

    monkeypatch.setattr(fsutil, "_flock_briefly", removed_first)
    with pytest.raises(FileNotFoundError, match="lock file was removed while this process took it"):
        fsutil.Lock(path)


def test_clean_finds_a_killed_demo_run_inside_its_temporary_directory(tmp_path, capsys):
    # offload demo keeps its states in a mkdtemp directory (offload-demo-XXXX) under the swap
    # dir: a kill -9 left the run one level below where clean looked ("no swap directories")
    import tempfile

    demo = tempfile.mkdtemp(prefix="offload-demo-", dir=str(tmp_path))
    path = _left(demo)
    starting = tempfile.mkdtemp(prefix="offload-demo-", dir=str(tmp_path))  # a live demo before its run
    assert main(["clean", "--dry-run", str(tmp_path)]) == 0
    assert os.path.isdir(path)
    assert main(["clean", str(tmp_path)]) == 0
    assert path in capsys.readouterr().out
    assert not os.path.exists(demo)  # emptied: gone with its run
    assert os.path.isdir(starting)   # empty, but nothing was removed from it: left for its demo
    live = SwapStore(starting, SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
    try:
        assert main(["clean", str(tmp_path)]) == 0
        assert os.path.isdir(live.path) and f"{live.path}" in capsys.readouterr().out  # held, named
    finally:
        live.close()


FOREIGN = {  # [Note: a directory clean may remove] in offload/swap/own_dir.py: named, moded and filled like ours
    "no lock file": {"manifest.json": b"my notes, not an offload manifest\n", "slot0.bin": os.urandom(4096)},
    "its manifest.json is not JSON": {"lock": b"123\n", "manifest.json": b"my notes\n", "slot0.bin": b"x"},
    "its manifest.json is not an offload swap manifest": {"lock": b"", "manifest.json": b'{"format": "mine"}'},
    "its lock file holds something other than a pid": {"lock": b"my lock\n", "slot1.bin": b"data"},
}


@pytest.mark.parametrize("why", list(FOREIGN))
@pytest.mark.parametrize("dry_run", [False, True])
def test_clean_keeps_a_directory_whose_contents_offload_did_not_write(tmp_path, capsys, why, dry_run):
    path = os.path.join(str(tmp_path), "offload-mydata.rank0")
    os.mkdir(path, 0o700)
    for name, data in FOREIGN[why].items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    for name in os.listdir(path) + [""]:  # old: not a directory being made
        _age(os.path.join(path, name), 7200)
    assert main(["clean"] + (["--dry-run"] if dry_run else []) + [str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"skipped {path}: {why}" in out and "not a directory offload made" in out, out
    assert "removed 0 directories" in out or "would remove 0 directories" in out
    for name, data in FOREIGN[why].items():
        assert open(os.path.join(path, name), "rb").read() == data


def test_clean_removes_a_left_param_tier_directory(tmp_path):
    # what shard/tier_dir.py's lock_dir leaves: its pid without a newline, and no manifest
    path = os.path.join(str(tmp_path), "offload-params.999999.rank0")
    os.mkdir(path, 0o700)
    for name, data in (("lock", b"999999"), ("areas.bin", b"\0" * 4096)):
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    assert [p for p, _ in clean_dir(str(tmp_path))["removed"]] == [path]


def test_a_param_tier_lock_that_is_a_fifo_is_refused_naming_it(tmp_path):
    # a plain os.open took a FIFO as the lock (O_RDWR does not block on one), which every
    # other lock of a directory (fsutil.Lock, try_lock: offload clean) refuses
    from offload.io import NotRegularFile
    from offload.shard.tier_dir import lock_dir
    from _no_hang import within

    lock = tmp_path / "lock"
    os.mkfifo(lock)
    with within(5), pytest.raises(NotRegularFile, match=r"cannot open the lock: not a regular file \(a FIFO\)") as e:
        lock_dir(str(tmp_path))
    assert e.value.filename == str(lock)
