"""Opening swap files: O_DIRECT where the file system allows it, clear errors where it does not.

[Note: O_DIRECT] Direct I/O bypasses the page cache: a hot cached read at 5.7 GB/s would fake a
fast disk, and buffered writes ran at 0.49 GB/s with 99 % system CPU on our machines. It needs
offset, length and buffer address on 4 KiB (we use 4096, the largest logical block size in
practice, rather than asking statx). ramfs, tmpfs before Linux 6.6 and some network file
systems refuse it (tmpfs accepts it since 6.6).

We open *without* O_DIRECT first and then switch it on with ``fcntl(F_SETFL)``: a refusal
then leaves exactly one file, created once, with O_EXCL semantics intact (opening with
``O_CREAT | O_DIRECT`` on tmpfs creates the file *and* fails, so a retry with O_EXCL would
see its own file).

A request that is not 4 KiB-aligned (the tail of a file whose size is not a multiple of 4 KiB,
the rest of a short transfer) goes through ``IOFile.buffered_fd``, a second descriptor of the
same file without O_DIRECT; the kernel keeps direct and buffered accesses to one file coherent
(direct I/O writes back and invalidates cached pages of its range).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import tempfile
import threading
from typing import Dict, Optional, Tuple

__all__ = ["ALIGN", "IOFile", "NotRegularFile", "open_file", "open_regular", "probe_direct"]

log = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of offset, length and buffer address that O_DIRECT requests need."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _oserror(err: int, msg: str, path: str) -> OSError:
    return OSError(err, f"{msg}: {os.strerror(err)}", path)


class NotRegularFile(OSError):
    """A path that names a FIFO, a directory, a socket or a device where a file should be."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class _DirectoryHere(NotRegularFile, IsADirectoryError):
    """(an ``IsADirectoryError`` too, as the read of a directory raised before)"""


def _not_regular(mode: int, what: str, path: str) -> NotRegularFile:
    kind = next((name for test, name in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):#o}")
    if stat.S_ISDIR(mode):
        return _DirectoryHere(errno.EISDIR, f"{what}: not a regular file ({kind})", path)
    return NotRegularFile(errno.EINVAL, f"{what}: not a regular file ({kind})", path)


def open_regular(path: str, flags: int, mode: int = 0o600, what: str = "open") -> int:
    """``os.open(path, flags, mode)`` that refuses anything but a regular file, without blocking.

    [Note: a FIFO where a file was] Opening a FIFO for reading (or writing) blocks until a
    writer (a reader) comes: a FIFO put in place of a manifest, a checkpoint's data file or a
    swap directory's ``reserve.bin`` hung a load or a resume forever. So the file is opened
    with O_NONBLOCK, checked with ``fstat`` (no race: it is the file we hold) and only then
    made blocking again. A FIFO opened write-only without a reader fails with ENXIO at once
    (so does a socket): that one is told by ``lstat``. Refusals are :class:`NotRegularFile`
    (an ``IsADirectoryError`` too for a directory, else EINVAL) naming the path; other errors are ``os.open``'s.
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            try:
                st = os.lstat(path)
            except OSError:
                raise exc from None
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(st.st_mode, what, path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode, what, path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


class IOFile:
    """An open file for the engines: ``fd``, ``path``, ``direct`` (O_DIRECT actually in use)."""

    def __init__(self, fd: int, path: str, *, direct: bool, writable: bool) -> None:
        self.fd = fd
        self.path = path
        self.direct = direct
        self.writable = writable
        self._buffered_fd: Optional[int] = None
        self._lock = threading.Lock()

    def fileno(self) -> int:
        self._check_open()
        return self.fd

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def _check_open(self) -> None:
        if self.fd < 0:
            raise OSError(errno.EBADF, "I/O on a closed IOFile", self.path)

    @property
    def buffered_fd(self) -> int:
        """A descriptor of the same file without O_DIRECT, for unaligned pieces.

        Opened on first use through ``/proc/self/fd`` (so a renamed or unlinked file still
        works) and closed with the file. Equal to ``fd`` when the file is not direct.
        """
        self._check_open()
        if not self.direct:
            return self.fd
        with self._lock:
            if self._buffered_fd is None:
                flags = (os.O_RDWR if self.writable else os.O_RDONLY) | os.O_CLOEXEC
                try:
                    os.fstat(self.fd)
                    self._buffered_fd = os.open(f"/proc/self/fd/{self.fd}", flags)
                except OSError as exc:
                    raise _oserror(exc.errno or errno.EBADF, "cannot open a buffered descriptor for unaligned I/O",
                                   self.path) from None
            return self._buffered_fd

    @property
    def size(self) -> int:
        """Current size in bytes (``fstat``)."""
        self._check_open()
        return os.fstat(self.fd).st_size

    def preallocate(self, nbytes: int) -> None:
        """Reserve ``nbytes`` of disk blocks now (``posix_fallocate``).

        Writing into allocated blocks ran 2-3x faster than into a fresh file on our disks, and
        ENOSPC shows up here, at set-up, not in the middle of a training step.
        """
        self._check_open()
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as exc:
            raise _oserror(exc.errno or errno.EIO, f"cannot preallocate {nbytes} bytes", self.path) from None

    def truncate(self, nbytes: int) -> None:
        """Set the file size to ``nbytes``."""
        self._check_open()
        try:
            os.ftruncate(self.fd, nbytes)
        except OSError as exc:
            raise _oserror(exc.errno or errno.EIO, f"cannot truncate to {nbytes} bytes", self.path) from None

    def fsync(self) -> None:
        """Flush file data and metadata to the device (O_DIRECT skips the cache, not the disk's)."""
        self._check_open()
        for fd in {self.fd, self._buffered_fd} - {None}:
            try:
                os.fsync(fd)
            except OSError as exc:
                raise _oserror(exc.errno or errno.EIO, "fsync failed", self.path) from None

    def close(self) -> None:
        """Close both descriptors. Idempotent."""
        with self._lock:
            if self._buffered_fd is not None and self._buffered_fd != self.fd:
                os.close(self._buffered_fd)
            self._buffered_fd = None
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)

    def __enter__(self) -> "IOFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"IOFile({self.path!r}, fd={self.fd}, direct={self.direct}, writable={self.writable})"


_warned_dirs: set = set()


def open_file(path: "str | os.PathLike[str]", *, write: bool = False, create: bool = False,
              exclusive: bool = False, direct: Optional[bool] = None, mode: int = 0o600,
              nofollow: bool = True) -> IOFile:
    """Open ``path`` for the io engines.

    ``write``: read-write (else read-only). ``create``: create if missing (needs ``write``);
    ``exclusive``: fail with EEXIST if it exists (O_EXCL, needs ``create``). ``direct``: True
    O_DIRECT or ``OSError(EINVAL)``; False buffered; None O_DIRECT if the file system allows
    it, else buffered with a logged warning (once per directory). ``nofollow``: refuse a
    symlink as the last component (O_NOFOLLOW), so a swap path cannot be redirected.
    Errors are ``OSError(errno, message, path)``.
    """
    path = os.fspath(path)
    if create and not write:
        raise ValueError("open_file(create=True) needs write=True")
    if exclusive and not create:
        raise ValueError("open_file(exclusive=True) needs create=True")
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT
    if exclusive:
        flags |= os.O_EXCL
    if nofollow:
        flags |= os.O_NOFOLLOW
    what = "open for writing" if write else "open for reading"
    try:
        fd = open_regular(path, flags, mode, what)
    except NotRegularFile:
        raise
    except OSError as exc:
        if exc.errno is None:
            raise  # not the system's: a signal handler's TimeoutError, say (was taken for EIO)
        err = exc.errno
        msg = what
        if err == errno.ELOOP and nofollow:
            msg = f"{what} (it is a symbolic link, refused with nofollow=True)"
        raise _oserror(err, msg, path) from None
    use_direct = False
    if direct is not False:
        if not _O_DIRECT:
            err = errno.EINVAL
        else:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
                use_direct = True
                err = 0
            except OSError as exc:
                err = exc.errno or errno.EINVAL
        if not use_direct:
            if direct:
                os.close(fd)
                raise _oserror(err, "O_DIRECT refused by the file system (use direct=None or False to "
                                    "allow buffered I/O)", path)
            directory = os.path.dirname(os.path.abspath(path))
            if directory not in _warned_dirs:
                _warned_dirs.add(directory)
                log.warning("O_DIRECT refused in %s (%s); using buffered I/O there, which goes "
                            "through the page cache", directory, os.strerror(err))
    return IOFile(fd, path, direct=use_direct, writable=write)


_probe_cache: Dict[Tuple[int, int], Tuple[bool, str]] = {}


def probe_direct(directory: "str | os.PathLike[str]", *, refresh: bool = False) -> Tuple[bool, str]:
    """Can files in ``directory`` be opened with O_DIRECT? -> ``(ok, reason)``.

    Creates and removes an unnamed temporary file there (missing directories raise ``OSError``
    with the path). A directory that takes no new file (a read-only mount, another user's
    checkpoint: EROFS, EACCES, EPERM) is probed on a regular file it holds, opened read-only,
    so that reading a checkpoint never needs write access; without one, the ``OSError`` is
    raised. Cached per file system (device, inode of the directory).
    """
    directory = os.fspath(directory)
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise _oserror(exc.errno or errno.ENOENT, "cannot use directory", directory) from None
    key = (st.st_dev, st.st_ino)
    if not refresh and key in _probe_cache:
        return _probe_cache[key]
    try:
        fd, tmp = tempfile.mkstemp(prefix=".offload-probe-", dir=directory)
    except OSError as exc:
        fd = _existing_file(directory) if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else -1
        if fd < 0:
            raise _oserror(exc.errno or errno.EACCES, "cannot create a file in directory", directory) from None
        tmp = None
    try:
        if tmp is not None:
            os.unlink(tmp)
        if not _O_DIRECT:
            result = (False, "this platform has no O_DIRECT")
        else:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
                result = (True, "O_DIRECT accepted")
            except OSError as exc:
                result = (False, f"O_DIRECT refused ({os.strerror(exc.errno or errno.EINVAL)}), "
                                 "the file system does not support direct I/O (e.g. ramfs, tmpfs before "
                                 "Linux 6.6, some network file systems)")
    finally:
        os.close(fd)
    _probe_cache[key] = result
    return result


def _existing_file(directory: str) -> int:
    """A read-only descriptor of a regular file directly in ``directory`` (not a link), or -1."""
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    try:
                        return os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                    except OSError:
                        continue
    except OSError:
        pass
    return -1
