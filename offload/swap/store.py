"""The swap store: one private, locked directory per run and rank holding the states of a
:class:`~offload.swap.layout.SwapLayout` in two slot files and a manifest.

Directory ``SWAP_DIR/offload-<run>.rank<r>/`` (mode 0700)::

    lock            flock'ed while a process uses the directory; holds its pid
    slot0.bin       preallocated region file (0600, O_EXCL|O_NOFOLLOW)
    slot1.bin       the second slot
    manifest.json   written atomically (tmp + fsync + rename + fsync dir)
    reserve.bin     preallocated room for the manifest on a full disk (see the note below)

[Note: two slots] Each sub-group lives in one slot at a time (``manifest.slots[g]``). A step
reads ``g`` from its slot and writes the updated states into the *other* slot; only after all
writes of the step are durable (``fdatasync`` of the files written) does the manifest flip the
slots and advance ``step``. A ``kill -9`` at any moment therefore leaves the manifest describing
the last finished step, whose data nobody has overwritten since.

[Note: syncing the written slots] Each fdatasync costs the disk a cache flush (1-4 ms on the
virtio disks measured, bench/RESULTS.md), whether the file was written or not. A step usually
writes one slot file only (every sub-group flips each step, so all of them live in the same
slot), so ``sync`` fdatasyncs the files that ``write_requests`` handed out requests for since
their last successful fdatasync, and no other: each write is made durable by the first commit
after it, which is all a commit needs (data of earlier commits was synced by them).

A full disk: [Note: manifest reserve] in swap/reserve.py.

Nothing here knows optimizer math; ``extra`` is an opaque JSON dict the user of the store
commits together with each step (the optimizer keeps per-param step counts and a parameter
fingerprint there).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set

from offload.io import IORequest, open_file
from offload.io.auto import resolve_engine
from offload.swap import cleanup, fsutil
from offload.swap.in_flight import StepsInFlight
from offload.kernels.fields import field_names
from offload.swap.layout import SwapLayout
from offload.swap.own_dir import SWAP_FORMAT
from offload.swap.reserve import RESERVE, RESERVE_ROOM, ManifestReserve
from offload.swap.sigint import sigint_held
from offload.swap.manifest_check import (VERIFY_BLOCK, block_checksums, check_codes, check_group_sums, check_manifest,
                                         previous_commit, previous_json)

__all__ = ["SwapStore", "FORMAT", "FORMAT_VERSION", "VERIFY_BLOCK", "resolve_engine"]

log = logging.getLogger(__name__)

FORMAT = SWAP_FORMAT  # what `offload clean` looks for: [Note: a directory clean may remove]
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SLOT_FILES = ("slot0.bin", "slot1.bin")


class SwapStore:
    """Own the private directory, its lock, slot files and manifest.

    ``resume=False`` creates the directory (one left by a dead run is refused, or removed with
    ``discard_stale``; one a live process locks is never touched); ``resume=True`` opens it and
    checks that its manifest describes the same layout."""

    def __init__(self, swap_dir: str, layout: SwapLayout, *, state_names: Sequence[str],
                 run_name: str = "run", rank: int = 0, verify: bool = False, resume: bool = False,
                 io_engine: Any = None, direct: Optional[bool] = None,
                 identity: Optional[Dict[str, Any]] = None, discard_stale: bool = False) -> None:
        self.layout = layout
        self.fields = layout.named(state_names)  # names (fp32) or typed fields, one per state of the layout
        self.state_names = list(field_names(self.fields))
        self.verify = bool(verify)
        self.run_name = run_name
        self.rank = int(rank)
        self.identity = identity  # {"digest", "summary"} of the params (offload.swap.runs), or None
        self.resumed = bool(resume)  # whether the states come from an earlier run (resume="auto" decides late)
        self._discard_stale = bool(discard_stale) and not resume
        self.parent = fsutil.check_parent_dir(swap_dir)
        self.path = os.path.join(self.parent, fsutil.private_dir_name(run_name, self.rank))
        self._lock: Optional[fsutil.Lock] = None
        self.owner_pid = os.getpid()  # only this process may remove the directory ([Note: fork] in cleanup)
        self._dir_id: Optional[tuple] = None  # (st_dev, st_ino) of the directory we locked
        self.files: List[Any] = []
        self.engine = None
        self._owns_engine = False
        self._closed = self._closing = False  # closing: no new step starts, those in flight finish
        self._close_lock = threading.Lock()
        self.in_flight = StepsInFlight()
        self._token: Optional[int] = None
        self.pending_error: Optional[BaseException] = None
        self._reserve = ManifestReserve(self.path)  # [Note: manifest reserve] in reserve.py
        self.diverged: Optional[str] = None  # what the files hold after a failed _put_back
        # slot files written since their last fdatasync ([Note: syncing the written slots])
        self._unsynced: Set[int] = set()
        # The commit before the last while its data is still in the free slots, in each
        # manifest ([Note: a rank one step ahead] in agreement.py); None once a write went there.
        self._before_commit: Optional[tuple] = None
        try:
            self._open(resume, io_engine, direct)
        except BaseException:
            self._abandon()
            raise
        self._token = cleanup.register(self)
        from offload.memory import default_accounting

        self._acct_owner = f"swap:{self.path}"
        default_accounting().add("nvme", self._acct_owner, self.disk_bytes())

    # ------------------------------------------------------------------ opening
    def _open(self, resume: bool, io_engine: Any, direct: Optional[bool]) -> None:
        created = fsutil.make_private_dir(self.path)
        if resume and created:
            os.rmdir(self.path)
            raise FileNotFoundError(errno.ENOENT, "resume=True but there is no swap directory to resume from", self.path)
        self._lock = fsutil.Lock(self.path)  # refuses a directory in use, naming the pid
        self._created = created
        manifest_path = os.path.join(self.path, MANIFEST)
        if not created and not resume:
            self._replace_left_over(manifest_path)
        st = os.lstat(self.path)
        self._dir_id = (st.st_dev, st.st_ino)
        if resume:
            self._load_manifest(manifest_path)
            self._reserve.keep(os.path.getsize(manifest_path), strict=True)  # an older offload's has none
        self.engine, self._owns_engine = resolve_engine(io_engine, self.path)
        if direct is None and getattr(io_engine, "direct", None) is not None and hasattr(io_engine, "engine"):
            direct = io_engine.direct  # an IOConfig that says how to open files
        if resume:
            self._open_slot_files(create=False, direct=direct)
        else:
            self._open_slot_files(create=True, direct=direct)
            self.step = 0
            self.slots = [0] * self.layout.num_groups
            self.valid = [False] * self.layout.num_groups
            self.checksums: Dict[int, List[List[int]]] = {}
            self.extra: Dict[str, Any] = {}
            # The preallocated files' sizes and extents are durable before any manifest names
            # them: a power cut between the two must not leave a manifest whose files look
            # truncated ("step 0 lost" on resume, when nothing was held).
            self.sync()
            self._write_manifest()

    def _replace_left_over(self, manifest_path: str) -> None:
        """A directory left by a dead process (we hold its lock): refused if it holds a step
        (unless ``discard_stale``), else removed (half-made, or stale) and made again."""
        if os.path.lexists(manifest_path):
            try:
                step = fsutil.read_json(manifest_path).get("step", "?")
            except (OSError, ValueError, AttributeError):
                step = "?"
            if not self._discard_stale:
                raise FileExistsError(
                    errno.EEXIST, f"swap directory holds step {step} left by an earlier run whose process is gone; "
                    "pass resume=True to continue from it, resume='discard' to remove it and start afresh (a "
                    f"restart whose checkpoint restores the optimizer), or run `offload clean {self.parent}`",
                    self.path)
            log.warning("%s: removed the swap directory (step %s) left by an earlier run whose process is gone "
                        "(resume='discard'); starting afresh", self.path, step)
        fsutil.remove_private_dir(self.path, lock=self._lock)
        fsutil.make_private_dir(self.path)
        self._lock = fsutil.Lock(self.path)
        self._created = True

    def _open_slot_files(self, *, create: bool, direct: Optional[bool]) -> None:
        need = self.layout.file_bytes
        if create:
            # both slots, and the first manifest with the room kept for later ones (reserve.py):
            # short of those, the manifest's own write failed, naming a temporary file
            total = 2 * need + RESERVE_ROOM
            free = fsutil.free_bytes(self.path)
            if free < total:
                raise OSError(errno.ENOSPC, f"swap files need {total} bytes ({total / 2**30:.2f} GiB: two slots "
                              f"of {need} and {RESERVE_ROOM} for the manifest) but the file system has "
                              f"{free:.0f} free", self.path)
        for name in SLOT_FILES:
            full = os.path.join(self.path, name)
            try:
                f = open_file(full, write=True, create=create, exclusive=create, direct=direct, mode=0o600,
                              nofollow=True)
            except FileNotFoundError:
                if create:
                    raise
                # deleted since the commit being resumed
                raise FileNotFoundError(errno.ENOENT, self._lost_states("swap file missing"), full) from None
            self.files.append(f)
            if create:
                try:
                    f.preallocate(need)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise OSError(exc.errno, f"no space to preallocate swap file of {need} bytes "
                                      f"({2 * need} needed for both slots)", self.path) from exc
                    raise
                self._unsynced.add(len(self.files) - 1)  # its size and extents: synced before the first manifest
            elif f.size < need:
                raise ValueError(f"{full}: " + self._lost_states(f"swap file truncated to {f.size} of {need} bytes"))
            elif f.size > need:  # (preallocated to exactly the layout's size: another run's file, larger)
                raise ValueError(f"{full}: swap file of {f.size} bytes, expected {need}: not this run's")
        if direct is None and not all(f.direct for f in self.files):
            warnings.warn(f"swap directory {self.path} does not support O_DIRECT (tmpfs?): using buffered I/O "
                          "with fdatasync at the end of each step; the page cache will hold a copy of the states",
                          RuntimeWarning, stacklevel=4)

    def _lost_states(self, what: str) -> str:
        return (f"{what}: the states of step {self.step} it held are lost, nothing to resume; load a checkpoint "
                f"into a new run, or `offload clean {self.parent}` and start again")

    def _load_manifest(self, path: str) -> None:
        try:
            m = fsutil.unsealed(fsutil.read_json(path), path, fsutil.RESUME_ADVICE)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "swap directory has no manifest: nothing to resume", path) from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ValueError(f"{path}: not an offload swap manifest")
        if m.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: swap format version {m.get('version')!r}, this offload reads {FORMAT_VERSION}; "
                             "clean the directory (`offload clean`) and start again")
        check_manifest(m, path, nstates=self.layout.nstates, verify_block=VERIFY_BLOCK,
                       fields=self.fields)
        found = m.get("identity")
        if self.identity is not None and found is not None and found["digest"] != self.identity["digest"]:
            raise ValueError(f"{path}: swap directory holds the states of other params ({found.get('summary')}; "
                             f"this optimizer has {self.identity['summary']})")
        check_codes(m, path, self.fields)  # (fills in the typed keys older manifests lack)
        # (the states first: an Adam built without amsgrad on an amsgrad run's files is told which differ)
        expect = {"run": self.run_name, "rank": self.rank, "states": self.state_names, "dtype": self.layout.dtype_name,
                  "dtypes": self.layout.dtype_names, "blocks": [f.block for f in self.fields],
                  "numel": self.layout.numel,
                  "sub_group_size": self.layout.sub_group_size, "ranges": self.layout.ranges()}
        for key, want in expect.items():
            if m.get(key) != want:
                got = m.get(key)
                if key == "ranges":
                    got, want = f"{len(got or [])} sub-groups", f"{len(want)} sub-groups"
                raise ValueError(f"{path}: swap directory belongs to another run or layout: {key} is {got!r}, "
                                 f"expected {want!r}")
        if bool(m.get("verify")) != self.verify and self.verify:
            log.warning("%s was written without checksums; verify=True starts checking after the next write", path)
        self.step = m["step"]
        self.slots = list(m["slots"])
        self.valid = list(m["valid"])
        self.checksums = {int(k): v for k, v in (m.get("checksums") or {}).items()}
        self.extra = dict(m["extra"])
        self._before_commit = previous_commit(m)
        if self.identity is None:
            self.identity = found  # keep it in the next manifests

    def _write_manifest(self) -> None:
        m = {
            "format": FORMAT, "version": FORMAT_VERSION, "run": self.run_name, "rank": self.rank,
            "pid": os.getpid(), "dtype": self.layout.dtype_name, "dtypes": self.layout.dtype_names,
            "numel": self.layout.numel, "states": self.state_names, "sub_group_size": self.layout.sub_group_size,
            "ranges": self.layout.ranges(), "region_bytes": self.layout.region_bytes,
            "files": list(SLOT_FILES), "step": self.step, "slots": self.slots, "valid": self.valid,
            "verify": self.verify, "verify_block": VERIFY_BLOCK,
            "checksums": {str(k): v for k, v in self.checksums.items()} if self.verify else None,
            "extra": self.extra, **({"identity": self.identity} if self.identity is not None else {}),
            **({"previous": previous_json(self._before_commit, self.verify, self.extra)} if self._before_commit else {}),
            # packed int8 blocks ([Note: block-wise 8-bit states] in kernels/quant.py); absent: none
            **({"blocks": [f.block for f in self.fields], "codes": [f.code for f in self.fields]}
               if any(f.blocked for f in self.fields) else {}),
        }
        try:
            n = fsutil.write_json_atomic(self.path, MANIFEST, fsutil.sealed(m))
            self._reserve.full_warned = False  # a manifest fits without the reserve: the disk has room again
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._reserve.drop():
                raise
            n = fsutil.write_json_atomic(self.path, MANIFEST, fsutil.sealed(m))
            if not self._reserve.full_warned:  # once until a manifest fits without it again
                self._reserve.full_warned = True
                log.warning("%s: the file system is full: the manifest of step %d went into the room kept in %s "
                            "(training goes on: the preallocated swap files need no new space, except on a "
                            "copy-on-write file system; checkpoints on this disk fail until space is freed)",
                            self.path, self.step, RESERVE)
        self._reserve.keep(n)

    # ------------------------------------------------------------------ requests
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"swap store {self.path} is closed")

    def _requests(self, op: str, slot: int, g: int, buf: Any) -> List[Any]:
        nbytes = self.layout.group_bytes(g)
        view = buf.memoryview if hasattr(buf, "memoryview") else buf
        if op == "write":  # before the write can be issued: the next sync must cover it
            self._unsynced.add(slot)
        return [IORequest(op=op, file=self.files[slot], offset=self.layout.group_offset(g), buf=view[:nbytes])]

    def read_requests(self, g: int, buf: Any) -> List[Any]:
        """Requests that read sub-group ``g``'s committed states into ``buf``; ``[]`` when
        ``g`` was never written (its states are zeros: fill the buffer instead of reading)."""
        self._check_open()
        if not self.valid[g]:
            return []
        return self._requests("read", self.slots[g], g, buf)

    def write_requests(self, g: int, buf: Any) -> List[Any]:
        """Requests that write ``buf`` into the slot of ``g`` that the manifest does *not* use."""
        self._check_open()
        if self.diverged:  # that slot may be the one the manifest on disk uses
            raise OSError(errno.EIO, self.diverged, self.path)
        self._before_commit = None  # its data may be overwritten from now on
        return self._requests("write", 1 - self.slots[g], g, buf)

    def read_back_requests(self, g: int, buf: Any) -> List[Any]:
        """Requests that read back what ``write_requests`` wrote (``g``'s free slot), before
        any commit names it."""
        self._check_open()
        return self._requests("read", 1 - self.slots[g], g, buf)

    def held(self) -> str:
        """What the swap files hold, for an error after a failed step: the last finished step,
        or, when a slot file lost bytes since it was made (truncated), that its data is gone."""
        if self.diverged:
            return self.diverged
        for f in self.files:
            try:
                size = f.size
            except OSError as exc:
                return f"the swap file {f.path} cannot be examined ({exc.strerror or exc})"
            if size < self.layout.file_bytes:
                return (f"the swap file {f.path} was truncated to {size} of {self.layout.file_bytes} bytes: the "
                        f"states of step {self.step} in it are lost; load a checkpoint (load_checkpoint()) or "
                        f"remove the directory (close(), or `offload clean {self.parent}`) and start again")
        return f"the swap files still hold step {self.step}"

    def read_slot_file(self, g: int) -> str:
        return self.files[self.slots[g]].path

    # ------------------------------------------------------------------ checksums
    def checksum(self, g: int, buf: Any) -> List[List[int]]:
        """Per-state, per-block crc32 of the states of ``g`` held in ``buf``."""
        view = buf.memoryview if hasattr(buf, "memoryview") else buf
        return [block_checksums(view[off:off + used], used) for off, used, _ in self.layout.state_spans(g)]

    def check(self, g: int, buf: Any) -> None:
        """With ``verify``: compare ``buf`` (just read) with the committed checksums of ``g``."""
        if not self.verify or not self.valid[g] or g not in self.checksums:
            return
        check_group_sums(self.checksum(g, buf), self.checksums[g], g=g, step=self.step, names=self.state_names,
                         base=self.layout.group_offset(g), spans=self.layout.state_spans(g), path=self.read_slot_file(g))

    # ------------------------------------------------------------------ commit
    def sync(self) -> None:
        """fdatasync the slot files written since their last sync: every completed write is
        durable (the first half of commit; [Note: syncing the written slots]). A file whose
        sync fails stays to be synced."""
        self._check_open()
        for slot in sorted(self._unsynced):
            self.files[slot].fsync()
            self._unsynced.discard(slot)

    def commit(self, written: Dict[int, Optional[List[List[int]]]], extra: Optional[Dict[str, Any]] = None,
               *, advance: bool = True, synced: bool = False) -> None:
        """Make the writes of ``written`` (g -> checksums or None) the new consistent state:
        fdatasync the slot files written, flip the slots of those groups, advance ``step`` (when
        ``advance``) and replace the manifest atomically. The caller must have waited for
        every write to complete. ``synced``: the caller ran :meth:`sync` after the last write."""
        self._check_open()
        if not synced:
            self.sync()
        slots, valid, checksums, step = list(self.slots), list(self.valid), dict(self.checksums), self.step
        for g, sums in written.items():
            self.slots[g] = 1 - self.slots[g]
            self.valid[g] = True
            if self.verify and sums is not None:
                self.checksums[g] = sums
            else:
                self.checksums.pop(g, None)
        if advance:
            self.step += 1
        old_extra, old_before = self.extra, self._before_commit
        if extra is not None:
            self.extra = extra
        self._before_commit = (slots, valid, checksums, step, old_extra)
        try:
            self._write_manifest()
        except BaseException as exc:
            self.slots, self.valid, self.checksums, self.step, self.extra = slots, valid, checksums, step, old_extra
            self._before_commit = old_before
            if isinstance(exc, fsutil.ReplacedNotDurable):
                self._put_back(f"step {step + 1}" if advance else f"the failed commit's states (step {step} too)")
            raise

    def _put_back(self, failed: str) -> None:
        """Put the previous manifest back after a commit left ``failed`` on disk unsynced ([Note:
        a manifest replaced, not synced] in fsutil.py); where that fails too, write no more."""
        try:
            self._write_manifest()
        except fsutil.ReplacedNotDurable:
            return  # the previous manifest is back in place: what every reader sees
        except OSError as again:  # the caller raises exc; held() says this
            self.diverged = (f"putting back the manifest of step {self.step} failed too ({again.strerror or again}): "
                             f"the swap files hold {failed}; this store writes no more: "
                             "close(keep_swap=True) and resume=True from there")

    def undo_commit(self) -> None:
        """Go back to the state before the last :meth:`commit` (its data is still in the
        other slots: nothing has written there since) and rewrite the manifest. For several
        ranks, when another rank could not commit the same step, or at resume, when the others
        hold the step before ([Note: a rank one step ahead] in agreement.py)."""
        self._check_open()
        before = self._before_commit
        if before is None:
            raise RuntimeError(f"{self.path}: no commit to undo")
        now = (self.slots, self.valid, self.checksums, self.step, self.extra)
        self.slots, self.valid, self.checksums, self.step, self.extra = before
        self._before_commit = None
        try:
            self._write_manifest()
        except fsutil.ReplacedNotDurable:
            raise  # the undone manifest is in place: so it stays here too
        except BaseException:
            self.slots, self.valid, self.checksums, self.step, self.extra = now
            self._before_commit = before
            raise

    @property
    def previous_step(self) -> Optional[int]:
        """The step of the commit before the last while the free slots still hold its data
        (nothing was written there since), else None: what :meth:`undo_commit` goes back to."""
        return None if self._before_commit is None else self._before_commit[3]

    # ------------------------------------------------------------------ closing
    def disk_bytes(self) -> int:
        return 2 * self.layout.file_bytes

    def _abandon(self) -> None:
        """Undo a failed open: remove what we created, release what we hold."""
        self._close_files()
        if self._lock is not None and self._lock.fd >= 0:
            if getattr(self, "_created", False):
                try:
                    fsutil.remove_private_dir(self.path, lock=self._lock)
                except OSError as exc:
                    log.warning("could not remove %s: %s", self.path, exc)
            self._lock.release()

    def close(self, *, remove: bool = True) -> None:
        """Close files and engine (after the steps of other threads), and with ``remove`` (the default) delete
        the directory; ``remove=False`` keeps it (resumable), unlocked. It also stays after a SIGTERM (see cleanup's
        notes); a forked child does nothing (the store is its parent's); a directory that vanished or was
        replaced since we locked it is left alone (with a warning)."""
        with self._close_lock:
            if self._closed or self._closing:
                return
            self._closing = True
        if os.getpid() == self.owner_pid:  # [Note: a close meets a step] (a child's registry: its parent's threads)
            self.in_flight.wait_others(self.path)
        self._closed = True
        if os.getpid() != self.owner_pid:
            return  # a forked child: files, lock, engine and accounting are the parent's
        if self._token is not None:
            cleanup.unregister(self._token)
            from offload.memory import default_accounting

            default_accounting().clear_owner(self._acct_owner)
        # A Ctrl-C between two unlinks left a directory without its manifest (or a slot file): held
        # until the directory is gone (or kept whole), then raised; a second interrupts at once.
        with sigint_held():
            self._close_files()
            if self._lock is not None:
                try:
                    if remove and cleanup.terminating():
                        held = self.extra or self.step or any(self.valid)  # (extra is optional: a user's commits)
                        log.warning("%s: kept after %s (%s; `offload clean %s` removes it)", self.path, cleanup.why_kept(),
                                    f"step {self.step}, resumable with resume=True" if held else
                                    "never committed: nothing to resume, resume='auto' starts afresh", self.parent)
                    elif remove:
                        self._remove_dir()
                finally:
                    self._lock.release()  # a directory we could not remove must not stay locked by a closed store

    def _close_files(self) -> None:
        for f in self.files:
            try:
                f.close()
            except OSError as exc:
                log.warning("closing %s: %s", f.path, exc)
        self.files = []
        if self._owns_engine and self.engine is not None:
            self.engine.close()
        self.engine = None

    def _remove_dir(self) -> None:
        cleanup.remove_run_dir(self.path, self._lock, self._dir_id, self.parent, self.step,
                               held=bool(self.extra or self.step or any(self.valid)))

    closed = property(lambda self: self._closed or self._closing)  # (a closing store starts no step)

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
