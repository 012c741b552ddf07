"""``resume=True`` for every rule: a run stopped after step 3 (``close(keep_swap=True)``, as a
kill -9 leaves it) and resumed takes step 4 exactly as an uninterrupted run, with the same
state_dict. Adagrad's ``sum`` was overwritten by its initial value on resume (the
constructor's fill went into the resumed store), and SGD forgot which momentum buffers had
started (dampening then treated them as new; state_dict() dropped them)."""
from __future__ import annotations

import pytest
import torch

import offload

RULES = {
    "sgd": lambda ps, **k: offload.SGD(ps, lr=0.01, momentum=0.9, **k),
    "sgd-dampening": lambda ps, **k: offload.SGD(ps, lr=0.01, momentum=0.9, dampening=0.1, **k),
    "adagrad": lambda ps, **k: offload.Adagrad(ps, lr=0.01, initial_accumulator_value=0.25, **k),
    "lion": lambda ps, **k: offload.Lion(ps, lr=1e-3, weight_decay=0.1, **k),
    "adamw": lambda ps, **k: offload.AdamW(ps, lr=0.01, **k),
}


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(70, 60).to(dtype)  # 4200 weights: compressed where int8 is asked


def _grads(m, i):
    g = torch.Generator().manual_seed(i)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rule", list(RULES))
def test_resume_continues_as_the_uninterrupted_run(rule, dtype, state_dtype, tmp_path):
    dtype, make = getattr(torch, dtype), RULES[rule]
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    kw = dict(offload="nvme", state_dtype=state_dtype)
    ref = _model(dtype)
    opt = make(ref.parameters(), swap_dir=str(tmp_path / "ref"), **kw)
    for i in range(4):
        _grads(ref, i)
        opt.step()
    want = opt.state_dict()["state"]
    opt.close()
    m = _model(dtype)
    opt = make(m.parameters(), swap_dir=str(tmp_path / "run"), **kw)
    for i in range(3):
        _grads(m, i)
        opt.step()
    before = opt.state_dict()["state"]
    opt.close(keep_swap=True)
    opt = make(m.parameters(), swap_dir=str(tmp_path / "run"), resume=True, **kw)
    try:
        after = opt.state_dict()["state"]
        assert before.keys() == after.keys()
        for k in before:
            assert before[k].keys() == after[k].keys(), k
            for name, v in before[k].items():
                assert torch.equal(v, after[k][name]), (k, name)
        _grads(m, 3)
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
        got = opt.state_dict()["state"]
        for k in want:
            for name, v in want[k].items():
                assert torch.equal(v, got[k][name]), (k, name)
    finally:
        opt.close()
