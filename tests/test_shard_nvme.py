"""Stage 3 with the params on NVMe (``offload.shard(..., offload_params="nvme")``): the same
bits as params in RAM, every store, 1 and 2 gloo ranks; the pages leave RAM between uses;
p.grad's stand-in follows torch's zero_grad rules; bad input; two models in one swap_dir;
checkpoints loaded into params on NVMe.

[Note: paged tensors] in offload/memory/paging.py and [Note: the param tier] in
offload/shard/tier.py say what is checked here."""
from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

import offload
from offload.memory import paging
from offload.shard import gathered_params, runtime_of
import test_shard_train as base

STEPS = 4


def _swap_parent():
    return tempfile.mkdtemp(prefix="shard-nvme-", dir="/var/tmp")


def job_tiers(group, *, offload_params, states="none", dtype="float32", accumulate=1, max_grad_norm=None,
              zero_keep=False, state_dtype="float32", steps=STEPS, shared_parent=None):
    """Train the test model; the gathered params, and what the param tier saw. ``shared_parent``:
    one swap_dir for every rank (else one each)."""
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
    parent = shared_parent or _swap_parent()
    try:
        m = base._model()
        if dtype == "bfloat16":
            m = m.to(torch.bfloat16)
        swap = parent if offload_params == "nvme" else None
        model = offload.shard(m, process_group=group, offload_params=offload_params, swap_dir=swap)
        hp = dict(base.HP, eps=1e-2) if max_grad_norm else base.HP
        opt = offload.AdamW(model.parameters(), offload=states, swap_dir=parent if states == "nvme" else None,
                            max_grad_norm=max_grad_norm, state_dtype=state_dtype, **hp)
        rt = runtime_of(model)
        resident = []
        for step in range(steps):
            for micro in range(accumulate):
                loss = base._loss(model, step, micro, world, rank, {})
                loss.float().backward()
            if rt.tier is not None:
                resident.append(rt.tier.resident_bytes())
            opt.step()
            opt.zero_grad(set_to_none=not zero_keep)
            if rt.tier is not None:
                resident.append(rt.tier.resident_bytes())
        out = {"params": gathered_params(model), "resident": resident,
               "disk": rt.tier.disk_bytes if rt.tier is not None else 0,
               "read": rt.tier.bytes_read if rt.tier is not None else 0,
               "shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
        opt.close()
        if rt.tier is not None:
            path = rt.tier.path
            rt.tier.close()
            out["removed"] = not os.path.exists(path)
        return out
    finally:
        if shared_parent is None:
            shutil.rmtree(parent, ignore_errors=True)


def _run(pools, world, **kw):
    if world == 1:
        return [job_tiers(None, **kw)]
    return pools(world).run("test_shard_nvme:job_tiers", **kw)


pools = base.pools


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


CASES = {
    "fp32_host_states": dict(),
    "fp32_cpu_states": dict(states="cpu"),
    "fp32_nvme_states": dict(states="nvme"),
    "bf16_cpu_states": dict(dtype="bfloat16", states="cpu"),
    "bf16_nvme_states": dict(dtype="bfloat16", states="nvme"),
    "bf16_nvme_int8": dict(dtype="bfloat16", states="nvme", state_dtype="int8"),
    "accumulate_clip": dict(states="nvme", accumulate=2, max_grad_norm=0.5),
    "zero_grad_in_place": dict(states="cpu", accumulate=2, zero_keep=True),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_params_on_nvme_equal_params_in_ram(pools, world, case):
    kw = CASES[case]
    if world == 2 and case not in ("fp32_nvme_states", "bf16_nvme_states", "accumulate_clip"):
        pytest.skip("the other cases run on one rank (the tier is per rank)")
    ram = _run(pools, world, offload_params="cpu", **kw)
    disk = _run(pools, world, offload_params="nvme", **kw)
    for r, d in zip(ram, disk):
        _same(d["params"], r["params"])
        assert d["removed"]
        assert d["read"] > 0
        # between steps (after zero_grad) nothing of the shards stays in RAM but partial edge pages
        assert max(d["resident"][1::2]) <= 4096 * 4 * len(d["params"]), d["resident"]


def test_ranks_can_share_one_swap_dir(pools, tmp_path):
    """Params and states on NVMe, two ranks, one swap_dir (a DeepSpeed config's one nvme_path):
    each rank's optimizer directory is named by its rank (both took rank 0's: rank 1 failed)."""
    ram = _run(pools, 2, offload_params="cpu", states="nvme", steps=2)
    shared = _run(pools, 2, offload_params="nvme", states="nvme", shared_parent=str(tmp_path), steps=2)
    for r, d in zip(ram, shared):
        _same(d["params"], r["params"])
    assert os.listdir(tmp_path) == []  # every rank removed its own directories


def test_the_contract_holds_with_params_on_nvme():
    ref = base._reference(STEPS, 1)
    out = job_tiers(None, offload_params="nvme", states="nvme")
    base._assert_params(out["params"], ref)


def test_grads_live_where_the_states_live(tmp_path):
    model = offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path))
    opt = offload.AdamW(model.parameters(), offload="cpu")
    base._loss(model, 0, 0, 1, 0, {}).backward()
    shard = next(p for p in model.parameters() if hasattr(p, "_offload_shard"))
    assert shard.grad is not None and shard._offload_shard.flat.grad_area is None  # in RAM: states are
    opt.close()
    runtime_of(model).tier.close()
    model = offload.shard(base._model())  # params in RAM, states on NVMe: the grads go to a swap file
    opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path))
    rt = runtime_of(model)
    base._loss(model, 0, 0, 1, 0, {}).backward()
    shard = next(p for p in model.parameters() if hasattr(p, "_offload_shard"))
    assert shard.grad is shard._offload_shard.flat.grad_standin and rt.tier.bytes_written > 0
    opt.step()
    opt.close()
    rt.tier.close()
    with pytest.raises(ValueError, match="not crash-safe"):
        model = offload.shard(base._model().to(torch.bfloat16), offload_params="nvme", swap_dir=str(tmp_path))
        offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), master_dtype="bfloat16")


def test_grad_standin_follows_torch_rules(tmp_path):
    model = offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path))
    opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path))
    rt = runtime_of(model)
    base._loss(model, 0, 0, 1, 0, {}).backward()
    shards = [p for p in model.parameters() if hasattr(p, "_offload_shard")]
    flat = shards[0]._offload_shard.flat
    assert shards[0].grad is flat.grad_standin and shards[0].grad.shape == shards[0].shape
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.nn.utils.clip_grad_norm_(shards, 1.0)  # in place on the stand-in: torch's own error
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(1))
    with pytest.raises(RuntimeError, match="single memory location"):
        scaler.unscale_(opt)  # GradScaler reads grads in memory: refused the same way
    g = flat.disk_grad()
    paging.load([g])
    assert g.abs().sum() > 0
    paging.evict([g])
    shards[0].grad.zero_()  # zero_grad(set_to_none=False): the grad on disk is zeroed
    g = flat.disk_grad()
    paging.load([g])
    assert g.abs().sum() == 0
    paging.evict([g])
    opt.close()
    rt.tier.close()


def test_bad_arguments(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="swap_dir"):
        offload.shard(base._model(), offload_params="nvme")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="swap_dir"):  # an unset variable: it took the cwd, as the optimizer does not
        offload.shard(base._model(), offload_params="nvme", swap_dir="")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="swap_dir"):
        offload.shard(base._model(), offload_params="cpu", swap_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path / "missing"))


def test_swap_dir_expands_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "swap").mkdir()
    model = offload.shard(base._model(), offload_params="nvme", swap_dir="~/swap")
    assert os.listdir(tmp_path / "swap") and not (tmp_path / "~").exists()
    runtime_of(model).tier.close()


def test_shard_values_round_trip(tmp_path):
    model = offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path))
    rt = runtime_of(model)
    flat = rt.units[1].flats[0]
    v = flat.shard_values()
    assert v.abs().sum() > 0
    flat.set_shard_values(v * 2)
    torch.testing.assert_close(flat.shard_values(), v * 2, rtol=0, atol=0)
    assert rt.tier.resident_bytes() <= 4096 * 2 * sum(len(u.flats) for u in rt.units)
    rt.tier.close()


# ---------------------------------------------------------------------- kill -9 and resume
def job_resumable(group, *, parent, first, steps, resume, leave):
    """Params and states on NVMe in one swap_dir for every rank; train steps [first, first +
    steps); the gathered params. ``leave``: the states' directories stay as a kill leaves them."""
    import _internals as internals

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = offload.shard(base._model(), process_group=group, offload_params="nvme", swap_dir=parent)
    opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=parent, resume=resume, **base.HP)
    for step in range(first, first + steps):
        base._loss(model, step, 0, world, rank, {}).float().backward()
        opt.step()
        opt.zero_grad()
    out = gathered_params(model)
    if leave:
        sw = opt._store._inner._swap
        sw._finalizer.detach()
        sw.pipeline.close()
        sw.store.close(remove=False)
    else:
        opt.close()
    runtime_of(model).tier.close()
    return out


def test_stage3_ranks_killed_between_their_commits_resume_at_the_step_all_hold(pools, tmp_path):
    # [Note: a rank one step ahead]: rank 1's states as a kill before its commit of step 3
    # left them (step 2), rank 0 committed step 3 and goes back to step 2
    parent = tmp_path / "swap"
    parent.mkdir()
    run = functools.partial(pools(2).run, "test_shard_nvme:job_resumable", parent=str(parent))
    whole = run(first=0, steps=4, resume=False, leave=False)
    run(first=0, steps=2, resume=False, leave=True)
    shutil.copytree(parent / "offload-flat.rank1", tmp_path / "rank1-at-step-2")
    run(first=2, steps=1, resume=True, leave=True)
    shutil.rmtree(parent / "offload-flat.rank1")
    os.rename(tmp_path / "rank1-at-step-2", parent / "offload-flat.rank1")
    resumed = run(first=2, steps=2, resume=True, leave=False)
    for got, ref in zip(resumed, whole):
        _same(got, ref)
    assert os.listdir(parent) == []


_TRAIN = r"""
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
import offload
from offload.memory import paging
from offload.shard import gathered_params
import test_shard_train as base

params_dir, states_dir, steps, kill_at, out = {params_dir!r}, {states_dir!r}, {steps}, {kill_at}, {out!r}
torch.manual_seed(0)
m = base._model().to(torch.{dtype})
model = offload.shard(m, offload_params="nvme", swap_dir=params_dir)
opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=states_dir, resume="auto", **base.HP)
sd = opt.state_dict()["state"]
start = int(sd[0]["step"]) if sd else 0
for step in range(start, steps):
    base._loss(model, step, 0, 1, 0, {{}}).float().backward()
    if step == kill_at:  # kill -9 in the middle of the step's param writes
        real, calls = paging.store, []
        def store(views):
            calls.append(1)
            if len(calls) == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            real(views)
        paging.store = store  # every caller goes through the module: offload.memory.paging.store
    opt.step()
    opt.zero_grad()
torch.save({{"params": gathered_params(model), "start": start}}, out)
opt.close()
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kill9_mid_step_then_resume_equals_an_uninterrupted_run(tmp_path, dtype):
    import subprocess

    from _forkserver import spawn

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]))

    def run(tag, kill_at):
        pdir, sdir = tmp_path / f"{tag}-params", tmp_path / f"{tag}-states"
        pdir.mkdir(exist_ok=True)
        sdir.mkdir(exist_ok=True)
        out = str(tmp_path / f"{tag}.pt")
        src = _TRAIN.format(tests=tests, params_dir=str(pdir), states_dir=str(sdir), steps=4, kill_at=kill_at, out=out,
                            dtype=dtype)
        child = spawn(src, env=env)  # forked from a warm interpreter (tests/_forkserver.py)
        _, err = child.communicate(timeout=300)
        return subprocess.CompletedProcess(["-c"], child.returncode, "", err), out, pdir

    whole, out_whole, _ = run("whole", -1)
    assert whole.returncode == 0, whole.stderr
    killed, out_res, pdir = run("resumed", 2)
    assert killed.returncode == -9, killed.stderr
    again, _, _ = run("resumed", -1)
    assert again.returncode == 0, again.stderr
    got, ref = torch.load(out_res), torch.load(out_whole)
    assert got["start"] == 2  # steps 0-1 were committed, step 2 was not
    _same(got["params"], ref["params"])
    # the killed run's param file was left behind; the next run removed it (its pid is gone)
    assert len(os.listdir(pdir)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planner_counts_the_bytes_on_disk_the_runtime_writes(tmp_path, dtype):
    from offload.plan import estimate

    m = base._model().to(dtype)
    blocks = [sum(p.numel() for p in b.parameters()) for b in m.blocks]
    total = sum(p.numel() for p in set(m.parameters()))
    model = offload.shard(m, offload_params="nvme", swap_dir=str(tmp_path))
    opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), max_host_bytes=1 << 20)
    rt = runtime_of(model)
    plan = estimate(total, stage=3, offload="nvme", offload_params="nvme", param_device="cpu", param_dtype=dtype,
                    unit_params=[total - sum(blocks)] + blocks, max_host_bytes=1 << 20)
    # the pipeline's buffers leave room in max_host_bytes for the paged grads and params of
    # the sub-group being stepped (offload/swap/pipeline.py paged_bound): the same sub-groups
    swap = opt._store._inner._swap
    assert plan.inputs["swap"]["sub_group_size"] == swap.layout.sub_group_size
    assert plan.inputs["swap"]["buffers"] == len(swap.pipeline.buffers)
    unpaged = estimate(total, stage=3, offload="nvme", offload_params="cpu", param_device="cpu", param_dtype=dtype,
                       unit_params=[total - sum(blocks)] + blocks, max_host_bytes=1 << 20)
    assert unpaged.inputs["swap"]["sub_group_size"] > swap.layout.sub_group_size
    assert plan.breakdown["nvme"]["params"] == rt.tier.logical["params"]
    assert plan.breakdown["nvme"]["grads"] == rt.tier.logical["grads"]
    # the states: the flat store's master and moments, as the planner's swap model says
    report = opt.memory_report()
    assert plan.inputs["swap"]["nstates"] == 3
    assert sum(v for k, v in plan.breakdown["nvme"].items() if k not in ("params", "grads")) == report["tiers"]["nvme"]
    opt.close()
    rt.tier.close()


def test_module_state_dict_reads_and_writes_the_shards_on_disk(tmp_path):
    model = offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path))
    ref = offload.shard(base._model())
    sd, want = model.state_dict(), ref.state_dict()
    assert set(sd) == set(want)
    for k in want:
        assert torch.equal(sd[k], want[k]), k
    doubled = {k: v * 2 for k, v in sd.items()}
    model.load_state_dict(doubled)
    for k, v in model.state_dict().items():
        assert torch.equal(v, doubled[k]), k
    runtime_of(model).tier.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_pager_against_a_shadow_copy(tmp_path, seed):
    """Random reads, writes, evictions and read-aheads of ranges of a few paged areas (odd
    sizes, ranges that share pages with their neighbours) keep every byte: compared with a
    plain copy after every operation that reads."""
    from offload.shard.tier import ParamTier

    g = torch.Generator().manual_seed(seed)
    tier = ParamTier(str(tmp_path), 0)
    try:
        sizes = [1, 1023, 4097, 70001]
        areas = [tier.area(n, torch.float32) for n in sizes]
        shadows = [torch.zeros(n) for n in sizes]

        def pick():
            i = int(torch.randint(len(sizes), (1,), generator=g))
            n = sizes[i]
            a = int(torch.randint(n, (1,), generator=g))
            b = int(torch.randint(a + 1, n + 1, (1,), generator=g))
            return i, a, b

        for _ in range(400):
            op = int(torch.randint(5, (1,), generator=g))
            i, a, b = pick()
            view, shadow = areas[i][a:b], shadows[i][a:b]
            if op == 0:  # write every element
                vals = torch.randn(b - a, generator=g)
                paging.will_write([view])
                view.copy_(vals)
                paging.store([view])
                shadow.copy_(vals)
            elif op == 1:  # read-modify-write
                paging.load([view])
                view.add_(1.0)
                paging.store([view])
                shadow.add_(1.0)
            elif op == 2:
                paging.evict([view])
            elif op == 3:
                paging.prefetch([view])
            else:
                paging.load([view])
                assert torch.equal(view, shadow), (i, a, b)
        for area, shadow in zip(areas, shadows):
            paging.load([area])
            assert torch.equal(area, shadow)
            paging.evict([area])
        assert tier.resident_bytes() <= 4096 * len(sizes)
    finally:
        tier.close()


def test_offload_clean_leaves_a_live_param_dir_and_the_next_run_removes_a_dead_one(tmp_path):
    import subprocess
    import sys

    from offload.shard.tier import ParamTier
    from offload.swap.cleanup import clean_dir

    live = ParamTier(str(tmp_path), 0)
    out = clean_dir(str(tmp_path))
    assert [p for p, _ in out["held"]] == [live.path] and os.path.isdir(live.path)
    # a process killed while holding its directory: the lock dies with it
    code = ("import os, signal, sys; from offload.shard.tier import ParamTier; "
            f"t = ParamTier({str(tmp_path)!r}, 1); print(t.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    dead = run.stdout.strip()
    assert run.returncode == -9 and os.path.isdir(dead)
    again = ParamTier(str(tmp_path), 1)
    assert not os.path.exists(dead) and os.path.isdir(live.path)
    again.close()
    live.close()
    assert os.listdir(tmp_path) == []


def test_two_models_with_params_on_nvme_share_one_swap_dir_in_one_process(tmp_path):
    """Each model's tier has a directory of its own (a second one had the first's name, pid and
    rank, and failed on its lock with a bare BlockingIOError); the grads-on-disk tier of a
    model in RAM with its states on NVMe too."""
    a = offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path))
    b = offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path))
    c = offload.shard(base._model())
    opts = [offload.AdamW(m.parameters(), offload="nvme", swap_dir=str(tmp_path), **base.HP) for m in (a, b, c)]
    paths = {runtime_of(m).tier.path for m in (a, b, c)}
    assert len(paths) == 3 and all(os.path.isdir(p) for p in paths)
    for m, opt in zip((a, b, c), opts):
        base._loss(m, 0, 0, 1, 0, {}).backward()
        opt.step()
    _same(gathered_params(a), gathered_params(b))
    _same(gathered_params(a), gathered_params(c))
    for m, opt in zip((a, b, c), opts):
        opt.close()
        runtime_of(m).tier.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("states,kind", [("nvme", "shard"), ("cpu", "optimizer")])
def test_a_checkpoint_loads_into_params_on_nvme(tmp_path, states, kind):
    """fp32 params on NVMe. States on NVMe, offload.shard's checkpoint: the load takes the
    masters from the params it just wrote, whose pages are on disk (it read them as zeros, and
    the next step trained on from zero masters). States in RAM, the optimizer's checkpoint: the
    params rewritten from the loaded masters went past the pager (lost at the next read)."""
    def build(tag):
        d = tmp_path / tag
        d.mkdir()
        model = offload.shard(base._model(), offload_params="nvme", swap_dir=str(d))
        return model, offload.AdamW(model.parameters(), offload=states, swap_dir=str(d) if states == "nvme" else None,
                                    **base.HP)

    def save(model, opt):
        (offload.shard.save_checkpoint(model, opt, ckpt) if kind == "shard" else opt.save_checkpoint(ckpt))

    def load(model, opt):
        (offload.shard.load_checkpoint(model, opt, ckpt) if kind == "shard" else opt.load_checkpoint(ckpt))

    def train(model, opt, start, stop):
        for step in range(start, stop):
            base._loss(model, step, 0, 1, 0, {}).backward()
            opt.step()
            opt.zero_grad()

    ckpt = str(tmp_path / "ckpt")
    model, opt = build("a")
    train(model, opt, 0, 2)
    save(model, opt)
    train(model, opt, 2, 3)
    want = gathered_params(model)
    again, opt2 = build("b")
    load(again, opt2)
    train(again, opt2, 2, 3)
    _same(gathered_params(again), want)
    for m, o in ((model, opt), (again, opt2)):
        o.close()
        runtime_of(m).tier.close()


@pytest.mark.parametrize("offload_params", ["cpu", "nvme"])
def test_a_later_optimizer_without_nvme_states_is_refused_where_the_grads_went_to_disk(tmp_path, offload_params):
    # an optimizer with offload="nvme" sends the grad shards to swap files for good: one
    # built after it that keeps its states elsewhere would step on p.grad's stand-ins
    swap = str(tmp_path) if offload_params == "nvme" else None
    model = offload.shard(base._model(), offload_params=offload_params, swap_dir=swap)
    offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), **base.HP).close()
    for where in ("cpu", "none"):
        with pytest.raises(ValueError, match=f"offload='{where}' on a model whose grad shards an earlier optimizer"):
            offload.AdamW(model.parameters(), offload=where, **base.HP)
    again = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), **base.HP)
    base._loss(model, 0, 0, 1, 0, {}).float().backward()
    again.step()
    again.close()
    runtime_of(model).tier.close()


def test_a_live_processs_param_dir_not_locked_yet_is_not_an_orphan(tmp_path):
    # ranks sharing a swap_dir: one rank's directory exists a moment before its lock does,
    # and another rank's orphan sweep must not take it (it removed it in a 2-rank run)
    import subprocess
    import sys

    from offload.shard.tier import ParamTier

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        made = {}
        for who, pid in (("live", live.pid), ("dead", int(gone.stdout))):
            made[who] = tmp_path / f"offload-params.{pid}.rank1"
            made[who].mkdir(mode=0o700)
        tier = ParamTier(str(tmp_path), 0)
        assert made["live"].is_dir() and not made["dead"].exists()
        tier.close()
    finally:
        live.kill()
        live.wait()


def test_a_param_dir_of_our_name_held_by_another_process_is_left_to_it(tmp_path, monkeypatch):
    # two containers on one host directory, each job its pid namespace's pid 1: the other's
    # directory has our name and its lock is held; ParamTier failed with a bare
    # "BlockingIOError: [Errno 11] Resource temporarily unavailable" (no path, no reason)
    import fcntl
    import itertools

    from offload.shard import tier as tier_mod

    monkeypatch.setattr(tier_mod, "_SEQ", itertools.count(1000))
    theirs = tmp_path / f"offload-params.{os.getpid()}-1000.rank0"
    theirs.mkdir(mode=0o700)
    fd = os.open(theirs / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: flock conflicts as another process's
        t = tier_mod.ParamTier(str(tmp_path), 0)
        assert t.path == str(tmp_path / f"offload-params.{os.getpid()}-1001.rank0")
        t.close()
        assert os.listdir(tmp_path) == [theirs.name] and os.listdir(theirs) == ["lock"]
    finally:
        os.close(fd)


def test_a_budget_too_small_names_the_max_host_bytes_that_works(tmp_path):
    # with params on NVMe the pipeline gets a part of max_host_bytes (paged_bound); the error
    # named that part as "max_host_bytes=3276" and asked for "at least 36864", which failed
    # again (29491 of it left to the buffers)
    import re

    model = offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"^max_host_bytes=4096 is too small with the params on NVMe") as e:
        offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), max_host_bytes=4096)
    least = int(re.search(r"pass max_host_bytes >= (\d+)$", str(e.value)).group(1))
    with pytest.raises(ValueError, match=f"pass max_host_bytes >= {least}$"):
        offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), max_host_bytes=least - 1)
    offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), max_host_bytes=least).close()
    runtime_of(model).tier.close()


def test_a_budget_too_small_to_resume_names_the_max_host_bytes_that_works(tmp_path):
    # the resume path's own message (the layout of the directory to resume) still named the
    # shrunk bound, "max_host_bytes=1638 ... pass max_host_bytes >= <the buffers' bytes>",
    # for max_host_bytes=4096: a value that fails again
    import re

    model = offload.shard(base._model(), offload_params="nvme", swap_dir=str(tmp_path))
    opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(tmp_path), **base.HP)
    base._loss(model, 0, 0, 1, 0, {}).float().backward()
    opt.step()
    opt.close(keep_swap=True)
    kw = dict(offload="nvme", swap_dir=str(tmp_path), resume=True, **base.HP)
    with pytest.raises(ValueError, match=r"^max_host_bytes=4096 is too small with the params on NVMe.* of the swap "
                                         r"directory to resume \(written with sub_group_size=\d+\)") as e:
        offload.AdamW(model.parameters(), max_host_bytes=4096, **kw)
    least = int(re.search(r"pass max_host_bytes >= (\d+) to resume it", str(e.value)).group(1))
    with pytest.raises(ValueError, match=f"pass max_host_bytes >= {least} to resume it"):
        offload.AdamW(model.parameters(), max_host_bytes=least - 1, **kw)
    resumed = offload.AdamW(model.parameters(), max_host_bytes=least, **kw)
    assert int(resumed.state_dict()["state"][0]["step"]) == 1
    resumed.close()
    runtime_of(model).tier.close()
