"""The generic swap pipeline: sizing, ordering and overlap under slow I/O, no read/write races."""
from __future__ import annotations

import json
import time

import pytest
import torch

from offload.swap import SwapLayout, SwapPipeline, SwapStore, plan_sub_groups
from test_swap_util import SlowEngine, threads_engine


def test_plan_sub_groups():
    # explicit size: rounded up to 1024 elements; 3 buffers must fit
    assert plan_sub_groups(10_000, 2, 1 << 20, 1000) == (1024, 8)
    with pytest.raises(ValueError, match=r"max_host_bytes=100000 cannot hold 3 pipeline buffers .* 49152 bytes each"):
        plan_sub_groups(1 << 20, 2, 100_000, 6000)
    with pytest.raises(ValueError, match="cannot hold 3 pipeline buffers"):
        plan_sub_groups(1 << 20, 2, 10_000, None)
    # derived size: ~16 sub-groups, 4 buffers within the bound
    sg, nbuf = plan_sub_groups(200_000_000, 2, 512 << 20, None)
    assert sg % 1024 == 0 and 14 <= -(-200_000_000 // sg) <= 16 and nbuf * 2 * sg * 4 <= 512 << 20 and nbuf >= 3
    sg, nbuf = plan_sub_groups(200_000_000, 2, 64 << 20, None)
    assert nbuf == 4 and 4 * 2 * sg * 4 <= 64 << 20
    # a single small sub-group needs one buffer only
    assert plan_sub_groups(10, 2, 8192, None) == (1024, 1)


def _ranges_to_group(entry, layout):
    _, op, ranges, t = entry
    return op, ranges[0][1] // layout.region_bytes


def test_pipeline_overlaps_and_never_races(tmp_path):
    """Read g+1 is held back until compute g has started, and write g-1 too: a pipeline that
    waited for either before computing g would stall on the gate (5 s timeout, recorded)."""
    import threading

    inner = threads_engine()
    layout = SwapLayout(10 * 1024 + 5, 1024, 2)
    G = layout.num_groups
    started = [threading.Event() for _ in range(G)]

    def hold(op, ranges):
        g = ranges[0][1] // layout.region_bytes
        if op == "read" and g >= 1:
            return started[g - 1]
        if op == "write" and g + 1 < G:
            return started[g + 1]
        return None

    slow = SlowEngine(inner, read_delay=0.01, write_delay=0.01, hold=hold)
    store = SwapStore(str(tmp_path), layout, state_names=["a", "b"], io_engine=slow)
    pipe = SwapPipeline(store, buffers=3)
    events = []

    def compute(g, s, e, tensors):
        started[g].set()
        t0 = time.perf_counter()
        a, b = tensors
        assert a.numel() == e - s
        a += torch.arange(s, e, dtype=torch.float32)  # a = step * index
        b += 1.0
        events.append(("compute", g, t0, time.perf_counter()))

    for step in range(1, 4):
        events.clear()
        slow.log.clear()
        for ev in started:
            ev.clear()
        stats = pipe.run(range(G), compute)
        t_return = time.perf_counter()
        assert store.step == step
        log = [(_ranges_to_group(x, layout), x[0], x[3]) for x in slow.log]
        done = {(op, g): t for (op, g), kind, t in log if kind == "done"}
        sub = {(op, g): t for (op, g), kind, t in log if kind == "submit"}
        reads_expected = G if step > 1 else 0  # first step: never-written groups are zeros, not read
        assert sum(1 for (op, _) in done if op == "read") == reads_expected
        for _, g, t0, t1 in events:
            if step > 1:
                assert done[("read", g)] < t0, f"compute {g} before its read finished"
                if g + 1 < G:
                    assert sub[("read", g + 1)] < t0, f"read {g + 1} not submitted before compute {g}"
            if g >= 1:
                assert sub[("write", g - 1)] < t0, f"write {g - 1} not submitted before compute {g}"
        assert max(t for (op, _), t in done.items() if op == "write") < t_return  # writes done before return
        assert stats["kernel_s"] > 0 and stats["wait_read_s"] >= 0 and stats["step_s"] >= stats["kernel_s"]
        assert stats["write_bytes"] == sum(layout.group_bytes(g) for g in range(G))
    assert slow.hold_timeouts == []  # compute g always ran while read g+1 and write g-1 were in flight
    assert slow.violations == []
    # the data: a = 3 * index, b = 3 everywhere
    for g in range(G):
        buf = pipe.buffers[0]
        inner.wait(inner.submit(store.read_requests(g, buf)))
        a, b = pipe.tensors(g, buf)
        s, e = layout.group_range(g)
        assert torch.equal(a, 3 * torch.arange(s, e, dtype=torch.float32)) and torch.equal(b, torch.full_like(b, 3.0))
    del a, b
    pipe.close()
    store.close()
    inner.close()


def test_pipeline_more_buffers_read_further_ahead(tmp_path):
    inner = threads_engine()
    slow = SlowEngine(inner, read_delay=0.02, write_delay=0.02)
    layout = SwapLayout(8 * 1024, 1024, 1)
    store = SwapStore(str(tmp_path), layout, state_names=["a"], io_engine=slow)
    pipe = SwapPipeline(store, buffers=6)
    pipe.run(range(8), lambda g, s, e, t: t[0].fill_(g))
    slow.log.clear()
    seen = []

    def compute(g, s, e, t):
        assert torch.equal(t[0], torch.full_like(t[0], float(g)))
        seen.append(sum(1 for x in slow.log if x[0] == "submit" and x[1] == "read"))
        t[0].add_(1)

    pipe.run(range(8), compute)
    assert seen[0] >= 4  # at the first compute, several reads were already in flight
    assert slow.violations == []
    pipe.close()
    store.close()
    inner.close()


def test_subset_of_groups_keeps_others(tmp_path):
    inner = threads_engine()
    layout = SwapLayout(4 * 1024, 1024, 1)
    store = SwapStore(str(tmp_path), layout, state_names=["a"], io_engine=inner)
    pipe = SwapPipeline(store, buffers=3)
    pipe.run(range(4), lambda g, s, e, t: t[0].fill_(g + 1))
    pipe.run([1, 3], lambda g, s, e, t: t[0].mul_(10))
    got = []
    for g in range(4):
        inner.wait(inner.submit(store.read_requests(g, pipe.buffers[0])))
        got.append(pipe.tensors(g, pipe.buffers[0])[0][0].item())
    assert got == [1.0, 20.0, 3.0, 40.0] and store.step == 2
    pipe.close()
    store.close()
    inner.close()


# [Note: ranks vote before commit]: several ranks exchange one flag after their writes are
# durable and commit only if no rank failed; every rank votes exactly once per step.
def _voting_store(tmp_path, engine=None):
    layout = SwapLayout(3 * 1024, 1024, 2)
    store = SwapStore(str(tmp_path), layout, state_names=["a", "b"], io_engine=engine or threads_engine())
    return store, SwapPipeline(store, buffers=3)


def _bump(g, s, e, tensors):
    for t in tensors:
        t += 1.0


def test_vote_all_ok_commits(tmp_path):
    store, pipe = _voting_store(tmp_path)
    votes = []
    pipe.run(range(3), _bump, vote=lambda ok: votes.append(ok) or [])
    assert votes == [True, True] and store.step == 1  # before the commit, and after it
    pipe.close()
    store.close()


def test_vote_with_a_failed_peer_commits_nothing(tmp_path):
    from offload.swap import SwapStepError

    store, pipe = _voting_store(tmp_path)
    pipe.run(range(3), _bump)
    slots, manifest = list(store.slots), (tmp_path.glob("offload-*/manifest.json"))
    before = [p.read_bytes() for p in manifest]
    votes = []
    with pytest.raises(SwapStepError, match="applied on no rank: the swap step of rank 2 failed; "
                                            "the swap files still hold step 1") as e:
        pipe.run(range(3), _bump, vote=lambda ok: votes.append(ok) or [2])
    assert e.value.computed == [0, 1, 2] and votes == [True]
    assert store.step == 1 and store.slots == slots
    assert [p.read_bytes() for p in tmp_path.glob("offload-*/manifest.json")] == before
    # the states are still those of step 1
    out = []
    pipe.run(range(3), lambda g, s, e, ts: out.append(float(ts[0][0])), commit=False)
    assert out == [1.0, 1.0, 1.0]
    pipe.close()
    store.close()


def test_local_failure_votes_false_once(tmp_path):
    from offload.swap import SwapStepError
    from test_swap_util import FaultyEngine

    faulty = FaultyEngine(threads_engine(), op="write", fail_at=2)
    store, pipe = _voting_store(tmp_path, faulty)
    votes = []
    with pytest.raises(SwapStepError, match="injected write error"):
        pipe.run(range(3), _bump, vote=lambda ok: votes.append(ok) or [0])
    assert votes == [False] and store.step == 0
    pipe.close()
    store.close()


def test_commit_failing_here_votes_false_in_the_second_vote(tmp_path, monkeypatch):
    from offload.swap import SwapStepError

    store, pipe = _voting_store(tmp_path)

    def full(*a, **k):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(store, "_write_manifest", full)
    votes = []
    with pytest.raises(SwapStepError, match="could not be committed: No space left"):
        pipe.run(range(3), _bump, vote=lambda ok: votes.append(ok) or ([] if ok else [0]))
    assert votes == [True, False] and store.step == 0
    pipe.close()
    store.close()


def _as_before_but_the_step_before(manifest, before):
    """The manifest names what ``before`` did, but no longer the step before its last: the
    undone step's writes went into those slots ([Note: a rank one step ahead])."""
    from offload.swap import fsutil

    now, then = (fsutil.unsealed(json.loads(b), str(manifest)) for b in (manifest.read_bytes(), before))
    assert then.pop("previous")["step"] == 0 and "previous" not in now
    return now == then


def test_a_second_vote_that_fails_undoes_this_rank_commit(tmp_path):
    """A peer died between the votes (gloo raises in the collective): this rank undoes its
    commit rather than stay a step ahead of the dead rank's files."""
    from offload.swap import SwapStepError

    store, pipe = _voting_store(tmp_path)
    pipe.run(range(3), _bump)
    manifest = next(tmp_path.glob("offload-*/manifest.json"))
    before = manifest.read_bytes()
    calls = []

    def vote(ok):
        calls.append(ok)
        if len(calls) == 2:
            raise RuntimeError("[gloo] Connection closed by peer")
        return []

    with pytest.raises(SwapStepError, match=r"swap step 2 was applied on no rank: the ranks' vote on it failed "
                                            r"\(RuntimeError: a rank died\?\); this rank's commit was undone"):
        pipe.run(range(3), _bump, vote=vote)
    assert store.step == 1 and _as_before_but_the_step_before(manifest, before)
    pipe.close()
    store.close()


def test_a_peer_that_could_not_commit_makes_this_rank_undo_its_commit(tmp_path):
    from offload.swap import SwapStepError

    store, pipe = _voting_store(tmp_path)
    pipe.run(range(3), _bump)
    manifest = next(tmp_path.glob("offload-*/manifest.json"))
    before, slots = manifest.read_bytes(), list(store.slots)
    answers = [[], [1]]  # all prepared; then rank 1 could not commit
    with pytest.raises(SwapStepError, match="swap step 2 was applied on no rank: rank 1 could not commit it; "
                                            "this rank's commit was undone: the swap files still hold step 1"):
        pipe.run(range(3), _bump, vote=lambda ok: answers.pop(0))
    assert store.step == 1 and store.slots == slots and _as_before_but_the_step_before(manifest, before)
    out = []
    pipe.run(range(3), lambda g, s, e, ts: out.append(float(ts[0][0])), commit=False)
    assert out == [1.0, 1.0, 1.0]  # step 1's states, read from the slots the manifest names
    pipe.close()
    store.close()


def test_a_close_in_another_thread_waits_for_the_step_in_flight(tmp_path):
    """[Note: a close meets a step]: the atexit cleanup closing the store while a daemon
    thread's step runs closed the slot files under it (IndexError, EBADF; a reused descriptor
    could take its writes). The close now waits for the step, which commits."""
    import threading

    layout = SwapLayout(4 * 1024, 1024, 1)
    store = SwapStore(str(tmp_path), layout, state_names=["a"], io_engine=threads_engine())
    pipe = SwapPipeline(store, buffers=3)
    inside, errors = threading.Event(), []

    def compute(g, s, e, tensors):
        inside.set()
        time.sleep(0.05)
        tensors[0] += 1.0

    def step():
        try:
            pipe.run(range(layout.num_groups), compute)
        except BaseException as exc:  # what the step met, if anything
            errors.append(exc)

    t = threading.Thread(target=step)
    t.start()
    assert inside.wait(10)
    store.close(remove=False)  # as cleanup.close_all does at exit
    t.join(10)
    assert errors == [] and store.step == 1
    pipe.close()
    with pytest.raises(RuntimeError, match=r"swap store .* is closed"):
        pipe.run(range(layout.num_groups), compute)
    again = SwapStore(str(tmp_path), layout, state_names=["a"], resume=True)
    assert again.step == 1
    again.close()
