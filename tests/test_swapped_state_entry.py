"""``opt.state[p]`` of states kept in swap files (``offload="nvme"``) against the RAM store of
the same params (state_view.py, [Note: states an entry reads on access] in state_entry.py):
a state reads in the dtype that store holds it (bf16 as bf16, where the swap files gave
float32 and DeepSpeed's bf16-state tests failed; int8 of fp32 CPU params as the host store's
packed blocks), and it is listed (``"exp_avg" in st`` was False, ``keys()`` held only
``"step"``) without a read, with dict's other operations as on the RAM stores' entries."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import offload
from offload.optim.swapped_shards import SwappedShards

# (param dtype, state_dtype): fp32 CPU params are the host store's in RAM, bf16 ones the flat store's
CASES = [("float32", "float32"), ("float32", "bfloat16"), ("float32", "int8"),
         ("bfloat16", "bfloat16"), ("bfloat16", "int8")]
IDS = [f"{d}-{s}" for d, s in CASES]
STORED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.uint8}


def _keys(dtype):
    """An entry's keys: a bf16 param's fp32 master is listed too ([Note: the master in opt.state])."""
    return ["step", "exp_avg", "exp_avg_sq"] + (["master"] if dtype == "bfloat16" else [])


class _Params:
    """A 300x40 weight (compressed in RAM too) and a 300 bias, with grads of their own: a
    bias the host store keeps float32 and the swap files compress does not move the weight."""

    def __init__(self, dtype):
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(300, 40, generator=g).to(getattr(torch, dtype)))
        self.bias = torch.nn.Parameter(torch.randn(300, generator=g).to(getattr(torch, dtype)))

    def parameters(self):
        return [self.weight, self.bias]


def _model(dtype):
    return _Params(dtype)


def _step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()


def _pair(tmp_path, dtype, state_dtype, steps=2, kinds=("cpu", "nvme"), **nvme_kw):
    """(models, optimizers) of ``kinds`` (the RAM store's, the swap files'), stepped alike."""
    ms, opts = [], []
    for i, kind in enumerate(kinds):
        ms.append(_model(dtype))
        kw = {"swap_dir": str(tmp_path / str(i)), **nvme_kw} if kind == "nvme" else {}
        if kw:
            (tmp_path / str(i)).mkdir()
        opts.append(offload.AdamW(ms[-1].parameters(), lr=1e-2, offload=kind, state_dtype=state_dtype, **kw))
    for s in range(steps):
        for m, o in zip(ms, opts):
            _step(m, o, s)
    return ms, opts


def _same(a, b):
    assert type(a) is torch.Tensor or a.dtype == b.dtype  # (a read copy of the nvme store, a plain one)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(torch.as_tensor(a).view(-1), torch.as_tensor(b).view(-1))


@pytest.mark.parametrize("sub_group_size", [None, 1024], ids=["one-sub-group", "sub-groups-of-1024"])
@pytest.mark.parametrize("dtype,state_dtype", CASES, ids=IDS)
def test_a_swapped_state_reads_as_the_ram_store_holds_it(tmp_path, dtype, state_dtype, sub_group_size):
    # (sub-groups of 1024: the 12000 weights span 12 of them, each read into the same buffer)
    (ram, nv), (a, b) = _pair(tmp_path, dtype, state_dtype, sub_group_size=sub_group_size)
    try:
        for key in _keys(dtype)[1:]:  # (the master too: float32 in both)
            _same(b.state[nv.weight][key], a.state[ram.weight][key])
            bias = b.state[nv.bias][key]
            if dtype == "bfloat16":  # the flat store: the same in RAM
                _same(bias, a.state[ram.bias][key])
            else:  # the swap files compress small params too (the host store keeps them float32)
                assert bias.dtype == STORED[state_dtype]
            assert b.state[nv.weight].get(key).dtype == a.state[ram.weight][key].dtype
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("dtype,state_dtype", CASES, ids=IDS)
def test_a_read_state_written_back_changes_nothing(tmp_path, dtype, state_dtype):
    (ref, nv), (a, b) = _pair(tmp_path, dtype, state_dtype, kinds=("nvme", "nvme"))
    try:
        for key in _keys(dtype)[1:]:
            b.state[nv.weight][key] = b.state[nv.weight][key]  # bf16, or packed blocks: bit for bit
            b.state[nv.bias][key] = b.state[nv.bias][key]
        for k, p in enumerate(nv.parameters()):
            for key in _keys(dtype)[1:]:
                _same(b.state[p][key], a.state[ref.parameters()[k]][key])
        _step(ref, a, 5)
        _step(nv, b, 5)
        assert torch.equal(ref.weight, nv.weight) and torch.equal(ref.bias, nv.bias)
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        for k in (0, 1):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[k][key], sb[k][key]), (k, key)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("dtype,state_dtype", CASES, ids=IDS)
def test_swapped_states_are_listed_without_a_read(tmp_path, dtype, state_dtype, monkeypatch):
    (ram, nv), (a, b) = _pair(tmp_path, dtype, state_dtype)
    try:
        def refuse(*args, **kwargs):
            raise AssertionError("listing the states read the swap files")

        with monkeypatch.context() as mp:
            mp.setattr(SwappedShards, "read", refuse)
            mp.setattr(SwappedShards, "read_storage", refuse)
            for p, q in ((ram.weight, nv.weight), (ram.bias, nv.bias)):
                st, ref = b.state[q], a.state[p]
                assert list(st) == list(ref) == _keys(dtype)
                assert list(st.keys()) == list(ref.keys()) and len(st) == len(ref) == len(_keys(dtype))
                assert "exp_avg" in st and "exp_avg_sq" in st.keys() and "max_exp_avg_sq" not in st
                assert list(reversed(st.keys())) == list(reversed(ref.keys()))
        st, ref = b.state[nv.weight], a.state[ram.weight]
        for got in (dict(st), {**st}, st.copy(), dict(st.items()), pickle.loads(pickle.dumps(st)),
                    list(copy.deepcopy(b.state).values())[0]):
            assert type(got) is dict and list(got) == list(ref)
            for key in _keys(dtype)[1:]:
                _same(got[key], ref[key])
        assert [v.dtype for v in st.values()] == [v.dtype for v in ref.values()]
        assert st == st and "'exp_avg_sq': tensor(" in repr(st)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("dtype,state_dtype", CASES[1:3] + CASES[4:], ids=IDS[1:3] + IDS[4:])
def test_dict_changes_of_a_swapped_entry(tmp_path, dtype, state_dtype):
    (ram, nv), (a, b) = _pair(tmp_path, dtype, state_dtype)
    try:
        st = b.state[nv.weight]
        for drop in (lambda: st.pop("exp_avg"), lambda: st.__delitem__("exp_avg_sq"), st.popitem):
            with pytest.raises(NotImplementedError, match="keeps '(exp_avg|master)"):
                drop()
        assert list(st) == _keys(dtype)  # nothing dropped
        _same(st.setdefault("exp_avg", None), a.state[ram.weight]["exp_avg"])
        st.update(exp_avg=torch.zeros_like(nv.weight))
        assert not b.state_dict()["state"][0]["exp_avg"].any()
        for opt, m in ((a, ram), (b, nv)):  # torch's way to start a param afresh
            opt.state[m.weight].clear()
        assert list(st) == [] and len(st) == 0 and "exp_avg" not in st and st.get("exp_avg") is None
        _step(ram, a, 7)
        _step(nv, b, 7)
        assert float(st["step"]) == 1 and list(st) == _keys(dtype)
        assert torch.equal(ram.weight, nv.weight)
        _same(st["exp_avg"], a.state[ram.weight]["exp_avg"])
    finally:
        a.close()
        b.close()


def test_amsgrad_turned_on_lists_no_max_exp_avg_sq_before_a_step_as_torch(tmp_path):
    """torch creates ``max_exp_avg_sq`` only at a param's first step (its _init_group), so a
    group that turns amsgrad on later shows none (and torch's next step raises KeyError): the
    swap files' entries (whose store keeps it, for the other group) show none either."""
    torch.manual_seed(0)
    w = [torch.randn(5000), torch.randn(300)]
    ref = [torch.nn.Parameter(t.clone()) for t in w]
    ps = [torch.nn.Parameter(t.clone()) for t in w]
    groups = lambda xs: [{"params": [xs[0]]}, {"params": [xs[1]], "amsgrad": True}]  # noqa: E731
    t = torch.optim.Adam(groups(ref), lr=1e-2, foreach=False)
    o = offload.Adam(groups(ps), lr=1e-2, offload="nvme", swap_dir=str(tmp_path))
    try:
        for x, opt in ((ref, t), (ps, o)):
            for p in x:
                p.grad = torch.ones_like(p)
            opt.step()
            opt.param_groups[0]["amsgrad"] = True
        for x, opt in ((ref, t), (ps, o)):
            assert "max_exp_avg_sq" not in opt.state[x[0]] and "max_exp_avg_sq" in opt.state[x[1]]
            with pytest.raises(KeyError):
                opt.state[x[0]]["max_exp_avg_sq"]
        torch.testing.assert_close(o.state[ps[1]]["max_exp_avg_sq"], t.state[ref[1]]["max_exp_avg_sq"],
                                   rtol=1e-5, atol=1e-6)
    finally:
        o.close()


def test_packed_blocks_of_a_param_across_sub_groups_read_as_the_host_store_holds_them(tmp_path):
    # int8 sub-groups are at least 262144 elements: a param of 600000 spans three
    g = torch.Generator().manual_seed(0)
    w = torch.randn(600000, generator=g)
    ps = [torch.nn.Parameter(w.clone()) for _ in range(2)]
    a = offload.AdamW([ps[0]], lr=1e-2, offload="cpu", state_dtype="int8")
    b = offload.AdamW([ps[1]], lr=1e-2, offload="nvme", swap_dir=str(tmp_path), state_dtype="int8",
                      sub_group_size=1024)
    try:
        assert b._store.sub_group_size < w.numel() // 2
        for s in range(2):
            grad = torch.randn(w.shape, generator=g)
            for p, o in zip(ps, (a, b)):
                p.grad = grad.clone()
                o.step()
        for key in ("exp_avg", "exp_avg_sq"):
            _same(b.state[ps[1]][key], a.state[ps[0]][key])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("dtype,state_dtype", CASES, ids=IDS)
def test_a_closed_store_lists_and_reads_no_state(tmp_path, dtype, state_dtype):
    """After close() an entry lists only its "step" ([Note: states an entry reads on access]):
    the fp32 params' store (SwappedState) listed its swapped states still, and reading one
    (``get``, ``dict(st)``, ``copy.deepcopy(opt.state)``) raised IndexError from the closed
    swap files; the flat store's said nothing already."""
    (nv,), (b,) = _pair(tmp_path, dtype, state_dtype, kinds=("nvme",))
    b.close()
    for p in nv.parameters():
        st = b.state[p]
        assert list(st) == ["step"] and "exp_avg" not in st and len(st) == 1
        assert st.get("exp_avg") is None
        with pytest.raises(KeyError):
            st["exp_avg"]
        assert list(copy.deepcopy(st)) == ["step"] and list(pickle.loads(pickle.dumps(st))) == ["step"]


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype,state_dtype", CASES, ids=IDS)
def test_an_update_with_a_refused_value_changes_nothing(tmp_path, kind, dtype, state_dtype):
    """``opt.state[p].update(exp_avg=ok, exp_avg_sq=wrong size)``: refused (ValueError) with
    nothing written; it wrote exp_avg before refusing exp_avg_sq, and a caller that caught the
    error went on from a half-changed state (the next step differed from the run without it)."""
    if kind == "cpu" and dtype == "float32":
        pytest.skip("the host store's opt.state is torch's own dicts")
    (ref, m), (a, b) = _pair(tmp_path, dtype, state_dtype, kinds=(kind, kind))
    try:
        st = b.state[m.weight]
        with pytest.raises(ValueError):
            st.update({"exp_avg": torch.zeros(300, 40), "note": 1, "exp_avg_sq": torch.zeros(7)})
        assert "note" not in st
        _step(ref, a, 5)
        _step(m, b, 5)
        assert torch.equal(ref.weight, m.weight) and torch.equal(ref.bias, m.bias)
        for key in ("exp_avg", "exp_avg_sq"):
            _same(b.state[m.weight][key], a.state[ref.weight][key])
    finally:
        a.close()
        b.close()
