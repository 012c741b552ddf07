"""torch.distributed.checkpoint's state_dict helpers (``get_optimizer_state_dict`` /
``set_optimizer_state_dict``, what FSDP2 / torchtitan users call) on offload's optimizers.

Their dicts differ from ``opt.state_dict()`` in two ways that reached our load:
- the param ids are FQNs ("0.weight"), not 0..n-1: the flat store paired a loaded
  ``master`` (bf16 params) with its param by index, found none, and rebuilt the masters from
  the bf16 params (the next steps drifted from an uninterrupted run);
- with ``flatten_optimizer_state_dict=True`` each entry is rebuilt from the keys of
  ``opt.state[p]``: a key there that the saved dict lacks comes back as ``{}`` (our SGD keeps
  a "step" that torch's SGD layout drops: the load refused it), and a state not listed there
  was dropped: the load started it afresh under the loaded step count, silently
  (``offload="nvme"`` lists its swapped states now, and an fp16/bf16 param's entry its fp32
  ``master``: [Note: the master in opt.state] in offload/optim/state_view.py; before, the
  master was rebuilt from the rounded param and the resumed run drifted).

Each check trains an uninterrupted optimizer and one resumed through the helpers on the same
grads and compares the params element by element.
"""
from __future__ import annotations

import copy

import pytest
import torch

import _torch_compat
import offload
from _lazy import lazy_import

dcp_sd = lazy_import("torch.distributed.checkpoint.state_dict")  # on first use: tests/_lazy.py


def _flat():
    return dcp_sd.StateDictOptions(flatten_optimizer_state_dict=True)


# torch 2.6's unflatten looks up every key opt.state[p] lists: our SGD's "step", which its
# torch-layout dict leaves out, is a KeyError there (README, torch row). Later releases
# rebuild a missing key.
# (a string condition: evaluated when the test runs, so collection does not import DCP)
SGD_FLAT_GAP = pytest.mark.xfail("not _torch_compat.dcp_unflatten_tolerates_missing_keys()", raises=KeyError,
                                 strict=True, reason="torch 2.6's DCP unflatten and SGD's 'step' (README)")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(dtype)


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        model(torch.randn(4, 7, generator=gen).to(dtype)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _make(cls, kw, dtype, tmp_path, tag):
    model = _model(dtype)
    extra = {}
    if kw.get("offload") == "nvme":
        (tmp_path / tag).mkdir(exist_ok=True)
        extra = {"swap_dir": str(tmp_path / tag)}
    opt = cls(model.parameters(), **{**kw, **extra})
    return model, opt


def _resumed(cls, kw, tmp_path, dtype=torch.float32, options=None):
    """(uninterrupted model, resumed model) after 3 steps, a save and a load through the
    helpers into a new optimizer, and 3 more steps each."""
    model, opt = _make(cls, kw, dtype, tmp_path, "a")
    _train(model, opt, 3, 1)
    saved = copy.deepcopy(dcp_sd.get_optimizer_state_dict(model, opt, options=options))
    model2, opt2 = _make(cls, kw, dtype, tmp_path, "b")
    model2.load_state_dict(model.state_dict())
    dcp_sd.set_optimizer_state_dict(model2, opt2, saved, options=options)
    _train(model, opt, 3, 2)
    _train(model2, opt2, 3, 2)
    opt.close()
    opt2.close()
    return model, model2


def _same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("offload_to", ["none", "nvme"])
def test_bf16_params_keep_their_masters_through_fqn_keys(workdir, offload_to):
    tmp_path = workdir
    kw = dict(lr=1e-2, weight_decay=0.1, offload=offload_to)
    _same_params(*_resumed(offload.AdamW, kw, tmp_path, dtype=torch.bfloat16))


@pytest.mark.parametrize("offload_to", ["none", "cpu", "nvme"])
def test_bf16_masters_through_flattened_dict(workdir, offload_to):
    """The resumed run is the uninterrupted one bit for bit: the master came back too."""
    kw = dict(lr=1e-2, weight_decay=0.1, offload=offload_to)
    model, model2 = _resumed(offload.AdamW, kw, workdir, dtype=torch.bfloat16, options=_flat())
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(q, p), name


@pytest.mark.parametrize("offload_to", ["none", "cpu"])
@SGD_FLAT_GAP
def test_sgd_flattened_dict_loads(tmp_path, offload_to):
    kw = dict(lr=1e-2, momentum=0.9, weight_decay=0.1, offload=offload_to)
    _same_params(*_resumed(offload.SGD, kw, tmp_path, options=_flat()))


@pytest.mark.parametrize("cls,kw", [(offload.AdamW, dict(lr=1e-2, weight_decay=0.1)), (offload.Adagrad, dict(lr=1e-2)),
                                    (offload.SGD, dict(lr=1e-2, momentum=0.9))])
def test_nvme_flattened_dict_loads(workdir, cls, kw):
    """nvme: opt.state[p] lists the swapped states (read on access), so the flattened dict
    carries them; before, it lost them and the load started them afresh, silently."""
    if cls is offload.SGD and not _torch_compat.dcp_unflatten_tolerates_missing_keys():
        with pytest.raises(KeyError, match="step"):  # torch 2.6's DCP unflatten (SGD_FLAT_GAP)
            _resumed(cls, dict(kw, offload="nvme"), workdir, options=_flat())
        return
    _same_params(*_resumed(cls, dict(kw, offload="nvme"), workdir, options=_flat()))


@pytest.mark.parametrize("cls,kw", [(offload.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                    (offload.SGD, dict(lr=1e-2, momentum=0.9))])
def test_nvme_unflattened_dict_loads(workdir, cls, kw):
    """The same flows without flattening keep every state (the supported way with nvme)."""
    _same_params(*_resumed(cls, dict(kw, offload="nvme"), workdir))


def test_bare_step_refused_by_plain_load():
    """The check is the load's: a hand-made entry with a step and no moments for a param
    whose moments the optimizer holds (torch's Adam fails on it at its next step) is refused
    before anything is loaded; one for a param without state yet loads as before."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = offload.AdamW([p], lr=1e-2)
    sd = {"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": copy.deepcopy(opt.state_dict()["param_groups"])}
    opt.load_state_dict(copy.deepcopy(sd))  # nothing held yet: nothing to lose
    p.grad = torch.ones_like(p)
    opt.step()
    held = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="state\\[0\\] has a 'step' \\(4\\) but none of"):
        opt.load_state_dict(copy.deepcopy(sd))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], held["state"][0]["exp_avg"])
    sd["state"][0]["step"] = torch.tensor(0.0)  # a count of 0: nothing to lose
    opt.load_state_dict(sd)
