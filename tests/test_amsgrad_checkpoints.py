"""Checkpoints and state_dict round trips of Adam groups that differ in amsgrad, in every
store, against torch.optim ([Note: kept states in checkpoints] in offload/optim/ckpt_holding.py).

Three groups: amsgrad always on, on for two steps then off (torch keeps its params'
max_exp_avg_sq meanwhile, and its state_dict carries it), never on. The first steps' grads
are large, so the max_exp_avg_sq they leave stays above exp_avg_sq and decides the updates
once the group turns amsgrad on again: a max_exp_avg_sq lost in the round trip (restarted
from zeros) shows in the params. Torch runs through the same switches; every param and
state is compared element by element."""
from __future__ import annotations

import copy

import pytest
import torch

import offload

TOL = dict(rtol=1e-5, atol=1e-6)
SIZES = (7, 17, 4097, 1)  # group 0: 7; group 1 (turns amsgrad off): 17 and 4097 (SIMD tails); group 2: 1
STORES = ("none", "cpu", "nvme", "flat", "flat-nvme")  # fp32 CPU params (host, swapped); bf16 params (flat)


def _params(store):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if store.startswith("flat") else torch.float32
    return [torch.randn(n, generator=gen).to(dtype).requires_grad_() for n in SIZES]


def _groups(params, middle=True):
    return [{"params": params[:1], "amsgrad": True},
            {"params": params[1:3], "amsgrad": middle, "lr": 3e-3},
            {"params": params[3:], "amsgrad": False, "weight_decay": 0.1}]


def _kwargs(store, tmp_path, name):
    if store in ("nvme", "flat-nvme"):
        (tmp_path / name).mkdir(exist_ok=True)
        return {"offload": "nvme", "swap_dir": str(tmp_path / name)}
    return {"offload": "none" if store == "none" else "cpu"}


def _step(pairs, gen, t):
    """Step ``t`` of each (optimizer, params) on the same bf16-exact grads, large ones first."""
    scale = 100.0 if t < 2 else 1.0
    grads = [(torch.randn(n, generator=gen) * scale).to(torch.bfloat16) for n in SIZES]
    for opt, params in pairs:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        opt.step()


def _flip(opts, amsgrad):
    for opt in opts:
        opt.param_groups[1]["amsgrad"] = amsgrad


def _shows(entry, key):
    """Whether ``entry`` (of opt.state) has ``key``: a swapped store's entry reads it on access."""
    try:
        return entry[key] is not None
    except KeyError:
        return False


class Run:
    """Ours and torch's, four steps in: group 1 had amsgrad on for two, off for two."""

    def __init__(self, store, tmp_path, cls=offload.AdamW, ref_cls=torch.optim.AdamW):
        self.params = _params(store)
        self.ref_params = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = cls(_groups(self.params), lr=1e-2, **_kwargs(store, tmp_path, "run"))
        self.ref = ref_cls(_groups(self.ref_params), lr=1e-2, foreach=False)
        self.gen = torch.Generator().manual_seed(1)
        for t in range(4):
            _flip((self.opt, self.ref), t < 2)
            self.steps(t, t + 1)

    def steps(self, first, end):
        for t in range(first, end):
            _step([(self.opt, self.params), (self.ref, self.ref_params)], self.gen, t)

    def check_keys(self):
        """Which states each param shows (opt.state and state_dict): torch's."""
        got, want = self.opt.state_dict()["state"], self.ref.state_dict()["state"]
        assert {i: sorted(set(e) - {"master"}) for i, e in got.items()} == {i: sorted(e) for i, e in want.items()}
        for p, r in zip(self.params, self.ref_params):
            assert _shows(self.opt.state[p], "max_exp_avg_sq") == ("max_exp_avg_sq" in self.ref.state[r])

    def check_values(self):
        got, want = self.opt.state_dict()["state"], self.ref.state_dict()["state"]
        for i, (p, r) in enumerate(zip(self.params, self.ref_params)):
            torch.testing.assert_close(got[i].get("master", p.detach()), r.detach(), **TOL)
            assert float(got[i]["step"]) == float(want[i]["step"])
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if k in want[i]:
                    torch.testing.assert_close(got[i][k], want[i][k], **TOL)

    def go_on(self):
        """Group 1 turns amsgrad on again: two more steps, from its kept max_exp_avg_sq."""
        self.check_keys()
        _flip((self.opt, self.ref), True)
        self.steps(4, 6)
        self.check_keys()
        self.check_values()
        self.opt.close()


def _reload(run, dst, tmp_path, cls=offload.AdamW):
    """A new optimizer of store ``dst`` on the same params (built with other groups' lr and
    amsgrad: the checkpoint's come with it) loading the checkpoint ``run`` saves now."""
    run.opt.save_checkpoint(str(tmp_path / "ckpt"))
    run.opt.close()
    opt = cls(_groups(run.params, middle=True), lr=0.5, **_kwargs(dst, tmp_path, "back"))
    opt.load_checkpoint(str(tmp_path / "ckpt"))
    assert [g["amsgrad"] for g in opt.param_groups] == [True, False, False]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3, 1e-2]
    run.opt = opt


@pytest.mark.parametrize("store", STORES)
def test_a_checkpoint_saved_while_a_group_has_amsgrad_off_keeps_its_max_exp_avg_sq(store, tmp_path):
    run = Run(store, tmp_path)
    _reload(run, store, tmp_path)
    run.go_on()


@pytest.mark.parametrize("src, dst", [("cpu", "nvme"), ("nvme", "cpu"), ("none", "nvme"), ("nvme", "nvme")])
def test_a_checkpoint_of_groups_that_differ_in_amsgrad_moves_between_stores(src, dst, tmp_path):
    run = Run(src, tmp_path)
    _reload(run, dst, tmp_path)
    run.go_on()


def test_a_checkpoint_goes_from_cpu_to_nvme_and_back(tmp_path):
    run = Run("cpu", tmp_path)
    _reload(run, "nvme", tmp_path)
    run.check_keys()
    run.steps(4, 5)  # one more step with amsgrad off, on NVMe
    run.opt.save_checkpoint(str(tmp_path / "ckpt2"))
    run.opt.close()
    run.opt = offload.AdamW(_groups(run.params), lr=0.5, offload="cpu")
    run.opt.load_checkpoint(str(tmp_path / "ckpt2"))
    run.check_keys()
    _flip((run.opt, run.ref), True)
    run.steps(5, 7)
    run.check_keys()
    run.check_values()


@pytest.mark.parametrize("store", STORES)
def test_a_group_that_turned_amsgrad_off_and_on_again_round_trips_checkpoints(store, tmp_path):
    """Saved after the group turned amsgrad back on (on, off, on): the same as torch."""
    run = Run(store, tmp_path)
    _flip((run.opt, run.ref), True)
    run.steps(4, 5)
    run.opt.save_checkpoint(str(tmp_path / "ckpt"))  # (with amsgrad on)
    run.opt.close()
    run.opt = offload.AdamW(_groups(run.params, middle=False), lr=0.5, **_kwargs(store, tmp_path, "back"))
    run.opt.load_checkpoint(str(tmp_path / "ckpt"))
    assert [g["amsgrad"] for g in run.opt.param_groups] == [True, True, False]
    run.check_keys()
    _flip((run.opt, run.ref), False)
    run.steps(5, 6)
    run.check_keys()
    _flip((run.opt, run.ref), True)
    run.steps(6, 7)
    run.check_keys()
    run.check_values()
    run.opt.close()


@pytest.mark.parametrize("store", STORES)
def test_torch_state_dict_with_max_exp_avg_sq_of_an_amsgrad_off_group_loads_in_every_store(store, tmp_path):
    """torch.optim.Adam's state_dict, taken while group 1 has amsgrad off, into ours (and ours
    into torch's): the kept max_exp_avg_sq is loaded, shown and used when amsgrad is back."""
    run = Run(store, tmp_path, offload.Adam, torch.optim.Adam)
    mine, theirs = copy.deepcopy(run.opt.state_dict()), copy.deepcopy(run.ref.state_dict())
    assert "max_exp_avg_sq" in mine["state"][1] and "max_exp_avg_sq" in theirs["state"][1]
    run.opt.close()
    twin = torch.optim.Adam(_groups([r.detach().clone().requires_grad_() for r in run.ref_params]),
                            lr=0.5, foreach=False)
    twin.load_state_dict(mine)  # ours into torch's: the same entries
    for i, e in twin.state_dict()["state"].items():
        assert set(e) - {"master"} == set(theirs["state"][i])
    for p, r in zip(run.params, run.ref_params):
        p.data.copy_(r)  # (a bf16 param's master comes from its value: torch's dict has none)
        r.data.copy_(p.float())
    run.opt = offload.Adam(_groups(run.params), lr=0.5, **_kwargs(store, tmp_path, "back"))
    run.opt.load_state_dict(theirs)
    run.go_on()


def _ranks_job(rank, world, stage, kwargs, directory):
    """On each of two gloo ranks (the same grads on both): the run, a checkpoint saved while
    group 1 has amsgrad off, a new optimizer loading it, two steps with amsgrad on again."""
    params = _params("cpu")
    opt = offload.AdamW(_groups(params), lr=1e-2, stage=stage, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for t in range(4):
        _flip((opt,), t < 2)
        _step([(opt, params)], gen, t)
    opt.save_checkpoint(directory)
    opt.close()
    opt = offload.AdamW(_groups(params), lr=0.5, stage=stage, **kwargs)
    opt.load_checkpoint(directory)
    keys = {i: sorted(set(e) - {"master"}) for i, e in opt.state_dict()["state"].items()}  # (collective)
    _flip((opt,), True)
    for t in range(4, 6):
        _step([(opt, params)], gen, t)
    sd = opt.state_dict()["state"]
    opt.close()  # the ranks live on for the next job
    # plain lists: a tensor sent through the queue lives in shared memory tied to its sender
    return keys, [p.tolist() for p in params], {i: {k: v.tolist() for k, v in e.items() if k != "step"}
                                                for i, e in sd.items()}


@pytest.mark.parametrize("stage, store", [(1, "cpu"), (2, "cpu"), (2, "nvme")])
def test_two_ranks_checkpoint_keeps_the_max_exp_avg_sq_of_an_amsgrad_off_group(stage, store, tmp_path):
    from _ranks import group

    got = group(2).run(_ranks_job, stage, _kwargs(store, tmp_path, "swap"), str(tmp_path / "ckpt"))
    run = Run("cpu", tmp_path)  # torch's run (ours in one process is not needed)
    run.opt.close()
    want_keys = {i: sorted(e) for i, e in run.ref.state_dict()["state"].items()}
    _flip((run.ref,), True)
    for t in range(4, 6):
        _step([(run.ref, run.ref_params)], run.gen, t)
    want = run.ref.state_dict()["state"]
    for rank in (0, 1):
        keys, params, states = got[rank]
        assert keys == want_keys
        for i, (p, r) in enumerate(zip(params, run.ref_params)):
            torch.testing.assert_close(torch.tensor(p), r.detach(), **TOL)
            assert set(states[i]) == set(want[i]) - {"step"}
            for k, v in states[i].items():
                torch.testing.assert_close(torch.tensor(v), want[i][k], **TOL)


def _meta_rewritten(monkeypatch, rewrite):
    """The checkpoints' meta as ``rewrite`` makes it, when Adam reads ``holding`` (the
    manifest itself is sealed: an edited file is refused before its meta is read)."""
    import offload.optim.ckpt_holding as holding

    real = holding.saved_meta
    monkeypatch.setattr(holding, "saved_meta", lambda d: (rewrite(dict(real(d)[0])), real(d)[1]))


@pytest.mark.parametrize("store", ["cpu", "nvme"])
def test_a_checkpoint_without_holding_loads_as_before(store, tmp_path, monkeypatch):
    """A checkpoint written before ``holding`` existed: a param of a group with amsgrad off
    holds no max_exp_avg_sq after the load (the group's rule decides, as it always did)."""
    run = Run(store, tmp_path)
    _meta_rewritten(monkeypatch, lambda meta: {k: v for k, v in meta.items() if k != "holding"})
    _reload(run, store, tmp_path)
    sd = run.opt.state_dict()["state"]
    assert ["max_exp_avg_sq" in sd[i] for i in range(4)] == [True, False, False, False]
    run.opt.close()


@pytest.mark.parametrize("holding", [{"max_exp_avg_sq": "all"}, {"max_exp_avg_sq": [0, True]}, [1]])
def test_a_malformed_holding_is_refused_before_anything_loads(holding, tmp_path, monkeypatch):
    run = Run("cpu", tmp_path)
    run.opt.save_checkpoint(str(tmp_path / "ckpt"))
    run.steps(4, 5)  # (the states the refused load must leave)
    before = copy.deepcopy(run.opt.state_dict())
    _meta_rewritten(monkeypatch, lambda meta: dict(meta, holding=holding))
    with pytest.raises(ValueError, match="meta.holding is not a map of state name to a list of param indices"):
        run.opt.load_checkpoint(str(tmp_path / "ckpt"))
    after = run.opt.state_dict()
    for i, e in before["state"].items():
        assert set(after["state"][i]) == set(e) and all(torch.equal(after["state"][i][k], v) for k, v in e.items())


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_the_host_store_built_without_amsgrad_keeps_a_max_exp_avg_sq_through_checkpoints(state_dtype, tmp_path):
    """No group has amsgrad when the host store is built; group 1 turns it on for two steps,
    then off: its checkpoint holds the max_exp_avg_sq (it was left out: the store's fields
    were those of its first rules), a new optimizer of the same arguments loads it, and goes
    on bit for bit as the run that was never saved (and, in float32, as torch)."""
    params, twin_params = _params("cpu"), _params("cpu")
    ref_params = [p.detach().clone().requires_grad_() for p in params]

    def plain(ps):
        return [dict(g, amsgrad=False) for g in _groups(ps)]

    opt, twin = (offload.AdamW(plain(ps), lr=1e-2, state_dtype=state_dtype) for ps in (params, twin_params))
    ref = torch.optim.AdamW(plain(ref_params), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for t in range(4):
        _flip((opt, twin, ref), t < 2)
        _step([(opt, params), (twin, twin_params), (ref, ref_params)], gen, t)
    sd = opt.state_dict()["state"]
    assert sd[2]["max_exp_avg_sq"].dtype == torch.float32 and sd[2]["max_exp_avg_sq"].shape == params[2].shape  # (4097: int8)
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    opt = offload.AdamW(plain(params), lr=1e-2, state_dtype=state_dtype)
    opt.load_checkpoint(str(tmp_path / "ckpt"))
    got, want = opt.state_dict()["state"], twin.state_dict()["state"]
    assert {i: list(e) for i, e in got.items()} == {i: list(e) for i, e in want.items()}
    assert sorted(got[1]) == sorted(ref.state_dict()["state"][1])  # torch's keys
    _flip((opt, twin, ref), True)
    for t in range(4, 6):
        _step([(opt, params), (twin, twin_params), (ref, ref_params)], gen, t)
    got, want = opt.state_dict()["state"], twin.state_dict()["state"]
    for i in want:
        assert all(torch.equal(got[i][k], v) for k, v in want[i].items()), i
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params))
    if state_dtype == "float32":
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, **TOL)


@pytest.mark.parametrize("dst", ["none", "cpu"])
@pytest.mark.parametrize("src", ["none", "cpu"])
def test_a_param_not_stepped_since_amsgrad_was_turned_on_loads_without_a_max_exp_avg_sq(src, dst, tmp_path):
    # the load took every stepped param of an amsgrad group as holding one beside the meta that
    # says which do (the group rule is for checkpoints written before the meta): a param stepped
    # before its group turned amsgrad on, and not since, came back with a max_exp_avg_sq of
    # zeros that torch's state has not (found by tools/history_fuzz.py)
    g = torch.Generator().manual_seed(4)
    ours = [torch.randn(n, generator=g).requires_grad_() for n in (300, 17)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt, ref = offload.AdamW(ours, lr=1e-2, offload=src), torch.optim.AdamW(theirs, lr=1e-2)
    for step in range(2):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            grad = None if step == 1 and i == 1 else torch.randn(a.shape, generator=g)
            a.grad, b.grad = (None, None) if grad is None else (grad.clone(), grad)
        opt.step()
        ref.step()
        opt.param_groups[0]["amsgrad"] = ref.param_groups[0]["amsgrad"] = True
        # (torch's step fails without one: ours starts a param's max_exp_avg_sq at zeros)
        ref.state[theirs[0]].setdefault("max_exp_avg_sq", torch.zeros_like(theirs[0]))
    opt.save_checkpoint(str(tmp_path))
    again = offload.AdamW(ours, lr=1e-2, offload=dst)
    again.load_checkpoint(str(tmp_path))
    for a, b in zip(ours, theirs):
        assert sorted(again.state[a]) == sorted(ref.state[b]) == sorted(opt.state[a])
    ref.load_state_dict(again.state_dict())  # and torch goes on from it
    assert "max_exp_avg_sq" not in ref.state[theirs[1]]
