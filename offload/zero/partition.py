"""Where each parameter lives in a flat buffer, and which part of it this rank owns.

[Note: flat layout] The params of one flat group (same device and dtype) are laid end to
end in a flat buffer of ``total`` elements, padded with zeros to ``padded``, a multiple of
the world size, so every rank owns one contiguous shard of ``shard = padded // world``
elements: rank ``r`` owns flat ``[r * shard, (r + 1) * shard)``. A param may straddle two
shards; each rank steps only its own *pieces* (param ∩ shard).

[Note: block-aligned flat layout] With ``align`` > 1 (256 when a state is stored in int8
blocks: [Note: block-wise 8-bit states] in offload/kernels/quant.py) every param starts at a
multiple of ``align`` (zeros between params) and the shard is a multiple of ``align``, so no
block holds elements of two params or of two ranks' shards. A block shared by two params
would be re-encoded when one of them steps: the other's states would move without a grad
(torch leaves them alone), or at another step count. The offsets do not depend on the world
size, so each element keeps its flat index (its random stream) on any number of ranks.
``align`` = 1 is the unpadded layout. Nothing here allocates or
communicates: it is the arithmetic the optimizer and the collectives share, kept pure so it
can be tested exhaustively.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

__all__ = ["FlatLayout", "Piece", "split_ranges"]


@dataclass(frozen=True)
class Piece:
    """The part of param ``index`` that lies in [``lo``, ``hi``) of the flat buffer."""

    index: int
    lo: int
    hi: int
    param_offset: int
    """Offset of ``lo`` inside the flattened param."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class FlatLayout:
    """Offsets of params in a flat buffer padded to ``world``, and the shard of ``rank``."""

    def __init__(self, numels: Sequence[int], world: int = 1, rank: int = 0, align: int = 1) -> None:
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ValueError(f"align must be an int >= 1, got {align!r}")
        self.numels: Tuple[int, ...] = tuple(int(n) for n in numels)
        if any(n < 0 for n in self.numels):
            raise ValueError(f"negative numel in {self.numels}")
        offsets, acc = [], 0
        for n in self.numels:
            acc = -(-acc // align) * align  # [Note: block-aligned flat layout]
            offsets.append(acc)
            acc += n
        self.offsets: Tuple[int, ...] = tuple(offsets)
        self.total = acc
        self.world = world
        self.rank = rank
        self.align = align
        self.shard = -(-acc // (world * align)) * align if acc else 0
        self.padded = self.shard * world

    def shard_range(self, rank: Optional[int] = None) -> Tuple[int, int]:
        """Flat [start, end) owned by ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        return r * self.shard, (r + 1) * self.shard

    def slot(self, index: int) -> Tuple[int, int]:
        """Flat [start, end) of param ``index``."""
        return self.offsets[index], self.offsets[index] + self.numels[index]

    def pieces(self, lo: int, hi: int) -> Iterator[Piece]:
        """The parts of every param that fall in flat [lo, hi), in order."""
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                yield Piece(i, a, b, a - off)

    def owned(self, index: int) -> Optional[Piece]:
        """The part of param ``index`` this rank owns, or None."""
        start, end = self.shard_range()
        off, n = self.offsets[index], self.numels[index]
        a, b = max(start, off), min(end, off + n)
        return Piece(index, a, b, a - off) if a < b else None


def split_ranges(lo: int, hi: int, size: int) -> List[Tuple[int, int]]:
    """[lo, hi) cut into consecutive ranges of at most ``size`` elements."""
    if size <= 0:
        raise ValueError(f"size must be > 0, got {size}")
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]
