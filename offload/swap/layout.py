"""Where each sub-group's states sit in a swap file and in a pipeline buffer.

The states (e.g. ``exp_avg`` and ``exp_avg_sq``) are flat fp32 arrays over one index space
of ``numel`` elements, cut into sub-groups of ``sub_group_size`` elements (the last one
shorter). Sub-group ``g`` owns one *region* of a slot file: its states one after the other,
each padded to 4096 bytes so every transfer is O_DIRECT-aligned in offset, length and (with
pool buffers) address::

    slot file:  | region 0                      | region 1       | ...
    region g:   | state 0 of g | pad | state 1 of g | pad |

A pipeline buffer holds exactly one region, laid out the same way, so one read and one
write per sub-group move all of its states.
"""
from __future__ import annotations

from typing import List, Tuple

ALIGN = 4096
ELEMS_PER_PAGE = ALIGN // 4  # fp32 elements per 4 KiB


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class SwapLayout:
    """Sub-group ranges and byte offsets for ``nstates`` fp32 arrays of ``numel`` elements."""

    itemsize = 4
    dtype_name = "float32"

    def __init__(self, numel: int, sub_group_size: int, nstates: int) -> None:
        if numel <= 0:
            raise ValueError(f"numel must be > 0, got {numel}")
        if sub_group_size <= 0 or sub_group_size % ELEMS_PER_PAGE:
            raise ValueError(f"sub_group_size must be a positive multiple of {ELEMS_PER_PAGE}, got {sub_group_size}")
        if nstates <= 0:
            raise ValueError(f"nstates must be > 0, got {nstates}")
        self.numel = int(numel)
        self.sub_group_size = int(min(sub_group_size, round_up(numel, ELEMS_PER_PAGE)))
        self.nstates = int(nstates)
        self.num_groups = -(-self.numel // self.sub_group_size)
        self.region_bytes = self.nstates * round_up(self.sub_group_size * self.itemsize, ALIGN)
        last = self.group_range(self.num_groups - 1)
        self.file_bytes = (self.num_groups - 1) * self.region_bytes + self.nstates * self.state_bytes_for(last[1] - last[0])

    def group_range(self, g: int) -> Tuple[int, int]:
        if not 0 <= g < self.num_groups:
            raise IndexError(f"sub-group {g} out of range 0..{self.num_groups - 1}")
        start = g * self.sub_group_size
        return start, min(start + self.sub_group_size, self.numel)

    def ranges(self) -> List[List[int]]:
        return [list(self.group_range(g)) for g in range(self.num_groups)]

    def state_bytes_for(self, length: int) -> int:
        return round_up(length * self.itemsize, ALIGN)

    def state_bytes(self, g: int) -> int:
        """Padded bytes of one state of sub-group ``g`` (the stride between its states)."""
        s, e = self.group_range(g)
        return self.state_bytes_for(e - s)

    def group_bytes(self, g: int) -> int:
        """Bytes moved to read or write all states of sub-group ``g``."""
        return self.nstates * self.state_bytes(g)

    def group_offset(self, g: int) -> int:
        """Offset of sub-group ``g``'s region in a slot file."""
        self.group_range(g)
        return g * self.region_bytes

    def groups_overlapping(self, start: int, end: int) -> range:
        """Sub-groups that intersect the element range ``[start, end)``."""
        if end <= start:
            return range(0)
        return range(start // self.sub_group_size, (end - 1) // self.sub_group_size + 1)
