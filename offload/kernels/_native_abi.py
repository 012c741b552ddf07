"""The native library's step struct, mirrored in ctypes, and its fast packer.

``StepArgs`` mirrors ``struct offload_step_args`` (native/offload_native.h) field for field;
``native_backend`` refuses a library whose ``offload_step_args_size()`` differs from
``ctypes.sizeof(StepArgs)``. Filling a ctypes Structure takes one Python attribute store per
field and a temporary object per nested struct, a visible share of a tiny param's step (the
host store steps every param, biases and norms included); so each call packs the bytes with
one precompiled ``struct.Struct`` whose offsets are read from ``StepArgs`` itself
(``_packer``): one layout, two views, and a test that they agree.
"""
from __future__ import annotations

import ctypes
import struct
from typing import List, Tuple

from .adam_consts import AdamConsts
from .rule_consts import AdagradConsts, LionConsts, SgdConsts

__all__ = ["BLOCK_ELEMS", "Array", "Quant", "COMPRESSED_STEP", "AdamConstsC", "RuleConsts", "StepArgs", "MAX_STATES", "ADAM_STEP", "ADAM_CONSTS",
           "STEP_STATES", "AMSGRAD_STEP", "SGD_CONSTS", "ADAGRAD_CONSTS", "LION_CONSTS"]

MAX_STATES = 4  # OFFLOAD_MAX_STATES
# OFFLOAD_BLOCK_ELEMS (native/parallel.h): the ranges the library hands to threads, which the
# numba grad norm cuts too (same bits); load_library refuses a library that reports another.
BLOCK_ELEMS = 1 << 16


class Array(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("rounding", ctypes.c_int32)]


class Quant(ctypes.Structure):
    """struct offload_quant: the Q8 tables (pointers to float32 [256] / [255]) and the
    stochastic rounding stream's offset and seed."""
    _fields_ = [("signed_map", ctypes.c_void_p), ("signed_mid", ctypes.c_void_p),
                ("unsigned_map", ctypes.c_void_p), ("unsigned_mid", ctypes.c_void_p),
                ("offset", ctypes.c_int64), ("seed", ctypes.c_uint32), ("reserved", ctypes.c_int32)]


class AdamConstsC(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_float) for name in AdamConsts._fields[:9]]
                + [(name, ctypes.c_int32) for name in AdamConsts._fields[9:]])


def _consts_struct(name: str, tup) -> type:
    """A ctypes mirror of a rule's consts struct: its NamedTuple's floats, then its flags
    (int32), in the NamedTuple's order (native/offload_native.h keeps the same order)."""
    fields = [(f, ctypes.c_float if isinstance(d, float) else ctypes.c_int32)
              for f, d in zip(tup._fields, _SAMPLES[tup])]
    return type(name, (ctypes.Structure,), {"_fields_": fields})


# one value of each field, to tell floats from flags
_SAMPLES = {SgdConsts: (1.0,) * 5 + (0,) * 3, AdagradConsts: (1.0,) * 4 + (0,),
            LionConsts: (1.0,) * 5 + (0,) * 2}
SgdConstsC = _consts_struct("SgdConstsC", SgdConsts)
AdagradConstsC = _consts_struct("AdagradConstsC", AdagradConsts)
LionConstsC = _consts_struct("LionConstsC", LionConsts)


class RuleConsts(ctypes.Union):
    _fields_ = [("adam", AdamConstsC), ("sgd", SgdConstsC), ("adagrad", AdagradConstsC),
                ("lion", LionConstsC), ("reserved", ctypes.c_double * 8)]


class StepArgs(ctypes.Structure):
    _fields_ = [("rule", ctypes.c_int32), ("num_states", ctypes.c_int32), ("n", ctypes.c_int64),
                ("param", Array), ("grad", Array), ("lowp", Array),
                ("states", Array * MAX_STATES), ("consts", RuleConsts),
                ("isa", ctypes.c_int32), ("num_threads", ctypes.c_int32), ("quant", Quant),
                ("prefetch", ctypes.c_int32), ("pool", ctypes.c_int32)]


_CODES = {ctypes.c_int32: "i", ctypes.c_int64: "q", ctypes.c_void_p: "Q", ctypes.c_float: "f",
          ctypes.c_uint32: "I"}


def _scalars(cls, base: int) -> List[Tuple[int, str]]:
    """(offset, struct code) of each scalar field of ctypes struct ``cls`` placed at ``base``."""
    return [(base + getattr(cls, name).offset, _CODES[ctype]) for name, ctype in cls._fields_]


def _packer(num_states: int, consts_cls) -> struct.Struct:
    """A Struct writing rule, num_states, n, param, grad, lowp (data and dtype), ``num_states``
    states, the rule's constants (as the bytes ``consts_packer(consts_cls)`` makes), isa, num_threads,
    prefetch and pool, in that order, at StepArgs' offsets; the bytes it skips (padding, rounding, unused states,
    reserved constants, the quant struct) are zero."""
    s = StepArgs
    items = [(s.rule.offset, "i"), (s.num_states.offset, "i"), (s.n.offset, "q")]
    # data and dtype of each array; rounding (float32 arrays: 0) is left as zero bytes
    for name in ("param", "grad", "lowp"):
        items += _scalars(Array, getattr(s, name).offset)[:2]
    for k in range(num_states):
        items += _scalars(Array, s.states.offset + k * ctypes.sizeof(Array))[:2]
    items += [(s.consts.offset, f"{ctypes.sizeof(consts_cls)}s")]
    items += [(s.isa.offset, "i"), (s.num_threads.offset, "i"), (s.prefetch.offset, "i"), (s.pool.offset, "i")]
    return _struct(items, ctypes.sizeof(s))


def _compressed_packer(num_states: int) -> struct.Struct:
    """A Struct writing every field of StepArgs (rounding included) with ``num_states``
    states and the rule constants as a union's bytes, then the quant struct: the packer of
    the compressed steps (the float32 steps keep ``_packer``, which leaves rounding and
    quant zero: nothing to pack per call)."""
    s = StepArgs
    items = [(s.rule.offset, "i"), (s.num_states.offset, "i"), (s.n.offset, "q")]
    for name in ("param", "grad", "lowp"):
        items += _scalars(Array, getattr(s, name).offset)
    for k in range(num_states):
        items += _scalars(Array, s.states.offset + k * ctypes.sizeof(Array))
    items += [(s.consts.offset, f"{ctypes.sizeof(RuleConsts)}s")]
    items += [(s.isa.offset, "i"), (s.num_threads.offset, "i")]
    items += _scalars(Quant, s.quant.offset)
    items += [(s.prefetch.offset, "i"), (s.pool.offset, "i")]
    return _struct(items, ctypes.sizeof(s))


def consts_packer(consts_cls) -> struct.Struct:
    """A Struct writing every field of ctypes struct ``consts_cls`` at its offset."""
    return _struct(_scalars(consts_cls, 0), ctypes.sizeof(consts_cls))


def _struct(items: List[Tuple[int, str]], size: int) -> struct.Struct:
    fmt, pos = "=", 0
    for offset, code in items:
        if offset < pos:
            raise RuntimeError(f"StepArgs fields out of order at offset {offset}")
        fmt += (f"{offset - pos}x" if offset > pos else "") + code
        pos = offset + struct.calcsize("=" + code)
    return struct.Struct(fmt + f"{size - pos}x")


ADAM_STEP = _packer(2, AdamConstsC)
"""pack(rule, 2, n, param ptr, dtype, grad ptr, dtype, lowp ptr, dtype, exp_avg ptr, dtype,
exp_avg_sq ptr, dtype, ADAM_CONSTS.pack(*AdamConsts), isa, num_threads, prefetch, pool) -> one StepArgs."""
ADAM_CONSTS = consts_packer(AdamConstsC)
AMSGRAD_STEP = _packer(3, AdamConstsC)
"""ADAM_STEP's layout with a third state (max_exp_avg_sq): the AMSGrad rule."""

STEP_STATES = {k: _packer(k, RuleConsts) for k in (0, 1)}
"""num_states -> the packer of a rule with that many states (SGD, Adagrad, Lion); its
constants are the rule's packed consts bytes, zero-padded to the union's size."""
COMPRESSED_STEP = {k: _compressed_packer(k) for k in range(4)}
"""num_states -> pack(rule, num_states, n, param ptr, dtype, rounding, grad ptr, dtype, 0, lowp
ptr, dtype, 0, (ptr, dtype, rounding) per state, consts bytes, isa, num_threads, signed_map,
signed_mid, unsigned_map, unsigned_mid, offset, seed, 0, prefetch, pool)."""
SGD_CONSTS = consts_packer(SgdConstsC)
ADAGRAD_CONSTS = consts_packer(AdagradConstsC)
LION_CONSTS = consts_packer(LionConstsC)
