"""Bytes per memory tier, counted by the layers that own them.

The planner (``offload plan``) predicts how many bytes each tier needs; this module is where
the runtime says what it actually holds, so the two can be compared. Each owner (a
``BufferPool``, the swap layer for NVMe files, the partitioner for device tensors) adds and
removes its own bytes under a name; ``snapshot()`` sums them per tier and keeps the peak.
"""
from __future__ import annotations

from typing import Dict, Tuple

from offload.memory.reentry import FinalizerSafeLock

__all__ = ["TIERS", "Accounting", "default_accounting"]

TIERS = ("device", "pinned_host", "pageable_host", "nvme")
"""The tiers of DESIGN.md, fastest first."""


class Accounting:
    """Thread-safe byte counters keyed by (tier, owner), with a peak per tier.

    Owners are free-form names (``"pool:3"``, ``"swap:/nvme/rank0"``) so a report can say who
    holds what. Counts never go below zero: removing more than was added is a ``ValueError``
    (it means the owner lost track of its bytes, which a report must not hide).
    """

    def __init__(self) -> None:
        self._lock = FinalizerSafeLock()  # [Note: finalizers re-enter] in reentry.py
        self._bytes: Dict[Tuple[str, str], int] = {}
        self._peak: Dict[str, int] = {t: 0 for t in TIERS}

    @staticmethod
    def _check_tier(tier: str) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown memory tier {tier!r}; expected one of {', '.join(TIERS)}")

    def add(self, tier: str, owner: str, nbytes: int) -> None:
        """Count ``nbytes`` more in ``tier`` for ``owner`` (negative to subtract)."""
        self._check_tier(tier)
        if self._lock.defer(self._add, tier, owner, nbytes):
            return
        with self._lock.held():
            self._add(tier, owner, nbytes)

    def _add(self, tier: str, owner: str, nbytes: int) -> None:
        key = (tier, owner)
        new = self._bytes.get(key, 0) + int(nbytes)
        if new < 0:
            raise ValueError(f"{owner}: {tier} bytes would become negative ({new})")
        if new:
            self._bytes[key] = new
        else:
            self._bytes.pop(key, None)
        total = sum(v for (t, _), v in self._bytes.items() if t == tier)
        self._peak[tier] = max(self._peak[tier], total)

    def remove(self, tier: str, owner: str, nbytes: int) -> None:
        """Count ``nbytes`` fewer in ``tier`` for ``owner``."""
        self.add(tier, owner, -int(nbytes))

    def clear_owner(self, owner: str) -> None:
        """Forget everything ``owner`` counted (it released all it held)."""
        if self._lock.defer(self._clear, owner):
            return
        with self._lock.held():
            self._clear(owner)

    def _clear(self, owner: str) -> None:
        for key in [k for k in self._bytes if k[1] == owner]:
            del self._bytes[key]

    def by_owner(self) -> Dict[str, Dict[str, int]]:
        """``{owner: {tier: bytes}}`` for the owners holding bytes now."""
        with self._lock.held():
            out: Dict[str, Dict[str, int]] = {}
            for (tier, owner), v in self._bytes.items():
                out.setdefault(owner, {})[tier] = v
            return out

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        """``{"current": {tier: bytes}, "peak": {tier: bytes}}`` over all owners."""
        with self._lock.held():
            cur = {t: 0 for t in TIERS}
            for (tier, _), v in self._bytes.items():
                cur[tier] += v
            return {"current": cur, "peak": dict(self._peak)}

    def reset_peak(self) -> None:
        """Start a new peak window from the current totals (e.g. at the start of a step)."""
        with self._lock.held():
            for t in TIERS:
                self._peak[t] = sum(v for (tier, _), v in self._bytes.items() if tier == t)


_DEFAULT = Accounting()


def default_accounting() -> Accounting:
    """The process-wide counters that pools and swap files report into by default."""
    return _DEFAULT
