"""An Adam group that turns amsgrad off and back on in the flat and swapped stores: torch
keeps each param's max_exp_avg_sq meanwhile (in opt.state and state_dict()) and uses it
again; so do these stores (``kept_states``, [Note: groups of different rules] in
offload/kernels/fields.py), bit for bit with the host store and through a state_dict
round trip against torch.optim."""
from __future__ import annotations

import copy

import pytest
import torch

import offload
from test_mixed_rule_stores import TOL, _adam_groups, _pair, _params, _same_states, _step, _store_kwargs


def _big_then_small(opts_params, gen, t):
    """One step on the same grads: large ones first, so that the max_exp_avg_sq of those
    steps stays above exp_avg_sq afterwards (it decides the later updates)."""
    scale = 100.0 if t < 2 else 1.0
    grads = [(torch.randn(p.shape, generator=gen) * scale).to(torch.bfloat16) for p in opts_params[0][1]]
    for opt, params in opts_params:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        opt.step()


def _flip(opts, amsgrad):
    for opt in opts:
        opt.param_groups[1]["amsgrad"] = amsgrad


@pytest.mark.parametrize("store", ["nvme", "flat"])
def test_a_group_that_turns_amsgrad_off_keeps_max_exp_avg_sq_as_the_host_store(store, tmp_path):
    params, host_params = _pair(store, tmp_path)
    opt = offload.AdamW(_adam_groups(params, (True, True)), lr=1e-2, **_store_kwargs(store, tmp_path))
    host = offload.AdamW(_adam_groups(host_params, (True, True)), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for amsgrad in (True, False, True):
        _flip((opt, host), amsgrad)
        for t in range(2):
            _step([(opt, params), (host, host_params)], gen)
        _same_states(opt, host, params)  # max_exp_avg_sq shown in the off phase too, as torch's
        assert opt.state[params[3]]["max_exp_avg_sq"].shape == params[3].shape  # (a reader on NVMe)
    opt.close()


def test_a_state_dict_taken_while_amsgrad_is_off_carries_max_exp_avg_sq_as_torch(tmp_path):
    """Saved with the group's amsgrad off, loaded into a new optimizer that turns it back
    on: torch goes on with the kept max_exp_avg_sq, and so does the swapped store."""
    params, ref_params = _params(), _params()
    opt = offload.Adam(_adam_groups(params, (True, True)), lr=1e-2, **_store_kwargs("nvme", tmp_path))
    ref = torch.optim.Adam(_adam_groups(ref_params, (True, True)), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for t in range(4):
        _flip((opt, ref), t < 2)
        _big_then_small([(opt, params), (ref, ref_params)], gen, t)
    mine, theirs = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict())
    assert "max_exp_avg_sq" in mine["state"][3]  # as torch's
    opt.close()
    opt = offload.Adam(_adam_groups(params, (True, True)), lr=0.5, **_store_kwargs("nvme", tmp_path, "back"))
    ref = torch.optim.Adam(_adam_groups(ref_params, (True, True)), lr=0.5, foreach=False)
    opt.load_state_dict(mine)
    ref.load_state_dict(theirs)
    _flip((opt, ref), True)
    for t in range(4, 6):
        _big_then_small([(opt, params), (ref, ref_params)], gen, t)
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    for i, (p, r) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(p, r, **TOL)
        assert set(got[i]) == set(want[i])
        for k in want[i]:
            torch.testing.assert_close(got[i][k], want[i][k], **TOL)
    opt.close()
