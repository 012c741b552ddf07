"""The param tier's directories (tier.py [Note: the param tier]): the lock a live process holds on
its own, and the sweep of those left by processes that died without closing."""
from __future__ import annotations

import fcntl
import logging
import os
import re

from offload.io.files import open_regular
from offload.swap import fsutil

__all__ = ["lock_dir", "remove_orphans"]

log = logging.getLogger("offload.shard")

_DIR_RE = re.compile(r"^offload-params\.(\d+)(-\d+)?\.rank\d+$")


def remove_orphans(parent: str) -> None:
    """The directories of processes that died without closing (kill -9; their lock is free):
    nothing in them is ever read again (the params' truth is the optimizer's), so they go."""
    for name in os.listdir(parent):
        m = _DIR_RE.match(name)
        if m is None or fsutil.pid_alive(int(m.group(1))):
            continue  # a live process's (another rank's may not hold its lock yet: made, then locked)
        path = os.path.join(parent, name)
        try:
            fsutil.check_private_dir(path)
            fd, _pid = fsutil.try_lock(path, grace=False)  # (its maker's pid is gone: no grace)
            if fd is None and _pid is not None:
                continue  # in use
            try:
                fsutil.remove_private_dir(path)
            finally:
                if fd is not None:
                    os.close(fd)
            log.info("removed %s, left by a process that is gone", path)
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)


def lock_dir(path: str) -> int:
    """The directory's lock, held while this process uses it (``offload clean`` and the next
    run leave a held one alone). A FIFO or a directory in its place (in a directory of this
    pid left by another pid namespace's process) is refused naming it, as ``fsutil.Lock``
    refuses one; a plain ``os.open`` took a FIFO as the lock."""
    fd = open_regular(os.path.join(path, fsutil.LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, "cannot open the lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, str(os.getpid()).encode())
    except BaseException:
        os.close(fd)
        raise
    return fd
