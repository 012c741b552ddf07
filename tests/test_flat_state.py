"""The flat store on one process: bf16/fp16 CPU params with fp32 masters on the host.

Reference: ``torch.optim.AdamW(foreach=False)`` run on an fp32 copy of the params (the
master), fed each step with exactly the grads our bf16 model produced (upcast). Our masters
must match it within rtol 1e-5 / atol 1e-6 after every step, and our bf16 params must be the
round-to-nearest-even of our masters, bit for bit. The model mixes layers of low arithmetic
density, a frozen layer, a branch used only on some steps, and odd sizes (SIMD tails).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import offload
from offload.optim.flat_state import FlatState
import _internals as internals

STEPS = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(17, 33)
        self.frozen = nn.Linear(33, 33)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(33)
        self.side = nn.Linear(33, 33)  # used on even steps only
        self.out = nn.Linear(33, 7)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.inp(x))
        h = self.norm(self.frozen(h))
        if use_side:
            h = h + self.side(h)
        return self.out(h)


def _model(dtype: torch.dtype, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def _train(monkeypatch, *, dtype=torch.bfloat16, copy_grads=False, accumulate=2, scaler=False,
           overflow_at=None, max_grad_norm=None, set_to_none=True, steps=STEPS, on_step=None,
           device_path=False, sub_group_size=None, unscale=False, **extra):
    monkeypatch.setattr(FlatState, "copy_cpu_grads", copy_grads or device_path)
    monkeypatch.setattr(FlatState, "stage_cpu_params", device_path)
    model = _model(dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in params]
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    ref = torch.optim.AdamW(masters, foreach=False, **kw)
    opt = offload.AdamW(params, max_grad_norm=max_grad_norm, sub_group_size=sub_group_size, **kw, **extra)
    assert opt.memory_report()["store"] == "flat"
    lam = lambda s: 1.0 / (1 + 0.3 * s)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lam)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaler else None
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(accumulate):
            x = torch.randn(6, 17, generator=gen).to(dtype)
            loss = model(x, use_side=step % 2 == 0).float().pow(2).mean()
            if overflow_at == step and micro == 0:
                loss = loss * float("inf")
            (gs.scale(loss) if gs else loss).backward()
        grads = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
        if on_step is not None:
            on_step(step, model, opt)
            grads = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
        # The reference: torch.optim.AdamW on the fp32 masters, same grads, same decisions.
        inv = 1.0 / gs.get_scale() if gs else 1.0
        skip = any(g is not None and not torch.isfinite(g).all() for g in grads)
        if not skip:
            for m, g in zip(masters, grads):
                m.grad = None if g is None else g * inv
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([m for m in masters if m.grad is not None], max_grad_norm)
            ref.step()
        if gs:
            if unscale:
                gs.unscale_(opt)  # in place, after the hook copied the grads
            gs.step(opt)
            gs.update()
        else:
            opt.step()
        assert opt.last_step_skipped == skip
        sched.step()
        ref_sched.step()
        opt.zero_grad(set_to_none=set_to_none)
        ref.zero_grad()
        for p, m in zip(params, masters):
            ours = internals.master(opt, p)
            torch.testing.assert_close(ours, m.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), ours.to(dtype)), "param is not the RNE copy of its master"
    return model, opt, ref, masters


@pytest.mark.parametrize("copy_grads", [False, True], ids=["grads-in-place", "hook-copy"])
def test_bf16_matches_adamw_on_fp32_master(monkeypatch, copy_grads):
    _, opt, _, _ = _train(monkeypatch, copy_grads=copy_grads)
    assert opt.memory_report()["tiers"]["pageable"] > 0


def test_device_path_on_cpu_staging_and_sub_groups(monkeypatch):
    # The CUDA path (hook copy to a host grad buffer, kernel writes a staging buffer, one
    # copy per sub-group into the param) run with CPU params, sub-groups of 100 elements.
    _, opt, _, _ = _train(monkeypatch, device_path=True, sub_group_size=100)
    assert opt.memory_report()["detail"]["lowp_bytes"] > 0


def test_zero_grad_set_to_none_false_steps_zero_grads_like_torch(monkeypatch):
    # With set_to_none=False the unused branch keeps a zero grad and torch steps it (weight
    # decay, moments decay); the reference sees the same zeros.
    _train(monkeypatch, set_to_none=False, copy_grads=True)


def test_fp16_grad_scaler_injected_overflow_skips_step(monkeypatch):
    _, opt, _, _ = _train(monkeypatch, dtype=torch.float16, scaler=True, overflow_at=3)
    assert opt.skipped_steps == 1


def test_grad_scaler_unscale_before_step_with_hook_copies(monkeypatch):
    # unscale_() rewrites the grads without bumping their version: the copies must be redone.
    # (bf16: GradScaler.unscale_ refuses fp16 grads.)
    _, opt, _, _ = _train(monkeypatch, dtype=torch.bfloat16, scaler=True, overflow_at=2, copy_grads=True,
                          unscale=True, steps=5)
    assert opt.skipped_steps == 1


def test_max_grad_norm_matches_clip_grad_norm(monkeypatch):
    _, opt, _, _ = _train(monkeypatch, max_grad_norm=0.05, accumulate=1)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # clipping was active


def test_grad_changed_after_hook_is_recopied(monkeypatch):
    # The hook copied p.grad during backward; an in-place change afterwards (as
    # clip_grad_norm_ or a manual unscale would make) must be what the step uses.
    def halve(step, model, opt):
        model.out.weight.grad.mul_(0.5)
        model.inp.bias.grad = model.inp.bias.grad.clone() * 2  # a new tensor the hook never saw
    _train(monkeypatch, copy_grads=True, accumulate=1, steps=4, on_step=halve)


def test_state_dict_roundtrip_keeps_fp32_master_and_loads_into_torch(monkeypatch):
    model, opt, ref, masters = _train(monkeypatch, steps=4)
    sd = opt.state_dict()
    params = list(model.parameters())
    for i, p in enumerate(params):
        if not p.requires_grad:
            assert i not in sd["state"]
            continue
        st = sd["state"][i]
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == p.shape
        torch.testing.assert_close(st["exp_avg"], ref.state[masters[i]]["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st["exp_avg_sq"], ref.state[masters[i]]["exp_avg_sq"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st["master"], masters[i].detach(), rtol=1e-5, atol=1e-6)
    # A fresh optimizer on a fresh bf16 model of the same values continues identically.
    twin = _model(torch.bfloat16, seed=5)
    twin.load_state_dict(model.state_dict())
    opt2 = offload.AdamW(twin.parameters(), lr=1.0)
    opt2.load_state_dict(copy.deepcopy(sd))  # torch shares step tensors with the source
    for p, q in zip(params, twin.parameters()):
        torch.testing.assert_close(internals.master(opt2, q), internals.master(opt, p), rtol=0, atol=0)
    x = torch.randn(5, 17).bfloat16()
    for m, o in ((model, opt), (twin, opt2)):
        m(x, True).float().sum().backward()
        o.step()
    for p, q in zip(params, twin.parameters()):
        assert torch.equal(p, q)
    # torch.optim.AdamW on fp32 params takes the same state dict (the extra key is ignored).
    fp32 = [p.detach().float().clone().requires_grad_() for p in params]
    t = torch.optim.AdamW(fp32)
    t.load_state_dict(sd)
    torch.testing.assert_close(t.state[fp32[0]]["exp_avg"], sd["state"][0]["exp_avg"])


def test_load_without_master_takes_params(monkeypatch):
    model, opt, _, _ = _train(monkeypatch, steps=2, accumulate=1)
    sd = opt.state_dict()
    for st in sd["state"].values():
        del st["master"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the user loaded other weights
    opt.load_state_dict(sd)
    for p in model.parameters():
        assert torch.equal(internals.master(opt, p), p.detach().float())


def test_rejects_unsupported_param_dtype():
    with pytest.raises(NotImplementedError, match="complex128.*torch.optim.AdamW"):
        offload.AdamW([nn.Parameter(torch.zeros(3, dtype=torch.complex128))])
    with pytest.raises(NotImplementedError, match="parameter 1 is torch.float64"):  # beside a flat master
        offload.AdamW([nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(3, dtype=torch.float64))])


def test_bf16_moments_on_nvme_match_adamw(monkeypatch, tmp_path):
    # Master and moments in swap files (sub-groups of 1024 elements: several per step); the
    # host keeps only the pipeline buffers and the bf16 params.
    model, opt, ref, masters = _train(monkeypatch, offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024,
                                      max_grad_norm=0.5)
    rep = opt.memory_report()
    n = sum(p.numel() for p in model.parameters())
    assert rep["detail"]["state_bytes"] == 0
    assert rep["tiers"]["nvme"] >= 2 * 12 * n  # two slots of master, exp_avg, exp_avg_sq
    sd = opt.state_dict()
    for i, m in enumerate(masters):
        if i in sd["state"]:
            torch.testing.assert_close(sd["state"][i]["exp_avg_sq"], ref.state[m]["exp_avg_sq"], rtol=1e-5, atol=1e-6)
    # load_state_dict writes the moments back into (other) swap files: same next step.
    twin = _model(torch.bfloat16, seed=3)
    twin.load_state_dict(model.state_dict())
    (tmp_path / "b").mkdir()
    opt2 = offload.AdamW(twin.parameters(), offload="nvme", swap_dir=str(tmp_path / "b"), max_grad_norm=0.5)
    opt2.load_state_dict(copy.deepcopy(sd))
    x = torch.randn(5, 17).bfloat16()
    for m, o in ((model, opt), (twin, opt2)):
        m(x, True).float().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(internals.master(opt, p), internals.master(opt2, q))
    opt.close()
    opt2.close()


def test_nvme_device_path_on_cpu(monkeypatch, tmp_path):
    # The CUDA path (hook copies, staging, copies into the params) with moments on NVMe.
    _, opt, _, _ = _train(monkeypatch, device_path=True, offload="nvme", swap_dir=str(tmp_path), steps=4)
    assert opt.memory_report()["tiers"]["nvme"] > 0
    opt.close()


def test_sub_groups_split_large_params(monkeypatch):
    # A sub-group smaller than a param cuts it into several kernel calls: same result.
    model = _model(torch.bfloat16)
    twin = _model(torch.bfloat16)
    a = offload.AdamW(model.parameters(), lr=1e-2)
    b = offload.AdamW(twin.parameters(), lr=1e-2, sub_group_size=7)
    x = torch.randn(4, 17).bfloat16()
    for m, o in ((model, a), (twin, b)):
        for _ in range(3):
            m(x, True).float().sum().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(internals.master(a, p), internals.master(b, q))
        assert math.isfinite(float(p.float().sum()))


def test_save_and_load_checkpoint_one_rank(monkeypatch, tmp_path):
    model, opt, _, _ = _train(monkeypatch, steps=3, accumulate=1)
    opt.save_checkpoint(str(tmp_path))
    twin = _model(torch.bfloat16, seed=9)  # other values: the checkpoint restores them
    opt2 = offload.AdamW(twin.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    opt2.load_checkpoint(str(tmp_path))
    x = torch.randn(5, 17).bfloat16()
    for m, o in ((model, opt), (twin, opt2)):
        m(x, True).float().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(internals.master(opt, p), internals.master(opt2, q))
        assert torch.equal(p, q)


def test_param_groups_with_own_hyperparameters_and_add_param_group():
    # Two groups with their own lr / weight decay / betas, and a third added later.
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in params]
    spec = [dict(lr=1e-2, weight_decay=0.0), dict(lr=3e-2, weight_decay=0.2, betas=(0.5, 0.9))]
    ours = offload.AdamW([dict(params=params[:4], **spec[0]), dict(params=params[4:8], **spec[1])])
    ref = torch.optim.AdamW([dict(params=masters[:4], **spec[0]), dict(params=masters[4:8], **spec[1])],
                            foreach=False)
    for step in range(4):
        if step == 2:
            ours.add_param_group(dict(params=params[8:], lr=5e-3, eps=1e-4))
            ref.add_param_group(dict(params=masters[8:], lr=5e-3, eps=1e-4))
        model(torch.randn(4, 17).bfloat16(), True).float().pow(2).sum().backward()
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float()
        ours.step()
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    for p, m in zip(params, masters):
        torch.testing.assert_close(internals.master(ours, p), m.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adagrad_group_added_later_starts_its_sum_at_initial_accumulator_value(dtype, state_dtype):
    # torch fills every param's sum with initial_accumulator_value, an added group's too; the
    # flat store's new fields started at zero (found by tools/history_fuzz.py)
    torch.manual_seed(0)
    params = [torch.randn(n).to(dtype).requires_grad_() for n in (7, 300)]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    ours = offload.Adagrad(params[:1], lr=0.1, initial_accumulator_value=0.5, state_dtype=state_dtype)
    ref = torch.optim.Adagrad(masters[:1], lr=0.1, initial_accumulator_value=0.5, foreach=False)
    ours.add_param_group(dict(params=params[1:], lr=0.05))
    ref.add_param_group(dict(params=masters[1:], lr=0.05))
    assert torch.equal(ours.state_dict()["state"][1]["sum"], torch.full((300,), 0.5))  # before a step too
    for _ in range(2):
        for p, m in zip(params, masters):
            p.grad = torch.randn(p.shape).to(dtype)
            m.grad = p.grad.float()
        ours.step()
        ref.step()
    rtol = 1e-5 if state_dtype == "float32" else 4e-2  # bf16 states: two stochastic roundings
    for p, m in zip(params, masters):
        torch.testing.assert_close(ours.state[p]["sum"].float(), ref.state[m]["sum"], rtol=rtol, atol=1e-6)
        torch.testing.assert_close(internals.master(ours, p), m.detach(), rtol=rtol, atol=1e-6)


class _CountingStream:
    """A side stream that only counts: stands for a CUDA stream with copies still queued."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(self.name)

    def wait_current(self):
        pass

    def current_waits(self):
        pass


def test_host_writes_outside_step_wait_for_the_side_streams(tmp_path, monkeypatch):
    # step() returns with param copies still queued on the copy stream, reading the pinned
    # master / staging buffers; a load rewrites those buffers on the host, so it must wait
    # for them first (and so must the collection of an optimizer dropped without close()).
    import gc

    import offload.optim.flat.checkpoints as fs
    from offload.zero.flat_group import FlatGroup

    model = _model(torch.bfloat16, seed=3)
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    log = []
    internals.streams(opt)[torch.device("cuda", 7)] = (_CountingStream(log, "grad"), _CountingStream(log, "copy"))
    # The first host writes of each load: they must come after both drains.
    real_refresh, real_load = FlatGroup.refresh_master, fs.load_shards
    monkeypatch.setattr(FlatGroup, "refresh_master", lambda fg: (log.append("write"), real_refresh(fg))[1])
    monkeypatch.setattr(fs, "load_shards", lambda *a: (log.append("write"), real_load(*a))[1])
    model(torch.randn(5, 17).bfloat16(), True).float().sum().backward()
    opt.step()
    opt.save_checkpoint(str(tmp_path))
    sd = opt.state_dict()
    for load, arg in ((opt.load_state_dict, sd), (opt.load_checkpoint, str(tmp_path))):
        log.clear()
        load(arg)
        assert log[:3] == ["grad", "copy", "write"], log
    del load
    log.clear()
    del opt
    gc.collect()
    assert log == ["grad", "copy"]


def test_a_small_model_keeps_in_ram_what_the_report_says():
    # The store's host buffers come from a pool that maps 64 MiB regions; it mapped them
    # prefaulted, so a 2M-param bf16 model held 64 MiB resident where memory_report() said 24.
    from offload.memory.region import HUGE_PAGE, resident_pages

    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).to(torch.bfloat16)
    opt = offload.AdamW(model.parameters(), lr=1e-3, offload="cpu")
    pool = internals.store(opt)._pools[0]
    resident = 0
    for region in pool._regions:
        pages = resident_pages(region.address, region.size)
        if pages is None:
            pytest.skip("mincore cannot tell resident pages here")
        resident += sum(pages) * 4096
    reported = opt.memory_report()["tiers"]["pageable"]
    assert reported > 0
    assert resident <= reported + 2 * HUGE_PAGE, (resident, reported)
    opt.close()
