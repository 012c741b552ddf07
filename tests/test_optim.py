"""offload.Adam / offload.AdamW against torch.optim.Adam / AdamW (foreach=False), fp32 CPU.

Runs under whatever backend ``OFFLOAD_BACKEND`` selects (CI runs the suite with native and
with numba).

Both optimizers step on the same grads, those of our model (``train_pair``): the numerics
contract is about identical grads. A reference computing its own grads would compute them
from params that differ by the two optimizers' last bits, and Adam amplifies that where |g|
is near eps, by an amount that depends on the CPU's matmul rounding (the margin to atol 1e-6
was 4x here, and that is the kind of margin another CPU erased in issue 13).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import offload

RTOL, ATOL = 1e-5, 1e-6


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Odd sizes break SIMD tails; the bias-free layer and the 1-element param are edge cases.
    return torch.nn.Sequential(
        torch.nn.Linear(17, 33),
        torch.nn.Tanh(),
        torch.nn.Linear(33, 7, bias=False),
        torch.nn.LayerNorm(7),
        torch.nn.Linear(7, 1),
    )


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 17, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def assert_same(model_a, model_b, opt_a, opt_b):
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        if not sb:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[key], sb[key], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}.{key}: {m}")
        assert float(sa["step"]) == float(sb["step"])


def train_pair(our_model, ours, ref_model, ref, data, sign=1.0):
    """Steps both on each batch, with the grads of ``our_model`` copied into ``ref_model``."""
    for x, y in data:
        ours.zero_grad()
        ref.zero_grad()
        (sign * torch.nn.functional.mse_loss(our_model(x), y)).backward()
        copy_grads(our_model, ref_model)
        ref.step()
        ours.step()


def copy_grads(src, dst):
    for p, q in zip(src.parameters(), dst.parameters()):
        q.grad = None if p.grad is None else p.grad.detach().clone()


def train(model, opt, data, sched=None, sign=1.0):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = sign * torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls_name", ["Adam", "AdamW"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_torch_100_steps(cls_name, weight_decay, maximize):
    ref_model = make_model()
    our_model = copy.deepcopy(ref_model)
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay, maximize=maximize)
    ref = getattr(torch.optim, cls_name)(ref_model.parameters(), foreach=False, **kw)
    ours = getattr(offload, cls_name)(our_model.parameters(), **kw)
    # With maximize the loop maximizes -loss (so it still converges: a diverging loop would
    # amplify last-bit differences between kernels until no tolerance holds).
    train_pair(our_model, ours, ref_model, ref, batches(100), sign=-1.0 if maximize else 1.0)
    assert_same(our_model, ref_model, ours, ref)


def test_adam_decoupled_weight_decay_is_adamw():
    ref_model = make_model()
    our_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ours = offload.Adam(our_model.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    train_pair(our_model, ours, ref_model, ref, batches(20))
    assert_same(our_model, ref_model, ours, ref)


def test_param_groups_frozen_and_missing_grads_and_scheduler():
    ref_model = make_model()
    our_model = copy.deepcopy(ref_model)

    def groups(m):
        return [
            {"params": list(m[0].parameters()), "lr": 3e-3},
            {"params": list(m[2].parameters()) + list(m[3].parameters()), "weight_decay": 0.0},
            {"params": list(m[4].parameters())},
        ]

    ref_model[3].weight.requires_grad_(False)  # frozen: never gets a grad
    our_model[3].weight.requires_grad_(False)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
    ours = offload.AdamW(groups(our_model), lr=1e-2)
    ref_s = torch.optim.lr_scheduler.StepLR(ref, step_size=3, gamma=0.5)
    our_s = torch.optim.lr_scheduler.StepLR(ours, step_size=3, gamma=0.5)
    data = batches(12)
    for i, (x, y) in enumerate(data):
        ours.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(our_model(x), y).backward()
        if i % 4 == 1:  # this step the last layer gets no grad
            for p in our_model[4].parameters():
                p.grad = None
        copy_grads(our_model, ref_model)  # the same grads (see the module's docstring)
        ref.step()
        ours.step()
        ref_s.step()
        our_s.step()
    assert_same(our_model, ref_model, ours, ref)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


def test_gradient_accumulation_and_closure():
    ref_model = make_model()
    our_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    ours = offload.AdamW(our_model.parameters(), lr=1e-2)
    data = batches(12)
    for i in range(0, 12, 3):
        for model, opt in ((ref_model, ref), (our_model, ours)):
            def closure(model=model, opt=opt):
                opt.zero_grad()
                total = 0.0
                for x, y in data[i:i + 3]:
                    loss = torch.nn.functional.mse_loss(model(x), y) / 3
                    loss.backward()
                    total += loss.item()
                return total
            loss = opt.step(closure)
            assert isinstance(loss, float)
    assert_same(our_model, ref_model, ours, ref)


def test_zero_size_and_scalar_params():
    ref_p = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.tensor(0.5))]
    our_p = [torch.nn.Parameter(p.detach().clone()) for p in ref_p]
    ref = torch.optim.AdamW(ref_p, lr=0.1, foreach=False)
    ours = offload.AdamW(our_p, lr=0.1)
    for step in range(5):
        for ps in (ref_p, our_p):
            ps[0].grad = torch.zeros(0)
            ps[1].grad = torch.tensor(0.3 * (step + 1))
        ref.step()
        ours.step()
    torch.testing.assert_close(our_p[1], ref_p[1], rtol=RTOL, atol=ATOL)
    assert float(ours.state[our_p[0]]["step"]) == float(ref.state[ref_p[0]]["step"]) == 5.0


def test_non_contiguous_param():
    base_ref = torch.randn(9, 5)
    ref_p = torch.nn.Parameter(base_ref.t())  # a transposed (non-contiguous) leaf
    our_p = torch.nn.Parameter(base_ref.clone().t())
    assert not our_p.is_contiguous()
    ref = torch.optim.Adam([ref_p], lr=0.05, foreach=False)
    ours = offload.Adam([our_p], lr=0.05)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        grad = torch.randn(5, 9, generator=g)
        ref_p.grad = grad.clone()
        our_p.grad = grad.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(our_p, ref_p, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_round_trip_mid_run(direction):
    ref_model = make_model()
    our_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    ours = offload.AdamW(our_model.parameters(), lr=1e-2, weight_decay=0.05)
    data = batches(20)
    train(ref_model, ref, data[:10])
    train(our_model, ours, data[:10])
    if direction == "torch_to_ours":
        fresh_model = copy.deepcopy(ref_model)
        fresh = offload.AdamW(fresh_model.parameters(), lr=1.0)
        fresh.load_state_dict(copy.deepcopy(ref.state_dict()))
        assert fresh.param_groups[0]["lr"] == 1e-2
        train_pair(fresh_model, fresh, ref_model, ref, data[10:])
        assert_same(fresh_model, ref_model, fresh, ref)
    else:
        fresh_model = copy.deepcopy(our_model)
        fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1.0, foreach=False)
        sd = ours.state_dict()
        assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
        assert sd["state"][0]["step"].dtype == torch.float32
        fresh.load_state_dict(copy.deepcopy(sd))
        train_pair(our_model, ours, fresh_model, fresh, data[10:])
        assert_same(our_model, fresh_model, ours, fresh)


def test_max_grad_norm_matches_clip_grad_norm():
    ref_model = make_model()
    our_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    ours = offload.AdamW(our_model.parameters(), lr=1e-2, max_grad_norm=0.05)
    for x, y in batches(15):
        ours.zero_grad()
        (torch.nn.functional.mse_loss(our_model(x), y) * 10).backward()
        copy_grads(our_model, ref_model)  # the same grads, unclipped (see the module's docstring)
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        ref.step()
        ours.step()
        assert math.isclose(ours.last_grad_norm, float(norm), rel_tol=1e-5)
    assert_same(our_model, ref_model, ours, ref)


def test_grad_scaler_unscales_in_kernel_and_skips_overflow():
    ref_model = make_model()
    our_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    ours = offload.AdamW(our_model.parameters(), lr=1e-2)
    scalers = {id(ref): torch.amp.GradScaler("cpu", init_scale=1024.0),
               id(ours): torch.amp.GradScaler("cpu", init_scale=1024.0)}
    for i, (x, y) in enumerate(batches(10)):
        ours.zero_grad()
        loss = torch.nn.functional.mse_loss(our_model(x), y)
        scalers[id(ref)].scale(loss)  # starts its scale; its grads are ours, copied below
        scalers[id(ours)].scale(loss).backward()
        if i == 4:  # injected overflow: both must skip this step
            next(our_model.parameters()).grad[0, 0] = float("inf")
        copy_grads(our_model, ref_model)  # the same scaled grads (see the module's docstring)
        for opt in (ref, ours):
            scalers[id(opt)].step(opt)
            scalers[id(opt)].update()
        assert ours.last_step_skipped == (i == 4)
    assert ours.skipped_steps == 1
    assert scalers[id(ours)].get_scale() == scalers[id(ref)].get_scale()
    assert_same(our_model, ref_model, ours, ref)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "Invalid learning rate: -1.0"),
        (dict(eps=-1e-8), "Invalid epsilon value: -1e-08"),
        (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
        (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
        (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
        (dict(max_grad_norm=0.0), "Invalid max_grad_norm: 0.0"),
        (dict(offload="disk"), "unknown offload target 'disk'"),
        (dict(offload="nvme"), "needs swap_dir"),
        (dict(stage=3), "Invalid stage: 3"),
    ],
)
def test_invalid_arguments(kwargs, message):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        offload.AdamW([p], **kwargs)


def test_amsgrad_honoured_not_ignored():
    """amsgrad=True steps with the running maximum: after a large grad then small ones the
    param moves less than plain Adam's, as torch's does."""
    out = {}
    for ams in (False, True):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = offload.AdamW([p], lr=0.1, amsgrad=ams)
        for g in (100.0, 0.01, 0.01):
            p.grad = torch.full((3,), g)
            opt.step()
        ref = torch.nn.Parameter(torch.zeros(3))
        topt = torch.optim.AdamW([ref], lr=0.1, amsgrad=ams, foreach=False)
        for g in (100.0, 0.01, 0.01):
            ref.grad = torch.full((3,), g)
            topt.step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
        out[ams] = p.detach().clone()
        assert ("max_exp_avg_sq" in opt.state[p]) is ams
    assert not torch.allclose(out[False], out[True])


def test_sparse_grad_rejected_like_torch():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = offload.Adam([p])
    p.grad = torch.sparse_coo_tensor([[1]], [1.0], (4,))
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_forced_unknown_backend_is_an_error():
    with pytest.raises((ValueError, RuntimeError), match="nope"):
        offload.AdamW([torch.nn.Parameter(torch.zeros(3))], backend="nope")


def test_step_stats_and_memory_report():
    model = make_model()
    opt = offload.AdamW(model.parameters())
    train(model, opt, batches(3))
    stats = opt.step_stats()
    assert stats["steps"] == 3
    assert stats["last"]["kernel"] > 0 and stats["last"]["step"] >= stats["last"]["kernel"]
    report = opt.memory_report()
    n = sum(p.numel() for p in model.parameters())
    assert report["tiers"]["pageable"] == 8 * n  # exp_avg + exp_avg_sq, fp32
    assert report["rss"] > 0


def test_two_optimizers_loaded_from_one_state_dict_keep_their_own_steps():
    model = make_model()
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, batches(2))
    sd = opt.state_dict()
    a_model, b_model = copy.deepcopy(model), copy.deepcopy(model)
    a = offload.AdamW(a_model.parameters(), lr=1e-2)
    b = offload.AdamW(b_model.parameters(), lr=1e-2)
    a.load_state_dict(sd)
    b.load_state_dict(sd)
    train(a_model, a, batches(3))
    assert float(a.state[next(a_model.parameters())]["step"]) == 5.0
    assert float(b.state[next(b_model.parameters())]["step"]) == 2.0
    assert float(sd["state"][0]["step"]) == 2.0


def test_step_tensors_are_never_changed_in_place():
    """A step tensor, once in opt.state, keeps its value: one handed out by state_dict() or
    put there by the user is shared, and torch's load_state_dict keeps a loaded dict's own."""
    model = make_model()
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    p = next(model.parameters())
    train(model, opt, batches(2))
    held = opt.state[p]["step"]
    sd = opt.state_dict()
    handed = sd["state"][0]["step"]
    assert handed is held and sd["state"][0] is not opt.state[p]  # new entry dicts, the very tensors
    assert sd["state"][0]["exp_avg"] is opt.state[p]["exp_avg"]
    train(model, opt, batches(2))
    assert float(held) == 2.0 and float(opt.state[p]["step"]) == 4.0
    own = torch.tensor(7.0)  # a step tensor the user put there
    opt.state[p]["step"] = own
    train(model, opt, batches(1))
    assert float(own) == 7.0 and float(opt.state[p]["step"]) == 8.0


def test_a_failed_step_puts_back_the_step_tensors(monkeypatch):
    model = make_model()
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, batches(2))
    steps = {id(p): opt.state[p]["step"] for p in model.parameters()}
    from offload.kernels import get_backend

    def boom(*a, **kw):
        raise MemoryError("injected")

    backend = get_backend(opt.backend)
    for name in ("checked_rule_steps", "checked_rule_step", "rule_step"):
        monkeypatch.setattr(backend, name, boom)
    with pytest.raises(MemoryError):
        train(model, opt, batches(1))
    monkeypatch.undo()
    for p in model.parameters():
        assert float(opt.state[p]["step"]) == 2.0, "a count the failed step raised stayed raised"
        assert opt.state[p]["step"] is steps[id(p)]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_as_the_user_left_it_after_a_step(monkeypatch, enabled):
    """[Note: no collection inside a step] in offload/optim/step_guard.py."""
    import gc

    model = make_model()
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    seen = []
    monkeypatch.setattr(opt, "_store_step", lambda work, m: seen.append(gc.isenabled()) or {})
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        train(model, opt, batches(1))
        assert seen == [False] and gc.isenabled() is enabled

        def fail(work, m):
            raise RuntimeError("injected")

        monkeypatch.setattr(opt, "_store_step", fail)
        with pytest.raises(RuntimeError, match="injected"):
            train(model, opt, batches(1))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_add_param_group_of_another_kind_after_construction_is_a_clear_error():
    opt = offload.AdamW([torch.nn.Parameter(torch.zeros(3))])
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(5))], "lr": 0.1})  # fp32: fine
    with pytest.raises(ValueError, match=r"parameter 2 has dtype torch.bfloat16.*when the optimizer is built"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]})
