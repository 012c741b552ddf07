"""The 8-lane vector ops of offload/kernels/_numba_f32x8.py give, lane by lane, the bits of
the scalar helpers the numba kernels used before (_numba_bits): every fp16 and bf16 bit
pattern (NaN payloads, subnormals and -0 included) and fp32 bits through the loaders, and
one-rounding FMAs. The blocked sum of squares (_numba_sumsq) reads grads only through
them, so its bits rest on these (tests/test_sumsq_bits.py checks the sums themselves).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("offload.kernels.numba_backend")

from numba import njit  # noqa: E402

from offload.kernels import _numba_f32x8 as v8  # noqa: E402
from offload.kernels._numba_bits import (  # noqa: E402
    bf16_to_float, bits_from_f32, f32_from_bits, fma32, half_to_float)

_ALL16 = np.arange(1 << 16, dtype=np.uint16)


@njit
def _loaded(g, code):
    """The loaders' lanes, as bits, in element order: lane l of the even/odd bf16 halves
    back at elements 2l and 2l + 1 (16 elements a step); 8 elements a step otherwise."""
    out = np.empty(g.size, dtype=np.uint32)
    step = 16 if code == 2 else 8
    for i in range(0, g.size, step):
        if code == 2:
            a, b = v8.load_bf16_even(g, i), v8.load_bf16_odd(g, i)
            for k in range(8):
                out[i + 2 * k] = bits_from_f32(v8.lane(a, k))
                out[i + 2 * k + 1] = bits_from_f32(v8.lane(b, k))
        else:
            v = v8.load_f16(g, i) if code == 1 else v8.load_f32(g, i)
            for k in range(8):
                out[i + k] = bits_from_f32(v8.lane(v, k))
    return out


@njit
def _scalar(g, code):
    out = np.empty(g.size, dtype=np.uint32)
    for i in range(g.size):
        if code == 1:
            out[i] = bits_from_f32(half_to_float(g[i]))
        elif code == 2:
            out[i] = bits_from_f32(bf16_to_float(g[i]))
        else:
            out[i] = bits_from_f32(f32_from_bits(np.uint32(g[i])))
    return out


@pytest.mark.parametrize("code", [1, 2])
def test_16_bit_loads_every_pattern(code):
    np.testing.assert_array_equal(_loaded(_ALL16, code), _scalar(_ALL16, code))
    if code == 1:  # and what numpy makes of fp16 (it keeps NaN payloads too)
        np.testing.assert_array_equal(_loaded(_ALL16, code),
                                      _ALL16.view(np.float16).astype(np.float32).view(np.uint32))


def test_fp32_load_keeps_every_bit():
    rng = np.random.default_rng(0)
    g = rng.integers(0, 1 << 32, size=1 << 16, dtype=np.uint32)
    g[:4] = [0x7F800001, 0xFFC00123, 0x80000000, 0x00000001]  # sNaN, qNaN, -0, denormal
    np.testing.assert_array_equal(_loaded(g, 0), g)


@njit
def _fmas(x, acc):
    vec, one = np.empty_like(x), np.empty_like(x)
    for i in range(0, x.size, 8):
        v = v8.fma_sq(v8.load_f32(x, i), v8.add(v8.load_f32(acc, i), v8.zero()))
        for k in range(8):
            vec[i + k] = v8.lane(v, k)
            one[i + k] = fma32(x[i + k], x[i + k], acc[i + k])
    return vec, one


def test_fma_sq_rounds_once():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1 << 16).astype(np.float32)
    acc = (rng.standard_normal(1 << 16) * 1e3).astype(np.float32)
    vec, one = _fmas(x, acc)
    np.testing.assert_array_equal(vec.view(np.uint32), one.view(np.uint32))
    # and it is not the square rounded, then added (two roundings) for some of them
    twice = (x * x + acc).view(np.uint32)
    assert (vec.view(np.uint32) != twice).any()


@njit
def _set_lanes(x):
    v = v8.zero()
    for k in range(8):
        v = v8.with_lane(v, k, x[k])
    return np.array([v8.lane(v, k) for k in range(8)], dtype=np.float32)


def test_with_lane_and_lane():
    x = np.arange(1, 9, dtype=np.float32) / 3
    np.testing.assert_array_equal(_set_lanes(x), x)
