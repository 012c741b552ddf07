"""Streamed loading (offload.shard.load_weights, shard(weights=)) and saving
(offload.shard.full_state_dict) of a sharded model: round trips through safetensors and torch
files on 1, 2 and 3 gloo ranks, bit for bit, with params of the contract's sizes (1, 7, 15,
16, 17, 4097, 2**20 + 3: slots that straddle the ranks' chunks), a param tied across units,
a frozen param and a buffer; each rank reads only its own slices; torch's load_state_dict
errors, word for word."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import offload
from offload.shard import full_state_dict, gathered_params, load_weights, runtime_of
from offload.shard import weights as weights_mod
import _ranks

SIZES = [(1,), (7, 1), (3, 5), (16,), (17, 1), (17, 241), (2 ** 20 + 3,), (1031, 1017)]


class Holder(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.n = len(shapes)
        for i, s in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(s)))

    def forward(self, x):
        for i in range(self.n):
            x = x + getattr(self, f"p{i}").square().mean()
        return x + (self.tied.sum() if hasattr(self, "tied") else 0)


class Model(nn.Module):
    """Two units of the contract's sizes, a param tied across them (the root's), a leftover
    param (the root's), a frozen one and a persistent buffer (both whole on every rank)."""

    def __init__(self):
        super().__init__()
        self.units = nn.ModuleList([Holder(SIZES[:5]), Holder(SIZES[5:])])
        self.units[1].tied = self.units[0].p2  # blocks 0 and 1 both hold it
        self.head = nn.Linear(5, 3)
        self.frozen = nn.Parameter(torch.randn(4, 3), requires_grad=False)
        self.register_buffer("stat", torch.arange(6, dtype=torch.int64))

    def forward(self, x):
        x = self.head(x) @ self.frozen.T
        for u in self.units:
            x = u(x)
        return x.sum()


def _ref(seed=0):
    torch.manual_seed(seed)
    return Model()


def _np(sd):
    return {k: v.numpy() for k, v in sd.items()}


def _equal(got, ref):
    assert list(got) == list(ref)
    for k in ref:
        g = torch.from_numpy(got[k]) if not isinstance(got[k], torch.Tensor) else got[k]
        assert g.dtype == ref[k].dtype and g.shape == ref[k].shape, k
        assert torch.equal(g, ref[k]), k


def _files(tmp_path, sd):
    """The reference state dict as a torch file and a safetensors file (no shared tensors there)."""
    pt, st = str(tmp_path / "ref.pt"), str(tmp_path / "ref.safetensors")
    torch.save(sd, pt)
    save_file({k: v.clone() for k, v in sd.items()}, st)
    return {"torch": pt, "safetensors": st}


# ---------------------------------------------------------------------- one rank
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_full_state_dict_round_trip(tmp_path, fmt):
    ref = _ref()
    sd = ref.state_dict()
    m = offload.shard(copy.deepcopy(ref))
    _equal(full_state_dict(m), sd)
    path = tmp_path / f"full.{fmt}"
    assert full_state_dict(m, path, fmt=fmt) is None
    assert not [f for f in os.listdir(tmp_path) if "partial" in f]
    loaded = torch.load(path, mmap=True, weights_only=True) if fmt == "torch" else {}
    if fmt == "torch":
        assert list(loaded) == list(sd)  # state_dict()'s order, the tied param one tensor
        assert loaded["units.0.p2"].data_ptr() == loaded["units.1.tied"].data_ptr()
    if fmt == "safetensors":
        with safe_open(str(path), "pt") as f:
            loaded = {k: f.get_tensor(k) for k in f.keys()}
    plain = _ref(1)
    plain.load_state_dict(loaded, strict=True)
    _equal(plain.state_dict(), sd)
    full = gathered_params(m)
    for k, v in full.items():
        assert torch.equal(v, sd[k])


def test_full_state_dict_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    # a file object's write raises OSError(ENOSPC) without a filename: it reached the caller
    # as a bare "[Errno 28] No space left on device"
    import errno

    from offload.shard import fullstate

    def full(f, t):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fullstate, "_write", full)
    path = tmp_path / "full.safetensors"
    with pytest.raises(OSError, match="writing the state dict failed") as e:
        full_state_dict(offload.shard(_ref()), path)
    assert e.value.errno == errno.ENOSPC and e.value.filename == f"{path}.partial"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_load_weights_one_rank(tmp_path, fmt):
    sd = _ref().state_dict()
    path = _files(tmp_path, sd)[fmt]
    with torch.device("meta"):
        meta = Model()
    _equal(full_state_dict(offload.shard(meta, weights=path)), sd)
    other = offload.shard(_ref(7))  # a real model, other values: every slot is overwritten
    assert load_weights(other, path) == ([], [])
    _equal(full_state_dict(other), sd)


def test_tied_param_loads_from_either_name(tmp_path):
    sd = _ref().state_dict()
    for drop in ("units.0.p2", "units.1.tied"):
        part = {k: v for k, v in sd.items() if k != drop}
        torch.save(part, tmp_path / "part.pt")
        m = offload.shard(_ref(3))
        assert load_weights(m, tmp_path / "part.pt") == ([], [])
        _equal(full_state_dict(m), sd)


def _torch_error(model, sd, strict=True):
    with pytest.raises(RuntimeError) as e:
        model.load_state_dict(sd, strict=strict)
    return str(e.value)


def test_errors_in_torchs_words(tmp_path):
    sd = _ref().state_dict()
    bad = {k: v for k, v in sd.items() if k not in ("head.bias", "units.0.p4")}
    bad["extra.weight"] = torch.zeros(2)
    bad["units.1.p1"] = torch.zeros(5)  # size mismatch (a sharded param)
    bad["frozen"] = torch.zeros(3, 4)   # size mismatch (a whole one)
    torch.save(bad, tmp_path / "bad.pt")
    m = offload.shard(_ref(3))
    before = full_state_dict(m)
    for strict in (True, False):
        with pytest.raises(RuntimeError) as e:
            load_weights(m, tmp_path / "bad.pt", strict=strict)
        assert str(e.value) == _torch_error(_ref(3), bad, strict).replace("Holder", "Model")
        _equal(full_state_dict(m), before)  # checked before anything is written
    bad["units.1.p1"], bad["frozen"] = sd["units.1.p1"], sd["frozen"]
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(RuntimeError, match=r'^Error\(s\) in loading state_dict for Model:\n\tMissing key\(s\) in '
                                           r'state_dict: "units.0.p4", "head.bias". \n\tUnexpected key\(s\) in '
                                           r'state_dict: "extra.weight". $'):
        load_weights(m, tmp_path / "bad.pt")
    res = load_weights(m, tmp_path / "bad.pt", strict=False)
    assert res == _ref(3).load_state_dict(bad, strict=False)
    got = full_state_dict(m)
    assert torch.equal(got["head.weight"], sd["head.weight"]) and torch.equal(got["head.bias"], before["head.bias"])
    with pytest.raises(FileNotFoundError):
        load_weights(m, tmp_path / "nothing.pt")
    with pytest.raises(ValueError, match="offload.shard"):
        load_weights(_ref(), tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="fmt must be one of"):
        full_state_dict(m, tmp_path / "x", fmt="npz")
    with pytest.raises(ValueError, match="rank0_only=False is for path=None"):
        full_state_dict(m, tmp_path / "x", rank0_only=False)
    with pytest.raises(ValueError, match="offload.shard"):
        full_state_dict(_ref())


def test_after_training_steps():
    """full_state_dict reads the shards the optimizer stepped."""
    m = offload.shard(_ref())
    opt = offload.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.ones(2, 5)).backward()
        opt.step()
        opt.zero_grad()
    full = gathered_params(m)
    got = full_state_dict(m)
    assert not torch.equal(got["units.0.p2"], _ref().state_dict()["units.0.p2"])
    for k, v in full.items():
        assert torch.equal(got[k], v)
    assert torch.equal(got["units.1.tied"], full["units.0.p2"])
    opt.close()


# ---------------------------------------------------------------------- 2 and 3 ranks
def _rank_job(rank, world, files, out_path):
    """On the session's gloo ranks (tests/_ranks.py ``group``), which serve other files' jobs
    too: the reader's counting patch goes back after."""
    res = {}
    read = [0]
    real = weights_mod._Reader.read

    def counting(self, key, start, stop):
        read[0] += stop - start
        return real(self, key, start, stop)

    weights_mod._Reader.read = counting
    try:
        for fmt, path in files.items():
            with torch.device("meta"):
                m = Model()
            offload.shard(m, weights=path)
            res[fmt] = _np(full_state_dict(m, rank0_only=False))
    finally:
        weights_mod._Reader.read = real
    res["read"] = read[0] // len(files)
    res["chunks"] = sum(f.chunk for u in runtime_of(m).units for f in u.flats)
    try:  # rank 0 cannot write there: it raises after the gathers, the others do not wait forever
        full_state_dict(m, "/nonexistent-dir/x.safetensors")
        res["error"] = None
    except FileNotFoundError:
        res["error"] = "FileNotFoundError"
    full_state_dict(m, out_path)  # rank 0 writes it
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_load_their_slices_and_save(tmp_path, world):
    sd = _ref().state_dict()
    files = _files(tmp_path, sd)
    out_path = str(tmp_path / "saved.safetensors")
    got = _ranks.group(world).run(_rank_job, files, out_path, timeout=240)  # a spawn of its own cost ~3 s
    sharded = sum(v.numel() for k, v in sd.items() if k not in ("frozen", "stat", "units.1.tied"))
    for r in range(world):
        _equal(got[r]["torch"], sd)
        _equal(got[r]["safetensors"], sd)
        assert got[r]["read"] <= got[r]["chunks"]  # its own slices only
        assert got[r]["error"] == ("FileNotFoundError" if r == 0 else None)
    assert sum(got[r]["read"] for r in range(world)) == sharded  # every element once, by one rank
    with safe_open(out_path, "pt") as f:
        _equal({k: f.get_tensor(k) for k in sd}, sd)
        assert sorted(f.keys()) == sorted(sd)
