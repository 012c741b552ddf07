"""Finding the offload optimizer inside the wrappers of the training tools."""
from __future__ import annotations

from typing import Any

__all__ = ["offload_optimizer"]


def offload_optimizer(optimizer: Any) -> Any:
    """The offload optimizer inside ``optimizer`` (accelerate's ``AcceleratedOptimizer``
    wraps it as ``.optimizer``), or None when there is none."""
    from offload.optim.base import RuleOptimizer

    seen = 0
    while optimizer is not None and not isinstance(optimizer, RuleOptimizer) and seen < 8:
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return optimizer if isinstance(optimizer, RuleOptimizer) else None
