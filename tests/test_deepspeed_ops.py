"""DeepSpeed's CPU optimizers by their names and arguments (offload/integrations/deepspeed_ops.py):
each against its reference (torch's AdamW / Adam / Adagrad, Lion's paper in plain torch) element
by element, as DeepSpeed's own tests use them (non-contiguous params, sparse grads,
``fp32_optimizer_states=False``), and the cases where the shim refuses or differs on purpose."""
from __future__ import annotations

import inspect

import pytest
import torch

import offload
from offload.integrations.deepspeed_ops import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion

SIZES = [1, 7, 17, 4097]  # (SIMD tails)


def _pair(n, dtype=torch.float32, seed=0):
    d = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return torch.nn.Parameter(d.clone()), torch.nn.Parameter(d.clone())


def _run(p, opt, q, ref, steps=5, sparse=False):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if sparse:  # half the rows zero, as an embedding's
            grad[::2] = 0
            grad = grad.to_sparse()
        p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_is_torchs_adamw_or_adam(n, adamw_mode):
    p, q = _pair(n)
    opt = DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    ref = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)([q], lr=1e-2, weight_decay=0.1, foreach=False)
    _run(p, opt, q, ref)
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-6, atol=0)
    assert opt.adam_w_mode is adamw_mode and opt.param_groups[0]["decoupled_weight_decay"] is adamw_mode


def test_cpu_adam_defaults_are_deepspeeds():
    """DeepSpeed's signature, in its order: weight_decay 0 (torch's AdamW: 1e-2), AdamW mode."""
    names = list(inspect.signature(DeepSpeedCPUAdam.__init__).parameters)[1:10]
    assert names == ["model_params", "lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad",
                     "adamw_mode", "fp32_optimizer_states"]
    p, q = _pair(33)
    opt = DeepSpeedCPUAdam([p])
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0)
    opt2 = DeepSpeedCPUAdam([q], 1e-3, False)  # positional bias_correction, as DeepSpeed's callers pass it
    assert opt2.bias_correction is False
    assert isinstance(opt, offload.Adam)


def test_cpu_adam_amsgrad_steps_amsgrad():
    p, q = _pair(4097)
    opt = DeepSpeedCPUAdam([p], lr=1e-2, amsgrad=True)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0, amsgrad=True, foreach=False)
    _run(p, opt, q, ref)
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert "max_exp_avg_sq" in opt.state[p]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_states_where_deepspeed_keeps_them(dtype):
    """fp32_optimizer_states=False: bf16 states for bf16/fp16 params (DeepSpeed's test reads
    their dtype), fp32 for fp32 params; the steps stay within bf16's rounding of fp32 states'."""
    p, q = _pair(1024, dtype)
    low, full = DeepSpeedCPUAdam([p], fp32_optimizer_states=False), DeepSpeedCPUAdam([q])
    _run(p, low, q, full, steps=10)
    assert low.state[p]["exp_avg"].dtype == low.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    assert full.state[q]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p.float().norm(), q.float().norm(), rtol=5e-2, atol=0)
    a, b = _pair(64)
    opt = DeepSpeedCPUAdam([a], fp32_optimizer_states=False)
    _run(a, opt, b, DeepSpeedCPUAdam([b]), steps=1)
    assert opt.state[a]["exp_avg"].dtype == torch.float32


def test_generators_are_read_once():
    """model.parameters() is a generator: its dtypes are read and the optimizer still gets every param."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
    opt = DeepSpeedCPUAdam(model.parameters(), fp32_optimizer_states=False)
    assert len(opt.param_groups[0]["params"]) == 4 and opt.state_dtype == "bfloat16"
    groups = [{"params": (p for p in model[0].parameters()), "lr": 0.1}, {"params": model[1].parameters()}]
    opt = DeepSpeedCPULion(groups, fp32_optimizer_states=False)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2] and opt.param_groups[0]["lr"] == 0.1


def test_refusals_name_the_argument():
    p = torch.nn.Parameter(torch.randn(8))
    b = torch.nn.Parameter(torch.randn(8).bfloat16())
    with pytest.raises(ValueError, match="mix"):
        DeepSpeedCPUAdam([p, b], fp32_optimizer_states=False)
    with pytest.raises(ValueError, match="not both"):
        DeepSpeedCPUAdam([b], fp32_optimizer_states=False, state_dtype="int8")
    with pytest.raises(TypeError, match="fp32_optimizer_states"):
        DeepSpeedCPULion([p], fp32_optimizer_states="no")
    with pytest.raises(TypeError, match="adamw_mode"):
        DeepSpeedCPUAdam([p], adamw_mode=None)
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdagrad([p], amsgrad=True)
    with pytest.raises(ValueError, match="group 1 has bias_correction=False"):
        DeepSpeedCPUAdam([{"params": [p]}, {"params": [b], "bias_correction": False}])
    DeepSpeedCPUAdam([{"params": [p], "bias_correction": True}])  # the same value: as DeepSpeed's
    with pytest.raises(TypeError):  # torch's own errors stand: a tensor, a set of a group's params
        DeepSpeedCPUAdam(p)
    with pytest.raises(TypeError, match="ordered collections"):
        DeepSpeedCPUAdam([{"params": {p}}])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        DeepSpeedCPUAdam([p], lr=-1.0)


@pytest.mark.parametrize("n", SIZES)
def test_cpu_adagrad_is_torchs(n):
    p, q = _pair(n)
    opt, ref = DeepSpeedCPUAdagrad([p], weight_decay=0.1), torch.optim.Adagrad([q], weight_decay=0.1, foreach=False)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["eps"] == 1e-10
    _run(p, opt, q, ref)
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["sum"], ref.state[q]["sum"], rtol=1e-6, atol=0)


def test_cpu_adagrad_non_contiguous_and_sparse():
    """DeepSpeed's two Adagrad cases: a transposed param, and an embedding's sparse grads."""
    initial = torch.randn(6, 5).t()
    p, q = torch.nn.Parameter(initial.clone(memory_format=torch.preserve_format)), torch.nn.Parameter(initial.clone())
    assert not p.is_contiguous()
    opt, ref = DeepSpeedCPUAdagrad([p]), torch.optim.Adagrad([q], foreach=False)
    _run(p, opt, q, ref, steps=3)
    torch.testing.assert_close(p, q)
    torch.testing.assert_close(opt.state[p]["sum"], ref.state[q]["sum"])
    p, q = _pair(64 * 16)
    opt, ref = DeepSpeedCPUAdagrad([p]), torch.optim.Adagrad([q], foreach=False)
    _run(p, opt, q, ref, steps=4, sparse=True)
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", SIZES)
def test_cpu_lion_is_the_papers(n):
    """Lion (arXiv:2302.06675) in plain torch, DeepSpeed's defaults, on a non-contiguous param."""
    initial = torch.randn(n, 3).t()
    p = torch.nn.Parameter(initial.clone(memory_format=torch.preserve_format))
    lr, (b1, b2), wd = 1e-3, (0.9, 0.999), 0.1
    opt = DeepSpeedCPULion([p], weight_decay=wd)
    assert opt.param_groups[0]["lr"] == lr and opt.param_groups[0]["betas"] == (b1, b2)
    ref, m = initial.clone(), torch.zeros_like(initial)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grad = torch.randn(initial.shape, generator=g)
        p.grad = grad.clone()
        opt.step()
        ref.mul_(1 - lr * wd).add_(torch.sign(m * b1 + grad * (1 - b1)), alpha=-lr)
        m.mul_(b2).add_(grad, alpha=1 - b2)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=1e-6, atol=1e-7)


def test_offload_keywords_pass_through(workdir):
    """Every keyword of the offload optimizer it is: states in swap files, clipping."""
    p, q = _pair(4097)
    opt = DeepSpeedCPUAdam([p], lr=1e-2, offload="nvme", swap_dir=str(workdir), max_grad_norm=1.0)
    ref = offload.AdamW([q], lr=1e-2, weight_decay=0, max_grad_norm=1.0)
    _run(p, opt, q, ref)
    assert torch.equal(p, q)
    opt.close()
