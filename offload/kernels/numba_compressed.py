"""numba kernels of a step with compressed states (bf16, packed int8 blocks) or a bf16 param.

One pass over the call in tiles of ``quant.BLOCK`` (256) elements on the call's block grid:
per tile, each state is decoded element by element (bf16 bits, or ``map[code] * absmax``),
the rule's own element function (numba_rules: the numba float32 path's, so the float32
arithmetic and its bits are that path's) steps the element into a 256-float scratch tile per
array, and then each array is written back in a loop of its own kind: rounded to bf16
(nearest, or quant.py's lowbias32 stream), copied, or, once the tile's absmax is known,
encoded (#midpoints below x/absmax, by the bucket table of native/q8_buckets.h, or a binary
search over the 255 midpoints). No full-size float32 temporary: a thread's scratch is three
tiles. The result equals ``compressed_ref.compose_step`` around the numba float32 method bit
for bit (tests/test_numba_compressed.py). There is no ``prange`` wrapper: the backend runs
``run_serial`` (``nogil``) over runs of tiles on Python threads (_numba_tiles_pool), which
spares a second compile of each specialisation.

[Note: numba's error model]
Every numba kernel of the library is compiled with ``error_model="numpy"``. With numba's
default ("python") a float division by zero raises ZeroDivisionError, so AdamW or Adagrad
with ``eps=0`` on an all-zero grad raised where torch gives NaN, and the check before each
division kept every plain (non-prange) loop scalar. Indices built from a tile's start are
unsigned (``np.uint64``) for the same reason: a signed index may be negative, and numba's
wraparound select turned the loads into gathers. Together, 4M elements on one thread (CPU
ns per element, this machine, beside other jobs): bf16 states 9.3 -> 2.3, int8 states 21 ->
14-16 (its encoder stays scalar), float32 0.6-0.8 either way
(tests/test_numba_zero_division.py holds the NaN).

The kernel is generic: numba compiles one specialisation per argument kinds, chosen at
compile time by ``@overload`` on the argument types --
- a state is ``None`` (absent), a float32 array, a uint16 array (bf16 bits) or a tuple
  ``(uint8 bytes, map, mid, zero code, bucket table)`` (packed blocks; the table is
  q8_buckets.build's, empty where the map does not fit it: then the binary search);
- the param is a float32 array, or uint16 (a bf16 param, its own master, rounded
  stochastically on stream 0);
- the rule is the class of its scalars' namedtuple (``AdamArgs``, ...).
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._numba_bits import bf16_to_float, bits_from_f32, f32_from_bits, float_to_bf16, lowp_bits
from . import numba_rules as nr
from .quant import BLOCK, PACKED_BLOCK, stream_key, stream_shift

__all__ = ["AdamArgs", "SgdArgs", "AdagradArgs", "LionArgs", "run_serial"]

_FASTMATH = False  # every FMA is an explicit fma32 in the element functions: none other may fuse

# A rule's folded scalars (numba_rules' *_scalars / numba_backend's _kernel_scalars, in that
# order): the class tells the kernel which element function to inline.
AdamArgs = namedtuple("AdamArgs", "gs use_l2 l2 decay coeff from_end b2 w2 bc2s eps nss")
SgdArgs = namedtuple("SgdArgs", "gs use_wd wd mom omd mode nesterov neg_lr")
AdagradArgs = namedtuple("AdagradArgs", "gs use_wd wd eps neg_clr")
LionArgs = namedtuple("LionArgs", "gs decay c1 c2 neg_lr from_end1 from_end2")

_NAN_BITS = 0x7FC00000  # torch's float("nan"): the absmax of a non-finite block
# (stream key, shift of the hash's half) of the param and the two states (quant.stream_key)
_K0, _H0 = np.uint32(stream_key(0)), np.uint32(stream_shift(0))
_K1, _H1 = np.uint32(stream_key(1)), np.uint32(stream_shift(1))
_K2, _H2 = np.uint32(stream_key(2)), np.uint32(stream_shift(2))


def rule_update(r, g, p, a, c):
    """(p, a, c) after one element of the rule whose scalars are ``r`` (numba only)."""
    raise NotImplementedError


@overload(rule_update, inline="always")
def _rule_update(r, g, p, a, c):
    cls = getattr(r, "instance_class", None)
    if cls is AdamArgs:
        def adam(r, g, p, a, c):
            return nr.adam_update(g, p, a, c, r.use_l2, r.l2, r.decay, r.coeff, r.from_end,
                                  r.b2, r.w2, r.bc2s, r.eps, r.nss)
        return adam
    if cls is SgdArgs:
        def sgd(r, g, p, a, c):
            p, a = nr._sgd(g, p, a, r.use_wd, r.wd, r.mom, r.omd, r.mode, r.nesterov, r.neg_lr)
            return p, a, c
        return sgd
    if cls is AdagradArgs:
        def adagrad(r, g, p, a, c):
            p, a = nr._adagrad(g, p, a, r.use_wd, r.wd, r.eps, r.neg_clr)
            return p, a, c
        return adagrad
    if cls is LionArgs:
        def lion(r, g, p, a, c):
            p, a = nr._lion(g, p, a, r.decay, r.c1, r.c2, r.neg_lr, r.from_end1, r.from_end2)
            return p, a, c
        return lion
    return None


# The hash in uint32 arithmetic: written on int64 with masks (as quant.py's), numba's loops
# came out scalar with 64-bit multiplies, ~20x slower.
@njit(inline="always", nogil=True, cache=True)
def _lowbias32(x):
    x = np.uint32(x)
    x ^= x >> np.uint32(16)
    x = np.uint32(x * np.uint32(0x7FEB352D))
    x ^= x >> np.uint32(15)
    x = np.uint32(x * np.uint32(0x846CA68B))
    return x ^ (x >> np.uint32(16))


@njit(inline="always", nogil=True, cache=True)
def _bf16_stochastic(x, i, q, stream, shift):
    """bf16 bits of float32 ``x``, element ``i`` of the call: ``(bits + r) >> 16`` with r
    the half at ``shift`` of lowbias32((offset + i) mod 2**32 ^ seed ^ stream); NaN -> 0xFFFF
    (the uint32 sum wraps only for NaN bits, which the select replaces)."""
    h = _lowbias32((np.uint32(q[1]) + np.uint32(i)) ^ np.uint32(q[0]) ^ stream)
    r = (h >> shift) & np.uint32(0xFFFF)
    u = bits_from_f32(x)
    hi = np.uint32(u + r) >> np.uint32(16)
    return np.uint32(0xFFFF) if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else hi


@njit(inline="always", nogil=True, cache=True)
def _decode(table, code, scale):
    """map[code] * absmax (rounded before the rule uses it: the kernels allow no fusion)."""
    return table[code] * scale


# -- the state kinds: load, keep, finish a tile ----------------------------------------------
def block_scale(s, b):
    raise NotImplementedError


def load_state(s, scale, b, j, i):
    raise NotImplementedError


def finish_state(s, buf, b, n_live, q, stream, shift):
    raise NotImplementedError


def _is_blocked(s):
    return isinstance(s, types.BaseTuple)


def _is_bf16(s):
    return isinstance(s, types.Array) and s.dtype == types.uint16


@overload(block_scale, inline="always")
def _block_scale(s, b):
    if _is_blocked(s):
        def blocked(s, b):
            a, base = s[0], b * PACKED_BLOCK + BLOCK
            bits = (np.uint32(a[base]) | (np.uint32(a[base + 1]) << 8)
                    | (np.uint32(a[base + 2]) << 16) | (np.uint32(a[base + 3]) << 24))
            return f32_from_bits(np.uint32(bits))
        return blocked
    return lambda s, b: np.float32(0)


@overload(load_state, inline="always")
def _load_state(s, scale, b, j, i):
    if isinstance(s, types.NoneType):
        return lambda s, scale, b, j, i: np.float32(0)
    if _is_blocked(s):
        return lambda s, scale, b, j, i: _decode(s[1], s[0][np.uint64(b * PACKED_BLOCK + j)], scale)
    if _is_bf16(s):
        return lambda s, scale, b, j, i: bf16_to_float(s[i])
    return lambda s, scale, b, j, i: s[i]


@njit(nogil=True, cache=True, error_model="numpy")
def _copy_back(dst, buf, b, n_live):
    """Tile ``b`` of a float32 array from its new values ``buf[:n_live]``."""
    lo = b * BLOCK
    for j in range(n_live):
        dst[np.uint64(lo + j)] = buf[j]


@njit(nogil=True, cache=True, error_model="numpy")
def _round_back(dst, buf, b, n_live, q, stream, shift):
    """Tile ``b`` of a bf16 array (uint16 bits) from ``buf[:n_live]``, rounded
    stochastically on ``stream`` at ``shift``."""
    lo = b * BLOCK
    for j in range(n_live):
        dst[np.uint64(lo + j)] = _bf16_stochastic(buf[j], lo + j, q, stream, shift)


@overload(finish_state)  # not inlined in numba IR: the bf16 kind's branch tripped its SSA check
def _finish_state(s, buf, b, n_live, q, stream, shift):
    """Write tile ``b``'s new values ``buf[:n_live]`` into the state: encoded (blocked),
    rounded to bf16 (nearest, or stochastically on ``stream`` at ``shift``), or copied."""
    if isinstance(s, types.NoneType):
        def absent(s, buf, b, n_live, q, stream, shift):
            pass
        return absent
    if _is_blocked(s):
        def blocked(s, buf, b, n_live, q, stream, shift):
            _encode_block(s[0], s[2], s[3], s[4], s[5], buf, b, n_live)
        return blocked
    if _is_bf16(s):
        def bf16(s, buf, b, n_live, q, stream, shift):
            if q[2]:
                _round_back(s, buf, b, n_live, q, stream, shift)
            else:
                lo = b * BLOCK
                for j in range(n_live):
                    s[np.uint64(lo + j)] = float_to_bf16(buf[j])
        return bf16

    def f32(s, buf, b, n_live, q, stream, shift):
        _copy_back(s, buf, b, n_live)
    return f32


@njit(inline="always", nogil=True, cache=True)
def _code(mid, xn):
    """#{k : mid[k] < xn} over the 255 sorted midpoints: 8 halvings (128 + ... + 1 = 255,
    so every probe is in range)."""
    pos = 0
    step = 128
    while step:
        pos += step if mid[np.uint64(pos + step - 1)] < xn else 0
        step >>= 1
    return pos


@njit(inline="always", nogil=True, cache=True)
def _code_bucket(t, xn):
    """q8_buckets.code_of of one value: [Note: bucketed encoder] in native/q8_buckets.h
    (t: the keys, then the words; |xn| held to [2^-31, 2) before it indexes t). With it the
    int8 AdamW step took 15 ns of CPU time per element against 22 with the binary search
    (4M elements, 1 thread, this machine)."""
    u = np.int64(bits_from_f32(xn)) & 0xFFFFFFFF
    ac = min(max(u & 0x7FFFFFFF, 96 << 23), 0x3FFFFFFF)
    kw = np.int64(np.int32(t[np.uint64((u >> 31) * 32 + ((ac >> 23) & 31))]))
    shift = kw & 31
    w = np.int64(t[np.uint64(64 + (ac >> shift) + (kw >> 5))])
    rel = ((u ^ (0xFFFFFFFF if u >> 31 else 0)) << (32 - shift)) & 0xFFFFFFFF
    return (w + (1 if rel >= (w & ~0xFF) else 0)) & 0xFF


@njit(nogil=True, cache=True, error_model="numpy")
def _encode_block(a, mid, zc, table, sqrt_code, buf, b, n_live):
    """Block ``b`` of packed bytes ``a`` from the float32 values ``buf[:n_live]``
    (quant.encode_blocks: NaN absmax and zero codes for a non-finite block, zero codes for
    an all-zero one, the zero code past the live elements; with ``sqrt_code`` the codes of
    sqrt(max(x / absmax, 0)), [Note: square-root code])."""
    amax = np.float32(0)
    bad = False
    for j in range(n_live):
        x = buf[j]
        bad |= (bits_from_f32(x) & 0x7F800000) == 0x7F800000
        amax = max(amax, abs(x))
    base = np.uint64(b * PACKED_BLOCK)  # unsigned indices: no negative-index wraparound
    if bad or amax == 0:
        for j in range(BLOCK):
            a[base + np.uint64(j)] = zc
    else:
        if sqrt_code:  # the roots in buf (the caller's scratch tile), then coded over 1.0: exact
            for j in range(n_live):
                buf[j] = np.sqrt(max(buf[j] / amax, np.float32(0)))
            amax_code = np.float32(1)
        else:
            amax_code = amax
        if table.size:
            for j in range(n_live):
                a[base + np.uint64(j)] = _code_bucket(table, buf[j] / amax_code)
        else:
            for j in range(n_live):
                a[base + np.uint64(j)] = _code(mid, buf[j] / amax_code)
        for j in range(n_live, BLOCK):
            a[base + np.uint64(j)] = zc
    bits = np.uint32(_NAN_BITS) if bad else bits_from_f32(amax)
    for k in range(4):
        a[base + np.uint64(BLOCK + k)] = np.uint8((bits >> (8 * k)) & 0xFF)


# -- the param kinds ---------------------------------------------------------------------------
def load_param(p, i):
    raise NotImplementedError


def finish_param(p, buf, b, n_live, q):
    raise NotImplementedError


@overload(load_param, inline="always")
def _load_param(p, i):
    if _is_bf16(p):
        return lambda p, i: bf16_to_float(p[i])
    return lambda p, i: p[i]


@overload(finish_param)
def _finish_param(p, buf, b, n_live, q):
    """Write tile ``b``'s new param values: a bf16 param rounded stochastically (stream 0)."""
    if _is_bf16(p):
        def bf16(p, buf, b, n_live, q):
            _round_back(p, buf, b, n_live, q, _K0, _H0)
        return bf16

    def f32(p, buf, b, n_live, q):
        _copy_back(p, buf, b, n_live)
    return f32


# -- the pass ---------------------------------------------------------------------------------
@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def run_serial(b_lo, b_hi, p, g, grad_code, s0, s1, lowp, lowp_code, r, q):
    """Tiles ``b_lo`` .. ``b_hi`` - 1 of the call. ``q`` is (seed, offset mod 2**32,
    stochastic states); ``lowp_code`` > 0 writes the float32 param's low-precision copy."""
    n = g.size
    bufp = np.empty(BLOCK, dtype=np.float32)
    buf0 = np.empty(BLOCK, dtype=np.float32)
    buf1 = np.empty(BLOCK, dtype=np.float32)
    for b in range(b_lo, b_hi):
        lo = b * BLOCK
        n_live = min(BLOCK, n - lo)
        sc0 = block_scale(s0, b)
        sc1 = block_scale(s1, b)
        # the rule over the tile into three scratch tiles, with no branch on the kinds (one
        # store each per element), then each array written back in a loop of its own kind:
        # the per-element store of each kind used to be a call (numba would not inline its
        # branches) and made this kernel 14-22x slower than the float32 one
        for j in range(n_live):
            i = np.uint64(lo + j)  # unsigned: no negative-index wraparound, so loads stay vector loads
            pi, a, c = rule_update(r, nr.load_grad(g, i, grad_code) * r.gs, load_param(p, i),
                                   load_state(s0, sc0, b, j, i), load_state(s1, sc1, b, j, i))
            bufp[j] = pi
            buf0[j] = a
            buf1[j] = c
        if lowp_code > 0:
            for j in range(n_live):
                lowp[np.uint64(lo + j)] = lowp_bits(bufp[j], lowp_code)
        finish_param(p, bufp, b, n_live, q)
        finish_state(s0, buf0, b, n_live, q, _K1, _H1)
        finish_state(s1, buf1, b, n_live, q, _K2, _H2)
