"""A manifest whose seal key is damaged must not load as an older, unsealed one (swap/fsutil.py):
one flipped bit in "manifest_crc32" made it unchecked, and a step count damaged beside it loaded
silently."""
import json
import os

import pytest
import torch

import offload

SEAL = b'"manifest_crc32"'


def _damaged_variants(raw: bytes):
    """Every one-bit change of the seal key that leaves valid JSON, each with a step count changed too."""
    i = raw.index(SEAL) + 1
    for pos in range(i, i + len(SEAL) - 2):
        for bit in range(7):
            b = bytearray(raw)
            b[pos] ^= 1 << bit
            try:
                m = json.loads(bytes(b))
            except ValueError:
                continue
            if "manifest_crc32" in m:
                continue
            yield bytes(b).replace(b'"steps":[3]', b'"steps":[7]', 1)


def _three_steps(opt, p):
    for _ in range(3):
        p.grad = torch.randn(p.shape, dtype=p.dtype)
        opt.step()


def test_checkpoint_with_a_damaged_seal_key_is_refused(tmp_path):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    (tmp_path / "swap").mkdir()
    opt = offload.AdamW([p], lr=1e-3, offload="nvme", swap_dir=str(tmp_path / "swap"))
    _three_steps(opt, p)
    ck = tmp_path / "ck"
    opt.save_checkpoint(str(ck))
    opt.close()
    path = ck / "rank0" / "offload-ckpt.json"
    raw = path.read_bytes()
    assert b'"steps":[3]' in raw
    n = 0
    for bad in list(_damaged_variants(raw))[::4]:
        path.write_bytes(bad)
        other = offload.AdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-3, offload="cpu")
        with pytest.raises(ValueError, match="manifest"):
            other.load_checkpoint(str(ck))
        n += 1
    assert n >= 8
    path.write_bytes(raw)  # the intact one still loads
    other = offload.AdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-3, offload="cpu")
    other.load_checkpoint(str(ck))
    assert other.state_dict()["state"][0]["step"].item() == 3


def test_resume_from_a_swap_manifest_with_a_damaged_seal_key_is_refused(tmp_path):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    d = str(tmp_path / "swap")
    os.mkdir(d)
    opt = offload.AdamW([p], lr=1e-3, offload="nvme", swap_dir=d)
    _three_steps(opt, p)
    opt.close(keep_swap=True)
    path = os.path.join(d, "offload-flat.rank0", "manifest.json")
    raw = open(path, "rb").read()
    bad = next(_damaged_variants(raw))
    open(path, "wb").write(bad)
    with pytest.raises(ValueError, match="manifest"):
        offload.AdamW([p], lr=1e-3, offload="nvme", swap_dir=d, resume=True)
    open(path, "wb").write(raw)
    again = offload.AdamW([p], lr=1e-3, offload="nvme", swap_dir=d, resume=True)
    assert again.state_dict()["state"][0]["step"].item() == 3
    again.close()
