"""The grad multiplier of a step: 1/loss-scale (GradScaler) times the global-norm clip
coefficient, folded into the kernel's pass instead of a pass of its own over the grads."""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional, Tuple

import torch

from offload.kernels import get_backend
from offload.memory import paging
from offload.optim.host_dtypes import real_view
from offload.optim.context import StepContext
from offload.optim.protocol import optional

__all__ = ["grad_multiplier"]

log = logging.getLogger("offload.optim")


def grad_multiplier(ctx: StepContext, store: Any, work: Any, *, backend: Optional[str],
                    num_threads: Optional[int]) -> Tuple[Optional[float], float, Optional[float]]:
    """(multiplier, seconds spent preparing the grads, grad norm): the multiplier is
    1/loss-scale times the clip coefficient, or None when the step must be skipped; the norm
    is None when it was not computed (no clipping, or a skip before it)."""
    inv_scale = 1.0
    if ctx.grad_scale is not None:  # GradScaler's, for this step only
        inv_scale = 1.0 / float(ctx.grad_scale)
    if ctx.found_inf is not None and float(ctx.found_inf) > 0:
        log.info("step skipped: GradScaler found inf/nan in the gradients")
        return None, 0.0, None
    # Grads that must move first (copies to host buffers, the reduction across ranks)
    # are timed as grad_transfer, not as the clip that needs them.
    t_prepare = 0.0
    prepare = optional(store, "prepare_grads")
    if prepare is not None:
        t = time.perf_counter()
        prepare()
        t_prepare = time.perf_counter() - t
    if ctx.max_grad_norm is None:
        return inv_scale, t_prepare, None
    norm_fn = optional(store, "global_grad_sumsq")
    sumsq, nonfinite = norm_fn(work) if norm_fn is not None else _sumsq(work, backend, num_threads)
    if nonfinite:
        log.warning("step skipped: non-finite gradient norm")
        return None, t_prepare, float("nan")
    norm = math.sqrt(sumsq) * inv_scale
    # Same coefficient as torch.nn.utils.clip_grad_norm_.
    clip = min(1.0, ctx.max_grad_norm / (norm + 1e-6))
    return inv_scale * clip, t_prepare, norm


_PAGED_PIECE = 1 << 24  # elements of a paged grad in memory at once while its norm is taken


def _sumsq(work: Any, backend: Optional[str], num_threads: Optional[int]) -> Tuple[float, bool]:
    """The grads' sum of squares, one kernel pass each, and whether one is not finite."""
    kernel = get_backend(backend)
    sumsq, nonfinite = 0.0, False
    for _, items in work:
        for _, g in items:
            if g.numel():
                g = real_view(g)  # a complex grad's norm is its pairs' ([Note: complex params])
                flat = g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1)
                if flat.dtype == torch.float64:  # no float32 kernel takes it: [Note: float64 params]
                    s = float(torch.dot(flat, flat))
                    sumsq += s
                    nonfinite |= not math.isfinite(s)
                    continue
                # a grad in a swap file (params on NVMe) is read in pieces: [Note: paged tensors]
                step = _PAGED_PIECE if paging.active() and paging.paged(flat) else flat.numel()
                for a in range(0, flat.numel(), step):
                    piece = flat[a:a + step]
                    paging.load([piece])
                    s, bad = kernel.grad_sumsq(piece, num_threads=num_threads)
                    paging.evict([piece])
                    sumsq += s
                    nonfinite |= bad
    return sumsq, nonfinite
