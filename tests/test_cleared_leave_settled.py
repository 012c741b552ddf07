"""``opt.state[p].clear()`` between steps, then the states leave the optimizer before p's next
step: ``close(keep_swap=True)`` + ``resume=True`` showed the cleared entry again and went on
from its old moments and count ([Note: cleared before a kept close] in offload/optim/cleared.py;
history fuzz seed 131: SGD, a frozen param cleared), as ``save_checkpoint`` did before
state_io's [Note: cleared before a save]. Either way the run now goes on as the uninterrupted
one: torch's for fp32 states, offload's own bit for bit for the others."""
from __future__ import annotations

import pytest
import torch

import offload
from test_cleared_kept_states import _grads, _params  # (the same sizes and grads)

RULES = {"sgd": ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
         "adam": ("Adam", dict(lr=1e-2, amsgrad=True)),
         "adamw": ("AdamW", dict(lr=1e-2))}
# (param dtype, offload, state_dtype)
STORES = {"nvme": (torch.float32, "nvme", None), "nvme-int8": (torch.float32, "nvme", "int8"),
          "flat": (torch.bfloat16, "cpu", None), "flat-nvme-bf16": (torch.bfloat16, "nvme", "bfloat16")}




def _make(rule, store, params, tmp_path, tag, **extra):
    name, hp = RULES[rule]
    _, where, sd = STORES[store]
    kw = dict(hp, offload=where, **extra)
    if sd is not None:
        kw["state_dtype"] = sd
    if where == "nvme" and "swap_dir" not in kw:
        kw["swap_dir"] = str(tmp_path / f"swap-{tag}")
        (tmp_path / f"swap-{tag}").mkdir()
    return getattr(offload, name)(params, **kw)


def _twin(rule, store, tmp_path):
    """The uninterrupted run: torch's for fp32 states, else offload's of the same configuration."""
    dtype, _, sd = STORES[store]
    if dtype == torch.float32 and sd is None:
        name, hp = RULES[rule]
        params = _params(dtype)
        return getattr(torch.optim, name)(params, **hp), params
    params = _params(dtype)
    return _make(rule, store, params, tmp_path, "twin"), params


def _interrupt(opt, how, rule, store, params, tmp_path):
    if how == "checkpoint-go-on":
        opt.save_checkpoint(str(tmp_path / "ck"))
        return opt
    if how == "checkpoint":
        opt.save_checkpoint(str(tmp_path / "ck"))
        opt.close()
        new = _make(rule, store, params, tmp_path, "new")
        new.load_checkpoint(str(tmp_path / "ck"))
        return new
    swap = opt.config.swap_dir
    opt.close(keep_swap=True)
    return _make(rule, store, params, tmp_path, "resumed", swap_dir=swap, resume=True)


def _entries(opt):
    return sorted(k for k, v in opt.state_dict()["state"].items() if any(n != "step" for n in v))


@pytest.mark.parametrize("how", ["resume", "checkpoint", "checkpoint-go-on"])
@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("rule", list(RULES))
def test_a_cleared_param_leaves_as_torch_starts_it_afresh(rule, store, how, tmp_path):
    if how == "resume" and STORES[store][1] != "nvme":
        pytest.skip("resume=True needs offload='nvme'")
    params = _params(STORES[store][0])
    opt = _make(rule, store, params, tmp_path, "a")
    ref, ref_params = _twin(rule, store, tmp_path)
    for seed in (1, 2):
        for o, ps in ((opt, params), (ref, ref_params)):
            _grads(ps, seed)
            o.step()
    for o, ps in ((opt, params), (ref, ref_params)):
        o.state[ps[1]].clear()
        ps[2].requires_grad_(False)  # frozen: no step of its own until the end (seed 131)
        ps[2].grad = None
    opt = _interrupt(opt, how, rule, store, params, tmp_path)
    assert _entries(opt) == _entries(ref) == [0, 2]
    for seed in (3, 4):
        if seed == 4:
            params[2].requires_grad_(True)
            ref_params[2].requires_grad_(True)
        for o, ps in ((opt, params), (ref, ref_params)):
            _grads(ps, seed)
            o.step()
    exact = not isinstance(ref, torch.optim.Optimizer) or isinstance(ref, (offload.SGD, offload.Adam, offload.AdamW))
    for i, (p, q) in enumerate(zip(params, ref_params)):
        if exact:
            assert torch.equal(p.detach(), q.detach()), f"param {i}"
        else:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6, msg=f"param {i}")
    sa, sb = opt.state_dict()["state"], ref.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        for n, v in sb[k].items():
            if n in sa[k] and torch.is_tensor(v) and v.is_floating_point():
                assert torch.equal(sa[k][n], v) if exact else torch.allclose(sa[k][n].float(), v.float(), rtol=2e-5, atol=2e-6), (k, n)
        assert float(sa[k].get("step", 0)) == float(sb[k].get("step", 0)) or rule == "sgd", k
    opt.close()
    if exact:
        ref.close()
