"""The int8 encoder's bucket table in numpy: native/q8_buckets.h's, word for word.

[Note: bucketed encoder] in native/q8_buckets.h says what it is: per key (sign, exponent of
x/absmax) the first bucket and the mantissa bits that cut the exponent's range, per bucket a
base code and a cut, so that ``code = base + (rel(xn) >= cut) mod 256`` is the scheme's
``#{i : mid[i] < xn}`` for every float32 xn in [-1, 1] (tools/q8_exhaustive.py checks all of
them). numba_compressed.py encodes with it; this module builds it once per map.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["MAX_BUCKETS", "build", "code_of"]

MAX_BUCKETS = 1024
_TOP = 0x3FFFFFFF  # |xn| is held to [2^-31, 2) before it indexes the table


def _floats(lo: np.ndarray, mask: int, neg: bool, rel) -> np.ndarray:
    """The float of each bucket (magnitude bits lo .. lo + mask) at rel: ascending in rel."""
    bits = (lo + (mask - rel) if neg else lo + rel).astype(np.uint32)
    x = bits.view(np.float32)
    return -x if neg else x


def _words(mid: np.ndarray, lo: np.ndarray, mask: int, neg: bool, s2: int) -> Optional[np.ndarray]:
    """The buckets' words (cut << s2 | base; base - 1 and no cut where the code is constant),
    or None if a bucket holds two code boundaries."""
    base = np.searchsorted(mid, _floats(lo, mask, neg, np.zeros_like(lo)), side="left")
    top = np.searchsorted(mid, _floats(lo, mask, neg, np.full_like(lo, mask)), side="left")
    if (top - base > 1).any():
        return None
    a, b = np.zeros_like(lo), np.full_like(lo, mask)  # the first rel above mid[base]
    split = top > base
    thr = mid[np.minimum(base, 254)]
    while (a < b).any():
        m = a + (b - a) // 2
        above = thr < _floats(lo, mask, neg, m)
        a, b = np.where(above, a, m + 1), np.where(above, m, b)
    return np.where(split, (a << s2) | base, (base - 1) & 0xFF)


def build(mid) -> Optional[np.ndarray]:
    """uint32[64 + MAX_BUCKETS]: the keys (as int32 bits), then the bucket words; None if
    the map does not fit (unsorted midpoints, two boundaries in a bucket at 10 bits)."""
    mid = np.ascontiguousarray(mid, dtype=np.float32)
    if mid.shape != (255,) or not (mid[1:] >= mid[:-1]).all():
        return None
    key = np.zeros(64, dtype=np.int64)
    word = np.zeros(MAX_BUCKETS, dtype=np.int64)
    used = 0
    for k in range(64):
        neg, e = k >= 32, 96 + (k & 31)
        for mb in range(0, 1 if e == 96 else 11):
            if used + (1 << mb) > MAX_BUCKETS:
                return None
            shift = 23 - mb
            b = np.arange(1 << mb, dtype=np.int64)
            lo = np.zeros(1, dtype=np.int64) if e == 96 else (e << 23) | (b << shift)
            mask = (97 << 23) - 1 if e == 96 else (1 << shift) - 1
            w = _words(mid, lo, mask, neg, 9 + mb)
            if w is not None and not (e == 96 and w[0] > 0xFF):  # e <= 96: no cut
                break
        else:
            return None
        word[used:used + (1 << mb)] = w
        key[k] = ((used - (e << mb)) << 5) | shift
        used += 1 << mb
    return np.concatenate([key, word]).astype(np.int64).astype(np.uint32)


def code_of(table: np.ndarray, xn: np.ndarray) -> np.ndarray:
    """The codes of float32 xn by the table (numpy, lane-wise what the kernels do)."""
    u = np.ascontiguousarray(xn, dtype=np.float32).view(np.uint32).astype(np.int64)
    ac = np.clip(u & 0x7FFFFFFF, 96 << 23, _TOP)
    kw = table[(u >> 31) * 32 + ((ac >> 23) & 31)].astype(np.uint32).view(np.int32).astype(np.int64)
    shift = kw & 31
    w = table[64 + (ac >> shift) + (kw >> 5)].astype(np.int64)
    rel = ((u ^ np.where(u >> 31 == 1, 0xFFFFFFFF, 0)) << (32 - shift)) & 0xFFFFFFFF
    return ((w + (rel >= (w & ~0xFF))) & 0xFF).astype(np.uint8)
