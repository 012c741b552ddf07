"""[Note: params written by others] (offload/optim/flat/param_sync.py): weights written into
the params after the optimizer was built (``model.load_state_dict``, ``offload.shard``'s
checkpoint and weight loads) are what the next step starts from, as with torch's optimizers.
The flat store's master kept the construction-time weights and the first step undid the load."""
from __future__ import annotations

import pytest
import torch

import offload
from offload.optim.flat import param_sync


def _net(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(dtype)


def _step(m, opt, s):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s)).to(next(m.parameters()).dtype)
    m(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


CASES = [("bfloat16", "cpu", None), ("bfloat16", "nvme", None), ("float32", "cpu", 2), ("float32", "nvme", 1)]


def _write(m, new, how):
    """``new``'s weights into ``m``'s params, as users write them."""
    if how == "load_state_dict":
        m.load_state_dict(new.state_dict())
        return
    for p, q in zip(m.parameters(), new.parameters()):
        if how == "rebind":  # p.data = t: other memory, the param's version unchanged
            p.data = q.detach().clone()
        else:  # an in-place write through .data (a version counter of its own), then the README's call
            p.data.copy_(q.detach())
            torch.autograd.graph.increment_version(p)


@pytest.mark.parametrize("how", ["load_state_dict", "rebind", "data_copy_increment_version"])
@pytest.mark.parametrize("dtype,where,stage", CASES, ids=[f"{d}-{w}-stage{s}" for d, w, s in CASES])
def test_weights_loaded_after_construction_are_stepped_from(dtype, where, stage, how, tmp_path):
    dtype = getattr(torch, dtype)

    def make(m, name):
        kw = {"stage": stage} if stage is not None else {}
        if where == "nvme":
            (tmp_path / name).mkdir()
            kw["swap_dir"] = str(tmp_path / name)
        return offload.AdamW(m.parameters(), lr=1e-2, offload=where, **kw)

    m = _net(0, dtype)
    opt = make(m, "a")
    assert opt._store.kind == "flat" or stage is not None
    _step(m, opt, 0)
    _write(m, _net(1, dtype), how)  # new weights, after a step even
    ref = _net(1, dtype)
    ref_opt = make(ref, "b")  # the same optimizer, built on the new weights
    ref_opt.load_state_dict(opt.state_dict())  # the same moments and step; its masters: the dict's
    ref.load_state_dict(_net(1, dtype).state_dict())
    for s in (1, 2):
        _step(m, opt, s)
        _step(ref, ref_opt, s)
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    opt.close()
    ref_opt.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_a_write_of_the_same_values_keeps_the_fp32_master(dtype, where, tmp_path):
    # torch's test_optim (_compare_between) copies equal params back into the params after
    # each step; so do p.copy_(same) and a clamp_ that clips nothing. The master took the
    # param's rounded values and lost every update below the param's ulp (lr=1e-4 here: the
    # rewritten run drifted from the other). Elements the write did change take its values.
    dtype = getattr(torch, dtype)

    def make(m, name):
        kw = {}
        if where == "nvme":
            (tmp_path / name).mkdir()
            kw["swap_dir"] = str(tmp_path / name)
        return offload.AdamW(m.parameters(), lr=1e-4, offload=where, **kw)

    a, b = _net(0, dtype), _net(0, dtype)
    opt_a, opt_b = make(a, "a"), make(b, "b")
    start = [p.detach().clone() for p in a.parameters()]
    for s in range(12):
        _step(a, opt_a, s)
        _step(b, opt_b, s)
        with torch.no_grad():
            for p in b.parameters():
                p.copy_(p.clone())  # the same values, written in place
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), start))  # the test can fail
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    before = opt_b.state_dict()["state"][0]["master"].clone()  # b[0].weight's
    assert not torch.equal(before, before.to(dtype).float())  # it holds bits below the ulp
    with torch.no_grad():
        b[0].weight[0, 0] = 0.5  # one element really written
    for g in opt_b.param_groups:
        g["lr"] = 0.0  # the step below leaves the masters as the write left them
    _step(b, opt_b, 99)
    master = opt_b.state_dict()["state"][0]["master"]
    assert master[0, 0].item() == 0.5
    rest = torch.ones_like(master, dtype=torch.bool)
    rest[0, 0] = False
    assert torch.equal(master[rest], before[rest])
    opt_a.close()
    opt_b.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_store_own_writes_are_not_taken_for_a_load(dtype):
    m = _net(0, getattr(torch, dtype))
    opt = offload.AdamW(m.parameters(), lr=1e-2, offload="cpu", stage=2)
    for s in range(3):
        _step(m, opt, s)
        assert param_sync.changed(opt._store) == []  # the fp32 master is never rounded to the param
    with torch.no_grad():
        m[0].weight.add_(1.0)
    assert param_sync.changed(opt._store) == [m[0].weight]
    opt.close()


def test_stage3_checkpoint_with_params_on_disk_steps_from_the_loaded_weights(tmp_path):
    def make(tag):
        m = _net(0)
        (tmp_path / tag).mkdir()
        offload.shard(m, offload_params="nvme", swap_dir=str(tmp_path / tag), unit={torch.nn.Linear})
        return m, offload.AdamW(m.parameters(), lr=1e-2)

    m, opt = make("a")
    for s in range(2):
        _step(m, opt, s)
    offload.shard.save_checkpoint(m, opt, str(tmp_path / "ck"))
    m2, opt2 = make("b")
    offload.shard.load_checkpoint(m2, opt2, str(tmp_path / "ck"))
    for mm, oo in ((m, opt), (m2, opt2)):
        _step(mm, oo, 2)
    a, b = offload.shard.gathered_params(m), offload.shard.gathered_params(m2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt.close()
    opt2.close()


# ------------------------------------------- [Note: stepped params are marked written] (step_guard.py)
OWN_MASTER = [("float32", "none"), ("float32", "cpu"), ("float32", "nvme"), ("bfloat16", "none"),
              ("bfloat16", "cpu"), ("bfloat16", "nvme")]


def _make(params, where, tmp_path, name, **kw):
    if where == "nvme":
        (tmp_path / name).mkdir()
        kw["swap_dir"] = str(tmp_path / name)
    return offload.AdamW(params, offload=where, **kw)


@pytest.mark.parametrize("dtype,where", OWN_MASTER, ids=[f"{d}-{w}" for d, w in OWN_MASTER])
def test_backward_through_a_graph_from_before_the_step_raises_as_with_torch(dtype, where, tmp_path):
    """torch's in-place update bumps the params' versions, so a backward that saved a param
    before the step refuses; the kernels' pointer writes must count the same."""
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: _make(ps, where, tmp_path, "a", lr=1e-2)):
        m = _net(0, getattr(torch, dtype))
        opt = make(m.parameters())
        x = torch.randn(4, 8).to(getattr(torch, dtype))
        m(x).float().square().mean().backward()
        loss = m(x).float().square().mean()  # saves the weights as they are now
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        getattr(opt, "close", lambda: None)()


@pytest.mark.parametrize("where", ["none", "cpu", "nvme"])
def test_two_optimizers_over_the_same_bf16_params_both_land(where, tmp_path):
    """Each optimizer keeps an fp32 master of the bf16 params. The second used to step from
    its own master and overwrite the first one's update (it moved the params by nothing
    when both computed the same update); now each sees the other's write and starts from
    the param where it changed, as torch's optimizers do over params they share."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4097).bfloat16())
    ours = [_make([p], where, tmp_path, f"o{k}", lr=lr, weight_decay=0.1) for k, lr in enumerate((1e-2, 3e-2))]
    ref_p = p.detach().clone()
    refs = [torch.nn.Parameter(ref_p.float()) for _ in range(2)]
    ref_opts = [torch.optim.AdamW([r], lr=lr, weight_decay=0.1, foreach=False) for r, lr in zip(refs, (1e-2, 3e-2))]
    for s in range(4):
        g = torch.randn(4097, generator=torch.Generator().manual_seed(s)).bfloat16()
        p.grad = g
        for k, opt in enumerate(ours):
            opt.step()
            # the reference: each optimizer steps from the shared bf16 value where the other
            # one changed it, from its own fp32 master where the value is still its rounding
            with torch.no_grad():
                refs[k].copy_(torch.where(refs[k].bfloat16() == ref_p, refs[k], ref_p.float()))
            refs[k].grad = g.float()
            ref_opts[k].step()
            ref_p = refs[k].detach().bfloat16()
            # at most one bf16 ulp apart (an fp32 ulp of difference may round either way)
            assert torch.allclose(p.detach().float(), ref_p.float(), rtol=2 ** -7, atol=0), (s, k)
    moved = (p.detach().float() - torch.randn(4097, generator=torch.Generator().manual_seed(0)).bfloat16().float())
    assert moved.abs().mean() > 0.05  # both updates landed (one alone moves ~0.04 in 4 steps)
    for opt in ours:
        opt.close()


def test_a_single_optimizer_never_reads_back_its_own_rounded_params():
    """The mark must not make the store take its own write for another's: the fp32 master
    would be replaced by the rounded param at every step."""
    m = _net(0, torch.bfloat16)
    opt = offload.AdamW(m.parameters(), lr=1e-2, offload="cpu")
    versions = [p._version for p in m.parameters()]
    for s in range(3):
        _step(m, opt, s)
        assert param_sync.changed(opt._store) == []
    assert [p._version for p in m.parameters()] == [v + 3 for v in versions]
    opt.close()


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_a_param_of_many_sub_groups_is_merged_chunk_by_chunk(where, tmp_path, monkeypatch):
    # refresh_changed takes a changed param a sub-group of the swap files at a time (in RAM,
    # HOST_CHUNK elements): every chunk must merge as the whole did, the elements written on
    # either side of each boundary taking the write and the rest keeping their fp32 master.
    monkeypatch.setattr(param_sync, "HOST_CHUNK", 1000)
    n = 4096 * 3 + 77
    torch.manual_seed(5)
    p = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
    kw = dict(swap_dir=str(tmp_path), sub_group_size=4096) if where == "nvme" else {}
    opt = offload.AdamW([p], lr=1e-4, offload=where, **kw)
    if where == "nvme":
        assert opt._store._swap.layout.num_groups >= 4  # the test crosses sub-groups
    for s in range(4):
        p.grad = torch.randn(n, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
        opt.step()
    before = opt.state_dict()["state"][0]["master"].clone()
    assert not torch.equal(before, before.to(torch.bfloat16).float())  # bits below the ulp
    idx = [0, 999, 1000, 4095, 4096, 8191, 8192, 12287, 12288, n - 1]
    with torch.no_grad():
        p.copy_(p.clone())  # the same values everywhere...
        p[idx] = 0.5  # ...but these
    assert param_sync.changed(opt._store) == [p]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    master = opt.state_dict()["state"][0]["master"]
    assert torch.equal(master[idx], torch.full((len(idx),), 0.5))
    rest = torch.ones(n, dtype=torch.bool)
    rest[idx] = False
    assert torch.equal(master[rest], before[rest])
    assert torch.equal(p.detach(), master.to(torch.bfloat16))
    opt.close()


def _own_master_job(rank, world, where, load, swap_root, ckpt):
    """Two ranks, bf16 params that are their own master (each rank steps its bf16 shard and
    all-gathers it): weights written after construction, then (``load``) the optimizer's
    checkpoint or state_dict of those weights; the step starts from them."""
    import os
    kw = {}
    if where == "nvme":
        kw["swap_dir"] = os.path.join(swap_root, f"{load}-r{rank}")
        os.makedirs(kw["swap_dir"])
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8192).bfloat16())
    opt = offload.AdamW([p], lr=1e-3, stage=2, master_dtype="bfloat16", offload=where, **kw)
    try:
        weights = torch.full_like(p, 5.0)
        with torch.no_grad():
            p.copy_(weights)  # model.load_state_dict after the optimizer was built
        if load == "ckpt":
            opt.load_checkpoint(ckpt)
        elif load == "sd":
            opt.load_state_dict(torch.load(os.path.join(ckpt, "sd.pt"), weights_only=False))
        kept = torch.equal(p.detach(), weights)
        p.grad = torch.ones_like(p)
        opt.step()
        return kept, float((p.detach().float() - 5.0).abs().max())
    finally:
        opt.close()


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_two_ranks_own_bf16_master_follows_weights_written_after_construction(where, tmp_path):
    """[Note: bf16 master] on several ranks: the master is the rank's bf16 shard, taken from
    the params when the optimizer was built. A write after that was ignored: the step started
    from the old shard and all-gathered it over the write (and with offload="nvme" a
    load_checkpoint or load_state_dict did the same), so a resume that loads the weights
    into a built optimizer went on from the wrong params."""
    from _ranks import group
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    p = torch.nn.Parameter(torch.full((8192,), 5.0).bfloat16())
    one = offload.AdamW([p], lr=1e-3, master_dtype="bfloat16", offload="cpu")
    one.save_checkpoint(str(ckpt))
    torch.save(one.state_dict(), ckpt / "sd.pt")
    for load in ("none", "ckpt", "sd"):
        got = group(2).run(_own_master_job, where, load, str(tmp_path), str(ckpt), timeout=180)
        for rank, (kept, moved) in got.items():
            assert kept, (load, rank)
            assert moved <= 0.03125, (load, rank, moved)  # one step of lr 1e-3 from 5.0: a bf16 ulp at most
