"""``differentiable=True`` gives torch's own optimizer ([Note: differentiable steps are
torch's] in offload/optim/differentiable.py): the same steps and states as torch's, autograd
through the update, a warning that nothing is offloaded; offload's options with it, and
subclasses, are refused."""
from __future__ import annotations

import warnings

import pytest
import torch

import offload
import offload.optim.differentiable as differentiable

CASES = [("Adam", dict(lr=0.1, weight_decay=0.1, maximize=True)), ("AdamW", dict(lr=0.1, betas=(0.8, 0.9))),
         ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)), ("Adagrad", dict(lr=0.1, lr_decay=0.01))]


@pytest.fixture(autouse=True)
def _each_warns(monkeypatch):
    monkeypatch.setattr(differentiable, "_warned", set())


def _run(cls, kw, steps=3):
    """params before the steps (leaves), the optimizer, the loss after the steps."""
    w0 = torch.randn(7, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = w0.clone()  # differentiable: the optimizer steps a non-leaf, as torch's tests do
    opt = cls([w], differentiable=True, **kw)
    for s in range(steps):
        x = torch.randn(3, 7, generator=torch.Generator().manual_seed(s))
        w.grad = torch.autograd.grad((x @ w).square().mean(), w, create_graph=True)[0]
        opt.step()
    return w0, w, opt


@pytest.mark.parametrize("name, kw", CASES, ids=[c[0] for c in CASES])
def test_differentiable_steps_are_torchs_with_autograd_through_them(name, kw):
    with pytest.warns(UserWarning, match=rf"offload.{name}\(differentiable=True\) is torch.optim.{name}: .*nothing is offloaded"):
        w0, w, opt = _run(getattr(offload, name), kw)
    assert type(opt) is getattr(torch.optim, name)
    r0, r, ref = _run(getattr(torch.optim, name), kw)
    assert torch.equal(w, r)
    for k, v in ref.state[r].items():
        assert torch.equal(opt.state[w][k], v), k
    g, = torch.autograd.grad(w.sum(), w0)  # through the three updates
    h, = torch.autograd.grad(r.sum(), r0)
    assert torch.equal(g, h) and g.abs().sum() > 0


def test_the_warning_comes_once_per_class():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            offload.AdamW([torch.zeros(2, requires_grad=True).clone()], differentiable=True)
    assert len(caught) == 1


@pytest.mark.parametrize("option", [dict(offload="cpu"), dict(state_dtype="int8"), dict(max_grad_norm=1.0),
                                    dict(num_threads=1), dict(bias_correction=False), dict(backend="numba")])
def test_offload_options_cannot_apply_to_torchs_step(option):
    key = next(iter(option))
    with pytest.raises(NotImplementedError, match=rf"differentiable=True is torch.optim.AdamW's own step .*'{key}' "
                                                  r"cannot apply to it"):
        offload.AdamW([torch.zeros(2)], differentiable=True, **option)


def test_their_defaults_are_no_obstacle():
    opt = offload.Adam([torch.zeros(2)], differentiable=True, offload="none", state_dtype="float32",
                       bias_correction=True, verify=False, stage=0, num_threads=None)
    assert type(opt) is torch.optim.Adam


def test_subclasses_and_lion_keep_their_refusals():
    from offload.integrations.deepspeed_ops import DeepSpeedCPUAdam

    class Mine(offload.AdamW):
        pass

    with pytest.raises(NotImplementedError, match="differentiable=True is not supported"):
        Mine([torch.zeros(2)], differentiable=True)
    with pytest.raises((NotImplementedError, TypeError)):
        DeepSpeedCPUAdam([torch.zeros(2)], differentiable=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'differentiable'"):
        offload.Lion([torch.zeros(2)], differentiable=True)
    assert type(offload.AdamW([torch.zeros(2)], differentiable=False)) is offload.AdamW
