"""The flat store with ``offload="nvme"``: the fp32 master and both moments of fp16/bf16 (or
mixed) params live in swap files.

Reference: the same optimizer with ``offload="cpu"``: same kernel, same order of operations,
so params, masters and moments must be equal bit for bit, across sub-group sizes that cut
params, several param groups, checkpoints both ways, a failed step and a kill -9 + resume.
"""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.nn as nn

import offload
from offload.swap import SwapStepError
from test_flat_state import _model as _net
from test_swap_util import FaultyEngine, run_python
import _internals as internals

HP = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)


def _model(seed: int = 0, dtype=torch.bfloat16) -> nn.Module:
    return _net(dtype, seed)


def _batch(step: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(6, 17, generator=torch.Generator().manual_seed(100 + step)).to(dtype)


def train(model, opt, first: int, last: int, dtype=torch.bfloat16) -> None:
    """Steps first..last-1; the side branch runs on even steps only (per-param step counts differ)."""
    for s in range(first, last):
        model(_batch(s, dtype), use_side=s % 2 == 0).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def assert_same(a, opt_a, b, opt_b) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(internals.master(opt_a, p), internals.master(opt_b, q))
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sorted(sa[k]) == sorted(sb[k])
        for key in sa[k]:
            assert torch.equal(sa[k][key], sb[k][key]), (k, key)


def _nvme(model, swap, **kw):
    swap.mkdir(exist_ok=True)
    return offload.AdamW(model.parameters(), offload="nvme", swap_dir=str(swap), **dict(HP, **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sub", [1024, None], ids=["sub1024", "auto"])
def test_nvme_equals_cpu_bit_for_bit(tmp_path, dtype, sub):
    ref, ours = _model(dtype=dtype), _model(dtype=dtype)
    opt = _nvme(ours, tmp_path, sub_group_size=sub, max_grad_norm=0.5)
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", max_grad_norm=0.5, **HP)
    train(ref, opt_ref, 0, 5, dtype)
    train(ours, opt, 0, 5, dtype)
    assert_same(ref, opt_ref, ours, opt)
    rep = opt.memory_report()
    assert rep["detail"]["state_bytes"] == 0 and rep["tiers"]["nvme"] > 0
    path = internals.swap(opt).swap_path
    opt.close()
    opt_ref.close()
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


def test_mixed_dtypes_and_param_groups(tmp_path):
    # fp32 and bf16 params in one optimizer (two flat groups; the fp32 params get the master
    # copied into them) and two param groups with their own lr.
    def build(seed):
        m = _model(seed)
        m.out.float()
        return m

    def groups(m):
        return [{"params": [p for n, p in m.named_parameters() if not n.startswith("out")]},
                {"params": list(m.out.parameters()), "lr": 1e-2}]

    ref, ours = build(0), build(0)
    opt_ref = offload.AdamW(groups(ref), offload="cpu", **HP)
    opt = offload.AdamW(groups(ours), offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, **HP)
    for s in range(4):
        for m, o in ((ref, opt_ref), (ours, opt)):
            x = _batch(s)
            h = m.norm(m.frozen(torch.nn.functional.gelu(m.inp(x))))
            m.out(h.float()).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert_same(ref, opt_ref, ours, opt)
    opt.close()


def test_checkpoints_move_between_nvme_and_cpu(tmp_path):
    full, a = _model(), _model()
    opt_full = offload.AdamW(full.parameters(), offload="cpu", **HP)
    train(full, opt_full, 0, 6)
    # nvme saves, cpu and nvme (another sub-group size) load; fresh models: params come back too.
    opt_a = _nvme(a, tmp_path / "sa", sub_group_size=1024)
    train(a, opt_a, 0, 3)
    opt_a.save_checkpoint(str(tmp_path / "ck1"))
    b, c = _model(seed=9), _model(seed=8)
    opt_b = offload.AdamW(b.parameters(), offload="cpu", **HP)
    opt_c = _nvme(c, tmp_path / "sc", sub_group_size=2048)
    opt_b.load_checkpoint(str(tmp_path / "ck1"))
    opt_c.load_checkpoint(str(tmp_path / "ck1"))
    # ...and cpu saves, nvme loads.
    opt_b.save_checkpoint(str(tmp_path / "ck2"))
    d = _model(seed=7)
    opt_d = _nvme(d, tmp_path / "sd")
    opt_d.load_checkpoint(str(tmp_path / "ck2"))
    for m, o in ((a, opt_a), (b, opt_b), (c, opt_c), (d, opt_d)):
        train(m, o, 3, 6)
        assert_same(full, opt_full, m, o)
        o.close()


def test_failed_write_restores_params_and_the_step_can_be_retried(tmp_path):
    ref, ours = _model(), _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    opt = _nvme(ours, tmp_path, sub_group_size=1024)
    store = internals.swap(opt).store
    faulty = FaultyEngine(store.engine, op="write", fail_at=0)
    store.engine = faulty
    train(ref, opt_ref, 0, 3)
    train(ours, opt, 0, 2)
    before = [p.detach().clone() for p in ours.parameters()]
    masters = [internals.master(opt, p) for p in ours.parameters()]
    steps = {k: float(v["step"]) for k, v in opt.state_dict()["state"].items()}
    ours(_batch(2), use_side=True).float().pow(2).mean().backward()
    faulty.arm(3)  # the third sub-group's write fails: two sub-groups were computed already
    with pytest.raises(SwapStepError, match="restored from that step") as e:
        opt.step()
    assert "still hold step 2" in str(e.value)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), before))
    assert all(torch.equal(internals.master(opt, p), m) for p, m in zip(ours.parameters(), masters))
    assert {k: float(v["step"]) for k, v in opt.state_dict()["state"].items()} == steps
    faulty.arm(0)
    opt.step()  # the same grads again
    opt.zero_grad()
    train(ours, opt, 3, 3)
    assert_same(ref, opt_ref, ours, opt)
    opt.close()


_CHILD = r"""
import sys, time, torch, offload
from offload.swap.pipeline import SwapPipeline
from test_flat_swap import HP, _model, train

swap, mode = sys.argv[1], sys.argv[2]
torch.set_num_threads(int(sys.argv[3]))  # the parent's: the same forward/backward sums
model = _model()
opt = offload.AdamW(model.parameters(), offload="nvme", swap_dir=swap, sub_group_size=1024, **HP)
state = {"step": 0}
orig = SwapPipeline.run

def run(self, groups, compute, **kw):
    def slow(g, s, e, t):
        compute(g, s, e, t)
        if state["step"] == 3 and g == 1:
            print("mid", flush=True)
            time.sleep(60)
    return orig(self, groups, slow, **kw)

SwapPipeline.run = run
if mode == "exit":  # leave the directory behind without a kill: no atexit handlers
    train(model, opt, 0, 2)
    import os
    os._exit(0)
print("ready", flush=True)
for s in range(100):
    state["step"] = s
    train(model, opt, s, s + 1)
"""


def test_kill_9_mid_step_then_resume_is_bit_exact(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    p = run_python(_CHILD, str(swap), "kill", str(torch.get_num_threads()))
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    assert p.stdout.readline().strip() == "mid", p.stderr.read()
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert json.load(open(swap / "offload-flat.rank0" / "manifest.json"))["step"] == 3  # 0, 1, 2 finished
    ref = _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    train(ref, opt_ref, 0, 6)
    # Other initial values: the params come back from the masters of the last finished step (3).
    ours = _model(seed=5)
    opt = _nvme(ours, swap, sub_group_size=1024, resume=True)
    assert max(float(st["step"]) for st in opt.state.values()) == 3
    train(ours, opt, 3, 6)
    assert_same(ref, opt_ref, ours, opt)
    opt.close()
    assert os.listdir(swap) == []


def test_resume_checks_the_params_and_their_layout(tmp_path):
    p = run_python(_CHILD, str(tmp_path), "exit", str(torch.get_num_threads()))
    assert p.wait() == 0, p.stderr.read()
    other = nn.Linear(4, 4).bfloat16()
    with pytest.raises(ValueError, match="states of other params .3142 elements"):
        offload.AdamW(other.parameters(), offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, resume=True)
    with pytest.raises(ValueError, match="written with sub_group_size=1024: pass sub_group_size=1024"):
        _nvme(_model(), tmp_path, sub_group_size=2048, resume=True)
    # The same number of elements in another order: the flat groups differ.
    shuffled = list(reversed(list(_model().parameters())))
    with pytest.raises(ValueError, match="states of other params"):
        offload.AdamW(shuffled, offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, resume=True, **HP)
    ours = _model(seed=4)
    opt = _nvme(ours, tmp_path, sub_group_size=1024, resume=True)
    ref = _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    train(ref, opt_ref, 0, 2)
    assert_same(ref, opt_ref, ours, opt)
    opt.close()


def test_flipped_bit_in_a_swapped_master_is_detected_and_nothing_applied(tmp_path):
    model = _model()
    opt = _nvme(model, tmp_path, sub_group_size=1024, verify=True)
    train(model, opt, 0, 2)
    sw = internals.swap(opt)
    path = sw.store.read_slot_file(1)
    off = sw.layout.group_offset(1) + 100  # the master of sub-group 1, block 0
    fd = os.open(path, os.O_RDWR)
    b = os.pread(fd, 1, off)
    os.pwrite(fd, bytes([b[0] ^ 0x04]), off)
    os.close(fd)
    before = [p.detach().clone() for p in model.parameters()]
    model(_batch(2), use_side=True).float().pow(2).mean().backward()
    with pytest.raises(SwapStepError, match="checksum mismatch in block 0 .* of master of sub-group 1") as e:
        opt.step()
    assert e.value.filename == path
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.close()


def test_shards_vote_every_step_even_with_nothing_to_step(tmp_path):
    # Several ranks: a rank whose shard got no grads this step still takes part in the vote
    # ([Note: ranks vote before commit]), else the others would wait for it forever.
    from offload.optim.swapped_shards import SwappedShards

    votes, peers = [], [[], [], [1]]
    sh = SwappedShards([4096], swap_dir=str(tmp_path), identity={}, extra=dict,
                       vote=lambda ok: votes.append(ok) or peers.pop(0))
    assert sh.step([]) == {} and votes == [True, True]  # both votes, as a rank with items
    with pytest.raises(SwapStepError, match="applied on no rank: the swap step of rank 1 failed"):
        sh.step([])
    assert votes == [True, True, True]  # the first vote failed: no second
    sh.close()
