"""Checkpoints of the stage-0 stores load across state dtypes and stores ([Note: converting
loads] in offload/zero/ckpt_convert.py): the loaded states are those the state_dict route
gives (decoded float32, encoded again as the loading store keeps them), bit for bit, and the
next step is too."""
from __future__ import annotations

import itertools

import pytest
import torch

import offload

SIZES = [4097, 7, 300, 1]  # 300: under one block; the last param never gets a grad (step 0)
COMBOS = [(s, d) for s in ("cpu", "nvme") for d in ("float32", "bfloat16", "int8")]


def _make(kind, store, state_dtype, params, tmp_path):
    kw = dict(lr=1e-2, state_dtype=state_dtype)
    if store == "nvme":
        tmp_path.mkdir(exist_ok=True)
        kw.update(offload="nvme", swap_dir=str(tmp_path))
    else:
        kw.update(offload="cpu")
    if kind == "sgd":
        return offload.SGD(params, momentum=0.9, **kw)
    return offload.AdamW(params, weight_decay=0.1, **kw)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params[:-1]:
        p.grad = torch.randn(p.shape, generator=g)


def _same_state(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            torch.testing.assert_close(sa[i][k], sb[i][k], rtol=0, atol=0, msg=lambda m: f"param {i} {k}: {m}")


PAIRS = [c for c in itertools.product(COMBOS, COMBOS) if c[0] != c[1]]


# SGD (another rule, one state) on the pairs that cross stores with int8 on a side
CASES = [("adamw", a, b) for a, b in PAIRS] + [("sgd", a, b) for a, b in PAIRS
                                              if a[0] != b[0] and "int8" in (a[1], b[1])]


@pytest.mark.parametrize("kind,src,dst", CASES, ids=["%s:%s-%s->%s-%s" % (k, *a, *b) for k, a, b in CASES])
def test_load_across_state_dtypes_equals_the_state_dict_route(tmp_path, kind, src, dst):
    params = _params()
    opt = _make(kind, *src, params, tmp_path / "a")
    for s in range(2):
        _grads(params, s)
        opt.step()
    opt.save_checkpoint(str(tmp_path / "ckpt"))

    via_ckpt, via_sd = _params(1), _params(1)
    a = _make(kind, *dst, via_ckpt, tmp_path / "b")
    b = _make(kind, *dst, via_sd, tmp_path / "c")
    a.load_checkpoint(str(tmp_path / "ckpt"))
    sd = opt.state_dict()
    for i, p in enumerate(params):  # torch's SGD layout has no step; ours counts it (bf16 rounding seeds)
        if i in sd["state"]:
            sd["state"][i]["step"] = opt.state[p]["step"].clone()
    b.load_state_dict(sd)
    _same_state(a, b)
    for p, q in zip(via_ckpt, via_sd):  # and they step alike
        p.data.copy_(q.data)
    _grads(via_ckpt, 7)
    _grads(via_sd, 7)
    a.step()
    b.step()
    for p, q in zip(via_ckpt, via_sd):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    _same_state(a, b)
    for o in (opt, a, b):
        o.close()


def test_other_states_are_still_refused(tmp_path):
    params = _params()
    opt = _make("adamw", "nvme", "int8", params, tmp_path / "a")
    _grads(params, 0)
    opt.step()
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    sgd = _make("sgd", "nvme", "float32", _params(1), tmp_path / "b")
    with pytest.raises(ValueError, match="exp_avg"):
        sgd.load_checkpoint(str(tmp_path / "ckpt"))
    shapes = offload.AdamW([torch.nn.Parameter(torch.zeros(n)) for n in (4097, 7, 301, 1)], offload="cpu")
    with pytest.raises(ValueError):
        shapes.load_checkpoint(str(tmp_path / "ckpt"))
    for o in (opt, sgd, shapes):
        o.close()
