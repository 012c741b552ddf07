"""The CUDA path of the flat store: grads D2H on a side stream, params H2D on a copy stream.

Every test runs twice: on a CUDA device (``[cuda]``, marked ``cuda``, skipped without one;
bench/gpu_check.sh runs them), and on the CPU with the streams emulated (``[emulated]``,
tests/stream_emulation.py: async copies are queued and run only when a GPU would have to
have run them, and a copy whose source the host changed first writes NaN), so CI checks
the path's stream logic too. Following torchao's trick, the model is a stack of layers with
low arithmetic density (thin linears, elementwise ops), so the device finishes its work
quickly and any missing wait between streams shows up as a stale value: the test reads
params and losses right after ``step()`` on the compute stream, with no
``torch.cuda.synchronize()`` in between.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import offload
from offload.optim.flat_state import FlatState
from stream_emulation import Emulation
import _internals as internals

_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda,
                                    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])


_EMU = []  # the emulation of the running test, if it runs emulated


@pytest.fixture(params=[_CUDA, "emulated"])
def dev(request, monkeypatch):
    """The device the params live on: "cuda", or "cpu" with the CUDA path emulated."""
    if request.param == "cuda":
        yield "cuda"
        return
    with Emulation().install(monkeypatch) as emu:
        _EMU.append(emu)
        try:
            yield "cpu"
        finally:
            _EMU.pop()


HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.05)


def _model(dtype, dev):
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(257, 257), nn.SiLU()]
    layers.append(nn.Linear(257, 3))
    m = nn.Sequential(*layers)
    m[2].requires_grad_(False)  # a frozen layer
    return m.to(dev, dtype)


def _with_reference(dtype, dev):
    """The model, its params, fp32 masters on the host and torch's AdamW over those."""
    model = _model(dtype, dev)
    params = list(model.parameters())
    masters = [p.detach().float().cpu().clone().requires_grad_(p.requires_grad) for p in params]
    return model, params, masters, torch.optim.AdamW(masters, foreach=False, **HP)


def _step_both(opt, ref, params, masters):
    """The grads to torch's AdamW on the fp32 masters; both step; the masters must agree."""
    for p, m in zip(params, masters):
        m.grad = None if p.grad is None else p.grad.float().cpu()
    ref.step()
    opt.step()
    opt.zero_grad()
    ref.zero_grad()
    for p, m in zip(params, masters):
        torch.testing.assert_close(internals.master(opt, p), m.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_params_match_adamw_on_host_master(monkeypatch, dev, dtype, overlap):
    monkeypatch.setattr(FlatState, "overlap", overlap)
    model, params, masters, ref = _with_reference(dtype, dev)
    opt = offload.AdamW(params, offload="cpu", **HP)
    assert opt.memory_report()["store"] == "flat"
    for step in range(10):
        for micro in range(2):  # gradient accumulation: the hook fires twice per param
            x = torch.randn(64, 257, device=dev, dtype=dtype)
            model(x).float().pow(2).mean().backward()
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float().cpu()
        ref.step()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref.zero_grad()
        # Read on the compute stream right away: must see the copied params.
        for p, m in zip(params, masters):
            ours = internals.master(opt, p)
            torch.testing.assert_close(ours, m.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach().cpu(), ours.to(dtype)), "device param is not the copy of its master"
    opt.close()


def test_cuda_grad_changed_after_backward_is_seen(monkeypatch, dev):
    model, params, masters, ref = _with_reference(torch.bfloat16, dev)
    opt = offload.AdamW(params, offload="cpu", **HP)
    for _ in range(3):
        model(torch.randn(8, 257, device=dev, dtype=torch.bfloat16)).float().sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # in place, after the hook's copy
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float().cpu()
        ref.step()
        opt.step()
        opt.zero_grad()
    for p, m in zip(params, masters):
        torch.testing.assert_close(internals.master(opt, p), m.detach(), rtol=1e-5, atol=1e-6)
    assert opt.memory_report()["tiers"]["pinned"] > 0


def test_cuda_fp16_grad_scaler_overflow_skips_and_unscales_in_kernel(dev):
    model, params, masters, ref = _with_reference(torch.float16, dev)
    opt = offload.AdamW(params, offload="cpu", **HP)
    scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 12)
    for step in range(5):
        loss = model(torch.randn(16, 257, device=dev, dtype=torch.float16)).float().pow(2).mean()
        if step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        grads = [None if p.grad is None else p.grad.float().cpu() for p in params]
        skip = any(g is not None and not torch.isfinite(g).all() for g in grads)
        inv = 1.0 / scaler.get_scale()
        if not skip:
            for m, g in zip(masters, grads):
                m.grad = None if g is None else g * inv
            ref.step()
        scaler.step(opt)
        scaler.update()
        assert opt.last_step_skipped == skip
        opt.zero_grad()
        ref.zero_grad()
    assert opt.skipped_steps == 1
    for p, m in zip(params, masters):
        torch.testing.assert_close(internals.master(opt, p), m.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_params_with_master_and_moments_on_nvme(tmp_path, dev, dtype):
    # bf16: the kernel writes the pinned staging, copied on the copy stream; fp32: the master
    # is copied from the pipeline buffer to the device param sub-group by sub-group.
    model, params, masters, ref = _with_reference(dtype, dev)
    (tmp_path / "a").mkdir()
    opt = offload.AdamW(params, offload="nvme", swap_dir=str(tmp_path / "a"), sub_group_size=16384, **HP)
    for _ in range(4):
        model(torch.randn(32, 257, device=dev, dtype=dtype)).float().pow(2).mean().backward()
        _step_both(opt, ref, params, masters)
        for p in params:
            assert torch.equal(p.detach().cpu(), internals.master(opt, p).to(dtype))
    assert opt.memory_report()["tiers"]["nvme"] > 0 and opt.memory_report()["detail"]["state_bytes"] == 0
    # A streamed checkpoint restores masters, moments and the device params of a fresh model.
    opt.save_checkpoint(str(tmp_path / "ck"))
    twin = _model(dtype, dev)
    with torch.no_grad():
        for q in twin.parameters():
            q.add_(1.0)
    (tmp_path / "b").mkdir()
    opt2 = offload.AdamW(twin.parameters(), offload="nvme", swap_dir=str(tmp_path / "b"), **HP)
    opt2.load_checkpoint(str(tmp_path / "ck"))
    for p, q in zip(params, twin.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(internals.master(opt, p), internals.master(opt2, q))
    opt.close()
    opt2.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_loads_right_after_step_wait_for_the_param_copies(tmp_path, dev, dtype):
    # step() returns with the param copies still queued; they read the pinned master (fp32)
    # or staging (bf16). Loading a state dict without masters right away (resetting the
    # optimizer) rewrites the master from the params: it must wait for those copies, or the
    # params get the zeroed master.
    model = _model(dtype, dev)
    params = list(model.parameters())
    opt = offload.AdamW(params, offload="cpu", **HP)
    fresh = offload.AdamW(_model(dtype, dev).parameters(), offload="cpu", **HP).state_dict()
    opt.save_checkpoint(str(tmp_path / "step0"))
    model(torch.randn(16, 257, device=dev, dtype=dtype)).float().pow(2).mean().backward()
    opt.step()
    stepped = [internals.master(opt, p).clone() for p in params]
    opt.load_state_dict(fresh)  # right after the step: masters from the params' values
    for p, m in zip(params, stepped):
        assert torch.equal(p.detach().cpu(), m.to(dtype))
        torch.testing.assert_close(internals.master(opt, p), m.to(dtype).float(), rtol=0, atol=0)
    assert not opt.state_dict()["state"]
    opt.zero_grad()
    model(torch.randn(16, 257, device=dev, dtype=dtype)).float().pow(2).mean().backward()
    opt.step()
    opt.load_checkpoint(str(tmp_path / "step0"))  # right after a step again
    start = _model(dtype, dev)
    for p, q in zip(params, start.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())
        torch.testing.assert_close(internals.master(opt, p), q.detach().float().cpu(), rtol=0, atol=0)
    opt.close()


def test_cuda_clipping_takes_the_grad_norm_on_the_device(monkeypatch, dev):
    # With max_grad_norm the hook takes each grad's sum of squares on the device, so the step
    # makes no pass over the copied grads on the host; a grad changed after its hook (here
    # scaled in place) is measured on the host instead. Clipped as torch clips.
    from offload.kernels import get_backend

    model, params, masters, ref = _with_reference(torch.bfloat16, dev)
    opt = offload.AdamW(params, offload="cpu", max_grad_norm=0.05, **HP)
    backend = type(get_backend(opt.backend))
    host_passes = []
    real = backend.grad_sumsq

    def spy(self, grad, **kw):
        host_passes.append(grad.numel())
        return real(self, grad, **kw)

    monkeypatch.setattr(backend, "grad_sumsq", spy)
    for step in range(4):
        for micro in range(2):  # the hook fires twice per param: the last sum counts
            model(torch.randn(16, 257, device=dev, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        if step == 2:
            with torch.no_grad():
                params[0].grad.mul_(3.0)
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float().cpu()
        ref_norm = float(torch.nn.utils.clip_grad_norm_([m for m in masters if m.grad is not None], 0.05))
        ref.step()
        host_passes.clear()
        opt.step()
        assert host_passes == ([params[0].numel()] if step == 2 else []), host_passes
        assert opt.last_grad_norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > 0.05  # it clips
        opt.zero_grad()
        ref.zero_grad()
        for p, m in zip(params, masters):
            torch.testing.assert_close(internals.master(opt, p), m.detach(), rtol=1e-5, atol=1e-6)
    opt.close()


def test_cuda_no_sync_copies_the_accumulated_grads_once(dev):
    # Accumulating over 3 micro-batches: inside opt.no_sync() the hooks copy nothing; the last
    # backward copies each accumulated grad once. A step taken with the grads still unsent
    # (inside the block) copies them then.
    model, params, masters, ref = _with_reference(torch.bfloat16, dev)
    opt = offload.AdamW(params, offload="cpu", **HP)
    trainable = sum(p.requires_grad for p in params)

    def backward():
        model(torch.randn(16, 257, device=dev, dtype=torch.bfloat16)).float().pow(2).mean().backward()

    for step in range(4):
        copies = _EMU[0].queued["grad"] if _EMU else 0
        with opt.no_sync():
            backward()
            backward()
            if step == 3:
                backward()  # the step below finds the grads never sent
        if step < 3:
            backward()
            if _EMU:
                assert _EMU[0].queued["grad"] - copies == trainable
        _step_both(opt, ref, params, masters)
    opt.close()


@pytest.mark.parametrize("store", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype,master_dtype", [
    ("bfloat16", None), ("int8", None), ("int8", "bfloat16"), ("bfloat16", "bfloat16")])
def test_cuda_compressed_states_step_as_host_params_do(tmp_path, dev, store, state_dtype, master_dtype):
    # The kernel runs on the host whatever the params' device: bf16 device params with bf16 /
    # int8 states (and a bf16 master) must get the same bits as bf16 host params fed the same
    # grads (both take the flat store), and so must the states torch's layout gives back. A
    # missing wait shows up here as a stale param or master. (fp32 params are not compared:
    # on the host they are updated in place by another store, which keeps a param of under
    # 4096 elements in float32 states and seeds bf16 rounding per param, not per flat group.)
    dtype = torch.bfloat16
    model = _model(dtype, dev)
    params = list(model.parameters())
    twin = [p.detach().cpu().clone().requires_grad_(p.requires_grad) for p in params]
    kw = dict(HP, state_dtype=state_dtype, master_dtype=master_dtype)

    def make(ps, name):
        if store == "nvme":
            (tmp_path / name).mkdir()
            return offload.AdamW(ps, offload="nvme", swap_dir=str(tmp_path / name), sub_group_size=16384, **kw)
        return offload.AdamW(ps, offload="cpu", **kw)

    opt, ref = make(params, "dev"), make(twin, "host")
    for step in range(4):
        model(torch.randn(32, 257, device=dev, dtype=dtype)).float().pow(2).mean().backward()
        for p, q in zip(params, twin):
            q.grad = None if p.grad is None else p.grad.detach().cpu().clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for i, (p, q) in enumerate(zip(params, twin)):
            assert torch.equal(p.detach().cpu(), q.detach()), f"param {i} differs after step {step}"
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    assert ours.keys() == theirs.keys() and ours
    for k in ours:
        for name, v in ours[k].items():
            assert torch.equal(v, theirs[k][name]), f"state {k}.{name} differs"
    opt.close()
    ref.close()
