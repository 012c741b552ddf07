"""The planner's view of how the states are stored: ``state_dtype`` and ``master_dtype``.

The bytes come from the typed fields (offload/kernels/fields.py: bf16 2 B per element, int8
260 B per block of 256), the flat layout from the engine's own ``FlatLayout``: with int8
states the flat store starts every param on a block and cuts shards at whole blocks ([Note:
block-aligned flat layout] in offload/zero/partition.py), which a plan counts exactly when it
is given the module (each param's size), and else as one param.

Each store compresses as it really does: the flat store and the swapped stores every element;
the host store (fp32 CPU params with offload "none"/"cpu") each param on its own, and a param
of fewer than ``MIN_COMPRESSED_NUMEL`` (4096) elements in float32 states (``HostState.compressed``),
also counted per param when the module is given (``host_state_bytes``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.kernels.fields import ADAGRAD, ADAM, ADAM_AMSGRAD, LION, SGD, SGD_PLAIN, STATE_DTYPES, Rule
from offload.kernels.quant import BLOCK
from offload.optim.host_state import MIN_COMPRESSED_NUMEL
from offload.zero.partition import FlatLayout

from .inputs import dtype_name

__all__ = ["OPTIMIZER_RULES", "StatesLayout", "check_compression", "param_numels", "state_fields", "state_notes",
           "host_state_bytes", "held_state_bytes", "kernel_bytes_ratio", "listed"]

_ADAM_BYTES = 28  # bytes Adam's fp32 step moves per element (reads + writes)
# the planner's optimizer names (``estimate(optimizer=)``, ``offload plan --optimizer``) -> their rules
OPTIMIZER_RULES = {"adam": ADAM, "adamw": ADAM, "sgd": SGD, "sgd_plain": SGD_PLAIN, "adagrad": ADAGRAD, "lion": LION}


def kernel_bytes_ratio(s: Any) -> float:
    """The kernel rate is Adam's (its probe, bench/adam.py); the other rules are bound by the
    same memory wall and move 12 B per element (param read and write, grad read) plus 8 per
    float32 state: AMSGrad 36 against 28 (bench/amsgrad.py: 1.27-1.32x), SGD with momentum,
    Adagrad and Lion 20, SGD without momentum 12."""
    return (12 + 8 * len(s.float32_rule.fields)) / _ADAM_BYTES


def listed(names: Any) -> str:
    """"a, b and c"."""
    names = list(names)
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


class StatesLayout:
    """Mixin of the planner's setup: what follows from ``state_dtype`` / ``master_dtype``
    (fields ``n``, ``ranks``, ``in_place``, ``numels``, ``state_dtype``, ``master_dtype``)."""

    @property
    def float32_rule(self) -> Rule:
        """The optimizer's rule (Adam with ``amsgrad``: its third state max_exp_avg_sq), float32 states."""
        if getattr(self, "amsgrad", False):
            return ADAM_AMSGRAD
        return OPTIMIZER_RULES.get(getattr(self, "optimizer", "adam"), ADAM)

    @property
    def rule(self) -> Rule:
        """``float32_rule`` with its states stored as ``state_dtype`` says (the fields' bytes)."""
        return self.float32_rule.with_state_dtype(self.state_dtype)

    @property
    def master_lowp(self) -> bool:
        """bf16 params that are their own master (the flat store keeps no fp32 master)."""
        return self.master_dtype == "bfloat16" and not self.in_place

    @property
    def align(self) -> int:
        """Where the flat store starts each param and cuts shards (1: anywhere)."""
        return BLOCK if not self.in_place and any(f.blocked for f in self.rule.fields) else 1

    @property
    def layout(self) -> FlatLayout:
        return FlatLayout(self.numels or (self.n,), self.ranks, 0, self.align)

    @property
    def shard(self) -> int:
        """This rank's elements of the flat buffers (padded to the world size; with int8
        states to whole blocks per param and per shard)."""
        if self.align > 1:
            return self.layout.shard if self.n else 0
        return -(-self.n // self.ranks) if self.n else 0

    @property
    def swap_numel(self) -> int:
        """Elements of this rank's swap space (offload="nvme"): the shard; the in-place
        store (SwappedState) starts each param on a block with int8 states (its blocks its
        own, offload/optim/swapped_state.py) and pads nothing after the last."""
        if self.in_place and any(f.blocked for f in self.rule.fields):
            return FlatLayout(self.numels or (self.n,), 1, 0, BLOCK).total if self.n else 0
        return self.shard

    @property
    def flat_total(self) -> int:
        """Elements of the flat range (the params and the padding between them)."""
        return self.n if self.align == 1 else self.layout.total


def state_fields(s: Any):
    """The typed states kept per element: the fp32 master unless the params are their own
    master (the in-place store, or bf16 params with ``master_dtype="bfloat16"``), then the
    rule's (Adam's moments, stored as ``state_dtype`` says)."""
    return s.rule.with_master() if s.separate_master else s.rule.fields


def host_state_bytes(s: Any, numels: Sequence[int]) -> Dict[str, int]:
    """Bytes of each state in the host store (HostState, offload/optim/host_state.py) for
    params of ``numels`` elements: each param's states are tensors of their own (int8: its own
    blocks), and a param of fewer than ``MIN_COMPRESSED_NUMEL`` elements keeps float32 states
    whatever ``state_dtype`` says (``HostState.compressed``)."""
    out = {}
    for f, f32 in zip(s.rule.fields, s.float32_rule.fields):
        out[f.name] = sum(f.nbytes(k) if k >= MIN_COMPRESSED_NUMEL else f32.nbytes(k) for k in numels)
    return out


def held_state_bytes(s: Any) -> Dict[str, int]:
    """Bytes of each of the rule's states held in host memory (offload "none"/"cpu", stages
    0-2): the host store's per param (``host_state_bytes``), the flat store's over the shard."""
    if s.in_place:
        return host_state_bytes(s, s.numels or (s.n,))
    return {f.name: f.nbytes(s.shard) for f in s.rule.fields}


def check_compression(state_dtype: Any, master_dtype: Any, pdt: torch.dtype) -> None:
    """As the optimizers check them (offload/optim/options.py), and a bf16 master needs bf16 params."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
    if master_dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"master_dtype must be None, 'float32' or 'bfloat16', got {master_dtype!r}")
    if master_dtype == "bfloat16" and pdt != torch.bfloat16:
        raise ValueError(f"master_dtype='bfloat16' needs bfloat16 params (the param is its own master), "
                         f"got param_dtype {dtype_name(pdt)}")


def param_numels(module: Optional[torch.nn.Module]) -> Optional[Tuple[int, ...]]:
    """Each trainable param's elements, tied ones once (as ``count_params``), or None."""
    if module is None:
        return None
    seen, out = set(), []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p.numel())
    return tuple(out)


def state_notes(s: Any) -> List[str]:
    """What a plan with compressed states or a bf16 master should say about its counts."""
    notes = []
    if s.in_place and s.offload != "nvme" and s.state_dtype != "float32":
        if s.numels is None:
            notes.append(f"{s.state_dtype} states in the host store: counted as one param; params of fewer than "
                         f"{MIN_COMPRESSED_NUMEL} elements keep float32 states, counted only when a module is given")
        else:
            notes.append(f"{s.state_dtype} states in the host store: params of fewer than {MIN_COMPRESSED_NUMEL} "
                         "elements keep float32 states (counted)")
    if s.numels is None and (s.align > 1 or (s.in_place and s.offload == "nvme" and s.state_dtype == "int8")):
        store = "flat store" if s.align > 1 else "swap files"
        notes.append(f"int8 states in the {store} start each param on a block of 256 elements: up to "
                     "255 elements more per param, counted only when a module is given")
    if s.master_lowp:
        notes.append("master_dtype='bfloat16': the bf16 params are their own master (no fp32 copy)")
    if getattr(s, "amsgrad", False):
        notes.append("amsgrad: the kernel time is Adam's rate scaled by 36/28, the bytes each moves per "
                     "element (both are bound by memory bandwidth; bench/amsgrad.py)")
    if s.offload == "nvme" and s.state_dtype == "int8":
        notes.append("offload='nvme' with int8 states: sub-groups are cut at multiples of 262144 elements "
                     "(a packed block's 260 bytes reach a 4 KiB page every 1024 blocks)")
    return notes
