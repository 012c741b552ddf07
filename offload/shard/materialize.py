"""A model built on the meta device, materialized unit by unit as ``shard()`` builds its flats.

[Note: meta materialization] ``shard()`` walks the modules in post-order (children first,
the order of ``module.apply``). A module holding meta params or buffers gets them as real
CPU tensors, zero-filled (never uninitialised memory), one new tensor per old one, set under
every name that held it (a tied param stays one param); then it is initialised: ``init_fn(m)``
when given (called on every module whose subtree had meta tensors, as ``module.apply(init_fn)``
would), else its own ``reset_parameters()``. When the walk leaves a unit module, that unit's
flat buffer is built from its members and only this rank's chunk is kept (flat_unit.py), so the
peak is about one unit's params twice (the members and the flat), never the whole model; the
root unit (the leftover params, and params tied across units) is built last. Same seed on
every rank => same values: the ranks must seed identically before ``shard()`` (or load
weights). The values equal a model built normally when its init runs in the same order (e.g.
``nn.Linear``s built in registration order, or ``model.apply(init_fn)`` after the same seed).
With ``shard(weights=)`` the checkpoint fills the params and persistent buffers (a strict
load), so only the modules holding meta non-persistent buffers (rotary caches, causal masks:
no checkpoint has them) are initialised; the rest stay zeros until loaded. After each unit the
freed heap is given back to the system (``offload.memory.heap.trim_heap``).

An init that writes into a unit already sharded (an ancestor's ``reset_parameters`` looping
over its descendants, as TinyGPT's does) would write into freed memory: while the walk runs,
the sharded units' params are ``_Sharded`` placeholders whose in-place ops raise.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from offload.memory import heap

__all__ = ["has_meta", "check_inits", "materialize"]

InitFn = Optional[Callable[[nn.Module], Any]]


def _own_meta(m: nn.Module) -> List[Tuple[str, str]]:
    """The meta tensors ``m`` holds itself: (kind, name) with kind "param" or "buffer"."""
    out = [("param", n) for n, p in m._parameters.items() if p is not None and p.is_meta]
    return out + [("buffer", n) for n, b in m._buffers.items() if b is not None and b.is_meta]


def has_meta(module: nn.Module) -> bool:
    return any(_own_meta(m) for m in module.modules())


def check_inits(module: nn.Module, init_fn: InitFn, weights: Any) -> None:
    """Before anything is allocated: every module holding meta tensors has an init (with
    ``weights``, params may have none: the checkpoint fills them; non-persistent buffers,
    which no checkpoint holds, still need one)."""
    if init_fn is not None:
        if not callable(init_fn):
            raise TypeError(f"init_fn must be callable (called with each module), got {type(init_fn).__name__}")
        return
    bad = []
    for name, m in module.named_modules():
        if callable(getattr(m, "reset_parameters", None)):
            continue
        own = _own_meta(m)
        if weights is not None:
            own = [(k, n) for k, n in own if k == "buffer" and n in m._non_persistent_buffers_set]
        if own:
            bad.append(f"{name or '<root>'} ({type(m).__name__}: {', '.join(n for _, n in own)})")
    if bad:
        raise ValueError("offload.shard: these modules hold tensors on the meta device but have no "
                         f"reset_parameters() to initialise them: {'; '.join(bad)}. Pass init_fn= "
                         "(called with each module), or weights= for params")


class _ShardedWrite(RuntimeError):
    pass


class _Sharded(torch.Tensor):
    """Stands for a param already in its unit's shards while the walk runs: reads of its
    metadata work (a meta tensor), in-place writes raise."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
            raise _ShardedWrite(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def _holders(module: nn.Module) -> Dict[int, List[Tuple[nn.Module, str, str]]]:
    """id of every tensor -> every (module, kind, name) that holds it (tied ones under each)."""
    out: Dict[int, List[Tuple[nn.Module, str, str]]] = {}
    for m in module.modules():
        for kind, table in (("param", m._parameters), ("buffer", m._buffers)):
            for n, t in table.items():
                if t is not None:
                    out.setdefault(id(t), []).append((m, kind, n))
    return out


class _Walk:
    def __init__(self, module: nn.Module, unit_modules: List[nn.Module], build: Callable[[int], Any],
                 init_fn: InitFn, members: List[list], loading: bool) -> None:
        self.root, self.build, self.init_fn, self.members = module, build, init_fn, members
        self.loading = loading
        self.unit_index = {id(m): i for i, m in enumerate(unit_modules)}
        self.holders = _holders(module)
        self.names = {id(m): n for n, m in module.named_modules()}
        self.new: Dict[int, torch.Tensor] = {}  # id(old meta param) -> its real one, until its unit is built
        self.hidden: List[Tuple[nn.Module, str, torch.Tensor]] = []

    def run(self) -> None:
        self.visit(self.root, set())
        self.install_members(0)
        self.build(0)
        heap.trim_heap()
        for m, name, leaf in self.hidden:  # the units' views, back in place of the placeholders
            setattr(m, name, leaf)

    def visit(self, m: nn.Module, seen: Set[int]) -> bool:
        """Post-order; True when ``m``'s subtree held meta tensors."""
        if id(m) in seen:
            return False
        seen.add(id(m))
        below = any([self.visit(c, seen) for c in m.children()])
        own = _own_meta(m)
        for kind, name in own:
            self.realize(m, kind, name)
        self.init(m, below, own)
        i = self.unit_index.get(id(m))
        if i is not None and i > 0:
            self.install_members(i)
            self.build(i)
            self.hide(i)
            # A unit's temporaries (its params, its flat buffer: tens of MB, under glibc's
            # largest mmap threshold) come from the heap and the chunk kept lands between
            # them; their holes are too small for the next unit's, so without this RSS grows
            # by about the whole model (measured: 768 MB resident for 384 MB of shards).
            heap.trim_heap()
        return below or bool(own)

    def init(self, m: nn.Module, below: bool, own: list) -> None:
        if self.loading:  # the checkpoint fills params and persistent buffers: init only what it cannot
            below, own = False, [(k, n) for k, n in own if k == "buffer" and n in m._non_persistent_buffers_set]
        if self.init_fn is not None:
            run, call, what = below or bool(own), self.init_fn, "init_fn"
        else:  # no reset_parameters: weights= fills it (check_inits)
            run, call, what = bool(own) and callable(getattr(m, "reset_parameters", None)), None, "reset_parameters()"
        if not run:
            return
        try:
            with torch.no_grad():
                call(m) if call is not None else m.reset_parameters()
        except _ShardedWrite as e:
            raise RuntimeError(
                f"offload.shard: the {what} of module {self.names.get(id(m)) or '<root>'} ({type(m).__name__}) "
                f"wrote ({e}) into a param of a unit already sharded (a unit is sharded as soon as its own "
                "modules are initialised): an init must write only its module's own params (and its "
                "descendants' inside the same unit)") from None

    def realize(self, m: nn.Module, kind: str, name: str) -> None:
        old = (m._parameters if kind == "param" else m._buffers)[name]
        data = torch.zeros(old.shape, dtype=old.dtype)  # zeros: an init that skips it leaves no garbage
        new = nn.Parameter(data, requires_grad=old.requires_grad) if kind == "param" else data
        if kind == "param":
            self.new[id(old)] = new
        for h, k, n in self.holders[id(old)]:
            (h._parameters if k == "param" else h._buffers)[n] = new

    def install_members(self, i: int) -> None:
        """The unit's member list (api.py builds the flats from it) <- the real params."""
        self.members[i] = [(self.new.pop(id(p), p), owners) for p, owners in self.members[i]]

    def hide(self, i: int) -> None:
        for p, owners in self.members[i]:
            for m, name in owners:
                leaf = getattr(m, name)
                self.hidden.append((m, name, leaf))
                setattr(m, name, torch.Tensor._make_subclass(_Sharded, torch.empty(leaf.shape, dtype=leaf.dtype,
                                                                                   device="meta")))
        self.members[i] = None  # the unit's real params: no reference left, their memory goes


def materialize(module: nn.Module, unit_modules: List[nn.Module], members: List[list],
                build: Callable[[int], Any], init_fn: InitFn, loading: bool = False) -> None:
    """Materialize ``module``'s meta tensors unit by unit, calling ``build(i)`` (unit i's
    flats from ``members[i]``) as soon as unit i is initialised, the root (0) last. See the
    note. ``loading``: a checkpoint is loaded next; only non-persistent buffers are initialised."""
    _Walk(module, unit_modules, build, init_fn, members, loading).run()

