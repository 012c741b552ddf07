"""The core's seams (issue #14, first step): the store protocol written down in one module,
the flat store split into collaborators, and no collective hidden inside ``grads(p)``."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import offload
from offload.optim import protocol
from offload.optim.flat_state import FlatState
from offload.optim.host_state import HostState
from offload.optim.swapped_state import SwappedState
from offload.zero import comm
import _internals as internals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("step", "export_state", "import_state", "reset_state", "memory_report", "close")


def test_the_protocol_lists_every_required_method_and_every_store_has_them():
    listed = {n for n in vars(protocol.Store) if not n.startswith("_")}
    assert set(REQUIRED) <= listed
    for cls in (HostState, SwappedState, FlatState):
        missing = [n for n in REQUIRED if not callable(getattr(cls, n, None))]
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert isinstance(cls.kind, str)


def test_optional_methods_are_asked_for_by_their_listed_name_only():
    opt = offload.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert protocol.optional(internals.store(opt), "grads") is None  # the host store reads p.grad itself
    assert protocol.optional(internals.store(opt), "check_param") == internals.store(opt).check_param
    with pytest.raises(AttributeError, match=r"'grad' is not an optional method of the store protocol"):
        protocol.optional(internals.store(opt), "grad")
    # every name the optimizer frame asks for is in the list (a typo there would raise on
    # every step); the frame moved from adam.py to base.py (RuleOptimizer) with issue #15
    src = "".join(open(os.path.join(ROOT, "offload", "optim", name), encoding="utf-8").read()
                  for name in ("base.py", "adam.py"))
    asked = {part.split('"')[1] for part in src.split("optional(self._store, ")[1:]}
    assert asked and asked <= set(protocol.OPTIONAL), asked - set(protocol.OPTIONAL)
    assert "getattr(self._store, \"" not in src.replace("getattr(self._store, \"kind\"", "")


@pytest.fixture
def two_ranks(monkeypatch):
    """A flat store that believes it is rank 0 of 2; all_reduce calls are counted (and, on
    one process, the MAX over ranks is the local value)."""
    calls = []
    monkeypatch.setattr(comm, "world_and_rank", lambda group=None: (2, 0))
    monkeypatch.setattr(comm, "all_reduce", lambda t, group=None, op=None: calls.append(t.clone()))
    return calls


def test_grads_is_never_a_collective_and_agree_is_one_per_step(two_ranks):
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(6))
    opt = offload.AdamW([a, b], stage=2)
    assert len(two_ranks) == 1  # building it: the ranks agree on the params (comm.agree_on_params)
    two_ranks.clear()
    store = internals.store(opt)
    assert isinstance(store, FlatState) and store.world == 2
    a.grad = torch.full((4,), 2.0)
    with pytest.raises(RuntimeError, match=r"needs agree_on_grads\(\) first"):
        store.grads(a)
    assert two_ranks == []  # the getter started no collective
    store.agree_on_grads()
    store.agree_on_grads()  # once a step: the second call does nothing
    # the mask, found_inf, then each rank's (failed, hyperparameters, steps): [Note: a step the
    # ranks agree to begin] in offload/optim/step_agreement.py
    assert len(two_ranks) == 1 and two_ranks[0].tolist() == [1, 0, 0] + [0, 0, 0] * 2
    assert store.grads(a) is a.grad
    assert store.grads(b) is None  # no rank has one (as the all-reduced mask says)
    opt.close()


def test_the_split_modules_keep_the_shape_limits():
    spec = importlib.util.spec_from_file_location("check_sizes", os.path.join(ROOT, "tools", "check_sizes.py"))
    cs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cs)
    files = {k: v for k, v in cs.module_files(os.path.join(ROOT, "offload")).items()
             if k.startswith(("offload.optim.flat", "offload.optim.protocol"))}
    assert "offload.optim.flat.store" in files and "offload.optim.flat_state" in files
    assert cs.long_files(files) == []
    assert cs.long_functions(files) == []
    assert [c for c in cs.import_cycles(cs.import_graph(cs.module_files(os.path.join(ROOT, "offload"))))
            if any(m.startswith("offload.optim.flat") for m in c)] == []


class _Stream:
    """A side stream that copies at once and counts the copies queued on it."""

    def __init__(self):
        self.entered = 0

    def synchronize(self):
        pass

    wait_current = current_waits = synchronize

    def keep_alive(self, t):
        pass

    def context(self):
        import contextlib

        self.entered += 1
        return contextlib.nullcontext()


@pytest.mark.parametrize("flip", [False, True])
def test_overlap_is_read_at_each_copy(monkeypatch, flip):
    # bench/offload_step.py flips FlatState.overlap between the steps of one optimizer:
    # the grad hook and the param sink must follow it, not a value taken at construction.
    pairs = []
    monkeypatch.setattr(FlatState, "side_streams",
                        staticmethod(lambda dev: pairs.append((_Stream(), _Stream())) or pairs[-1]))
    monkeypatch.setattr(FlatState, "copy_cpu_grads", True)
    monkeypatch.setattr(FlatState, "stage_cpu_params", True)
    monkeypatch.setattr(FlatState, "overlap", True)
    p = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    ref = torch.nn.Parameter(p.detach().float().clone())
    opt, topt = offload.AdamW([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    if flip:
        monkeypatch.setattr(FlatState, "overlap", False)
    (p.float() * torch.arange(64.0)).sum().backward()
    (ref * torch.arange(64.0)).sum().backward()
    opt.step()
    topt.step()
    grad_stream, copy_stream = pairs[0]
    assert (grad_stream.entered, copy_stream.entered) == ((0, 0) if flip else (1, 1))
    master = internals.master(opt, p)
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p.detach(), master.bfloat16(), rtol=0, atol=0)  # the copy went to the param
    opt.close()
