"""[Note: writes before the counts] (offload/optim/step_guard.py): states written since the last
step (Adagrad's initial sum, an assigned opt.state[p][k]) are committed with the counts as they
were, before the step advances them. Committed inside the store's step, they went into the
manifest with the new counts: a kill -9 before the step's own commit left a manifest one step
ahead of its data, and resume=True went on from it. The child here dies right where the swap
step begins, after that commit."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import offload

CHILD = textwrap.dedent("""
    import os, sys, torch, offload
    from offload.optim import swapped_shards as S
    orig = S.SwappedShards._step
    def dies(self, *a, **k):  # a kill -9 where the swap step begins (after any commit of writes)
        self._cache.flush(self._meta)  # what the step does first
        os._exit(9)
    S.SwappedShards._step = dies
    dtype = getattr(torch, sys.argv[3])
    ps = [torch.nn.Parameter((torch.ones(5000) * (i + 1)).to(dtype)) for i in range(2)]
    o = getattr(offload, sys.argv[2])(ps, lr=0.1, offload="nvme", swap_dir=sys.argv[1])
    if sys.argv[2] == "AdamW":
        p = ps[0]
        p.grad = torch.ones_like(p)
        S.SwappedShards._step = orig
        o.step()                                                 # step 1 goes through
        S.SwappedShards._step = dies
        o.state[p]["exp_avg"] = torch.full((5000,), 0.5)         # a write before step 2
    for p in ps:
        p.grad = torch.ones_like(p)
    o.step()
""")


@pytest.mark.parametrize("cls,dtype", [("Adagrad", "float32"), ("Adagrad", "bfloat16"), ("AdamW", "float32"),
                                       ("AdamW", "bfloat16")])
def test_a_kill_after_the_commit_of_writes_resumes_at_the_step_before(tmp_path, cls, dtype):
    d = str(tmp_path / "swap")
    os.makedirs(d)
    r = subprocess.run([sys.executable, "-c", CHILD, d, cls, dtype], env=dict(os.environ), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    m = json.load(open(glob.glob(d + "/offload-*/manifest.json")[0]))
    done = 1 if cls == "AdamW" else 0  # AdamW: its first step went through
    assert m["step"] == done and set(m["extra"]["steps"]) <= {0, done}, m["extra"]["steps"]
    ps = [torch.nn.Parameter((torch.ones(5000) * (i + 1)).to(getattr(torch, dtype))) for i in range(2)]
    if cls == "AdamW":  # the params of step 1, for the resume's fingerprint: rebuilt by the first step
        ref = offload.AdamW([torch.nn.Parameter(ps[0].detach().clone())], lr=0.1)
        ref.param_groups[0]["params"][0].grad = torch.ones_like(ps[0])
        ref.step()
        with torch.no_grad():
            ps[0].copy_(ref.param_groups[0]["params"][0])
    o = getattr(offload, cls)(ps, lr=0.1, offload="nvme", swap_dir=d, resume=True)
    try:
        sd = o.state_dict()["state"]
        assert int(sd[0]["step"]) == done
        if cls == "AdamW":
            assert torch.equal(sd[0]["exp_avg"], torch.full((5000,), 0.5))  # the write, at the step it was made
    finally:
        o.close()
