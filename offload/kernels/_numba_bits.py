"""Bit-level helpers for the numba kernels: float <-> int bitcasts and fp16/bf16 rounding.

numba has no scalar bitcast, so two tiny LLVM intrinsics provide it; the conversions are
then integer code that LLVM vectorizes. The rules are those of native/convert.h: fp16 is
IEEE round-to-nearest-even with the NaN rule of x86 vcvtps2ph, bf16 is torch's
round_to_nearest_even with NaN -> 0xFFFF (torch's vectorized conversion), so every backend
writes the same bits as ``master.to(dtype)``.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import _numba_cache

__all__ = ["f32_from_bits", "bits_from_f32", "half_to_float", "float_to_half",
           "bf16_to_float", "float_to_bf16", "u16_to_float", "lowp_bits", "fma32"]


@intrinsic
def f32_from_bits(typingctx, u):
    """Reinterpret a uint32 as float32."""
    if u != types.uint32:
        return None
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


@intrinsic
def bits_from_f32(typingctx, f):
    """Reinterpret a float32 as uint32."""
    if not isinstance(f, types.Float):
        return None
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return sig, codegen


# The conversions below compute every case and then select, with no early return: LLVM
# turns the selects into vector blends, while the branchy form stayed scalar (~5x slower).

@njit(inline="always", nogil=True, cache=True)
def half_to_float(h):
    """Exact fp16 bits -> float32."""
    h = np.uint32(h)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    normal = sign | ((exp + 112) << 23) | (mant << 13)
    special = sign | 0x7F800000 | (mant << 13)  # inf / NaN
    # zero / subnormal: mant * 2**-24 is exact in float32
    sub = sign | bits_from_f32(np.float32(mant) * np.float32(5.9604644775390625e-08))
    bits = special if exp == 0x1F else normal
    bits = sub if exp == 0 else bits
    return f32_from_bits(np.uint32(bits))


@njit(inline="always", nogil=True, cache=True)
def float_to_half(x):
    """float32 -> fp16 bits, round to nearest even (vcvtps2ph rules, NaN included)."""
    u = np.int64(bits_from_f32(x))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    # normal half: rebias the exponent, keep 10 mantissa bits, round on the 13 dropped
    qn = (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3FF)
    rn = a & 0x1FFF
    qn += np.int64((rn > 0x1000) | ((rn == 0x1000) & ((qn & 1) == 1)))
    # subnormal half: value / 2**-24 = mant * 2**(e - 126); shift right by s = 126 - e
    # (s >= 31 leaves 0: below half the smallest subnormal, or a float32 denormal; s is
    # clamped to >= 1 so the unused lanes of normal values shift by a defined amount)
    s = max(min(126 - (a >> 23), 31), 1)
    mant = (a & 0x7FFFFF) | 0x800000
    qs = mant >> s
    rs = mant & ((1 << s) - 1)
    half = 1 << (s - 1)
    qs += np.int64((rs > half) | ((rs == half) & ((qs & 1) == 1)))
    q = qs if a < 0x38800000 else qn
    q = 0x7C00 if a >= 0x477FF000 else q  # >= 65520 rounds to inf; inf stays inf
    q = (0x7E00 | ((a >> 13) & 0x3FF)) if a > 0x7F800000 else q  # NaN: quiet, keep payload
    return sign | q


@njit(inline="always", nogil=True, cache=True)
def bf16_to_float(b):
    return f32_from_bits(np.uint32((b & 0xFFFF) << 16))


@njit(inline="always", nogil=True, cache=True)
def float_to_bf16(x):
    u = np.int64(bits_from_f32(x))
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return 0xFFFF if (u & 0x7FFFFFFF) > 0x7F800000 else r


@njit(inline="always", nogil=True, cache=True)
def u16_to_float(g, grad_code):
    """A 16-bit grad element (fp16 when ``grad_code`` is 1, else bf16) as float32."""
    return half_to_float(g) if grad_code == 1 else bf16_to_float(g)


@njit(inline="always", nogil=True, cache=True)
def lowp_bits(p, lowp_code):
    """Both conversions, then a select: an unconditional store keeps the loop vectorized."""
    return float_to_half(p) if lowp_code == 1 else float_to_bf16(p)


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` in float32 with one rounding (llvm.fma: the FMA instruction, or an
    exact libm call on a CPU without one), as the native units and torch's vectorized
    kernels compute it; fastmath "contract" only permits that fusion."""
    if not all(isinstance(x, types.Float) for x in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32] * 3))
        vals = [context.cast(builder, v, t, types.float32)
                for v, t in zip(args, signature.args)]
        return builder.call(fn, vals)
    return sig, codegen


# Before any kernel is loaded from numba's cache: drop it when a source of this folder
# changed since it was compiled (numba checks only the file defining each kernel).
_numba_cache.drop_stale(lowp_bits)
