"""Hints for an I/O error on a file system gone read-only under the swap files."""
from __future__ import annotations

import errno
import os
from typing import Optional

__all__ = ["read_only_now"]


def read_only_now(path: str, err: Optional[int]) -> str:
    """A hint for the I/O error ``err`` in ``path``: when its file system is read-only now
    (the kernel makes ext4 so on a disk error, ``errors=remount-ro``, or after aborting its
    journal; on recent kernels without a remount, "emergency_ro", which statvfs does not show:
    the EROFS tells), what that means for the user; else ''."""
    try:
        if err != errno.EROFS and not os.statvfs(path).f_flag & os.ST_RDONLY:
            return ""
    except OSError:
        return ""
    return (f" [the file system of {path} is read-only now: the kernel turns a file system so after a disk "
            "error or an aborted journal (see dmesg); the swap files keep their last committed step: repair the "
            "file system (unmount, fsck, mount read-write) before resume=True]")
