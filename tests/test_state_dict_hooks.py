"""state_dict hooks as torch's test_optim.py drives them, in every store: a pre hook that puts a
non-param entry in ``opt.state`` (``opt.state["test"] = 1``, torch's test_state_dict_pre_hook)
gets it back in ``state_dict()``, and a post hook sees torch's layout (SGD: only started
momentum buffers, no "step"; Adagrad: every param's sum) and keeps what it adds.
Each check runs on torch's class too, so the expectations are torch's."""
from __future__ import annotations

import pytest
import torch

import offload

# (ours, torch's or None, constructor kwargs)
RULES = {
    "adamw": (offload.AdamW, torch.optim.AdamW, {}),
    "sgd": (offload.SGD, torch.optim.SGD, {"momentum": 0.9}),
    "sgd_plain": (offload.SGD, torch.optim.SGD, {}),
    "adagrad": (offload.Adagrad, torch.optim.Adagrad, {}),
    "lion": (offload.Lion, None, {}),
}
STORES = {"host": {}, "bf16": {"state_dtype": "bfloat16"}, "int8": {"state_dtype": "int8"}, "nvme": {"offload": "nvme"}}


def _make(cls, kwargs, store, tmp_path, params):
    extra = dict(STORES[store]) if cls.__module__.startswith("offload") else {}
    if extra.get("offload") == "nvme":
        extra["swap_dir"] = str(tmp_path)
    return cls(params, lr=0.1, **kwargs, **extra)


def _two_groups(kwargs):
    """Two params in two groups; the second group never steps (torch: no state for it)."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(300)
    return p, q, [{"params": [p]}, {"params": [q]}]


@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_pre_hooks_non_param_entry_passes_through(rule, store, tmp_path):
    ours, theirs, kwargs = RULES[rule]

    def note(opt):
        opt.state["test"] = 1

    for cls in filter(None, (theirs, ours)):
        p = torch.nn.Parameter(torch.rand(2, 3))
        opt = _make(cls, kwargs, store, tmp_path, [p])
        opt.register_state_dict_pre_hook(note)
        assert opt.state_dict()["state"]["test"] == 1, cls  # before any step
        p.grad = torch.ones_like(p)
        opt.step()
        sd = opt.state_dict()
        assert sd["state"]["test"] == 1, cls
        opt.load_state_dict(sd)  # and back: torch keeps the entry in opt.state
        assert opt.state["test"] == 1, cls
        opt.step()
        getattr(opt, "close", lambda: None)()


@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_post_hook_sees_torchs_layout_and_keeps_what_it_adds(rule, store, tmp_path):
    ours, theirs, kwargs = RULES[rule]
    seen = {}

    def post(opt, sd):
        seen[type(opt).__module__] = {k: sorted(v) for k, v in sd["state"].items()}
        sd["state"]["extra"] = {"step": 5}
        return sd

    for cls in filter(None, (theirs, ours)):
        p, q, groups = _two_groups(kwargs)
        opt = _make(cls, kwargs, store, tmp_path, groups)
        opt.step()
        opt.register_state_dict_post_hook(post)
        sd = opt.state_dict()
        assert sd["state"]["extra"] == {"step": 5}, cls
        assert set(sd["state"]) == set(seen[cls.__module__]) | {"extra"}, cls
        getattr(opt, "close", lambda: None)()
    if theirs is not None:
        # ours only: a bf16 param's fp32 "master"; SGD's "step" with bf16 states (their rounding
        # seeds), alone in the entry of a param without a buffer
        ours_only = {"master"} | ({"step"} if rule.startswith("sgd") and store == "bf16" else set())
        ours_view = {k: [n for n in v if n not in ours_only] for k, v in seen[ours.__module__].items()}
        ours_view = {k: v for k, v in ours_view.items() if v or k in seen[theirs.__module__]}
        assert ours_view == seen[theirs.__module__]
    else:  # Lion: the stepped param's exp_avg (and our step count), nothing for q
        assert "exp_avg" in seen[ours.__module__][0] and 1 not in seen[ours.__module__]
