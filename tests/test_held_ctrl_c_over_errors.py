"""A Ctrl-C held by a block that then raises an error (offload/swap/sigint.py sigint_held):
the KeyboardInterrupt used to be dropped, and a loop that caught the block's error (a retry
after a failed step, a load's refusal) went on as if no Ctrl-C came. It is raised now, the
block's error chained as its context; over a SystemExit the process is stopping anyway."""
import os
import signal

import pytest
import torch

import offload
from offload.optim import base
from offload.swap.sigint import sigint_held


@pytest.fixture
def sigint_raises():
    """Python's own handler (a suite started in the background inherits SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("sigint_raises")
def test_a_held_ctrl_c_is_raised_over_the_blocks_error():
    with pytest.raises(KeyboardInterrupt) as got:
        with sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError(5, "Input/output error")
    assert isinstance(got.value.__context__, OSError) and got.value.__context__.errno == 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("sigint_raises")
def test_without_a_ctrl_c_the_blocks_error_is_raised_as_it_is():
    with pytest.raises(ValueError, match="bad"):
        with sigint_held():
            raise ValueError("bad")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("sigint_raises")
def test_a_stopping_process_is_not_turned_into_a_ctrl_c():
    with pytest.raises(SystemExit):
        with sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise SystemExit(143)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (17, 4097)]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("kind", ["none", "nvme"])
@pytest.mark.usefixtures("sigint_raises")
def test_a_step_that_fails_after_a_ctrl_c_raises_the_ctrl_c(tmp_path, monkeypatch, kind):
    params = _params()
    kw = {"offload": "nvme", "swap_dir": str(tmp_path)} if kind == "nvme" else {"offload": kind}
    opt = offload.AdamW(params, lr=1e-2, **kw)
    _grads(params, 1)
    opt.step()
    from offload.kernels import get_backend

    backend = get_backend(opt.backend)

    def failing(*a, **k):  # the kernel: a Ctrl-C comes, then the step fails
        os.kill(os.getpid(), signal.SIGINT)
        raise OSError(5, "Input/output error")
    for face in ("adam_step", "rule_step", "checked_rule_step", "checked_rule_steps"):
        monkeypatch.setattr(backend, face, failing)
    _grads(params, 2)
    with pytest.raises(KeyboardInterrupt) as got:
        opt.step()
    assert isinstance(got.value.__context__, OSError)
    monkeypatch.undo()
    opt.close()


@pytest.mark.usefixtures("sigint_raises")
def test_a_refused_load_with_a_held_ctrl_c_leaves_no_failed_state(monkeypatch):
    """The load raised its own error (all or nothing: nothing changed); the held Ctrl-C is
    raised over it, but the optimizer is not in the failed state a second Ctrl-C (which cuts a
    load short) leaves."""
    params = _params()
    opt = offload.AdamW(params, lr=1e-2)
    _grads(params, 1)
    opt.step()
    sd = opt.state_dict()

    def refused(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        raise ValueError("the dict is refused")
    monkeypatch.setattr(base, "load_state_dict_into", refused)
    with pytest.raises(KeyboardInterrupt) as got:
        opt.load_state_dict(sd)
    assert isinstance(got.value.__context__, ValueError)
    monkeypatch.undo()
    _grads(params, 2)
    opt.step()  # not refused: no failed state
    opt.load_state_dict(sd)
