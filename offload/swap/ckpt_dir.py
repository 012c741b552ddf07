"""The directory side of a checkpoint: its lock, and a save's files from start to clean-up.

A checkpoint is often saved into a directory that holds other things (HF's ``checkpoint-N/``
with the model's own ``*.bin``), so a save touches only files that are unmistakably its own:
every name starts with ``offload-ckpt.`` and a file is removed only when a record of ours names
it (the manifest, for the previous generation; ``offload-ckpt.pending.json``, written before a
save creates anything, for what a save that died half-way left). No name pattern decides.

[Note: checkpoint lock] A save holds an exclusive ``flock`` on ``DIR/offload-ckpt.lock`` from
before it reads the manifest until its clean-up is done; a load holds a shared one while it
reads. Another process meeting the lock gets :class:`CheckpointBusy` naming the holder's pid.
The per-rank shards of one job live in ``DIR/rank<r>/``, each with its own lock, so the ranks
of one job save together while a second job saving into the same DIR is refused.
"""
from __future__ import annotations

import errno
import fcntl
import os
from typing import Any, Dict, List, Optional, Union

from offload.io.files import open_regular
from offload.kernels.fields import StateField
from offload.swap import fsutil
from offload.swap.ckpt_schema import check_checkpoint_manifest, check_steps_cover

__all__ = ["remove_quiet", "CKPT_FORMAT", "CKPT_VERSION", "CKPT_MANIFEST", "CKPT_LOCK", "CKPT_PENDING", "CheckpointBusy",
           "DirLock", "NewGeneration", "manifest_path", "read_manifest", "manifest_dtypes", "manifest_fields", "manifest_file_bytes",
           "retire_single_directory", "check_covers"]

CKPT_FORMAT = "offload-ckpt"
CKPT_VERSION = 1
CKPT_MANIFEST = "offload-ckpt.json"
CKPT_LOCK = "offload-ckpt.lock"
CKPT_PENDING = "offload-ckpt.pending.json"
PREFIX = "offload-ckpt."


def manifest_fields(m: Dict[str, Any]) -> Dict[str, StateField]:
    """Each state's typed field in manifest ``m``: its ``fields`` (name, dtype, block), or in
    a manifest of an older release its dtypes."""
    if isinstance(m.get("fields"), list):
        return {str(d["name"]): StateField.from_description(d) for d in m["fields"]}
    return {k: StateField.from_description({"name": k, "dtype": d}) for k, d in manifest_dtypes(m).items()}


def manifest_dtypes(m: Dict[str, Any]) -> Dict[str, str]:
    """Each state's dtype name in manifest ``m`` (a manifest of the first release has one
    ``dtype``, float32, for every state)."""
    dtypes = m.get("dtypes")
    if isinstance(dtypes, dict):
        return {str(k): str(v) for k, v in dtypes.items()}
    return {str(k): str(m.get("dtype")) for k in m.get("states") or []}


def manifest_file_bytes(m: Dict[str, Any], name: str) -> int:
    """Bytes the manifest says the file of state ``name`` has (one figure, or one per state)."""
    fb = m.get("file_bytes")
    return int(fb[name] if isinstance(fb, dict) else fb)


def check_covers(meta: Dict[str, Any], shapes: List[Any], directory: str) -> None:
    """ValueError unless checkpoint ``directory``'s ``meta`` is of params of ``shapes``, with
    one step count each: checked before a load changes anything."""
    if meta.get("shapes") != shapes:
        raise ValueError(f"{directory}: checkpoint of params with other shapes")
    check_steps_cover(meta, len(shapes), manifest_path(directory))


def manifest_path(directory: str) -> str:
    """The manifest a load of checkpoint ``directory`` reads first: rank 0's, or the previous
    release's single-directory one."""
    ranked = os.path.join(directory, "rank0", CKPT_MANIFEST)
    return ranked if os.path.lexists(ranked) else os.path.join(directory, CKPT_MANIFEST)


def read_manifest(directory: str, advice: str = fsutil.LOAD_ADVICE) -> Dict[str, Any]:
    path = os.path.join(directory, CKPT_MANIFEST)
    try:
        m = fsutil.unsealed(fsutil.read_json(path), path, advice)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no offload checkpoint here (manifest missing)", path) from None
    except NotADirectoryError:
        raise fsutil.not_a_checkpoint_dir(directory, "load") from None
    if not isinstance(m, dict) or m.get("format") != CKPT_FORMAT:
        raise ValueError(f"{path}: not an offload checkpoint manifest")
    if m.get("version") != CKPT_VERSION:
        raise ValueError(f"{path}: checkpoint format version {m.get('version')!r}, this offload reads {CKPT_VERSION}")
    check_checkpoint_manifest(m, path)
    # Only names of ours: a save removes the files its previous manifest names (finish()), so
    # a damaged 'files' naming "model.bin" would have the next save delete the user's file.
    files = m.get("files")
    if not isinstance(files, dict) or not all(n in files and _ours(n, files[n], m["gen"]) for n in m["states"]) \
            or len(files) != len(m["states"]):
        raise ValueError(f"{path}: the manifest's 'files' is not a map of each state to a file name of ours "
                         f"({PREFIX}<state>.<gen>.bin) in this directory, got {files!r:.120}")
    return m


def _ours(state: str, name: object, gen: int) -> bool:
    """Whether ``name`` is the file name a save of generation ``gen`` gives ``state``'s file
    (the first release's, without the prefix, too)."""
    return isinstance(name, str) and name in (f"{PREFIX}{state}.{gen}.bin", f"{state}.{gen}.bin")


class CheckpointBusy(BlockingIOError):
    """Another process saves into (or loads from) the checkpoint directory; ``pid``: who."""

    def __init__(self, msg: str, path: str, pid: Optional[int]) -> None:
        super().__init__(errno.EWOULDBLOCK, msg, path)
        self.pid = pid


class DirLock:
    """``flock`` on ``DIR/offload-ckpt.lock``: exclusive for a save, shared for a load (see
    [Note: checkpoint lock]). Never blocks. The file stays: removing a lock file others may
    have open would let two holders lock two different files."""

    def __init__(self, directory: str, *, exclusive: bool) -> None:
        self.path = os.path.join(directory, CKPT_LOCK)
        self.fd = -1
        if not exclusive and not any(os.path.lexists(os.path.join(directory, n)) for n in (CKPT_MANIFEST, CKPT_LOCK)):
            return  # no checkpoint here: the load's own error says so, without a lock file left behind
        try:
            self.fd = open_regular(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                   "cannot open the checkpoint's lock")
        except OSError as exc:
            if exclusive or exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise
            return  # a read-only checkpoint: nobody can save into it while we read
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(self.fd, 64, 0).decode("ascii", "replace").split()
            self.release()
            pid = int(text[0]) if text and text[0].isdigit() else None
            what = text[1] if len(text) > 1 and pid is not None else "save or load"
            who = f"process {pid} (a {what})" if pid is not None else "another process"
            raise CheckpointBusy(f"checkpoint directory is in use by {who}, which holds its lock {CKPT_LOCK}; "
                                 "save each checkpoint from one job at a time, or into another directory",
                                 directory, pid) from None
        try:
            os.ftruncate(self.fd, 0)  # for the message of whoever meets the lock next
            os.pwrite(self.fd, f"{os.getpid()} {'save' if exclusive else 'load'}\n".encode(), 0)
        except OSError as exc:  # (EIO, ENOSPC) held on, every later save or load here was "busy"
            self.release()
            raise OSError(exc.errno, f"cannot write this process's pid into the lock: {exc.strerror}",
                          self.path) from exc

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def remove_quiet(path: str) -> bool:
    """Unlink ``path``; True when it is gone (or was never there), False on another error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


class NewGeneration:
    """One save's files, from the lock to the clean-up.

    ``open()`` takes the lock, finishes what an interrupted save left (by its pending record),
    checks the space, and records the files this save will create before creating any.
    ``tmps[k]`` is where state ``k`` goes; ``publish()`` renames them to their final names
    (still invisible: the manifest names the old ones); ``commit()`` replaces the manifest;
    ``abort()`` puts the previous manifest back if this save's was already in place, and
    removes this save's files; ``finish()`` removes the previous generation and the record,
    and releases the lock.
    """

    def __init__(self, directory: str, names: List[str], per_file: Union[int, Dict[str, int]]) -> None:
        self.directory = os.path.abspath(directory)
        self.names = list(names)
        # bytes of each state's file (padded); one figure for all when every state has one dtype
        self.per_file = per_file if isinstance(per_file, dict) else {k: int(per_file) for k in self.names}
        self.need = sum(self.per_file.values())
        self.lock: Optional[DirLock] = None
        self.old: Optional[Dict[str, Any]] = None
        self.gen = 0
        self.finals: Dict[str, str] = {}
        self.tmps: Dict[str, str] = {}
        self.recorded = False  # our pending record is written: abort() may remove it

    def open(self) -> "NewGeneration":
        fsutil.make_checkpoint_dir(self.directory)
        self.lock = DirLock(self.directory, exclusive=True)
        exists = os.path.lexists(os.path.join(self.directory, CKPT_MANIFEST))
        self.old = read_manifest(self.directory, fsutil.SAVE_ADVICE) if exists else None
        self._finish_interrupted()
        self.gen = int(self.old["gen"]) + 1 if self.old else 1
        free = fsutil.free_bytes(self.directory)
        if free < self.need:
            raise OSError(errno.ENOSPC, f"checkpoint needs {self.need} bytes ({self.need / 2**30:.2f} GiB) in this "
                          f"directory, {free} free; the previous checkpoint is untouched", self.directory)
        self.finals = {k: f"{PREFIX}{k}.{self.gen}.bin" for k in self.names}
        self.tmps = {k: os.path.join(self.directory, f".{self.finals[k]}.tmp") for k in self.names}
        for name in list(self.finals.values()) + [os.path.basename(t) for t in self.tmps.values()]:
            if os.path.lexists(os.path.join(self.directory, name)):
                raise FileExistsError(errno.EEXIST, "a file of this name is in the way of the checkpoint and is not "
                                      "ours (no record of ours names it): move it away", self._path(name))
        fsutil.write_json_atomic(self.directory, CKPT_PENDING, {
            "gen": self.gen, "files": sorted(self.finals.values()) + sorted(map(os.path.basename, self.tmps.values())),
            "old": sorted(self._old_files())})
        self.recorded = True
        return self

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _old_files(self) -> List[str]:
        return list(self.old["files"].values()) if self.old else []

    def _finish_interrupted(self) -> None:
        """A save that died left its pending record: remove what it names that the current
        manifest does not (its new files before its commit, the old ones after)."""
        try:
            rec = fsutil.read_json(self._path(CKPT_PENDING))
        except (FileNotFoundError, ValueError):
            return
        if not isinstance(rec, dict):
            return
        keep = set(self._old_files())
        for name in list(rec.get("files") or []) + list(rec.get("old") or []):
            if isinstance(name, str) and os.path.basename(name) == name and name not in keep:
                remove_quiet(self._path(name))

    def preallocate(self, f: Any, name: str) -> None:
        try:
            f.preallocate(self.per_file[name])
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(exc.errno, f"checkpoint needs {self.need} bytes in this directory and the file "
                              "system ran out; the previous checkpoint is untouched", self.directory) from exc
            raise

    def publish(self) -> None:
        for k in self.names:
            os.rename(self.tmps[k], self._path(self.finals[k]))
        fsutil.fsync_dir(self.directory)

    def commit(self, *, dtypes: Dict[str, str], numel: int, crcs: Dict[str, int], meta: Dict[str, Any],
               fields: Optional[Dict[str, StateField]] = None) -> None:
        """Replace the manifest. ``dtypes``: each state's element type; ``dtype`` and an int
        ``file_bytes`` say it once when all states share it (as the first format did, so
        that release still reads an fp32 checkpoint), else "mixed" and a map per state;
        ``fields`` lists each state's ``StateField.describe()`` in file order (name, dtype,
        and for packed 8-bit blocks the block and code), from ``fields`` where given."""
        one = len(set(dtypes.values())) == 1 and len(set(self.per_file.values())) == 1
        fsutil.write_json_atomic(self.directory, CKPT_MANIFEST, fsutil.sealed({
            "format": CKPT_FORMAT, "version": CKPT_VERSION,
            "dtype": next(iter(dtypes.values())) if one else "mixed", "dtypes": dict(dtypes), "numel": numel,
            "states": self.names,
            "fields": [fields[k].describe() if fields and k in fields else {"name": k, "dtype": dtypes[k]}
                       for k in self.names], "gen": self.gen, "files": self.finals,
            "file_bytes": next(iter(self.per_file.values())) if one else dict(self.per_file),
            "crc32": dict(crcs), "meta": meta}))

    def _pointed(self) -> bool:
        try:
            return int(read_manifest(self.directory)["gen"]) == self.gen
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def abort(self) -> None:
        """Back to the previous checkpoint; raises (saying what DIR holds) only if that fails."""
        if not self.recorded:  # failed before creating anything (the lock may be another's)
            self.release()
            return
        if self._pointed():
            try:
                if self.old is not None:
                    fsutil.write_json_atomic(self.directory, CKPT_MANIFEST, fsutil.sealed(self.old))
                else:
                    os.unlink(self._path(CKPT_MANIFEST))
                    try:
                        fsutil.fsync_dir(self.directory)
                    except OSError as exc:  # gone for every reader: as below
                        raise fsutil.ReplacedNotDurable(exc.errno or errno.EIO, str(exc), self.directory) from exc
            except fsutil.ReplacedNotDurable:
                # The previous manifest is back for every reader, its directory unsynced: a
                # power cut may still bring this save's back, so its files stay (the pending
                # record names them: the next save removes them).
                self.release()
                return
            except OSError as exc:
                self.release()
                raise OSError(exc.errno, f"the save failed after its manifest was written, and putting the previous "
                              f"one back failed too ({exc.strerror or exc}): this directory holds the new checkpoint "
                              "where the others (ranks) may hold the old one; save again", self.directory) from exc
        if all([remove_quiet(p) for k in self.names for p in (self.tmps[k], self._path(self.finals[k]))]):
            remove_quiet(self._path(CKPT_PENDING))
        self.release()

    def finish(self) -> str:
        """After the commit: the previous generation goes (a file that cannot be removed stays
        named in the pending record, for the next save), then the lock."""
        ok = all([remove_quiet(self._path(name)) for name in self._old_files() if name not in self.finals.values()])
        if ok:
            remove_quiet(self._path(CKPT_PENDING))
        self.release()
        return self.directory

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def retire_single_directory(directory: str) -> None:
    """After a save into ``DIR/rank<r>/``: the previous release's single-directory checkpoint
    in ``DIR`` (its manifest and the files it names; nothing else) goes, under the lock.
    Its files first, its manifest last: a crash between leaves a manifest that no load reads
    (``rank0/`` comes first) and the next save removes."""
    directory = os.path.abspath(directory)
    if not os.path.lexists(os.path.join(directory, CKPT_MANIFEST)):
        return
    try:
        lock = DirLock(directory, exclusive=True)
    except CheckpointBusy:
        return  # a load reads it now: the next save retires it
    with lock:
        try:
            old = read_manifest(directory)
        except (OSError, ValueError):
            return  # not ours to remove
        if all([remove_quiet(os.path.join(directory, name)) for name in old["files"].values()]):
            remove_quiet(os.path.join(directory, CKPT_MANIFEST))
            fsutil.fsync_dir(directory)
