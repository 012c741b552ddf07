"""Compressed states (bf16, packed int8 blocks) in checkpoints and across a crash: saved as
they are (the manifest's fields carry dtype and block), loaded bit for bit, refused with a
clear message into an optimizer of other state dtypes (the state_dict route converts),
damage detected by the crc32 of the packed bytes, and resume=True after kill -9 equal to an
uninterrupted run."""
from __future__ import annotations

import json
import os

import pytest
import torch

import offload
from test_swap_util import run_python

BIG = 1 << 18
# the torch reference has the compressed path on every machine; OFFLOAD_BACKEND picks another
BACKEND = os.environ.get("OFFLOAD_BACKEND", "torch")
SIZES = (7, 4097, BIG + 3)
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]


def _steps(opt, params, first, last):
    for k in range(first, last):
        gen = torch.Generator().manual_seed(50 + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _opt(params, d, state_dtype, **kw):
    os.makedirs(d, exist_ok=True)
    return offload.AdamW(params, offload="nvme", swap_dir=str(d), state_dtype=state_dtype,
                         sub_group_size=BIG, backend=BACKEND, **dict(HP, **kw))


def _same(o1, p1, o2, p2):
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for i in s1:
        for k in s1[i]:
            assert torch.equal(s1[i][k], s2[i][k]), (i, k)


@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_nvme_checkpoint_round_trip_bit_for_bit(tmp_path, state_dtype):
    params = _params()
    opt = _opt(params, tmp_path / "a", state_dtype)
    _steps(opt, params, 0, 2)
    opt.save_checkpoint(str(tmp_path / "ck"))
    m = json.load(open(tmp_path / "ck" / "rank0" / "offload-ckpt.json"))
    want = {"int8": [{"name": "exp_avg", "dtype": "int8", "block": 256, "code": "signed"},
                     {"name": "exp_avg_sq", "dtype": "uint8", "block": 256, "code": "sqrt"}],
            "bfloat16": [{"name": "exp_avg", "dtype": "bfloat16"}, {"name": "exp_avg_sq", "dtype": "bfloat16"}]}
    assert m["fields"] == want[state_dtype]
    if state_dtype == "int8":  # packed bytes, each param on its own blocks
        n = sum(-(-s // 256) * 256 for s in SIZES[:-1]) + SIZES[-1]
        assert m["numel"] == n and os.path.getsize(tmp_path / "ck" / "rank0" / m["files"]["exp_avg"]) >= \
            -(-n // 256) * 260
    copy = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _opt(copy, tmp_path / "b", state_dtype)
    opt2.load_checkpoint(str(tmp_path / "ck"))
    _same(opt, params, opt2, copy)
    _steps(opt, params, 2, 3)
    _steps(opt2, copy, 2, 3)
    _same(opt, params, opt2, copy)
    opt.close()
    opt2.close()


@pytest.mark.parametrize("offload_to", ["none", "cpu"])
@pytest.mark.parametrize("master_dtype", [None, "bfloat16"])
def test_flat_store_int8_checkpoint_loads_into_the_same_optimizer(tmp_path, offload_to, master_dtype):
    """bf16 params keep their states in the flat store, whose int8 shards are padded to whole
    blocks: a checkpoint of params whose total is no multiple of 256 loads back bit for bit
    (the loader once took the saver's shards for unpadded ones and refused its own checkpoint)."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16)) for n in (70000, 100, 4097)]
    kw = dict(HP, offload=offload_to, state_dtype="int8", master_dtype=master_dtype, backend=BACKEND)
    opt = offload.AdamW(params, **kw)
    _steps(opt, params, 0, 2)
    opt.save_checkpoint(str(tmp_path / "ck"))
    copy = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = offload.AdamW(copy, **kw)
    opt2.load_checkpoint(str(tmp_path / "ck"))
    _same(opt, params, opt2, copy)
    _steps(opt, params, 2, 3)
    _steps(opt2, copy, 2, 3)
    _same(opt, params, opt2, copy)
    opt.close()
    opt2.close()


def test_other_state_dtype_converts_at_stage_0_and_the_flat_store_refuses(tmp_path):
    params = _params()
    opt = _opt(params, tmp_path / "a", "int8")
    _steps(opt, params, 0, 2)
    opt.save_checkpoint(str(tmp_path / "ck"))
    (tmp_path / "b").mkdir()
    fp32 = offload.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], offload="nvme",
                         swap_dir=str(tmp_path / "b"), backend=BACKEND, **HP)
    fp32.load_checkpoint(str(tmp_path / "ck"))  # fp32 params in place: decoded as it loads
    sd = opt.state_dict()
    for i, st in fp32.state_dict()["state"].items():  # the dequantized values, as state_dict() gives them
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], sd["state"][i][k])
    opt.close()
    fp32.close()
    # bf16 params: the flat store, whose shards do not convert: refused, naming both and the way
    bf = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params]
    for p in bf:
        p.grad = torch.ones_like(p)
    q8 = _opt(bf, tmp_path / "c", "int8")
    q8.step()
    q8.save_checkpoint(str(tmp_path / "ck2"))
    f32 = _opt([torch.nn.Parameter(p.detach().clone()) for p in bf], tmp_path / "d", "float32")
    with pytest.raises(ValueError, match=r"int8 in blocks of 256.*float32.*state_dict\(\)"):
        f32.load_checkpoint(str(tmp_path / "ck2"))
    f32.load_state_dict(q8.state_dict())
    q8.close()
    f32.close()


def test_a_refused_bf16_master_checkpoint_is_not_called_one_of_fp32_params(tmp_path):
    # bf16 params with master_dtype="bfloat16" keep no master, and the refusal described their
    # checkpoint as "fp32 CPU params updated in place (stage 0 ...)", which it is not.
    bf = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params()]
    kw = dict(HP, offload="cpu", state_dtype="int8", backend=BACKEND)
    own = offload.AdamW(bf, master_dtype="bfloat16", **kw)
    _steps(own, bf, 0, 1)
    own.save_checkpoint(str(tmp_path / "ck"))
    fp32_master = offload.AdamW([torch.nn.Parameter(p.detach().clone()) for p in bf], **kw)
    with pytest.raises(ValueError, match=r"exp_avg_sq \(uint8 in blocks of 256, sqrt code\): no fp32 master .*"
                                         r"or bf16 params with master_dtype='bfloat16'\); this optimizer keeps master"):
        fp32_master.load_checkpoint(str(tmp_path / "ck"))
    own.close()
    fp32_master.close()


def test_corrupt_or_truncated_packed_file_is_detected(tmp_path):
    params = _params()
    opt = _opt(params, tmp_path / "a", "int8")
    _steps(opt, params, 0, 1)
    opt.save_checkpoint(str(tmp_path / "ck"))
    d = tmp_path / "ck" / "rank0"
    m = json.load(open(d / "offload-ckpt.json"))
    path = d / m["files"]["exp_avg_sq"]
    before = opt.state_dict()
    with open(path, "r+b") as f:  # one absmax byte of the second block
        f.seek(260 + 257)
        b = f.read(1)
        f.seek(260 + 257)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(OSError, match="crc32"):
        opt.load_checkpoint(str(tmp_path / "ck"))
    os.truncate(path, 4096)
    with pytest.raises((OSError, ValueError), match="bytes"):
        opt.load_checkpoint(str(tmp_path / "ck"))
    after = opt.state_dict()  # the failed loads changed nothing
    for i in before["state"]:
        for k in before["state"][i]:
            assert torch.equal(before["state"][i][k], after["state"][i][k])
    opt.close()


_KILLED = """
import os, signal, sys, torch, offload
sys.path.insert(0, os.path.dirname(sys.argv[2]))
from test_compressed_checkpoint import _params, _steps, _opt
params = _params()
opt = _opt(params, sys.argv[1], sys.argv[3], verify=True)
_steps(opt, params, 0, 2)
torch.save([p.detach() for p in params], os.path.join(sys.argv[1], "params.pt"))
print("saved", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_resume_after_kill_equals_an_uninterrupted_run(tmp_path, state_dtype):
    d = tmp_path / "swap"
    d.mkdir()
    proc = run_python(_KILLED, str(d), __file__, state_dtype)
    out, err = proc.communicate(timeout=300)
    assert out.strip() == "saved", err
    saved = torch.load(d / "params.pt")
    os.unlink(d / "params.pt")
    params = [torch.nn.Parameter(t.clone()) for t in saved]
    opt = _opt(params, d, state_dtype, verify=True, resume=True)
    _steps(opt, params, 2, 4)
    ref_params = _params()
    ref = _opt(ref_params, tmp_path / "ref", state_dtype, verify=True)
    _steps(ref, ref_params, 0, 4)
    _same(opt, params, ref, ref_params)
    assert int(opt.state_dict()["state"][0]["step"]) == 4
    opt.close()
    ref.close()


# ---------------------------------------------------------------------------- N -> M, shards in swap stores
def _rank_store(tmp_path, tag, numels, world, rank, fields, rule, values=None):
    from offload.optim.swapped_shards import SwappedShards
    from offload.zero.partition import FlatLayout

    layouts = [FlatLayout(n, world, rank) for n in numels]
    d = tmp_path / f"swap-{tag}"
    d.mkdir(exist_ok=True)
    sh = SwappedShards([lay.shard for lay in layouts], swap_dir=str(d), identity={"tag": tag}, extra=dict,
                       fields=fields, rule=rule, sub_group_size=BIG, rank=rank, backend=BACKEND)
    if values is not None:  # master from the global flat values, states from steps
        sh.initialise(lambda k, lo, hi, out: out.copy_(values[k][layouts[k].shard_range()[0] + lo:][:hi - lo]))
    return sh, layouts


def _step_and_save_rank(tmp_path, numels, rank, fields, rule, values, grad):
    """Rank ``rank`` of 2: a swap store of ``numels``, one AdamW step with ``grad(n)`` as
    each shard's grad, saved under tmp_path/ck/rank<r>; the stepped states read back."""
    from offload.optim.swapped_shards import WorkItem
    from offload.swap.checkpoint import save_store

    sh, lays = _rank_store(tmp_path, f"old{rank}", numels, 2, rank, fields, rule, values)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True, step=1, grad_scale=1.0)
    sh.step([WorkItem(k, 0, lay.shard, grad(lay.shard), hp, None, "copy") for k, lay in enumerate(lays) if lay.shard])
    stepped = [sh.read(k, 0, lay.shard) for k, lay in enumerate(lays)]
    meta = dict(kind="flat", world=2, rank=rank, groups=[list(n) for n in numels], save_id=1,
                steps=[1] * sum(len(n) for n in numels))
    sh.save(lambda store, bufs: save_store(store, bufs, str(tmp_path / "ck" / f"rank{rank}"), meta))
    sh.close()
    return stepped


@pytest.mark.parametrize("numels", [[[300000, 224288], [2048]], [[5, 250], [100000, 1]]])
def test_reshard_world_2_to_1_and_back_bit_for_bit(tmp_path, numels):
    from offload.kernels.fields import ADAM
    from offload.swap.checkpoint import save_store
    from offload.zero.checkpoint import fill_store_from_shards

    rule = ADAM.with_state_dtype("int8")
    fields = rule.with_master()
    gen = torch.Generator().manual_seed(7)
    values = [torch.randn(-(-sum(n) // 2) * 2, generator=gen) for n in numels]
    aligned = all((sum(n) // 2) % 256 == 0 for n in numels)
    per_rank = [_step_and_save_rank(tmp_path, numels, r, fields, rule, values, lambda n: torch.randn(n, generator=gen))
                for r in range(2)]
    one, lays1 = _rank_store(tmp_path, "new", numels, 1, 0, fields, rule)
    fill = lambda store, bufs: fill_store_from_shards(str(tmp_path / "ck"), lays1, store, bufs, fields)
    if not aligned:  # a block would straddle two ranks: refused, the store unchanged
        with pytest.raises(ValueError, match="whole blocks"):
            one.load_checkpoint(fill, lambda meta: None)
        one.close()
        return
    one.load_checkpoint(fill, lambda meta: None)
    for k, lay in enumerate(lays1):
        got = one.read(k, 0, sum(numels[k]))
        for name in got:
            want = torch.cat([per_rank[r][k][name] for r in range(2)])[:sum(numels[k])]
            assert torch.equal(got[name], want), (k, name)
    meta = dict(kind="flat", world=1, rank=0, groups=[list(n) for n in numels], save_id=2,
                steps=[1] * sum(len(n) for n in numels))  # (one count per param, as a store writes)
    one.save(lambda store, bufs: save_store(store, bufs, str(tmp_path / "ck1" / "rank0"), meta))
    one.close()
    for r in range(2):  # 1 -> 2: each rank gets back its own bytes
        sh, lays = _rank_store(tmp_path, f"back{r}", numels, 2, r, fields, rule)
        sh.load_checkpoint(lambda store, bufs: fill_store_from_shards(str(tmp_path / "ck1"), lays, store, bufs,
                                                                      fields), lambda meta: None)
        for k, lay in enumerate(lays):
            got = sh.read(k, 0, lay.shard)
            assert all(torch.equal(got[n], per_rank[r][k][n]) for n in got), (r, k)
        sh.close()


def test_stage0_format_is_per_param_packed_tensors_end_to_end(tmp_path):
    """SwappedState's int8 checkpoint holds each param's packed blocks one after the other: the
    bytes a host store of per-param packed tensors saves (ckpt_states.save_states(fields=)),
    so such a checkpoint moves between the two as it is, both ways."""
    from offload.kernels.compressed_ref import decode_state
    from offload.kernels.fields import ADAM
    from offload.zero.ckpt_states import load_states, save_states, stage0_numel

    rule = ADAM.with_state_dtype("int8")
    params = _params()
    opt = _opt(params, tmp_path / "a", "int8")
    _steps(opt, params, 0, 2)
    opt.save_checkpoint(str(tmp_path / "ck"))
    numels = [p.numel() for p in params]
    scratch = {f.name: [torch.empty(f.storage_numel(n), dtype=torch.uint8) for n in numels] for f in rule.fields}
    meta = load_states(str(tmp_path / "ck"), numels, scratch, rule.fields)
    assert meta["steps"] == [2, 2, 2] and stage0_numel(numels, rule.fields) == 256 + 4352 + BIG + 3
    sd = opt.state_dict()["state"]
    for f in rule.fields:
        for i, n in enumerate(numels):
            assert torch.equal(decode_state(f, scratch[f.name][i], n), sd[i][f.name].reshape(-1))
    # back: per-param packed tensors (changed) saved by the host format, loaded by SwappedState
    for t in scratch["exp_avg"]:
        t.view(-1, 260)[:, :256] = 200  # other codes, same absmax
    save_states(str(tmp_path / "ck2"), numels, scratch, dict(meta), fields=rule.fields)
    opt.load_checkpoint(str(tmp_path / "ck2"))
    sd = opt.state_dict()["state"]
    for f in rule.fields:
        for i, n in enumerate(numels):
            assert torch.equal(decode_state(f, scratch[f.name][i], n), sd[i][f.name].reshape(-1))
    opt.close()
