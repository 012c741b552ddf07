"""Where each sub-group's states sit in a swap file and in a pipeline buffer.

The states (e.g. ``exp_avg`` and ``exp_avg_sq``) are flat arrays over one index space of
``numel`` elements, each of its own element type (a :class:`~offload.kernels.fields.StateField`:
fp32 today, bf16 or int8 tomorrow), cut into sub-groups of ``sub_group_size`` elements (the
last one shorter). Sub-group ``g`` owns one *region* of a slot file: its states one after
the other, each padded to 4096 bytes on its own so every transfer is O_DIRECT-aligned in
offset, length and (with pool buffers) address::

    slot file:  | region 0                      | region 1       | ...
    region g:   | state 0 of g | pad | state 1 of g | pad |

A pipeline buffer holds exactly one region, laid out the same way, so one read and one
write per sub-group move all of its states. ``sub_group_size`` is a multiple of
``elems_per_page(fields)``, the fewest elements that are whole pages of every state (1024
when every state is fp32, 2048 with a bf16 one, 262144 with a packed int8 one: 1024 blocks
of 260 bytes): then every full sub-group of every state is whole pages, cut at block
boundaries, and a checkpoint's flat files (the states in index order, see checkpoint.py)
are written in aligned pieces too. A state's bytes in a region are ``field.nbytes(length)``
(packed blocks included); the last sub-group ends where the states end, padded on disk.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple, Union

from offload.kernels.fields import StateField

ALIGN = 4096
ELEMS_PER_PAGE = ALIGN // StateField("state").itemsize  # fp32 elements per 4 KiB (the unit for fp32 states)

States = Union[int, Sequence[Union[str, StateField]]]
"""What a layout (or a store, a plan) is told of its states: typed fields, names (each a
float32 field of that name), or for the layouts of old callers, just how many fp32 states."""


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def as_fields(states: States) -> Tuple[StateField, ...]:
    """``states`` as typed fields: a str is a float32 field of that name, an int ``n`` is
    ``n`` float32 fields named ``state0``... (callers that only knew the count)."""
    if isinstance(states, bool) or not isinstance(states, (int, list, tuple)):
        raise TypeError(f"states must be a count or a sequence of names or StateFields, got {type(states).__name__}")
    if isinstance(states, int):
        if states <= 0:
            raise ValueError(f"nstates must be > 0, got {states}")
        return tuple(StateField(f"state{k}") for k in range(states))
    out = []
    for s in states:
        if isinstance(s, StateField):
            out.append(s)
        elif isinstance(s, str):
            out.append(StateField(s))
        else:
            raise TypeError(f"a state must be a name or a StateField, got {type(s).__name__} {s!r:.40}")
    if not out:
        raise ValueError("nstates must be > 0, got no states")
    return tuple(out)


def elems_per_page(fields: Sequence[StateField]) -> int:
    """The unit of ``sub_group_size``: the fewest elements that are whole 4 KiB pages of every
    one of ``fields`` (``lcm`` of their ``align_elems``). 1024 for fp32 states, 2048 with a bf16
    one (as before typed fields: a page of the narrowest state), 262144 with a packed int8
    field (1024 blocks of 260 bytes): a sub-group then starts every field's bytes on a page,
    which O_DIRECT needs, and is cut at block boundaries."""
    return math.lcm(*(f.align_elems(ALIGN) for f in fields))


class SwapLayout:
    """Sub-group ranges and byte offsets for the ``states`` of ``numel`` elements."""

    def __init__(self, numel: int, sub_group_size: int, states: States) -> None:
        self.fields = as_fields(states)
        page = elems_per_page(self.fields)
        if numel <= 0:
            raise ValueError(f"numel must be > 0, got {numel}")
        if sub_group_size <= 0 or sub_group_size % page:
            raise ValueError(f"sub_group_size must be a positive multiple of {page}, got {sub_group_size}")
        self.numel = int(numel)
        self.sub_group_size = int(min(sub_group_size, round_up(numel, page)))
        self.nstates = len(self.fields)
        self.num_groups = -(-self.numel // self.sub_group_size)
        self.region_bytes = self.region_bytes_for(self.sub_group_size)
        last = self.group_range(self.num_groups - 1)
        self.file_bytes = (self.num_groups - 1) * self.region_bytes + self.region_bytes_for(last[1] - last[0])

    @property
    def dtype_name(self) -> str:
        """The one element type of every state ("float32"), or "mixed"."""
        names = {f.dtype_name for f in self.fields}
        return names.pop() if len(names) == 1 else "mixed"

    @property
    def dtype_names(self) -> List[str]:
        return [f.dtype_name for f in self.fields]

    @property
    def itemsize(self) -> int:
        """Bytes per element of every state, for layouts of one element type."""
        sizes = {f.itemsize for f in self.fields}
        if len(sizes) != 1:
            raise ValueError(f"the states {[f.name for f in self.fields]} have several element sizes: "
                             "ask each field (layout.fields[k].itemsize)")
        return sizes.pop()

    def named(self, states: Sequence[Union[str, StateField]]) -> Tuple[StateField, ...]:
        """``states`` (names of fp32 states, or typed fields) as fields, checked against the
        layout's element types one by one."""
        fields = as_fields(list(states))
        if len(fields) != self.nstates:
            raise ValueError(f"{len(fields)} state names for a layout of {self.nstates} states")
        for f, mine in zip(fields, self.fields):
            if f.dtype != mine.dtype:
                raise ValueError(f"state {f.name!r} is {f.dtype_name}, the layout holds {mine.dtype_name} in its place")
        return fields

    def group_range(self, g: int) -> Tuple[int, int]:
        if not 0 <= g < self.num_groups:
            raise IndexError(f"sub-group {g} out of range 0..{self.num_groups - 1}")
        start = g * self.sub_group_size
        return start, min(start + self.sub_group_size, self.numel)

    def ranges(self) -> List[List[int]]:
        return [list(self.group_range(g)) for g in range(self.num_groups)]

    def padded_bytes(self, k: int, length: int) -> int:
        """Bytes state ``k`` of ``length`` elements takes in a region (padded to 4096)."""
        return round_up(self.fields[k].nbytes(length), ALIGN)

    def region_bytes_for(self, length: int) -> int:
        return sum(self.padded_bytes(k, length) for k in range(self.nstates))

    def state_spans(self, g: int) -> List[Tuple[int, int, int]]:
        """(offset in the region, used bytes, padded bytes) of each state of sub-group ``g``."""
        s, e = self.group_range(g)
        out, off = [], 0
        for k, f in enumerate(self.fields):
            padded = self.padded_bytes(k, e - s)
            out.append((off, f.nbytes(e - s), padded))
            off += padded
        return out

    def state_bytes_for(self, length: int) -> int:
        """Padded bytes of one state of ``length`` elements, for layouts of one element type."""
        self.itemsize  # refuses layouts of several element sizes
        return round_up(self.fields[0].nbytes(length), ALIGN)

    def state_bytes(self, g: int) -> int:
        """Padded bytes of one state of sub-group ``g`` (the stride between its states), for
        layouts of one element type; ``state_spans`` serves every layout."""
        s, e = self.group_range(g)
        return self.state_bytes_for(e - s)

    def group_bytes(self, g: int) -> int:
        """Bytes moved to read or write all states of sub-group ``g``."""
        s, e = self.group_range(g)
        return self.region_bytes_for(e - s)

    def group_offset(self, g: int) -> int:
        """Offset of sub-group ``g``'s region in a slot file."""
        self.group_range(g)
        return g * self.region_bytes

    def groups_overlapping(self, start: int, end: int) -> range:
        """Sub-groups that intersect the element range ``[start, end)``."""
        if end <= start:
            return range(0)
        return range(start // self.sub_group_size, (end - 1) // self.sub_group_size + 1)
