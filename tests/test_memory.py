"""BufferPool and accounting: alignment, reuse without growth, zero-copy views, real unmapping."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from offload.memory import HUGE_PAGE, Accounting, BufferPool, default_accounting

ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
    torch.uint64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
]


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.fixture
def pool():
    p = BufferPool(region_bytes=8 << 20)
    yield p
    # A full collection only when views are still alive: late in the suite the heap is large
    # and gc.collect() takes ~0.7 s, for each of this module's ~20 tests.
    try:
        p.close()
    except BufferError:  # views held by reference cycles: collect them, close what is left
        gc.collect()
        p.close()


def test_buffers_are_aligned_and_disjoint(pool):
    sizes = [1, 7, 4095, 4096, 4097, 65536 + 3, 1 << 20, (3 << 20) + 1, 9 << 20]
    bufs = [pool.acquire(n) for n in sizes]
    spans = []
    for b, n in zip(bufs, sizes):
        assert b.nbytes == n and b.capacity % 4096 == 0 and b.capacity >= n
        assert b.data_ptr % 4096 == 0
        spans.append((b.data_ptr, b.data_ptr + b.capacity))
    spans.sort()
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, "two live buffers overlap"
    for r in pool._regions:
        assert r.address % HUGE_PAGE == 0 and r.size % HUGE_PAGE == 0
    # A request larger than region_bytes gets a region of its own size.
    assert any(r.size >= 9 << 20 for r in pool._regions)


def test_alignment_option():
    with BufferPool(region_bytes=4 << 20, alignment=64 << 10) as p:
        bufs = [p.acquire(n) for n in (1, 5000, 70000)]
        assert all(b.data_ptr % (64 << 10) == 0 for b in bufs)
        for b in bufs:
            p.release(b)
    with pytest.raises(ValueError, match="alignment"):
        BufferPool(alignment=1000)


def test_release_then_acquire_reuses_same_memory(pool):
    a = pool.acquire(1 << 20)
    ptr = a.data_ptr
    pool.release(a)
    b = pool.acquire(1 << 20)
    assert b.data_ptr == ptr
    assert pool.stats()["reuses"] == 1


def test_no_growth_over_1000_cycles(pool):
    rng = random.Random(0)
    live = []
    for _ in range(50):  # warm up to the steady-state working set
        live.append(pool.acquire(rng.choice([4096, 10000, 1 << 16, 300000])))
    reserved = pool.stats()["reserved_bytes"]
    for _ in range(1000):
        pool.release(live.pop(rng.randrange(len(live))))
        live.append(pool.acquire(rng.choice([4096, 10000, 1 << 16, 300000])))
    st = pool.stats()
    assert st["reserved_bytes"] == reserved, st
    assert st["buffers_in_use"] == 50
    for b in live:
        pool.release(b)
    st = pool.stats()
    assert st["in_use_bytes"] == 0 and st["free_bytes"] == st["reserved_bytes"]
    # Everything merged back: each region is one free extent again.
    assert all(len(v) == 1 for v in pool._free_off.values())


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_tensor_view_of_every_dtype_is_zero_copy(pool, dtype):
    buf = pool.acquire(4096 * 3 + 17)
    size = torch.empty((), dtype=dtype).element_size()
    ref = torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8)
    buf.memoryview[:] = ref.numpy().tobytes()
    off = 2 * 4096
    t = buf.tensor(dtype, offset_bytes=off)
    assert t.dtype == dtype and t.numel() == (buf.nbytes - off) // size
    assert t.data_ptr() == buf.data_ptr + off
    # Bytes seen through the tensor are exactly the buffer's bytes...
    n = t.numel() * size
    assert torch.equal(t.view(torch.uint8), ref[off:off + n])
    # ...and writes through the tensor land in the buffer.
    t.view(torch.uint8).fill_(0xA5)
    assert bytes(buf.memoryview[off:off + n]) == b"\xa5" * n
    assert bytes(buf.memoryview[:off]) == ref[:off].numpy().tobytes()
    part = buf.tensor(dtype, numel=3, offset_bytes=size)
    assert part.numel() == 3 and part.data_ptr() == buf.data_ptr + size
    del t, part


def test_tensor_view_bad_arguments(pool):
    buf = pool.acquire(4096)
    with pytest.raises(ValueError, match="multiple of 4"):
        buf.tensor(torch.float32, offset_bytes=2)
    with pytest.raises(ValueError, match="does not fit"):
        buf.tensor(torch.float32, numel=1025)
    with pytest.raises(ValueError, match="torch.dtype"):
        buf.tensor("float32")
    with pytest.raises(ValueError, match="outside"):
        buf.view(4000, 200)
    assert len(buf[10:20]) == 10


def test_acquire_and_release_errors(pool):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            pool.acquire(bad)
    b = pool.acquire(10)
    pool.release(b)
    with pytest.raises(ValueError, match="twice"):
        pool.release(b)
    with pytest.raises(ValueError, match="released"):
        b.memoryview
    with BufferPool(region_bytes=2 << 20) as other:
        c = other.acquire(10)
        with pytest.raises(ValueError, match="does not belong"):
            pool.release(c)
        other.release(c)


def test_max_bytes_is_enforced():
    with BufferPool(region_bytes=2 << 20, max_bytes=4 << 20) as p:
        a = p.acquire(2 << 20)
        b = p.acquire(2 << 20)
        with pytest.raises(MemoryError, match="max_bytes"):
            p.acquire(1)
        p.release(a)
        c = p.acquire(1)  # freed space is used before mapping more
        p.release(b)
        p.release(c)


def test_huge_pages_are_obtained():
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
        if "[never]" in fh.read():
            pytest.skip("transparent huge pages are disabled on this machine")
    with BufferPool(region_bytes=8 << 20) as p:
        p.reserve(8 << 20)
        st = p.stats(huge_pages=True)
        # Most of a touched, advised region should be huge pages (the kernel may fall short
        # under fragmentation, hence not all of it).
        assert st["huge_page_bytes"] >= st["reserved_bytes"] // 2, st


def test_close_unmaps_and_refuses_while_views_live():
    acct = Accounting()
    p = BufferPool(pin=False, region_bytes=2 << 20, accounting=acct)  # pageable on a GPU machine too
    buf = p.acquire(8192)
    addr = buf.data_ptr
    assert acct.snapshot()["current"]["pageable_host"] == 2 << 20
    t = buf.tensor(torch.float32)
    view = buf.memoryview
    with pytest.raises(BufferError, match="live views"):
        p.close()
    assert _mapped(addr)
    t[0] = 1.0  # still mapped and usable after the refused close
    del t
    with pytest.raises(BufferError):
        p.close()
    view.release()
    p.close()
    assert not _mapped(addr)
    assert p.stats()["reserved_bytes"] == 0
    assert acct.snapshot()["current"]["pageable_host"] == 0
    with pytest.raises(ValueError, match="closed"):
        p.acquire(1)
    with pytest.raises(ValueError):
        buf.memoryview
    p.close()  # idempotent


def test_stats_count_pinned_and_pageable():
    with BufferPool(region_bytes=2 << 20) as p:
        a = p.acquire(5000)
        st = p.stats()
        assert st["in_use_bytes"] == 8192 and st["buffers_in_use"] == 1
        assert st["reserved_bytes"] == st["pinned_bytes"] + st["pageable_bytes"] == 2 << 20
        if torch.cuda.is_available():
            assert st["pinned_bytes"] == 2 << 20 and a.pinned
        else:
            assert st["pinned_bytes"] == 0 and not a.pinned
        p.release(a)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pin_true_without_cuda_is_an_error():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        BufferPool(pin=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_buffers_copy_asynchronously():
    with BufferPool(pin=True, region_bytes=2 << 20) as p:
        b = p.acquire(1 << 20)
        h = b.tensor(torch.float32)
        h.copy_(torch.arange(h.numel(), dtype=torch.float32))
        d = h.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(d.cpu(), h)
        del h, d
        p.release(b)


def test_accounting_counts_per_tier_and_peak():
    acct = Accounting()
    acct.add("nvme", "swap:a", 100)
    acct.add("nvme", "swap:b", 50)
    acct.add("pinned_host", "pool:x", 10)
    acct.remove("nvme", "swap:a", 100)
    snap = acct.snapshot()
    assert snap["current"] == {"device": 0, "pinned_host": 10, "pageable_host": 0, "nvme": 50}
    assert snap["peak"]["nvme"] == 150
    assert acct.by_owner() == {"swap:b": {"nvme": 50}, "pool:x": {"pinned_host": 10}}
    with pytest.raises(ValueError, match="negative"):
        acct.remove("nvme", "swap:b", 51)
    with pytest.raises(ValueError, match="unknown memory tier"):
        acct.add("gpu", "x", 1)
    acct.reset_peak()
    assert acct.snapshot()["peak"]["nvme"] == 50
    assert isinstance(default_accounting(), Accounting)


class _FakeCudart:
    """torch.cuda.cudart() stand-in: records (un)registrations, answers ``err`` to registering."""

    def __init__(self, err: int) -> None:
        self.err, self.calls = err, []

    def cudaHostRegister(self, addr, size, flags):
        self.calls.append(("register", addr, size))
        return self.err

    def cudaHostUnregister(self, addr):
        self.calls.append(("unregister", addr))
        return 0


def _vm_flags(addr: int):
    from test_io_fixed import _vm_flags as flags

    return flags(addr)


@pytest.fixture
def fake_cuda(monkeypatch):
    import offload.memory.pool as pool_mod
    import offload.memory.region as region_mod

    def install(err: int) -> _FakeCudart:
        fake = _FakeCudart(err)
        monkeypatch.setattr(pool_mod, "cuda_pin_available", lambda: True)
        monkeypatch.setattr(region_mod, "_cudart", lambda: fake)
        return fake

    return install


def test_pinned_regions_are_left_out_of_fork_and_unregistered_before_unmap(fake_cuda, monkeypatch):
    # Pinned pages cannot be shared copy-on-write: fork() would copy every one into each
    # DataLoader worker. A pinned region is MADV_DONTFORK ("dc" in VmFlags) for its life.
    import offload.memory.region as region_mod

    fake = fake_cuda(0)
    p = BufferPool(region_bytes=2 << 20)
    b = p.acquire(4096)
    addr = b.data_ptr
    assert b.pinned and "dc" in _vm_flags(addr)
    assert p.stats()["pinned_bytes"] == 2 << 20
    p.release(b)

    def no_lookup():  # a finalizer looking torch.cuda up again could re-enter its lazy init
        raise AssertionError("the runtime that pinned the region must unpin it")

    monkeypatch.setattr(region_mod, "_cudart", no_lookup)
    p.close()
    assert [c[0] for c in fake.calls] == ["register", "unregister"] and fake.calls[0][1] == fake.calls[1][1]
    assert not _mapped(addr)


def test_a_refused_pin_warns_and_stays_unpinned_unless_pinning_was_required(fake_cuda, caplog):
    # A sandboxed runtime or exhausted pinnable memory: cudaHostRegister fails (2: out of
    # memory). pin=None goes on with pageable buffers (copies stay correct, only synchronous);
    # pin=True was a demand, and says why it cannot be met.
    fake = fake_cuda(2)
    with caplog.at_level("WARNING", logger="offload.memory.pool"):
        p = BufferPool(region_bytes=2 << 20, name="auto")
        a = p.acquire(4096)
        b = p.acquire(4 << 20)  # a second region: not tried again
    assert not a.pinned and not b.pinned and p.pin is False and "dc" not in _vm_flags(a.data_ptr)
    assert [c[0] for c in fake.calls] == ["register"]
    assert "cudaHostRegister(2097152 bytes) failed with CUDA error 2" in caplog.text and "stay unpinned" in caplog.text
    a.tensor(torch.float32).fill_(1.0)  # the memory works
    p.release(a)
    p.release(b)
    p.close()
    strict = BufferPool(pin=True, region_bytes=2 << 20)
    with pytest.raises(RuntimeError, match="failed with CUDA error 2"):
        strict.acquire(4096)
    assert strict.stats()["reserved_bytes"] == 0
    strict.close()
