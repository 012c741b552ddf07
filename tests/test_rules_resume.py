"""``resume=True`` for every rule: a run stopped after step 3 (``close(keep_swap=True)``, as a
kill -9 leaves it) and resumed takes step 4 exactly as an uninterrupted run, with the same
state_dict. Adagrad's ``sum`` was overwritten by its initial value on resume (the
constructor's fill went into the resumed store), and SGD forgot which momentum buffers had
started (dampening then treated them as new; state_dict() dropped them)."""
from __future__ import annotations

import pytest
import torch

import offload

RULES = {
    "sgd": lambda ps, **k: offload.SGD(ps, lr=0.01, momentum=0.9, **k),
    "sgd-dampening": lambda ps, **k: offload.SGD(ps, lr=0.01, momentum=0.9, dampening=0.1, **k),
    "adagrad": lambda ps, **k: offload.Adagrad(ps, lr=0.01, initial_accumulator_value=0.25, **k),
    "lion": lambda ps, **k: offload.Lion(ps, lr=1e-3, weight_decay=0.1, **k),
    "adamw": lambda ps, **k: offload.AdamW(ps, lr=0.01, **k),
}


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(70, 60).to(dtype)  # 4200 weights: compressed where int8 is asked


def _grads(m, i):
    g = torch.Generator().manual_seed(i)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rule", list(RULES))
def test_resume_continues_as_the_uninterrupted_run(rule, dtype, state_dtype, tmp_path):
    dtype, make = getattr(torch, dtype), RULES[rule]
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    kw = dict(offload="nvme", state_dtype=state_dtype)
    ref = _model(dtype)
    opt = make(ref.parameters(), swap_dir=str(tmp_path / "ref"), **kw)
    for i in range(4):
        _grads(ref, i)
        opt.step()
    want = opt.state_dict()["state"]
    opt.close()
    m = _model(dtype)
    opt = make(m.parameters(), swap_dir=str(tmp_path / "run"), **kw)
    for i in range(3):
        _grads(m, i)
        opt.step()
    before = opt.state_dict()["state"]
    shown = [sorted(opt.state[p]) for p in m.parameters()]
    opt.close(keep_swap=True)
    opt = make(m.parameters(), swap_dir=str(tmp_path / "run"), resume=True, **kw)
    try:
        assert [sorted(opt.state[p]) for p in m.parameters()] == shown  # opt.state lists the resumed states
        after = opt.state_dict()["state"]
        assert before.keys() == after.keys()
        for k in before:
            assert before[k].keys() == after[k].keys(), k
            for name, v in before[k].items():
                assert torch.equal(v, after[k][name]), (k, name)
        _grads(m, 3)
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
        got = opt.state_dict()["state"]
        for k in want:
            for name, v in want[k].items():
                assert torch.equal(v, got[k][name]), (k, name)
    finally:
        opt.close()


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
@pytest.mark.parametrize("rule", ["adamw", "lion", "sgd"])
def test_resume_with_a_bf16_master_needs_the_params_of_that_step(rule, state_dtype, tmp_path):
    """[Note: own-master fingerprint] (offload/optim/flat/own_master.py): with
    master_dtype="bfloat16" the swap files hold no params. A resume used to go on from the
    new process's initial weights with the states of step 3, silently; now it is refused
    (the directory kept), and with the params of step 3 loaded it goes on bit for bit."""
    make = RULES[rule]
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    kw = dict(offload="nvme", state_dtype=state_dtype, master_dtype="bfloat16")
    ref = _model(torch.bfloat16)
    opt = make(ref.parameters(), swap_dir=str(tmp_path / "ref"), **kw)
    for i in range(4):
        _grads(ref, i)
        opt.step()
    opt.close()
    m = _model(torch.bfloat16)
    opt = make(m.parameters(), swap_dir=str(tmp_path / "run"), **kw)
    for i in range(3):
        _grads(m, i)
        opt.step()
    step3 = [p.detach().clone() for p in m.parameters()]
    opt.close(keep_swap=True)  # as a kill -9 leaves it: the params die with the process
    fresh = _model(torch.bfloat16)
    with pytest.raises(ValueError, match="not those of step 3 .* load the params of that step first"):
        make(fresh.parameters(), swap_dir=str(tmp_path / "run"), resume=True, **kw)
    with torch.no_grad():  # one element of step 3 off by one bf16 ulp: still refused
        fresh.weight.copy_(step3[0])
        fresh.bias.copy_(step3[1])
        fresh.weight.view(-1).view(torch.int16)[0] += 1  # the next bf16 value (sampled: an end of the param)
    with pytest.raises(ValueError, match="not those of step 3"):
        make(fresh.parameters(), swap_dir=str(tmp_path / "run"), resume=True, **kw)
    with torch.no_grad():
        fresh.weight.copy_(step3[0])
    opt = make(fresh.parameters(), swap_dir=str(tmp_path / "run"), resume=True, **kw)
    try:
        _grads(fresh, 3)
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), ref.parameters()))
    finally:
        opt.close()


def _two_rank_resume(rank, world, root, state_dtype):
    """Stage 2 over 2 ranks: each rank's bf16 shard is what its step writes (all-gathered
    after the commit); the fingerprint samples it, and a resume checks the loaded params."""
    import os

    kw = dict(offload="nvme", state_dtype=state_dtype, master_dtype="bfloat16", stage=2)

    def run(tag, steps, resume=False, start=None):
        d = os.path.join(root, tag)
        os.makedirs(d, exist_ok=True)
        m = _model(torch.bfloat16)
        if start is not None:
            with torch.no_grad():
                for p, v in zip(m.parameters(), start):
                    p.copy_(v)
        opt = offload.AdamW(m.parameters(), lr=0.01, swap_dir=d, resume=resume, **kw)
        for i in steps:
            _grads(m, 10 * i + rank)  # each rank its own grads: averaged
            opt.step()
        return m, opt

    ref, opt = run("ref", range(4))
    want = [p.detach().clone() for p in ref.parameters()]
    opt.close()
    m, opt = run("run", range(3))
    step3 = [p.detach().clone() for p in m.parameters()]
    opt.close(keep_swap=True)
    try:
        run("run", [], resume=True)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    m, opt = run("run", [3], resume=True, start=step3)
    same = all(torch.equal(a, b) for a, b in zip(m.parameters(), want))
    opt.close()
    return refused is not None and "not those of step 3" in refused, same


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_two_ranks_resume_with_a_bf16_master_checks_the_params(state_dtype, tmp_path):
    from _ranks import group

    got = group(2).run(_two_rank_resume, str(tmp_path), state_dtype, timeout=300)
    assert got == {0: (True, True), 1: (True, True)}


@pytest.mark.parametrize("store", ["none", "cpu", "nvme"])
def test_sgd_without_state_and_a_bf16_master_saves_and_loads_its_steps(store, tmp_path):
    """SGD without momentum over bf16 params that are their own master keeps nothing per
    element, but its steps seed the master's stochastic rounding: save_checkpoint /
    load_checkpoint carry them (the load refused a checkpoint of no state), and
    offload="nvme" steps in RAM as "cpu" (its constructor raised: swap files of no state)."""
    kw = dict(offload=store, swap_dir=str(tmp_path / "swap")) if store == "nvme" else dict(offload=store)

    def make(m):
        return offload.SGD(m.parameters(), lr=0.05, master_dtype="bfloat16", **kw)

    a, b = _model(torch.bfloat16), _model(torch.bfloat16)
    opt_a = make(a)
    for i in range(3):
        _grads(a, i)
        opt_a.step()
    opt_a.save_checkpoint(str(tmp_path / "ckpt"))
    b.load_state_dict(a.state_dict())
    opt_b = make(b)
    opt_b.load_checkpoint(str(tmp_path / "ckpt"))
    assert [float(opt_b.state[p]["step"]) for p in b.parameters()] == [3.0, 3.0]
    for i in range(3, 6):
        for m, opt in ((a, opt_a), (b, opt_b)):
            _grads(m, i)
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    opt_a.close()
    opt_b.close()
    assert not list((tmp_path / "swap").rglob("*.bin"))  # (none with nvme: nothing to swap)


def _sgd_plain_bf16_job(rank, world, where, swap_root):
    """SGD without momentum over bf16 params that are their own master, stage 2: two steps."""
    import os
    kw = {}
    if where == "nvme":
        kw["swap_dir"] = os.path.join(swap_root, f"r{rank}")
        os.makedirs(kw["swap_dir"])
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (3000, 5000)]
    opt = offload.SGD(ps, lr=0.1, stage=2, master_dtype="bfloat16", offload=where, **kw)
    try:
        for s in range(2):
            g = torch.Generator().manual_seed(s)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()
        return [p.detach().float().tolist() for p in ps]
    finally:
        opt.close()


def test_two_ranks_sgd_without_state_over_bf16_masters_on_nvme_gathers_the_params(tmp_path):
    """With nothing to swap, offload="nvme" steps in RAM as "cpu" does; its param sink was
    built before that was decided, for the swapped step's gather after the commit, which the
    RAM step never makes: on two ranks each rank's params kept the other rank's half unstepped."""
    from _ranks import group
    got = {where: group(2).run(_sgd_plain_bf16_job, where, str(tmp_path / where), timeout=180)
           for where in ("cpu", "nvme")}
    for rank in range(2):
        assert got["nvme"][rank] == got["cpu"][rank], rank
    assert got["cpu"][0] == got["cpu"][1]
