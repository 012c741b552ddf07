"""uring registered (fixed) buffers: byte-exact through them, fallbacks that say why, and the
swap pipeline registering its buffers (see [Note: fixed buffers] in offload/io/uring.py)."""
from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from offload.io import engine_unavailable_reason, open_engine, open_file
from offload.io import uring as uring_mod
from offload.memory import BufferPool
import _internals as internals

pytestmark = pytest.mark.skipif(engine_unavailable_reason("uring") is not None,
                                reason=f"uring engine unavailable here: {engine_unavailable_reason('uring')}")


@pytest.fixture
def pool():
    p = BufferPool(region_bytes=8 << 20)
    yield p
    p.close()


@pytest.fixture
def eng():
    e = open_engine("uring", queue_depth=8, block_size=64 << 10)
    yield e
    e.close()


def _fixed_available(e, buf):
    h = e.register_buffers([buf])
    if h is None:
        pytest.skip(f"registered buffers unavailable here: {e.fixed_buffers_reason}")
    return h


def _fill(mv, seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (len(mv),), dtype=torch.uint8, generator=g).numpy().tobytes()
    mv[:] = data
    return data


@pytest.mark.parametrize("length,offset", [(4096, 0), ((1 << 20) + 4096 * 3, 4096 * 7), (12345, 3),
                                           ((256 << 10) + 100, 8192)])
def test_round_trip_through_registered_buffers(eng, pool, workdir, length, offset):
    src, dst = pool.acquire(length), pool.acquire(length)
    h = _fixed_available(eng, src)
    h2 = eng.register_buffers([dst])
    assert h2 is not None
    data = _fill(src.memoryview, length)
    with open_file(workdir / "f", write=True, create=True) as f:
        assert eng.write(f, offset, src) == length
        dst.memoryview[:] = b"\xee" * length
        assert eng.read(f, offset, dst) == length
    assert bytes(dst.memoryview) == data
    # through the table, O_DIRECT or (unaligned) the buffered descriptor alike
    assert eng.stats()["fixed_pieces"] > 0
    eng.unregister_buffers(h)
    eng.unregister_buffers(h2)
    pool.release(src)
    pool.release(dst)


def test_buffer_outside_the_table_and_after_unregister_goes_plain(eng, pool, workdir):
    reg, other = pool.acquire(64 << 10), pool.acquire(64 << 10)
    h = _fixed_available(eng, reg)
    with open_file(workdir / "g", write=True, create=True) as f:
        data = _fill(other.memoryview, 1)
        before = eng.stats()["fixed_pieces"]
        assert eng.write(f, 0, other) == len(data)
        assert eng.stats()["fixed_pieces"] == before  # not registered: a plain writev
        assert eng.read(f, 0, reg) == len(data)
        assert eng.stats()["fixed_pieces"] == before + 1
        assert bytes(reg.memoryview) == data
        eng.unregister_buffers(h)
        reg.memoryview[:] = bytes(len(data))
        assert eng.read(f, 0, reg) == len(data)
        assert eng.stats()["fixed_pieces"] == before + 1  # gone from the table
        assert bytes(reg.memoryview) == data
    pool.release(reg)
    pool.release(other)


def test_large_buffers_take_several_slots_and_pieces_across_them_go_plain(eng, pool, workdir, monkeypatch):
    # The kernel's 1 GiB per slot, scaled down: 256 KiB slots over a 1 MiB buffer.
    monkeypatch.setattr(uring_mod, "_FIXED_MAX_BYTES", 256 << 10)
    buf = pool.acquire(1 << 20)
    h = _fixed_available(eng, buf)
    assert len(eng._handles[h]) == 4
    data = _fill(buf.memoryview, 2)
    with open_file(workdir / "h", write=True, create=True) as f:
        # 64 KiB pieces from an offset of 32 KiB into the buffer: those straddling a slot
        # boundary (3 of them) go plain, the rest fixed; bytes are exact either way
        view = buf.memoryview[32 << 10: (32 << 10) + (512 << 10)]
        before = eng.stats()["fixed_pieces"]
        assert eng.write(f, 0, view) == len(view)
        assert eng.stats()["fixed_pieces"] - before == 8 - 2
        back = pool.acquire(512 << 10)
        assert eng.read(f, 0, back) == len(view)
        assert bytes(back.memoryview) == data[32 << 10: (32 << 10) + (512 << 10)]
        pool.release(back)
    del view
    eng.unregister_buffers(h)
    assert not eng._handles and len(eng._fixed._free) == uring_mod._FIXED_SLOTS
    pool.release(buf)


def test_refused_registration_is_logged_and_io_still_works(eng, pool, workdir, monkeypatch, caplog):
    def refuse(fd, opcode, arg, nr):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(uring_mod, "_ring_register", refuse)
    buf = pool.acquire(64 << 10)
    with caplog.at_level(logging.INFO, logger="offload.io.uring"):
        assert eng.register_buffers([buf]) is None
    assert "ulimit -l" in caplog.text and "Cannot allocate memory" in caplog.text
    data = _fill(buf.memoryview, 3)
    with open_file(workdir / "k", write=True, create=True) as f:
        assert eng.write(f, 0, buf) == len(data)
        buf.memoryview[:] = bytes(len(data))
        assert eng.read(f, 0, buf) == len(data)
    assert bytes(buf.memoryview) == data
    assert eng.stats()["fixed_pieces"] == 0
    pool.release(buf)


def test_kernel_without_the_opcodes_falls_back(eng, pool, monkeypatch, caplog):
    monkeypatch.setattr(uring_mod.UringEngine, "_fixed_supported",
                        lambda self: "the kernel lacks IORING_OP_READV_FIXED / WRITEV_FIXED (Linux 6.15+)")
    buf = pool.acquire(4096)
    with caplog.at_level(logging.INFO, logger="offload.io.uring"):
        assert eng.register_buffers([buf]) is None
    assert "Linux 6.15+" in caplog.text
    pool.release(buf)


def test_other_engines_register_nothing(pool):
    buf = pool.acquire(4096)
    with open_engine("threads", queue_depth=2) as e:
        assert e.register_buffers([buf]) is None
        e.unregister_buffers(None)
    pool.release(buf)


def test_closed_engine_refuses_registration(pool):
    e = open_engine("uring", queue_depth=2)
    e.close()
    buf = pool.acquire(4096)
    with pytest.raises(RuntimeError, match="closed or broken"):
        e.register_buffers([buf])
    pool.release(buf)


def test_swap_pipeline_registers_its_buffers_and_releases_them(workdir):
    import offload

    params = [torch.nn.Parameter(torch.randn(50_000)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = offload.AdamW(params, lr=1e-3, offload="nvme", swap_dir=str(workdir), io_engine="uring")
    opt.step()
    eng_ = internals.swap(opt).store.engine  # SwappedState -> SwapStore -> its engine
    assert isinstance(eng_, uring_mod.UringEngine)
    if eng_.fixed_buffers_reason is not None:
        pytest.skip(f"registered buffers unavailable here: {eng_.fixed_buffers_reason}")
    assert eng_.stats()["fixed_pieces"] > 0 and eng_._handles
    # the report says how much the ring keeps page-locked (the pipeline's buffers)
    locked = opt.memory_report()["detail"]["io_locked_bytes"]
    assert locked == sum(b.capacity for b in internals.swap(opt).pipeline.buffers) > 0
    opt.close()
    assert not eng_._handles  # unregistered before the pipeline's pool was unmapped


def test_offload_info_says_whether_buffers_can_be_registered(monkeypatch):
    from offload.io import engine_status

    st = engine_status()["uring registered buffers"]
    assert st.startswith("yes (they count against RLIMIT_MEMLOCK") or st.startswith("no: "), st
    monkeypatch.setattr(uring_mod.UringEngine, "_fixed_supported", lambda self: "the kernel lacks it (test)")
    assert engine_status()["uring registered buffers"] == "no: the kernel lacks it (test)"


def _vm_flags(addr):
    """The VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    lo = hi = None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and len(head.split("-")) == 2 and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(x, 16) for x in head.split("-"))
                lo, hi = a, b
            elif line.startswith("VmFlags:") and lo is not None and lo <= addr < hi:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_registered_buffers_are_left_out_of_fork(eng, pool):
    # Pinned pages cannot be shared copy-on-write: fork() would copy them all into the child
    # (a DataLoader worker). While registered, the buffer is MADV_DONTFORK ("dc").
    buf = pool.acquire(1 << 20)
    addr = buf.data_ptr
    assert "dc" not in _vm_flags(addr)
    h = _fixed_available(eng, buf)
    assert "dc" in _vm_flags(addr)
    eng.unregister_buffers(h)
    assert "dc" not in _vm_flags(addr)
    # a buffer that is not whole pages (a bytearray on the heap) is registered but never
    # marked: its pages hold other objects the child needs
    small = bytearray(5000)
    h = eng.register_buffers([small])
    assert h is not None and eng._dontfork[h] == []
    eng.unregister_buffers(h)
    pool.release(buf)


def test_a_forked_child_unregistering_leaves_the_parents_table_alone(eng, pool, workdir):
    # The ring (and its table of registered buffers) is shared with a forked child: an
    # unregister there (a child closing the parent's optimizer with keep_swap=True) emptied the
    # parent's slots, and its next read into them failed with EFAULT ("Bad address").
    reg = pool.acquire(64 << 10)
    h = _fixed_available(eng, reg)
    pid = os.fork()
    if pid == 0:
        try:
            eng.unregister_buffers(h)
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    with open_file(workdir / "k", write=True, create=True) as f:
        data = _fill(reg.memoryview, 3)
        before = eng.stats()["fixed_pieces"]
        assert eng.write(f, 0, reg) == len(data)
        reg.memoryview[:] = bytes(len(data))
        assert eng.read(f, 0, reg) == len(data)
        assert eng.stats()["fixed_pieces"] == before + 2  # still through the table
        assert bytes(reg.memoryview) == data
    eng.unregister_buffers(h)
    pool.release(reg)
