"""offload.SGD, offload.Adagrad, offload.Lion and offload.AdamW(amsgrad=True) against
torch.optim.SGD / Adagrad / AdamW (foreach=False) and a plain-torch Lion, element by element (DESIGN.md's numerics contract:
rtol 1e-5, atol 1e-6 after 20 steps), in every store: fp32 CPU params with offload none,
cpu and nvme; bf16 params (the flat store, its fused low-precision copy); and (in
test_rules_ranks.py) two gloo ranks at stage 2.

Each backend that implements the rule runs (the torch reference always; numba and native
once the kernels have the rule), chosen by ``OFFLOAD_BACKEND`` as everywhere else.
"""
from __future__ import annotations

import copy

import os

import pytest
import torch

import offload
from offload.kernels import get_backend
from offload.kernels.fields import ADAGRAD, ADAM_AMSGRAD, LION, SGD as SGD_RULE

SIZES = (1, 7, 15, 16, 17, 4097)
STEPS = 20
TOL = dict(rtol=1e-5, atol=1e-6)


def _backend_has(rule) -> bool:
    """The backend in use implements ``rule`` (the numba and native kernels come later)."""
    p = torch.zeros(1)
    states = {f.name: torch.zeros(1) for f in rule.fields}
    hyper = {"sgd": dict(lr=0.1, momentum=0.9), "adagrad": dict(lr=0.1), "lion": dict(lr=0.1),
             "adam_amsgrad": dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True)}[rule.name]
    try:
        get_backend(None).rule_step(rule, p, torch.ones(1), states, step=1, **hyper)
    except NotImplementedError:
        return False
    return True


def _need(rule):
    if not _backend_has(rule):
        pytest.skip(f"backend {get_backend(None).name!r} has no {rule.name} kernel yet")


class RefLion(torch.optim.Optimizer):
    """lion-pytorch's Lion (its lerp form), in plain torch."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                p.mul_(1 - lr * wd)
                p.add_(m.clone().lerp_(p.grad, 1 - b1).sign_(), alpha=-lr)
                m.lerp_(p.grad, 1 - b2)


# (offload class, reference class, rule, groups' hyperparameters: two groups that differ)
CASES = {
    "sgd-momentum": (offload.SGD, torch.optim.SGD, SGD_RULE,
                     [dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
                      dict(lr=0.02, momentum=0.8, nesterov=True)]),
    "sgd-mixed": (offload.SGD, torch.optim.SGD, SGD_RULE,
                  [dict(lr=0.05), dict(lr=0.02, momentum=0.9, weight_decay=0.1, maximize=True)]),
    "adagrad": (offload.Adagrad, torch.optim.Adagrad, ADAGRAD,
                [dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
                 dict(lr=0.1, eps=1e-6)]),
    "lion": (offload.Lion, RefLion, LION,
             [dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), dict(lr=3e-3, betas=(0.95, 0.98))]),
    "amsgrad": (offload.AdamW, torch.optim.AdamW, ADAM_AMSGRAD,
                [dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
                 dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, maximize=True, amsgrad=True)]),
}


def _groups(params, hypers):
    half = len(params) // 2
    return [dict(params=params[:half], **hypers[0]), dict(params=params[half:], **hypers[1])]


def _ref_kwargs(ref_cls):
    return {} if ref_cls is RefLion else {"foreach": False}


def _store_kwargs(store, tmp_path):
    if store == "nvme":
        tmp_path.mkdir(parents=True, exist_ok=True)
        return dict(offload="nvme", swap_dir=str(tmp_path))
    return dict(offload="cpu" if store == "bf16" else store)


def _run(case, store, tmp_path, steps=STEPS, sizes=SIZES):
    cls, ref_cls, rule, hypers = CASES[case]
    _need(rule)
    dtype = torch.bfloat16 if store == "bf16" else torch.float32
    torch.manual_seed(0)
    init = [torch.randn(n).to(dtype) for n in sizes]
    ours = [p.clone() for p in init]
    ref = [p.float() for p in init]  # bf16: the reference steps the fp32 master
    opt = cls(_groups(ours, hypers), **_store_kwargs(store, tmp_path))
    rop = ref_cls(_groups(ref, hypers), **_ref_kwargs(ref_cls))
    for _ in range(steps):
        for p, r in zip(ours, ref):
            g = torch.randn(p.shape).to(dtype)
            p.grad, r.grad = g, g.float()
        opt.step()
        rop.step()
    return opt, rop, ours, ref


def _check(opt, ours, ref, bf16):
    if not bf16:
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p, r, **TOL)
        return
    state = opt.state_dict()["state"]
    for i, (p, r) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(state[i]["master"], r, **TOL)  # the fp32 master
        # the param: its own master rounded (RNE); the reference's master rounds the same way
        # unless the two masters, within TOL, straddle a bf16 rounding boundary
        assert torch.equal(p, state[i]["master"].to(torch.bfloat16))


@pytest.mark.parametrize("store", ["none", "cpu", "nvme", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_in_every_store(case, store, tmp_path):
    opt, rop, ours, ref = _run(case, store, tmp_path)
    _check(opt, ours, ref, store == "bf16")
    if store != "bf16":  # the states too, by torch's names
        names = opt.state_names()
        for p, r in zip(ours, ref):
            for k in names:
                want = rop.state[r].get(k)
                if isinstance(want, torch.Tensor):
                    torch.testing.assert_close(opt.state[p][k], want, **TOL)
    opt.close()


def test_large_param_matches(tmp_path):
    """One param of 2**20 + 3 elements (the SIMD bodies and tails at scale), each rule."""
    for case in ("sgd-momentum", "adagrad", "lion"):
        opt, _, ours, ref = _run(case, "cpu", tmp_path, steps=3, sizes=(2 ** 20 + 3, 5))
        _check(opt, ours, ref, False)


def test_momentum_free_sgd_on_nvme_steps_in_place_as_torch(tmp_path, caplog):
    """fp32 CPU params and no state to swap: the host store steps them, with a log line,
    instead of the ValueError that failed every SGD case of torch's test_optim.py under
    offload="nvme"; no swap file is written, and a momentum set later keeps its buffers."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4097))
    q = p.detach().clone().requires_grad_()
    with caplog.at_level("WARNING", logger="offload.optim.host_state"):
        opt = offload.SGD([p], lr=0.1, weight_decay=0.01, offload="nvme", swap_dir=str(tmp_path))
    assert "no state to swap" in caplog.text
    ref = torch.optim.SGD([q], lr=0.1, weight_decay=0.01, foreach=False)
    for i in range(5):
        if i == 3:
            opt.param_groups[0]["momentum"] = ref.param_groups[0]["momentum"] = 0.9
        g = torch.randn(4097, generator=torch.Generator().manual_seed(i))
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert opt.memory_report()["store"] == "host" and os.listdir(tmp_path) == []
    torch.testing.assert_close(opt.state_dict()["state"][0]["momentum_buffer"], ref.state[q]["momentum_buffer"],
                               rtol=1e-6, atol=1e-7)
    opt.close()


@pytest.mark.parametrize("case", ["sgd-momentum", "sgd-mixed", "adagrad", "amsgrad"])
@pytest.mark.parametrize("store", ["cpu", "nvme", "bf16"])
def test_state_dict_moves_both_ways_with_torch(case, store, tmp_path):
    """5 steps here, load into torch, 5 more each with the same grads; then torch -> here."""
    cls, ref_cls, rule, hypers = CASES[case]
    opt, rop, ours, ref = _run(case, store, tmp_path, steps=5)
    bf16 = store == "bf16"
    sd = opt.state_dict()
    if case.startswith("sgd"):
        assert all(set(st) == {"momentum_buffer"} for st in sd["state"].values()) or bf16
    fresh_ref = [r.clone() for r in ref]
    torch_opt = ref_cls(_groups(fresh_ref, hypers), **_ref_kwargs(ref_cls))
    torch_opt.load_state_dict(copy.deepcopy(sd))  # as torch.save + torch.load (a live dict shares tensors)
    # and back: a new offload optimizer from torch's dict
    back = [p.clone() for p in ours]
    opt2 = cls(_groups(back, hypers), **_store_kwargs(store, tmp_path / "b"))
    opt2.load_state_dict(copy.deepcopy(rop.state_dict()))
    for _ in range(5):
        for p, b, r, f in zip(ours, back, ref, fresh_ref):
            g = torch.randn(p.shape).to(p.dtype)
            p.grad, b.grad, r.grad, f.grad = g, g.clone(), g.float(), g.float()
        for o in (opt, opt2, rop, torch_opt):
            o.step()
    if not bf16:
        for f, r in zip(fresh_ref, ref):
            torch.testing.assert_close(f, r, **TOL)
    if not bf16:  # (torch's dict has no fp32 master: a bf16 load starts from the params' values)
        _check(opt2, back, ref, False)
    opt.close()
    opt2.close()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("store", ["cpu", "nvme", "bf16"])
def test_checkpoint_round_trip(case, store, tmp_path):
    cls, ref_cls, rule, hypers = CASES[case]
    opt, rop, ours, ref = _run(case, store, tmp_path / "s", steps=4)
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    back = [p.clone() for p in ours]
    opt2 = cls(_groups(back, hypers), **_store_kwargs(store, tmp_path / "b"))
    opt2.load_checkpoint(str(tmp_path / "ckpt"))
    for _ in range(4):
        for p, b, r in zip(ours, back, ref):
            g = torch.randn(p.shape).to(p.dtype)
            p.grad, b.grad, r.grad = g, g.clone(), g.float()
        opt.step()
        opt2.step()
        rop.step()
    _check(opt2, back, ref, store == "bf16")
    for p, b in zip(ours, back):
        assert torch.equal(p, b)
    opt.close()
    opt2.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_max_grad_norm_clips_as_torch(case):
    cls, ref_cls, rule, hypers = CASES[case]
    _need(rule)
    torch.manual_seed(1)
    ours = [torch.randn(n) for n in (7, 4097)]
    ref = [p.clone() for p in ours]
    opt = cls(_groups(ours, hypers), max_grad_norm=0.5)
    rop = ref_cls(_groups(ref, hypers), **_ref_kwargs(ref_cls))
    for _ in range(5):
        for p, r in zip(ours, ref):
            g = torch.randn(p.shape) * 3
            p.grad, r.grad = g, g.clone()
        torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=False)
        opt.step()
        rop.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, **TOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_grad_scaler_unscales_and_skips_overflow(case):
    cls, ref_cls, rule, hypers = CASES[case]
    _need(rule)
    torch.manual_seed(2)
    ours = [torch.randn(n) for n in (7, 17)]
    ref = [p.clone() for p in ours]
    opt = cls(_groups(ours, hypers))
    rop = ref_cls(_groups(ref, hypers), **_ref_kwargs(ref_cls))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i in range(6):
        scaler.scale(torch.zeros(()))  # starts its scale; the grads below are scaled by hand
        scale = scaler.get_scale()
        for p, r in zip(ours, ref):
            g = torch.randn(p.shape)
            p.grad, r.grad = g * scale, g.clone()
        if i == 3:
            ours[0].grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        assert opt.last_step_skipped == (i == 3)
        if i != 3:
            rop.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, **TOL)
