"""The swap step as a session (offload/swap/session.py, step.py) and typed state fields
through the swap layer: a bf16 state beside fp32 ones through the layout, the pipeline and
both checkpoint paths, bit for bit."""
from __future__ import annotations

import json
import os

import pytest
import torch

from offload.kernels.fields import StateField
from offload.swap import SwapLayout, SwapPipeline, SwapSession, SwapStore, plan_sub_groups
from offload.swap.checkpoint import load_store, load_tensors, read_manifest, save_store, save_tensors, verify_checkpoint
from offload.swap.runs import open_store
from offload.swap.session import GroupState
from test_swap_util import threads_engine
from offload.swap import fsutil

MIXED = (StateField("master"), StateField("exp_avg", torch.bfloat16), StateField("exp_avg_sq"))
NUMEL = 3 * 2048 + 77  # a short last sub-group: padding of each state on its own


def test_mixed_layout_pads_each_state_to_a_page_on_its_own():
    lay = SwapLayout(NUMEL, 2048, MIXED)
    assert lay.nstates == 3 and lay.dtype_name == "mixed" and lay.dtype_names == ["float32", "bfloat16", "float32"]
    # full sub-group: 2048 x 4, 2048 x 2 (4096: one page), 2048 x 4
    assert lay.state_spans(0) == [(0, 8192, 8192), (8192, 4096, 4096), (12288, 8192, 8192)]
    assert lay.region_bytes == 20480
    # the last one: 77 elements, each state padded to 4096 separately
    assert lay.state_spans(3) == [(0, 308, 4096), (4096, 154, 4096), (8192, 308, 4096)]
    assert lay.group_bytes(3) == 3 * 4096 and lay.file_bytes == 3 * 20480 + 3 * 4096
    with pytest.raises(ValueError, match="the states .* have several element sizes"):
        lay.itemsize  # noqa: B018  (a mixed layout has no single item size)


def test_mixed_layout_sub_group_is_whole_pages_of_the_narrowest_state():
    with pytest.raises(ValueError, match="sub_group_size must be a positive multiple of 2048, got 1024"):
        SwapLayout(NUMEL, 1024, MIXED)
    assert plan_sub_groups(10_000, MIXED, 1 << 20, 1000)[0] == 2048
    assert plan_sub_groups(10_000, 2, 1 << 20, 1000) == plan_sub_groups(10_000, ["a", "b"], 1 << 20, 1000) == (1024, 8)
    with pytest.raises(TypeError, match="a state must be a name or a StateField, got float"):
        SwapLayout(NUMEL, 2048, [1.5])


def test_store_refuses_names_of_other_dtypes_than_its_layout(tmp_path):
    with pytest.raises(ValueError, match="state 'exp_avg' is float32, the layout holds bfloat16 in its place"):
        SwapStore(str(tmp_path), SwapLayout(NUMEL, 2048, MIXED), state_names=["master", "exp_avg", "exp_avg_sq"])


def _values(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g).to(f.dtype) for f in MIXED]


def _open(tmp_path, name, sub_group_size=2048, **kw):
    store, nbuf = open_store(str(tmp_path), NUMEL, MIXED, identity={"digest": "d" * 32, "summary": "test"},
                             max_host_bytes=1 << 20, sub_group_size=sub_group_size, run_name=name, rank=0,
                             verify=True, resume=False, io_engine=kw.get("engine"))
    return store, SwapPipeline(store, buffers=nbuf)


def _fill(pipe, vals):
    def compute(g, s, e, tensors):
        for t, v in zip(tensors, vals):
            assert t.dtype == v.dtype
            t.copy_(v[s:e])
    pipe.run(range(pipe.layout.num_groups), compute, extra={"steps": [1]})


def _read(pipe):
    got = [torch.empty(NUMEL, dtype=f.dtype) for f in MIXED]

    def compute(g, s, e, tensors):
        for out, t in zip(got, tensors):
            out[s:e] = t
    pipe.run(range(pipe.layout.num_groups), compute, commit=False)
    return got


def _bits_equal(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32))


def test_bf16_state_round_trips_through_pipeline_and_checkpoints_bit_for_bit(tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    vals = _values(0)
    store, pipe = _open(swap, "a")
    try:
        _fill(pipe, vals)
        _bits_equal(_read(pipe), vals)
        m = json.loads((swap / "offload-a.rank0" / "manifest.json").read_text())
        assert m["dtype"] == "mixed" and m["dtypes"] == ["float32", "bfloat16", "float32"]
        save_store(store, pipe.buffers, str(ckpt), {"steps": [1]})
    finally:
        pipe.close()
        store.close()
    cm = read_manifest(str(ckpt))
    assert cm["dtypes"] == {"master": "float32", "exp_avg": "bfloat16", "exp_avg_sq": "float32"}
    assert cm["file_bytes"] == {"master": 28672, "exp_avg": 16384, "exp_avg_sq": 28672}
    verify_checkpoint(str(ckpt), MIXED, NUMEL)
    with pytest.raises(ValueError, match="expected 6221 of .* \\(float32\\)"):
        verify_checkpoint(str(ckpt), [f.name for f in MIXED], NUMEL)  # names alone mean fp32
    # into host tensors of the same dtypes
    host = {f.name: [torch.empty(NUMEL, dtype=f.dtype)] for f in MIXED}
    assert load_tensors(str(ckpt), host) == {"steps": [1]}
    _bits_equal([host[f.name][0] for f in MIXED], vals)
    with pytest.raises(ValueError, match="checkpoint holds exp_avg as bfloat16, the tensors are float32"):
        load_tensors(str(ckpt), {f.name: [torch.empty(NUMEL)] for f in MIXED})
    # into a store of another sub-group size, through its free slots, then committed
    _load_into_a_store_and_compare(swap, "b", ckpt, vals, sub_group_size=4096)


def _load_into_a_store_and_compare(swap, name, ckpt, vals, **kw):
    """Load checkpoint ``ckpt`` into a new store's free slots, commit, compare bit for bit."""
    store, pipe = _open(swap, name, **kw)
    try:
        meta, written = load_store(store, pipe.buffers, str(ckpt))
        store.commit(written, meta, advance=False)
        _bits_equal(_read(pipe), vals)
    finally:
        pipe.close()
        store.close()


def test_host_tensors_with_a_bf16_state_load_into_a_store(tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    vals = _values(1)
    half = NUMEL // 2  # two tensors per state, concatenated
    save_tensors(str(ckpt), {f.name: [v[:half], v[half:]] for f, v in zip(MIXED, vals)}, {"steps": [2]})
    _load_into_a_store_and_compare(swap, "c", ckpt, vals)


def test_fp32_checkpoint_manifest_keeps_the_first_format(tmp_path):
    """A checkpoint of fp32 states stays readable by the release before typed fields: one
    ``dtype`` and an int ``file_bytes``."""
    save_tensors(str(tmp_path), {"exp_avg": [torch.ones(10)], "exp_avg_sq": [torch.ones(10)]}, {})
    m = read_manifest(str(tmp_path))
    assert m["dtype"] == "float32" and m["file_bytes"] == 4096
    assert m["dtypes"] == {"exp_avg": "float32", "exp_avg_sq": "float32"}


def test_swap_manifest_without_dtypes_resumes_as_fp32(tmp_path):
    """A swap directory of the release before typed fields (no ``dtypes``) still resumes."""
    lay = SwapLayout(5000, 2048, 2)
    store = SwapStore(str(tmp_path), lay, state_names=["exp_avg", "exp_avg_sq"], verify=True)
    pipe = SwapPipeline(store, buffers=3)
    pipe.run(range(lay.num_groups), lambda g, s, e, ts: [t.fill_(g + 0.5) for t in ts], extra={"steps": [1]})
    pipe.close()
    path = os.path.join(store.path, "manifest.json")
    store.close(remove=False)
    m = json.loads(open(path).read())
    del m["dtypes"]
    del m[fsutil.SEAL]  # an older release's manifest: neither dtypes nor a seal
    with open(path, "w") as f:
        json.dump(m, f)
    store = SwapStore(str(tmp_path), lay, state_names=["exp_avg", "exp_avg_sq"], verify=True, resume=True)
    pipe = SwapPipeline(store, buffers=3)
    got = []
    pipe.run(range(lay.num_groups), lambda g, s, e, ts: got.append(float(ts[1][0])), commit=False)
    assert got == [0.5, 1.5, 2.5] and store.step == 1
    pipe.close()
    store.close()


class _Log:
    """An engine that records the order of submissions (op, sub-group)."""

    def __init__(self, inner, region):
        self.inner, self.region, self.log = inner, region, []

    def submit(self, reqs):
        self.log.append((reqs[0].op, reqs[0].offset // self.region))
        return self.inner.submit(reqs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_session_named_steps_move_each_group_through_its_states(tmp_path):
    inner = threads_engine()
    lay = SwapLayout(4 * 1024, 1024, 2)
    log = _Log(inner, lay.region_bytes)
    store = SwapStore(str(tmp_path), lay, state_names=["a", "b"], io_engine=log)
    pipe = SwapPipeline(store, buffers=3)
    try:
        pipe.run(range(4), lambda g, s, e, ts: None)  # every group valid, so the next session reads
        log.log.clear()
        session = pipe.open_session(range(4))
        with pytest.raises(RuntimeError, match="sub-group 1 acquired out of the session's order"):
            session.acquire(1)
        with session.guard():
            for g in session.groups:
                views = session.views(g)
                assert session.state[g] is GroupState.COMPUTING and len(views) == 2
                # at least g+1 is read ahead before g is computed
                assert ("read", g) in log.log and (g + 1 == 4 or ("read", g + 1) in log.log)
                session.finish(g)
                assert session.state[g] in (GroupState.WRITING, GroupState.DONE)
            session.drain()
        assert all(s is GroupState.DONE for s in session.state.values())
        assert session.computed == [0, 1, 2, 3] and len(session.free) == 3
        stats = session.commit({"steps": [2]})
        assert store.step == 2 and stats["groups"] == 4.0 and stats["read_bytes"] == 4 * lay.region_bytes
        # three buffers: never more than three groups read and not yet written back
        assert [op for op, _ in log.log[:3]] == ["read", "read", "read"]
    finally:
        pipe.close()
        store.close()
        inner.close()


class _Req:
    def __init__(self, op, offset):
        self.op, self.offset, self.buf = op, offset, bytearray(16)
        self.file = type("F", (), {"path": "/fake/slot"})()


class _LazyEngine:
    """Completes a write only when waited for (``poll`` says not yet): writes stay in flight."""

    def __init__(self):
        self.submitted = []

    def submit(self, reqs):
        self.submitted.append([(r.op, r.offset) for r in reqs])
        return reqs

    def poll(self, ticket):
        return False

    def wait(self, reqs):
        return [len(r.buf) for r in reqs]


def test_session_refuses_a_read_of_a_range_being_written():
    """[Note: no read races a write]: a read of a (file, offset) whose write is still in
    flight is refused before it is submitted, whatever the route."""
    eng = _LazyEngine()
    reads = lambda g, buf: [_Req("read", 1 if g == 3 else 100 + g)]  # noqa: E731  (3 reads where 1 writes)
    writes = lambda g, buf: [_Req("write", g)]  # noqa: E731
    session = SwapSession(eng, [object(), object(), object()], [0, 1, 2, 3], reads=reads, writes=writes)
    for g in (0, 1):
        session.acquire(g)
        session.finish(g)
    # acquire(2) waits for write 0 to free a buffer, then reads 3 ahead: write 1 still flies
    with pytest.raises(RuntimeError, match="read of sub-group 3 submitted while a write of it is in flight"):
        session.acquire(2)
    assert [("read", 1)] not in eng.submitted
    session.abort()
    assert len(session.free) == 3  # every buffer back after the abort


def test_group_cache_reads_and_writes_a_bf16_state_in_place(tmp_path):
    """The random-access cache (one-group sessions) sees the same typed views as a step."""
    from offload.swap.cache import GroupCache

    vals = _values(2)
    store, pipe = _open(tmp_path, "d")
    try:
        _fill(pipe, vals)
        cache = GroupCache(pipe)
        master, m, v = cache.load(1)
        assert m.dtype == torch.bfloat16 and m.numel() == 2048
        _bits_equal([master, m, v], [x[2048:4096] for x in vals])
        m.fill_(3.0)
        cache.mark_dirty()
        assert cache.flush(lambda: {"steps": [1]}) and store.step == 1  # flipped one sub-group, no new step
        vals[1][2048:4096] = 3.0
        _bits_equal(_read(pipe), vals)
    finally:
        pipe.close()
        store.close()
