"""io layer: byte-exact round trips per engine, exact short reads, errors with errno and path,
O_DIRECT fallback, GIL release while waiting, engine choice, tuning files."""
from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import json
import logging
import os
import subprocess
import threading
import time

import pytest
import torch

from offload.config import IOConfig
from offload.io import (ENGINES, AsyncIO, IORequest, NotRegularFile, engine_unavailable_reason, load_tuning,
                        open_engine, open_file, open_regular, probe_direct, save_tuning)
from offload.io import auto as io_auto
from offload.memory import BufferPool

from _no_hang import within


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    p = BufferPool(region_bytes=32 << 20)
    yield p
    gc.collect()
    try:
        p.close()
    except BufferError:  # a failed test's traceback can hold views; test_engines_keep_no_views checks leaks
        pass


@pytest.fixture(params=ENGINES)
def engine(request):
    why = engine_unavailable_reason(request.param)
    if why is not None:  # e.g. io_uring blocked by a container's seccomp filter
        pytest.skip(f"{request.param} engine unavailable here: {why}")
    eng = open_engine(request.param, queue_depth=8, block_size=64 << 10)
    yield eng
    eng.close()


def _mount(tmp_path_factory, name, args):
    target = tmp_path_factory.mktemp(name)
    r = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mounting is not permitted here: mount {' '.join(args)}: {r.stderr.strip()}")
    return target


def _umount(target):
    subprocess.run(["umount", str(target)], capture_output=True)


@pytest.fixture(scope="module")
def small_ext4(tmp_path_factory):
    """A 4 MiB ext4 image, loop-mounted, to run out of space on."""
    img = tmp_path_factory.mktemp("img") / "small.ext4"
    with open(img, "wb") as fh:
        fh.truncate(4 << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 unavailable: {r.stderr.strip()}")
    target = _mount(tmp_path_factory, "ext4", ["-o", "loop", str(img)])
    yield target
    _umount(target)


@pytest.fixture(scope="module")
def readonly_dir(tmp_path_factory):
    """A read-only tmpfs: as root, chmod would not stop a write, a read-only mount does."""
    target = _mount(tmp_path_factory, "ro", ["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"])
    yield target
    _umount(target)


@pytest.fixture(scope="module")
def nodirect_dir(tmp_path_factory):
    """A file system that refuses O_DIRECT. tmpfs accepts it since Linux 6.6 (/dev/shm does
    here), ramfs still refuses it."""
    target = _mount(tmp_path_factory, "ramfs", ["-t", "ramfs", "ramfs"])
    ok, _ = probe_direct(target)
    if ok:
        _umount(target)
        pytest.skip("ramfs accepted O_DIRECT on this kernel; no file system here refuses it")
    yield target
    _umount(target)


def _fill(buf, seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (len(buf),), dtype=torch.uint8, generator=g).numpy().tobytes()
    buf.memoryview[:] = data
    return data


# -- round trips ------------------------------------------------------------------------------

LENGTHS = [1, 4095, 4096, 12345, 64 << 10, (64 << 10) + 4096 * 3, (1 << 20) + 7]
OFFSETS = [0, 4096 * 5, 3]


@pytest.mark.parametrize("offset", OFFSETS)
def test_round_trip_lengths_and_offsets(engine, pool, workdir, offset):
    with open_file(workdir / "f", write=True, create=True) as f:
        assert f.direct
        pos = offset
        written = []
        for i, n in enumerate(LENGTHS):
            src = pool.acquire(n)
            written.append((pos, _fill(src, i)))
            assert engine.write(f, pos, src) == n
            pool.release(src)
            pos += n + 4096  # leave holes: they must read back as zeros
        for pos, data in written:
            dst = pool.acquire(len(data))
            dst.memoryview[:] = b"\xff" * len(data)
            assert engine.read(f, pos, dst) == len(data)
            assert bytes(dst.memoryview) == data
            pool.release(dst)
        hole = bytearray(4096)
        assert engine.read(f, offset + LENGTHS[0], hole) == 4096
        assert bytes(hole) == bytes(4096)


def test_hundreds_in_flight_many_buffers_and_reopen(engine, pool, workdir):
    n, size = 300, (16 << 10) + 100  # unaligned tails too
    srcs = [pool.acquire(size) for _ in range(n)]
    datas = [_fill(b, 1000 + i) for i, b in enumerate(srcs)]
    stride = 20 << 10
    with open_file(workdir / "many", write=True, create=True, exclusive=True) as f:
        t = engine.submit([IORequest("write", f, i * stride, b) for i, b in enumerate(srcs)])
        assert engine.wait(t) == [size] * n
        f.fsync()
    st = engine.stats()
    assert st["max_inflight"] <= engine.queue_depth, st  # never overfull
    if engine.name == "uring":  # issues the whole queue at once; thread pools ramp up by timing
        assert st["max_inflight"] == engine.queue_depth, st
    with open_file(workdir / "many") as f:  # reopen read-only
        dsts = [pool.acquire(size) for _ in range(n)]
        t = engine.submit([IORequest("read", f, i * stride, b) for i, b in reversed(list(enumerate(dsts)))])
        assert engine.wait(t) == [size] * n
        for d, data in zip(dsts, datas):
            assert bytes(d.memoryview) == data
    for b in srcs + dsts:
        pool.release(b)


def test_short_read_past_eof_is_exact(engine, pool, workdir):
    with open_file(workdir / "short", write=True, create=True) as f:
        src = pool.acquire(10000)
        data = _fill(src, 7)
        assert engine.write(f, 0, src) == 10000
        assert f.size == 10000
        dst = pool.acquire(256 << 10)  # spans several blocks beyond the end
        assert engine.read(f, 0, dst) == 10000
        assert bytes(dst.memoryview[:10000]) == data
        assert engine.read(f, 8192, dst) == 10000 - 8192
        assert bytes(dst.memoryview[:1808]) == data[8192:]
        assert engine.read(f, 20000, dst) == 0
        t = engine.submit([IORequest("read", f, 0, dst[0:5000]), IORequest("read", f, 4096, dst[8192:16384 + 8192])])
        assert engine.wait(t) == [5000, 10000 - 4096]
        pool.release(src)
        pool.release(dst)


def test_engines_keep_no_views(engine, workdir):
    """After a batch (even a failed one), nothing in the engine holds a view of pool memory:
    the pool can unmap."""
    p = BufferPool(region_bytes=2 << 20)
    bufs = [p.acquire(100000) for _ in range(4)]
    with open_file(workdir / "nv", write=True, create=True) as f:
        engine.wait(engine.submit([IORequest("write", f, i * 100000, b) for i, b in enumerate(bufs)]))
        engine.wait(engine.submit([IORequest("read", f, i * 100000, b) for i, b in enumerate(bufs)]))
        bad = open_file(workdir / "nv-bad", write=True, create=True)
        os.close(bad.fd)
        with pytest.raises(OSError):
            engine.wait(engine.submit([IORequest("write", bad, 0, bufs[0])]))
        bad.fd = -1
    for b in bufs:
        p.release(b)
    del bufs
    gc.collect()
    p.close()


def test_buffer_kinds(engine, workdir):
    with open_file(workdir / "kinds", write=True, create=True) as f:
        t = torch.arange(3000, dtype=torch.float32)
        assert engine.write(f, 0, t) == 12000
        assert engine.write(f, 12000, b"tail bytes") == 10
        back = torch.empty(3000, dtype=torch.float32)
        assert engine.read(f, 0, back) == 12000
        assert torch.equal(back, t)
        ba = bytearray(10)
        assert engine.read(f, 12000, memoryview(ba)) == 10 and bytes(ba) == b"tail bytes"
        with pytest.raises(ValueError, match="writable"):
            engine.read(f, 0, b"read-only")
        with pytest.raises(ValueError, match="contiguous"):
            engine.write(f, 0, torch.zeros(4, 4).t())


def test_progress_while_the_submitter_computes(engine, pool, workdir):
    """The swap pipeline submits, computes (holding the GIL), then waits: the queue must be
    refilled meanwhile, so the batch is done without any call into the engine."""
    buf = pool.acquire(4 << 20)
    _fill(buf, 3)
    with open_file(workdir / "bg", write=True, create=True) as f:
        t = engine.submit([IORequest("write", f, 0, buf)])  # 64 pieces, queue depth 8
        deadline = time.monotonic() + 10
        x = 0
        while not engine.poll(t) and time.monotonic() < deadline:
            for i in range(20000):  # pure-Python compute, GIL held
                x += i
        assert engine.poll(t)
        assert engine.wait(t) == [4 << 20]
    pool.release(buf)


def test_concurrent_submitters(engine, pool, workdir):
    errors = []

    def worker(k):
        try:
            b = pool.acquire(300 << 10)
            data = _fill(b, 50 + k)
            with open_file(workdir / f"c{k}", write=True, create=True) as f:
                for _ in range(5):
                    assert engine.write(f, 0, b) == len(data)
                    b.memoryview[:] = bytes(len(data))
                    assert engine.read(f, 0, b) == len(data)
                    assert bytes(b.memoryview) == data
            pool.release(b)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


# -- errors -----------------------------------------------------------------------------------

def test_missing_directory(tmp_path):
    missing = tmp_path / "nope" / "f"
    with pytest.raises(OSError) as ei:
        open_file(missing, write=True, create=True)
    assert ei.value.errno == errno.ENOENT and ei.value.filename == str(missing)
    with pytest.raises(OSError) as ei:
        open_engine("auto", directory=tmp_path / "nope")
    assert ei.value.errno == errno.ENOENT and ei.value.filename == str(tmp_path / "nope")


def test_readonly_directory(readonly_dir):
    path = readonly_dir / "f"
    with pytest.raises(OSError) as ei:
        open_file(path, write=True, create=True)
    assert ei.value.errno == errno.EROFS and ei.value.filename == str(path)
    with pytest.raises(OSError) as ei:
        probe_direct(readonly_dir, refresh=True)
    assert ei.value.errno == errno.EROFS and ei.value.filename == str(readonly_dir)


def test_bad_fd_reports_errno_and_path(engine, workdir):
    f = open_file(workdir / "bad", write=True, create=True)
    os.close(f.fd)  # closed behind the IOFile's back
    with pytest.raises(OSError) as ei:
        engine.write(f, 0, bytearray(8192))
    assert ei.value.errno == errno.EBADF and ei.value.filename == str(workdir / "bad")
    assert "write of" in str(ei.value)
    f.fd = -1  # the descriptor is gone; do not close a number someone else may own now


def test_write_to_read_only_file_is_refused(engine, workdir):
    (workdir / "ro").write_bytes(b"x")
    with open_file(workdir / "ro") as f:
        with pytest.raises(OSError) as ei:
            engine.write(f, 0, b"y")
        assert ei.value.errno == errno.EBADF and ei.value.filename == str(workdir / "ro")


def test_one_failing_request_fails_the_batch_after_all_finish(engine, pool, workdir):
    good = open_file(workdir / "good", write=True, create=True)
    bad = open_file(workdir / "bad2", write=True, create=True)
    os.close(bad.fd)
    buf = pool.acquire(1 << 20)
    t = engine.submit([IORequest("write", good, 0, buf), IORequest("write", bad, 0, buf[0:4096])])
    with pytest.raises(OSError) as ei:
        engine.wait(t)
    assert ei.value.errno == errno.EBADF and ei.value.filename == str(workdir / "bad2")
    assert t.done and t._pending == 0
    bad.fd = -1
    good.close()
    pool.release(buf)


def test_enospc_on_a_full_file_system(engine, pool, small_ext4):
    buf = pool.acquire(8 << 20)
    path = small_ext4 / f"fill-{engine.name}"
    with open_file(path, write=True, create=True) as f:
        with pytest.raises(OSError) as ei:
            engine.write(f, 0, buf)
        assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(path)
        with pytest.raises(OSError) as ei:
            f.preallocate(8 << 20)
        assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(path)
    os.unlink(path)
    pool.release(buf)


def test_open_file_options(workdir):
    p = workdir / "x"
    open_file(p, write=True, create=True, exclusive=True).close()
    with pytest.raises(OSError) as ei:
        open_file(p, write=True, create=True, exclusive=True)
    assert ei.value.errno == errno.EEXIST and ei.value.filename == str(p)
    os.symlink(p, workdir / "link")
    with pytest.raises(OSError) as ei:
        open_file(workdir / "link")
    assert ei.value.errno == errno.ELOOP and "symbolic link" in str(ei.value)
    open_file(workdir / "link", nofollow=False).close()
    with pytest.raises(ValueError):
        open_file(p, create=True)
    with pytest.raises(ValueError):
        open_file(p, write=True, exclusive=True)
    with open_file(p, write=True, direct=False) as f:
        assert not f.direct
        f.preallocate(1 << 20)
        assert f.size == 1 << 20
        f.truncate(4096)
        assert f.size == 4096


def test_direct_refused_falls_back_and_says_so(nodirect_dir, caplog, pool):
    ok, why = probe_direct(nodirect_dir)
    assert not ok and "O_DIRECT refused" in why
    with caplog.at_level(logging.WARNING, logger="offload.io.files"):
        f = open_file(nodirect_dir / "f", write=True, create=True, exclusive=True)
    assert not f.direct
    assert any("O_DIRECT refused" in r.getMessage() and str(nodirect_dir) in r.getMessage() for r in caplog.records)
    with pytest.raises(OSError) as ei:
        open_file(nodirect_dir / "g", write=True, create=True, direct=True)
    assert ei.value.errno == errno.EINVAL and ei.value.filename == str(nodirect_dir / "g")
    eng = open_engine("auto", directory=nodirect_dir)
    try:
        assert eng.name == "threads" and eng.direct is False and "O_DIRECT" in eng.reason
        src = pool.acquire(10000)
        data = _fill(src, 9)
        assert eng.write(f, 0, src) == 10000
        back = bytearray(10000)
        assert eng.read(f, 0, back) == 10000 and bytes(back) == data
        pool.release(src)
    finally:
        eng.close()
        f.close()
    with pytest.raises(OSError) as ei:
        open_engine("auto", directory=nodirect_dir, direct=True)
    assert ei.value.errno == errno.EINVAL


def test_dev_shm_tmpfs_probe_matches_open(tmp_path):
    """tmpfs refused O_DIRECT before Linux 6.6 and accepts it since: whatever this kernel does,
    the probe, open_file and open_engine must agree (ramfs above covers the refusal)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    ok, why = probe_direct("/dev/shm", refresh=True)
    path = f"/dev/shm/offload-test-{os.getpid()}"
    try:
        with open_file(path, write=True, create=True, exclusive=True) as f:
            assert f.direct == ok, why
        with open_engine("auto", directory="/dev/shm") as eng:
            assert (eng.direct is False) == (not ok)
    finally:
        os.unlink(path)


def test_bad_requests(engine, workdir):
    with open_file(workdir / "r", write=True, create=True) as f:
        with pytest.raises(ValueError, match="op"):
            IORequest("append", f, 0, bytearray(1))
        with pytest.raises(ValueError, match="offset"):
            IORequest("read", f, -1, bytearray(1))
        with pytest.raises(ValueError, match="IOFile"):
            IORequest("read", 3, 0, bytearray(1))
        with pytest.raises(ValueError, match="IORequest"):
            engine.submit([("read", f, 0, bytearray(1))])
        other = open_engine("threads")
        t = other.submit([])
        assert other.poll(t) and other.wait(t) == []
        with pytest.raises(ValueError, match="another engine"):
            engine.wait(t)
        other.close()
        with pytest.raises(ValueError, match="closed"):
            other.submit([])


# -- the GIL ----------------------------------------------------------------------------------

def _count_for(seconds_fn):
    stop = threading.Event()
    out = {}

    def counter():
        n = 0
        t0 = time.perf_counter()
        while not stop.is_set():
            n += 1
        out["rate"] = n / (time.perf_counter() - t0)

    th = threading.Thread(target=counter)
    th.start()
    seconds_fn()
    stop.set()
    th.join()
    return out["rate"]


def test_waiting_releases_the_gil(engine, pool, workdir):
    size = 32 << 20
    buf = pool.acquire(size)
    with open_file(workdir / "gil", write=True, create=True) as f:
        assert engine.write(f, 0, buf) == size
        waited = []

        def io_for_a_while():
            t_end = time.perf_counter() + 0.4
            while time.perf_counter() < t_end:
                t = engine.submit([IORequest("read", f, 0, buf)])
                t0 = time.perf_counter()
                engine.wait(t)
                waited.append(time.perf_counter() - t0)

        # Idle rate before and after, the lower one counts: the machine's load may change in
        # between, and a waiter holding the GIL would leave the counter at 3-5 %, far below.
        # On 2 cores the engine's own threads (the uring reaper takes the GIL for each
        # completion) and the kernel's I/O work share them with the counter: 50 % was seen
        # to fail at 49.6 % in a clean-clone CI run, so the bar is 25 %, still 5x a holder.
        idle = _count_for(lambda: time.sleep(0.3))
        busy = _count_for(io_for_a_while)
        idle = min(idle, _count_for(lambda: time.sleep(0.3)))
    pool.release(buf)
    assert sum(waited) > 0.2  # the main thread really spent its time waiting
    assert busy > 0.25 * idle, f"counting thread ran at {busy / idle:.0%} of its speed while {engine.name} waited"


# -- choosing an engine -----------------------------------------------------------------------

def test_auto_picks_uring_with_direct(workdir, monkeypatch):
    monkeypatch.delenv("OFFLOAD_IO_ENGINE", raising=False)
    if io_auto._uring_reason() is not None:
        pytest.skip(f"io_uring unavailable here: {io_auto._uring_reason()}")
    with open_engine("auto", directory=workdir) as eng:
        assert eng.name == "uring" and "O_DIRECT" in eng.reason


def test_env_forces_an_engine(monkeypatch):
    monkeypatch.setenv("OFFLOAD_IO_ENGINE", "threads")
    with open_engine() as eng:
        assert eng.name == "threads" and "OFFLOAD_IO_ENGINE" in eng.reason
    with open_engine("aiofiles") as eng:  # an explicit name beats the variable
        assert eng.name == "aiofiles"
    monkeypatch.setenv("OFFLOAD_IO_ENGINE", "spdk")
    with pytest.raises(ValueError, match="OFFLOAD_IO_ENGINE"):
        open_engine()
    with pytest.raises(ValueError, match="unknown io engine"):
        open_engine("spdk")


def test_engine_status_for_offload_info(monkeypatch):
    from offload.io import engine_status

    monkeypatch.delenv("OFFLOAD_IO_ENGINE", raising=False)
    st = engine_status()
    assert st["threads"] == "available" and st["env OFFLOAD_IO_ENGINE"] == "unset"
    monkeypatch.setattr(io_auto, "_uring_reason", lambda: "blocked by seccomp")
    st = engine_status()
    assert st["uring"] == "unavailable: blocked by seccomp" and st["auto picks"].startswith("threads")
    monkeypatch.setenv("OFFLOAD_IO_ENGINE", "aiofiles")
    assert engine_status()["auto picks"].startswith("aiofiles (forced")


def test_forced_engine_that_cannot_work_is_an_error(monkeypatch):
    blocked = "io_uring_queue_init failed: Operation not permitted (blocked by a seccomp filter)"
    monkeypatch.setattr(io_auto, "_uring_reason", lambda: blocked)
    monkeypatch.setenv("OFFLOAD_IO_ENGINE", "uring")
    with pytest.raises(RuntimeError, match="cannot work here.*seccomp"):
        open_engine()
    monkeypatch.delenv("OFFLOAD_IO_ENGINE")
    with pytest.raises(RuntimeError, match="'uring'.*cannot work"):
        open_engine("uring")
    with open_engine("auto") as eng:  # auto falls back, and says why
        assert eng.name == "threads" and "io_uring unavailable" in eng.reason


@pytest.fixture
def binding_probe(monkeypatch):
    """Swap the child script that exercises python-liburing; the cached verdict is recomputed
    before and after, so the rest of the process sees the real one."""
    from offload.io import uring_ring

    uring_ring._binding_crash_reason.cache_clear()

    def use(script: str):
        monkeypatch.setattr(uring_ring, "_BINDING_PROBE", script)
        uring_ring._binding_crash_reason.cache_clear()
        return uring_ring

    yield use
    monkeypatch.undo()
    uring_ring._binding_crash_reason.cache_clear()


def test_a_binding_that_kills_its_probe_is_a_reason_not_a_crash(binding_probe):
    # python-liburing 2026.3.x executes AVX-512 in Ring(): SIGILL on an AVX2-only CPU, which
    # no try can catch. The child dies instead of us, and io_uring is unavailable, saying why.
    ring = binding_probe("import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    why = ring._binding_crash_reason()
    assert why is not None and "SIGILL" in why and "illegal instruction" in why and "python-liburing" in why
    assert ring.uring_unavailable_reason() == why
    with pytest.raises(RuntimeError, match="SIGILL"):
        ring._liburing()
    ring = binding_probe("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    why = ring._binding_crash_reason()
    assert "SIGSEGV" in why and "illegal" not in why
    ring = binding_probe("import sys; sys.stderr.write('first\\nno such call\\n'); sys.exit(3)")
    assert ring._binding_crash_reason().endswith("failed its probe (exit 3: no such call)")
    ring = binding_probe("pass")
    assert ring._binding_crash_reason() is None


def test_a_probe_child_that_cannot_start_keeps_the_binding_out_of_this_process(binding_probe, monkeypatch):
    # Run as a user who may not exec sys.executable (a venv whose python lives under /root), the
    # child could not start and the binding was then probed in this process: SIGILL on a CPU
    # without AVX-512. Without a child to sacrifice the binding is not used at all.
    ring = binding_probe("pass")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/root/venv/bin/python")

    monkeypatch.setattr(ring.subprocess, "run", refuse)
    why = ring._binding_crash_reason()
    assert why is not None and "not probed" in why and "Permission denied" in why
    assert ring.uring_unavailable_reason() == why
    with pytest.raises(RuntimeError, match="not probed"):
        ring._liburing()


def test_the_real_binding_probe_agrees_with_the_engine():
    from offload.io import uring_ring

    if uring_ring._binding_crash_reason() is not None:
        pytest.skip(f"python-liburing cannot run here: {uring_ring._binding_crash_reason()}")
    if uring_ring.uring_unavailable_reason() is not None:
        pytest.skip(f"io_uring unavailable here: {uring_ring.uring_unavailable_reason()}")
    with open_engine("uring") as eng:  # the probe said yes, so the binding's calls run in this process
        assert eng.name == "uring"


# -- tuning files -----------------------------------------------------------------------------

def test_tuned_setting_takes_effect(tmp_path, pool, workdir, monkeypatch):
    monkeypatch.delenv("OFFLOAD_IO_ENGINE", raising=False)
    path = tmp_path / "tune.json"
    save_tuning(path, IOConfig(engine="threads", queue_depth=3, block_size=128 << 10, direct=True),
                read_gbps=1.5, write_gbps=2.5, directory=str(workdir))
    cfg = load_tuning(path)
    assert cfg == IOConfig(engine="threads", queue_depth=3, block_size=128 << 10, direct=True)
    with open_engine(cfg, directory=workdir) as eng:
        assert (eng.name, eng.queue_depth, eng.block_size, eng.direct) == ("threads", 3, 128 << 10, True)
        buf = pool.acquire(4 << 20)
        with eng.open(workdir / "tuned", write=True, create=True) as f:
            assert f.direct
            t = eng.submit([IORequest("write", f, 0, buf)])
            eng.wait(t)
            st = eng.stats()
            assert st["pieces"] == (4 << 20) // (128 << 10)  # split at the tuned block size
            # at the tuned queue depth: never more; 3 at once unless a loaded box lets each piece
            # finish before the next starts (seen with two suites on 2 cores), so a few more writes
            for _ in range(20):
                if eng.stats()["max_inflight"] >= 3:
                    break
                eng.wait(eng.submit([IORequest("write", f, 0, buf)]))
        assert eng.stats()["max_inflight"] == 3
        pool.release(buf)


def test_bad_tuning_files(tmp_path):
    good = {"schema": "offload-io-tuning/1", "engine": "uring", "block_size": 1 << 20, "queue_depth": 32,
            "direct": True}
    cases = [
        ({**good, "io_engine": "uring"}, "unknown tuning key"),
        ({k: v for k, v in good.items() if k != "queue_depth"}, "missing"),
        ({**good, "schema": "ds_nvme_tune"}, "schema"),
        ({**good, "block_size": 1000}, "block_size"),
        ({**good, "engine": "spdk"}, "unknown io engine"),
        ({**good, "direct": "yes"}, "direct"),
    ]
    for data, msg in cases:
        p = tmp_path / "t.json"
        p.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=msg):
            load_tuning(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON"):
        load_tuning(p)
    with pytest.raises(OSError):
        load_tuning(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="auto"):
        save_tuning(tmp_path / "x.json", IOConfig())


# -- the asyncio face -------------------------------------------------------------------------

def test_asyncio_face_round_trip_and_errors(pool, workdir):
    srcs = [pool.acquire((100 << 10) + i) for i in range(6)]
    datas = [_fill(b, 70 + i) for i, b in enumerate(srcs)]

    async def main():
        async with AsyncIO(queue_depth=4, block_size=32 << 10) as aio:
            with open_file(workdir / "aio", write=True, create=True) as f:
                counts = await asyncio.gather(*(aio.write(f, i * (128 << 10), b) for i, b in enumerate(srcs)))
                assert counts == [len(d) for d in datas]
                dsts = [bytearray(len(d) + 5000) for d in datas]
                got = await aio.run([IORequest("read", f, i * (128 << 10), d) for i, d in enumerate(dsts)])
                assert got[:-1] == [len(d) + 5000 for d in datas[:-1]] and got[-1] == len(datas[-1])
                for d, data in zip(dsts, datas):
                    assert bytes(d[:len(data)]) == data
                assert aio.stats()["max_inflight"] <= 4
            bad = open_file(workdir / "aio-bad", write=True, create=True)
            os.close(bad.fd)
            with pytest.raises(OSError) as ei:
                await aio.read(bad, 0, bytearray(10))
            assert ei.value.errno == errno.EBADF and ei.value.filename == str(workdir / "aio-bad")
            bad.fd = -1

    asyncio.run(main())
    for b in srcs:
        pool.release(b)


def test_dropped_engine_releases_its_threads(workdir):
    """An engine dropped without close() must not leave its reaper (or loop) thread behind."""
    before = {t.ident for t in threading.enumerate()}
    for name in ENGINES:
        if engine_unavailable_reason(name) is not None:
            continue
        eng = open_engine(name, queue_depth=4)
        with open_file(workdir / f"drop-{name}", write=True, create=True) as f:
            assert eng.write(f, 0, bytearray(10000)) == 10000
        del eng
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, [t.name for t in extra]


def test_a_ring_made_with_stdin_closed():
    """With fd 0 closed (a daemon, ``cmd <&-``) python-liburing's ring landed on fd 0, which it
    takes for a ring never set up: `offload info` failed ("io_uring_queue_exit(ring) not
    initialized") and so would the engine. /dev/null holds fd 0 while a ring is made."""
    import sys

    from offload.io import uring_ring

    why = uring_ring.uring_unavailable_reason()
    if why is not None:
        pytest.skip(f"io_uring unavailable here: {why}")
    code = ("import os\n"
            "os.close(0)\n"
            "from offload.io.uring_ring import uring_unavailable_reason\n"
            "assert uring_unavailable_reason() is None, uring_unavailable_reason()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    out = subprocess.run([sys.executable, "-m", "offload", "info"], timeout=120, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(0))
    assert out.returncode == 0 and "not initialized" not in out.stderr, out.stderr


# ------------------------------------------------------------------ files that are no regular file
@pytest.mark.parametrize("write", [False, True])
def test_open_file_refuses_a_fifo_at_once_naming_it(tmp_path, write):
    """A FIFO in place of a swap or checkpoint file blocked the open until a writer (a reader)
    came: forever ([Note: a FIFO where a file was] in offload/io/files.py)."""
    fifo = str(tmp_path / "slot0.bin")
    os.mkfifo(fifo)
    with within(5), pytest.raises(NotRegularFile, match=r"not a regular file \(a FIFO\)") as e:
        open_file(fifo, write=write)
    assert e.value.filename == fifo and e.value.errno == errno.EINVAL


def test_open_regular_refuses_a_write_only_fifo_and_a_directory(tmp_path):
    fifo = str(tmp_path / "reserve.bin")
    os.mkfifo(fifo)
    with within(5), pytest.raises(NotRegularFile, match=r"not a regular file \(a FIFO\)") as e:
        open_regular(fifo, os.O_WRONLY | os.O_CREAT)  # no reader: ENXIO at once, told by lstat
    assert e.value.filename == fifo
    with pytest.raises(NotRegularFile, match=r"not a regular file \(a directory\)") as e:
        open_regular(str(tmp_path), os.O_RDONLY)
    assert isinstance(e.value, IsADirectoryError) and e.value.filename == str(tmp_path)


def test_open_regular_gives_a_blocking_descriptor(tmp_path):
    fd = open_regular(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
    try:
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
    finally:
        os.close(fd)


def test_open_file_lets_an_exception_without_errno_through(tmp_path, monkeypatch):
    """A signal handler's TimeoutError raised inside the open was turned into EIO."""
    from offload.io import files

    def _timeout(*_a, **_k):
        raise TimeoutError("a watchdog")

    monkeypatch.setattr(files, "open_regular", _timeout)
    with pytest.raises(TimeoutError, match="a watchdog") as e:
        files.open_file(str(tmp_path / "f"))
    assert e.value.errno is None
