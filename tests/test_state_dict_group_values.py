"""``load_state_dict`` runs each loaded group through the optimizer's constructor checks
(``check_group``): a dict whose group holds ``lr=None`` or ``betas=[]`` is refused, naming the
group, and nothing changes. torch's own load takes such a group and its step fails; here the
step failed too, after the states had been replaced. The flags that only choose torch's code
path (foreach, fused) and those the load sets to False with a warning (capturable,
differentiable) do not make a dict refused."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import offload


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (4099, 17)]


def _step(opt, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


MAKE = {
    "adamw": (lambda ps, **k: offload.AdamW(ps, lr=1e-2, **k), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    "sgd": (lambda ps, **k: offload.SGD(ps, lr=1e-2, momentum=0.9, **k), lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
    "adagrad": (lambda ps, **k: offload.Adagrad(ps, lr=1e-2, **k), lambda ps: torch.optim.Adagrad(ps, lr=1e-2)),
    "lion": (lambda ps, **k: offload.Lion(ps, lr=1e-3, **k), None),
}


@pytest.mark.parametrize("name, key, value, match", [
    ("adamw", "lr", None, "lr must be"),
    ("adamw", "betas", [], "betas must be a pair"),
    ("adamw", "eps", "x", "eps must be"),
    ("adamw", "weight_decay", float("nan"), "Invalid weight_decay value: nan"),
    ("adamw", "amsgrad", 0, "amsgrad must be True or False, got int 0"),
    ("sgd", "momentum", "x", "momentum must be"),
    ("sgd", "lr", -1.0, "Invalid learning rate: -1.0"),
    ("adagrad", "lr_decay", [], "lr_decay must be"),
    ("lion", "betas", (0.9, 1.5), r"Invalid beta parameter at index 1: 1.5"),
])
@pytest.mark.parametrize("offl", ["none", "nvme"])
@pytest.mark.parametrize("source", ["ours", "torch"])
def test_a_group_the_constructor_refuses_is_refused_by_the_load(workdir, name, key, value, match, offl, source):
    ours, theirs = MAKE[name]
    if source == "torch" and theirs is None:
        pytest.skip("torch has no Lion")
    src = _params()
    other = theirs(src) if source == "torch" else ours(src)
    _step(other, src)
    sd = copy.deepcopy(other.state_dict())
    sd["param_groups"][0][key] = value
    kw = dict(offload="nvme", swap_dir=str(workdir)) if offl == "nvme" else {}
    ps = _params(1)
    opt = ours(ps, **kw)
    _step(opt, ps, 2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=f"load_state_dict: param group 0: {match}"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    _step(opt, ps, 3)  # and it steps on
    opt.close()


def test_flags_that_pick_torchs_code_path_still_load():
    src = _params()
    torch_opt = torch.optim.AdamW(src, lr=torch.tensor(0.01), foreach=False)
    _step(torch_opt, src)
    sd = copy.deepcopy(torch_opt.state_dict())
    sd["param_groups"][0].update(foreach=True, differentiable=True, fused=None)
    ps = _params(1)
    opt = offload.AdamW(ps, lr=1e-2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.load_state_dict(sd)
    assert any("differentiable=True" in str(x.message) for x in w)
    g = opt.param_groups[0]
    assert g["foreach"] is True and g["differentiable"] is False and torch.is_tensor(g["lr"])
    _step(opt, ps)
    opt.close()


@pytest.mark.parametrize("name", ["adamw", "sgd", "adagrad", "lion"])
@pytest.mark.parametrize("offl", ["none", "nvme", "flat"])
def test_a_group_added_with_a_value_the_constructor_refuses_is_refused(workdir, name, offl):
    # torch's add_param_group takes {"lr": "x"} (its step fails); here the step failed too
    ours = MAKE[name][0]
    kw = dict(offload="nvme", swap_dir=str(workdir)) if offl == "nvme" else dict(stage=2) if offl == "flat" else {}
    ps = _params()
    opt = ours(ps, **kw)
    _step(opt, ps)
    with pytest.raises(TypeError, match=r"param group 1: lr must be a float or a 1-element Tensor, got str 'x'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(5))], "lr": "x"})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"param group 1: Invalid learning rate: -1.0"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(5))], "lr": -1.0})
    _step(opt, ps, 2)
    opt.close()


def test_a_group_given_to_the_constructor_is_checked_as_its_defaults_are():
    # (torch checks only the keyword arguments: a group's own lr=None failed at the first step)
    with pytest.raises(TypeError, match=r"param group 1: lr must be a float or a 1-element Tensor, got NoneType"):
        offload.AdamW([{"params": _params()}, {"params": _params(1), "lr": None}], lr=1e-2)
    with pytest.raises(ValueError, match=r"param group 0: Invalid momentum value: -0.5"):
        offload.SGD([{"params": _params(), "momentum": -0.5}], lr=1e-2)
