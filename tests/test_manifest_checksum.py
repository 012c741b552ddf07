"""A checkpoint manifest carries its own crc32 ([Note: sealed manifests] in offload/swap/fsutil.py):
a digit changed in its steps, an lr or a shape fails the load naming the file; a manifest without
one (an older release's) still loads."""
import json
import os
import re

import pytest
import torch

import offload
from offload.shard import load_checkpoint, save_checkpoint
from offload.shard.checkpoint import MANIFEST as SHARD_MANIFEST
from offload.swap import fsutil

SIZES = [1, 7, 17, 4097]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _train(opt, params, steps):
    for s in range(steps):
        g = torch.Generator().manual_seed(50 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _saved(tmp_path, offl="cpu"):
    ps = _params()
    opt = offload.AdamW(ps, lr=0.0125, weight_decay=0.01, offload=offl)
    _train(opt, ps, 3)
    opt.save_checkpoint(str(tmp_path / "ck"))
    return ps, opt, tmp_path / "ck" / "rank0" / "offload-ckpt.json"


def _fresh():
    ps = _params(seed=1)
    return ps, offload.AdamW(ps, lr=0.5, offload="cpu")


def _edit(path, pattern, repl):
    """Change the manifest's text (still valid JSON: its checksum must catch it, not the parser)."""
    text = path.read_text()
    new, n = re.subn(pattern, repl, text, count=1)
    assert n == 1 and new != text, (pattern, text[:300])
    json.loads(new)
    path.write_text(new)


FLIPS = {  # what a digit flipped in a manifest changed silently before it had a checksum
    "steps": (r'"steps":\[3,', '"steps":[4,'),
    "lr": (r'"lr":0\.0125', '"lr":0.0175'),
    "shape": (r'"shapes":\[\[1\],\[7\]', '"shapes":[[1],[8]'),
    # its last digit (a first 9 -> 0 would not be JSON; the crc differs per save: meta's save_id)
    "the seal itself": (r'("manifest_crc32":\d*)(\d)', lambda m: m.group(1) + str((int(m.group(2)) + 1) % 10)),
}


@pytest.mark.parametrize("what", list(FLIPS))
def test_a_flipped_digit_fails_the_load_naming_the_file(tmp_path, what):
    _, _, path = _saved(tmp_path)
    _edit(path, *FLIPS[what])
    ps, new = _fresh()
    before = {k: v.clone() for k, v in new.state_dict()["state"].get(0, {}).items()}
    with pytest.raises(ValueError, match=re.escape(f"{path}: the manifest fails its own checksum")):
        new.load_checkpoint(str(tmp_path / "ck"))
    assert new.param_groups[0]["lr"] == 0.5 and new.state_dict()["state"].get(0, {}).keys() == before.keys()


def test_a_truncated_manifest_fails_naming_the_file(tmp_path):
    _, _, path = _saved(tmp_path)
    text = path.read_text()
    path.write_text(text[:len(text) // 2])
    _, new = _fresh()
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a valid manifest")):
        new.load_checkpoint(str(tmp_path / "ck"))


@pytest.mark.parametrize("offl", ["cpu", "nvme"])
def test_an_old_manifest_without_a_checksum_loads(tmp_path, offl):
    kw = {}
    if offl == "nvme":
        os.makedirs(tmp_path / "swap")
        kw = {"swap_dir": str(tmp_path / "swap")}
    ps = _params()
    opt = offload.AdamW(ps, lr=0.0125, weight_decay=0.01, offload=offl, **kw)
    _train(opt, ps, 3)
    opt.save_checkpoint(str(tmp_path / "ck"))
    path = tmp_path / "ck" / "rank0" / "offload-ckpt.json"
    m = json.loads(path.read_text())
    assert isinstance(m.pop(fsutil.SEAL), int)  # written with one
    path.write_text(json.dumps(m))  # as the previous release wrote it: no seal
    qs = _params(seed=1)
    new = offload.AdamW(qs, lr=0.5, offload=offl, **kw)
    new.load_checkpoint(str(tmp_path / "ck"))
    assert new.param_groups[0]["lr"] == 0.0125
    for i in range(len(SIZES)):
        a, b = opt.state_dict()["state"][i], new.state_dict()["state"][i]
        assert float(a["step"]) == float(b["step"]) == 3
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    opt.close()
    new.close()


def test_a_save_over_an_old_manifest_seals_the_new_one(tmp_path):
    ps, opt, path = _saved(tmp_path)
    m = json.loads(path.read_text())
    m.pop(fsutil.SEAL)
    path.write_text(json.dumps(m))
    opt.save_checkpoint(str(tmp_path / "ck"))
    assert fsutil.SEAL in json.loads(path.read_text())


def test_the_seal_survives_what_json_changes(tmp_path):
    # int keys come back as strings and sort otherwise: writer and reader must hash the same bytes
    obj = {"a": {2: 1, 10: 2, 1: 3}, "lr": 1e-3, "nan": float("inf"), "t": (1, 2), "s": "ü"}
    fsutil.write_json_atomic(str(tmp_path), "m.json", fsutil.sealed(obj))
    path = str(tmp_path / "m.json")
    got = fsutil.unsealed(fsutil.read_json(path), path)
    assert got == json.loads(json.dumps(obj)) and fsutil.SEAL not in got
    with pytest.raises(TypeError, match="a sealed manifest is a JSON object, got list"):
        fsutil.sealed([1, 2])


def _stage3(lr):
    torch.manual_seed(0)
    model = offload.shard(torch.nn.Sequential(torch.nn.Linear(7, 17), torch.nn.Linear(17, 3)))
    opt = offload.AdamW(model.parameters(), lr=lr)
    return model, opt


def test_a_stage3_manifest_is_sealed_too(tmp_path):
    model, opt = _stage3(0.0125)
    for _ in range(2):
        model(torch.randn(4, 7)).sum().backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(model, opt, str(tmp_path / "s3"))
    path = tmp_path / "s3" / SHARD_MANIFEST
    m2, o2 = _stage3(0.5)
    load_checkpoint(m2, o2, str(tmp_path / "s3"))  # as written: loads
    assert o2.param_groups[0]["lr"] == 0.0125
    _edit(path, r'"lr":0\.0125', '"lr":0.0175')
    m3, o3 = _stage3(0.5)
    with pytest.raises(ValueError, match=re.escape(f"{path}: the manifest fails its own checksum")):
        load_checkpoint(m3, o3, str(tmp_path / "s3"))
    assert o3.param_groups[0]["lr"] == 0.5
    m = json.loads(path.read_text())
    m.pop(fsutil.SEAL)
    m["optimizer"]["param_groups"][0]["hyper"]["lr"] = 0.0125
    path.write_text(json.dumps(m))  # an older release's: no seal, loads
    m4, o4 = _stage3(0.5)
    load_checkpoint(m4, o4, str(tmp_path / "s3"))
    assert o4.param_groups[0]["lr"] == 0.0125
