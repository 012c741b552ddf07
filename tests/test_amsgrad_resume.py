"""``offload="nvme"`` with ``resume=True`` after groups that differ in amsgrad: the swap
files hold the max_exp_avg_sq of a group whose amsgrad went off (torch keeps it), and each
commit records which params hold one (StepContext.commit_meta, ckpt_holding's "holding"), so
the resumed optimizer shows it in opt.state and state_dict() and goes on from it, as torch's
uninterrupted run does, element by element."""
from __future__ import annotations

import copy

import pytest

import offload
from offload.optim.context import StepContext
from test_amsgrad_checkpoints import Run, _groups, _kwargs, _shows


def _resume(run, store, tmp_path):
    """Close with the swap files kept; a new optimizer resumes them, built with the groups
    as they are now (group 1 with amsgrad off)."""
    run.opt.close(keep_swap=True)
    run.opt = offload.AdamW(_groups(run.params, middle=False), lr=1e-2, resume=True,
                            **_kwargs(store, tmp_path, "run"))


@pytest.mark.parametrize("store", ["nvme", "flat-nvme"])
def test_a_resumed_run_shows_the_max_exp_avg_sq_of_an_amsgrad_off_group(store, tmp_path):
    run = Run(store, tmp_path)
    _resume(run, store, tmp_path)
    run.check_keys()  # opt.state and state_dict() right after the resume: torch's keys
    run.check_values()
    run.go_on()  # group 1 turns amsgrad on again: from the kept max_exp_avg_sq, as torch


@pytest.mark.parametrize("store", ["nvme", "flat-nvme"])
def test_swap_files_written_before_the_record_resume_as_before(store, tmp_path, monkeypatch):
    """A manifest without the optimizer's record (an older run): a param holds a
    max_exp_avg_sq when its group has amsgrad now and it stepped."""
    monkeypatch.setattr(StepContext, "commit_extra", lambda self: {})
    run = Run(store, tmp_path)
    _resume(run, store, tmp_path)
    assert [_shows(run.opt.state[p], "max_exp_avg_sq") for p in run.params] == [True, False, False, False]
    run.opt.close()


@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
@pytest.mark.parametrize("store", ["nvme", "flat-nvme"])
def test_a_run_resumed_right_after_a_load_shows_what_the_load_gave(store, how, tmp_path):
    """The load's own commit recorded the optimizer's record as it was before: the new one
    is committed once known, so a resume before any step shows the loaded max_exp_avg_sq."""
    run = Run(store, tmp_path)
    sd = copy.deepcopy(run.opt.state_dict())
    run.opt.save_checkpoint(str(tmp_path / "ckpt"))
    run.opt.close()
    opt = offload.AdamW(_groups(run.params, middle=False), lr=1e-2, **_kwargs(store, tmp_path, "back"))
    opt.load_checkpoint(str(tmp_path / "ckpt")) if how == "checkpoint" else opt.load_state_dict(sd)
    opt.close(keep_swap=True)
    run.opt = offload.AdamW(_groups(run.params, middle=False), lr=1e-2, resume=True, **_kwargs(store, tmp_path, "back"))
    run.go_on()


def test_a_run_whose_only_group_turned_amsgrad_off_resumes_built_as_it_was(tmp_path):
    """Swap files of a store built with amsgrad hold max_exp_avg_sq also after its one group
    turned amsgrad off: a resume built without amsgrad is refused naming the states (it named
    only their dtypes: history fuzz seed 215); built as the run was, with the group turned off
    again, it goes on as torch's uninterrupted run, element by element."""
    import torch

    gen = torch.Generator().manual_seed(0)
    vals = [torch.randn(n, generator=gen) for n in (300, 7)]
    ours, theirs = [[torch.nn.Parameter(v.clone()) for v in vals] for _ in range(2)]
    swap = tmp_path / "swap"
    swap.mkdir()
    opt = offload.Adam(ours, lr=0.1, amsgrad=True, offload="nvme", swap_dir=str(swap))
    ref = torch.optim.Adam(theirs, lr=0.1, amsgrad=True)

    def step(seed):
        for o, ps in ((opt, ours), (ref, theirs)):
            g = torch.Generator().manual_seed(seed)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            o.step()
    step(1)
    for o in (opt, ref):
        o.param_groups[0]["amsgrad"] = False
    step(2)
    opt.close(keep_swap=True)
    with pytest.raises(ValueError, match=r"states is \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'\]"):
        offload.Adam(ours, lr=0.1, amsgrad=False, offload="nvme", swap_dir=str(swap), resume=True)
    opt = offload.Adam(ours, lr=0.1, amsgrad=True, offload="nvme", swap_dir=str(swap), resume=True)
    opt.param_groups[0]["amsgrad"] = False
    step(3)
    opt.param_groups[0]["amsgrad"] = ref.param_groups[0]["amsgrad"] = True
    step(4)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)
    sa, sb = opt.state_dict()["state"], ref.state_dict()["state"]
    for k in sb:
        assert sorted(sa[k]) == sorted(sb[k])
        for n in sb[k]:
            torch.testing.assert_close(sa[k][n].float(), sb[k][n].float(), rtol=2e-5, atol=2e-6)
    opt.close()
