"""Checkpoints of a swap store, streamed in buffer-sized pieces (never the whole state in RAM).

A checkpoint is a directory (which may hold other files: only ours are touched, see
offload/swap/ckpt_dir.py)::

    offload-ckpt.json                 manifest (format, version, dtype, numel, states, files, crc32, meta)
    offload-ckpt.exp_avg.<gen>.bin    one flat fp32 array per state, in index order, padded to 4096
    offload-ckpt.exp_avg_sq.<gen>.bin
    offload-ckpt.lock                 flock'ed by a save (exclusive) or a load (shared)

(The previous release named the data files ``exp_avg.<gen>.bin``; the manifest names them,
so its checkpoints load as they are.) The data files hold the plain flat arrays, independent
of the sub-group layout, so a checkpoint loads with any ``sub_group_size`` (and the optimizer
can write the same format from host-resident states). Saving writes new files under
temporary names, fsyncs them, renames them to a new generation ``<gen>``, then replaces the
manifest atomically; the old generation is deleted only after that, so a crash or ENOSPC
mid-save leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import errno
import os
import zlib
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from offload.io import IORequest, open_file
from offload.swap.ckpt_dir import (CKPT_FORMAT, CKPT_MANIFEST, CKPT_VERSION, CheckpointBusy, DirLock, NewGeneration,
                                   read_manifest)
from offload.swap.layout import ALIGN, round_up

__all__ = ["CKPT_FORMAT", "CKPT_VERSION", "CKPT_MANIFEST", "CheckpointBusy", "save_store", "load_store",
           "save_tensors", "load_tensors", "read_manifest", "verify_checkpoint", "Agree"]

# agree(prepare, commit, undo): run a save's two halves; several ranks pass
# offload.zero.comm.all_or_none, so that every rank commits its shard or none does
Agree = Callable[[Callable[[], Any], Callable[[Any], None], Callable[[], str]], Any]


def _alone(prepare: Callable[[], Any], commit: Callable[[Any], None], undo: Callable[[], str]) -> Any:
    out = prepare()
    commit(out)
    return out


def _save(new: NewGeneration, write: Callable[[], Dict[str, int]], fields: Dict[str, Any],
          agree: Optional[Agree]) -> str:
    """The frame of a save: ``write()`` fills ``new.tmps`` (returns the crc32s), then the
    files get their final names and the manifest is replaced; any failure, here or (through
    ``agree``) on another rank, leaves the previous checkpoint in place."""
    def prepare() -> Dict[str, int]:
        new.open()
        crcs = write()
        new.publish()
        return crcs

    def undo() -> str:
        new.abort()
        return "it put its previous checkpoint back"

    try:
        (agree or _alone)(prepare, lambda crcs: new.commit(crcs=crcs, **fields), undo)
    except BaseException:
        new.abort()
        raise
    return new.finish()


def _stream(engine: Any, buffers: List[Any], groups: List[int],
            reads: Callable[[int, Any], List[Any]], process: Callable[[int, Any], None],
            writes: Callable[[int, Any], List[Any]]) -> None:
    """For each group: read into a free buffer (synchronously), ``process``, then submit its
    writes and go on; a buffer is reused only after its writes completed."""
    from offload.swap.pipeline import _check_counts

    free = list(buffers)
    pending: Deque[Tuple[Any, Any, List[Any]]] = deque()
    try:
        for g in groups:
            if not free:
                buf, ticket, reqs = pending.popleft()
                _check_counts(engine.wait(ticket), reqs, "write")
                free.append(buf)
            buf = free.pop()
            rq = reads(g, buf)
            if rq:
                _check_counts(engine.wait(engine.submit(rq)), rq, "read")
            process(g, buf)
            wq = writes(g, buf)
            pending.append((buf, engine.submit(wq), wq))
        while pending:
            buf, ticket, reqs = pending.popleft()
            _check_counts(engine.wait(ticket), reqs, "write")
    finally:
        for _, ticket, _ in pending:  # after an error: let in-flight writes finish
            try:
                engine.wait(ticket)
            except Exception:
                pass


def save_store(store: Any, buffers: List[Any], directory: str, meta: Dict[str, Any], *,
               agree: Optional[Agree] = None) -> str:
    """Stream the committed states of ``store`` into checkpoint ``directory`` (created 0700 if
    missing). ``meta``: opaque JSON (the optimizer's steps, shapes, fingerprint)."""
    layout, names = store.layout, store.state_names
    new = NewGeneration(directory, names, round_up(layout.numel * layout.itemsize, ALIGN))
    fields = dict(dtype=layout.dtype_name, numel=layout.numel, meta=meta)
    return _save(new, lambda: _write_store(store, buffers, new), fields, agree)


def _write_store(store: Any, buffers: List[Any], new: NewGeneration) -> Dict[str, int]:
    layout, names = store.layout, store.state_names
    files: List[Any] = []
    crcs = [0] * len(names)
    try:
        for k in names:
            f = open_file(new.tmps[k], write=True, create=True, exclusive=True, mode=0o600, nofollow=True)
            files.append(f)
            new.preallocate(f)

        def process(g: int, buf: Any) -> None:
            if store.verify:
                store.check(g, buf)
            s, e = layout.group_range(g)
            stride, used = layout.state_bytes(g), (e - s) * layout.itemsize
            view = buf.memoryview
            for k in range(len(names)):
                crcs[k] = zlib.crc32(view[k * stride:k * stride + used], crcs[k])
                if used < stride:  # deterministic padding at the end of the file
                    view[k * stride + used:(k + 1) * stride] = bytes(stride - used)

        def reads(g: int, buf: Any) -> List[Any]:
            rq = store.read_requests(g, buf)
            if not rq:
                buf.memoryview[:layout.group_bytes(g)] = bytes(layout.group_bytes(g))
            return rq

        def writes(g: int, buf: Any) -> List[Any]:
            s, _ = layout.group_range(g)
            stride = layout.state_bytes(g)
            return [IORequest(op="write", file=files[k], offset=s * layout.itemsize,
                              buf=buf.memoryview[k * stride:(k + 1) * stride]) for k in range(len(names))]

        _stream(store.engine, buffers, list(range(layout.num_groups)), reads, process, writes)
        for f in files:
            f.fsync()
    finally:
        for f in files:
            try:
                f.close()
            except OSError:
                pass
    return dict(zip(names, crcs))


def load_store(store: Any, buffers: List[Any], directory: str) -> Tuple[Dict[str, Any], Dict[int, Any]]:
    """See :func:`_load_store`; under the directory's shared lock (no save meanwhile)."""
    with DirLock(os.path.abspath(directory), exclusive=False):
        return _load_store(store, buffers, directory)


def _load_store(store: Any, buffers: List[Any], directory: str) -> Tuple[Dict[str, Any], Dict[int, Any]]:
    """Stream checkpoint ``directory`` into the free slots of ``store``; returns (meta,
    written) where ``written`` is what :meth:`SwapStore.commit` needs to make it current.
    Nothing is committed here: on a crc mismatch or an I/O error the store is unchanged."""
    layout, names = store.layout, store.state_names
    directory = os.path.abspath(directory)
    m = read_manifest(directory)
    for key, want in (("dtype", layout.dtype_name), ("numel", layout.numel), ("states", names)):
        if m.get(key) != want:
            raise ValueError(f"{directory}: checkpoint {key} is {m.get(key)!r}, this optimizer has {want!r}")
    per_file = round_up(layout.numel * layout.itemsize, ALIGN)
    files: List[Any] = []
    crcs = [0] * len(names)
    written: Dict[int, Any] = {}
    try:
        for k in names:
            f = open_file(os.path.join(directory, m["files"][k]), write=False, nofollow=True)
            files.append(f)
            if f.size < per_file:
                raise ValueError(f"{f.path}: {f.size} bytes, a checkpoint of {layout.numel} elements has {per_file}")

        def reads(g: int, buf: Any) -> List[Any]:
            s, _ = layout.group_range(g)
            stride = layout.state_bytes(g)
            return [IORequest(op="read", file=files[k], offset=s * layout.itemsize,
                              buf=buf.memoryview[k * stride:(k + 1) * stride]) for k in range(len(names))]

        def process(g: int, buf: Any) -> None:
            s, e = layout.group_range(g)
            stride, used = layout.state_bytes(g), (e - s) * layout.itemsize
            view = buf.memoryview
            for k in range(len(names)):
                crcs[k] = zlib.crc32(view[k * stride:k * stride + used], crcs[k])
            written[g] = store.checksum(g, buf) if store.verify else None

        _stream(store.engine, buffers, list(range(layout.num_groups)), reads, process, store.write_requests)
    finally:
        for f in files:
            f.close()
    for k, name in enumerate(names):
        want = int(m["crc32"][name])
        if crcs[k] != want:
            raise OSError(errno.EIO, f"checkpoint data of {name} fails its crc32 ({crcs[k]:08x}, manifest {want:08x}); "
                          "nothing was loaded", os.path.join(directory, m["files"][name]))
    return m.get("meta") or {}, written


# --------------------------------------------------------------------------- host tensors
# The same checkpoint format written from / read into ordinary tensors (e.g. the moments of
# offload="cpu" kept in opt.state), so a checkpoint moves between "cpu" and "nvme" both ways.

_STAGE_BYTES = 32 << 20


def _flat_pieces(tensors: List[Any], *, writable: bool):
    import torch

    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or (writable and not t.is_contiguous()):
            raise ValueError(f"checkpoint tensors must be fp32 CPU tensors{' (contiguous)' if writable else ''}, "
                             f"got {t.dtype} on {t.device}")
        yield t.detach().reshape(-1)


class _Staging:
    """One pool buffer (and its fp32 view) to stream through; an engine unless given."""

    def __init__(self, directory: str, stage_bytes: int, io_engine: Any) -> None:
        import torch

        from offload.memory import BufferPool
        from offload.io.auto import resolve_engine

        self.nbytes = max(ALIGN, stage_bytes // ALIGN * ALIGN)
        self.engine, self._owned = resolve_engine(io_engine, directory)
        self.pool = BufferPool(pin=False, region_bytes=self.nbytes, name=f"ckpt:{directory}")  # never meets a GPU
        self.buf = self.pool.acquire(self.nbytes)
        self.view = self.buf.memoryview
        self.floats = self.buf.tensor(torch.float32)

    def __enter__(self) -> "_Staging":
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.view, self.floats
        self.pool.release(self.buf)
        try:
            self.pool.close()
        except BufferError:  # a view lives on in a traceback: the memory goes with it later
            pass
        if self._owned:
            self.engine.close()


def verify_checkpoint(directory: str, states: List[str], numel: int, *, io_engine: Any = None,
                      stage: Optional[memoryview] = None, stage_bytes: int = _STAGE_BYTES) -> Dict[str, Any]:
    """See :func:`_verify`; under the directory's shared lock."""
    with DirLock(os.path.abspath(directory), exclusive=False):
        return _verify(directory, states, numel, io_engine=io_engine, stage=stage, stage_bytes=stage_bytes)


def _verify(directory: str, states: List[str], numel: int, *, io_engine: Any = None,
            stage: Optional[memoryview] = None, stage_bytes: int = _STAGE_BYTES) -> Dict[str, Any]:
    """Read checkpoint ``directory`` through once, touching nothing else: its manifest must
    hold ``states`` of ``numel`` fp32 elements each, and every data file its size and crc32.
    Returns the manifest. For a load that must not stop half-way: check every file first
    (several of them, on several ranks), then load. ``stage``: a buffer to stream through
    (else one of ``stage_bytes`` is made), with ``io_engine``."""
    directory = os.path.abspath(directory)
    m = read_manifest(directory)
    if sorted(m.get("states", [])) != sorted(states) or m.get("numel") != numel or m.get("dtype") != "float32":
        raise ValueError(f"{directory}: checkpoint holds {m.get('numel')!r} {m.get('dtype')} elements of states "
                         f"{m.get('states')}, expected {numel} float32 of {sorted(states)}")

    def check(engine: Any, view: memoryview) -> None:
        used = numel * 4
        for name in m["states"]:
            path = os.path.join(directory, m["files"][name])
            crc, offset = 0, 0
            with open_file(path, write=False, direct=False, nofollow=True) as f:
                if f.size < int(m.get("file_bytes", used)):  # what load_tensors and load_store ask for
                    raise ValueError(f"{path}: {f.size} bytes, the manifest says {m.get('file_bytes', used)}")
                while offset < used:
                    n = min(len(view), used - offset)
                    got = engine.read(f, offset, view[:n])
                    if got != n:
                        raise OSError(errno.EIO, f"short read: {got} of {n} bytes at {offset}", path)
                    crc = zlib.crc32(view[:n], crc)
                    offset += n
            if crc != int(m["crc32"][name]):
                raise OSError(errno.EIO, f"checkpoint data of {name} fails its crc32 ({crc:08x}, manifest "
                              f"{int(m['crc32'][name]):08x}); nothing was loaded", path)

    if stage is not None and io_engine is not None:
        check(io_engine, stage)
    else:
        with _Staging(directory, stage_bytes, io_engine) as st:
            check(st.engine, st.view)
    return m


def save_tensors(directory: str, states: Dict[str, List[Any]], meta: Dict[str, Any], *,
                 io_engine: Any = None, stage_bytes: int = _STAGE_BYTES, agree: Optional[Agree] = None) -> str:
    """Write ``states`` (name -> fp32 CPU tensors, concatenated in order) as a checkpoint in
    ``directory``: the files and manifest of :func:`save_store`, streamed through one staging
    buffer of ``stage_bytes``; the previous checkpoint there is replaced only once this one is
    complete."""
    names = list(states)
    numels = {k: sum(t.numel() for t in states[k]) for k in names}
    if not names or len(set(numels.values())) != 1:
        raise ValueError(f"every state needs the same number of elements, got {numels}")
    numel = numels[names[0]]
    new = NewGeneration(directory, names, round_up(numel * 4, ALIGN))

    def write() -> Dict[str, int]:
        with _Staging(new.directory, stage_bytes, io_engine) as st:
            return {k: _write_tensors(st, new, k, states[k]) for k in names}

    return _save(new, write, dict(dtype="float32", numel=numel, meta=meta), agree)


def _write_tensors(st: "_Staging", new: NewGeneration, k: str, tensors: List[Any]) -> int:
    with open_file(new.tmps[k], write=True, create=True, exclusive=True, mode=0o600) as f:
        new.preallocate(f)
        crc, fill, offset = 0, 0, 0
        for piece in _flat_pieces(tensors, writable=False):
            pos = 0
            while pos < piece.numel():
                n = min(piece.numel() - pos, st.floats.numel() - fill)
                st.floats[fill:fill + n].copy_(piece[pos:pos + n])
                fill, pos = fill + n, pos + n
                if fill == st.floats.numel():
                    crc = zlib.crc32(st.view, crc)
                    st.engine.write(f, offset, st.view)
                    offset, fill = offset + st.nbytes, 0
        if fill:
            used, padded = fill * 4, round_up(fill * 4, ALIGN)
            crc = zlib.crc32(st.view[:used], crc)
            st.view[used:padded] = bytes(padded - used)
            st.engine.write(f, offset, st.view[:padded])
        f.fsync()
    return crc


def load_tensors(directory: str, states: Dict[str, List[Any]], *, io_engine: Any = None,
                 stage_bytes: int = _STAGE_BYTES) -> Dict[str, Any]:
    """See :func:`_load_tensors`; under the directory's shared lock."""
    with DirLock(os.path.abspath(directory), exclusive=False):
        return _load_tensors(directory, states, io_engine=io_engine, stage_bytes=stage_bytes)


def _load_tensors(directory: str, states: Dict[str, List[Any]], *, io_engine: Any = None,
                  stage_bytes: int = _STAGE_BYTES) -> Dict[str, Any]:
    """Fill ``states`` (name -> contiguous fp32 CPU tensors, concatenated in order) from
    checkpoint ``directory``; returns its ``meta``. The tensors are filled as the data streams
    in and the crc32 is compared at the end of each file: after an error, treat them as
    garbage (load into scratch tensors first where that matters)."""
    directory = os.path.abspath(directory)
    m = read_manifest(directory)
    names = list(states)
    if sorted(names) != sorted(m["states"]):
        raise ValueError(f"{directory}: checkpoint holds states {m['states']}, asked for {names}")
    for k in names:
        n = sum(t.numel() for t in states[k])
        if n != m["numel"]:
            raise ValueError(f"{directory}: checkpoint has {m['numel']} elements per state, the tensors {n}")
    with _Staging(directory, stage_bytes, io_engine) as st:
        for k in names:
            path = os.path.join(directory, m["files"][k])
            crc, avail, fill, offset = 0, 0, 0, 0
            with open_file(path, write=False) as f:
                if f.size < m["file_bytes"]:
                    raise ValueError(f"{path}: {f.size} bytes, the manifest says {m['file_bytes']}")
                for piece in _flat_pieces(states[k], writable=True):
                    pos = 0
                    while pos < piece.numel():
                        if fill == avail:
                            nbytes = min(st.nbytes, m["file_bytes"] - offset)
                            got = st.engine.read(f, offset, st.view[:nbytes])
                            if got != nbytes:
                                raise OSError(errno.EIO, f"short read: {got} of {nbytes} bytes at {offset}", path)
                            used = min(nbytes, m["numel"] * 4 - offset)
                            crc = zlib.crc32(st.view[:used], crc)
                            offset += nbytes
                            avail, fill = used // 4, 0
                        n = min(piece.numel() - pos, avail - fill)
                        piece[pos:pos + n].copy_(st.floats[fill:fill + n])
                        fill, pos = fill + n, pos + n
            if crc != int(m["crc32"][k]):
                raise OSError(errno.EIO, f"checkpoint data of {k} fails its crc32 ({crc:08x}, manifest "
                              f"{int(m['crc32'][k]):08x})", path)
    return m.get("meta") or {}
