"""numba kernels of SGD, Adagrad, Lion and AMSGrad: the fallback twins of native/rule_loop.h.

One element function per rule (the native bodies' statement order and float32 scalars from
``rule_consts``; ``fma32`` where the native units use an FMA, so the two agree bit for bit),
each run by parallel (prange) loops, without and with the low-precision copy, and a serial
loop for small tensors, as the Adam kernels in numba_backend.
The grad is float32 or 16-bit bits (``load_grad`` picks at compile time from the array's
dtype); the low-precision copy is written when ``lowp_code`` > 0. SGD without a buffer gets
the param as a stand-in state array that its mode 0 never writes.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._numba_bits import fma32, lowp_bits, u16_to_float

__all__ = ["adam_update", "load_grad", "sgd_parallel", "sgd_parallel_lowp", "sgd_serial", "adagrad_parallel",
           "adagrad_parallel_lowp", "adagrad_serial", "lion_parallel", "lion_parallel_lowp",
           "lion_serial", "amsgrad_parallel", "amsgrad_parallel_lowp", "amsgrad_serial",
           "sgd_scalars", "adagrad_scalars", "lion_scalars"]

# No fastmath flag: every FMA the native units take is written out (fma32), and "contract"
# let LLVM fuse others too. Lion's caller scales the grad (g = grad * gs, for max_grad_norm or a
# GradScaler) and _lion subtracts the moment (g - m): fused into fma(grad, gs, -m), numba's
# exp_avg was one ulp off the native units' (every ISA) from the second step (forty-seventh
# session's fuzz on AVX-512).
_FASTMATH = False


def load_grad(g, i, grad_code):
    """Element ``i`` of a grad array as float32 (numba only)."""
    raise NotImplementedError


@overload(load_grad, inline="always")
def _load_grad(g, i, grad_code):
    if g.dtype == types.float32:
        return lambda g, i, grad_code: g[i]
    return lambda g, i, grad_code: u16_to_float(g[i], grad_code)


@njit(inline="always", nogil=True, cache=True)
def adam_update(g, p, m, v, use_l2, l2, decay, coeff, from_end, b2, w2, bc2s, eps, nss):
    """One element of torch's _single_tensor_adam; returns (p, m, v). The FMAs are the
    native units' (native/adam_avx512.cpp), written out: left to "contract", LLVM fused
    other pairs in the vectorized loops than in the serial ones (the serial and parallel
    kernels, and numba and native, then differed in the last bit).

    Flags become selects, not branches, so the loop stays vectorized."""
    g = fma32(p, l2, g) if use_l2 else g
    m = fma32(coeff, g - m, g if from_end else m)
    v = fma32(w2 * g, g, v * b2)
    denom = np.sqrt(v) / bc2s + eps
    # torch's param.mul_(decay) then param.addcdiv_(...): two roundings, no FMA (the native
    # units' adam_math, [Note: explicit FMAs])
    p = p * decay + (nss * m) / denom
    return p, m, v


_ALL_ONES_NAN = np.uint32(0xFFFFFFFF).view(np.float32)


@njit(inline="always", nogil=True, cache=True)
def max_nan(a, b):
    """torch.maximum as its vectorized CPU kernel computes it (native vmax_nan): b unless
    a > b, and the all-ones NaN where either is NaN."""
    if a != a or b != b:
        return _ALL_ONES_NAN
    return a if a > b else b


@njit(inline="always", nogil=True, cache=True)
def amsgrad_update(g, p, m, v, vmax, use_l2, l2, decay, coeff, from_end, b2, w2, bc2s, eps, nss):
    """One element of torch's _single_tensor_adam with amsgrad=True: adam_update's
    arithmetic with the running maximum of v in the denominator; returns (p, m, v, vmax)."""
    g = fma32(p, l2, g) if use_l2 else g
    m = fma32(coeff, g - m, g if from_end else m)
    v = fma32(w2 * g, g, v * b2)
    vmax = max_nan(vmax, v)
    denom = np.sqrt(vmax) / bc2s + eps
    p = p * decay + (nss * m) / denom
    return p, m, v, vmax


@njit(inline="always", nogil=True, cache=True, fastmath=_FASTMATH)
def _sgd(g, p, buf, use_wd, wd, mom, omd, mode, nesterov, neg_lr):
    """(p, buf) after one element of torch's _single_tensor_sgd."""
    if use_wd:
        g = fma32(p, wd, g)
    update = g
    if mode == 1:
        buf = g  # the first step's buffer: d_p, no dampening
    elif mode == 2:
        buf = fma32(g, omd, buf * mom)
    if mode != 0:
        update = fma32(buf, mom, g) if nesterov else buf
    return fma32(update, neg_lr, p), buf


@njit(inline="always", nogil=True, cache=True, fastmath=_FASTMATH)
def _adagrad(g, p, s, use_wd, wd, eps, neg_clr):
    if use_wd:
        g = fma32(p, wd, g)
    s = fma32(g, g, s)
    std = np.sqrt(s) + eps
    return p + (neg_clr * g) / std, s


@njit(inline="always", nogil=True, cache=True, fastmath=_FASTMATH)
def _lion(g, p, m, decay, c1, c2, neg_lr, from_end1, from_end2):
    p = p * decay
    d = g - m
    c = fma32(c1, d, g if from_end1 else m)
    u = np.float32((c > 0) - (c < 0))  # torch's vectorized sign: 0 for zeros and NaN
    p = fma32(u, neg_lr, p)
    return p, fma32(c2, d, g if from_end2 else m)


# The loops: one element function each, so the parallel and serial twins cannot differ.
# The parallel loops come in pairs, without and with the copy: an unconditional store keeps
# the prange body vectorized, a branch on the copy's presence did not (5x slower here).
@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def sgd_parallel(p, g, grad_code, s, lowp, lowp_code, gs, use_wd, wd, mom, omd, mode,
                 nesterov, neg_lr):
    for i in prange(p.size):
        pi, bi = _sgd(load_grad(g, i, grad_code) * gs, p[i], s[i], use_wd, wd, mom, omd,
                      mode, nesterov, neg_lr)
        p[i] = pi
        if mode != 0:  # loop-invariant: hoisted; and the stand-in state is never written
            s[i] = bi


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def sgd_parallel_lowp(p, g, grad_code, s, lowp, lowp_code, gs, use_wd, wd, mom, omd, mode,
                      nesterov, neg_lr):
    for i in prange(p.size):
        pi, bi = _sgd(load_grad(g, i, grad_code) * gs, p[i], s[i], use_wd, wd, mom, omd,
                      mode, nesterov, neg_lr)
        p[i] = pi
        if mode != 0:  # loop-invariant: hoisted; and the stand-in state is never written
            s[i] = bi
        lowp[i] = lowp_bits(pi, lowp_code)


@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def sgd_serial(p, g, grad_code, s, lowp, lowp_code, gs, use_wd, wd, mom, omd, mode,
               nesterov, neg_lr):
    for i in range(p.size):
        pi, bi = _sgd(load_grad(g, i, grad_code) * gs, p[i], s[i], use_wd, wd, mom, omd,
                      mode, nesterov, neg_lr)
        p[i] = pi
        if mode != 0:
            s[i] = bi
        if lowp_code > 0:
            lowp[i] = lowp_bits(pi, lowp_code)


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def adagrad_parallel(p, g, grad_code, s, lowp, lowp_code, gs, use_wd, wd, eps, neg_clr):
    for i in prange(p.size):
        pi, si = _adagrad(load_grad(g, i, grad_code) * gs, p[i], s[i], use_wd, wd, eps, neg_clr)
        p[i] = pi
        s[i] = si


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def adagrad_parallel_lowp(p, g, grad_code, s, lowp, lowp_code, gs, use_wd, wd, eps, neg_clr):
    for i in prange(p.size):
        pi, si = _adagrad(load_grad(g, i, grad_code) * gs, p[i], s[i], use_wd, wd, eps, neg_clr)
        p[i] = pi
        s[i] = si
        lowp[i] = lowp_bits(pi, lowp_code)


@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def adagrad_serial(p, g, grad_code, s, lowp, lowp_code, gs, use_wd, wd, eps, neg_clr):
    for i in range(p.size):
        pi, si = _adagrad(load_grad(g, i, grad_code) * gs, p[i], s[i], use_wd, wd, eps, neg_clr)
        p[i] = pi
        s[i] = si
        if lowp_code > 0:
            lowp[i] = lowp_bits(pi, lowp_code)


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def lion_parallel(p, g, grad_code, s, lowp, lowp_code, gs, decay, c1, c2, neg_lr, from_end1,
                  from_end2):
    for i in prange(p.size):
        pi, mi = _lion(load_grad(g, i, grad_code) * gs, p[i], s[i], decay, c1, c2, neg_lr,
                       from_end1, from_end2)
        p[i] = pi
        s[i] = mi


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def lion_parallel_lowp(p, g, grad_code, s, lowp, lowp_code, gs, decay, c1, c2, neg_lr,
                       from_end1, from_end2):
    for i in prange(p.size):
        pi, mi = _lion(load_grad(g, i, grad_code) * gs, p[i], s[i], decay, c1, c2, neg_lr,
                       from_end1, from_end2)
        p[i] = pi
        s[i] = mi
        lowp[i] = lowp_bits(pi, lowp_code)


@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def lion_serial(p, g, grad_code, s, lowp, lowp_code, gs, decay, c1, c2, neg_lr, from_end1,
                from_end2):
    for i in range(p.size):
        pi, mi = _lion(load_grad(g, i, grad_code) * gs, p[i], s[i], decay, c1, c2, neg_lr,
                       from_end1, from_end2)
        p[i] = pi
        s[i] = mi
        if lowp_code > 0:
            lowp[i] = lowp_bits(pi, lowp_code)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def amsgrad_parallel(p, g, grad_code, m, v, vmax, lowp, lowp_code, gs, use_l2, l2, decay, coeff,
                     from_end, b2, w2, bc2s, eps, nss):
    for i in prange(p.size):
        pi, mi, vi, xi = amsgrad_update(load_grad(g, i, grad_code) * gs, p[i], m[i], v[i],
                                        vmax[i], use_l2, l2, decay, coeff, from_end, b2, w2,
                                        bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        vmax[i] = xi


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def amsgrad_parallel_lowp(p, g, grad_code, m, v, vmax, lowp, lowp_code, gs, use_l2, l2, decay,
                          coeff, from_end, b2, w2, bc2s, eps, nss):
    for i in prange(p.size):
        pi, mi, vi, xi = amsgrad_update(load_grad(g, i, grad_code) * gs, p[i], m[i], v[i],
                                        vmax[i], use_l2, l2, decay, coeff, from_end, b2, w2,
                                        bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        vmax[i] = xi
        lowp[i] = lowp_bits(pi, lowp_code)


@njit(nogil=True, cache=True, error_model="numpy")
def amsgrad_serial(p, g, grad_code, m, v, vmax, lowp, lowp_code, gs, use_l2, l2, decay, coeff,
                   from_end, b2, w2, bc2s, eps, nss):
    for i in range(p.size):
        pi, mi, vi, xi = amsgrad_update(load_grad(g, i, grad_code) * gs, p[i], m[i], v[i],
                                        vmax[i], use_l2, l2, decay, coeff, from_end, b2, w2,
                                        bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        vmax[i] = xi
        if lowp_code > 0:
            lowp[i] = lowp_bits(pi, lowp_code)


# The folded constants as the kernels' trailing arguments: numpy float32 scalars, so numba
# compiles float32 arithmetic (the native units'), and plain ints / bools for the flags.
_f32 = np.float32


def sgd_scalars(c) -> tuple:
    return (_f32(c.grad_scale), c.use_wd, _f32(c.weight_decay), _f32(c.momentum),
            _f32(c.one_minus_dampening), c.momentum_mode, c.nesterov, _f32(c.neg_lr))


def adagrad_scalars(c) -> tuple:
    return (_f32(c.grad_scale), c.use_wd, _f32(c.weight_decay), _f32(c.eps), _f32(c.neg_clr))


def lion_scalars(c) -> tuple:
    return (_f32(c.grad_scale), _f32(c.decay), _f32(c.coeff1), _f32(c.coeff2), _f32(c.neg_lr),
            c.from_end1, c.from_end2)
