"""offload.Lion loads lion-pytorch's state_dict layout (exp_avg, no "step", no "maximize") and goes
on with lion-pytorch's update from the loaded momentum."""
import copy

import pytest
import torch

import offload


def _lion_pytorch_step(p, g, m, lr, wd, b1, b2):  # lion_pytorch.lion_pytorch.update_fn
    p.mul_(1.0 - lr * wd)
    p.add_(m.clone().mul_(b1).add(g, alpha=1.0 - b1).sign_(), alpha=-lr)
    m.mul_(b2).add_(g, alpha=1.0 - b2)


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_lion_loads_lion_pytorch_state_dict(state_dtype):
    torch.manual_seed(0)
    init, m0, g = torch.randn(17), torch.randn(17), torch.randn(17)
    sd = {"state": {0: {"exp_avg": m0.clone()}},
          "param_groups": [{"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "params": [0]}]}
    p = torch.nn.Parameter(init.clone())
    opt = offload.Lion([p], lr=1.0, state_dtype=state_dtype)
    opt.load_state_dict(copy.deepcopy(sd))
    p.grad = g.clone()
    opt.step()
    ref, m = init.clone(), m0.clone()
    _lion_pytorch_step(ref, g, m, 1e-2, 0.1, 0.9, 0.99)
    assert torch.equal(p.detach(), ref)   # a param under 4096 elements keeps float32 states
    torch.testing.assert_close(opt.state_dict()["state"][0]["exp_avg"], m, rtol=1e-6, atol=1e-7)


def test_lion_refuses_decoupled_weight_decay_group():
    p = torch.nn.Parameter(torch.randn(7))
    opt = offload.Lion([p])
    sd = {"state": {}, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.1,
                                         "decoupled_weight_decay": True, "params": [0]}]}
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        opt.load_state_dict(sd)


def test_lion_refuses_decoupled_group_given_added_or_set():
    """The constructor, add_param_group and the step refuse it too (they took it and stepped it
    as lr * weight_decay, 1/lr times lion-pytorch's decay), with nothing changed."""
    p, q = torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        offload.Lion([{"params": [p], "decoupled_weight_decay": True}], weight_decay=0.1)
    opt = offload.Lion([p], weight_decay=0.1)
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        opt.add_param_group({"params": [q], "decoupled_weight_decay": True})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["decoupled_weight_decay"] = True
    p.grad, before = torch.randn(7), p.detach().clone()
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        opt.step()
    assert torch.equal(p.detach(), before)
    opt.param_groups[0]["decoupled_weight_decay"] = False
    opt.step()
    assert not torch.equal(p.detach(), before)


@pytest.mark.parametrize("stage", [0, 1])
def test_lion_reloads_its_own_state_dict_after_a_load(stage):
    """torch's __setstate__ (each load_state_dict) adds "differentiable" to Lion's defaults
    alone; the next load of its own state_dict was refused ("param group 0 has no
    'differentiable'", forty-eighth session's 2-rank history fuzz)."""
    ps = [torch.nn.Parameter(torch.randn(7)) for _ in range(2)]
    a = offload.Lion(ps, lr=1e-3, offload="cpu", stage=stage)
    for p in ps:
        p.grad = torch.randn(7)
    a.step()
    b = offload.Lion(ps, lr=1e-3, offload="cpu", stage=stage)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    b.step()
    want = copy.deepcopy(b.state_dict())
    b.load_state_dict(copy.deepcopy(want))
    assert torch.equal(b.state_dict()["state"][0]["exp_avg"], want["state"][0]["exp_avg"])
    a.close()
    b.close()
