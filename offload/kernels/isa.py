"""Which instruction set the native kernels run, for `offload info` and the tests."""
from __future__ import annotations

from typing import List, Optional

__all__ = ["native_isa", "supported_isas"]


def _native():
    from .registry import _load
    return _load("native")


def native_isa() -> Optional[str]:
    """The ISA native calls use now ($OFFLOAD_ISA or the best); None without the library."""
    backend = _native()
    return None if backend is None else backend.isa()


def supported_isas() -> List[str]:
    """ISAs this CPU can run, as the native library sees them ([] without the library)."""
    backend = _native()
    return [] if backend is None else list(backend.supported)
