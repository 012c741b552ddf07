"""The swap store's own manifest (``manifest.json``: the step, which slot holds each sub-group,
the per-param steps) is sealed with its crc32 as the checkpoint manifests are ([Note: sealed
manifests] in offload/swap/fsutil.py). A digit changed after it was written used to resume
silently: another slot's (older) states, or other step counts. And a save over a damaged
checkpoint manifest says that nothing was saved, not "nothing was loaded"."""
import json
import os
import re

import pytest
import torch

import offload
from offload.shard import save_checkpoint
from offload.shard.checkpoint import MANIFEST as SHARD_MANIFEST
from offload.swap import fsutil
from offload.swap.cleanup import clean_dir

import _internals as internals

HP = dict(lr=1e-2, weight_decay=0.01)
N = 3000


def _left(tmp_path, steps=2):
    """An optimizer's swap directory left at ``steps`` as a kill leaves it; (param, its state
    after the last step, the manifest's path)."""
    torch.manual_seed(0)
    p = torch.randn(N, requires_grad=True)
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, **HP)
    for k in range(steps):
        p.grad = torch.randn(N, generator=torch.Generator().manual_seed(k))
        opt.step()
    state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    path = os.path.join(internals.leave_swap_as_killed(opt), "manifest.json")
    return p, state, path


def test_the_store_writes_a_sealed_manifest(tmp_path):
    _, _, path = _left(tmp_path)
    m = json.load(open(path))
    assert isinstance(m[fsutil.SEAL], int)
    assert fsutil.unsealed(m, path)["step"] == 2  # and the seal is its content's
    clean_dir(str(tmp_path))


FLIPS = {  # valid JSON each: only the seal can tell
    "step": (r'"step":2\b', '"step":3'),
    "a slot": (r'"slots":\[(\d)', lambda m: '"slots":[' + str(1 - int(m.group(1)))),
    "a param's step count": (r'"steps":\[2\]', '"steps":[5]'),
}


@pytest.mark.parametrize("what", list(FLIPS))
def test_a_changed_manifest_is_not_resumed(tmp_path, what):
    p, _, path = _left(tmp_path)
    text = open(path).read()
    new, n = re.subn(FLIPS[what][0], FLIPS[what][1], text, count=1)
    assert n == 1 and new != text
    json.loads(new)
    open(path, "w").write(new)
    with pytest.raises(ValueError, match=re.escape(f"{path}: the manifest fails its own checksum")) as e:
        offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, resume=True, **HP)
    assert "nothing was resumed" in str(e.value) and "offload clean" in str(e.value)
    assert open(path).read() == new  # a refused resume deletes nothing
    clean_dir(str(tmp_path))


def test_a_sealed_manifest_resumes_the_same_states(tmp_path):
    p, state, _ = _left(tmp_path)
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, resume=True, **HP)
    got = opt.state_dict()["state"][0]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(got[k], state[k]), k
    assert float(got["step"]) == 2
    opt.close()


def test_an_older_unsealed_manifest_still_resumes(tmp_path):
    p, state, path = _left(tmp_path)
    m = json.load(open(path))
    del m[fsutil.SEAL]  # as the previous release wrote it
    json.dump(m, open(path, "w"))
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, resume=True, **HP)
    got = opt.state_dict()["state"][0]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(got[k], state[k]), k
    p.grad = torch.ones(N)
    opt.step()  # its next commit is sealed
    assert fsutil.SEAL in json.load(open(os.path.join(internals.swap(opt).store.path, "manifest.json")))
    opt.close()


def _damage(path):
    text = path.read_text()
    new = re.sub(r'("lr":)0\.01\b', r'\g<1>0.02', text, count=1)
    assert new != text
    path.write_text(new)


def test_a_save_over_a_damaged_checkpoint_says_nothing_was_saved(tmp_path):
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (7, 4097)]
    opt = offload.AdamW(ps, offload="cpu", **HP)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.save_checkpoint(str(tmp_path / "ck"))
    path = tmp_path / "ck" / "rank0" / "offload-ckpt.json"
    _damage(path)
    damaged = path.read_text()
    with pytest.raises(ValueError, match=re.escape(f"{path}: the manifest fails its own checksum")) as e:
        opt.save_checkpoint(str(tmp_path / "ck"))
    assert "nothing was saved" in str(e.value) and "nothing was loaded" not in str(e.value)
    assert path.read_text() == damaged  # left as it was
    opt.save_checkpoint(str(tmp_path / "elsewhere"))  # the advice works


def test_a_stage3_save_over_a_damaged_checkpoint_says_nothing_was_saved(tmp_path):
    torch.manual_seed(0)
    model = offload.shard(torch.nn.Sequential(torch.nn.Linear(7, 17), torch.nn.Linear(17, 3)))
    opt = offload.AdamW(model.parameters(), **HP)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    save_checkpoint(model, opt, str(tmp_path / "s3"))
    path = tmp_path / "s3" / SHARD_MANIFEST
    _damage(path)
    with pytest.raises(ValueError, match="nothing was saved"):
        save_checkpoint(model, opt, str(tmp_path / "s3"))
