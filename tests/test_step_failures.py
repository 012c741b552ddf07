"""Failed steps (issue 13, section 2): bad grads and changed params are refused before
anything changes; a Ctrl-C waits for the step to be whole; any other failure puts the
optimizer in a stated failed state that a public call leaves (see [Note: failed steps] in
offload/optim/step_guard.py). Reference: torch's AdamW on the same grads."""
from __future__ import annotations

import os
import signal
import types

import pytest
import torch
import torch.nn as nn

import offload
from offload.kernels._rule_step import RuleStepFace
from offload.swap import SwapStepError
from test_swap_util import faulty_swap_engines
import _internals as internals

SIZES = [(3000,), (7,), (40, 60), (1,), (2500,)]
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
STORES = ["none", "nvme", "bf16", "bf16-nvme"]


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SIZES]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _opt(kind, tmp_path, params=None):
    dtype = torch.bfloat16 if kind.startswith("bf16") else torch.float32
    params = params if params is not None else _params(dtype)
    (tmp_path / "swap").mkdir(exist_ok=True)
    offload_kw = {"offload": "nvme", "swap_dir": str(tmp_path / "swap"), "sub_group_size": 1024,
                  "max_host_bytes": 1 << 20} if kind.endswith("nvme") else {"offload": "none"}
    return params, offload.AdamW(params, **HP, **offload_kw)


class _Torch:
    """torch's AdamW stepped on the same grads: the reference."""

    def __init__(self, params):
        self.dtype = params[0].dtype
        self.params = [nn.Parameter(p.detach().float().clone()) for p in params]
        self.opt = torch.optim.AdamW(self.params, **HP, foreach=False)

    def step(self, step):
        _grads(self.params, step)
        for p in self.params:  # the grads the optimizer under test got, rounded to its dtype
            p.grad = p.grad.to(self.dtype).float()
        self.opt.step()


def _close_to(params, ref):
    for p, q in zip(params, ref.params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.fixture
def swap_engines(monkeypatch):
    return faulty_swap_engines(monkeypatch)


def _inject(engines, op, fail_at):
    """The (one) optimizer's swap engine, failing the ``fail_at``-th batch of ``op`` from now."""
    assert len(engines) == 1, f"{len(engines)} swap engines opened: which one fails is unclear"
    faulty = engines[0]
    faulty.op = op
    faulty.arm(fail_at)
    return faulty


def _train(opt, params, ref, start, stop):
    for s in range(start, stop):
        _grads(params, s)
        opt.step()
        if ref is not None:
            ref.step(s)


def _steps(opt, params):
    return [int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0 for p in params]


# ---------------------------------------------------------------------- item 1: nvme I/O failure
def test_failed_nvme_step_is_stated_and_clear_failure_checks_the_params(tmp_path, swap_engines):
    params, opt = _opt("nvme", tmp_path)
    ref = _Torch(params)
    _train(opt, params, ref, 0, 2)
    saved = [p.detach().clone() for p in params]
    _inject(swap_engines, "write", 2)
    _grads(params, 2)
    with pytest.raises(SwapStepError) as e:
        opt.step()
    msg = str(e.value)
    assert msg.count("[Errno") == 1 and msg.count(internals.swap_path(opt)) <= 2, msg  # no "[Errno 5] [Errno 5]"
    assert "clear_failure" in msg and "still hold step 2" in msg
    assert _steps(opt, params) == [2] * len(params)
    assert any(not torch.equal(p, q) for p, q in zip(params, saved))  # half-updated in place: stated
    with pytest.raises(RuntimeError, match="failed state.*clear_failure"):
        opt.step()
    with pytest.raises(ValueError, match="not those of step 2"):
        opt.clear_failure()
    with torch.no_grad():
        for p, q in zip(params, saved):
            p.copy_(q)
    opt.clear_failure()
    _train(opt, params, ref, 2, 5)  # the same step retried, then more
    _close_to(params, ref)
    assert _steps(opt, params) == [5] * len(params)
    opt.close()


def test_accept_params_goes_on_from_the_params_as_they_are(tmp_path, swap_engines):
    params, opt = _opt("nvme", tmp_path)
    _train(opt, params, None, 0, 2)
    _inject(swap_engines, "read", 3)
    _grads(params, 2)
    with pytest.raises(SwapStepError):
        opt.step()
    opt.clear_failure(accept_params=True)
    _train(opt, params, None, 2, 4)
    assert _steps(opt, params) == [4] * len(params)
    # the swap directory agrees with the params: a resume in the same process accepts them
    opt.close(keep_swap=True)
    opt2 = offload.AdamW(params, **HP, offload="nvme", swap_dir=str(tmp_path / "swap"), sub_group_size=1024,
                         max_host_bytes=1 << 20, resume=True)
    assert _steps(opt2, params) == [4] * len(params)
    opt2.close()


def test_close_keep_swap_then_resume_in_the_same_process(tmp_path, swap_engines):
    params, opt = _opt("nvme", tmp_path)
    ref = _Torch(params)
    _train(opt, params, ref, 0, 2)
    saved = [p.detach().clone() for p in params]
    _inject(swap_engines, "write", 3)
    _grads(params, 2)
    with pytest.raises(SwapStepError):
        opt.step()
    opt.close(keep_swap=True)
    with torch.no_grad():
        for p, q in zip(params, saved):
            p.copy_(q)
    opt2 = offload.AdamW(params, **HP, offload="nvme", swap_dir=str(tmp_path / "swap"), sub_group_size=1024,
                         max_host_bytes=1 << 20, resume=True)
    _train(opt2, params, ref, 2, 4)
    _close_to(params, ref)
    opt2.close()
    assert os.listdir(tmp_path / "swap") == []


def test_keep_swap_needs_nvme(tmp_path):
    _, opt = _opt("none", tmp_path)
    with pytest.raises(ValueError, match=r"keep_swap=True\) needs offload='nvme'"):
        opt.close(keep_swap=True)


# ---------------------------------------------------------------------- item 2: checked before any change
def _snapshot(opt, params):
    return [p.detach().clone() for p in params], _steps(opt, params), opt.state_dict()["state"]


def _unchanged(opt, params, snap):
    ps, steps, state = snap
    assert all(torch.equal(p, q) for p, q in zip(params, ps))
    assert _steps(opt, params) == steps
    now = opt.state_dict()["state"]
    assert sorted(now) == sorted(state)
    for k in state:
        for key in state[k]:
            assert torch.equal(now[k][key], state[k][key]), (k, key)


@pytest.mark.parametrize("kind", STORES)
def test_grad_of_another_dtype_is_refused_before_any_change(tmp_path, kind):
    params, opt = _opt(kind, tmp_path)
    _train(opt, params, None, 0, 2)
    snap = _snapshot(opt, params)
    _grads(params, 2)
    params[3].grad.data = params[3].grad.data.double()  # after three params that would step first
    with pytest.raises(TypeError, match="param 3: grad is float64"):
        opt.step()
    _unchanged(opt, params, snap)
    _grads(params, 2)
    opt.step()  # not a failed state: the step simply did not start
    assert _steps(opt, params) == [3] * len(params)
    opt.close()


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("change", ["dtype", "size"])
def test_param_changed_after_construction_is_refused_before_any_change(tmp_path, kind, change):
    params, opt = _opt(kind, tmp_path)
    _train(opt, params, None, 0, 2)
    snap = _snapshot(opt, params)
    old = params[4].data
    params[4].data = old.double() if change == "dtype" else torch.zeros(old.numel() + 1, dtype=old.dtype)
    _grads(params, 2)
    with pytest.raises(ValueError, match="param 4 was registered as .* and is now"):
        opt.step()
    params[4].data = old
    _unchanged(opt, params, snap)
    opt.close()


# ---------------------------------------------------------------------- item 2: Ctrl-C and other exceptions
class _Kernel:
    """The store's kernel, sending ``signals`` SIGINTs to this process from its ``at``-th call
    (or raising ``exc`` there)."""

    def __init__(self, inner, at, signals=1, exc=None):
        self.inner, self.at, self.signals, self.exc, self.calls = inner, at, signals, exc, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _call(self):
        self.calls += 1
        if self.calls == self.at:
            if self.exc is not None:
                raise self.exc
            for _ in range(self.signals):
                os.kill(os.getpid(), signal.SIGINT)

    def adam_step(self, *a, **kw):
        self._call()
        return self.inner.adam_step(*a, **kw)

    def rule_step(self, *a, **kw):  # the faces offload.optim.functional calls
        self._call()
        return self.inner.rule_step(*a, **kw)

    def checked_rule_step(self, *a, **kw):
        self._call()
        return self.inner.checked_rule_step(*a, **kw)

    def checked_rule_steps(self, rule, entries, hyper, num_threads=None):
        # one call per tensor, as the default face steps a batch (the native backend's one
        # call cannot fail half-way): the injected failure lands in the middle of the batch
        return RuleStepFace.checked_rule_steps(self, rule, entries, hyper, num_threads)


def _patch_kernel(monkeypatch, opt, kernel_factory):
    """Wrap the kernel backend every store of ``opt`` steps with (the backend object is shared:
    stores keep it, so patching its methods reaches them all); monkeypatch.undo() unwraps it."""
    from offload.kernels import get_backend

    backend = get_backend(opt.backend)
    inner = types.SimpleNamespace(adam_step=backend.adam_step, rule_step=backend.rule_step,
                                  checked_rule_step=backend.checked_rule_step)
    wrapped = kernel_factory(inner)
    monkeypatch.setattr(backend, "adam_step", wrapped.adam_step)
    monkeypatch.setattr(backend, "rule_step", wrapped.rule_step)
    monkeypatch.setattr(backend, "checked_rule_step", wrapped.checked_rule_step)
    monkeypatch.setattr(backend, "checked_rule_steps", wrapped.checked_rule_steps)
    return wrapped


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test: a suite started in the background by a shell
    without job control inherits SIGINT ignored, and the step guard leaves an ignored SIGINT
    ignored, as it should, so the Ctrl-C tests would see no KeyboardInterrupt there."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("kind", ["none", "nvme", "bf16-nvme"])
@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_lands_after_the_step_is_whole(tmp_path, monkeypatch, kind):
    params, opt = _opt(kind, tmp_path)
    ref = _Torch(params)
    _train(opt, params, ref, 0, 2)
    _patch_kernel(monkeypatch, opt, lambda k: _Kernel(k, at=2))
    _grads(params, 2)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    ref.step(2)
    assert _steps(opt, params) == [3] * len(params)  # the whole step, once
    monkeypatch.undo()
    _train(opt, params, ref, 3, 5)
    for p, q in zip(params, ref.params):  # bf16 params: their fp32 masters
        got = p if p.dtype == torch.float32 else internals.master(opt, p)
        torch.testing.assert_close(got.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    opt.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.usefixtures("sigint_raises")
def test_a_child_forked_during_a_held_ctrl_c_gets_pythons_handler():
    """A thread forks while the main thread's step holds Ctrl-C: the child inherits the
    hold's handler but not the block that restores Python's; without the fork hook its first
    Ctrl-C was swallowed."""
    import threading

    from offload.swap.sigint import sigint_held

    status = []

    def fork_and_wait():
        pid = os.fork()
        if pid == 0:  # the child: only this thread; Python's handler must be back
            try:
                os._exit(0 if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 3)
            finally:
                os._exit(4)
        status.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

    with sigint_held():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        t = threading.Thread(target=fork_and_wait)
        t.start()
        t.join(60)
    assert status == [0], "the forked child kept the hold's SIGINT handler"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("sigint_raises")
def test_second_ctrl_c_interrupts_at_once_and_is_a_failed_step(tmp_path, monkeypatch):
    params, opt = _opt("nvme", tmp_path)
    _train(opt, params, None, 0, 2)
    saved = [p.detach().clone() for p in params]
    _patch_kernel(monkeypatch, opt, lambda k: _Kernel(k, at=3, signals=2))
    _grads(params, 2)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert _steps(opt, params) == [2] * len(params)
    with pytest.raises(RuntimeError, match="failed state"):
        opt.step()
    with torch.no_grad():
        for p, q in zip(params, saved):
            p.copy_(q)
    opt.clear_failure()
    monkeypatch.undo()
    _grads(params, 2)
    opt.step()
    opt.close()


@pytest.mark.parametrize("kind", ["none", "nvme"])
def test_an_exception_in_the_middle_of_a_step_is_a_failed_step(tmp_path, monkeypatch, kind):
    params, opt = _opt(kind, tmp_path)
    _train(opt, params, None, 0, 2)
    _patch_kernel(monkeypatch, opt, lambda k: _Kernel(k, at=3, exc=MemoryError("injected")))
    _grads(params, 2)
    with pytest.raises(MemoryError):
        opt.step()
    monkeypatch.undo()
    assert _steps(opt, params) == [2] * len(params)
    with pytest.raises(RuntimeError, match="failed state.*MemoryError"):
        opt.step()  # never a silent second application of the sub-groups already stepped
    if kind == "none":
        with pytest.raises(ValueError, match="accept_params=True"):
            opt.clear_failure()
    opt.clear_failure(accept_params=True)
    opt.step()
    assert _steps(opt, params) == [3] * len(params)
    opt.close()


def test_load_state_dict_ends_the_failed_state(tmp_path, monkeypatch):
    params, opt = _opt("none", tmp_path)
    _train(opt, params, None, 0, 2)
    sd = {"state": {k: dict(v) for k, v in opt.state_dict()["state"].items()},
          "param_groups": opt.state_dict()["param_groups"]}
    sd = __import__("copy").deepcopy(sd)
    _patch_kernel(monkeypatch, opt, lambda k: _Kernel(k, at=2, exc=MemoryError("injected")))
    _grads(params, 2)
    with pytest.raises(MemoryError):
        opt.step()
    monkeypatch.undo()
    opt.load_state_dict(sd)
    opt.step()
    assert _steps(opt, params) == [3] * len(params)
