"""The host store's kept native structs ([Note: prepared batches] in
offload/kernels/native_prepared.py) against the general path, bit for bit.

Each test drives two optimizers over identical params and grads: one as built (its groups
go through their kept structs from the third step on), one whose store never keeps any. After
every step the params and every state must be equal to the bit, whatever was changed
between steps: a state replaced, ``p.data`` reassigned, a non-contiguous grad, a param
without a grad, another thread count or ISA, a load. A counter shows that the kept structs
did run, so the comparison is not of the general path with itself.
"""
from __future__ import annotations

import copy
import errno
import pickle

import pytest
import torch

import offload
from offload.kernels import get_backend
from offload.kernels import native_prepared
from offload.kernels.native_backend import NativeBackend

pytestmark = pytest.mark.skipif(not isinstance(get_backend(None), NativeBackend),
                                reason="the kept structs are the native backend's")

SIZES = [(1,), (7,), (17,), (4097,), (70001,), (33, 65)]  # SIMD tails, two blocks, a 2-D param


class _NeverKept:
    def step(self, *a, **k):
        return False

    def remember(self, *a, **k):
        pass

    def clear(self):
        pass

    def keep_slots(self, count):
        pass

    def forget(self, slot):
        pass


def _make(kind, params, **extra):
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 2e-3}]
    if kind == "adamw":
        return offload.AdamW(groups, lr=1e-2, weight_decay=0.1, **extra)
    if kind == "amsgrad":
        return offload.Adam(groups, lr=1e-2, amsgrad=True, **extra)
    if kind == "sgd":
        return offload.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, **extra)
    if kind == "sgd_plain":
        return offload.SGD(groups, lr=0.05, **extra)
    if kind == "adagrad":
        return offload.Adagrad(groups, lr=0.1, lr_decay=0.01, **extra)
    if kind == "lion":
        return offload.Lion(groups, lr=1e-3, weight_decay=0.1, **extra)
    raise ValueError(kind)


@pytest.fixture
def runs(monkeypatch):
    """Counts the kept structs' runs that stepped."""
    counted = {"ran": 0}
    real = native_prepared.PreparedBatch.run

    def run(self, *a, **k):
        ok = real(self, *a, **k)
        counted["ran"] += bool(ok)
        return ok

    monkeypatch.setattr(native_prepared.PreparedBatch, "run", run)
    return counted


class Pair:
    """Two optimizers over equal params: ``fast`` as built, ``ref`` never keeping structs."""

    def __init__(self, kind, seed=0, **extra):
        gen = torch.Generator().manual_seed(seed)
        self.a = [torch.randn(s, generator=gen).requires_grad_() for s in SIZES]
        self.b = [p.detach().clone().requires_grad_() for p in self.a]
        self.fast, self.ref = _make(kind, self.a, **extra), _make(kind, self.b, **extra)
        self.ref._store._prepared = _NeverKept()
        self.gen = torch.Generator().manual_seed(seed + 1)

    def grads(self, skip=(), transpose=False, negated=False):
        for i, (pa, pb) in enumerate(zip(self.a, self.b)):
            if i in skip:
                pa.grad = pb.grad = None
                continue
            g = torch.randn(pa.shape, generator=self.gen)
            if transpose and g.dim() == 2:  # a non-contiguous grad of the same shape
                g = torch.randn(tuple(reversed(pa.shape)), generator=self.gen).t()
            # torch's lazy negation: the values of g, the memory of -g (ref gets plain g)
            pa.grad, pb.grad = (torch._neg_view(-g) if negated else g), g.clone()

    def step(self, **kw):
        self.grads(**kw)
        self.fast.step()
        self.ref.step()
        self.check()

    def check(self):
        for i, (pa, pb) in enumerate(zip(self.a, self.b)):
            assert torch.equal(pa, pb), f"param {i} differs"
            sa, sb = self.fast.state[pa], self.ref.state[pb]
            assert sorted(sa) == sorted(sb)
            for k in sa:
                assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), f"param {i} {k} differs"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["adamw", "amsgrad", "sgd", "sgd_plain", "adagrad", "lion"])
def test_kept_structs_step_as_the_general_path(kind, threads, runs):
    pair = Pair(kind, num_threads=threads)
    for step in range(6):
        if step == 4:  # a schedule: the constants change, the structs stay
            for opt in (pair.fast, pair.ref):
                for g in opt.param_groups:
                    g["lr"] *= 0.5
        pair.step()
    assert runs["ran"] >= 2 * 3, "the kept structs never ran: this test compared nothing"


def test_changes_between_steps_are_seen(runs, monkeypatch):
    pair = Pair("adamw")
    for _ in range(3):
        pair.step()
    assert runs["ran"] > 0
    a, b = pair.a, pair.b

    def both(fn):
        fn(pair.fast, a)
        fn(pair.ref, b)
        pair.step()
        pair.step()  # the kept structs again, repacked for what changed

    new = torch.randn(SIZES[3])
    both(lambda opt, ps: opt.state[ps[3]].__setitem__("exp_avg", new.clone()))
    new = torch.randn(SIZES[4])
    both(lambda opt, ps: setattr(ps[4], "data", new.clone()))
    both(lambda opt, ps: opt.state[ps[1]].clear())  # restarts, its count at 1: mixed counts in a group
    both(lambda opt, ps: opt.state[ps[2]]["step"].fill_(1000.0))  # torch reads the step each time
    both(lambda opt, ps: opt.state[ps[3]]["exp_avg_sq"].mul_(2.0))  # in place: the same tensor
    pair.step(transpose=True)
    pair.step(skip=(0, 4))
    pair.step(skip=(0, 4))
    pair.step()
    for opt in (pair.fast, pair.ref):
        opt.num_threads = 1
    pair.step()
    monkeypatch.setenv("OFFLOAD_ISA", "avx2" if "avx2" in get_backend(None).supported else "scalar")
    pair.step()
    monkeypatch.delenv("OFFLOAD_ISA")
    pair.step()
    sd = pair.ref.state_dict()
    pair.fast.load_state_dict(copy.deepcopy(sd))
    pair.ref.load_state_dict(copy.deepcopy(sd))
    pair.step()
    pair.step()
    ran = runs["ran"]
    pair.step()
    assert runs["ran"] == ran + 2, "the kept structs did not come back after the changes"


def test_a_state_that_is_its_param_is_refused_as_before():
    pair = Pair("adamw")
    for _ in range(3):
        pair.step()
    p = pair.a[3]
    pair.fast.state[p]["exp_avg"] = p.detach()  # the same memory as the param
    pair.grads()
    with pytest.raises(ValueError, match="overlaps"):
        pair.fast.step()


def test_a_struct_the_library_refuses_steps_the_general_way(runs, monkeypatch):
    pair = Pair("lion")
    for _ in range(3):
        pair.step()
    real = NativeBackend.run_structs
    calls = {"n": 0}

    def refuse_first(self, structs, count, threads):
        calls["n"] += 1
        if calls["n"] == 1:
            return -errno.EINVAL, 0  # refused before anything ran
        return real(self, structs, count, threads)

    monkeypatch.setattr(NativeBackend, "run_structs", refuse_first)
    ran = runs["ran"]
    pair.step()  # the first group falls back, the second runs kept
    assert calls["n"] >= 2 and runs["ran"] == ran + 1


def test_copies_and_pickles_keep_nothing_of_the_original(runs):
    pair = Pair("adamw")
    for _ in range(3):
        pair.step()
    twin = copy.deepcopy(pair.fast)
    again = pickle.loads(pickle.dumps(pair.fast))
    before = [p.detach().clone() for p in pair.a]
    for opt in (twin, again):
        params = [p for g in opt.param_groups for p in g["params"]]
        for _ in range(3):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    for p, q in zip(pair.a, before):
        assert torch.equal(p, q), "a copy's step wrote the original's params"
    pair.step()


def test_step_tensors_of_a_group_are_new_and_independent():
    pair = Pair("adamw")
    pair.step()
    held = [pair.fast.state[p]["step"] for p in pair.a]
    pair.step()
    assert [float(t) for t in held] == [1.0] * len(held)
    now = [pair.fast.state[p]["step"] for p in pair.a]
    assert all(a is not b for a, b in zip(held, now))
    now[0].fill_(50.0)  # one param's count only
    assert [float(t) for t in now[1:]] == [2.0] * (len(now) - 1)


def test_a_batch_packed_for_another_tail_does_not_run():
    pair = Pair("adamw")
    for _ in range(3):
        pair.step()
    kept = pair.fast._store._prepared._kept
    assert kept, "no group kept its structs"
    batch = next(iter(kept.values())).batch
    other = (batch.tail[0], batch.tail[1] + 1, batch.tail[2])
    assert not batch.run([0] * batch.count, [1] * batch.count, None, other)


def test_a_state_replaced_by_another_dtype_is_refused():
    pair = Pair("adamw")
    for _ in range(3):
        pair.step()
    p = pair.a[3]
    del pair.fast.state[p]["exp_avg"]  # its address free for the next tensor, but for the kept batch
    pair.fast.state[p]["exp_avg"] = torch.zeros(p.numel(), dtype=torch.float64)
    pair.grads()
    with pytest.raises(TypeError, match="exp_avg"):
        pair.fast.step()


def test_loaded_step_tensors_keep_their_dtype():
    """A loaded float64 step (saved under torch.set_default_dtype(torch.float64)) stays
    float64, as torch's own _get_value / step_t += 1 keep it; the others are new float32."""
    pair = Pair("adamw")
    pair.step()
    sd = pair.fast.state_dict()
    sd["state"][0]["step"] = sd["state"][0]["step"].to(torch.float64)
    pair.fast.load_state_dict(sd)
    pair.grads()
    pair.fast.step()
    steps = [pair.fast.state[p]["step"] for p in pair.a]
    assert steps[0].dtype == torch.float64 and float(steps[0]) == 2.0
    assert all(t.dtype == torch.float32 and float(t) == 2.0 for t in steps[1:])


def test_a_param_listed_twice_steps_twice_each_step(runs):
    """torch warns and steps it as often as listed; the kept structs hold it twice, at two
    counts (the library runs structs over the same memory in order: batch_alias.h)."""
    p0 = torch.randn(5000)
    q, r = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    with pytest.warns(UserWarning, match="duplicate parameters"):
        fast = offload.AdamW([q, q], lr=1e-2, weight_decay=0.01, num_threads=2)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ref = offload.AdamW([r, r], lr=1e-2, weight_decay=0.01, num_threads=2)
    ref._store._prepared = _NeverKept()
    for k in range(5):
        g = torch.randn(5000)
        q.grad, r.grad = g, g.clone()
        fast.step()
        ref.step()
        assert torch.equal(q, r) and float(fast.state[q]["step"]) == 2.0 * (k + 1)
    assert runs["ran"] >= 2


@pytest.mark.parametrize("kind", ["adamw", "sgd", "adagrad"])
def test_the_same_memory_in_another_layout_is_seen(kind, runs):
    """A param or state that keeps its address and size but not its layout (the same memory
    viewed transposed) steps as its new layout, as the general path and torch do; the
    kept structs once stepped it as the old one, silently."""
    pair = Pair(kind)
    for _ in range(4):
        pair.step()
    ran = runs["ran"]
    assert ran > 0
    for p in (pair.a[5], pair.b[5]):  # (33, 65): the same memory read as a (65, 33) transposed
        p.data = p.data.reshape(65, 33).t()
        assert not p.is_contiguous()
    pair.step()
    pair.step()
    name = {"adamw": "exp_avg", "sgd": "momentum_buffer", "adagrad": "sum"}[kind]
    for opt, ps in ((pair.fast, pair.a), (pair.ref, pair.b)):
        st = opt.state[ps[5]]
        st[name] = st[name].reshape(65, 33).t()
        assert not st[name].is_contiguous()
    pair.step()
    pair.step()
    assert runs["ran"] > ran, "the kept structs never ran again"


def test_a_grad_with_a_lazy_negation_is_read_as_its_values(runs):
    """``torch._neg_view(-g)`` holds -g in memory and reads as g: both paths step g."""
    pair = Pair("adamw")
    for _ in range(3):
        pair.step()
    for _ in range(3):
        pair.step(negated=True)
    assert runs["ran"] > 0


def test_a_removed_group_keeps_no_storage(runs):
    """A kept batch holds its tensors' storages: a group removed from ``param_groups``
    must not keep its states alive through its kept structs."""
    pair = Pair("adamw")
    for _ in range(4):
        pair.step()
    kept = pair.fast._store._prepared._kept
    assert 1 in kept
    for opt, ps in ((pair.fast, pair.a), (pair.ref, pair.b)):
        opt.param_groups.pop()
        for p in ps[3:]:
            opt.state.pop(p, None)
            p.grad = None
    pair.a, pair.b = pair.a[:3], pair.b[:3]
    pair.step()
    assert sorted(kept) == [0]


def test_a_group_without_grads_keeps_no_storage(runs):
    """A group none of whose params has a grad (frozen) is not stepped, so its kept batch
    would never be checked again: its storages (the user may drop the params' data and
    states, as torch then frees them) must not stay alive in it. Unfrozen, it steps as the
    general path and is kept again."""
    pair = Pair("adamw")
    for _ in range(4):
        pair.step()
    kept = pair.fast._store._prepared._kept
    assert 1 in kept
    frozen = tuple(range(3, len(SIZES)))
    pair.step(skip=frozen)
    assert sorted(kept) == [0]
    ran = runs["ran"]
    for _ in range(4):
        pair.step()
    assert 1 in kept and runs["ran"] > ran
