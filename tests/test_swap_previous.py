"""The commit before the last, kept in each swap manifest while the free slots still hold its
data, so that a rank left one step ahead by a kill between the ranks' commits can go back to
the others' step at resume ([Note: a rank one step ahead] in offload/swap/agreement.py; the
ranks' side is in test_zero.py)."""
import json
import os

import pytest

from offload.memory import BufferPool
from offload.swap import SwapLayout, SwapStore

NAMES = ["exp_avg", "exp_avg_sq"]
LAYOUT = (5000, 2048, 2)  # 3 sub-groups, the last one short


def _store(tmp_path, **kw):
    return SwapStore(str(tmp_path), SwapLayout(*LAYOUT), state_names=NAMES, **kw)


def _write(st, pool, g, byte):
    """Sub-group ``g``'s free slot <- ``byte`` everywhere; its checksums."""
    buf = pool.acquire(st.layout.group_bytes(g))
    buf.memoryview[:] = bytes([byte]) * len(buf.memoryview)
    st.engine.wait(st.engine.submit(st.write_requests(g, buf)))
    sums = st.checksum(g, buf)
    pool.release(buf)
    return sums


def _read(st, pool, g):
    buf = pool.acquire(st.layout.group_bytes(g))
    st.engine.wait(st.engine.submit(st.read_requests(g, buf)))
    out = bytes(buf.memoryview)
    pool.release(buf)
    return set(out)


def _manifest(st):
    with open(os.path.join(st.path, "manifest.json")) as f:
        return json.load(f)


def _two_steps(tmp_path, pool, verify=False):
    """A store at step 2 (all sub-groups 0x22) whose free slots still hold step 1 (0x11)."""
    st = _store(tmp_path, verify=verify)
    st.commit({g: _write(st, pool, g, 0x11) for g in range(3)}, {"steps": [1]})
    st.commit({g: _write(st, pool, g, 0x22) for g in range(3)}, {"steps": [2]})
    return st


@pytest.fixture
def pool():
    p = BufferPool()
    yield p
    p.close()


@pytest.mark.parametrize("verify", [False, True])
def test_resumed_store_goes_back_to_the_step_its_free_slots_hold(tmp_path, pool, verify):
    st = _two_steps(tmp_path, pool, verify)
    assert st.previous_step == 1 and _manifest(st)["previous"]["step"] == 1
    st.close(remove=False)  # as a kill leaves it
    st = _store(tmp_path, verify=verify, resume=True)
    assert (st.step, st.previous_step, st.extra) == (2, 1, {"steps": [2]})
    st.undo_commit()
    assert (st.step, st.previous_step, st.extra) == (1, None, {"steps": [1]})
    assert [_read(st, pool, g) for g in range(3)] == [{0x11}] * 3  # checked against its checksums with verify
    assert "previous" not in _manifest(st)
    st.close(remove=False)
    st = _store(tmp_path, verify=verify, resume=True)  # the manifest on disk says the same
    assert (st.step, st.previous_step) == (1, None)
    assert [_read(st, pool, g) for g in range(3)] == [{0x11}] * 3
    st.close()


def test_a_write_into_the_free_slots_forgets_the_step_before(tmp_path, pool):
    st = _two_steps(tmp_path, pool)
    _write(st, pool, 1, 0x33)  # the next step began: step 1's data is going
    assert st.previous_step is None
    with pytest.raises(RuntimeError, match="no commit to undo"):
        st.undo_commit()
    st.commit({1: None}, advance=False)  # a commit that does not advance (a state write-back)
    assert (st.step, st.previous_step) == (2, 2)
    st.close()


def test_a_commit_that_fails_keeps_the_step_before(tmp_path, pool, monkeypatch):
    st = _two_steps(tmp_path, pool)
    sums = {g: _write(st, pool, g, 0x33) for g in range(3)}

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "_write_manifest", full)
    with pytest.raises(OSError):
        st.commit(sums)
    monkeypatch.undo()
    assert (st.step, st.previous_step) == (2, None)  # as before the commit: its writes went into the free slots
    st.close()


@pytest.mark.parametrize("field, value, says", [
    ("previous", [1], "previous must be an object or null"),
    ("previous.step", 3, r"previous.step must be in \[0, 2\], got 3"),
    ("previous.step", "1", "previous.step must be an integer"),
    ("previous.slots", [0, 1], "previous.slots has 2 entries for 3 sub-groups"),
    ("previous.valid", [True, 1, True], r"previous.valid\[1\] must be true or false"),
    ("previous.extra", None, "previous.extra must be an object"),
])
def test_a_damaged_step_before_is_refused_naming_the_field(tmp_path, pool, field, value, says):
    from offload.swap import fsutil

    st = _two_steps(tmp_path, pool)
    st.close(remove=False)
    path = os.path.join(st.path, "manifest.json")
    m = fsutil.unsealed(json.load(open(path)), path, "")
    if field == "previous":
        m["previous"] = value
    else:
        m["previous"][field.split(".")[1]] = value
    with open(path, "w") as f:
        json.dump(fsutil.sealed(m), f)  # sealed again: damaged by a writer, not by the disk
    with pytest.raises(ValueError, match="damaged swap manifest: " + says):
        _store(tmp_path, resume=True)


def test_the_step_before_keeps_only_what_changed_of_its_metadata(tmp_path, pool):
    # the params' facts stay the same from step to step: the manifest does not repeat them
    st = _store(tmp_path)
    facts = {"shapes": [[7, 3]] * 50, "kind": "flat"}
    st.commit({g: _write(st, pool, g, 0x11) for g in range(3)}, dict(facts, steps=[1], old=1))
    st.commit({g: _write(st, pool, g, 0x22) for g in range(3)}, dict(facts, steps=[2], new=2))
    prev = _manifest(st)["previous"]
    assert prev["extra"] == {"steps": [1], "old": 1} and prev["extra_dropped"] == ["new"]
    st.close(remove=False)
    st = _store(tmp_path, resume=True)
    st.undo_commit()
    assert st.extra == dict(facts, steps=[1], old=1)
    st.close()
