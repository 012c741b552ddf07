"""Backend selection: native, then numba, then torch; a forced backend that fails says why.

``OFFLOAD_BACKEND=native|numba|torch`` (or ``get_backend(name)``) forces one; a backend asked
for by name that cannot load raises RuntimeError carrying its reason (the compiler error or
the dlopen error for native, the import error for numba) -- never a silent switch.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Dict, Optional, Tuple

__all__ = ["get_backend", "backend_status", "BACKENDS"]

log = logging.getLogger("offload.kernels")

BACKENDS = ("native", "numba", "torch")

_lock = threading.Lock()
_loaded: Dict[str, object] = {}
_errors: Dict[str, str] = {}
_auto_logged = False


def _load(name: str):
    """Load backend ``name`` once; returns it or None (reason kept in _errors)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _errors:
            return None
        try:
            if name == "torch":
                from .torch_backend import TorchBackend
                backend = TorchBackend()
            elif name == "numba":
                from .numba_backend import NumbaBackend
                backend = NumbaBackend()
            elif name == "native":
                from .native_backend import NativeBackend
                backend = NativeBackend()
            else:
                raise ValueError(name)
        except Exception as exc:  # any load failure is a reason, kept and reported
            if isinstance(exc, OSError) and exc.strerror:
                _errors[name] = exc.strerror  # our loader's message already names the path
            else:
                _errors[name] = f"{type(exc).__name__}: {exc}"
            return None
        _loaded[name] = backend
        return backend


def get_backend(name: Optional[str] = None):
    """The kernel backend ``name``; None -> $OFFLOAD_BACKEND or "auto"."""
    global _auto_logged
    if name is None:
        name = os.environ.get("OFFLOAD_BACKEND", "") or "auto"
    if not isinstance(name, str):  # (an AttributeError from .strip() named nothing)
        raise TypeError(f"backend must be one of {', '.join(BACKENDS + ('auto',))} or None, got "
                        f"{type(name).__name__} {name!r:.40}")
    name = name.strip().lower()
    if name == "auto":
        for candidate in BACKENDS:
            backend = _load(candidate)
            if backend is not None:
                if not _auto_logged:
                    _auto_logged = True
                    skipped = {k: v for k, v in _errors.items() if k in BACKENDS}
                    log.info("kernel backend: %s%s", candidate,
                             f" (unavailable: {skipped})" if skipped else "")
                return backend
        raise RuntimeError(f"no kernel backend could be loaded: {_errors}")
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of "
                         f"{', '.join(BACKENDS + ('auto',))}")
    backend = _load(name)
    if backend is None:
        raise RuntimeError(f"kernel backend {name!r} is not available: {_errors[name]}")
    return backend


def backend_status() -> Dict[str, Tuple[bool, str]]:
    """name -> (available, reason) for every backend, for `offload info`."""
    status = {}
    for name in BACKENDS:
        backend = _load(name)
        if backend is None:
            status[name] = (False, _errors[name])
        else:
            try:
                status[name] = (True, getattr(backend, "describe", lambda: "ok")())
            except (RuntimeError, ValueError) as exc:  # loaded, but unusable as configured
                status[name] = (False, str(exc))
    return status
