"""The room kept for a swap store's manifest on a full disk.

[Note: manifest reserve] The slot files are preallocated, so a full disk cannot stop a step's
data writes; the manifest, though, is a new file at each commit (tmp + rename). On a full
disk that commit failed, and on several ranks the undo of the others' commits (a manifest
write too) could fail the same way. So each store keeps ``reserve.bin``, a preallocated file
of at least twice the largest manifest it wrote (1 MiB at least): a manifest write that hits
ENOSPC or EDQUOT deletes it, syncs the directory (ext4 reuses freed blocks only once the
unlink is committed) and writes again, with a warning; the next commits take back what room
there is (the old manifest's, at least), so on a full disk training goes on: the data needs
no new space (except on a copy-on-write file system, btrfs or ZFS, where overwriting the
preallocated slots allocates: there a full disk still fails the step, undone as any I/O
error). ``SwapStore.disk_bytes`` does not count it (metadata, as the manifest and the lock).

Here: ``drop`` gives the room up, ``keep`` takes back what room there is.
"""
from __future__ import annotations

import logging
import os

from offload.io.files import NotRegularFile, open_regular
from offload.swap import fsutil

__all__ = ["ManifestReserve", "RESERVE", "RESERVE_ROOM"]

log = logging.getLogger(__name__)

RESERVE = "reserve.bin"
_RESERVE_MIN = 1 << 20
RESERVE_ROOM = _RESERVE_MIN + (64 << 10)
"""What a new swap directory needs besides its slot files (checked with them before any is
made): the reserve's least size, and the first manifest with its temporary file."""


class ManifestReserve:
    """``reserve.bin`` of the swap directory ``path``, and whether a full disk was reported."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.bytes = 0  # what reserve.bin is known to hold
        self.warned = False  # no room to keep it: said once
        self.full_warned = False  # a manifest went into it: said once until one fits without it

    def keep(self, manifest_bytes: int, *, strict: bool = False) -> None:
        """Make reserve.bin hold at least twice ``manifest_bytes`` (whatever fits, warning once).
        ``strict`` (a resume): a reserve.bin that is no regular file (a FIFO, which blocked the
        open forever) is refused, naming it; at a commit, past the manifest's rename, it is
        only said (raising there would undo a step that is on disk)."""
        want = max(_RESERVE_MIN, -(-2 * manifest_bytes // _RESERVE_MIN) * _RESERVE_MIN)
        if self.bytes >= want:
            return
        try:
            fd = open_regular(os.path.join(self.path, RESERVE), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, "cannot keep the manifest's reserve")
            try:
                os.posix_fallocate(fd, 0, want)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno is None or (strict and isinstance(exc, NotRegularFile)):
                raise  # errno None: not the system's (a signal handler's TimeoutError), never "no room"
            # Whatever it could allocate stays: the next full-disk commit can still use it.
            if not self.warned:
                self.warned = True
                log.warning("%s: cannot keep %d bytes in reserve for the manifest (%s)", self.path, want,
                            exc.strerror or exc)
            return
        self.bytes = want
        self.warned = False  # (full_warned stays: a disk that frees exactly the reserve's room each
        # step, as ext4 without reserved clusters does, would say "full" at every step)

    def drop(self) -> bool:
        """Give the room up (False: there was none); the directory is synced, as ext4 reuses
        freed blocks only once the unlink is committed."""
        try:
            os.unlink(os.path.join(self.path, RESERVE))
        except FileNotFoundError:
            return False
        self.bytes = 0
        fsutil.fsync_dir(self.path)
        return True
