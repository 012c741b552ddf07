"""The write-back of an in-place change of a read copy to the store it was read from.

[Note: an in-place change of a read copy is written back] ``opt.state[p]["exp_avg"].zero_()``
(a reset after a loss spike), ``.mul_(0.5)``, torch's own tests' ``opt.state[p][k].copy_(ref)``:
on torch's states these change the state. A state read from the swap files (or decoded from
int8 blocks) is a new tensor, a ``ReadCopy``: the change was silently lost, then refused. Now
the change is applied to the copy and the whole copy is written back through its entry's
writer, as an assignment ``opt.state[p][k] = copy`` would (encoded as the state is stored:
bf16 rounded to nearest, int8 blocks re-encoded, packed int8 blocks bit for bit), so the store
holds what torch's state would (up to that encoding).

Only while the copy is not stale: a copy whose state may have changed since it was read (a
step, a restored step, a load, another assignment or write-back of the same state, a
``clear()`` of the entry, ``close()``) refuses the change and changes nothing, as does a copy
changed in another thread than the one that read it, or in a forked child (whose writes would
land in the parent's swap files). In torch ``a = st["exp_avg"]; st["exp_avg"] = b; a.mul_(0.5)``
leaves the state ``b``: writing ``a * 0.5`` back would be wrong. The versions are in
state_versions.py ([Note: state versions]); a write-back takes the new version, so a second
in-place change of the same copy lands too.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Optional, Tuple

import torch

__all__ = ["WriteBack", "bind"]


class WriteBack:
    """Where a read copy came from (entry, key, the version read) and how to write it back."""

    __slots__ = ("_entry", "key", "whole", "since", "_thread", "_pid")

    def __init__(self, entry: Any, key: str, whole: torch.Tensor, since: Tuple[int, int]) -> None:
        self._entry = weakref.ref(entry)
        self.key = key
        self.whole = whole  # a plain tensor over the whole copy's memory (views write into it)
        self.since = since
        self._thread = threading.get_ident()
        self._pid = os.getpid()

    def refusal(self) -> Optional[str]:
        """Why the copy may not be written back now, or None."""
        entry = self._entry()
        if os.getpid() != self._pid:
            return "it was read in the process this one was forked from (its store is that process's)"
        if threading.get_ident() != self._thread:
            return "it was read in another thread (read it again in this one)"
        if entry is None or self.key not in entry._read_keys():
            return "its state is no longer listed (opt.state[p] cleared or replaced, or the optimizer closed)"
        now = entry._version(self.key)
        if now is None:
            return "its store belongs to the process this one was forked from"
        if now != self.since:
            return ("stale: read it again; the state may have changed since this copy was read (a step, a load, "
                    "an assignment or another copy's in-place change)")
        return None

    def write(self) -> None:
        entry = self._entry()
        entry._writer(self.key, self.whole)
        self.since = entry._version(self.key)  # (its own write: the copy stays current)


def bind(value: Any, entry: Any, key: str, since: Optional[Tuple[int, int]]) -> None:
    """Give ``value`` (a read copy of ``entry``'s ``key``, read at version ``since``; None: read
    in a forked child) its write-back."""
    from offload.optim.read_copy import ReadCopy, plain

    if isinstance(value, ReadCopy):
        value._write_back = WriteBack(entry, key, plain(value), since)
