"""int8 checkpoints of the first int8 code ("unsigned": exp_avg_sq coded without the square
root, [Note: square-root code] in offload/kernels/quant.py) load by conversion: decoded as
that code, encoded in the current one, the same states as loading the old optimizer's
state_dict, and never taken byte for byte."""
from __future__ import annotations

import json
import os

import pytest
import torch

import offload
from offload.kernels import quant

SIZES = [4097, 300, 5000]


@pytest.fixture
def first_code(monkeypatch):
    """Within the fixture's switch, new fields take the first code (the torch backend, which
    encodes through quant.py with each field's code, then runs that scheme)."""
    class Switch:
        def on(self):
            monkeypatch.setattr(quant, "default_code", lambda signed: "signed" if signed else "unsigned")

        def off(self):
            monkeypatch.undo()
    return Switch()


def _params(store, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if store.startswith("flat") else torch.float32  # the flat store
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


def _make(store, params, d, **kw):
    kw = dict(lr=1e-2, weight_decay=0.1, state_dtype="int8", **kw)
    if store in ("nvme", "flat-nvme"):
        os.makedirs(d, exist_ok=True)
        kw.update(offload="nvme", swap_dir=str(d))
    else:
        kw.update(offload="cpu")
    return offload.AdamW(params, **kw)


def _train(opt, params, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            # grads over six decades within a block: the codes differ most there
            p.grad = (torch.randn(p.shape, generator=g) * torch.logspace(0, -6, p.numel())).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("store", ["cpu", "nvme", "flat", "flat-nvme"])
def test_first_code_checkpoint_loads_converted(tmp_path, first_code, store):
    first_code.on()
    params = _params(store)
    old = _make(store, params, tmp_path / "a", backend="torch")
    _train(old, params, 3, 0)
    old.save_checkpoint(str(tmp_path / "ck"))
    sd = old.state_dict()  # decoded by the first code: the values the old optimizer held
    old.close()
    first_code.off()

    rank0 = tmp_path / "ck" / "rank0"
    text = (rank0 / "offload-ckpt.json").read_text()
    assert '"unsigned"' in text and '"sqrt"' not in text  # the file says its code

    via_ckpt, via_sd = _params(store, 1), _params(store, 1)
    a = _make(store, via_ckpt, tmp_path / "b")
    b = _make(store, via_sd, tmp_path / "c")
    a.load_checkpoint(str(tmp_path / "ck"))
    b.load_state_dict(sd)
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys() == sd["state"].keys()
    for i in sa:
        # exp_avg_sq: recoded from the values the old optimizer held, as load_state_dict
        # encodes them; within a step of the sqrt code's map of those values
        assert torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]), i
        ref, got = sd["state"][i]["exp_avg_sq"].float(), sa[i]["exp_avg_sq"].float()
        assert ((got.sqrt() - ref.sqrt()).abs() <= 0.005 * ref.max().sqrt() + 0.08 * ref.sqrt()).all(), i
        # exp_avg: the signed code did not change; kept as stored (the host store) or decoded
        # and encoded again (a decode -> encode moves a negative-max block by at most a step)
        ref, got = sd["state"][i]["exp_avg"], sa[i]["exp_avg"]
        assert ((got - ref).abs() <= 0.0075 * ref.abs().max()).all(), i
        if store == "cpu" and SIZES[i] >= 4096:
            assert torch.equal(got, ref), i
    _train(a, via_ckpt, 1, 9)  # and it trains on
    assert all(torch.isfinite(p.float()).all() for p in via_ckpt)
    a.close()
    b.close()


def test_manifest_without_a_code_is_the_first_code(tmp_path):
    from offload.kernels.fields import StateField
    from offload.zero.checkpoint import checkpoint_fields
    m = {"fields": [{"name": "exp_avg", "dtype": "int8", "block": 256},
                    {"name": "exp_avg_sq", "dtype": "uint8", "block": 256}]}
    theirs = checkpoint_fields(m)
    assert [f.code for f in theirs] == ["signed", "unsigned"]
    mine = offload.AdamW([torch.nn.Parameter(torch.zeros(5000))], state_dtype="int8")
    assert theirs[0] == StateField("exp_avg", torch.int8, 256) and theirs[1] != StateField("exp_avg_sq", torch.uint8, 256)
    mine.close()
    # the packed host checkpoints' entries: [dtype, block] read as the first code
    from offload.zero.ckpt_packed import _form
    assert _form("exp_avg_sq", ["uint8", 256]).code == "unsigned"
    assert _form("exp_avg_sq", ["uint8", 256, "sqrt"]).code == "sqrt"
    assert _form("exp_avg", ["float32", 0]).code == ""
    with pytest.raises(ValueError, match="expected \\[dtype, block\\]"):
        _form("exp_avg", ["float32"])


def test_first_code_shards_reshard_2_to_1(tmp_path, first_code):
    """Flat-store shards in swap stores, saved by 2 ranks in the first code, stream into 1
    rank's store recoded block by block (fill_store_from_shards' general path)."""
    from test_compressed_checkpoint import _rank_store
    from offload.kernels.fields import ADAM
    from offload.zero.checkpoint import fill_store_from_shards
    import test_compressed_checkpoint as tcc

    numels = [[300000, 224288], [2048]]  # shards of whole blocks
    first_code.on()
    old_rule = ADAM.with_state_dtype("int8")
    assert old_rule.fields[1].code == "unsigned"
    gen = torch.Generator().manual_seed(7)
    values = [torch.randn(-(-sum(n) // 2) * 2, generator=gen) for n in numels]
    per_rank = []
    keep = tcc.BACKEND
    tcc.BACKEND = "torch"  # the scheme as quant.py writes it, in the first code
    try:
        for r in range(2):
            per_rank.append(tcc._step_and_save_rank(
                tmp_path, numels, r, old_rule.with_master(), old_rule, values,
                lambda n: torch.randn(n, generator=gen) * torch.logspace(0, -6, n)))
    finally:
        tcc.BACKEND = keep
    first_code.off()
    rule = ADAM.with_state_dtype("int8")
    one, lays1 = _rank_store(tmp_path, "new", numels, 1, 0, rule.with_master(), rule)
    one.load_checkpoint(lambda store, bufs: fill_store_from_shards(str(tmp_path / "ck"), lays1, store, bufs,
                                                                   rule.with_master()), lambda meta: None)
    for k, lay in enumerate(lays1):
        got = one.read(k, 0, sum(numels[k]))
        for name in got:
            want = torch.cat([per_rank[r][k][name] for r in range(2)])
            if name == "exp_avg_sq":  # (read gives values) recoded: the old values in the new code
                assert not torch.equal(got[name], want)
                want = quant.decode_blocks(quant.encode_blocks(want, False), want.numel(), False)
            assert torch.equal(got[name], want), (k, name)
    one.close()


_KILLED_FIRST_CODE = """
import os, signal, sys, torch, offload
from offload.kernels import quant
quant.default_code = lambda signed: "signed" if signed else "unsigned"  # the first int8 code
params = [torch.nn.Parameter(torch.randn(5000))]
opt = offload.AdamW(params, offload="nvme", swap_dir=sys.argv[1], state_dtype="int8", backend="torch")
for _ in range(2):
    params[0].grad = torch.randn(5000)
    opt.step()
print("stepped", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_swap_directory_of_the_first_code_is_not_resumed(tmp_path):
    """Swap files are not converted: resuming one of the first code is refused, saying why and
    what to do, before anything is read as the new code."""
    from test_swap_util import run_python
    proc = run_python(_KILLED_FIRST_CODE, str(tmp_path))
    out, err = proc.communicate(timeout=300)
    assert out.strip() == "stepped", err
    params = [torch.nn.Parameter(torch.randn(5000))]
    with pytest.raises(ValueError, match=r"codes \['signed', 'unsigned'\].*square-root code came later.*"
                                         r"checkpoints convert"):
        offload.AdamW(params, offload="nvme", swap_dir=str(tmp_path), state_dtype="int8", resume=True)
