"""DeepSpeed's name of Adagrad's state, ``"exp_avg_sq"``, on ``DeepSpeedCPUAdagrad``.

[Note: DeepSpeed's state names]
DeepSpeed's CPU Adagrad keeps its running sum of squared grads as ``state["exp_avg_sq"]``;
torch's, and ``offload.Adagrad``'s, is ``state["sum"]``. Code written for DeepSpeed's class
reads ``opt.state[p]["exp_avg_sq"]`` (DeepSpeed's own test of non-contiguous params does), so
the shim's entries answer both names for the one state:

- ``opt.state[p]["exp_avg_sq"]``, ``.get``, ``in``, assignment, ``del``, ``pop``,
  ``setdefault`` and ``update`` go to ``"sum"`` (an assignment writes the state the next step
  reads, through the store as ``"sum"``'s does);
- the entry lists ``"sum"`` only, so ``state_dict()`` keeps torch's layout and moves to and
  from ``torch.optim.Adagrad``;
- ``load_state_dict`` also takes DeepSpeed's layout: an entry with ``"exp_avg_sq"`` and no
  ``"sum"`` loads it as the sum (its int ``"step"`` becomes torch's tensor, as torch's
  Adagrad loads an old dict), and a group without torch's ``lr_decay`` or
  ``initial_accumulator_value`` (DeepSpeed's has neither) takes the optimizer's defaults.

The entries are made so by the mapping that holds them (``NamedState``, which the shim puts
wherever torch sets ``opt.state``: its constructor, a load, an unpickle): a plain dict put in
by torch or a store (a load, a param's first step after ``del opt.state[p]``) is swapped for a
``NamedEntry`` holding the same tensors when it is read (``opt.state[p]``, ``.get``,
``.values()``, ``.items()``), and a store's ``SwappedEntry`` (states read on access) takes the
names in place, its views and readers kept.
"""
from __future__ import annotations

import collections
from typing import Any, Dict

from offload.optim.state_entry import SwappedEntry

__all__ = ["NamedState", "deepspeed_layout_to_torch"]

ALIASES = {"exp_avg_sq": "sum"}
"""DeepSpeed's name -> torch's, of DeepSpeedCPUAdagrad's state."""


class _Aliased:
    """The name lookups of an entry that also answers ``ALIASES``' names."""

    __slots__ = ()

    def __missing__(self, key: Any) -> Any:
        if key in ALIASES:
            try:
                return self[ALIASES[key]]
            except KeyError:
                raise KeyError(key) from None
        missing = getattr(super(), "__missing__", None)  # (SwappedEntry's reads on access)
        if missing is None:
            raise KeyError(key)
        return missing(key)

    def __contains__(self, key: Any) -> bool:
        return super().__contains__(ALIASES.get(key, key))

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(ALIASES.get(key, key), value)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(ALIASES.get(key, key))

    def pop(self, key: Any, *default: Any) -> Any:
        return super().pop(ALIASES.get(key, key), *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


class NamedEntry(_Aliased, dict):
    """A plain entry (the host store's: torch's dict of tensors) with DeepSpeed's names."""


class NamedSwappedEntry(_Aliased, SwappedEntry):
    """A store's entry (``state_view.py``) with DeepSpeed's names."""


def _named(entry: Any) -> Any:
    if type(entry) is dict:
        return NamedEntry(entry)
    if type(entry) is SwappedEntry:
        entry.__class__ = NamedSwappedEntry  # in place: the store's views and readers stay bound
    return entry


class NamedState(collections.defaultdict):
    """``opt.state`` whose entries answer DeepSpeed's names (the module docstring)."""

    def __init__(self, entries: Any = ()) -> None:
        super().__init__(NamedEntry)
        for key, entry in dict(entries).items():
            dict.__setitem__(self, key, _named(entry))

    def __getitem__(self, key: Any) -> Any:
        entry = super().__getitem__(key)
        named = _named(entry)
        if named is not entry:
            dict.__setitem__(self, key, named)
        return named

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if dict.__contains__(self, key) else default

    def _name_all(self) -> None:
        for key in list(dict.keys(self)):
            self[key]

    # (what a store put in since, a SwappedEntry after a step, is named before it is listed)
    def values(self) -> Any:
        self._name_all()
        return super().values()

    def items(self) -> Any:
        self._name_all()
        return super().items()

    def __reduce__(self):  # (defaultdict's would pass the factory to __init__)
        return (NamedState, (), None, None, iter(dict.items(self)))


def deepspeed_layout_to_torch(state_dict: Any, defaults: Any = None) -> Any:
    """``state_dict`` with each entry that holds DeepSpeed's ``"exp_avg_sq"`` and no
    ``"sum"`` renamed to torch's (key order kept), and each param group given the keys of
    ``defaults`` it lacks; anything else as given."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        return state_dict
    groups = state_dict.get("param_groups")
    if isinstance(defaults, dict) and isinstance(groups, list):
        state_dict = {**state_dict, "param_groups": [{**defaults, **g} if isinstance(g, dict) else g
                                                      for g in groups]}
    state: Dict[Any, Any] = {}
    for k, entry in state_dict["state"].items():
        if isinstance(entry, dict) and "exp_avg_sq" in dict.keys(entry) and "sum" not in dict.keys(entry):
            entry = {ALIASES.get(key, key): v for key, v in dict.items(entry)}
        state[k] = entry
    return {**state_dict, "state": state}
