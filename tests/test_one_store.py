"""One swapped store and one checkpoint format (issue #14, item 4): the in-place fp32 store
is the one-shard case of the flat store's swapped store, its step counts live in a
StepContext, and every store saves rank<r>/ with typed fields."""
from __future__ import annotations

import collections
import json
import os
import weakref

import pytest
import torch

import offload
from offload.kernels.fields import ADAM, MASTER
from offload.optim.context import StepContext, StepCounts
from offload.optim.swapped_shards import SwappedShards, WorkItem

from test_swap_util import SIZES, SPLIT, Reference, batches_for, swapped_state
import _internals as internals

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _ctx():
    state = collections.defaultdict(dict)
    return StepContext(StepCounts(lambda: state)), state


def _same(a, b):
    return a.shape == b.shape and torch.equal(a, b)


# ------------------------------------------------------------------ one store
def test_in_place_store_is_the_one_shard_case_of_the_swapped_store(tmp_path):
    params = [torch.randn(n) for n in SIZES]
    st = swapped_state(tmp_path, params)
    assert isinstance(st.core, SwappedShards)
    assert st.core.fields == ADAM.fields and MASTER not in st.core.fields
    assert st.core.sizes == [sum(SIZES)]
    st.close()


def test_the_shard_store_steps_an_in_place_param_as_torch(tmp_path):
    # SwappedShards driven directly: fields without a master, one work item per param whose
    # output (mode "master") is the fp32 param itself; against torch.optim.AdamW.
    torch.manual_seed(0)
    params = [torch.randn(n) for n in (3000, 7, 1030)]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    topt = torch.optim.AdamW(ref, **HP)
    store = SwappedShards([sum(p.numel() for p in params)], swap_dir=str(tmp_path), identity={"t": 1},
                          extra=lambda: {"steps": []}, fields=ADAM.fields, sub_group_size=1024,
                          max_host_bytes=1 << 20, run_name="t")
    store.initialise(None)
    hyper = dict(lr=HP["lr"], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
    for step in range(1, 4):
        grads = [torch.randn(p.numel()) for p in params]
        items, off = [], 0
        for p, g in zip(params, grads):
            kw = dict(hyper, step=step)
            # positional tuples of WorkItem's order are accepted as well
            item = (0, off, off + p.numel(), g, kw, p.view(-1), "master")
            items.append(WorkItem(*item) if step % 2 else item)
            off += p.numel()
        store.step(items)
        for r, g in zip(ref, grads):
            r.grad = g.view(r.shape)
        topt.step()
    off = 0
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)
        got = store.read(0, off, off + p.numel())
        torch.testing.assert_close(got["exp_avg"], topt.state[r]["exp_avg"], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(got["exp_avg_sq"], topt.state[r]["exp_avg_sq"], rtol=1e-6, atol=1e-10)
        off += p.numel()
    store.close()


def test_a_work_item_of_the_wrong_mode_is_refused(tmp_path):
    store = SwappedShards([100], swap_dir=str(tmp_path), identity={}, extra=lambda: {}, fields=ADAM.fields,
                          sub_group_size=1024, max_host_bytes=1 << 20, run_name="t")
    store.initialise(None)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, step=1)
    with pytest.raises(ValueError, match="mode 'copy' in a store of fields"):
        store.step([WorkItem(0, 0, 100, torch.ones(100), kw, torch.zeros(100), "copy")])
    with pytest.raises(ValueError, match="unknown state 'master'"):
        store.read(0, 0, 10, ("master",))
    store.close()


# ------------------------------------------------------------------ step counts in the context
def test_step_counts_live_in_the_context_only(tmp_path):
    params = [torch.randn(n) for n in SIZES]
    ctx, state = _ctx()
    st = swapped_state(tmp_path, params, ctx=ctx)
    steps = [0] * len(params)
    for s in range(3):
        st.step(batches_for(params, steps, s, SPLIT))
    assert [int(state[p]["step"]) if "step" in state.get(p, {}) else 0 for p in params] == steps
    ctx.steps.set(params[0], 41)  # whoever holds the context changes a count: the store reads it
    assert st.step_of(params[0]) == 41
    st.flush()
    st.write_state(params[1], *st.read_state(params[1]), step=9)
    st.flush()
    manifest = json.load(open(os.path.join(st.swap_path, "manifest.json")))
    assert manifest["extra"]["steps"][:2] == [41, 9]  # persisted with the next commit
    st.close(keep_swap=True)
    ctx2, state2 = _ctx()
    again = swapped_state(tmp_path, params, ctx=ctx2, resume=True)
    assert [again.step_of(p) for p in params] == [41, 9] + steps[2:]
    assert int(state2[params[0]]["step"]) == 41
    again.close()


def test_a_failed_step_leaves_the_counts_as_they_were(tmp_path, monkeypatch):
    from offload.kernels import get_backend

    params = [torch.randn(n) for n in SIZES]
    ctx, state = _ctx()
    st = swapped_state(tmp_path, params, ctx=ctx)
    steps = [0] * len(params)
    st.step(batches_for(params, steps, 1, SPLIT))
    before = [st.step_of(p) for p in params]

    def boom(*a, **kw):
        raise RuntimeError("no kernel today")

    # the store keeps the shared backend object: patching its face reaches the store's step
    monkeypatch.setattr(get_backend(None), "rule_step", boom)
    monkeypatch.setattr(get_backend(None), "checked_rule_step", boom)
    monkeypatch.setattr(get_backend(None), "checked_rule_steps", boom)
    with pytest.raises(RuntimeError, match="no kernel today"):
        st.step(batches_for(params, list(steps), 2, SPLIT))
    monkeypatch.undo()
    assert [st.step_of(p) for p in params] == before
    st.close()


def test_the_optimizer_store_counts_in_opt_state_and_holds_no_optimizer(tmp_path):
    p = torch.nn.Parameter(torch.randn(3000))
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, **HP)
    p.grad = torch.ones(3000)
    opt.step()
    opt.step()
    assert internals.store(opt).step_of(p) == 2 == int(opt.state[p]["step"])
    # the counts come through a StepContext: no optimizer (nor a weak reference to one) in the store
    assert not any(v is opt or isinstance(v, weakref.ref) for v in vars(internals.store(opt)).values())
    opt.close()


# ------------------------------------------------------------------ one checkpoint format
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_stage0_saves_the_rank_format_with_typed_fields(tmp_path, kind):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (30, 7)]
    kw = dict(offload="nvme", swap_dir=str(tmp_path)) if kind == "nvme" else dict(offload="cpu")
    opt = offload.AdamW(params, **HP, **kw)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.save_checkpoint(str(tmp_path / "ck"))
    m = json.load(open(tmp_path / "ck" / "rank0" / "offload-ckpt.json"))
    assert m["fields"] == [f.describe() for f in ADAM.fields]
    assert (m["meta"]["kind"], m["meta"]["world"], m["meta"]["rank"], m["meta"]["groups"]) == ("flat", 1, 0, [[30, 7]])
    assert m["meta"]["steps"] == [1, 1]
    assert not os.path.exists(tmp_path / "ck" / "offload-ckpt.json")
    opt.close()


def test_a_checkpoint_whose_manifest_lies_about_a_dtype_is_caught(tmp_path):
    # another dtype converts as it loads (tests/test_checkpoint_convert.py); a manifest that says
    # bfloat16 over float32 bytes fails the data's crc32, and the states are left as they were
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(30))
    opt = offload.AdamW([p], offload="cpu", **HP)
    p.grad = torch.ones(30)
    opt.step()
    opt.save_checkpoint(str(tmp_path / "ck"))
    path = tmp_path / "ck" / "rank0" / "offload-ckpt.json"
    m = json.load(open(path))
    m["fields"][1]["dtype"] = "bfloat16"
    del m["manifest_crc32"]  # unsealed (an older release's manifest): else its own checksum fails first
    path.write_text(json.dumps(m))
    before = opt.state_dict()["state"][0]["exp_avg_sq"].clone()
    with pytest.raises(OSError, match=r"exp_avg_sq fails its crc32"):
        opt.load_checkpoint(str(tmp_path / "ck"))
    assert _same(opt.state_dict()["state"][0]["exp_avg_sq"], before)
    opt.close()


def test_a_cpu_checkpoint_loads_into_the_swapped_store_element_by_element(tmp_path):
    params = [torch.randn(n) for n in SIZES]
    ref = Reference(params)
    for s in range(3):
        ref.step(s, SPLIT)
    from offload.zero.ckpt_states import save_states

    save_states(str(tmp_path / "ck"), [p.numel() for p in params], {"exp_avg": ref.m, "exp_avg_sq": ref.v},
                {"steps": ref.steps, "shapes": [list(p.shape) for p in params]})
    (tmp_path / "swap").mkdir()
    st = swapped_state(tmp_path / "swap", [p.clone() for p in ref.params])
    st.load_checkpoint(str(tmp_path / "ck"))
    for i, p in enumerate(st.params):
        m, v = st.read_state(p)
        assert _same(m, ref.m[i]) and _same(v, ref.v[i]) and st.step_of(p) == ref.steps[i]
    st.close()


@pytest.mark.parametrize("kind", ["nvme", "flat"])
def test_load_checkpoint_leaves_a_state_dict_taken_before_alone(tmp_path, kind):
    # state_dict() hands out the step tensors themselves: the counts a load sets are new
    # tensors, not the old ones filled in place.
    p = torch.nn.Parameter(torch.randn(30))
    kw = dict(offload="nvme", swap_dir=str(tmp_path)) if kind == "nvme" else dict(stage=2)
    opt = offload.AdamW([p], **HP, **kw)
    p.grad = torch.ones(30)
    opt.step()
    opt.save_checkpoint(str(tmp_path / "ck"))
    opt.step()
    sd = opt.state_dict()
    opt.load_checkpoint(str(tmp_path / "ck"))
    assert float(sd["state"][0]["step"]) == 2.0 and float(opt.state[p]["step"]) == 1.0
    opt.close()


def test_a_dropped_in_place_store_frees_its_files_at_once(tmp_path):
    # The face and its core hold no cycle: dropping the store (no close(), no gc pass)
    # removes its swap directory, as before the stores became one.
    import gc

    gc.disable()
    try:
        st = swapped_state(tmp_path, [torch.randn(3000)])
        assert os.listdir(tmp_path)
        del st
        assert os.listdir(tmp_path) == []
    finally:
        gc.enable()
