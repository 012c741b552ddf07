"""[Note: GradScaler across ranks] (offload/optim/scaler_sync.py): at stages 1-2 each rank
reduces the grads inside the step, so GradScaler finds an inf in one rank's local grads only.
The ranks skipped that step together, but GradScaler.update() halved the loss scale on that
rank alone: the next steps summed grads scaled by 1024 on one rank and 512 on the other,
silently (0.025 off torch after two more steps). Now the agreed flag goes into every rank's
scaler. The reference: torch's AdamW over grads averaged by hand, with its own GradScaler."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import offload
from _ranks import group

STEPS, BAD_STEP = 4, 1


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _twins(stage, **kw):
    """(ours, ref, opt, ref_opt, scaler, ref_scaler): offload's AdamW and torch's over the
    same model, each with its own GradScaler."""
    ours, ref = _model(), _model()
    opt = offload.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, stage=stage, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return (ours, ref, opt, ref_opt, torch.amp.GradScaler("cpu", init_scale=1024.0),
            torch.amp.GradScaler("cpu", init_scale=1024.0))


def _step_both(scaler, opt, ref_scaler, ref_opt, scales):
    for sc, o in ((scaler, opt), (ref_scaler, ref_opt)):
        sc.step(o)
        sc.update()
    scales.append((scaler.get_scale(), ref_scaler.get_scale(), opt.last_step_skipped))


def _result(ours, ref, opt, scales):
    diff = max(float((a - b).abs().max()) for a, b in zip(ours.parameters(), ref.parameters()))
    opt.close()
    return dict(scales=scales, diff=diff)


def _scaler_job(rank, world, stage, unscale, swap_root):
    kw = dict(offload="nvme", swap_dir=f"{swap_root}/r{rank}") if swap_root else {}
    if swap_root:
        import os
        os.makedirs(kw["swap_dir"], exist_ok=True)
    ours, ref, opt, ref_opt, scaler, ref_scaler = _twins(stage, **kw)
    scales = []
    for s in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + s))
        for model, o, sc in ((ours, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad()
            sc.scale(model(x).square().mean()).backward()
            if s == BAD_STEP and rank == 1:  # an overflow in one rank's grads only
                model[0].weight.grad[0, 0] = float("inf")
        for p in ref.parameters():  # DDP's average, before the reference scaler looks
            dist.all_reduce(p.grad)
            p.grad /= world
        if unscale:
            scaler.unscale_(opt)
        _step_both(scaler, opt, ref_scaler, ref_opt, scales)
    return _result(ours, ref, opt, scales)


@pytest.mark.parametrize("stage, unscale, where", [(2, False, "none"), (1, True, "none"), (2, False, "nvme")])
def test_an_overflow_on_one_rank_changes_every_rank_loss_scale(stage, unscale, where, tmp_path):
    got = group(2).run(_scaler_job, stage, unscale, str(tmp_path) if where == "nvme" else None)
    for rank in (0, 1):
        scales = got[rank]["scales"]
        assert [ours for ours, _, _ in scales] == [theirs for _, theirs, _ in scales] == \
               [1024.0, 512.0, 512.0, 512.0], (rank, scales)
        assert [skipped for _, _, skipped in scales] == [False, True, False, False], (rank, scales)
        assert got[rank]["diff"] < 1e-6, (rank, got[rank])


def test_a_step_not_called_by_grad_scaler_has_no_scaler_to_write():
    from offload.optim.scaler_sync import share_found_inf

    opt = offload.AdamW(_model().parameters(), lr=1e-2)
    assert share_found_inf(opt, torch.ones(())) is False
    opt.close()


def _no_grads_job(rank, world, stage, bad):
    """Rank 0 has no grad at all at steps 0-1 (GradScaler finds nothing to check there: it
    hands the step the int 0, the sum of no flags, and records none); rank 1 overflows at
    step ``bad``. The reference: DDP's average, rank 0's grads counting as zeros."""
    ours, ref, opt, ref_opt, scaler, ref_scaler = _twins(stage)
    scales = []
    for s in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + s))
        for model, o, sc in ((ours, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad()
            loss = sc.scale(model(x).square().mean())  # (the scaler's first scale() makes its scale)
            if rank == 1 or s >= 2:  # (rank 0: an empty batch, no backward)
                loss.backward()
                if s == bad and rank == 1:
                    model[0].weight.grad[0, 0] = float("inf")
        for p in ref.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            p.grad = g / world
        _step_both(scaler, opt, ref_scaler, ref_opt, scales)
    return _result(ours, ref, opt, scales)


@pytest.mark.parametrize("stage, bad", [(1, 1), (2, 0)])
def test_a_rank_without_any_grad_agrees_with_the_others_loss_scale(stage, bad):
    # (Before: that rank's update() raised "No inf checks were recorded" after a step the
    # others skipped, or it stepped alone; gloo then aborted on the next mismatched collective.)
    got = group(2).run(_no_grads_job, stage, bad)
    want = [1024.0] * bad + [512.0] * (STEPS - bad)
    for rank in (0, 1):
        scales = got[rank]["scales"]
        assert [ours for ours, _, _ in scales] == [theirs for _, theirs, _ in scales] == want, (rank, scales)
        assert [skipped for _, _, skipped in scales] == [s == bad for s in range(STEPS)], (rank, scales)
        assert got[rank]["diff"] < 1e-6, (rank, got[rank])
