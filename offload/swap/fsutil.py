"""Small, careful file-system helpers for the swap store: private directories, locks, atomic JSON.

Everything here handles *metadata* (directories, the lock file, the small JSON manifest);
the bulk data goes through :mod:`offload.io`. Every failure is an ``OSError(errno, msg, path)``.

[Note: planted symlinks] Swap directories often live under shared places (``/var/tmp``, a
scratch disk). Whatever we create we create with ``O_EXCL | O_NOFOLLOW`` (files) or ``mkdir``
(which never follows), and an existing private directory is accepted only after ``lstat``
says it is a real directory owned by us with mode 0700. Inside a 0700 directory nobody else
can plant anything, so the files below it are safe once the directory is.

[Note: sealed manifests] A checkpoint manifest carries its own crc32 (``SEAL``, of its
other content in the canonical form ``write_json_atomic`` writes), written with it and
checked as it is read: ``write_json_atomic(d, name, sealed(m))`` and
``unsealed(read_json(path), path)`` (not a flag of those two, which tests wrap to inject
faults). The data files have their crc32s in the manifest; the manifest itself (``steps``,
``param_groups``' lr, shapes) had none, so a flipped digit there loaded silently. A
manifest without ``SEAL`` (an older release's) loads as it is; a reader of an older
release ignores the key. The swap store's own manifest (``manifest.json``: which slot holds
each sub-group, the step) is sealed the same way since it names the data a resume reads.
A damaged seal *key* must not pass for "no seal": one flipped bit in ``"manifest_crc32"``
made the manifest an older release's, unchecked, so a second damaged byte (a step count)
loaded silently. No older release wrote a key that close to ``SEAL``, so a manifest without
``SEAL`` but with such a key is refused as damaged.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import time
import zlib
from typing import Any, Dict, Optional, Tuple

from offload.io.files import open_regular
from offload.swap.fstype import refuse_pseudo
from offload.swap.sigint import removal_held

__all__ = [
    "check_parent_dir", "make_private_dir", "check_private_dir", "Lock", "lock_holder",
    "write_json_atomic", "ReplacedNotDurable", "read_json", "SEAL", "sealed", "unsealed", "LOAD_ADVICE", "SAVE_ADVICE", "RESUME_ADVICE", "fsync_dir", "remove_private_dir", "free_bytes",
    "make_checkpoint_dir", "not_a_checkpoint_dir",
    "DirectoryBusy", "NotOurs", "private_dir_name", "pid_alive",
]

LOCK_NAME = "lock"
DIR_PREFIX = "offload-"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def private_dir_name(run_name: str, rank: int) -> str:
    """The name of run ``run_name``'s private swap directory for ``rank``."""
    if not _NAME_RE.match(run_name) or run_name.startswith("."):
        raise ValueError(f"run_name must be 1-64 characters of [A-Za-z0-9_.-], got {run_name!r}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return f"{DIR_PREFIX}{run_name}.rank{rank}"
SEAL = "manifest_crc32"
"""The key of a manifest's own crc32 ([Note: sealed manifests])."""


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _content_crc(obj: Dict[str, Any]) -> int:
    """crc32 of ``obj`` less its seal, as read back: through one JSON round trip, where int
    keys become strings (and so sort otherwise), so writer and reader hash the same bytes."""
    body = {k: v for k, v in obj.items() if k != SEAL}
    return zlib.crc32(_dumps(json.loads(_dumps(body))))


def sealed(obj: Any) -> Any:
    """``obj`` (a manifest) with its own crc32, for ``write_json_atomic``."""
    if not isinstance(obj, dict):
        raise TypeError(f"a sealed manifest is a JSON object, got {type(obj).__name__}")
    return dict({k: v for k, v in obj.items() if k != SEAL}, **{SEAL: _content_crc(obj)})


LOAD_ADVICE = "nothing was loaded (restore it, or load an older checkpoint)"
# a swap store's manifest that fails its seal names slots and a step nobody can trust
RESUME_ADVICE = ("nothing was resumed; restore the optimizer from a checkpoint (resume='discard' starts "
                 "this swap directory afresh) or clean it (`offload clean`)")
SAVE_ADVICE = ("nothing was saved: a save reads the manifest it replaces (its generation, the files it retires); "
               "move the damaged checkpoint away or save into another directory")


def _near_seal(key: Any) -> bool:
    """``key`` is ``SEAL`` with a few characters changed (a damaged seal, not an older manifest)."""
    return (isinstance(key, str) and len(key) == len(SEAL)
            and sum(a != b for a, b in zip(key, SEAL)) <= 3)


def unsealed(obj: Any, path: str, advice: str = LOAD_ADVICE) -> Any:
    """``obj`` (as ``read_json(path)`` read it) less its seal, checked; as it is without one
    (an older release's manifest). ``advice``: what the caller did not do, and what to do."""
    if not isinstance(obj, dict):
        return obj
    if SEAL not in obj:
        near = [k for k in obj if _near_seal(k)]
        if near:
            raise ValueError(f"{path}: the manifest has no {SEAL} but a key {near[0]!r} close to it: its seal "
                             f"was damaged after it was written, so its content cannot be trusted; {advice}")
        return obj
    want, got = obj.pop(SEAL), _content_crc(obj)
    if want != got:
        raise ValueError(f"{path}: the manifest fails its own checksum ({SEAL} {want!r}, its content {got}): "
                         f"it was changed or damaged after it was written; {advice}")
    return obj


def check_parent_dir(path: str) -> str:
    """``path`` must exist, be a directory and be writable; returns its absolute path."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "swap_dir does not exist (create it on a local disk first)", path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "swap_dir is not a directory", path)
    refuse_pseudo(path)  # /proc, /sys, cgroup: "writable" to root, no files (swap/fstype.py)
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, "swap_dir is on a read-only file system", path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "swap_dir is not writable by this user", path)
    return path


def check_private_dir(path: str) -> os.stat_result:
    """Accept ``path`` only if it is a real (not symlinked) directory, ours, mode 0700."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "swap directory does not exist", path) from None
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "refusing a symlink where a private swap directory should be", path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "expected a private swap directory, found another kind of file", path)
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"swap directory belongs to uid {st.st_uid}, not to us ({os.geteuid()})", path)
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise PermissionError(errno.EPERM, f"swap directory has mode {stat.S_IMODE(st.st_mode):o}, expected 700", path)
    return st


def make_private_dir(path: str) -> bool:
    """Create ``path`` with mode 0700 (``mkdir`` never follows symlinks). Returns False if it
    already existed (and passed :func:`check_private_dir`), True if we created it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        check_private_dir(path)
        return False
    os.chmod(path, 0o700, follow_symlinks=False)  # umask may have cleared bits we asked for
    check_private_dir(path)
    return True


def not_a_checkpoint_dir(directory: str, doing: str) -> NotADirectoryError:
    """The error for a checkpoint ``directory`` that is a file or lies under one (``doing``:
    "save" or "load"), naming that file."""
    path = os.path.abspath(os.fspath(directory))
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    then = "the path of a directory, new or existing" if doing == "save" else "the directory it was saved into"
    return NotADirectoryError(errno.ENOTDIR, f"cannot {doing} a checkpoint there: this path is a file, and a "
                              f"checkpoint is a directory (offload writes its manifest and state files into it); pass "
                              f"{then}", path)


def make_checkpoint_dir(directory: str) -> None:
    """``directory`` and its parents made (0700) for a checkpoint's save, or refused by name
    where it is a file or lies under one (a bare "File exists" before), or on a kernel
    interface file system (swap/fstype.py: under /proc a bare ENOENT; on cgroup2 the mkdir
    made a control group)."""
    refuse_pseudo(directory, "checkpoint directory")  # (by its mount: it need not exist yet)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise not_a_checkpoint_dir(directory, "save") from None


def fsync_dir(path: str) -> None:
    """Make a rename/creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    except OSError as exc:  # fsync's own error names no file
        raise OSError(exc.errno, f"syncing the directory failed: {exc.strerror}", path) from exc
    finally:
        os.close(fd)


def lock_holder(lock_path: str) -> Optional[int]:
    """The pid written in a lock file, or None when unreadable."""
    try:
        fd = open_regular(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


class DirectoryBusy(BlockingIOError):
    """The swap directory's lock is held; ``pid`` is the holder (None if unknown)."""

    def __init__(self, err: int, msg: str, path: str, pid: Optional[int]) -> None:
        super().__init__(err, msg, path)
        self.pid = pid


class Lock:
    """An exclusive ``flock`` on ``DIR/lock`` holding our pid.

    ``flock`` locks die with the process, so a directory left by ``kill -9`` has a free lock:
    that is how a stale directory is told from a live one. The pid inside is only for the
    message; the lock itself is the truth.
    """

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_NAME)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = open_regular(self.path, flags, 0o600, "cannot open the lock")
        try:
            _flock_briefly(self.fd, self.path)
        except BlockingIOError:
            holder = lock_holder(self.path)
            os.close(self.fd)
            self.fd = -1
            who = f"process {holder}" if holder is not None else "another process"
            raise DirectoryBusy(errno.EWOULDBLOCK, f"swap directory is in use by {who} (its flock is held); "
                                "each run and rank needs its own directory", directory, holder) from None
        if not _names_this_file(self.path, self.fd):
            self.release()  # [Note: a directory being made]
            raise FileNotFoundError(errno.ENOENT, "the swap directory's lock file was removed while this process "
                                    "took it (an `offload clean` of the same directory at that moment?); "
                                    "nothing was written: try again", directory)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1


CREATION_GRACE_S = 60.0
"""A directory without its lock, or with an empty lock file, this young is being made."""


def try_lock(directory: str, grace: bool = True) -> Tuple[Optional[int], Optional[int]]:
    """(fd holding the lock, None) when the lock of ``directory`` is free, else (None, pid);
    pid -1: held, its pid not written yet, or the directory being made; (None, None): no lock
    file in a directory older than that, a creation that died before locking.

    [Note: a directory being made] A store makes its directory, then the lock file, then
    takes the flock and writes its pid: for a moment the directory has no lock, or a free and
    empty one. A clean or a resume that took that for a dead run's would remove the directory
    under its maker. So a directory in that state is taken for one in use while it is younger
    than ``CREATION_GRACE_S`` (a maker that died there leaves it to a later clean); the maker
    waits a moment for a lock a probe holds (``_flock_briefly``), and then checks that the
    lock file it holds is still the one in the directory (``_names_this_file``).
    ``grace=False``: a caller that knows the maker is gone (the param tier's directories name
    their pid) takes such a directory at once."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = open_regular(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, "cannot open the lock")
    except FileNotFoundError:
        return (None, -1) if grace and _young(directory) else (None, None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, (lock_holder(path) or -1)  # held; -1: its pid is not written yet
    if grace and os.fstat(fd).st_size == 0 and _young(path):
        os.close(fd)
        return None, -1  # made, not locked yet
    return fd, None


def _young(path: str) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime < CREATION_GRACE_S
    except OSError:
        return False


def _flock_briefly(fd: int, path: str) -> None:
    """flock ``fd``, waiting up to half a second while the holder has written no pid: a
    clean's probe (``try_lock``) holds it that long at most. A holder with a pid: at once."""
    deadline = time.monotonic() + 0.5
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if lock_holder(path) is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _names_this_file(path: str, fd: int) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (not removed, not replaced)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


class ReplacedNotDurable(OSError):
    """``write_json_atomic`` failed after its rename: the new content is in place (every reader
    sees it) but may not survive a power cut.

    [Note: a manifest replaced, not synced] A swap commit whose manifest was renamed into place
    but whose directory fsync failed (EIO) used to keep that manifest while the step's error
    said the files hold the previous step: a resume then took the failed step as done (bf16
    params: applied twice once the loop retried it), and a retry wrote into the slots the new
    manifest names. ``SwapStore.commit`` puts the previous manifest back; where that fails too,
    the store writes no more until it is reopened, and its error names the step on disk."""


def write_json_atomic(directory: str, name: str, obj: Any) -> int:
    """Write ``directory/name`` so that a reader sees the old or the new content, never a mix:
    a temporary file (O_EXCL, O_NOFOLLOW, 0600), fsync, rename over, fsync of the directory.
    Returns the bytes written; a failure after the rename is :class:`ReplacedNotDurable`."""
    data = _dumps(obj) + b"\n"
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    _drop_stale_tmp(directory, name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        os.unlink(tmp)
        raise OSError(exc.errno, f"writing {len(data)} bytes of metadata failed: {exc.strerror}", tmp) from exc
    os.close(fd)
    os.rename(tmp, final)
    try:
        fsync_dir(directory)
    except OSError as exc:
        # Past the rename every reader sees the new content: a caller that treats this like
        # a failure before it must first put the old content back (SwapStore.commit does).
        err = exc.errno or errno.EIO
        raise ReplacedNotDurable(err, f"{name} was replaced, but syncing its directory failed: {os.strerror(err)}",
                                 directory) from exc
    return len(data)


def _drop_stale_tmp(directory: str, name: str) -> None:
    """Remove the temporary files of ``name`` that a process killed in write_json_atomic left:
    this pid's (pid reuse after a crash) and those of pids that no longer run."""
    prefix = f".{name}.tmp-"
    for entry in os.listdir(directory):
        pid = entry[len(prefix):]
        if entry.startswith(prefix) and pid.isdigit() and (int(pid) == os.getpid() or not pid_alive(int(pid))):
            try:
                os.unlink(os.path.join(directory, entry))
            except FileNotFoundError:
                pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs here: this one, or another that a signal 0 reaches (one
    we may not signal runs too)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def read_json(path: str) -> Any:
    fd = open_regular(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, "cannot read")
    try:
        chunks = []
        while True:
            try:
                b = os.read(fd, 1 << 20)
            except OSError as exc:  # os.read names no file (EISDIR: a directory where the manifest was)
                raise OSError(exc.errno, exc.strerror, path) from None
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(fd)
    try:
        return json.loads(b"".join(chunks))
    except ValueError as exc:
        raise ValueError(f"{path}: not a valid manifest ({exc})") from None


def free_bytes(path: str) -> float:
    """Bytes available to us; ``inf`` where the file system reports no size (ramfs)."""
    st = os.statvfs(path)
    if st.f_blocks == 0:
        return float("inf")
    return st.f_bavail * st.f_frsize


# Every file the library writes into a private directory: the swap store's (store.py: the
# lock, two slot files, the manifest and its reserve) and the stage-3 param tier's
# (shard/tier.py: areas.bin), plus write_json_atomic's temporary names. Anything else was put
# there by someone else, and a directory holding it is kept whole.
OWN_FILES = frozenset({LOCK_NAME, "slot0.bin", "slot1.bin", "manifest.json", "reserve.bin", "areas.bin"})
_OWN_TMP = re.compile(r"^\.[A-Za-z0-9_.-]+\.tmp-[0-9]+$")


def own_file(name: str) -> bool:
    """Whether ``name`` in a private directory is one of the library's own files."""
    return name in OWN_FILES or _OWN_TMP.match(name) is not None


def check_own_entry(path: str, name: str, st: os.stat_result) -> None:
    """OSError (EEXIST) naming the entry unless it is one of the library's own files."""
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EEXIST, "unexpected non-file entry in a swap directory; removed nothing",
                      os.path.join(path, name))
    if not own_file(name):
        raise OSError(errno.EEXIST, "a file the library did not write is in this swap directory; removed "
                      "nothing", os.path.join(path, name))


class NotOurs(OSError):
    """The path no longer names the directory we locked (removed, and maybe made again by
    another process): nothing of it may be removed."""


def remove_private_dir(path: str, *, lock: Optional[Lock] = None, expect: Optional[Tuple[int, int]] = None) -> int:
    """Remove the files of private directory ``path``, then the directory; returns the bytes
    freed. Only the library's own files (``OWN_FILES``) directly inside are removed (the
    directory is 0700 and holds nothing else): any other entry is reported before anything is
    removed, so a refused directory is left whole. The lock file goes last so the directory stays claimed
    meanwhile. ``expect``: the (st_dev, st_ino) the directory had when ``lock`` was taken;
    with ``lock`` too, its lock file must still be the one ``lock`` holds (else NotOurs)."""
    st = check_private_dir(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if expect is not None:
            _check_ours(path, fd, lock, expect)
        entries = []
        for name in sorted(os.listdir(fd), key=lambda n: n == LOCK_NAME):
            est = os.lstat(name, dir_fd=fd)
            check_own_entry(path, name, est)
            entries.append((name, est.st_blocks * 512))
        with removal_held():  # whole or gone: [Note: a removal is whole] in sigint.py
            for name, _ in entries:
                os.unlink(name, dir_fd=fd)
            os.close(fd)
            fd = -1
            if lock is not None:
                lock.release()
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise NotOurs(errno.ESTALE, "swap directory was replaced while it was being removed; left it", path)
            os.rmdir(path)
    finally:
        if fd >= 0:
            os.close(fd)
    return sum(n for _, n in entries)


def _check_ours(path: str, fd: int, lock: Optional[Lock], expect: Tuple[int, int]) -> None:
    st = os.fstat(fd)
    mine = (st.st_dev, st.st_ino) == tuple(expect)
    if mine and lock is not None and lock.fd >= 0:
        try:
            lst = os.lstat(LOCK_NAME, dir_fd=fd)
        except FileNotFoundError:
            mine = False
        else:
            held = os.fstat(lock.fd)
            mine = (lst.st_dev, lst.st_ino) == (held.st_dev, held.st_ino)
    if not mine:
        raise NotOurs(errno.ESTALE, "the path no longer names the swap directory this process locked "
                      "(it was removed, and maybe made again by another process); not removing it", path)
