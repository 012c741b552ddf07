"""Remove swap files on close, on normal interpreter exit and on SIGTERM.

A swap directory holds as many bytes as the optimizer states, so a forgotten one costs real
disk. Open stores register here; ``atexit`` closes them, and a SIGTERM handler chains to
whatever handler was there before: with the default action it closes them and terminates
the process, as the sender expects; a Python handler (a framework's graceful shutdown) runs
untouched and the files go at exit. ``kill -9`` cannot be caught: such a directory keeps its
files but its ``flock`` dies with the process, which is how ``offload clean`` and
``resume=True`` recognise it.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from typing import Any, Dict, List

__all__ = ["register", "unregister", "close_all"]

log = logging.getLogger(__name__)

# Strong references: a store dropped without close() must still be cleaned at exit (its
# owner, e.g. SwappedState, also closes it when the owner is garbage-collected).
_open: Dict[int, Any] = {}
_lock = threading.Lock()
_counter = 0
_installed = False
_previous_handler: Any = None


def register(store: Any) -> int:
    """Track ``store`` (an object with ``close()``); returns a token for :func:`unregister`."""
    global _counter
    with _lock:
        _counter += 1
        _open[_counter] = store
        token = _counter
    _install()
    return token


def unregister(token: int) -> None:
    with _lock:
        _open.pop(token, None)


def close_all() -> None:
    """Close every registered store, newest first; errors are logged, not raised (exit path)."""
    with _lock:
        stores: List[Any] = [s for _, s in sorted(_open.items(), reverse=True)]
        _open.clear()
    for store in stores:
        try:
            store.close()
        except Exception as exc:  # exit path: keep closing the others
            log.warning("could not clean up swap store %s: %s", getattr(store, "path", store), exc)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: do what the handler we replaced would have done, cleaning up when that ends
    the process. A Python handler (a framework's graceful shutdown) runs first and untouched:
    if it exits (SystemExit), ``atexit`` cleans up; if it returns, the process goes on and so
    must its swap files. SIG_IGN: nothing. SIG_DFL: clean up, then die of SIGTERM."""
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL or unknown (set from C): terminate as the default action would
        close_all()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install() -> None:
    global _installed, _previous_handler
    if _installed:
        return
    _installed = True
    atexit.register(close_all)
    if threading.current_thread() is not threading.main_thread():
        log.debug("swap store opened outside the main thread: no SIGTERM cleanup handler")
        return
    try:
        _previous_handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError) as exc:  # embedded interpreters may refuse
        log.debug("could not install SIGTERM cleanup handler: %s", exc)


def clean_dir(swap_dir: str, *, dry_run: bool = False) -> Dict[str, List[Any]]:
    """Remove the swap directories under ``swap_dir`` whose lock is free (left by killed
    processes). Returns ``{"removed": [(path, bytes)], "held": [(path, pid)], "skipped":
    [(path, why)]}``. Only directories named like ours (``offload-<run>.rank<r>``) that pass
    the private-directory checks (real directory, ours, mode 0700) are touched."""
    import errno as _errno
    import re

    from offload.swap import fsutil

    swap_dir = os.path.abspath(swap_dir)
    if not os.path.isdir(swap_dir):
        raise NotADirectoryError(_errno.ENOTDIR, "not a directory", swap_dir)
    pattern = re.compile(r"^offload-[A-Za-z0-9_.-]+\.rank\d+$")
    out: Dict[str, List[Any]] = {"removed": [], "held": [], "skipped": []}
    for name in sorted(os.listdir(swap_dir)):
        if not pattern.match(name):
            continue
        path = os.path.join(swap_dir, name)
        try:
            fsutil.check_private_dir(path)
        except OSError as exc:
            out["skipped"].append((path, exc.strerror or str(exc)))
            continue
        fd, pid = fsutil.try_lock(path)
        if fd is None and pid is not None:
            out["held"].append((path, pid))
            continue
        # fd None and pid None: no lock file at all (a creation that died before locking)
        try:
            if dry_run:
                nbytes = sum(os.lstat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path))
            else:
                nbytes = fsutil.remove_private_dir(path)
            out["removed"].append((path, nbytes))
        except OSError as exc:
            out["skipped"].append((path, f"{exc.strerror or exc}: {exc.filename or ''}"))
        finally:
            if fd is not None:
                os.close(fd)
    return out
