"""Which file system holds a path, and refusing those that hold no data files.

A swap or checkpoint directory under /proc, /sys or a cgroup mount passed the checks of a
directory (it exists, it is one, ``access`` says writable to root) and then failed at its
first ``mkdir`` or write with a bare errno: "No such file or directory: '/proc/offload-run.rank0'",
"Operation not permitted", or, on cgroup2, a ``mkdir`` that *succeeds* and makes a control
group, whose files refuse data. These are refused up front, naming the file system.
"""
from __future__ import annotations

import errno
import os

__all__ = ["filesystem_type", "PSEUDO_FILE_SYSTEMS", "refuse_pseudo"]

# Kernel interfaces mounted as file systems: their files are not storage. (tmpfs and ramfs
# hold files, in RAM: allowed, with the O_DIRECT fallback's warning.)
PSEUDO_FILE_SYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs", "pstore",
    "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "binfmt_misc", "autofs", "efivarfs", "nsfs",
})


def _unescape(field: str) -> str:
    """A path of /proc/self/mounts: space, tab, newline and backslash are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_type(path: str) -> str:
    """File system type of the mount holding ``path`` (from /proc/self/mounts; "" if unknown)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = _unescape(fields[1])
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, fields[2]
    except OSError:
        return ""
    return fstype


def refuse_pseudo(path: str, what: str = "swap_dir") -> None:
    """OSError (EINVAL) when ``path`` is on a kernel interface file system (module docstring)."""
    fstype = filesystem_type(path)
    if fstype in PSEUDO_FILE_SYSTEMS:
        raise OSError(errno.EINVAL, f"{what} is on a {fstype} file system (a kernel interface, which holds "
                      "no data files): give a directory on a local disk", path)
