"""numba's on-disk kernel cache, dropped when any source of the kernels changed.

``cache=True`` keys a compiled kernel by the modification time and size of the one file
that defines it, not of the files whose functions it inlines or whose constants it reads:
after an edit of numba_rules.py (a ``git pull`` into an editable install), numba_backend's
and numba_compressed's cached kernels kept the old arithmetic and stepped with it, silently.
So the package keeps, beside numba's cache files, a digest of every source of this folder;
when it differs, the cached kernels of this folder are removed before any is loaded, and
numba compiles them afresh. Installed wheels are not at risk (an upgrade rewrites every
file), but the check costs one read of this folder (~0.3 MB) per process.
"""
from __future__ import annotations

import hashlib
import os

__all__ = ["drop_stale"]

_STAMP = "offload-kernel-sources.sha256"


def _digest(folder: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def drop_stale(dispatcher) -> None:
    """Remove this folder's cached kernels from the cache directory ``dispatcher`` (a
    ``cache=True`` kernel of this folder) uses when the sources changed since they were
    compiled. An unreadable or unwritable cache is left to numba, which then compiles
    without it."""
    cache_dir = getattr(getattr(dispatcher, "_cache", None), "_cache_path", None)
    if not cache_dir or not os.path.isdir(cache_dir):
        return
    folder = os.path.dirname(os.path.abspath(__file__))
    modules = {name[:-3] for name in os.listdir(folder) if name.endswith(".py")}
    digest = _digest(folder)
    stamp = os.path.join(cache_dir, _STAMP)
    try:
        with open(stamp) as f:
            if f.read().strip() == digest:
                return
    except OSError:
        pass
    try:
        for name in os.listdir(cache_dir):
            # numba's names: <module>.<function>-<line>.py311[.N].nbi / .nbc
            if name.endswith((".nbi", ".nbc")) and name.split(".", 1)[0] in modules:
                try:
                    os.unlink(os.path.join(cache_dir, name))
                except FileNotFoundError:
                    pass  # another process removed it first
        tmp = f"{stamp}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp, stamp)
    except OSError:
        pass  # numba only caches in a directory it can write to; a failed removal is retried next time
