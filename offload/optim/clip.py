"""The grad multiplier of a step: 1/loss-scale (GradScaler) times the global-norm clip
coefficient, folded into the kernel's pass instead of a pass of its own over the grads."""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

from offload.kernels import get_backend
from offload.optim.protocol import optional

__all__ = ["grad_multiplier"]

log = logging.getLogger("offload.optim")


def grad_multiplier(opt: Any, work: Any) -> Optional[float]:
    """1/loss-scale times the clip coefficient, or None when the step must be skipped."""
    inv_scale = 1.0
    scale = getattr(opt, "grad_scale", None)  # set by GradScaler.step for this call only
    if scale is not None:
        inv_scale = 1.0 / float(scale)
    found_inf = getattr(opt, "found_inf", None)
    if found_inf is not None and float(found_inf) > 0:
        log.info("step skipped: GradScaler found inf/nan in the gradients")
        return None
    # Grads that must move first (copies to host buffers, the reduction across ranks)
    # are timed as grad_transfer, not as the clip that needs them.
    prepare = optional(opt._store, "prepare_grads")
    if prepare is not None:
        t = time.perf_counter()
        prepare()
        opt._t_prepare = time.perf_counter() - t
    if opt.max_grad_norm is None:
        return inv_scale
    norm_fn = optional(opt._store, "global_grad_sumsq")
    if norm_fn is not None:
        sumsq, nonfinite = norm_fn(work)
    else:
        kernel = get_backend(opt.backend)
        sumsq, nonfinite = 0.0, False
        for _, items in work:
            for _, g in items:
                if g.numel():
                    s, bad = kernel.grad_sumsq(g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1), num_threads=opt.num_threads)
                    sumsq += s
                    nonfinite |= bad
    if nonfinite:
        log.warning("step skipped: non-finite gradient norm")
        opt.last_grad_norm = float("nan")
        return None
    norm = math.sqrt(sumsq) * inv_scale
    opt.last_grad_norm = norm
    # Same coefficient as torch.nn.utils.clip_grad_norm_.
    clip = min(1.0, opt.max_grad_norm / (norm + 1e-6))
    return inv_scale * clip
