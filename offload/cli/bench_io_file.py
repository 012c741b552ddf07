"""The test file of an ``offload bench-io`` run: made locked, filled with random data, then
removed or kept (``--keep``).

[Note: the test file while it runs] offload-bench-io.<pid>.dat, flock-ed while open: two runs
in one directory keep apart, and ``offload clean`` removes what a kill -9 left
(offload/swap/cleanup.py). --keep renames it to DATA_NAME.

[Note: --keep never replaces a file] DATA_NAME is an ordinary name a user may have given a
file of their own; --keep replaced whatever had that name with the test file (the user's data
lost, silently). Nothing on disk says which run made a file there (a kept file is random data
that later runs' write passes rewrote), so an existing DATA_NAME, ours or not, is refused before
the sweep, and the rename at the end is a hard link, which never replaces: a file given that
name during the sweep stays, and the test file is kept under its running name instead.
"""
from __future__ import annotations

import os
import sys

from .bench_io_output import Progress, _human

__all__ = ["DATA_NAME", "RUNNING_NAME", "create_data_file", "kept_name_problem", "remove_data_file"]

DATA_NAME = "offload-bench-io.dat"
RUNNING_NAME = "offload-bench-io.{pid}.dat"


def kept_name_problem(directory: str) -> "str | None":
    """Why ``--keep`` could not rename the test file to DATA_NAME in ``directory`` (checked
    before the sweep, not after it: a rename failing at the end lost the whole run's
    results), or None."""
    kept = os.path.join(directory, DATA_NAME)
    if os.path.isdir(kept) and not os.path.islink(kept):
        return f"--keep: {kept} is a directory; the test file could not be kept under that name"
    if os.path.lexists(kept):  # [Note: --keep never replaces a file]
        return (f"--keep: {kept} exists (a file kept by an earlier run, or someone else's) and is not replaced; "
                "remove it or pick another --dir")
    return None


def locked_new_file(path: str, direct: bool, open_file):
    """``path`` created afresh and flock-ed ([Note: the test file while it runs]). A file is
    unlocked between its creation and its lock: an ``offload clean`` of that moment may
    remove it (it takes an unlocked test file for a killed run's), and the run would go on
    over an unlinked file, its --keep rename failing at the end. So the lock waits for a
    clean that holds the file, and then the name must still be this file; else it is made
    again."""
    import fcntl

    for _ in range(5):
        if os.path.lexists(path):
            os.unlink(path)
        f = open_file(path, write=True, create=True, exclusive=True, direct=direct)
        try:
            fcntl.flock(f.fd, fcntl.LOCK_EX)
            mine = os.fstat(f.fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
        except BaseException:
            f.close()
            raise
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return f
        f.close()  # removed by a clean in between: make it again
    raise OSError(f"{path}: removed again and again as it was created (an `offload clean` loop over this directory?)")


def create_data_file(path: str, size: int, direct: bool, pool, progress: Progress):
    """A fresh file of random bytes (not zeros: compressing or deduplicating devices would lie)."""
    import torch

    from offload.io import IORequest, open_engine, open_file

    f = locked_new_file(path, direct, open_file)
    try:
        f.preallocate(size)  # ENOSPC now, not half-way
        chunk = 8 << 20
        gen = torch.Generator().manual_seed(size)
        bufs = [pool.acquire(chunk) for _ in range(4)]
        try:
            with open_engine("threads", queue_depth=8, block_size=1 << 20) as eng:
                progress.step(f"creating {_human(size)} test file of random data")
                off = 0
                while off < size:
                    reqs = []
                    for b in bufs:
                        if off >= size:
                            break
                        n = min(chunk, size - off)
                        b.tensor(torch.int64).random_(generator=gen)
                        reqs.append(IORequest("write", f, off, b[0:n]))
                        off += n
                    eng.wait(eng.submit(reqs))
                    progress.advance(sum(len(r.buf) for r in reqs))
            f.fsync()
        finally:
            for b in bufs:
                pool.release(b)
    except BaseException:
        f.close()
        raise
    return f


def _keep(path: str) -> str:
    """The test file at ``path`` renamed to DATA_NAME without replacing a file of that name
    ([Note: --keep never replaces a file]); returns where it is now."""
    import errno

    kept = os.path.join(os.path.dirname(path), DATA_NAME)
    try:
        os.link(path, kept)  # fails with EEXIST where rename would replace
    except FileExistsError:
        return _not_replaced(kept, path)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
            raise
        # a file system without hard links (vfat, some FUSE): checked, then renamed
        if os.path.lexists(kept):
            return _not_replaced(kept, path)
        os.rename(path, kept)
        return kept
    os.unlink(path)
    return kept


def _not_replaced(kept: str, path: str) -> str:
    print(f"offload bench-io: warning: {kept} appeared during the run and is not replaced; "
          f"the test file is kept as {path}", file=sys.stderr)
    return path


def remove_data_file(f, path: str, keep: bool) -> str:
    """Close the test file (its lock goes with it) and remove it, or with ``keep`` rename it
    to DATA_NAME; returns where it is now."""
    if keep and not os.path.exists(path):
        print(f"offload bench-io: warning: {path} is gone (removed by another process?): nothing kept",
              file=sys.stderr)
    if keep and os.path.exists(path):
        path = _keep(path)  # (while still locked: clean never sees it unlocked under the old name)
    if f is not None:
        f.close()
    if not keep and os.path.exists(path):
        os.unlink(path)
    return path
