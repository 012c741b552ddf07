"""[Note: syncing the written slots] in swap/store.py: a commit fdatasyncs every slot file a
write went to since its last sync, and no other (each fdatasync is a disk cache flush)."""
from __future__ import annotations

import errno

import pytest

from offload.swap import SwapLayout, SwapPipeline, SwapStepError, SwapStore
from test_swap_util import threads_engine


def _recording(store, fail=None):
    """Record the slot index of each fsync of ``store``'s files; ``fail``: a set of slots
    whose next fsync raises EIO (once each)."""
    synced = []
    for k, f in enumerate(store.files):
        real = f.fsync

        def fsync(k=k, real=real):
            if fail and k in fail:
                fail.discard(k)
                raise OSError(errno.EIO, "injected fdatasync failure", store.files[k].path)
            synced.append(k)
            real()
        f.fsync = fsync
    return synced


@pytest.fixture
def swap(tmp_path):
    engine = threads_engine()
    store = SwapStore(str(tmp_path), SwapLayout(4 * 1024, 1024, 2), state_names=["a", "b"], io_engine=engine)
    pipe = SwapPipeline(store, buffers=3)
    yield store, pipe
    pipe.close()
    store.close()
    engine.close()


def _bump(g, s, e, tensors):
    for t in tensors:
        t += 1.0


@pytest.mark.parametrize("groups", [[0, 1, 2, 3], [1, 3]])
def test_each_commit_syncs_the_files_written_and_no_other(swap, groups):
    store, pipe = swap
    synced = _recording(store)
    pipe.run(range(4), _bump)  # step 1: slot1.bin written (both were synced when made)
    assert synced == [1]
    for _ in range(3):
        synced.clear()
        want = sorted({1 - store.slots[g] for g in groups})
        pipe.run(groups, _bump)
        assert synced == want  # every sub-group lives in one slot: one file, one flush
    if store.slots[0] == store.slots[1]:
        pipe.run([0], _bump)
    assert store.slots[0] != store.slots[1]  # sub-groups 0 and 1 live in different slots now
    synced.clear()
    want = sorted({1 - store.slots[g] for g in (0, 1)})
    pipe.run([0, 1], _bump)
    assert synced == want == [0, 1]
    synced.clear()
    store.commit({}, {"k": 1}, advance=False)  # metadata only: nothing written, nothing to flush
    assert synced == []


def test_a_failed_sync_fails_the_step_and_is_retried_by_the_next_commit(swap):
    store, pipe = swap
    pipe.run(range(4), _bump)
    free = 1 - store.slots[0]
    synced = _recording(store, fail={free})
    with pytest.raises(SwapStepError, match="could not be committed"):
        pipe.run(range(4), _bump)
    assert store.step == 1 and synced == []  # the manifest still names step 1
    store.commit({}, {"k": 1}, advance=False)
    assert synced == [free]  # what that write left unsynced is flushed by the next commit
    synced.clear()
    store.commit({}, {"k": 2}, advance=False)
    assert synced == []


def test_the_made_slot_files_are_durable_before_the_first_manifest(tmp_path, monkeypatch):
    """A power cut after the first manifest must not find slot files it names unsynced (their
    preallocated size lost: resume would call step 0 "lost", when it held nothing)."""
    from offload.io.files import IOFile
    from offload.swap import fsutil

    events = []
    real_fsync, real_write = IOFile.fsync, fsutil.write_json_atomic

    def fsync(self):
        events.append(("fsync", self.path.rsplit("/", 1)[-1]))
        real_fsync(self)

    def write_json_atomic(d, name, m):
        events.append(("write", name))
        return real_write(d, name, m)
    monkeypatch.setattr(IOFile, "fsync", fsync)
    monkeypatch.setattr(fsutil, "write_json_atomic", write_json_atomic)
    engine = threads_engine()
    store = SwapStore(str(tmp_path), SwapLayout(4 * 1024, 1024, 2), state_names=["a", "b"], io_engine=engine)
    try:
        first_manifest = events.index(("write", "manifest.json"))
        synced = {name for op, name in events[:first_manifest] if op == "fsync"}
        assert synced == {"slot0.bin", "slot1.bin"}
        assert not store._unsynced
    finally:
        store.close()
        engine.close()
