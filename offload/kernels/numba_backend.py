"""The numba backend: the fallback when the native library is missing (no compiler).

Same signature and semantics as the native backend, and the same arithmetic order (see
native/adam_avx512.cpp). Kept small on purpose: four parallel (prange) Adam kernels (grads
fp32 or 16-bit viewed as uint16, with or without the low-precision copy), two serial ones
for small tensors; the sum of squares is _numba_sumsq's, the native units' bits. Each is
compiled on first use and cached on disk (``cache=True``), because a first compile costs
~1-2 s and CI runs the suite with this backend too.

Threads: numba's OpenMP layer would start a second OpenMP runtime beside torch's, both
spinning (the trap of DeepSpeed issue #4687); unless the user chose a layer
(NUMBA_THREADING_LAYER), this module selects numba's own "workqueue" pool. That pool does
not accept concurrent launches from two Python threads, so launches are serialised by a lock.
``num_threads`` is capped at numba's pool size (NUMBA_NUM_THREADS, the CPU count by default).
The Adam kernels take no fastmath flag: their FMAs are written out (numba_rules.adam_update,
the native units' own), since "contract" let LLVM fuse different pairs in vectorized and
serial loops; the flags that assume no NaN/Inf would break NaN propagation and the
non-finite flag, and "arcp" would turn divisions into reciprocals. Compressed states:
numba_compressed, the same element functions.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from typing import Tuple

import numba
import numpy as np
import torch
from numba import njit, prange

from ._checks import GRAD_DTYPES, LOWP_DTYPES, check_tensor, check_threads
from ._numba_bits import lowp_bits, u16_to_float
from . import _numba_signals
from ._numba_signals import signals_held
from ._numba_sumsq import sumsq_parallel, sumsq_serial
from ._numba_tiles_pool import run_tiles
from ._rule_step import RuleStepFace
from ._threads import resolve_threads
from .adam_consts import AdamConsts, FoldCache
from .compressed_ref import compose_step
from . import numba_compressed as nc
from . import numba_rules as nr
from . import q8_buckets
from .quant import BLOCK, default_code, quant_map, zero_code
from .rule_consts import RuleFoldCache, fold_adagrad, fold_lion, fold_sgd

__all__ = ["NumbaBackend"]

_numba_signals.install()  # signals that land in llvmlite's callbacks: [Note: signals in llvmlite's callbacks]

if not os.environ.get("NUMBA_THREADING_LAYER"):
    numba.config.THREADING_LAYER = "workqueue"

_FASTMATH = False  # the FMAs are explicit (numba_rules.adam_update): nothing else may fuse
_MIN_PER_THREAD = 1 << 16  # as native/dispatch.cpp: below this a thread costs more than it saves
_launch_lock = threading.Lock()


# Adam's element function lives beside the other rules' (numba_rules.adam_update), where the
# compressed-state kernels (numba_compressed) share it: the same source, the same bits.
_update = nr.adam_update


_lowp_bits = lowp_bits
_u16_to_float = u16_to_float


# prange over elements, not over per-thread chunks: numba vectorizes the body of a prange
# loop, while an inner serial loop over a chunk came out scalar and ~8x slower here (measured
# with numba's default error model; see numba_compressed's [Note: numba's error model]).
# Four Adam specialisations: grad fp32 or uint16 (fp16/bf16) x with or without lowp copy.
@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _adam_f32(p, g, m, v, gs, use_l2, l2, decay, coeff, from_end, b2, w2, bc2s, eps, nss):
    for i in prange(p.size):
        p[i], m[i], v[i] = _update(g[i] * gs, p[i], m[i], v[i], use_l2, l2, decay, coeff,
                                   from_end, b2, w2, bc2s, eps, nss)


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _adam_f32_lowp(p, g, m, v, lowp, lowp_code, gs, use_l2, l2, decay, coeff, from_end, b2,
                   w2, bc2s, eps, nss):
    for i in prange(p.size):
        pi, mi, vi = _update(g[i] * gs, p[i], m[i], v[i], use_l2, l2, decay, coeff,
                             from_end, b2, w2, bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        lowp[i] = _lowp_bits(pi, lowp_code)


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _adam_u16(p, g, grad_code, m, v, gs, use_l2, l2, decay, coeff, from_end, b2, w2, bc2s,
              eps, nss):
    for i in prange(p.size):
        p[i], m[i], v[i] = _update(_u16_to_float(g[i], grad_code) * gs, p[i], m[i], v[i],
                                   use_l2, l2, decay, coeff, from_end, b2, w2, bc2s, eps, nss)


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _adam_u16_lowp(p, g, grad_code, m, v, lowp, lowp_code, gs, use_l2, l2, decay, coeff,
                   from_end, b2, w2, bc2s, eps, nss):
    for i in prange(p.size):
        pi, mi, vi = _update(_u16_to_float(g[i], grad_code) * gs, p[i], m[i], v[i], use_l2,
                             l2, decay, coeff, from_end, b2, w2, bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        lowp[i] = _lowp_bits(pi, lowp_code)


# Serial twins for small tensors: a parallel launch costs ~50-100 us even on one thread,
# which a model with hundreds of small params (biases, norms) pays per tensor per step.
# Below _SERIAL_MAX elements these plain loops (~1 us for 64 elements) are faster; above,
# the prange versions win (numba vectorizes prange bodies, not these loops).
_SERIAL_MAX = 16384
_NO_LOWP = np.zeros(0, dtype=np.uint16)


@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _adam_f32_serial(p, g, m, v, lowp, lowp_code, gs, use_l2, l2, decay, coeff, from_end,
                     b2, w2, bc2s, eps, nss):
    for i in range(p.size):
        pi, mi, vi = _update(g[i] * gs, p[i], m[i], v[i], use_l2, l2, decay, coeff,
                             from_end, b2, w2, bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        if lowp_code > 0:  # a branch costs nothing in a loop that is not vectorized anyway
            lowp[i] = _lowp_bits(pi, lowp_code)


@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _adam_u16_serial(p, g, grad_code, m, v, lowp, lowp_code, gs, use_l2, l2, decay, coeff,
                     from_end, b2, w2, bc2s, eps, nss):
    for i in range(p.size):
        pi, mi, vi = _update(_u16_to_float(g[i], grad_code) * gs, p[i], m[i], v[i], use_l2,
                             l2, decay, coeff, from_end, b2, w2, bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        if lowp_code > 0:
            lowp[i] = _lowp_bits(pi, lowp_code)


def _u16(t: torch.Tensor) -> np.ndarray:
    """A 16-bit tensor's memory as a flat uint16 array (numpy has no bfloat16)."""
    return t.view(-1).view(torch.int16).numpy().view(np.uint16)


def quant_tables(table: np.ndarray, mid: np.ndarray, zc: int, sqrt_code: bool = False) -> tuple:
    """(decode table, mid, zero code, bucket table, square-root code) as numba_compressed
    takes a blocked state's tables; the bucket table is empty for a map it does not fit
    (q8_buckets.build)."""
    buckets = q8_buckets.build(mid)
    return (table, mid, zc, np.zeros(0, dtype=np.uint32) if buckets is None else buckets, bool(sqrt_code))


_QUANT_MAPS = {signed: quant_tables(*(t.numpy() for t in quant_map(signed)), zero_code(signed),
                                    default_code(signed) == "sqrt")
               for signed in (True, False)}


def _state_arg(field, t: torch.Tensor):
    """A state as numba_compressed takes it: packed blocks as (bytes, map, mid, zero code),
    bf16 as uint16 bits, float32 as itself."""
    if field.blocked:
        return (t.view(-1).numpy(),) + _QUANT_MAPS[field.signed]
    return _u16(t) if t.dtype == torch.bfloat16 else t.view(-1).numpy()


def _threads_for(n: int, num_threads) -> int:
    threads = resolve_threads(num_threads)
    return max(1, min(threads, numba.config.NUMBA_NUM_THREADS, n // _MIN_PER_THREAD))


def _kernel_scalars(c: AdamConsts) -> tuple:
    """The kernels' trailing arguments; numpy float32 scalars, so numba compiles float32
    arithmetic (native/adam_scalar.cpp's)."""
    f32 = np.float32
    return (f32(c.grad_scale), c.use_l2, f32(c.l2), f32(c.decay), f32(c.lerp_coeff),
            c.lerp_from_end, f32(c.beta2), f32(c.one_minus_beta2), f32(c.bc2_sqrt), f32(c.eps),
            f32(c.neg_step_size))


def _held(method):
    """``method`` with SIGINT and SIGTERM held while it runs its numba kernels
    ([Note: signals in llvmlite's callbacks] in _numba_signals.py)."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        with signals_held():
            return method(*args, **kwargs)
    return call


class NumbaBackend(RuleStepFace):
    name = "numba"

    def describe(self) -> str:
        return f"ok, numba {numba.__version__}"

    def __init__(self) -> None:
        self._fold = FoldCache(_kernel_scalars)
        self._sgd_fold = RuleFoldCache(fold_sgd, 8, nr.sgd_scalars)
        self._adagrad_fold = RuleFoldCache(fold_adagrad, 7, nr.adagrad_scalars)
        self._lion_fold = RuleFoldCache(fold_lion, 6, nr.lion_scalars)

    @_held
    def _sgd(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        # without a buffer the param stands in for it: mode 0 never writes it
        self._run_rule(nr.sgd_serial, (nr.sgd_parallel, nr.sgd_parallel_lowp), param, grad,
                       states[:1] or (param,), param_lowp, num_threads, self._sgd_fold(hyper))

    @_held
    def _adagrad(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        self._run_rule(nr.adagrad_serial, (nr.adagrad_parallel, nr.adagrad_parallel_lowp),
                       param, grad, states, param_lowp, num_threads, self._adagrad_fold(hyper))

    @_held
    def _lion(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        self._run_rule(nr.lion_serial, (nr.lion_parallel, nr.lion_parallel_lowp), param,
                       grad, states, param_lowp, num_threads, self._lion_fold(hyper))

    def _run_rule(self, serial, parallel, param, grad, states, param_lowp, num_threads,
                  scalars) -> None:
        """SGD, Adagrad, Lion or AMSGrad (numba_rules; ``states`` in field order): the serial
        loop for small tensors, else the prange pair's loop without or with the copy."""
        n = param.numel()
        if grad.dtype == torch.float32:
            g, code = grad.view(-1).numpy(), 0
        else:
            g, code = _u16(grad), GRAD_DTYPES[grad.dtype]
        lowp = (_NO_LOWP, -1) if param_lowp is None else \
            (_u16(param_lowp), LOWP_DTYPES[param_lowp.dtype])
        args = (param.view(-1).numpy(), g, code) + tuple(s.view(-1).numpy() for s in states) + lowp + scalars
        if n <= _SERIAL_MAX:
            serial(*args)
            return
        threads = _threads_for(n, num_threads)
        with _launch_lock:
            numba.set_num_threads(threads)
            parallel[param_lowp is not None](*args)

    @_held
    def _adam(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        args = self._fold(hyper)
        exp_avg, exp_avg_sq = states
        n = param.numel()
        p = param.view(-1).numpy()
        m = exp_avg.view(-1).numpy()
        v = exp_avg_sq.view(-1).numpy()
        lowp = () if param_lowp is None else (_u16(param_lowp), LOWP_DTYPES[param_lowp.dtype])
        if grad.dtype == torch.float32:
            head = (p, grad.view(-1).numpy(), m, v)
            serial, parallel = _adam_f32_serial, (_adam_f32_lowp if lowp else _adam_f32)
        else:
            head = (p, _u16(grad), GRAD_DTYPES[grad.dtype], m, v)
            serial, parallel = _adam_u16_serial, (_adam_u16_lowp if lowp else _adam_u16)
        if n <= _SERIAL_MAX:
            serial(*head, *(lowp or (_NO_LOWP, -1)), *args)
            return
        kernel, kargs = parallel, head + lowp
        threads = _threads_for(n, num_threads)
        with _launch_lock:
            numba.set_num_threads(threads)
            kernel(*kargs, *args)

    @_held
    def _adam_amsgrad(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        self._run_rule(nr.amsgrad_serial, (nr.amsgrad_parallel, nr.amsgrad_parallel_lowp), param, grad, states,
                       param_lowp, num_threads, self._fold(hyper))

    @_held
    def _compressed(self, method, fields, param, grad, states, param_lowp, num_threads, hyper,
                    q) -> None:
        """One pass of numba_compressed's kernel: states decoded per 256-element tile, the
        rule's float32 element function, states encoded; a bf16 param rounded stochastically.
        AMSGrad's three states go the scheme's own way (compressed_ref.compose_step around
        this backend's float32 AMSGrad: whole states decoded to float32 buffers): the same
        bits, without the fused kernel's memory saving; numba is the fallback."""
        if method == "_adam_amsgrad":
            compose_step(self._adam_amsgrad, fields, param, grad, states, param_lowp,
                         num_threads, hyper, q)
            return
        n = param.numel()
        p = param.view(-1).numpy() if param.dtype == torch.float32 else _u16(param)
        g, code = (grad.view(-1).numpy(), 0) if grad.dtype == torch.float32 else \
            (_u16(grad), GRAD_DTYPES[grad.dtype])
        s = [_state_arg(f, t) for f, t in zip(fields, states)] + [None, None]
        lowp = (_NO_LOWP, -1) if param_lowp is None else \
            (_u16(param_lowp), LOWP_DTYPES[param_lowp.dtype])
        args = (p, g, code, s[0], s[1]) + lowp + (self._rule_args(method, hyper),
                                                  (q.seed, q.offset & 0xFFFFFFFF,
                                                   bool(q.stochastic_states)))
        nb = -(-n // BLOCK)
        if n <= _SERIAL_MAX:
            nc.run_serial(0, nb, *args)
            return
        # Python threads over runs of tiles, not a prange wrapper (_numba_tiles_pool)
        run_tiles(nc.run_serial, nb, _threads_for(n, num_threads), args)

    def _rule_args(self, method: str, hyper: tuple):
        """The rule's folded scalars as the namedtuple that picks its element function."""
        if method == "_adam":
            return nc.AdamArgs(*self._fold(hyper))
        if method == "_sgd":
            return nc.SgdArgs(*self._sgd_fold(hyper))
        if method == "_adagrad":
            return nc.AdagradArgs(*self._adagrad_fold(hyper))
        if method == "_lion":
            return nc.LionArgs(*self._lion_fold(hyper))
        raise ValueError(f"no compressed kernel for rule method {method!r}")

    @_held
    def grad_sumsq(self, grad, *, num_threads=None) -> Tuple[float, bool]:
        check_tensor("grad", grad, GRAD_DTYPES)
        check_threads(num_threads)
        n = grad.numel()
        if n == 0:
            return 0.0, False
        code = GRAD_DTYPES[grad.dtype]
        # fp32 as its bits: one element loader for every dtype (_numba_sumsq._elem)
        g = grad.view(-1).view(torch.int32).numpy().view(np.uint32) if code == 0 else _u16(grad)
        if n <= _SERIAL_MAX:
            total = float(sumsq_serial(g, code))
        else:
            with _launch_lock:
                numba.set_num_threads(_threads_for(n, num_threads))
                total = float(sumsq_parallel(g, code))
        # the native units' blocked sum, bit for bit (_numba_sumsq): a block whose fp32 sum
        # overflows is redone in double, so the sum is non-finite exactly when an element is
        return total, not math.isfinite(total)
