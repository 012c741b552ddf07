"""numba's sum of squares of a grad: the native units' blocked fp32 sum, bit for bit.

The algorithm and its reasons are native/unit_dispatch.h's [Note: sumsq in fp32 blocks];
the code follows native/sumsq_blocks.h (the driver every native unit compiles) and the
dispatch of native/dispatch.cpp ``offload_grad_sumsq``:

- the grad is cut into SUMSQ_BLOCK-element ranges (the library's kBlock), each summed on
  its own into a double, and the ranges' sums are added in order: the cuts, hence the bits,
  do not depend on the thread count (prange only spreads the ranges over threads);
- within a range: kSumsqStreams runs of whole kSumsqSub-element sub-blocks read side by
  side, then the sub-blocks left over; a sub-block is 32 steps of 16 elements, each step
  into two 8-lane fp32 accumulators a and b of its stream, as the AVX2 unit's __m256
  (_numba_f32x8: LLVM vectors, so they stay in registers; each update one fp32 FMA, as a
  double add then a cast to float could round twice). Lane l of a and b takes elements
  l and l + 8 (fp32, fp16) or 2l and 2l + 1 (bf16); a + b first, then the streams' lanes
  are joined as ((s0 + s1) + (s2 + s3));
- a block's 8 fp32 lanes are added into 8 double lanes, joined at the end as
  ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)); a block whose fp32 sum is not finite,
  or (fp32, bf16) below 2**-100 in every lane, is redone exactly in double (element j into
  double lane j % 8, the same join), or is 0.0 when all its elements are zeros.

No fastmath: "reassoc" would let LLVM reorder the very sums that fix the bits.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _numba_f32x8 as v8
from ._native_abi import BLOCK_ELEMS
from ._numba_bits import bf16_to_float, f32_from_bits, half_to_float

__all__ = ["SUMSQ_BLOCK", "sumsq_parallel", "sumsq_serial"]

SUMSQ_BLOCK = BLOCK_ELEMS  # the ranges dispatch.cpp hands out (checked against the library at its load)
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
def _step(g, i, code, a, b):
    """fp32 FMAs of the squares of the 16 elements at i into a and b: lane l of a takes
    element i + l and of b i + 8 + l (fp32, fp16), or i + 2l and i + 2l + 1 (bf16, the
    AVX2 unit's split of 8 words): the lane join adds a and b first, as the SIMD units."""
    if code == _BF16:
        return v8.fma_sq(v8.load_bf16_even(g, i), a), v8.fma_sq(v8.load_bf16_odd(g, i), b)
    if code == _F16:
        return v8.fma_sq(v8.load_f16(g, i), a), v8.fma_sq(v8.load_f16(g, i + 8), b)
    return v8.fma_sq(v8.load_f32(g, i), a), v8.fma_sq(v8.load_f32(g, i + 8), b)


@njit(inline="always", nogil=True, cache=True)
def _group(g, s, stride, code):
    """The kSumsqStreams sub-blocks at s + k * stride side by side, as the SIMD units read
    them, stream k into its own pair of vectors (locals, so they stay in registers; in an
    array every FMA loaded and stored its accumulator); returns the block's 8 fp32 lanes,
    the streams joined as ((s0 + s1) + (s2 + s3))."""
    a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = v8.zero()
    for i in range(s, s + _SUB, 16):
        a0, b0 = _step(g, i, code, a0, b0)
        a1, b1 = _step(g, i + stride, code, a1, b1)
        a2, b2 = _step(g, i + 2 * stride, code, a2, b2)
        a3, b3 = _step(g, i + 3 * stride, code, a3, b3)
    return v8.add(v8.add(v8.add(a0, b0), v8.add(a1, b1)),
                  v8.add(v8.add(a2, b2), v8.add(a3, b3)))


@njit(inline="always", nogil=True, cache=True)
def _part(g, s, e, code):
    """[s, e), at most a sub-block: _step over its whole steps, then the tail's elements
    in the lanes a whole step would give them (a SIMD unit adds 0 * 0 for the rest, which
    changes nothing); returns the 8 fp32 lanes a + b."""
    a = b = v8.zero()
    full = s + (e - s) // 16 * 16
    for i in range(s, full, 16):
        a, b = _step(g, i, code, a, b)
    xa, xb = v8.zero(), v8.zero()
    for m in range(e - full):
        x = _elem(g, full + m, code)
        to_a = m % 2 == 0 if code == _BF16 else m < 8
        k = m // 2 if code == _BF16 else m % 8
        if to_a:
            xa = v8.with_lane(xa, k, x)
        else:
            xb = v8.with_lane(xb, k, x)
    return v8.add(v8.fma_sq(xa, a), v8.fma_sq(xb, b))


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
    """sumsq_fold: add the block's 8 fp32 lanes t into d; False when it must be redone."""
    finite, tiny = True, True
    for lane in range(8):
        x = v8.lane(t, lane)
        finite &= x < _INF  # False for NaN, as _CMP_LT_OQ
        tiny &= not (x >= _TINY)
    if not finite or (code != _F16 and tiny):
        return False
    for lane in range(8):
        d[lane] += np.float64(v8.lane(t, lane))
    return True


@njit(nogil=True, cache=True)
def _range(g, begin, end, code):
    """sumsq_loop over [begin, end): one dispatch range."""
    d = np.zeros(8)
    redone = 0.0
    stride = (end - begin) // (_STREAMS * _SUB) * _SUB
    for j in range(0, stride, _SUB):
        # one inlined copy per dtype, its code a constant: the dtype tests fold away (with
        # the code a variable, bf16 also paid for the fp16 conversion: ~1.3x slower)
        if code == _F16:
            t = _group(g, begin + j, stride, _F16)
        elif code == _BF16:
            t = _group(g, begin + j, stride, _BF16)
        else:
            t = _group(g, begin + j, stride, 0)
        if not _fold(t, d, code):
            for k in range(_STREAMS):
                s = begin + k * stride + j
                redone += _redo(g, s, s + _SUB, code)
    for s in range(begin + _STREAMS * stride, end, _SUB):
        e = min(s + _SUB, end)
        if not _fold(_part(g, s, e, code), d, code):
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
