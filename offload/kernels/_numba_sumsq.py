"""numba's sum of squares of a grad: the native units' blocked fp32 sum, bit for bit.

The algorithm and its reasons are native/unit_dispatch.h's [Note: sumsq in fp32 blocks];
the code follows native/sumsq_blocks.h (the driver every native unit compiles) and the
dispatch of native/dispatch.cpp ``offload_grad_sumsq``:

- the grad is cut into SUMSQ_BLOCK-element ranges (the library's kBlock), each summed on
  its own into a double, and the ranges' sums are added in order: the cuts, hence the bits,
  do not depend on the thread count (prange only spreads the ranges over threads);
- within a range: kSumsqStreams runs of whole kSumsqSub-element sub-blocks read side by
  side, then the sub-blocks left over; a sub-block is 32 steps of 16 elements, the element
  at offset m of a step going to fp32 accumulator m of its stream (each update one fp32 FMA,
  ``fma32``: a double add then a cast to float could round twice). The SIMD units pair
  accumulators m and m + 8 (fp32, fp16) or 2l and 2l + 1 (bf16) into lane l first, then
  join the streams' lanes as ((s0 + s1) + (s2 + s3));
- a block's 8 fp32 lanes are added into 8 double lanes, joined at the end as
  ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)); a block whose fp32 sum is not finite,
  or (fp32, bf16) below 2**-100 in every lane, is redone exactly in double (element j into
  double lane j % 8, the same join), or is 0.0 when all its elements are zeros.

No fastmath: "reassoc" would let LLVM reorder the very sums that fix the bits.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._numba_bits import bf16_to_float, f32_from_bits, fma32, half_to_float

__all__ = ["SUMSQ_BLOCK", "sumsq_parallel", "sumsq_serial"]

SUMSQ_BLOCK = 1 << 16  # native/parallel.h OFFLOAD_BLOCK_ELEMS: the ranges dispatch.cpp hands out
_SUB = 512  # kSumsqSub: 2 accumulators x 8 lanes x 32 steps
_STREAMS = 4  # kSumsqStreams
_TINY = np.float32(2.0 ** -100)  # kSumsqTiny
_INF = np.float32(np.inf)
_F16, _BF16 = 1, 2  # grad codes of _checks.GRAD_DTYPES (0: fp32, its bits viewed as uint32)


@njit(inline="always", nogil=True, cache=True)
def _elem(g, i, code):
    """Element i as float32: g holds fp32 bits (uint32) or fp16/bf16 bits (uint16)."""
    if code == _F16:
        return half_to_float(g[i])
    if code == _BF16:
        return bf16_to_float(g[i])
    return f32_from_bits(np.uint32(g[i]))


@njit(inline="always", nogil=True, cache=True)
def _step(g, i, code, acc, o):
    """fp32 FMAs of the squares of the 16 elements at i into acc[o .. o + 16)."""
    for m in range(16):
        x = _elem(g, i + m, code)
        acc[o + m] = fma32(x, x, acc[o + m])


@njit(inline="always", nogil=True, cache=True)
def _group(g, s, stride, code, acc):
    """The kSumsqStreams sub-blocks at s + k * stride side by side, as the SIMD units read
    them (each accumulator sees its steps in order either way), stream k into acc[16k ..]."""
    for i in range(0, _SUB, 16):
        for k in range(_STREAMS):
            _step(g, s + k * stride + i, code, acc, 16 * k)


@njit(inline="always", nogil=True, cache=True)
def _steps(g, s, e, code, acc, o):
    """_step over [s, e) (at most a sub-block), element j into acc[o + (j - s) % 16]."""
    full = s + (e - s) // 16 * 16
    for i in range(s, full, 16):
        _step(g, i, code, acc, o)
    for m in range(e - full):  # the tail: a SIMD unit adds 0 * 0 for the rest, which changes nothing
        x = _elem(g, full + m, code)
        acc[o + m] = fma32(x, x, acc[o + m])


@njit(inline="always", nogil=True, cache=True)
def _lane(acc, o, lane, code):
    """A stream's lane: its two accumulators added (the SIMD units' a + b)."""
    if code == _BF16:
        return acc[o + 2 * lane] + acc[o + 2 * lane + 1]
    return acc[o + lane] + acc[o + 8 + lane]


@njit(nogil=True, cache=True)
def _redo(g, s, e, code):
    """A block the fp32 path cannot take: 0.0 if all zeros, else the exact double sum."""
    nonzero = False
    for i in range(s, e):
        nonzero |= _elem(g, i, code) != 0
    if not nonzero:
        return 0.0
    d = np.zeros(8)
    for j in range(e - s):
        x = np.float64(_elem(g, s + j, code))
        d[j % 8] += x * x  # exact product: the same as the units' FMA
    return ((d[0] + d[4]) + (d[1] + d[5])) + ((d[2] + d[6]) + (d[3] + d[7]))


@njit(inline="always", nogil=True, cache=True)
def _fold(t, d, code):
    """sumsq_fold: add the block's 8 fp32 lanes into d; False when it must be redone."""
    finite, tiny = True, True
    for lane in range(8):
        finite &= t[lane] < _INF  # False for NaN, as _CMP_LT_OQ
        tiny &= not (t[lane] >= _TINY)
    if not finite or (code != _F16 and tiny):
        return False
    for lane in range(8):
        d[lane] += np.float64(t[lane])
    return True


@njit(nogil=True, cache=True)
def _range(g, begin, end, code):
    """sumsq_loop over [begin, end): one dispatch range."""
    acc = np.empty(16 * _STREAMS, dtype=np.float32)
    t = np.empty(8, dtype=np.float32)
    d = np.zeros(8)
    redone = 0.0
    stride = (end - begin) // (_STREAMS * _SUB) * _SUB
    for j in range(0, stride, _SUB):
        acc[:] = 0
        # one inlined copy per dtype, its code a constant: the dtype tests fold away (with
        # the code a variable, bf16 also paid for the fp16 conversion: ~1.3x slower)
        if code == _F16:
            _group(g, begin + j, stride, _F16, acc)
        elif code == _BF16:
            _group(g, begin + j, stride, _BF16, acc)
        else:
            _group(g, begin + j, stride, 0, acc)
        for lane in range(8):
            t[lane] = ((_lane(acc, 0, lane, code) + _lane(acc, 16, lane, code))
                       + (_lane(acc, 32, lane, code) + _lane(acc, 48, lane, code)))
        if not _fold(t, d, code):
            for k in range(_STREAMS):
                s = begin + k * stride + j
                redone += _redo(g, s, s + _SUB, code)
    for s in range(begin + _STREAMS * stride, end, _SUB):
        e = min(s + _SUB, end)
        acc[:16] = 0
        _steps(g, s, e, code, acc, 0)
        for lane in range(8):
            t[lane] = _lane(acc, 0, lane, code)
        if not _fold(t, d, code):
            redone += _redo(g, s, e, code)
    return (((d[0] + d[4]) + (d[1] + d[5])) + ((d[2] + d[6]) + (d[3] + d[7]))) + redone


@njit(parallel=True, nogil=True, cache=True)
def sumsq_parallel(g, code):
    """The ranges on numba's threads, their sums added in range order (as dispatch.cpp)."""
    nblocks = (g.size + SUMSQ_BLOCK - 1) // SUMSQ_BLOCK
    partial = np.empty(nblocks)
    for b in prange(nblocks):
        partial[b] = _range(g, b * SUMSQ_BLOCK, min((b + 1) * SUMSQ_BLOCK, g.size), code)
    total = 0.0
    for b in range(nblocks):
        total += partial[b]
    return total


@njit(nogil=True, cache=True)
def sumsq_serial(g, code):
    """sumsq_parallel on the calling thread (small grads: no launch)."""
    total = 0.0
    for b in range((g.size + SUMSQ_BLOCK - 1) // SUMSQ_BLOCK):
        total += _range(g, b * SUMSQ_BLOCK, min((b + 1) * SUMSQ_BLOCK, g.size), code)
    return total
