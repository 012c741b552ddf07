"""torch's optimizer database (``optim_db``) for SGD and Adagrad, against offload.SGD /
offload.Adagrad: every error input raises as torch's tests expect, and every configuration
torch tests (on any device; ``differentiable`` refused on purpose) steps like torch's
optimizer (foreach=False) on identical grads, params and states (rtol 1e-5, atol 1e-6), with
the state_dict each keeps. See test_torch_optim_db.py for Adam/AdamW and the harness's why."""
from __future__ import annotations

import pytest
import torch

import offload
from _lazy import lazy_value
from test_rules_optim import _need
from test_torch_optim_db import CO, _expect_error, _device_only_error_inputs, _kwargs_key
from offload.kernels.fields import ADAGRAD, SGD as SGD_RULE

INFOS = lazy_value(lambda: {info.name: info for info in CO.optim_db
                            if info.optim_cls in (torch.optim.SGD, torch.optim.Adagrad)})
OURS = {"SGD": offload.SGD, "Adagrad": offload.Adagrad}
RULES = {"SGD": SGD_RULE, "Adagrad": ADAGRAD}
REFUSED = ("differentiable",)
STEPS = 4
TOL = dict(rtol=1e-5, atol=1e-6)


def _error_inputs(info):
    return info.optim_error_inputs_func(device="cpu", dtype=torch.float32) + _device_only_error_inputs()


@pytest.mark.parametrize("impl", ["torch", "offload"])
@pytest.mark.parametrize("name", sorted(OURS))
def test_error_inputs(name, impl):
    cls = INFOS[name].optim_cls if impl == "torch" else OURS[name]
    inputs = _error_inputs(INFOS[name])
    assert inputs
    for error_input in inputs:
        if error_input.error_type is not Warning and error_input.error_on == CO.OptimizerErrorEnum.STEP_ERROR:
            _need(RULES[name])
        try:
            _expect_error(cls, error_input)
        except BaseException as exc:
            raise AssertionError(f"{impl} {name}: {error_input.optimizer_error_input.desc!r}: {exc}") from exc


def _configs(info):
    out, seen = [], set()
    for device in ("cpu", "cuda", "mps"):
        for oi in info.optim_inputs_func(device, torch.float32):
            kwargs = {k: v for k, v in oi.kwargs.items() if k not in REFUSED}
            if _kwargs_key(kwargs) not in seen:
                seen.add(_kwargs_key(kwargs))
                out.append((oi.desc, kwargs))
    return out


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in [(1,), (7,), (0,), (33, 31), (4099,)]]


@pytest.mark.parametrize("name", sorted(OURS))
def test_every_configuration_matches_torch(name):
    _need(RULES[name])
    configs = _configs(INFOS[name])
    assert len(configs) >= 4
    for desc, kwargs in configs:
        ref_params, ours_params = _params(), _params()
        plain = {k: v for k, v in kwargs.items() if k not in ("foreach", "fused")}
        ref = INFOS[name].optim_cls(ref_params, foreach=False, **plain)
        ours = OURS[name](ours_params, **kwargs)
        gen = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(ours_params, ref_params)):
                g = None if (i == 1 and step == 1) else torch.randn(a.shape, generator=gen)
                a.grad, b.grad = g, None if g is None else g.clone()
            ours.step()
            ref.step()
        osd, rsd = ours.state_dict(), ref.state_dict()
        assert sorted(osd["state"]) == sorted(rsd["state"]), desc
        for i, (a, b) in enumerate(zip(ours_params, ref_params)):
            torch.testing.assert_close(a.detach(), b.detach(), **TOL, msg=lambda m: f"{desc}: param {i}: {m}")
            if i in rsd["state"]:
                assert set(osd["state"][i]) == set(rsd["state"][i]), (desc, i)
                for key, want in rsd["state"][i].items():
                    torch.testing.assert_close(osd["state"][i][key], want, **TOL, msg=lambda m: f"{desc} {key}: {m}")
