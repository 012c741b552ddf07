"""Which modules are fetch units, and which params each unit owns.

A *unit* is a module whose params are gathered together, before its forward (and again
before its backward), and released after. The root module is always a unit: it owns every
trainable param no other unit owns (the "small leftover params", and a param tied between
two units: it must be one param, and only the root is gathered for the whole forward).
Frozen params (``requires_grad=False``) belong to no unit: they stay whole on every rank.

[Note: parents that read their children's params] ``nn.MultiheadAttention``'s forward reads
``out_proj.weight`` and ``.bias`` itself (``F.multi_head_attention_forward``), never calling
``out_proj``. A unit is gathered only around its own forward, so ``out_proj`` as a unit (the
``unit={nn.Linear}`` policy matches its ``NonDynamicallyQuantizableLinear``) was read released:
zeros on several ranks or with params on NVMe, and its grads, left in its views, never reduced
on one rank. No module under such a parent is a unit: its params stay in the parent's unit.
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple, Type, Union

import torch.nn as nn

__all__ = ["UnitPolicy", "choose_units", "assign_params"]

UnitPolicy = Union[None, int, Set[Type[nn.Module]], Tuple[Type[nn.Module], ...]]

# modules whose forward reads their submodules' params directly (see the note)
READS_CHILDREN: Tuple[Type[nn.Module], ...] = (nn.MultiheadAttention,)


def _check_policy(unit: UnitPolicy) -> None:
    if unit is None:
        return
    if isinstance(unit, bool) or (isinstance(unit, int) and unit < 1):
        raise ValueError(f"unit= must be None, a set of module classes or an int >= 1 (params per unit), got {unit!r}")
    if isinstance(unit, int):
        return
    if not isinstance(unit, (set, frozenset, tuple, list)) or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in unit):
        raise TypeError(f"unit= must be None, a set of nn.Module classes or an int, got {unit!r}")


def choose_units(module: nn.Module, unit: UnitPolicy) -> List[nn.Module]:
    """The unit modules, root first then in ``module.modules()`` order.

    ``None``: every element of an ``nn.ModuleList`` (transformer blocks, as GPT-2's ``h``);
    a set of classes: their instances; an int: a module whose own and unclaimed descendants'
    trainable params number at least that many (deepest first). Classes and ModuleList
    elements are taken outermost: a match inside a unit is part of that unit. Nothing under
    a module of ``READS_CHILDREN`` is a unit (see the note)."""
    _check_policy(unit)
    if isinstance(unit, int):
        return [module] + _by_size(module, unit)
    found: List[nn.Module] = []

    def is_unit(child: nn.Module, parent: nn.Module) -> bool:
        if unit is None:
            return isinstance(parent, nn.ModuleList)
        return isinstance(child, tuple(unit))

    def walk(m: nn.Module) -> None:
        if isinstance(m, READS_CHILDREN):
            return
        for child in m.children():
            if child is not module and is_unit(child, m) and child not in found:
                found.append(child)
            else:
                walk(child)

    walk(module)
    return [module] + found


def _by_size(root: nn.Module, threshold: int) -> List[nn.Module]:
    out: List[nn.Module] = []
    claimed: Set[int] = set()

    def count(m: nn.Module, sealed: bool = False) -> int:  # post-order: children claim first
        inner = sealed or isinstance(m, READS_CHILDREN)  # its descendants are no units (see the note)
        n = sum(count(c, inner) for c in m.children())
        n += sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in claimed)
        if m is not root and not sealed and n >= threshold:
            out.append(m)
            claimed.update(id(p) for p in m.parameters())
            return 0
        return n

    count(root)
    return out


def assign_params(root: nn.Module, units: List[nn.Module]
                  ) -> Tuple[List[List[Tuple[nn.Parameter, List[Tuple[nn.Module, str]]]]], int]:
    """For each unit, its trainable params with every (module, name) that holds them, in
    registration order; and how many frozen params stay whole. A param held under two units
    goes to the root (units[0])."""
    index: Dict[int, int] = {id(u): i for i, u in enumerate(units)}
    owners: Dict[int, List[Tuple[nn.Module, str]]] = {}
    unit_of: Dict[int, Set[int]] = {}
    params: Dict[int, nn.Parameter] = {}
    frozen: Set[int] = set()

    def walk(m: nn.Module, current: int) -> None:
        current = index.get(id(m), current)
        for name, p in m._parameters.items():
            if p is None:
                continue
            if not p.requires_grad:
                frozen.add(id(p))
                continue
            params.setdefault(id(p), p)
            held = owners.setdefault(id(p), [])
            if not any(o is m and n == name for o, n in held):  # a module reached twice
                held.append((m, name))
            unit_of.setdefault(id(p), set()).add(current)
        for child in m.children():
            walk(child, current)

    walk(root, 0)
    out: List[List[Tuple[nn.Parameter, List[Tuple[nn.Module, str]]]]] = [[] for _ in units]
    for pid, p in params.items():
        where = unit_of[pid]
        out[next(iter(where)) if len(where) == 1 else 0].append((p, owners[pid]))
    return out, len(frozen)
