"""Two optimizers whose params have the same shapes and dtypes share one swap_dir, close with
keep_swap=True (as a crash leaves them), and are resumed: [Note: same identity] in
offload/swap/runs.py. Stores with a fingerprint of the params find their own directory in any
order; the others are taken in creation order, with a warning."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import offload
from offload.swap.runs import ParamsMismatch

HP = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, max_host_bytes="4MiB")
SHAPE = (96, 80)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _pair(swap_dir, dtype, **kw):
    """Models A (1) and B (2) of the same shapes, other values, one optimizer each on ``swap_dir``,
    in that order."""
    os.makedirs(swap_dir, exist_ok=True)
    out = []
    for m in (1, 2):
        p = (torch.randn(SHAPE, generator=_gen(m)) * m).to(dtype).requires_grad_(True)
        out.append((p, offload.AdamW([p], offload="nvme", swap_dir=str(swap_dir), **HP, **kw)))
    return out


def _steps(p, o, m, ks):
    for k in ks:  # model m's grad of step k: the same in every run
        p.grad = torch.randn(SHAPE, generator=_gen(100 * m + k)).to(p.dtype) * (-1) ** m
        o.step()


def _resume(p, swap_dir, **kw):
    return offload.AdamW([p], offload="nvme", swap_dir=str(swap_dir), resume=True, **HP, **kw)


def _left(swap_dir, dtype, **kw):
    """A stepped 3 times, B twice, both closed with keep_swap=True: their params as left."""
    (a, oa), (b, ob) = _pair(swap_dir, dtype, **kw)
    _steps(a, oa, 1, range(3))
    _steps(b, ob, 2, range(2))
    oa.close(keep_swap=True)
    ob.close(keep_swap=True)
    return a, b


def _check_goes_on_as_uninterrupted(tmp_path, dtype, resumed, **kw):
    """``resumed``: [(param, optimizer)] of A and B, resumed after step 3 / 2; four more
    steps each, bit-exact with a run never interrupted (same store, same kernel)."""
    (a, oa), (b, ob) = resumed
    assert int(oa.state_dict()["state"][0]["step"]) == 3 and int(ob.state_dict()["state"][0]["step"]) == 2
    _steps(a, oa, 1, range(3, 5))
    _steps(b, ob, 2, range(2, 4))
    (ra, ora), (rb, orb) = _pair(tmp_path / "ref", dtype, **kw)
    _steps(ra, ora, 1, range(5))
    _steps(rb, orb, 2, range(4))
    for p, q, o, oref in ((a, ra, oa, ora), (b, rb, ob, orb)):
        assert torch.equal(p.detach(), q.detach())
        got, want = o.state_dict()["state"][0], oref.state_dict()["state"][0]
        assert sorted(got) == sorted(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
    for o in (oa, ob, ora, orb):
        o.close()
    assert os.listdir(tmp_path / "swap") == []


@pytest.mark.parametrize("dtype, kw", [(torch.float32, {}), (torch.bfloat16, {"master_dtype": "bfloat16"})],
                         ids=["fp32", "bf16-own-master"])
def test_params_with_a_fingerprint_find_their_own_directory_in_the_other_order(tmp_path, dtype, kw):
    a, b = _left(tmp_path / "swap", dtype, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fingerprint told them apart: nothing to warn about
        ob = _resume(b, tmp_path / "swap", **kw)  # B first now: the directory created first is A's
        oa = _resume(a, tmp_path / "swap", **kw)
    _check_goes_on_as_uninterrupted(tmp_path, dtype, [(a, oa), (b, ob)], **kw)


def test_fp32_params_of_neither_directory_are_refused_naming_both(tmp_path):
    a, b = _left(tmp_path / "swap", torch.float32)
    left = b.detach().clone()
    with torch.no_grad():
        b.add_(1.0)  # not the values B's last step left
    with pytest.raises(ParamsMismatch) as info:
        _resume(b, tmp_path / "swap")
    msg = str(info.value)
    first, second = (os.path.join(tmp_path / "swap", f"offload-{n}.rank0") for n in ("run", "run-2"))
    assert f"{first}: the params given are not those of step 3" in msg
    assert "do not hold these params either" in msg and second in msg
    oa = _resume(a, tmp_path / "swap")  # A's own still resumes; B's directory stays for B
    oa.close()
    with torch.no_grad():
        b.copy_(left)
    _resume(b, tmp_path / "swap").close()
    assert os.listdir(tmp_path / "swap") == []


def _dirs(swap_dir):
    return [os.path.join(swap_dir, f"offload-{n}.rank0") for n in ("flat", "flat-2")]


def _guesses(record):
    return [str(w.message) for w in record if "resumed in creation order" in str(w.message)]


def test_params_rebuilt_from_the_master_resume_in_creation_order_with_one_warning(tmp_path):
    a, b = _left(tmp_path / "swap", torch.bfloat16)  # bf16 params, their fp32 master in the swap files
    first, second = _dirs(tmp_path / "swap")
    with pytest.warns(UserWarning) as record:
        oa = _resume(a, tmp_path / "swap")  # the order of creation: each takes its own
        ob = _resume(b, tmp_path / "swap")
    (msg,) = _guesses(record)  # once for the pair, not once per optimizer
    assert first in msg and second in msg and f"this optimizer takes {first}" in msg
    _check_goes_on_as_uninterrupted(tmp_path, torch.bfloat16, [(a, oa), (b, ob)])


def test_params_rebuilt_from_the_master_in_the_other_order_are_warned_of(tmp_path):
    """Nothing tells the directories apart ([Note: same identity]): B, built first, takes the
    directory created first (A's), and the warning says so and what to do."""
    a, b = _left(tmp_path / "swap", torch.bfloat16)
    first, second = _dirs(tmp_path / "swap")
    with pytest.warns(UserWarning) as record:
        ob = _resume(b, tmp_path / "swap")
    (msg,) = _guesses(record)
    assert first in msg and second in msg and f"this optimizer takes {first}" in msg
    assert "Build the optimizers in the order they were first created, or give each its own swap_dir" in msg
    assert ob.state_dict()["state"][0]["step"] == 3  # A's: the limit the warning names
    ob.close()
    oa = _resume(a, tmp_path / "swap")
    oa.close()
    assert os.listdir(tmp_path / "swap") == []
