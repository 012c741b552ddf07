"""``opt.state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` in every store, as torch's tests and
users' monitoring code read them.

- fp32 CPU params in RAM (``HostState``): the moments are there already, in torch's layout,
  or, with ``state_dtype="bfloat16"`` / ``"int8"``, as stored (bf16 of p's shape, 1-D uint8
  packed blocks): [Note: compressed states in the host store] in host_state.py.
- Flat store in RAM: views into the flat fp32 host buffers, shaped like ``p`` on one rank;
  partitioned, this rank's slice only (1-D; absent on a rank that holds none of ``p``).
  They are the live states: the next step changes them.
- In swap files (``offload="nvme"``): read from the swap files on each access (a new tensor,
  up to ``p``'s size in RAM and one swap read each time; never a stale copy kept in RAM),
  compressed states decoded (float32 of ``p``'s shape, not the stored bf16 or int8 blocks).
  These keys are not stored in the dict: ``"exp_avg" in opt.state[p]`` is False and
  ``keys()`` does not list them; ``opt.state[p]["exp_avg"]`` and ``.get("exp_avg")`` work.
  Partitioned: this rank's slice, as above.

``state_dict()`` never returns these views: it reads full tensors from the store.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

__all__ = ["SwappedEntry", "attach", "detach"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def names_of(store: Any) -> tuple:
    """The per-element states ``store`` keeps for its rule (Adam's moments for a store without one)."""
    rule = getattr(store, "rule", None)
    return rule.names if rule is not None else MOMENTS


class SwappedEntry(dict):
    """``opt.state[p]`` of a param whose moments live in swap files: those keys are read on access."""

    def __init__(self, entry: dict, reader: Callable[[str], Optional[torch.Tensor]],
                 names: tuple = MOMENTS) -> None:
        super().__init__(entry)
        self._reader = reader
        self._names = names

    def __missing__(self, key: Any) -> torch.Tensor:
        value = self._reader(key) if key in self._names else None
        if value is None:
            raise KeyError(key)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __reduce__(self):  # pickled and deep-copied as the plain dict it holds (no store inside)
        return (dict, (dict(self),))


def _swapped_reader(store: Any, p: torch.Tensor) -> Callable[[str], Optional[torch.Tensor]]:
    ref, pref = weakref.ref(store), weakref.ref(p)

    def read(key: str) -> Optional[torch.Tensor]:
        st, param = ref(), pref()
        if st is None or param is None or getattr(st, "_closed", False):
            return None
        if param.numel() == 0:  # no bytes in the swap files; torch's state holds empty moments
            return torch.zeros(param.shape, dtype=torch.float32)
        if hasattr(st, "read_state"):  # SwappedState: fp32 CPU params, whole
            return st.read_state(param)[st.names.index(key)]
        fg, i = st._where[param]
        piece = fg.layout.owned(i)
        if piece is None or st._swap is None:
            return None
        start = fg.layout.shard_range()[0]
        vals = st._swap.read(st._groups.index(fg), piece.lo - start, piece.hi - start, (key,))[key]
        return vals.view(param.shape) if piece.numel == param.numel() else vals

    return read


def _flat_views(store: Any, p: torch.Tensor, st: dict) -> None:
    if p.numel() == 0:  # no bytes in the flat buffers; torch's state holds empty moments
        for key in names_of(store):
            st[key] = torch.zeros(p.shape, dtype=torch.float32)
        return
    fg, i = store._where[p]
    piece = fg.layout.owned(i)
    if piece is None:
        return
    start = fg.layout.shard_range()[0]
    for key in names_of(store):
        view = fg.state(key)[piece.lo - start:piece.hi - start]
        st[key] = view.view(p.shape) if piece.numel == p.numel() else view


def attach(opt: Any) -> None:
    """Put the moments (views, or readers) into ``opt.state[p]`` of every param that has
    stepped (has a ``"step"``)."""
    store = opt._store
    kind = getattr(store, "kind", None)
    if kind == "host" or store is None:
        return
    for p in [p for g in opt.param_groups for p in g["params"]]:
        st = opt.state.get(p)
        if not st or "step" not in st:
            continue
        if kind == "nvme" or getattr(store, "_nvme", False):
            if not isinstance(st, SwappedEntry):
                opt.state[p] = SwappedEntry(st, _swapped_reader(store, p), names_of(store))
        elif not any(k in st for k in names_of(store)) and (p in getattr(store, "_where", {}) or p.numel() == 0):
            _flat_views(store, p, st)


def detach(opt: Any) -> None:
    """Drop the views into the store's buffers (before they are freed)."""
    if getattr(opt._store, "kind", None) == "host":
        return
    names = names_of(opt._store)
    for st in opt.state.values():
        for key in names:
            if isinstance(st, dict) and key in st:
                del st[key]
