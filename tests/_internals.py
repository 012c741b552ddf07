"""The one place tests name the optimizer's private internals.

Tests read state through public API (opt.state_dict(), opt.state[p], opt.memory_report(),
opt.step_stats(), save/load_checkpoint) or a method of the store protocol
(offload/optim/protocol.py). Some white-box tests check an internal invariant on purpose
(the store holds no reference to its optimizer, swap files sit where the layout says, the
flat store's CUDA streams are used in order): they reach the internals through the
accessors below, so a rename inside offload/optim is fixed here, once.
"""
from __future__ import annotations

from typing import Any

import torch

from offload.optim import protocol


def store(opt: Any) -> Any:
    """The optimizer's store (HostState, SwappedState or FlatState). Exists for the tests of
    the store protocol itself (its methods are called, patched or checked for a cycle)."""
    return opt._store


def master(opt: Any, p: torch.Tensor) -> torch.Tensor:
    """``p``'s fp32 master through the protocol's optional ``master`` (the flat store: bf16/fp16
    or device params; gathered across ranks, so call it on every rank)."""
    get = protocol.optional(store(opt), "master")
    if get is None:
        raise AttributeError(f"the {store(opt).kind!r} store keeps no separate master (p is it)")
    return get(p)


def swap(opt: Any) -> Any:
    """The swap session (SwappedShards-like: .store, .pipeline, .layout, .swap_path) of an
    nvme optimizer: the fp32 store itself, or the flat store's. Exists for the tests that
    inject io faults into, or check the files of, a live swap directory."""
    st = store(opt)
    inner = getattr(st, "_swap", None)
    if inner is not None:
        return inner
    if getattr(st, "kind", None) != "nvme":
        raise AttributeError(f"the {st.kind!r} store has no swap session")
    return st


def swap_path(opt: Any) -> str:
    """The run's swap directory (where the files the test corrupts, or counts, are)."""
    return swap(opt).swap_path


def flat_groups(opt: Any) -> Any:
    """The flat store's param groups (staging and host-grad buffers are checked on them)."""
    return store(opt)._groups


def streams(opt: Any) -> Any:
    """The flat store's per-device (grad, copy) CUDA streams: a test plants counting streams."""
    return store(opt)._streams


def leave_swap_as_killed(opt: Any) -> str:
    """Leave ``opt``'s swap directory as a killed process would: its lock free, nothing flushed,
    nothing removed (opt.close(keep_swap=True) flushes first, which a kill does not); the
    optimizer is unusable afterwards. Returns the directory, for a resume=True optimizer."""
    sw = swap(opt)
    sw._finalizer.detach()
    sw.pipeline.close()
    sw.store.close(remove=False)
    return sw.store.path


def backward_reduction(opt: Any) -> Any:
    """The flat store's in-backward gradient reducer, or None (its launch sequence and bucket
    order are compared across ranks: they must agree or a collective hangs)."""
    return getattr(store(opt), "_backward_reduction", None)
