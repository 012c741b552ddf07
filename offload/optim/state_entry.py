"""``SwappedEntry``: the dict behind ``opt.state[p]`` of a param whose states a flat or
swapped store keeps (state_view.py attaches it after each step).

[Note: states an entry reads on access] A state held in the swap files (``offload="nvme"``)
or as int8 blocks of the flat store is not in the dict: it is read on each access
(``__missing__``). It is listed all the same, as torch's code and its users' expect of
``opt.state[p]``: ``"exp_avg" in st``, ``st.keys()``, ``len(st)``, iteration, ``items()``,
``values()``, ``dict(st)``, ``{**st}``, ``==``, ``repr``, ``copy()``, ``copy.deepcopy`` and pickle
see it as on the RAM stores' dicts (before, ``"exp_avg" in st`` was False while ``st["exp_avg"]``
worked, so ``if "exp_avg" in state:`` skipped it, and a deepcopy of ``opt.state`` held only the
steps). Listing it reads nothing (the store says whether it holds the param's states: a rank
holding none of a partitioned ``p`` lists none, a closed store none); a value (``items()``,
``values()``, ``dict(st)``, a copy) is a read. An entry without ``"step"`` lists none: that is
a param whose entry the user cleared (``st.clear()``, torch's way to start it afresh), whose
states the next step resets.
"""
from __future__ import annotations

from collections.abc import ItemsView, KeysView, ValuesView
from typing import Any, Callable, Iterator, Optional

import torch

from offload.optim.write_back import bind

__all__ = ["SwappedEntry", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")
_ABSENT = object()


def _holds_all() -> bool:
    return True


class _Keys(KeysView):  # (dict's views are reversible: reversed(opt.state[p].keys()))
    def __reversed__(self) -> Iterator[Any]:
        return reversed(self._mapping)


class _Items(ItemsView):
    def __reversed__(self) -> Iterator[Any]:
        return ((k, self._mapping[k]) for k in reversed(self._mapping))


class _Values(ValuesView):
    def __reversed__(self) -> Iterator[Any]:
        return (self._mapping[k] for k in reversed(self._mapping))


class SwappedEntry(dict):
    """``opt.state[p]`` of a param whose states live in the store: the keys that are not
    held in the dict (swapped, or int8 blocks) are read on access and listed (module
    docstring), and assigning any of the store's keys writes the store (``writer``).
    ``holds()``: whether the store holds p's states (no read); ``version(key)``: the version of
    that state a copy records to write an in-place change back ([Note: state versions]; None:
    no write-back, the copy refuses in-place changes)."""

    def __init__(self, entry: dict, reader: Callable[[str], Optional[torch.Tensor]],
                 names: tuple = MOMENTS, writer: Optional[Callable[[str, Any], None]] = None,
                 holds: Callable[[], bool] = _holds_all,
                 version: Optional[Callable[[str], Any]] = None) -> None:
        super().__init__(entry)
        self._version = version
        self._reader = reader
        self._names = names
        self._writer = writer
        self._holds = holds

    def holds(self) -> bool:
        """Whether the store holds p's states on this rank (stage 1/2: a slice of p; no read)."""
        return self._holds()

    def _read_keys(self) -> tuple:
        """The store's states this entry lists but does not hold in the dict (read on access)."""
        if not dict.__contains__(self, "step"):
            return ()
        keys = tuple(k for k in self._names if not dict.__contains__(self, k))
        return keys if keys and self._holds() else ()

    def __missing__(self, key: Any) -> torch.Tensor:
        if key not in self._read_keys():
            raise KeyError(key)
        since = self._version(key) if self._version is not None else None  # (before the read)
        value = self._reader(key)
        if value is None:
            raise KeyError(key)
        if self._version is not None:  # [Note: an in-place change of a read copy is written back]
            bind(value, self, key, since)
        return value

    # --- listing: the dict's own keys, then the states read on access (no read)
    def __contains__(self, key: Any) -> bool:
        return dict.__contains__(self, key) or key in self._read_keys()

    def __iter__(self) -> Iterator[Any]:
        return iter((*dict.keys(self), *self._read_keys()))

    def __reversed__(self) -> Iterator[Any]:
        return reversed((*dict.keys(self), *self._read_keys()))

    def __len__(self) -> int:
        return dict.__len__(self) + len(self._read_keys())

    def keys(self) -> KeysView:
        return _Keys(self)

    def items(self) -> ItemsView:  # (reads each state read on access)
        return _Items(self)

    def values(self) -> ValuesView:
        return _Values(self)

    def copy(self) -> dict:  # a plain dict, as dict.copy of a subclass gives
        return dict(self)

    def __eq__(self, other: Any) -> bool:
        if other is self:
            return True
        return dict(self) == (dict(other) if isinstance(other, SwappedEntry) else other)

    def __ne__(self, other: Any) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(dict(self))

    def __or__(self, other: Any) -> dict:
        return dict(self) | other

    def __ror__(self, other: Any) -> dict:
        return dict(other) | dict(self)

    # --- changes: assigning a store's state writes the store
    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self._names and self._writer is not None:
            self._writer(key, value)
        else:
            super().__setitem__(key, value)

    def _refuse_drop(self, key: Any, how: str) -> None:
        # A store's state is not the dict's to drop: deleting a view (flat store) left the
        # store's values in place and the next step put the view back (SGD went on with its
        # old momentum where torch's restarts it); a swapped one is not in the dict at all.
        if key in self._names and self._writer is not None:
            raise NotImplementedError(
                f"{how}: this optimizer keeps {key!r} in its store, not in opt.state, and cannot drop "
                "one state of a param; `del opt.state[p]` starts all of p's states afresh as torch "
                f"does, or assign opt.state[p][{key!r}] = torch.zeros_like(p) to zero this one")

    def __delitem__(self, key: Any) -> None:
        self._refuse_drop(key, f"del opt.state[p][{key!r}]")
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self._refuse_drop(key, f"opt.state[p].pop({key!r})")
        return super().pop(key, *default)

    def popitem(self) -> Any:
        if self:  # dict.popitem drops the last key: refused as a del of that key is
            key = next(reversed(self))
            self._refuse_drop(key, f"opt.state[p].popitem() (it drops {key!r})")
        return super().popitem()

    # dict's own update, |= and setdefault bypass __setitem__: an update of a store-held
    # state replaced the view in the dict and left the store's values (the next step put the
    # view back and went on from them)
    # All or nothing, as a load: a value the store refuses (a wrong size, say) raised after the
    # states before it were written, so a caller that caught the error went on with those.
    def update(self, *args: Any, **kwargs: Any) -> None:
        done = []  # (key, its value before), in the order written
        try:
            for key, value in dict(*args, **kwargs).items():
                before = self.get(key, _ABSENT) if key in self._names else dict.get(self, key, _ABSENT)
                # (a store's state may be a live view into its buffers: the write changes it)
                done.append((key, before.clone() if key in self._names and isinstance(before, torch.Tensor) else before))
                self[key] = value
        except BaseException:
            for key, before in reversed(done[:-1]):  # (the last one was refused: nothing written)
                if before is not _ABSENT:
                    self[key] = before  # (a read written back is bit for bit: state_view.py)
                elif not (key in self._names and self._writer is not None):
                    dict.pop(self, key, None)
            raise

    def __ior__(self, other: Any) -> "SwappedEntry":
        self.update(other)
        return self

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self._names or self._writer is None:
            return super().setdefault(key, default)
        try:
            return self[key]
        except KeyError:
            self[key] = default
            return default

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __reduce__(self):  # pickled and deep-copied as the plain dict it reads as (no store inside)
        return (dict, (dict(self),))
