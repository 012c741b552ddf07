"""``offload bench-io``: rows, JSON keys, tuning file that takes effect, fio side by side, errors."""
from __future__ import annotations

import json
import os

import pytest

from offload.cli import main
from offload.cli import bench_io
from offload.io import ENGINES, engine_unavailable_reason, load_tuning, open_engine, probe_direct
from offload.io import fio as io_fio

KEYS = {"tool", "engine", "rw", "block_size", "queue_depth", "direct", "bytes", "seconds", "gbps", "iops",
        "lat_p50_us", "lat_p99_us"}


AVAILABLE = [e for e in ENGINES if engine_unavailable_reason(e) is None]


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    if not probe_direct(d)[0]:
        pytest.skip(f"{d} refuses O_DIRECT")
    return d


def test_sweep_json_plot_and_tune(bench_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OFFLOAD_IO_ENGINE", raising=False)
    out_json, out_png, out_tune = tmp_path / "rows.json", tmp_path / "plot.png", tmp_path / "tune.json"
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "8MiB", "--rw", "read,write",
               "--block-size", "256K,1M", "--queue-depth", "1,4", "--engine", ",".join(AVAILABLE),
               "--loops", "2", "--json", str(out_json), "--plot", str(out_png), "--tune", str(out_tune)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "GB/s = 10^9 bytes/s" in captured.out and "best read:" in captured.out and "best write:" in captured.out
    assert "ETA" in captured.err
    rows = json.loads(out_json.read_text())
    assert len(rows) == 2 * 2 * 2 * len(AVAILABLE)
    seen = set()
    for r in rows:
        assert KEYS <= set(r)
        assert r["tool"] == "offload" and r["direct"] is True and r["loops"] == 2
        assert r["bytes"] == 2 * (8 << 20)
        assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["iops"] == pytest.approx(r["bytes"] / r["block_size"] / r["seconds"])
        assert 0 < r["lat_p50_us"] <= r["lat_p99_us"] <= r["lat_p999_us"]
        seen.add((r["engine"], r["rw"], r["block_size"], r["queue_depth"]))
    assert len(seen) == len(rows)
    assert out_png.stat().st_size > 1000
    assert not (bench_dir / bench_io.DATA_NAME).exists()  # cleaned without --keep
    # The tuning file names the best measured configuration and an engine opened from it uses it.
    data = json.loads(out_tune.read_text())
    cfg = load_tuning(out_tune)
    expected, _ = bench_io.best_config(rows)
    assert cfg == expected and data["measured"]["read_gbps"] > 0 and data["measured"]["write_gbps"] > 0
    with open_engine(cfg, directory=bench_dir) as eng:
        assert (eng.name, eng.block_size, eng.queue_depth, eng.direct) == (cfg.engine, cfg.block_size,
                                                                          cfg.queue_depth, True)


@pytest.mark.skipif("uring" not in AVAILABLE, reason="uring engine unavailable here")
def test_fixed_buffers_both_measures_uring_both_ways(bench_dir, tmp_path):
    out_json, out_tune = tmp_path / "rows.json", tmp_path / "tune.json"
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--engine", "uring", "--block-size", "256K",
               "--queue-depth", "4", "--fixed-buffers", "both", "--json", str(out_json), "--tune", str(out_tune)])
    assert rc == 0
    rows = json.loads(out_json.read_text())
    assert sorted((r["engine"], r["rw"]) for r in rows) == [("uring", "read"), ("uring", "write"),
                                                           ("uring-unreg", "read"), ("uring-unreg", "write")]
    probe = open_engine("uring")
    try:
        can = probe.register_buffers([bytearray(4096)]) is not None
    finally:
        probe.close()
    for r in rows:
        assert ("registered buffers" in r["note"]) == (can and r["engine"] == "uring")
    assert load_tuning(out_tune).engine == "uring"  # never the comparison row


def test_best_config_prefers_balanced_read_write():
    rows = [
        dict(tool="offload", engine="uring", rw="read", block_size=1 << 20, queue_depth=32, direct=True, gbps=3.0),
        dict(tool="offload", engine="uring", rw="write", block_size=1 << 20, queue_depth=32, direct=True, gbps=1.0),
        dict(tool="offload", engine="threads", rw="read", block_size=1 << 20, queue_depth=32, direct=True, gbps=2.0),
        dict(tool="offload", engine="threads", rw="write", block_size=1 << 20, queue_depth=32, direct=True, gbps=2.0),
        dict(tool="fio", engine="io_uring", rw="read", block_size=1 << 20, queue_depth=32, direct=True, gbps=9.0),
    ]
    cfg, measured = bench_io.best_config(rows)
    assert cfg.engine == "threads" and measured == {"read": 2.0, "write": 2.0}


@pytest.mark.skipif(io_fio.fio_path() is None, reason="fio not installed (apt-get install fio)")
def test_fio_side_by_side(bench_dir, tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "16MiB", "--rw", "read", "--engine", AVAILABLE[0],
               "--fio", "--keep", "--json", str(out_json)])
    assert rc == 0
    rows = json.loads(out_json.read_text())
    fio_rows = [r for r in rows if r["tool"] == "fio"]
    ours = [r for r in rows if r["tool"] == "offload"]
    assert fio_rows and len(ours) == 1
    assert all(r["bytes"] == 16 << 20 and r["gbps"] > 0 for r in fio_rows)
    assert {r["hugepages"] for r in fio_rows} == {False, True}
    assert ours[0]["vs_fio"] == pytest.approx(ours[0]["gbps"] / max(r["gbps"] for r in fio_rows))
    assert (bench_dir / bench_io.DATA_NAME).stat().st_size == 16 << 20  # --keep
    assert "vs fio" in capsys.readouterr().out


def test_without_fio_says_how_to_get_it(bench_dir, monkeypatch, capsys):
    monkeypatch.setattr(io_fio, "fio_path", lambda: None)
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--rw", "write", "--engine", "threads",
               "--fio"])
    assert rc == 0
    assert "apt-get install fio" in capsys.readouterr().err


def test_buffered_mode_measures_after_dropping_the_cache(bench_dir, tmp_path):
    out_json = tmp_path / "rows.json"
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--buffered", "--engine", "threads",
               "--json", str(out_json)])
    assert rc == 0
    rows = json.loads(out_json.read_text())
    assert {r["rw"] for r in rows} == {"read", "write"} and all(r["direct"] is False for r in rows)


def test_errors(tmp_path, capsys):
    assert main(["bench-io", "--dir", str(tmp_path / "missing"), "--size", "4MiB"]) == 1
    assert "[Errno 2] no such directory" in capsys.readouterr().err
    # options that disagree: a usage error, as a bad value is (the README's exit statuses)
    assert main(["bench-io", "--dir", str(tmp_path), "--size", "1000000", "--block-size", "1M"]) == 2
    assert "not a multiple" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench-io", "--dir", str(tmp_path), "--engine", "spdk"])
    with pytest.raises(SystemExit):
        main(["bench-io", "--dir", str(tmp_path), "--direct", "--buffered"])
    assert not os.path.exists(tmp_path / bench_io.DATA_NAME)


@pytest.mark.parametrize("flag", ["--json", "--plot", "--tune"])
def test_an_output_that_cannot_be_written_is_refused_before_the_sweep(tmp_path, capsys, monkeypatch, flag):
    # The sweep ran for minutes and only then failed to open --json / --tune ("Is a
    # directory", a missing folder): the measurements behind them were lost.
    def no_sweep(args):
        raise AssertionError("the sweep ran")
    monkeypatch.setattr(bench_io, "sweep", no_sweep)
    assert main(["bench-io", "--dir", str(tmp_path), "--size", "4MiB", flag, str(tmp_path / "no" / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{flag}: no such directory" in err and str(tmp_path / "no") in err
    assert main(["bench-io", "--dir", str(tmp_path), "--size", "4MiB", flag, str(tmp_path)]) == 1
    assert f"{flag}: is a directory" in capsys.readouterr().err


def test_engines_that_cannot_run_here_are_skipped_and_said(bench_dir, tmp_path, capsys, monkeypatch):
    # The default sweep lists uring; where python-liburing cannot run (an AVX2-only CPU) or the
    # kernel blocks io_uring, bench-io measures the others and says what it skipped.
    from offload.io import auto as io_auto

    monkeypatch.delenv("OFFLOAD_IO_ENGINE", raising=False)
    monkeypatch.setattr(io_auto, "_uring_reason", lambda: "blocked by a seccomp filter")
    out_json = tmp_path / "rows.json"
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--rw", "read", "--engine", "uring,threads",
               "--json", str(out_json)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "skipping engine uring: blocked by a seccomp filter" in err
    assert {r["engine"] for r in json.loads(out_json.read_text())} == {"threads"}
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--engine", "uring"])
    assert rc != 0
    assert "none of the engines asked for can run here: uring: blocked by a seccomp filter" in capsys.readouterr().err
    assert not os.listdir(bench_dir)  # nothing created before the refusal


def _stop_in_the_sweep(monkeypatch, stop):
    """Make the first measurement call ``stop()`` while it holds a view of a buffer, as an
    engine's requests do (the traceback keeps it alive)."""
    import torch

    def measure_one(args, contender, f, path, rw, bs, qd, bufs, *rest):
        view = bufs[0].tensor(torch.uint8)  # noqa: F841
        stop()
    monkeypatch.setattr(bench_io, "_measure_one", measure_one)


def test_ctrl_c_says_interrupted_and_removes_the_test_file(bench_dir, capsys, monkeypatch):
    # The pool's close() in the cleanup refused the regions the interrupted frames still viewed,
    # and its BufferError replaced the KeyboardInterrupt: a traceback and exit 1.
    def ctrl_c():
        raise KeyboardInterrupt
    _stop_in_the_sweep(monkeypatch, ctrl_c)
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--engine", "threads"])
    err = capsys.readouterr().err
    assert rc == 130 and "offload bench-io: interrupted" in err and "BufferError" not in err, err
    assert not os.listdir(bench_dir)


def test_sigterm_removes_the_test_file_and_exits_143(bench_dir, capsys, monkeypatch):
    # SIGTERM's default action ended the process with the --size test file left in --dir.
    # A handler of the test's own stands in for that default (which would end pytest), and
    # must be back in place after.
    import signal

    received = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        _stop_in_the_sweep(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGTERM))
        rc = main(["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--engine", "threads"])
        assert rc == 143 and "offload bench-io: terminated" in capsys.readouterr().err
        assert not os.listdir(bench_dir) and not received
        os.kill(os.getpid(), signal.SIGTERM)  # outside bench-io, the handler before it
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def _fake_fio(tmp_path, body: str) -> str:
    """An executable named fio that runs ``body`` (a Python script) instead of fio."""
    import sys

    exe = tmp_path / "fake-bin" / "fio"
    exe.parent.mkdir(exist_ok=True)
    exe.write_text(f"#!{sys.executable}\n{body}\n")
    exe.chmod(0o755)
    return str(exe)


def test_fio_past_its_time_limit_is_a_runtime_error_and_bench_io_sets_none(tmp_path, monkeypatch):
    # subprocess.TimeoutExpired escaped run_fio: a traceback from `offload bench-io --fio`
    # whose fio ran longer than 600 s (a large --size on a slow disk), the sweep lost.
    exe = _fake_fio(tmp_path, "import time; time.sleep(30)")
    monkeypatch.setattr(io_fio, "fio_path", lambda: exe)
    with pytest.raises(RuntimeError, match="limit"):
        io_fio.run_fio(str(tmp_path / "x"), rw="read", size=1 << 20, block_size=1 << 20, queue_depth=1,
                       direct=True, timeout=0.5)
    seen = {}

    def spy(path, **kw):
        seen.update(kw)
        raise KeyboardInterrupt  # enough: the call's arguments are what this checks

    monkeypatch.setattr(io_fio, "run_fio", spy)
    monkeypatch.setattr(bench_io, "_fio_variants", lambda args: [(False, "io_uring")])
    d = tmp_path / "disk"
    d.mkdir()
    if not probe_direct(d)[0]:
        pytest.skip(f"{d} refuses O_DIRECT")
    assert main(["bench-io", "--dir", str(d), "--size", "1M", "--engine", AVAILABLE[0], "--rw", "read",
                 "--fio"]) == 130
    assert seen["timeout"] is None


def test_a_fio_ioengine_that_fails_is_dropped_and_the_sweep_goes_on(bench_dir, tmp_path, monkeypatch, capsys):
    # fio built without libaio (or io_uring refused in a container) failed one variant, and
    # that RuntimeError ended the whole sweep: exit 1, no rows.
    exe = _fake_fio(tmp_path, r'''
import json, sys
a = dict(x.lstrip("-").split("=", 1) for x in sys.argv[1:] if "=" in x)
if a["ioengine"] == "libaio":
    sys.exit("fio: engine libaio not loadable")
side = {"io_bytes": int(a["size"]), "bw_bytes": 1e9, "runtime": 1, "iops": 1e9 / int(a["bs"]),
        "lat_ns": {"percentile": {"50.000000": 1e6, "99.000000": 2e6, "99.900000": 3e6}}, "clat_ns": {}}
print(json.dumps({"jobs": [{a["rw"]: side, "usr_cpu": 1.0, "sys_cpu": 2.0}]}))''')
    monkeypatch.setattr(io_fio, "fio_path", lambda: exe)
    out_json = tmp_path / "rows.json"
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "2M", "--rw", "read,write", "--engine", AVAILABLE[0],
               "--fio", "--json", str(out_json)])
    assert rc == 0
    assert "dropping fio libaio" in capsys.readouterr().err
    rows = json.loads(out_json.read_text())
    fio = [r for r in rows if r["tool"] == "fio"]
    assert {r["engine"] for r in fio} == {"io_uring"} and len(fio) == 4  # two variants x read, write
    ours = [r for r in rows if r["tool"] == "offload"]
    assert len(ours) == 2 and all(r["vs_fio"] == pytest.approx(r["gbps"]) for r in ours)
    assert not (bench_dir / bench_io.DATA_NAME).exists()


def test_buffers_larger_than_the_memory_available_are_refused_before_the_sweep(bench_dir, monkeypatch, capsys):
    # 2 x QD buffers of the block size are filled with random data: --block-size 8M
    # --queue-depth 1024 asks for 16 GiB, more than many hosts have: refused before the test file is made.
    monkeypatch.setattr(bench_io, "_mem_available", lambda: 512 << 20)
    rc = main(["bench-io", "--dir", str(bench_dir), "--size", "16M", "--block-size", "8M",
               "--queue-depth", "1,64", "--engine", AVAILABLE[0]])
    assert rc == 1
    err = capsys.readouterr().err
    assert "--queue-depth 64 x --block-size 8M needs 1.0 GiB" in err and "0.5 GiB of memory available" in err
    assert not (bench_dir / bench_io.DATA_NAME).exists()


@pytest.mark.parametrize("keep", [False, True])
def test_the_running_test_file_is_this_process_own_and_locked(bench_dir, monkeypatch, keep):
    """[Note: the test file while it runs]: offload-bench-io.<pid>.dat, flock-ed while the
    sweep runs (what `offload clean` tells from a killed run's), renamed by --keep."""
    import fcntl

    running = bench_dir / bench_io.RUNNING_NAME.format(pid=os.getpid())
    seen = []
    settle = bench_io._settle

    def check(f, size, pool, progress):
        fd = os.open(running, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        seen.append(sorted(os.listdir(bench_dir)))
        return settle(f, size, pool, progress)

    monkeypatch.setattr(bench_io, "_settle", check)
    argv = ["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--rw", "read", "--engine", "threads"]
    assert main(argv + (["--keep"] if keep else [])) == 0
    assert seen == [[running.name]]
    assert sorted(os.listdir(bench_dir)) == ([bench_io.DATA_NAME] if keep else [])


def test_the_test_file_removed_before_its_lock_is_made_again(tmp_path, monkeypatch):
    """An ``offload clean`` between the test file's creation and its flock removes it (an
    unlocked test file is a killed run's to clean); the run then made its sweep over an
    unlinked file and --keep kept nothing. The name must be the locked file: made again."""
    import fcntl

    from offload.cli import bench_io_file
    from offload.io import open_file

    path = str(tmp_path / bench_io.RUNNING_NAME.format(pid=os.getpid()))
    real, calls = fcntl.flock, []

    def clean_first(fd, op):  # the first lock comes after a clean unlinked the file
        if not calls:
            os.unlink(path)
        calls.append(op)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", clean_first)
    f = bench_io_file.locked_new_file(path, False, open_file)
    try:
        assert len(calls) == 2 and all(op == fcntl.LOCK_EX for op in calls)  # a blocking lock, twice
        assert os.stat(path).st_ino == os.fstat(f.fd).st_ino
    finally:
        f.close()


def test_keep_into_a_directory_is_refused_before_the_sweep(tmp_path, capsys):
    d = tmp_path / "disk"
    (d / bench_io.DATA_NAME).mkdir(parents=True)
    rc = main(["bench-io", "--dir", str(d), "--size", "4MiB", "--engine", "threads", "--block-size", "1M",
               "--queue-depth", "1", "--keep"])
    assert rc == 1
    assert "is a directory" in capsys.readouterr().err
    assert sorted(os.listdir(d)) == [bench_io.DATA_NAME]  # no test file made, none left


def test_keep_refuses_an_existing_file_before_the_sweep(tmp_path, capsys):
    """[Note: --keep never replaces a file]: a file named like the kept one was replaced by
    the test file (a user's data lost, silently)."""
    d = tmp_path / "disk"
    d.mkdir()
    (d / bench_io.DATA_NAME).write_text("user data")
    rc = main(["bench-io", "--dir", str(d), "--size", "4MiB", "--engine", "threads", "--block-size", "1M",
               "--queue-depth", "1", "--keep"])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"{d / bench_io.DATA_NAME} exists" in err and "remove it or pick another --dir" in err, err
    assert (d / bench_io.DATA_NAME).read_text() == "user data"
    assert sorted(os.listdir(d)) == [bench_io.DATA_NAME]  # no test file made, none left


def test_keep_does_not_replace_a_file_made_during_the_sweep(bench_dir, monkeypatch, capsys):
    settle = bench_io._settle

    def user_writes(f, size, pool, progress):
        (bench_dir / bench_io.DATA_NAME).write_text("user data")
        return settle(f, size, pool, progress)

    monkeypatch.setattr(bench_io, "_settle", user_writes)
    running = bench_io.RUNNING_NAME.format(pid=os.getpid())
    assert main(["bench-io", "--dir", str(bench_dir), "--size", "4MiB", "--rw", "read", "--engine", "threads",
                 "--keep"]) == 0
    assert (bench_dir / bench_io.DATA_NAME).read_text() == "user data"
    assert (bench_dir / running).stat().st_size == 4 << 20  # the test file, kept under its running name
    assert f"is not replaced; the test file is kept as {bench_dir / running}" in capsys.readouterr().err
