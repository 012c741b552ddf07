"""What the step's RAM holds beside its bound with params on NVMe (issue #16's memory target):
an area's region tail past its last page leaves RAM with that page ([Note: huge pages for
areas] in offload/shard/tier.py), and the step gives the forward + backward's free heap back
first ([Note: trimming the heap] in offload/memory/heap.py)."""
from __future__ import annotations

import ctypes
import importlib
import shutil
import tempfile

import numpy as np
import pytest
import torch

import offload
from offload.memory import HUGE_PAGE, PAGE, heap, paging
import test_shard_train as base

tier_mod = importlib.import_module("offload.shard.tier")
swapped = importlib.import_module("offload.optim.flat.swapped")
_libc = ctypes.CDLL(None, use_errno=True)


def _resident(region) -> np.ndarray:
    """Per 4 KiB page of the region: in RAM (mincore)."""
    vec = (ctypes.c_ubyte * (region.size // PAGE))()
    if _libc.mincore(ctypes.c_void_p(region.address), ctypes.c_size_t(region.size), vec) != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return np.frombuffer(vec, dtype=np.uint8) & 1


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("how", ["whole", "last-page", "written"])
def test_evict_drops_the_region_tail(tmp_path, how, defer):
    t = tier_mod.ParamTier(str(tmp_path), 0)
    t.defer_stores = defer
    try:
        n = (HUGE_PAGE + HUGE_PAGE // 2 + 3 * PAGE + 100) // 2  # bf16: ends inside its second huge page
        x = t.area(n, torch.bfloat16)
        a = t._areas[-1]
        assert a.region.size > a.pages * PAGE  # a tail past the area's last page
        view = x if how == "whole" else x[(a.pages - 1) * PAGE // 2:]  # the last page alone
        want = torch.arange(view.numel(), dtype=torch.float32).to(torch.bfloat16)
        if how == "written":
            paging.will_write([view])
            view.copy_(want)
            paging.store([view])  # deferred: its pages drop once the write is done
        else:
            paging.load([view])
            float(view.float().sum())  # the fault on the last huge page
        if not _resident(a.region)[a.pages:].any():
            pytest.skip("no transparent huge pages here: nothing brings the tail in")
        paging.evict([view])
        t.flush()
        r = _resident(a.region)
        assert r.sum() == 0, f"{int(r[:a.pages].sum())} area pages and {int(r[a.pages:].sum())} tail pages resident"
        if how == "written":  # the bytes came back from disk, the tail's drop took none of them
            paging.load([view])
            torch.testing.assert_close(view.clone(), want, rtol=0, atol=0)
            paging.evict([view])
    finally:
        t.close()


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_trim_heap_returns_free_chunks():
    malloc, free = _libc.malloc, _libc.free
    malloc.restype, malloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    size, count = 64 << 10, 1600  # 100 MiB of heap chunks (under glibc's mmap threshold)
    chunks = [malloc(size) for _ in range(count)]
    guard = malloc(size)  # in use above them: free() cannot give the heap's top back
    try:
        for c in chunks:
            ctypes.memset(c, 1, size)
        for c in chunks:
            free(c)
        before = _rss()
        if not heap.trim_heap():
            pytest.skip("no malloc_trim in this C library")
        freed = before - _rss()
        assert freed >= count * size * 0.8, f"{freed >> 20} MiB given back of {count * size >> 20} MiB free"
    finally:
        free(guard)


@pytest.mark.parametrize("offload_params", ["nvme", "cpu"])
def test_the_step_trims_the_heap_when_params_are_paged(monkeypatch, offload_params):
    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(paging.active()) or True)
    parent = tempfile.mkdtemp(prefix="tier-resident-", dir="/var/tmp")
    try:
        model = offload.shard(base._model(), offload_params=offload_params,
                              swap_dir=parent if offload_params == "nvme" else None)
        opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=parent, **base.HP)
        for step in range(2):
            base._loss(model, step, 0, 1, 0, {}).float().backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        assert calls == ([True, True] if offload_params == "nvme" else [])
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _anon_huge(region) -> int:
    """AnonHugePages of the mapping that holds ``region`` (bytes)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            f = line.split()
            if "-" in f[0] and not line[0].isupper():
                lo, hi = (int(x, 16) for x in f[0].split("-"))
                inside = lo <= region.address < hi
            elif inside and f[0] == "AnonHugePages:":
                return int(f[1]) * 1024
    return 0


@pytest.mark.parametrize("kind", ["params", "grads"])
def test_areas_of_a_huge_page_or_more_fault_huge_pages(tmp_path, kind):
    # the grads too: written into dropped 4 KiB pages they cost ~480k faults per 1B forward +
    # backward (bench/RESULTS.md, helper D), on huge pages ~1k
    t = tier_mod.ParamTier(str(tmp_path), 0)
    try:
        x = t.area(2 * HUGE_PAGE // 2, torch.bfloat16, kind)  # two huge pages
        a = t._areas[-1]
        paging.will_write([x])
        x.fill_(1)
        if _anon_huge(a.region) == 0 and kind == "params":
            pytest.skip("no transparent huge pages here")
        assert _anon_huge(a.region) >= HUGE_PAGE
        paging.store([x])
        paging.evict([x])
        assert _resident(a.region).sum() == 0
    finally:
        t.close()
