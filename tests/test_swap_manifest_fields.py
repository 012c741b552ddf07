"""resume=True over a swap manifest whose fields have the wrong type, sealed again (a writer's
bug or a hand edit, which the seal cannot tell): refused as the manifest is read, naming it
and the field. ``blocks = None`` or ``extra.shapes = True`` used to leak a TypeError from
deep in the resume ("'NoneType' object is not iterable", "object of type 'bool' has no
len()"), ``extra.optimizer.holding = 1`` a ValueError naming "the resumed swap files", a
step of 2**64 was resumed (and overflowed the ranks' int64 agreement later), and a kept
sub_group_size of 2**40 was reported without naming the directory it came from."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

import offload
from offload.swap import fsutil
from offload.swap.cleanup import clean_dir

import _internals as internals

SHAPES = [(5000,), (30, 40), (7,)]
KW = {"fp32": {}, "bf16": {}, "int8": dict(state_dtype="int8"), "ams": dict(amsgrad=True)}


def _left(tmp_path, kind, **kw):
    """The manifest of an AdamW's swap directory left after two steps as a kill leaves it, and
    the params to resume it with. kind: fp32 (params swapped in place), bf16 (flat store, fp32
    masters in the swap files), int8 (packed states), ams (amsgrad: its commit meta)."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SHAPES]
    opt = offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=str(tmp_path), **KW[kind], **kw)
    for k in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
    path = os.path.join(internals.leave_swap_as_killed(opt), "manifest.json")
    return [torch.nn.Parameter(p.detach().clone()) for p in ps], path


def _set(m, field, value):
    *parents, last = field.split(".")
    for k in parents:
        m = m[k]
    m[last] = value


@pytest.mark.parametrize("kind, field, value, says", [
    ("fp32", "extra.shapes", True, "extra.shapes must be a list of shapes, got True"),
    ("fp32", "extra.shapes", [[5000], [30, "x"], 7], "extra.shapes must be a list of shapes"),
    ("fp32", "blocks", None, r"blocks must be a list of 2 entries \(one per state\), got None"),
    ("fp32", "dtypes", None, "dtypes must be a list of 2 entries"),
    ("fp32", "extra.fingerprint", 5, "extra.fingerprint must be a string"),
    ("fp32", "previous.extra.steps", "x", "previous.extra.steps must be a list"),
    ("fp32", "step", 2**64, r"step must be in \[0, 2147483647\]"),
    ("int8", "blocks", 1, "blocks must be a list of 2 entries"),
    ("int8", "blocks", [256, -1], r"blocks\[1\] must be an integer >= 0, got -1"),
    ("int8", "codes", ["signed", None], r"codes\[1\] must be a code name, got None"),
    ("int8", "states", ["exp_avg", 1], "states must be a list of state names"),
    ("bf16", "extra.groups", [[5000, 1200, "7"]], "extra.groups must be lists of integers >= 0"),
    ("bf16", "extra.world", 0, r"extra.world must be an integer in \[1, 1048576\], got 0"),
    ("bf16", "extra.rank", True, "extra.rank must be an integer >= 0, got True"),
    ("bf16", "extra.rank", 1, r"extra.rank must be below world \(1\), got 1"),
    ("bf16", "extra.kind", None, "extra.kind must be a string"),
    ("ams", "extra.optimizer", "x", "extra.optimizer must be an object"),
    ("ams", "extra.optimizer.holding", 1, "extra.optimizer must be an object"),
])
def test_a_wrong_typed_field_is_refused_naming_the_manifest(tmp_path, kind, field, value, says):
    ps, path = _left(tmp_path, kind)
    m = fsutil.unsealed(json.load(open(path)), path, "")
    _set(m, field, value)
    with open(path, "w") as f:
        json.dump(fsutil.sealed(m), f)
    with pytest.raises(ValueError, match="damaged swap manifest: " + says) as e:
        offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=str(tmp_path), resume=True, **KW[kind])
    assert str(e.value).startswith(path + ": ")
    clean_dir(str(tmp_path))


def test_a_kept_sub_group_size_that_differs_names_the_manifest(tmp_path):
    ps, path = _left(tmp_path, "fp32", sub_group_size=2048)
    m = fsutil.unsealed(json.load(open(path)), path, "")
    m["sub_group_size"] = 2**40
    with open(path, "w") as f:
        json.dump(fsutil.sealed(m), f)
    says = f"{path}: sub_group_size=2048 but the swap directory was written with sub_group_size={2**40}:"
    with pytest.raises(ValueError, match=re.escape(says)):
        offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=str(tmp_path), sub_group_size=2048, resume=True)
    clean_dir(str(tmp_path))


@pytest.mark.parametrize("kind", list(KW))
def test_the_fields_as_written_still_resume(tmp_path, kind):
    ps, _ = _left(tmp_path, kind)
    opt = offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=str(tmp_path), resume=True, **KW[kind])
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [2.0] * len(SHAPES)
    opt.close()
