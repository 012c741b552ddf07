"""Stage 3 checkpoints keep the model's persistent buffers (checkpoint.py, ckpt_buffers.py
[Note: stage 3 checkpoint buffers]): a BatchNorm model trained a few steps, saved, loaded into
a fresh sharded model evaluates bit for bit as the saved one (before, its running stats came
back at their initial values, silently). Per rank on as many ranks as saved (each rank's own
stats), the old rank 0's on another number; a checkpoint saved without buffers (the older
format) still loads, with a warning, buffers unchanged; a model with other buffers is refused.

The session's gloo ranks (tests/_ranks.py group) for world 2; world 1 runs in this process."""
from __future__ import annotations

import copy
import json
import os
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import offload
from offload.shard import load_checkpoint, save_checkpoint
from offload.shard.checkpoint import MANIFEST
from offload.swap import fsutil
import _ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2)])
        self.register_buffer("cache", torch.zeros(3), persistent=False)  # not in state_dict: not saved

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _make(seed=0):
    torch.manual_seed(seed)
    model = offload.shard(Net())
    return model, offload.AdamW(model.parameters(), lr=1e-2)


def _buffers(model):
    return {k: v.clone() for k, v in model.named_buffers()}


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _eval(model):
    model.eval()
    with torch.no_grad():
        return model(torch.randn(4, 8, generator=torch.Generator().manual_seed(5)))


def job_save(directory):
    """3 steps on this rank's own batches (so the ranks' BatchNorm stats differ), saved."""
    model, opt = _make()
    g = torch.Generator().manual_seed(11 + _rank())
    for _ in range(3):
        model(torch.randn(16, 8, generator=g) * 3 + 1).square().mean().backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(model, opt, directory)
    return {"buffers": _buffers(model), "eval": _eval(model), "params": _params(model)}


def job_load(directory):
    model, opt = _make(seed=1)
    load_checkpoint(model, opt, directory)
    return {"buffers": _buffers(model), "eval": _eval(model), "params": _params(model)}


def _job(rank, world, name, kwargs):
    return globals()[name](**copy.deepcopy(kwargs))


def _go(world, name, **kwargs):
    if world == 1:
        return [globals()[name](**kwargs)]
    out = _ranks.group(world).run(_job, name, kwargs, timeout=180)
    return [out[r] for r in range(world)]


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_resumed_batchnorm_model_evaluates_bit_for_bit(tmp_path):
    saved = job_save(str(tmp_path))
    assert int(saved["buffers"]["blocks.0.1.num_batches_tracked"]) == 3
    loaded = job_load(str(tmp_path))
    _equal(loaded["buffers"], saved["buffers"])
    _equal(loaded["params"], saved["params"])
    assert torch.equal(loaded["eval"], saved["eval"])
    assert "cache" not in json.load(open(tmp_path / MANIFEST))["buffers"]


@pytest.mark.parametrize("n,m", [(2, 2), (2, 1), (1, 2)])
def test_buffers_per_rank_on_the_same_world_rank_0s_on_another(tmp_path, n, m):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    saved = _go(n, "job_save", directory=str(tmp_path))
    if n == 2:
        assert not torch.equal(saved[0]["buffers"]["blocks.0.1.running_mean"],
                               saved[1]["buffers"]["blocks.0.1.running_mean"])
    loaded = _go(m, "job_load", directory=str(tmp_path))
    for r, got in enumerate(loaded):
        want = saved[r] if n == m else saved[0]
        _equal(got["buffers"], want["buffers"])
        assert torch.equal(got["eval"], want["eval"])


def _strip_buffers(d):
    """The checkpoint in ``d`` as the older format wrote it: no buffers in its files or manifest."""
    path = os.path.join(d, MANIFEST)
    m = fsutil.unsealed(fsutil.read_json(path), path)
    del m["buffers"]
    for q, name in enumerate(m["files"]):
        f = os.path.join(d, name)
        data = torch.load(f, weights_only=True)
        del data["buffers"]
        torch.save(data, f)
        raw = open(f, "rb").read()
        m["bytes"][q], m["crc32"][q] = len(raw), zlib.crc32(raw)
    fsutil.write_json_atomic(d, MANIFEST, fsutil.sealed(m))


def test_a_checkpoint_without_buffers_loads_with_a_warning(tmp_path):
    saved = job_save(str(tmp_path))
    _strip_buffers(str(tmp_path))
    model, opt = _make(seed=1)
    before = _buffers(model)
    with pytest.warns(UserWarning, match="saved without the model's buffers"):
        load_checkpoint(model, opt, str(tmp_path))
    _equal(_buffers(model), before)  # as before buffers were kept: unchanged
    _equal(_params(model), saved["params"])  # the rest loads as before


def test_a_model_with_other_buffers_is_refused(tmp_path):
    job_save(str(tmp_path))
    model, opt = _make(seed=1)
    model.blocks[1][1].register_buffer("extra", torch.ones(2))
    before = _buffers(model)
    with pytest.raises(ValueError, match="buffers only in this model: 'blocks.1.1.extra'"):
        load_checkpoint(model, opt, str(tmp_path))
    _equal(_buffers(model), before)
