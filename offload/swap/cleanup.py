"""Remove swap files on close and on normal interpreter exit; keep them after SIGTERM or a crash.

A swap directory holds as many bytes as the optimizer states, so a forgotten one costs real
disk. Open stores register here and ``atexit`` closes them (removing their directories).

[Note: SIGTERM keeps the swap files] Schedulers (SLURM, Kubernetes) preempt a job with
SIGTERM, then SIGKILL; the swap directory then holds the last finished step, exactly what
``resume=True`` needs. With the default action (SIG_DFL) nothing needs doing: the kernel ends
the process, no atexit handler runs, the files stay, and the ``flock`` dies with the process.
So no handler of ours is installed then: a Python-level handler in place of SIG_DFL would
delay the death of a process blocked in a long C call (a signal that lands just before the
call blocks is seen only when it returns; CI once waited 60 s for a ``time.sleep(60)``).
Only when a Python handler is there (a framework's graceful shutdown, which may exit and run
atexit) do we wrap it: ours records that the process is being terminated and calls it
untouched. From then on no store of this process removes its directory, at exit or in
close(): it is left unlocked and resumable, and ``offload clean`` removes it. A handler set
after a store opened is wrapped when the next store registers or the next step starts
(``watch_sigterm``; if it chains to the handler it
replaced, ours, that goes on to the handler wrapped before: each runs once). ``kill -9`` cannot be caught
either: its directory keeps its files and its lock dies with the process, which is how
``offload clean`` and ``resume=True`` recognise it.

[Note: fork] A forked child inherits the registry, the atexit hook and the SIGTERM handler,
but not the stores: they belong to the parent. The registry is emptied in the child
(``os.register_at_fork``), and each store also records the pid that created it and does
nothing to its files, lock, buffers or io_uring when closed in another process.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

from offload.memory.reentry import FinalizerSafeLock

__all__ = ["register", "unregister", "close_all", "terminating", "removing", "watch_sigterm"]

log = logging.getLogger(__name__)

# Strong references: a store dropped without close() must still be cleaned at exit (its
# owner, e.g. SwappedState, also closes it when the owner is garbage-collected).
_open: Dict[int, Any] = {}
_lock = FinalizerSafeLock()  # a store's close may run in a finalizer: [Note: finalizers re-enter]
_counter = 0
_installed = False
# The Python handlers we wrapped, oldest first (a handler set after ours and then wrapped in
# turn usually chains to ours, which then goes on to the one before: see _on_sigterm).
_wrapped: List[Any] = []
_depth = 0
_terminating = False
_why_kept = ""  # what ends the process: "SIGTERM", or the uncaught exception's type
_removing = False  # inside removing(): a propagating KeyboardInterrupt keeps nothing


def terminating() -> bool:
    """True once this process received SIGTERM or is dying of an uncaught exception, and
    while a Ctrl-C's KeyboardInterrupt propagates (outside :func:`removing`): swap
    directories are then kept (see the notes). Never inside :func:`removing`: its caller
    removes the whole swap_dir next (a SIGTERM turned into an exception there, as by the
    demo, must not log a directory "kept" that is removed a moment later)."""
    return not _removing and (_terminating or isinstance(sys.exc_info()[1], KeyboardInterrupt))


@contextlib.contextmanager
def removing() -> Iterator[None]:
    """Stores closed in the block remove their directories while a Ctrl-C propagates, and
    after a SIGTERM: for a caller that removes the whole swap_dir next (the demo's temporary one)."""
    global _removing
    before, _removing = _removing, True
    try:
        yield
    finally:
        _removing = before


def why_kept() -> str:
    """Why :func:`terminating` is true, for the log line of a directory kept."""
    if _terminating:
        return _why_kept or "SIGTERM"
    return "Ctrl-C (closed while its KeyboardInterrupt propagated)"


# [Note: a crash keeps the swap files] An exception nobody catches ends the process as a
# kill would (a collective that failed because another rank died, an OOM, a CUDA error): its
# swap directory holds the last finished step, which resume=True needs, and the atexit
# cleanup removed it (so a job of several ranks lost the survivors' states too). Python calls
# sys.excepthook for such an exception in the main thread before the atexit handlers run:
# ours marks the process as terminating, then calls the hook it replaced. A close() reached
# while the exception unwinds (a with-block, a finally) still removes, as asked, unless it is
# a Ctrl-C's KeyboardInterrupt: a `finally: opt.close()` around the training loop would
# otherwise remove the states the run was stopped to keep (Ctrl-C ends a run as SIGTERM does;
# a KeyboardInterrupt caught and handled before close() is over: the directory goes).
def _on_uncaught(kind: Any, value: Any, tb: Any) -> None:
    global _terminating, _why_kept
    if _open:
        _terminating, _why_kept = True, f"an uncaught {getattr(kind, '__name__', kind)}"
    _previous_excepthook(kind, value, tb)


_previous_excepthook: Any = sys.excepthook


def _on_thread_uncaught(args: Any) -> None:
    """threading.excepthook: a thread that dies of an exception (the training loop run in a
    worker thread, whose main thread then exits) keeps the directories as the main thread's
    crash does; keeping costs only disk (``offload clean``), removing can lose the only copy."""
    global _terminating, _why_kept
    if _open and args.exc_type is not SystemExit:
        name = getattr(args.thread, "name", "?")
        _terminating, _why_kept = True, f"an uncaught {getattr(args.exc_type, '__name__', args.exc_type)} in thread {name}"
    _previous_thread_hook(args)


_previous_thread_hook: Any = threading.excepthook


def _crash_seen_at_exit() -> None:
    """At exit: an uncaught exception whose hook was not ours (a logging or traceback library
    replaced sys.excepthook after the first store opened) still keeps the directories. The
    interpreter records the exception in ``sys.last_value`` (3.12: ``sys.last_exc``) before
    it calls whatever hook is set. Not in an interactive session (a REPL, IPython, Jupyter):
    there it records every error shown at the prompt, and the session went on after it."""
    global _terminating, _why_kept
    if hasattr(sys, "ps1") or "IPython" in sys.modules:
        return
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if last is not None and not _terminating:
        _terminating, _why_kept = True, f"an uncaught {type(last).__name__}"


def _forget_in_child() -> None:
    """After fork, in the child: the registered stores are the parent's (see [Note: fork])."""
    global _lock, _terminating
    _lock = FinalizerSafeLock()  # another thread may have held it at the fork
    _open.clear()
    _terminating = False
    # The child has no store for our SIGTERM handler to keep, and a Python-level handler makes
    # SIGTERM racy for a child blocked in a lock (a signal landing just before the wait is seen
    # only at the next bytecode): multiprocessing's Pool.terminate() then hung on a worker that
    # never died. The child gets back the handler we replaced (a store it opens reinstalls ours).
    # (The atexit hook is inherited too, and finds an empty registry.)
    if signal.getsignal(signal.SIGTERM) is _on_sigterm and _wrapped:
        try:
            signal.signal(signal.SIGTERM, _wrapped[-1])
        except (ValueError, OSError):  # not the main thread after all: leave it
            return
        _wrapped.pop()  # a chain back to ours goes on to the one before, not to it again


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def register(store: Any) -> int:
    """Track ``store`` (an object with ``close()``); returns a token for :func:`unregister`."""
    global _counter
    with _lock.held():
        _counter += 1
        _open[_counter] = store
        token = _counter
    _install()
    return token


def unregister(token: int) -> None:
    if _lock.defer(_open.pop, token, None):
        return
    with _lock.held():
        _open.pop(token, None)


def close_all() -> None:
    """Close every registered store, newest first; errors are logged, not raised (exit path)."""
    if _open:
        _crash_seen_at_exit()
    with _lock.held():
        stores: List[Any] = [s for _, s in sorted(_open.items(), reverse=True)]
        _open.clear()
    for store in stores:
        try:
            store.close()
        except Exception as exc:  # exit path: keep closing the others
            log.warning("could not clean up swap store %s: %s", getattr(store, "path", store), exc)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: keep the swap directories from now on (see [Note: SIGTERM keeps the swap
    files]), then run the newest Python handler we wrapped, untouched. When that handler
    chains to the one it replaced, which was ours, this runs again one level down and calls
    the handler wrapped before it: each wrapped handler runs once, none recurses forever."""
    global _terminating, _depth
    _terminating = True
    if _depth >= len(_wrapped):
        return  # nothing older to chain to
    handler = _wrapped[-1 - _depth]
    _depth += 1
    try:
        handler(signum, frame)
    finally:
        _depth -= 1


def watch_sigterm() -> None:
    """Wrap a Python SIGTERM handler set since the last store opened (called by each step):
    a framework that installs its graceful-shutdown handler after building the optimizer
    then exits through atexit, which removed the directory a preempted job resumes from."""
    if _open:
        _install()


def _install() -> None:
    """Register the atexit hook once; wrap the SIGTERM handler when it is a Python one (see
    [Note: SIGTERM keeps the swap files]). Called at each register: a framework's handler set
    after the first store opened is wrapped by the next."""
    global _installed, _previous_excepthook, _previous_thread_hook
    if not _installed:
        _installed = True
        atexit.register(close_all)
        # once: a hook set later that chains to ours would otherwise be wrapped in a loop
        _previous_excepthook, sys.excepthook = sys.excepthook, _on_uncaught  # [Note: a crash keeps ...]
        _previous_thread_hook, threading.excepthook = threading.excepthook, _on_thread_uncaught
    if threading.current_thread() is not threading.main_thread():
        log.debug("swap store opened outside the main thread: no SIGTERM cleanup handler")
        return
    try:
        current = signal.getsignal(signal.SIGTERM)
        if current is _on_sigterm or not callable(current):
            return  # ours already, or SIG_DFL (the kernel ends us: files kept), SIG_IGN, or C's
        signal.signal(signal.SIGTERM, _on_sigterm)
        _wrapped.append(current)
    except (ValueError, OSError) as exc:  # embedded interpreters may refuse
        log.debug("could not install SIGTERM cleanup handler: %s", exc)


def clean_dir(swap_dir: str, *, dry_run: bool = False) -> Dict[str, List[Any]]:
    """Remove the swap directories under ``swap_dir`` whose lock is free (left by killed
    processes). Returns ``{"removed": [(path, bytes)], "held": [(path, pid)], "skipped":
    [(path, why)]}``. Only directories named like ours (``offload-<run>.rank<r>``) that pass
    the private-directory checks (real directory, ours, mode 0700), whose contents prove them
    offload's (``own_dir.not_proven_ours``) and that hold only its files are touched: any
    other is skipped whole."""
    import errno as _errno

    if not isinstance(swap_dir, (str, os.PathLike)) or not os.fspath(swap_dir):
        raise ValueError(f"swap_dir must name a directory, got {swap_dir!r}")
    swap_dir = os.path.abspath(swap_dir)
    if not os.path.isdir(swap_dir):  # (ENOTDIR said "not a directory" of a path that is nothing)
        if not os.path.lexists(swap_dir):
            raise FileNotFoundError(_errno.ENOENT, "no such directory", swap_dir)
        raise NotADirectoryError(_errno.ENOTDIR, "not a directory", swap_dir)
    out: Dict[str, List[Any]] = {"removed": [], "held": [], "skipped": []}
    _clean_runs(swap_dir, dry_run, out)
    _clean_demo_dirs(swap_dir, dry_run, out)
    _clean_bench_files(swap_dir, dry_run, out)
    return out


_RUN_DIR = r"^offload-[A-Za-z0-9_.-]+\.rank\d+$"


def _clean_runs(swap_dir: str, dry_run: bool, out: Dict[str, List[Any]]) -> None:
    """The run directories of ``swap_dir`` whose lock is free (see clean_dir)."""
    import re

    from offload.swap import fsutil
    from offload.swap.own_dir import not_proven_ours

    pattern = re.compile(_RUN_DIR)
    for name in sorted(os.listdir(swap_dir)):
        if not pattern.match(name):
            continue
        path = os.path.join(swap_dir, name)
        try:
            fsutil.check_private_dir(path)
            fd, pid = fsutil.try_lock(path)  # (a lock that is no regular file: refused, naming it)
        except OSError as exc:
            out["skipped"].append((path, exc.strerror or str(exc)))
            continue
        if fd is None and pid is not None:
            out["held"].append((path, pid))
            continue
        # fd None and pid None: no lock file, in a directory older than a creation takes
        try:
            why = not_proven_ours(path)  # [Note: a directory clean may remove] in own_dir.py
            if why is not None:
                out["skipped"].append((path, why))
                continue
            nbytes = _only_files(path) if dry_run else fsutil.remove_private_dir(path)
            out["removed"].append((path, nbytes))
        except OSError as exc:
            out["skipped"].append((path, f"{exc.strerror or exc}: {exc.filename or ''}"))
        finally:
            if fd is not None:
                os.close(fd)


def _clean_demo_dirs(swap_dir: str, dry_run: bool, out: Dict[str, List[Any]]) -> None:
    """``offload demo``'s temporary directories (``offload-demo-*``, mkdtemp's: ours, mode
    0700) left by a killed demo (a kill -9: Ctrl-C and SIGTERM remove them): their run
    directories as above, one level below where the scan of ``swap_dir`` looks."""
    from offload.swap import fsutil

    for name in sorted(os.listdir(swap_dir)):
        path = os.path.join(swap_dir, name)
        if not name.startswith("offload-demo-"):
            continue
        try:
            fsutil.check_private_dir(path)
        except OSError as exc:
            out["skipped"].append((path, exc.strerror or str(exc)))
            continue
        before = len(out["removed"])
        _clean_runs(path, dry_run, out)
        # Removed only when a dead run was removed from it just now, and then only if empty: an
        # empty one may be a live demo's that has not made its run directory yet.
        if not dry_run and len(out["removed"]) > before:
            try:
                os.rmdir(path)
            except OSError:
                pass


def _clean_bench_files(directory: str, dry_run: bool, out: Dict[str, List[Any]]) -> None:
    """The test files of ``offload bench-io`` runs that were killed: regular files of this
    user named ``offload-bench-io.<pid>.dat`` whose flock is free ([Note: the test file while
    it runs] in offload/cli/bench_io.py). A kept file (``--keep``) has another name."""
    import fcntl
    import re
    import stat

    pattern = re.compile(r"^offload-bench-io\.([1-9]\d*)\.dat$")  # (a pid: no leading zero)
    for name in sorted(os.listdir(directory)):
        m = pattern.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            out["skipped"].append((path, exc.strerror or str(exc)))
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                out["skipped"].append((path, "not a regular file of this user"))
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                out["held"].append((path, int(m.group(1))))
                continue
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue  # replaced since it was opened: a new run's file, not this one
            if not dry_run:
                os.unlink(path)  # (under the lock: a run that starts now makes a new file)
            out["removed"].append((path, st.st_blocks * 512))
        except OSError as exc:
            out["skipped"].append((path, exc.strerror or str(exc)))
        finally:
            os.close(fd)


def _only_files(path: str) -> int:
    """Bytes of the library's files in ``path``; OSError naming any other entry (what
    remove_private_dir would refuse before removing anything)."""
    from offload.swap import fsutil

    total = 0
    for name in os.listdir(path):
        st = os.lstat(os.path.join(path, name))
        fsutil.check_own_entry(path, name, st)
        total += st.st_blocks * 512
    return total


def remove_run_dir(path: str, lock: Any, dir_id: Tuple[int, int], parent: str, step: int, *, held: bool) -> None:
    """A store's ``close()``: its directory removed (``fsutil.remove_private_dir``), or the
    reason it stays. Gone already, replaced, or holding an entry of someone else's: a warning
    (kept whole, as ``offload clean`` keeps it). A removal the file system refused (a disk
    gone read-only, EIO) raises with the whole path, the file it stopped at, and what is
    left: a directory whose files are all there still holds step ``step`` (``held``: committed,
    resumable), one it got partway through holds nothing to resume."""
    import errno

    from offload.swap import fsutil

    try:
        before: Optional[set] = set(os.listdir(path))
    except OSError:
        before = None
    try:
        fsutil.remove_private_dir(path, lock=lock, expect=dir_id)
        return
    except FileNotFoundError:
        log.warning("%s: swap directory already removed by someone else", path)
        return
    except fsutil.NotOurs as exc:
        log.warning("%s: %s", path, exc.strerror)
        return
    except OSError as exc:
        if exc.errno == errno.EEXIST:  # someone put a foreign entry into our private directory
            log.warning("%s: kept (%s: %s); remove that entry, then `offload clean %s`",
                        path, exc.strerror, exc.filename, parent)
            return
        failed = exc
    try:
        whole = before is not None and before <= set(os.listdir(path))
    except OSError:
        whole = False
    if whole:
        left = f"it is kept whole at step {step}, resumable with resume=True" if held else \
            "it is kept (never committed: nothing to resume)"
    else:
        left = "part of its files are gone: nothing to resume from it"
    what = f" ({failed.filename})" if failed.filename and failed.filename != path else ""
    raise OSError(failed.errno, f"could not remove the swap directory: {failed.strerror}{what}; {left}; "
                  f"`offload clean {parent}` removes it once its file system takes writes again", path) from failed
