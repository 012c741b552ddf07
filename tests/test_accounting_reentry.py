"""A finalizer that re-enters the byte counters on the thread holding their lock
([Note: finalizers re-enter] in offload/memory/reentry.py): CI once hung in
``Accounting.add`` -> garbage collection -> ``BufferPool.__del__`` -> ``clear_owner``."""
from __future__ import annotations

import gc
import threading

import pytest

from offload.memory.accounting import Accounting
from offload.memory.pool import BufferPool


def _in_thread(fn, timeout=20.0):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "deadlocked: the thread holding the lock waited for itself"
    if "error" in out:
        raise out["error"]
    return out.get("value")


class _CollectingDict(dict):
    """What a collection in the middle of ``add`` looks like to the counters: a finalizer
    that clears an owner (and adds for another) runs while the dict is being walked."""

    def __init__(self, acct, *a):
        super().__init__(*a)
        self.acct, self.fired = acct, False

    def items(self):
        if not self.fired:
            self.fired = True
            self.acct.clear_owner("gone")
            self.acct.add("pinned_host", "late", 7)
        return super().items()


def test_a_finalizer_inside_add_is_run_after_it_not_deadlocked():
    acct = Accounting()
    acct.add("pageable_host", "gone", 100)
    acct.add("pageable_host", "kept", 5)
    acct._bytes = _CollectingDict(acct, acct._bytes)
    _in_thread(lambda: acct.add("pageable_host", "a", 10))
    assert acct.by_owner() == {"kept": {"pageable_host": 5}, "a": {"pageable_host": 10}, "late": {"pinned_host": 7}}
    assert acct.snapshot()["current"]["pageable_host"] == 15


def test_a_deferred_error_is_raised_after_the_others_ran():
    acct = Accounting()
    acct._bytes = _CollectingDict(acct)
    acct._lock._deferred.append((acct._add, ("nvme", "bad", -1)))  # as if a finalizer removed bytes it never added
    with pytest.raises(ValueError, match="negative"):
        _in_thread(lambda: acct.add("nvme", "a", 1))
    assert acct.by_owner()["late"] == {"pinned_host": 7}
    acct.add("nvme", "b", 1)  # the lock is free again


def test_pools_collected_in_the_middle_of_the_counters_never_hang():
    """The real thing: pools in reference cycles, collected whenever a count allocates."""
    acct = Accounting()

    def churn():
        old = gc.get_threshold()
        gc.set_threshold(1, 1, 1)
        try:
            for i in range(200):
                pool = BufferPool(pin=False, region_bytes=1 << 16, huge=False, accounting=acct, name=f"cyc{i}")
                pool.acquire(4096)
                pool.cycle = pool  # only the collector frees it, at any allocation
                del pool
                acct.add("pageable_host", "loop", 1)
        finally:
            gc.set_threshold(*old)
        gc.collect()

    _in_thread(churn, timeout=60)
    assert acct.by_owner() == {"loop": {"pageable_host": 200}}


def test_the_page_registry_and_the_store_registry_defer_a_finalizers_call():
    """The other two registries a finalizer gives back to: paging (the param tier's areas) and
    the swap stores' cleanup registry."""
    from offload.memory import paging
    from offload.swap import cleanup

    def inside_paging():
        paging.register(1 << 40, 4096, object())
        with paging._lock.held():  # as register() holds it when a collection runs a tier's finalizer
            paging.unregister(1 << 40)
            assert paging._find(1 << 40) is not None  # queued, not done under the holder's feet
        return paging._find(1 << 40)

    assert _in_thread(inside_paging) is None

    def inside_cleanup():
        token = cleanup.register(object())
        with cleanup._lock.held():
            cleanup.unregister(token)
            assert token in cleanup._open
        return token in cleanup._open

    assert _in_thread(inside_cleanup) is False
