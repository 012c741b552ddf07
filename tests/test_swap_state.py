"""Adam moments in swap files equal the in-RAM run with the same kernel, bit for bit; state
export/import, checkpoints and resume."""
from __future__ import annotations

import os

import pytest
import torch

from offload.swap import pipeline_host_bytes
from test_swap_util import SIZES, SPLIT, Reference, batches_for, swapped_state




def _run(st, params, steps, first, last):
    for step in range(first, last):
        st.step(batches_for(params, steps, step, SPLIT))


def _assert_same(st, params, ref):
    for i, p in enumerate(params):
        assert torch.equal(p, ref.params[i]), f"param {i}"
        m, v = st.read_state(p)
        assert torch.equal(m, ref.m[i]) and torch.equal(v, ref.v[i]), f"moments of param {i}"
        assert st.step_of(p) == ref.steps[i]


@pytest.mark.parametrize("sub_group_size,verify", [(1024, False), (3072, True)])
def test_equals_in_ram_reference(tmp_path, sub_group_size, verify):
    params = [torch.randn(n) for n in SIZES]
    ref = Reference(params)
    st = swapped_state(tmp_path, params, sub_group_size=sub_group_size, verify=verify)
    steps = [0] * len(params)
    for step in range(6):
        st.step(batches_for(params, steps, step, SPLIT))
        ref.step(step, SPLIT)
    _assert_same(st, params, ref)
    assert st.last_stats["write_bytes"] > 0 and set(st.last_stats) >= {
        "swap_read_s", "swap_write_s", "kernel_s", "wait_read_s", "wait_write_s", "step_s"}
    rep = st.memory_report()
    assert rep["nvme"] == 2 * st.layout.file_bytes and rep["pinned"] + rep["pageable"] == st.host_bytes
    assert st.host_bytes == pipeline_host_bytes(st.num_buffers, st.layout.region_bytes) == 2 << 20  # 1 MiB bound
    assert st.num_buffers * st.layout.region_bytes <= 1 << 20
    path = st.swap_path
    st.close()
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


def test_params_not_in_a_step_keep_their_state(tmp_path):
    params = [torch.randn(n) for n in (3000, 5)]
    st = swapped_state(tmp_path, params)
    st.step([(dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True),
              [(params[1], torch.ones(5), 1)])])
    m, v = st.read_state(params[0])
    assert not m.any() and not v.any() and st.step_of(params[0]) == 0 and st.export_state(params[0]) == {}
    m, v = st.read_state(params[1])
    assert torch.allclose(m, torch.full((5,), 0.1)) and st.step_of(params[1]) == 1
    assert st.step([]) == {}  # nothing to do: no I/O, no step
    st.close()


def test_export_import_round_trip(tmp_path):
    params = [torch.randn(n) for n in SIZES]
    ref = Reference(params)
    st = swapped_state(tmp_path / "a", params) if (tmp_path / "a").mkdir() is None else None
    steps = [0] * len(params)
    _run(st, params, steps, 0, 3)
    for s in range(3):
        ref.step(s, SPLIT)
    exported = [st.export_state(p) for p in params]
    st.close()
    (tmp_path / "b").mkdir()
    st2 = swapped_state(tmp_path / "b", params, sub_group_size=2048)
    for p, e, n in zip(params, exported, steps):
        st2.import_state(p, dict(e, step=torch.tensor(float(n))))
    _run(st2, params, steps, 3, 5)
    for s in range(3, 5):
        ref.step(s, SPLIT)
    _assert_same(st2, params, ref)
    st2.close()


def test_checkpoint_round_trip_other_layout(tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    params = [torch.randn(n) for n in SIZES]
    ref = Reference(params)
    st = swapped_state(swap, params, verify=True)
    steps = [0] * len(params)
    _run(st, params, steps, 0, 3)
    for s in range(3):
        ref.step(s, SPLIT)
    st.save_checkpoint(str(ckpt))
    st.save_checkpoint(str(ckpt))  # a second save replaces the first (new generation)
    assert sorted(os.listdir(ckpt / "rank0")) == ["offload-ckpt.exp_avg.2.bin", "offload-ckpt.exp_avg_sq.2.bin", "offload-ckpt.json",
                                    "offload-ckpt.lock"]
    _run(st, params, steps, 3, 4)  # moves on; the checkpoint must not
    st.close()
    st2 = swapped_state(swap, params, sub_group_size=5 * 1024, max_host_bytes=4 << 20)
    st2.load_checkpoint(str(ckpt))
    steps2 = [st2.step_of(p) for p in params]
    assert steps2 == ref.steps
    # params must be those of step 3 again (the caller's job): take them from the reference
    for p, q in zip(params, ref.params):
        p.copy_(q)
    _run(st2, params, steps2, 3, 5)
    for s in range(3, 5):
        ref.step(s, SPLIT)
    _assert_same(st2, params, ref)
    st2.close()


def test_checkpoint_corruption_is_detected(tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    params = [torch.randn(n) for n in SIZES]
    st = swapped_state(swap, params)
    steps = [0] * len(params)
    _run(st, params, steps, 0, 2)
    st.save_checkpoint(str(ckpt))
    before = [st.read_state(p) for p in params]
    with open(ckpt / "rank0" / "offload-ckpt.exp_avg_sq.1.bin", "r+b") as f:
        f.seek(4 * 5000)
        b = f.read(1)
        f.seek(4 * 5000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(OSError, match="exp_avg_sq fails its crc32.*nothing was loaded"):
        st.load_checkpoint(str(ckpt))
    for p, (m, v) in zip(params, before):
        assert all(torch.equal(x, y) for x, y in zip(st.read_state(p), (m, v)))
    st.close()


def test_resume_in_process(tmp_path):
    params = [torch.randn(n) for n in SIZES]
    ref = Reference(params)
    st = swapped_state(tmp_path, params)
    steps = [0] * len(params)
    _run(st, params, steps, 0, 3)
    for s in range(3):
        ref.step(s, SPLIT)
    saved = [p.clone() for p in params]
    st.pipeline.close()
    st.store.close(remove=False)  # as if the process had died after step 3
    # params of another step are refused
    with pytest.raises(ValueError, match="not those of step 3"):
        swapped_state(tmp_path, [torch.randn(n) for n in SIZES], resume=True)
    # a different sub-group layout is refused too
    with pytest.raises(ValueError, match="written with sub_group_size=1024: pass sub_group_size=1024"):
        swapped_state(tmp_path, saved, resume=True, sub_group_size=2048)
    st2 = swapped_state(tmp_path, saved, resume=True)
    steps2 = [st2.step_of(p) for p in saved]
    assert steps2 == steps
    _run(st2, saved, steps2, 3, 5)
    for s in range(3, 5):
        ref.step(s, SPLIT)
    _assert_same(st2, saved, ref)
    st2.close()
    assert os.listdir(tmp_path) == []


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="updates fp32 CPU params in place; got torch.float64"):
        swapped_state(tmp_path, [torch.randn(10, dtype=torch.float64)])
    with pytest.raises(ValueError, match="cannot hold 3 pipeline buffers"):
        swapped_state(tmp_path, [torch.randn(100_000)], max_host_bytes=20_000, sub_group_size=None)
    params = [torch.randn(10)]
    st = swapped_state(tmp_path, params)
    with pytest.raises(ValueError, match="not one of this optimizer's params"):
        st.read_state(torch.randn(10))
    with pytest.raises(ValueError, match="unknown keys"):
        st.step([(dict(lr=1.0, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0, decoupled=True, amsgrad=True),
                  [(params[0], torch.ones(10), 1)])])
    st.close()
    assert os.listdir(tmp_path) == []


def test_checkpoint_moves_between_host_tensors_and_swap(tmp_path):
    """The checkpoint format written from / read into plain tensors (offload='cpu' moments)."""
    from offload.swap.checkpoint import save_tensors
    from offload.zero.ckpt_states import load_states

    swap, a, b = tmp_path / "swap", tmp_path / "a", tmp_path / "b"
    swap.mkdir()
    params = [torch.randn(n) for n in SIZES]
    ref = Reference(params)
    for s in range(3):
        ref.step(s, SPLIT)
    # host -> swap, through a staging buffer smaller than one state (several chunks), in the
    # previous release's single-directory format (which still loads)
    save_tensors(str(a), {"exp_avg": ref.m, "exp_avg_sq": ref.v},
                 {"steps": ref.steps, "shapes": [list(p.shape) for p in params]}, stage_bytes=8192)
    st = swapped_state(swap, [p.clone() for p in ref.params])
    st.load_checkpoint(str(a))
    for i, p in enumerate(st.params):
        m, v = st.read_state(p)
        assert torch.equal(m, ref.m[i]) and torch.equal(v, ref.v[i]) and st.step_of(p) == ref.steps[i]
    # swap -> host
    st.save_checkpoint(str(b))
    m2 = [torch.empty_like(p) for p in params]
    v2 = [torch.empty_like(p) for p in params]
    meta = load_states(str(b), [p.numel() for p in params], {"exp_avg": m2, "exp_avg_sq": v2})
    assert meta["steps"] == ref.steps
    assert all(torch.equal(x, y) for x, y in zip(m2 + v2, ref.m + ref.v))
    st.close()


def test_two_optimizers_of_one_process_share_a_swap_dir(tmp_path):
    a, b = [torch.randn(10)], [torch.randn(20)]
    s1, s2 = swapped_state(tmp_path, a), swapped_state(tmp_path, b)
    assert [os.path.basename(s.swap_path) for s in (s1, s2)] == ["offload-run.rank0", "offload-run-2.rank0"]
    s1.close()
    s2.close()
    assert os.listdir(tmp_path) == []


def test_dropped_without_close_still_cleans_up(tmp_path):
    import gc

    params = [torch.randn(3000)]
    st = swapped_state(tmp_path, params)
    st.step([(dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True),
              [(params[0], torch.ones(3000), 1)])])
    assert os.listdir(tmp_path) == ["offload-run.rank0"]
    del st
    gc.collect()
    assert os.listdir(tmp_path) == []
