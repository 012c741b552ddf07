"""Typed optimizer state fields: what a state is called, its element type, and its bytes.

Every layer that sizes, lays out, streams or saves an optimizer state takes its size from a
``StateField`` instead of writing ``* 4`` and ``"float32"``: the kernels (which states a rule
updates), the swap layout and pipeline (bytes per sub-group), the checkpoints (what a file
holds), the flat layouts and the planner (bytes per tier). A compressed state (bf16, or int8
in blocks with a per-block scale) is then one more field description, not an edit in each.

A ``Rule`` is an optimizer's update as the layers below the optimizer see it: its name and
the fields it keeps per element. ``MASTER`` is the fp32 copy of a low-precision param, which
the flat stores keep beside the rule's fields.
"""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Iterable, Optional, Sequence, Tuple

import torch

from . import quant
from .quant import BLOCK, PACKED_BLOCK, packed_nbytes

__all__ = ["StateField", "Rule", "MASTER", "ADAM", "ADAM_AMSGRAD", "LION", "ADAGRAD", "SGD", "SGD_PLAIN",
           "RULES", "STATE_DTYPES", "union_rule", "NONNEGATIVE_STATES", "field_names", "bytes_per_element",
           "fields_bytes", "dtype_from_name", "dtype_name"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8, "uint8": torch.uint8}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` in files and manifests ("float32", "bfloat16", ...)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown state dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The name of ``dtype`` as files and manifests write it ("float32", ...)."""
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"no state field can have dtype {dtype}; expected one of {sorted(_DTYPES)}")


@dataclass(frozen=True)
class StateField:
    """One per-element optimizer state: ``exp_avg`` in fp32, say."""

    name: str
    """The key in torch's state_dict layout (``exp_avg``), in swap manifests and checkpoints."""
    dtype: torch.dtype = torch.float32
    """The element type the state is stored in; for a blocked field int8 (the signed map)
    or uint8 (the unsigned map)."""
    block: int = 0
    """0: one element per value. ``quant.BLOCK`` (256): block-wise 8-bit, stored as packed
    blocks of codes and a float32 absmax ([Note: block-wise 8-bit states] in quant.py)."""
    code: str = ""
    """A blocked field's code (``quant.CODES``): "signed" for int8, "sqrt" for uint8 (the
    default, filled in when left empty), or "unsigned", the first int8 checkpoints' uint8
    code, which only converting loads read ([Note: square-root code] in quant.py). Empty for
    a field of one element per value. A field of another code is another field: stores
    compare fields, so a file in the old code is converted, never taken as it is."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"a state field needs an identifier for a name, got {self.name!r}")
        dtype_name(self.dtype)  # refuses a dtype no file format here can name
        if self.block not in (0, BLOCK):
            raise ValueError(f"state field {self.name!r}: block must be 0 or {BLOCK}, got {self.block!r}")
        if self.block and self.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"state field {self.name!r}: a blocked field is int8 (signed map) "
                             f"or uint8 (unsigned map), got {self.dtype}")
        if not self.block:
            if self.code:
                raise ValueError(f"state field {self.name!r}: only a blocked field has a code, got {self.code!r}")
            return
        signed = self.dtype == torch.int8
        code = self.code or quant.default_code(signed)
        if code not in quant.CODES or (code == "signed") != signed:
            raise ValueError(f"state field {self.name!r}: a blocked {dtype_name(self.dtype)} field's code is "
                             f"{'signed' if signed else 'sqrt or unsigned'}, got {self.code!r}")
        object.__setattr__(self, "code", code)

    @property
    def blocked(self) -> bool:
        return self.block > 0

    @property
    def signed(self) -> bool:
        """A blocked field's map: signed (int8) or unsigned (uint8)."""
        return self.dtype == torch.int8

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the tensor that holds the state: uint8 bytes for a blocked field."""
        return torch.uint8 if self.block else self.dtype

    def storage_numel(self, numel: int) -> int:
        """Elements of ``storage_dtype`` that ``numel`` values take (packed blocks for a
        blocked field)."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return packed_nbytes(numel) if self.block else int(numel)

    def storage_offset(self, elem: int) -> int:
        """Where value ``elem`` starts in the storage; a blocked field is cut at block
        boundaries only (ValueError otherwise)."""
        if self.block and elem % self.block:
            raise ValueError(f"state field {self.name!r} is stored in blocks of {self.block}: "
                             f"it can be cut at multiples of {self.block} only, not at {elem}")
        return self.storage_numel(elem)

    def align_elems(self, align: int) -> int:
        """The fewest values whose bytes are a multiple of ``align`` bytes (where a range
        of this field can start so that its bytes start ``align``-aligned)."""
        unit, size = (self.block, PACKED_BLOCK) if self.block else (1, self.itemsize)
        return unit * (align // math.gcd(align, size))

    @property
    def itemsize(self) -> int:
        """Bytes per element (of the storage, for a blocked field: ``nbytes`` is the size of
        n values)."""
        return torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def nbytes(self, numel: int) -> int:
        """Bytes that ``numel`` values of this state take (unpadded; packed blocks included)."""
        return self.storage_numel(numel) * self.itemsize

    def describe(self) -> dict:
        """What a manifest records of the field (``from_description`` reads it back)."""
        d = {"name": self.name, "dtype": self.dtype_name}
        if self.block:
            d["block"] = self.block
            d["code"] = self.code
        return d

    @classmethod
    def from_description(cls, d: dict) -> "StateField":
        """The field ``describe`` wrote; a blocked uint8 field described without a code is
        the first int8 checkpoints' ("unsigned": they wrote none)."""
        dtype, block = dtype_from_name(str(d.get("dtype", "float32"))), int(d.get("block", 0))
        code = str(d.get("code", "")) if block else ""
        if block and not code and dtype == torch.uint8:
            code = "unsigned"
        return cls(str(d["name"]), dtype, block, code)


def field_names(fields: Iterable[StateField]) -> Tuple[str, ...]:
    return tuple(f.name for f in fields)


def bytes_per_element(fields: Iterable[StateField]) -> int:
    """Bytes one element costs across ``fields`` (unpadded)."""
    return sum(f.itemsize for f in fields)


def fields_bytes(fields: Sequence[StateField], numel: int) -> int:
    """Bytes ``numel`` elements take across ``fields`` (unpadded)."""
    return sum(f.nbytes(numel) for f in fields)


MASTER_NAME = "master"


@dataclass(frozen=True)
class Rule:
    """An optimizer's update as seen below the optimizer: a name and its state fields."""

    name: str
    fields: Tuple[StateField, ...]

    def __post_init__(self) -> None:
        names = field_names(self.fields)
        if len(set(names)) != len(names):
            raise ValueError(f"rule {self.name!r}: duplicate state field names {names}")
        if MASTER_NAME in names:
            raise ValueError(f"rule {self.name!r}: {MASTER_NAME!r} is the flat stores' fp32 master, not a rule state")

    @property
    def names(self) -> Tuple[str, ...]:
        return field_names(self.fields)

    def with_state_dtype(self, state_dtype: str) -> "Rule":
        """This rule with its states stored as ``state_dtype``: "float32" (itself),
        "bfloat16", or "int8" (blocked; the unsigned map for states that are never negative,
        ``NONNEGATIVE_STATES``)."""
        if state_dtype == "float32":
            return self
        if state_dtype == "bfloat16":
            return Rule(self.name, tuple(StateField(f.name, torch.bfloat16) for f in self.fields))
        if state_dtype == "int8":
            return Rule(self.name, tuple(
                StateField(f.name, torch.uint8 if f.name in NONNEGATIVE_STATES else torch.int8, BLOCK)
                for f in self.fields))
        raise ValueError(f"state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")

    @property
    def state_dtype(self) -> str:
        """"float32", "bfloat16" or "int8": how this rule's states are stored."""
        kinds = {"int8" if f.block else f.dtype_name for f in self.fields}
        return kinds.pop() if len(kinds) == 1 else ("float32" if not kinds else "mixed")

    @property
    def base(self) -> "Rule":
        """The rule with float32 states (the kernels' identity of the rule)."""
        return RULES[self.name]

    def holds(self, other: "Rule") -> bool:
        """Whether this rule's fields include every field ``other`` steps (by name, its
        float32 form's names): a store of this rule can step ``other`` on a subset of them."""
        return set(other.base.names) <= set(self.names)

    def narrowed(self, other: "Rule") -> "Rule":
        """``other`` over this rule's fields as they are stored (``other``'s names, this
        rule's dtypes): what a store of this rule steps a group of rule ``other`` with."""
        if not self.holds(other):
            raise ValueError(f"rule {self.name!r} {list(self.names)} does not hold rule {other.name!r}'s "
                             f"states {list(other.names)}")
        if other.base is self.base:
            return self  # (the very object: callers compare rules with `is`)
        mine = {f.name: f for f in self.fields}
        rule = Rule(other.base.name, tuple(mine[n] for n in other.base.names))
        return other.base if rule == other.base else rule

    def with_master(self) -> Tuple[StateField, ...]:
        """``MASTER`` followed by the rule's fields: what a flat store of low-precision or
        device params keeps per element."""
        return (MASTER,) + self.fields


MASTER = StateField(MASTER_NAME, torch.float32)
ADAM = Rule("adam", (StateField("exp_avg", torch.float32), StateField("exp_avg_sq", torch.float32)))
ADAM_AMSGRAD = Rule("adam_amsgrad", ADAM.fields + (StateField("max_exp_avg_sq", torch.float32),))
"""Adam with ``amsgrad=True``: torch's third state, the running maximum of exp_avg_sq, which
the denominator takes in its place."""
LION = Rule("lion", (StateField("exp_avg", torch.float32),))
ADAGRAD = Rule("adagrad", (StateField("sum", torch.float32),))
SGD = Rule("sgd", (StateField("momentum_buffer", torch.float32),))
"""SGD with a momentum buffer (torch's momentum != 0; with momentum 0 the buffer is left
untouched, as torch leaves an existing one)."""
SGD_PLAIN = Rule("sgd_plain", ())
"""SGD without momentum: torch keeps no per-element state for it, so neither does this rule."""
RULES = {r.name: r for r in (ADAM, ADAM_AMSGRAD, LION, ADAGRAD, SGD, SGD_PLAIN)}


# [Note: groups of different rules]
# torch's optimizers let param groups differ in rule: an Adam group with amsgrad beside one
# without, an SGD group with momentum beside one without. The host store keeps each param's
# own states (torch's dicts). A flat or swapped store lays out one set of fields for every
# element (flat buffers, swap files, checkpoint files), so it keeps the union of the groups'
# fields when one rule's fields hold all the others' (``union_rule``), and steps each group
# with its own rule on its own fields (``Rule.narrowed``: the work item's rule); the fields a
# group does not use stay untouched, zeros for a param that never used them. That is what
# torch does when a group later turns to the bigger rule (its max_exp_avg_sq, or momentum
# buffer, starts then: zeros, or the grad), and what state_dict() hides (a plain Adam
# param shows no max_exp_avg_sq). The cost is visible: every param holds the union's
# fields (memory_report, the planner's rule). A group that later needs a field the store
# does not keep is refused (options.check_group_rule): the layout is fixed at construction.
def union_rule(rules: Sequence[Rule]) -> Optional[Rule]:
    """The rule of ``rules`` that holds every other's fields (``Rule.holds``): what one flat
    or swapped store keeps for groups of different rules (adam within adam_amsgrad, sgd_plain
    within sgd), each group stepped on its own rule's fields; None when no rule holds all
    (rules with unrelated fields), or for no rules."""
    top = max(rules, key=lambda r: len(r.fields), default=None)
    if top is None or not all(top.holds(r) for r in rules):
        return None
    return top


STATE_DTYPES = ("float32", "bfloat16", "int8")
"""What ``state_dtype=`` takes."""
NONNEGATIVE_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum"})
"""States that are never negative: the int8 form uses the unsigned map for them."""
LATE_STATES = frozenset({"max_exp_avg_sq"})
"""States a param may lack beside its rule's others: a group that turns amsgrad on after its
params stepped (torch's state then holds exp_avg and exp_avg_sq alone; the step starts the
max_exp_avg_sq at zeros). A dict with such an entry is torch's (or our) state of that moment."""

