"""offload.SGD / Adagrad take torch's arguments and refuse bad ones as torch does: the same
exception type and message (compared with torch's own, not copied); Lion's checks in
torch's words; signatures and defaults as torch's (SGD, Adagrad) and lion-pytorch's (Lion)."""
import inspect

import pytest
import torch

import offload

BAD = {
    "SGD": [dict(lr=-0.1), dict(momentum=-0.5), dict(weight_decay=-1.0), dict(nesterov=True),
            dict(nesterov=True, momentum=0.9, dampening=0.1), dict(lr=torch.tensor([0.1, 0.2])),
            dict(fused=True, foreach=True), dict(fused=True, differentiable=True)],
    "Adagrad": [dict(lr=-0.1), dict(lr_decay=-0.1), dict(weight_decay=-1.0),
                dict(initial_accumulator_value=-1.0), dict(eps=-1e-10), dict(fused=True, foreach=True)],
}


@pytest.mark.parametrize("name, kwargs", [(n, k) for n, ks in BAD.items() for k in ks])
def test_bad_arguments_as_torch(name, kwargs):
    with pytest.raises(Exception) as theirs:
        getattr(torch.optim, name)([torch.zeros(3, requires_grad=True)], **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        getattr(offload, name)([torch.zeros(3, requires_grad=True)], **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("name", ["SGD", "Adagrad"])
def test_signature_and_defaults_as_torch(name):
    theirs = inspect.signature(getattr(torch.optim, name).__init__).parameters
    ours = inspect.signature(getattr(offload, name).__init__).parameters
    for key, param in theirs.items():
        assert key in ours, key
        assert ours[key].default == param.default, key
        assert ours[key].kind == param.kind, key
    p = torch.zeros(3)
    assert getattr(offload, name)([p]).defaults == getattr(torch.optim, name)([p]).defaults


def test_differentiable_is_torchs_own_optimizer():
    # (offload/optim/differentiable.py: [Note: differentiable steps are torch's])
    with pytest.warns(UserWarning, match=r"differentiable=True\) is torch.optim.SGD"):
        opt = offload.SGD([torch.zeros(3)], differentiable=True)
    assert type(opt) is torch.optim.SGD and opt.defaults["differentiable"] is True


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1.0), "Invalid learning rate: -1.0"),
    (dict(betas=(1.5, 0.99)), "Invalid beta parameter at index 0: 1.5"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (dict(betas=0.9), "betas must be a pair"),
])
def test_lion_checks(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        offload.Lion([torch.zeros(3)], **kwargs)


def test_lion_defaults_are_lion_pytorch_s():
    opt = offload.Lion([torch.zeros(3)])
    assert opt.defaults == dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False)


def test_sgd_state_layout_is_torch_s():
    """No "step", and no state without momentum, as torch.optim.SGD's state_dict."""
    for momentum in (0.0, 0.9):
        p, q = torch.ones(3), torch.ones(3)
        ours = offload.SGD([p], lr=0.1, momentum=momentum, backend="torch")  # the layout, not the kernel
        theirs = torch.optim.SGD([q], lr=0.1, momentum=momentum)
        p.grad, q.grad = torch.ones(3), torch.ones(3)
        ours.step()
        theirs.step()
        a, b = ours.state_dict()["state"], theirs.state_dict()["state"]
        assert a.keys() == b.keys() and all(a[k].keys() == b[k].keys() for k in a)
        assert bool(a) == (momentum != 0)


def test_adagrad_state_exists_before_the_first_step_as_torch():
    p, q = torch.ones(3), torch.ones(3)
    ours = offload.Adagrad([p], initial_accumulator_value=0.5)
    theirs = torch.optim.Adagrad([q], initial_accumulator_value=0.5)
    a, b = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert a.keys() == b.keys() and list(a[0]) == list(b[0])
    assert torch.equal(a[0]["sum"], b[0]["sum"]) and float(a[0]["step"]) == 0.0


def test_flat_store_refuses_momentum_set_after_construction():
    """bf16 params (the flat store) of an SGD without momentum keep no buffer: a momentum set
    later is refused at the step, before anything changes, with the reason."""
    p = torch.ones(5, dtype=torch.bfloat16)
    opt = offload.SGD([p], lr=0.1, backend="torch")
    p.grad = torch.ones(5, dtype=torch.bfloat16)
    opt.step()
    before = p.clone()
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match="a group now needs rule 'sgd'.*the store keeps the states of rule 'sgd_plain'"):
        opt.step()
    assert torch.equal(p, before)
    opt.param_groups[0]["momentum"] = 0.0  # refused before any change: not a failed step
    opt.step()
    assert not torch.equal(p, before)
    opt.close()


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_an_unknown_keyword_is_torchs_type_error_naming_the_class(name):
    # the base class's __init__ took the offload options, so Python named it ("RuleOptimizer")
    with pytest.raises(TypeError) as theirs:
        getattr(torch.optim, name)([torch.zeros(3, requires_grad=True)], foo=1)
    with pytest.raises(TypeError) as ours:
        getattr(offload, name)([torch.zeros(3, requires_grad=True)], foo=1)
    assert str(ours.value) == str(theirs.value) == f"{name}.__init__() got an unexpected keyword argument 'foo'"


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Adagrad", "Lion"])
@pytest.mark.parametrize("typo, meant", [("swapdir", "swap_dir"), ("max_host_byte", "max_host_bytes"),
                                         ("weight_decy", "weight_decay")])
def test_a_misspelt_keyword_names_the_one_meant(name, typo, meant):
    with pytest.raises(TypeError, match=rf"^{name}\.__init__\(\) got an unexpected keyword argument '{typo}'; "
                                        rf"did you mean '{meant}'\?$"):
        getattr(offload, name)([torch.zeros(3, requires_grad=True)], **{typo: 1})
