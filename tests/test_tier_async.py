"""The param tier's async stores ([Note: async stores] in offload/shard/tier.py): writes that
land late never lose bytes, never race a read or another write of their range, free their
pages once done, and a failed one raises."""
from __future__ import annotations

import importlib

import pytest
import torch

from offload.memory import PAGE, paging
from test_swap_util import FaultyEngine, SlowEngine

tier_mod = importlib.import_module("offload.shard.tier")


def _tier(tmp_path, engine_wrap=None):
    t = tier_mod.ParamTier(str(tmp_path), 0)
    if engine_wrap is not None:
        t._engine = engine_wrap(t._engine)
    return t


def _write(t, view, values):
    paging.will_write([view])
    view.copy_(values)
    paging.store([view])
    paging.evict([view])


def _read(view):
    paging.load([view])
    try:
        return view.clone()
    finally:
        paging.evict([view])


@pytest.mark.parametrize("defer", [False, True])
def test_late_writes_keep_every_byte(tmp_path, defer):
    # pieces that end mid-page (neighbours share pages), rewritten while earlier writes fly
    slow = []
    t = _tier(tmp_path, lambda e: slow.append(SlowEngine(e, read_delay=0.001, write_delay=0.03)) or slow[0])
    t.defer_stores = defer
    n = 3 * PAGE + 1000  # float32 elements: 12 pages and a part
    a = t.area(n, torch.float32)
    b = t.area(2 * PAGE, torch.float32, "grads")
    g = torch.Generator().manual_seed(0)
    want = torch.zeros(n)
    cuts = [0, 1, 1023, 1500, PAGE + 7, n]
    for rnd in range(3):
        for lo, hi in zip(cuts, cuts[1:]):
            v = torch.randn(hi - lo, generator=g)
            _write(t, a[lo:hi], v)
            want[lo:hi] = v
        vb = torch.randn(2 * PAGE, generator=g)
        _write(t, b, vb)
        if rnd == 1:  # read back while writes may still fly: the newest bytes
            torch.testing.assert_close(_read(a[cuts[1]:cuts[3]]), want[cuts[1]:cuts[3]], rtol=0, atol=0)
    t.flush()
    assert slow[0].violations == []  # no read of a range while its write flew
    torch.testing.assert_close(_read(a), want, rtol=0, atol=0)
    torch.testing.assert_close(_read(b), vb, rtol=0, atol=0)
    t.flush()
    assert t.resident_bytes() == 0  # every dropped page left once its write was done
    t.close()


def test_deferred_store_returns_before_the_disk(tmp_path):
    slow = []
    t = _tier(tmp_path, lambda e: slow.append(SlowEngine(e, write_delay=0.3)) or slow[0])
    t.defer_stores = True
    a = t.area(PAGE, torch.float32)
    _write(t, a, torch.ones(PAGE))
    assert t._writes and t.resident_bytes() == PAGE * 4  # in flight: its pages kept
    t.flush()
    assert not t._writes and t.resident_bytes() == 0
    t.defer_stores = False
    _write(t, a, torch.full((PAGE,), 2.0))
    assert not t._writes and t.resident_bytes() == 0  # not deferred: on disk when store returns
    torch.testing.assert_close(_read(a), torch.full((PAGE,), 2.0), rtol=0, atol=0)
    t.close()


def test_write_window_bounds_the_bytes_in_flight(tmp_path, monkeypatch):
    slow = []
    t = _tier(tmp_path, lambda e: slow.append(SlowEngine(e, write_delay=0.02)) or slow[0])
    monkeypatch.setattr(t, "write_window", 2 * PAGE * 4)
    t.defer_stores = True
    areas = [t.area(PAGE, torch.float32) for _ in range(6)]
    most = 0
    for i, a in enumerate(areas):
        _write(t, a, torch.full((PAGE,), float(i)))
        most = max(most, t._write_bytes())
    assert most <= 2 * PAGE * 4
    t.flush()
    for i, a in enumerate(areas):
        assert torch.equal(_read(a), torch.full((PAGE,), float(i)))
    t.close()


def test_failed_deferred_write_raises_at_flush(tmp_path):
    faulty = []
    t = _tier(tmp_path, lambda e: faulty.append(FaultyEngine(e, op="write", fail_at=2)) or faulty[0])
    t.defer_stores = True
    a, b = t.area(PAGE, torch.float32), t.area(PAGE, torch.float32)
    _write(t, a, torch.ones(PAGE))
    try:
        _write(t, b, torch.ones(PAGE))  # the failing one (may be reaped right here)
        t.flush()
    except OSError as exc:
        assert "injected write error" in str(exc)
    else:
        pytest.fail("a failed write was never reported")
    t.flush()  # reported once; the tier goes on
    _write(t, b, torch.full((PAGE,), 3.0))
    t.flush()
    assert torch.equal(_read(b), torch.full((PAGE,), 3.0))
    t.close()


@pytest.mark.parametrize("defer", [False, True])
def test_a_short_write_raises(tmp_path, defer):
    # an engine that reports fewer bytes written than asked: the tier ignored the count and
    # dropped the pages as if they were on disk
    faulty = []
    t = _tier(tmp_path, lambda e: faulty.append(FaultyEngine(e, op="write", fail_at=1, mode="short")) or faulty[0])
    t.defer_stores = defer
    try:
        a = t.area(2 * PAGE, torch.float32)  # eight pages
        with pytest.raises(OSError, match="short write: 28672 of 32768 bytes at offset 0") as e:
            _write(t, a, torch.ones(2 * PAGE))
            t.flush()
        assert e.value.filename.endswith("areas.bin")
    finally:
        t.close()


def test_evict_widens_over_pages_on_disk_within_its_huge_pages(tmp_path):
    # a fault in a huge-page area brings the whole huge page in: evict drops its on-disk part
    # too, never a page in memory ([Note: huge pages for areas])
    t = _tier(tmp_path)
    from offload.memory import HUGE_PAGE

    per = HUGE_PAGE // PAGE
    a = t.area(3 * HUGE_PAGE // 4, torch.float32)  # three huge pages
    area = t._areas[-1]
    area.state[:] = tier_mod._ON_DISK
    area.state[per + 3] = tier_mod._VALID  # a neighbour's edge page in the second huge page
    assert t._widen(area, per + 10, per + 20)[1:] == (per + 4, 2 * per)
    assert t._widen(area, 5, 7)[1:] == (0, per)
    assert t._widen(area, 2 * per + 1, 3 * per)[1:] == (2 * per, 3 * per)
    area.state[per + 20] = tier_mod._READING  # a prefetch in flight stops it too
    assert t._widen(area, per + 10, per + 15)[1:] == (per + 4, per + 20)
    del a
    t.close()


@pytest.mark.parametrize("how", ["load", "prefetch"])
def test_a_read_cut_short_by_a_truncated_file_raises(tmp_path, how):
    # the engines stop a read at end of file and report the bytes they got; the tier ignored
    # the count, and a forward over areas.bin truncated under it computed on zeros (loss 0.0)
    import errno
    import os

    t = _tier(tmp_path)
    try:
        view = t.area(3 * PAGE // 4, torch.float32)  # three pages
        _write(t, view, torch.arange(view.numel(), dtype=torch.float32))
        os.truncate(os.path.join(t.path, "areas.bin"), PAGE)
        if how == "prefetch":
            paging.prefetch([view])
        with pytest.raises(OSError, match="short read: 4096 of 12288 bytes at offset 0") as e:
            paging.load([view])
        assert e.value.errno == errno.EIO and e.value.filename.endswith("areas.bin")
    finally:
        t.close()
