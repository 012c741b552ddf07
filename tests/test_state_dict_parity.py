"""state_dict / load_state_dict as torch's (issue 13, sections 2 and 4): state_dict() changes
nothing in the optimizer and its post hooks see the moments; load_state_dict() is all or
nothing (a bad dict changes nothing; on nvme the loaded states are committed once) and keeps
nothing of what it loaded."""
from __future__ import annotations

import copy
import gc
import io
import json
import os
import weakref

import pytest
import torch
import torch.nn as nn

import offload
from test_swap_util import faulty_swap_engines
import _internals as internals

SIZES = [(3000,), (7,), (40, 60), (1,), (2500,)]
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
STORES = ["none", "nvme", "bf16", "bf16-nvme"]


def _opt(kind, tmp_path, seed=0):
    dtype = torch.bfloat16 if kind.startswith("bf16") else torch.float32
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SIZES]
    kw = {"offload": "none"}
    if kind.endswith("nvme"):
        (tmp_path / f"swap{seed}").mkdir(exist_ok=True)
        kw = {"offload": "nvme", "swap_dir": str(tmp_path / f"swap{seed}"), "sub_group_size": 1024,
              "max_host_bytes": 1 << 20}
    return params, offload.AdamW(params, **HP, **kw)


def _train(opt, params, start, stop):
    for s in range(start, stop):
        g = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _state_copy(opt):
    return copy.deepcopy(opt.state_dict())


def _same_state(a, b):
    assert sorted(a["state"]) == sorted(b["state"])
    for k in a["state"]:
        assert sorted(a["state"][k]) == sorted(b["state"][k]), k
        for key, t in a["state"][k].items():
            assert torch.equal(t, b["state"][k][key]), (k, key)


# ---------------------------------------------------------------------- item 4: state_dict
@pytest.mark.parametrize("kind", STORES)
def test_state_dict_does_not_change_the_optimizer(tmp_path, kind):
    params, opt = _opt(kind, tmp_path)
    _train(opt, params, 0, 2)
    # (the ids of what the dict holds: a state of the swap files is a new tensor on each read)
    before = {id(p): (list(opt.state[p]), {k: id(v) for k, v in dict.items(opt.state[p])}) for p in params}
    sd = opt.state_dict()
    assert all("exp_avg" in sd["state"][k] and "exp_avg_sq" in sd["state"][k] for k in range(len(params)))
    for p in params:
        assert {k: id(v) for k, v in dict.items(opt.state[p])} == before[id(p)][1]  # no key added, none replaced
        assert list(opt.state[p]) == before[id(p)][0]
    if kind != "none":  # no copy of the store's states stays in opt.state (nvme: read on access)
        # (a bf16 param's master is the store's, listed as its moments: [Note: the master in opt.state])
        assert all(("master" in opt.state[p]) == kind.startswith("bf16") for p in params)
        assert all("exp_avg" in opt.state[p] for p in params)  # listed (nvme: read on access)
        for key in ("exp_avg",) + (("master",) if kind.startswith("bf16") else ()):
            assert all(dict.__contains__(opt.state[p], key) for p in params) != kind.endswith("nvme")
    if kind != "none":  # (torch's, like the host store's, shares opt.state's live tensors)
        # the dict does not change with the next step (no shared stale copy either way)
        frozen = copy.deepcopy(sd)
        _train(opt, params, 2, 3)
        _same_state(sd, frozen)
    opt.close()


@pytest.mark.parametrize("kind", STORES)
def test_state_dict_post_hook_sees_the_moments(tmp_path, kind):
    params, opt = _opt(kind, tmp_path)
    _train(opt, params, 0, 1)
    seen = []

    def hook(o, sd):
        seen.append(sorted(sd["state"][0]))
        sd["extra"] = 1
        return sd

    opt.register_state_dict_post_hook(hook)
    sd = opt.state_dict()
    assert "exp_avg" in seen[0] and "exp_avg_sq" in seen[0] and sd["extra"] == 1
    opt.close()


@pytest.mark.parametrize("kind", STORES)
def test_state_dict_pickles_and_matches_torch_layout(tmp_path, kind):
    params, opt = _opt(kind, tmp_path)
    _train(opt, params, 0, 2)
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    _same_state(sd, back)
    for k, p in enumerate(params):
        assert sd["state"][k]["exp_avg"].shape == p.shape and type(sd["state"][k]["exp_avg"]) is torch.Tensor
    opt.close()


# ---------------------------------------------------------------------- item 3: all or nothing
def _bad(sd, what):
    sd = copy.deepcopy(sd)
    last = sd["state"][len(SIZES) - 1]
    if what == "shape":
        last["exp_avg"] = torch.zeros(last["exp_avg"].numel() + 1)
    elif what == "step":
        last["step"] = torch.tensor(float("nan"))
    elif what == "half":
        del last["exp_avg_sq"]
    return sd


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("what", ["shape", "step", "half"])
def test_a_bad_entry_changes_nothing(tmp_path, kind, what):
    src_params, src = _opt(kind, tmp_path, seed=1)
    _train(src, src_params, 0, 3)
    sd = src.state_dict()
    params, opt = _opt(kind, tmp_path)
    _train(opt, params, 0, 2)
    before = _state_copy(opt)
    with pytest.raises(ValueError, match=r"load_state_dict: state\[4\]"):
        opt.load_state_dict(_bad(sd, what))
    _same_state(opt.state_dict(), before)
    _train(opt, params, 2, 3)  # steps on from where it stood
    assert all(int(opt.state[p]["step"]) == 3 for p in params)
    opt.close()
    src.close()


@pytest.mark.parametrize("kind", STORES)
def test_another_optimizers_groups_are_refused_at_the_load(tmp_path, kind):
    """An SGD state_dict (no 'betas', no 'eps') loaded into AdamW: torch's load takes it and
    its step fails with a bare KeyError: 'betas'; ours refuses the load and changes nothing."""
    params, opt = _opt(kind, tmp_path)
    _train(opt, params, 0, 2)
    before = _state_copy(opt)
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        for k in ("betas", "eps", "amsgrad"):
            group.pop(k)
        group.update(momentum=0.9, dampening=0.0, nesterov=False)
    with pytest.raises(ValueError, match=r"load_state_dict: param group 0 has no 'betas', 'eps', which "
                                         r"offload.AdamW steps with \(a state_dict of another optimizer\?"):
        opt.load_state_dict(sd)
    _same_state(opt.state_dict(), before)
    assert opt.param_groups[0]["betas"] == HP["betas"]
    _train(opt, params, 2, 3)
    ref_params, ref = _opt(kind, tmp_path, seed=0) if kind == "none" else (None, None)
    if ref is not None:  # the same run without the failed load
        _train(ref, ref_params, 0, 3)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    opt.close()


@pytest.mark.parametrize("kind", ["nvme", "bf16-nvme"])
def test_nvme_load_state_dict_commits_once(tmp_path, kind, monkeypatch):
    src_params, src = _opt(kind, tmp_path, seed=1)
    _train(src, src_params, 0, 3)
    sd = src.state_dict()
    engines = faulty_swap_engines(monkeypatch)
    params, opt = _opt(kind, tmp_path)
    faulty, = engines  # opt's swap engine, disarmed until armed below
    _train(opt, params, 0, 2)
    before = _state_copy(opt)
    manifest = os.path.join(internals.swap_path(opt), "manifest.json")
    with open(manifest) as f:
        m0 = json.load(f)
    faulty.arm(3)  # the third sub-group written: two are already in their free slots
    with pytest.raises(OSError, match="injected write error"):
        opt.load_state_dict(sd)
    with open(manifest) as f:
        assert json.load(f) == m0  # never a manifest with some sub-groups loaded
    _same_state(opt.state_dict(), before)
    faulty.arm(0)
    opt.load_state_dict(sd)
    _same_state(opt.state_dict(), sd)
    opt.close()
    src.close()


# ---------------------------------------------------------------------- item 5: nothing kept
@pytest.mark.parametrize("kind", ["bf16", "bf16-nvme"])
def test_load_state_dict_keeps_nothing_it_loaded(tmp_path, kind):
    src_params, src = _opt(kind, tmp_path, seed=1)
    _train(src, src_params, 0, 2)
    sd = copy.deepcopy(src.state_dict())
    refs = [weakref.ref(t) for st in sd["state"].values() for k, t in st.items() if k != "step"]
    params, opt = _opt(kind, tmp_path)
    opt.load_state_dict(sd)
    del sd
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    _train(opt, params, 2, 3)
    opt.close()
    src.close()


# ---------------------------------------------------------------------- item 6: opt.state[p] moments
def _torch_moments(kind, seed, steps):
    dtype = torch.bfloat16 if kind.startswith("bf16") else torch.float32
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(*s, generator=g).to(dtype).float()) for s in SIZES]
    opt = torch.optim.AdamW(params, **HP, foreach=False)
    for s in range(steps):
        gg = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gg).to(dtype).float()
        opt.step()
    return opt, params


@pytest.mark.parametrize("kind", STORES)
def test_opt_state_holds_the_moments(tmp_path, kind):
    params, opt = _opt(kind, tmp_path)
    ref, ref_params = _torch_moments(kind, 0, 3)
    _train(opt, params, 0, 2)
    held = {key: opt.state[params[2]][key] for key in ("exp_avg", "exp_avg_sq")}
    _train(opt, params, 2, 3)
    sd = opt.state_dict()
    for k, (p, q) in enumerate(zip(params, ref_params)):
        for key in ("exp_avg", "exp_avg_sq"):
            got = opt.state[p][key]
            assert got.shape == p.shape and got.dtype == torch.float32
            assert torch.equal(got, sd["state"][k][key]), (k, key)  # the current moments, never a stale copy
            torch.testing.assert_close(got, ref.state[q][key], rtol=1e-5, atol=1e-6)
            assert torch.equal(opt.state[p].get(key), got)
    live = kind in ("none", "bf16")  # in RAM: views of the states themselves; nvme: read on each access
    assert torch.equal(held["exp_avg"], opt.state[params[2]]["exp_avg"]) == live
    if kind.endswith("nvme"):
        e = opt.state[params[0]]  # listed, and dict() reads it
        assert "exp_avg" in e and torch.equal(dict(e)["exp_avg"], e["exp_avg"])
    copy.deepcopy(opt.state)  # plain dicts when copied or pickled: no store inside
    torch.save(dict(opt.state), io.BytesIO())
    opt.close()


@pytest.mark.parametrize("kind", ["bf16", "nvme", "bf16-nvme"])
def test_opt_state_moments_after_load_state_dict(tmp_path, kind):
    src_params, src = _opt(kind, tmp_path, seed=1)
    _train(src, src_params, 0, 2)
    sd = copy.deepcopy(src.state_dict())
    params, opt = _opt(kind, tmp_path)
    opt.load_state_dict(sd)
    for k, p in enumerate(params):
        assert torch.equal(opt.state[p]["exp_avg_sq"], sd["state"][k]["exp_avg_sq"].float())
    opt.close()
    src.close()


_KILLED_LOAD = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n" + r"""
import os, signal, sys, torch, torch.nn as nn, offload
import _internals as internals
swap, out = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(0)
params = [nn.Parameter(torch.randn(n, generator=g)) for n in (3000, 7, 2500)]
opt = offload.AdamW(params, lr=1e-2, offload="nvme", swap_dir=swap, sub_group_size=1024, max_host_bytes=1 << 20)
for s in range(2):
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
torch.save({"params": [p.detach().clone() for p in params], "sd": opt.state_dict()}, os.path.join(out, "before.pt"))
sd = opt.state_dict()
for st in sd["state"].values():
    st["exp_avg"] = st["exp_avg"] + 1.0
    st["exp_avg_sq"] = st["exp_avg_sq"] + 1.0
    st["step"] = torch.tensor(7.0)
store = internals.swap(opt).store
inner, count = store.engine, [0]
class Killer:
    def __getattr__(self, name):
        return getattr(inner, name)
    def submit(self, reqs):
        reqs = list(reqs)
        if reqs and reqs[0].op == "write":
            count[0] += 1
            if count[0] == 3:  # two sub-groups of the load are written: die before the third
                os.kill(os.getpid(), signal.SIGKILL)
        return inner.submit(reqs)
store.engine = Killer()
opt.load_state_dict(sd)
print("not killed")
"""


def test_kill_during_nvme_load_state_dict_resumes_at_the_states_before(tmp_path):
    from test_swap_util import run_python

    (tmp_path / "swap").mkdir()
    p = run_python(_KILLED_LOAD, str(tmp_path / "swap"), str(tmp_path))
    out, err = p.communicate(timeout=120)
    assert p.returncode == -9, (out, err)
    before = torch.load(tmp_path / "before.pt", weights_only=True)
    params = [nn.Parameter(t) for t in before["params"]]
    opt = offload.AdamW(params, lr=1e-2, offload="nvme", swap_dir=str(tmp_path / "swap"), sub_group_size=1024,
                        max_host_bytes=1 << 20, resume=True)
    _same_state(opt.state_dict(), before["sd"])  # every moment and step from before the load, none from it
    opt.close()
