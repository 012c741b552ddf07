"""The step context wired in (issue #14): a store never reads, nor holds, its optimizer; the
flags users set on the optimizer live in the context; step counts live in torch's
``opt.state`` only, reached through ``ctx.steps``; a flat store built from explicit
arguments steps as torch does."""
from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

import offload
from offload.optim.context import StepContext
from offload.optim.flat.steps import WorkItem
from offload.optim.flat.store import FlatState
from offload.optim.functional import AdamHyper
from offload.optim.options import make_config
import _internals as internals

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _params(dtype, sizes=(37, 1000, 5)):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _reaches(root, target) -> bool:
    """Whether ``target`` is reachable from ``root`` (strongly, or through a weakref),
    following objects, containers, closures and bound methods but not module globals."""
    seen, todo = set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        if obj is target:
            return True
        if isinstance(obj, weakref.ReferenceType):
            todo.append(obj())
        elif isinstance(obj, types.FunctionType):
            todo.extend(c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None)
            todo.extend(obj.__defaults__ or ())
        elif isinstance(obj, torch.Tensor):
            continue  # data, not references
        else:
            todo.extend(gc.get_referents(obj))
    return False


@pytest.mark.parametrize("store", ["host", "flat", "flat-nvme"])
def test_no_store_reaches_its_optimizer(tmp_path, store):
    dtype = torch.float32 if store == "host" else torch.bfloat16
    kw = dict(offload="nvme", swap_dir=str(tmp_path)) if store == "flat-nvme" else {}
    params = _params(dtype)
    with offload.AdamW(params, **HP, max_grad_norm=1.0, **kw) as opt:
        _grads(params, 0)
        opt.step()
        assert not _reaches(internals.store(opt), opt), f"the {store} store reaches its optimizer"


def test_flags_set_on_the_optimizer_live_in_the_context():
    opt = offload.AdamW(_params(torch.bfloat16), **HP, max_grad_norm=2.0)
    ctx = opt._ctx
    assert ctx.max_grad_norm == 2.0 and opt.max_grad_norm == 2.0
    opt.grads_already_averaged = True  # as offload/integrations/hf.py does under DDP
    opt.state_dict_rank0_only = True
    opt.max_grad_norm = None
    assert ctx.grads_already_averaged and ctx.state_dict_rank0_only and ctx.max_grad_norm is None
    assert not {"grads_already_averaged", "state_dict_rank0_only", "max_grad_norm"} & set(vars(opt))
    with opt.no_sync():
        assert ctx.no_sync
        with opt.no_sync():
            assert ctx.no_sync
        assert ctx.no_sync
    assert not ctx.no_sync
    assert internals.store(opt).ctx is ctx
    opt.close()


def test_step_counts_follow_the_state_torch_replaces():
    params = _params(torch.bfloat16)
    opt = offload.AdamW(params, **HP)
    for s in range(3):
        _grads(params, s)
        opt.step()
    sd = opt.state_dict()
    other = offload.AdamW(_params(torch.bfloat16), **HP)
    old = other.state
    other.load_state_dict(sd)
    assert other.state is not old and other._ctx.torch_state.state is other.state
    q = other.param_groups[0]["params"]
    assert [other._ctx.steps.get(p) for p in q] == [3, 3, 3]
    _grads(q, 3)
    other.step()
    assert [int(other.state[p]["step"]) for p in q] == [4, 4, 4]
    assert [int(opt.state[p]["step"]) for p in params] == [3, 3, 3]  # the loaded tensors were not changed in place
    opt.close()
    other.close()


def test_a_failed_step_puts_back_the_very_step_tensors(monkeypatch):
    params = _params(torch.bfloat16)
    opt = offload.AdamW(params, **HP)
    _grads(params, 0)
    opt.step()
    before = [opt.state[p]["step"] for p in params]

    def broken(batches):
        assert [s for _, items in batches for _, _, s in items] == [2, 2, 2]  # each item carries its count
        raise RuntimeError("disk gone")
    monkeypatch.setattr(internals.store(opt), "step", broken)
    with pytest.raises(RuntimeError, match="disk gone"):
        opt.step()
    assert all(opt.state[p]["step"] is t for p, t in zip(params, before))
    monkeypatch.undo()
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sub_group_size", [None, 300])
def test_flat_store_built_from_explicit_arguments_steps_like_torch(dtype, sub_group_size):
    params = _params(dtype)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    torch_opt = torch.optim.AdamW(ref, **HP, foreach=False)
    ctx = StepContext.fresh()
    groups = [{"params": params}]
    ctx.rebind(param_groups=groups)
    store = FlatState(groups, config=make_config(offload="cpu", swap_dir=None, max_host_bytes=None,
                                                 sub_group_size=sub_group_size, verify=False, resume=False,
                                                 io_engine=None),
                      ctx=ctx, stage=0)
    hyper = AdamHyper(lr=HP["lr"], beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, decoupled=True,
                      maximize=False, bias_correction=True, grad_scale=1.0)
    try:
        for s in range(5):
            _grads(params, s)
            for p, q in zip(params, ref):
                q.grad = p.grad.float()
            ctx.steps.advance(params)
            store.step([(hyper, [(p, p.grad, ctx.steps.get(p)) for p in params])])
            torch_opt.step()
        for p, q in zip(params, ref):
            master = store.master(p)
            torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), master.to(dtype))  # the param is the master, rounded
            exported = store.export_state(p)
            torch.testing.assert_close(exported["exp_avg"], torch_opt.state[q]["exp_avg"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(exported["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-6)
    finally:
        store.close()


def test_work_item_is_the_swap_layers_tuple():
    g = torch.zeros(3)
    item = WorkItem(1, 4, 7, g, {"step": 1}, None, None, then=print)
    k, lo, hi, grad, kw, out, mode = item[:7]  # what swapped_shards.py unpacks
    assert (k, lo, hi, grad, kw, out, mode) == (1, 4, 7, g, {"step": 1}, None, None)


def test_found_inf_a_store_agrees_on_goes_back_to_grad_scaler(monkeypatch):
    """GradScaler sets grad_scale / found_inf on the optimizer; they reach the store through
    the context, and a flag the store replaces (the ranks' agreed one) is handed back."""
    params = _params(torch.bfloat16)
    opt = offload.AdamW(params, **HP)
    agreed = torch.ones(1)
    seen = []

    def begin_step():
        seen.append((opt._ctx.grad_scale, opt._ctx.found_inf))
        opt._ctx.found_inf = agreed  # as several ranks would: one rank overflowed
    monkeypatch.setattr(internals.store(opt), "begin_step", begin_step)
    before = [p.detach().clone() for p in params]
    _grads(params, 0)
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.zeros(1)  # as GradScaler.step does
    opt.step()
    assert float(seen[0][0]) == 4.0 and float(seen[0][1]) == 0.0
    assert opt.found_inf is agreed and opt.last_step_skipped
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))
    del opt.grad_scale, opt.found_inf  # as GradScaler does after the step
    monkeypatch.undo()
    opt.step()  # no scaler now: the context forgot the last step's facts
    assert opt._ctx.grad_scale is None and opt._ctx.found_inf is None and not opt.last_step_skipped
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_params_through_the_one_loop_match_torch(dtype):
    """A transposed param gets its update through a buffer put back after its last item."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(7, 300, generator=gen).to(dtype).t()),
              torch.nn.Parameter(torch.randn(50, generator=gen).to(torch.bfloat16))]  # a bf16 group: the flat store
    assert not params[0].is_contiguous()
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    torch_opt = torch.optim.AdamW(ref, **HP, foreach=False)
    opt = offload.AdamW(params, **HP, sub_group_size=512)
    for s in range(4):
        _grads(params, s)
        for p, q in zip(params, ref):
            q.grad = p.grad.float()
        opt.step()
        torch_opt.step()
    for p, q in zip(params, ref):
        master = internals.master(opt, p)
        torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), master.to(p.dtype))
    opt.close()
