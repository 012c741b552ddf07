"""DeepSpeed's calls beyond the constructor, on the shims of offload/integrations/deepspeed_ops.py,
as DeepSpeed's own tests make them (tests/unit/ops/adam/test_cpu_adam.py ``TestCPUAdamSubgroup``,
tests/unit/ops/adagrad/test_cpu_adagrad.py):

- ``DeepSpeedCPUAdagrad``: its state read by DeepSpeed's name, ``opt.state[p]["exp_avg_sq"]``,
  in every store, while ``state_dict()`` stays torch's (``"sum"``), and a dict of DeepSpeed's
  layout loads ([Note: DeepSpeed's state names]);
- ``DeepSpeedCPUAdam.step_subgroup`` / ``rollback_subgroup`` ([Note: DeepSpeed's sub-group
  steps]): the states and counts in ``opt.state[i]``, the bits of ``step()``, an undo that gives
  back the param and moments before the step, and the refusals."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from offload.integrations.deepspeed_ops import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam

STORES = ["none", "cpu", "nvme"]


def _store_kwargs(store, workdir):
    return {"offload": store, "swap_dir": str(workdir)} if store == "nvme" else {"offload": store}


def _grads(shape, steps, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(steps)]


# ---------------------------------------------------------------- Adagrad: DeepSpeed's state name
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("store", STORES)
def test_adagrad_state_reads_by_deepspeeds_name(store, dtype, workdir):
    """DeepSpeed's test_cpu_adagrad_non_contiguous_param, as written, in every store."""
    initial = torch.randn(6, 5).t().to(dtype)
    p = torch.nn.Parameter(initial.clone(memory_format=torch.preserve_format))
    q = torch.nn.Parameter(initial.clone().float())
    assert not p.is_contiguous()
    opt, ref = DeepSpeedCPUAdagrad([p], **_store_kwargs(store, workdir)), torch.optim.Adagrad([q], foreach=False)
    assert "exp_avg_sq" in opt.state[p] and "exp_avg_sq" not in list(opt.state[p])  # (listed: "sum")
    for grad in _grads((5, 6), 3, dtype):
        p.grad, q.grad = grad.clone(), grad.float()
        opt.step()
        ref.step()
    if dtype == torch.float32:
        torch.testing.assert_close(p, q)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["sum"])
    assert torch.equal(opt.state[p].get("exp_avg_sq"), opt.state[p]["sum"])
    assert all("exp_avg_sq" in st for st in opt.state.values())  # (entries a step put in too)
    sd = opt.state_dict()
    assert "exp_avg_sq" not in sd["state"][0] and "sum" in sd["state"][0]  # torch's layout
    torch.optim.Adagrad([torch.nn.Parameter(q.detach().clone())]).load_state_dict(sd)
    # an assignment by DeepSpeed's name is the state the next step reads
    opt.state[p]["exp_avg_sq"] = torch.full(p.shape, 4.0)
    ref.state[q]["sum"].fill_(4.0)
    p.grad, q.grad = torch.ones(p.shape, dtype=dtype), torch.ones(q.shape)
    opt.step()
    ref.step()
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["sum"])
    assert set(opt.state[p].keys()) <= {"step", "sum", "master"}
    opt.close()


@pytest.mark.parametrize("store", STORES)
def test_adagrad_loads_deepspeeds_layout(store, workdir):
    """A state_dict of DeepSpeed's CPU Adagrad (``"exp_avg_sq"``, an int ``"step"``) loads as
    the sum, and training goes on as torch's Adagrad from the same state."""
    q = torch.nn.Parameter(torch.randn(37))
    ref = torch.optim.Adagrad([q], foreach=False)
    for grad in _grads(37, 2):
        q.grad = grad
        ref.step()
    theirs = ref.state_dict()
    theirs["state"][0] = {"step": 2, "exp_avg_sq": theirs["state"][0]["sum"].clone()}
    p = torch.nn.Parameter(q.detach().clone())
    opt = DeepSpeedCPUAdagrad([p], **_store_kwargs(store, workdir))
    opt.load_state_dict(theirs)
    assert float(opt.state[p]["step"]) == 2 and isinstance(opt.state[p]["step"], torch.Tensor)  # torch's form
    assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["sum"])
    for grad in _grads(37, 2, seed=2):
        p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["sum"])
    opt.close()


@pytest.mark.parametrize("store", STORES)
def test_adagrad_loads_deepspeeds_groups_and_the_names_take_every_dict_call(store, workdir):
    """DeepSpeed's param groups have neither ``lr_decay`` nor ``initial_accumulator_value``:
    loaded as they were, the next step failed with KeyError 'lr_decay' (forty-fourth session);
    and ``setdefault``/``update``/``pop``/``del`` by DeepSpeed's name went past ``"sum"``."""
    q = torch.nn.Parameter(torch.randn(11))
    ref = torch.optim.Adagrad([q], lr=0.05, foreach=False)
    q.grad = torch.ones(11)
    ref.step()
    theirs = {"state": {0: {"step": 1, "exp_avg_sq": ref.state[q]["sum"].clone()}},
              "param_groups": [{"lr": 0.05, "eps": 1e-10, "weight_decay": 0, "amsgrad": False, "params": [0]}]}
    p = torch.nn.Parameter(q.detach().clone())
    opt = DeepSpeedCPUAdagrad([p], **_store_kwargs(store, workdir))
    opt.load_state_dict(theirs)
    assert opt.param_groups[0]["lr_decay"] == 0 and opt.param_groups[0]["initial_accumulator_value"] == 0
    ref.param_groups[0]["eps"] = 1e-10
    p.grad, q.grad = torch.full((11,), 0.5), torch.full((11,), 0.5)
    opt.step()
    ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    st = opt.state[p]
    assert st.setdefault("exp_avg_sq", None) is not None and "exp_avg_sq" not in list(st)
    st.update(exp_avg_sq=torch.full((11,), 2.0))
    assert torch.equal(st["sum"], torch.full((11,), 2.0)) and "exp_avg_sq" not in list(st)
    assert "exp_avg_sq" not in opt.state_dict()["state"][0]
    if store != "nvme":  # (a swapped entry's states are the store's: not removed by a pop)
        assert torch.equal(st.pop("exp_avg_sq"), torch.full((11,), 2.0)) and "sum" not in st
    opt.close()


def test_adagrad_names_survive_a_copy_and_del():
    p = torch.nn.Parameter(torch.randn(9))
    opt = DeepSpeedCPUAdagrad([p])
    p.grad = torch.ones(9)
    opt.step()
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        (p2,) = other.param_groups[0]["params"]
        assert torch.equal(other.state[p2]["exp_avg_sq"], opt.state[p]["sum"])
    del opt.state[p]  # torch's way to start a param's states afresh
    opt.step()
    assert torch.equal(opt.state[p]["exp_avg_sq"], torch.ones(9))
    with pytest.raises(KeyError, match="exp_avg_sq"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.randn(3))]).state[p]["exp_avg_sq"]


# ---------------------------------------------------------------- Adam: sub-group steps
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 17, 1024])
def test_step_subgroup_counts_and_rollback_sequence(dtype, n):
    """TestCPUAdamSubgroup's basic, multiple-call and step/rollback sequence cases, with the
    values checked: every rollback gives back the param and moments before its step."""
    g = torch.Generator().manual_seed(n)
    p = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))
    opt = DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.1)
    p.grad = torch.randn(n, generator=g).to(dtype)
    before = [(p.detach().clone(), None, None)]
    for step in range(1, 4):
        opt.step_subgroup(0)
        st = opt.state[0]
        assert st["step"] == step and isinstance(st["step"], int)
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        before.append((p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()))
    assert not torch.equal(p.detach(), before[0][0])
    # each step rounds p to its dtype and each undo starts from that: a few of its ulps, of
    # the largest value on the way (p, or the update, lr = 1e-2, where p crosses zero)
    eps = 2 ** -20 if dtype == torch.float32 else torch.finfo(dtype).eps
    for step in range(2, -1, -1):
        opt.rollback_subgroup(0)
        assert opt.state[0]["step"] == step
        old_p, old_m, old_v = before[step]
        err = (p.detach().float() - old_p.float()).abs()
        assert (err <= 4 * eps * (old_p.float().abs() + 3e-2)).all(), err.max()
        if old_m is not None:
            torch.testing.assert_close(opt.state[0]["exp_avg"], old_m, rtol=1e-5, atol=1e-6 * float(old_m.abs().max()))
            torch.testing.assert_close(opt.state[0]["exp_avg_sq"], old_v, rtol=1e-5,
                                       atol=1e-6 * float(old_v.abs().max()))


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("maximize", [False, True])
def test_step_subgroup_is_steps_bits_and_rollback_inverts_it(adamw_mode, maximize):
    """On float32 params, sub-group steps are the bits of ``step()`` from the same states (the
    kernel is the same), in AdamW and Adam mode; undoing the last step, with the grad it took,
    gives back what the other optimizer held after the step before."""
    n = 4097
    base = torch.randn(n, generator=torch.Generator().manual_seed(0))
    a, b = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    kw = dict(lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    whole, sub = DeepSpeedCPUAdam([a], **kw), DeepSpeedCPUAdam([b], **kw)
    for o in (whole, sub):
        o.param_groups[0]["maximize"] = maximize
    snaps = []
    for grad in _grads(n, 3):
        a.grad, b.grad = grad.clone(), grad.clone()
        whole.step()
        sub.step_subgroup(3)
        assert torch.equal(a, b)
        assert torch.equal(whole.state[a]["exp_avg"], sub.state[3]["exp_avg"])
        assert torch.equal(whole.state[a]["exp_avg_sq"], sub.state[3]["exp_avg_sq"])
        snaps.append([a.detach().clone()] + [whole.state[a][k].clone() for k in ("exp_avg", "exp_avg_sq")])
    sub.rollback_subgroup(3)
    old_p, old_m, old_v = snaps[-2]
    torch.testing.assert_close(b.detach(), old_p, rtol=1e-6, atol=1e-7)
    # (the moments cancel: v' - (1 - beta2) g**2 loses v''s low bits where g**2 made most of it)
    torch.testing.assert_close(sub.state[3]["exp_avg"], old_m, rtol=1e-5, atol=1e-6 * float(old_m.abs().max()))
    torch.testing.assert_close(sub.state[3]["exp_avg_sq"], old_v, rtol=1e-5, atol=1e-6 * float(old_v.abs().max()))


def test_subgroups_keep_their_own_states():
    """TestCPUAdamSubgroup's multiple sub-groups and its same-step case across sub-groups
    (param_groups[0]["params"] pointed at each sub-group's tensor in turn)."""
    base = torch.randn(128)
    a, b = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    opt = DeepSpeedCPUAdam([a])
    for step, grad in enumerate(_grads(128, 4), start=1):
        opt.param_groups[0]["params"] = [a]
        a.grad = grad.clone()
        opt.step_subgroup(0)
        opt.param_groups[0]["params"] = [b]
        b.grad = grad.clone()
        opt.step_subgroup(1)
        assert opt.state[0]["step"] == opt.state[1]["step"] == step
        assert torch.equal(a, b) and torch.equal(opt.state[0]["exp_avg"], opt.state[1]["exp_avg"])
    opt.rollback_subgroup(0)
    assert (opt.state[0]["step"], opt.state[1]["step"]) == (3, 4)


def test_subgroup_bf16_states_and_errors(workdir):
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    opt = DeepSpeedCPUAdam([p], fp32_optimizer_states=False)
    p.grad = torch.randn(300, dtype=torch.bfloat16)
    opt.step_subgroup(0)
    assert opt.state[0]["exp_avg"].dtype == torch.bfloat16
    opt.rollback_subgroup(0)
    assert opt.state[0]["step"] == 0
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 0: step count is 0"):
        opt.rollback_subgroup(0)
    with pytest.raises(RuntimeError, match="Cannot rollback optimizer state for sub_group_id 5 as it has not"):
        opt.rollback_subgroup(5)
    assert 5 not in opt.state
    q = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    q.grad = torch.randn(300, dtype=torch.bfloat16)
    opt.param_groups[0]["params"].append(q)
    with pytest.raises(ValueError, match="but 2 params have a grad"):
        opt.step_subgroup(0)
    opt.param_groups[0]["params"] = [torch.nn.Parameter(torch.randn(7, dtype=torch.bfloat16))]
    opt.param_groups[0]["params"][0].grad = torch.ones(7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="has shape"):
        opt.step_subgroup(0)
    assert opt.state[0]["step"] == 0
    x = torch.nn.Parameter(torch.randn(8))
    x.grad = torch.ones(8)
    for kw, match in [(dict(offload="nvme", swap_dir=str(workdir)), "offload='nvme'"),
                      (dict(max_grad_norm=1.0), "max_grad_norm"), (dict(state_dtype="int8"), "int8"),
                      (dict(stage=1), "stage=1")]:
        other = DeepSpeedCPUAdam([x], **kw)
        with pytest.raises(NotImplementedError, match=match):
            other.step_subgroup(0)
        assert 0 not in other.state
        other.close()
    stuck = DeepSpeedCPUAdam([x], lr=1.0, weight_decay=1.0)
    stuck.step_subgroup(0)
    with pytest.raises(ValueError, match="cannot be undone"):
        stuck.rollback_subgroup(0)


def _ranks_job(rank, world):
    # As DeepSpeed's engine: each rank a flat partition of one size, its own values and grads
    g = torch.Generator().manual_seed(rank)
    flat = torch.nn.Parameter(torch.randn(64, generator=g))
    ref = torch.nn.Parameter(flat.detach().clone())
    opt = DeepSpeedCPUAdam([flat], lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        grad = torch.randn(64, generator=g)
        flat.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
    sub = torch.nn.Parameter(torch.randn(16, generator=g))
    sub_opt = DeepSpeedCPUAdam([sub], lr=1e-2)
    sub.grad = torch.randn(16, generator=g)
    sub_opt.step_subgroup(0)
    return dict(stage=opt.stage, diff=float((flat.detach() - ref.detach()).abs().max()),
                subgroup_step=int(sub_opt.state[0]["step"]))


def test_deepspeeds_engine_partitions_each_rank_steps_its_own():
    """Several ranks: stage 0 unless given, as DeepSpeed's CPU optimizers talk to no rank. At the
    default stage 2 of offload.Adam, two ranks' flat partitions of one size were averaged and
    sharded together (silently wrong), and step_subgroup was refused (forty-fourth session)."""
    from _ranks import group

    got = group(2).run(_ranks_job)
    for rank in (0, 1):
        assert got[rank]["stage"] == 0 and got[rank]["diff"] < 1e-6 and got[rank]["subgroup_step"] == 1, got
