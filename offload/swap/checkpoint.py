"""Checkpoints of a swap store, streamed in buffer-sized pieces (never the whole state in RAM).

A checkpoint is a directory (which may hold other files: only ours are touched, see
offload/swap/ckpt_dir.py)::

    offload-ckpt.json                 manifest (format, version, dtype(s), numel, states, files, crc32, meta)
    offload-ckpt.exp_avg.<gen>.bin    one flat array per state (its dtype), in index order, padded to 4096
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from offload.io import IORequest, open_file
from offload.kernels.fields import StateField
from offload.swap.ckpt_dir import (CKPT_FORMAT, CKPT_MANIFEST, CKPT_VERSION, CheckpointBusy, DirLock, NewGeneration,
                                   manifest_dtypes, manifest_fields, manifest_file_bytes, read_manifest)
from offload.swap.layout import ALIGN, as_fields, round_up
from offload.swap.session import Requests, SwapSession

__all__ = ["CKPT_FORMAT", "CKPT_VERSION", "CKPT_MANIFEST", "CheckpointBusy", "save_store", "load_store",
           "save_tensors", "load_tensors", "read_manifest", "verify_checkpoint", "Agree", "stream_groups"]

# agree(prepare, commit, undo): run a save's two halves; several ranks pass
# offload.zero.comm.all_or_none, so that every rank commits its shard or none does
Agree = Callable[[Callable[[], Any], Callable[[Any], None], Callable[[], str]], Any]


def _alone(prepare: Callable[[], Any], commit: Callable[[Any], None], undo: Callable[[], str]) -> Any:
    out = prepare()
    commit(out)
    return out


def _save(new: NewGeneration, write: Callable[[], Dict[str, int]], manifest: Dict[str, Any],
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
        (agree or _alone)(prepare, lambda crcs: new.commit(crcs=crcs, **manifest), undo)
    except BaseException:
        new.abort()
        raise
    return new.finish()


def stream_groups(engine: Any, buffers: List[Any], groups: List[int], reads: Requests,
                  process: Callable[[int, Any], None], writes: Requests) -> None:
    """For each group in order: read it into a free buffer (``reads``; read ahead while
    buffers are free), ``process`` it, then submit its ``writes`` and go on; a buffer is
    reused only after its writes completed. A client of the swap session (session.py)."""
    session = SwapSession(engine, buffers, groups, reads=reads, writes=writes)
    try:
        for g in session.groups:
            process(g, session.acquire(g))
            session.finish(g)
        session.drain()
    except BaseException:
        session.abort()  # let what is in flight finish before anyone reuses the buffers
        raise




def _state_files(layout: Any, names: List[str]) -> Dict[str, int]:
    """Bytes of each state's checkpoint file: its flat array, padded to 4096."""
    return {k: round_up(f.nbytes(layout.numel), ALIGN) for k, f in zip(names, layout.fields)}


def save_store(store: Any, buffers: List[Any], directory: str, meta: Dict[str, Any], *,
               agree: Optional[Agree] = None) -> str:
    """Stream the committed states of ``store`` into checkpoint ``directory`` (created 0700 if
    missing). ``meta``: opaque JSON (the optimizer's steps, shapes, fingerprint)."""
    layout, names = store.layout, store.state_names
    new = NewGeneration(directory, names, _state_files(layout, names))
    manifest = dict(dtypes=dict(zip(names, layout.dtype_names)), numel=layout.numel, meta=meta,
                    fields={f.name: f for f in layout.fields})
    return _save(new, lambda: _write_store(store, buffers, new), manifest, agree)


def _flat_requests(op: str, layout: Any, files: List[Any], g: int, buf: Any) -> List[Any]:
    """One request per state between ``g``'s part of the buffer and its place in the flat file."""
    s, _ = layout.group_range(g)
    view = buf.memoryview
    return [IORequest(op=op, file=files[k], offset=layout.fields[k].nbytes(s), buf=view[off:off + padded])
            for k, (off, _, padded) in enumerate(layout.state_spans(g))]


def _crc_states(layout: Any, g: int, buf: Any, crcs: List[int], pad: bool) -> None:
    """Fold ``g``'s states into the running crc32s; ``pad``: zero the padding behind them
    (deterministic bytes at the end of the files)."""
    view = buf.memoryview
    for k, (off, used, padded) in enumerate(layout.state_spans(g)):
        crcs[k] = zlib.crc32(view[off:off + used], crcs[k])
        if pad and used < padded:
            view[off + used:off + padded] = bytes(padded - used)


def _write_store(store: Any, buffers: List[Any], new: NewGeneration) -> Dict[str, int]:
    layout, names = store.layout, store.state_names
    files: List[Any] = []
    crcs = [0] * len(names)
    try:
        for k in names:
            f = open_file(new.tmps[k], write=True, create=True, exclusive=True, mode=0o600, nofollow=True)
            files.append(f)
            new.preallocate(f, k)

        def process(g: int, buf: Any) -> None:
            if store.verify:
                store.check(g, buf)
            _crc_states(layout, g, buf, crcs, pad=True)

        def reads(g: int, buf: Any) -> List[Any]:
            rq = store.read_requests(g, buf)
            if not rq:
                buf.memoryview[:layout.group_bytes(g)] = bytes(layout.group_bytes(g))
            return rq

        stream_groups(store.engine, buffers, list(range(layout.num_groups)), reads, process,
                      lambda g, buf: _flat_requests("write", layout, files, g, buf))
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


def _check_fits(m: Dict[str, Any], directory: str, layout: Any, names: List[str]) -> None:
    """The checkpoint holds the states, element types and element count of ``layout``."""
    for key, want in (("numel", layout.numel), ("states", names)):
        if m.get(key) != want:
            raise ValueError(f"{directory}: checkpoint {key} is {m.get(key)!r}, this optimizer has {want!r}")
    want = {f.name: f for f in layout.fields}
    if manifest_fields(m) != want:
        raise ValueError(f"{directory}: checkpoint states are {_say(manifest_fields(m))}, this optimizer keeps "
                         f"{_say(want)}")


def _say(fields: Dict[str, StateField]) -> str:
    return ", ".join(f"{k} ({_kind(f)})" for k, f in fields.items())


def _kind(f: StateField) -> str:
    return f"{f.dtype_name} in blocks of {f.block}, {f.code} code" if f.block else f.dtype_name


def _load_store(store: Any, buffers: List[Any], directory: str) -> Tuple[Dict[str, Any], Dict[int, Any]]:
    """Stream checkpoint ``directory`` into the free slots of ``store``; returns (meta,
    written) where ``written`` is what :meth:`SwapStore.commit` needs to make it current.
    Nothing is committed here: on a crc mismatch or an I/O error the store is unchanged."""
    layout, names = store.layout, store.state_names
    directory = os.path.abspath(directory)
    m = read_manifest(directory)
    _check_fits(m, directory, layout, names)
    per_file = _state_files(layout, names)
    files: List[Any] = []
    crcs = [0] * len(names)
    written: Dict[int, Any] = {}
    try:
        for k in names:
            f = open_file(os.path.join(directory, m["files"][k]), write=False, nofollow=True)
            files.append(f)
            if f.size < per_file[k]:
                raise ValueError(f"{f.path}: {f.size} bytes, a checkpoint of {layout.numel} elements has {per_file[k]}")

        def process(g: int, buf: Any) -> None:
            _crc_states(layout, g, buf, crcs, pad=False)
            written[g] = store.checksum(g, buf) if store.verify else None

        stream_groups(store.engine, buffers, list(range(layout.num_groups)),
                      lambda g, buf: _flat_requests("read", layout, files, g, buf), process, store.write_requests)
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


def _flat_pieces(tensors: List[Any], dtype: Any, *, writable: bool):
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu" or (writable and not t.is_contiguous()):
            raise ValueError(f"checkpoint tensors of one state must be CPU tensors of one dtype ({dtype})"
                             f"{' and contiguous' if writable else ''}, got {t.dtype} on {t.device}")
        yield t.detach().reshape(-1)


def _state_dtype(name: str, tensors: List[Any]) -> StateField:
    """The typed field of state ``name``: the dtype of its tensors (float32 when it has none);
    packed blocks need their field said (``fields=`` of save_tensors)."""
    return StateField(name, tensors[0].dtype) if tensors else StateField(name)


class _Staging:
    """One pool buffer to stream through (``typed(dtype)`` views it); an engine unless given."""

    def __init__(self, directory: str, stage_bytes: int, io_engine: Any) -> None:
        from offload.memory import BufferPool
        from offload.io.auto import resolve_engine

        self.nbytes = max(ALIGN, stage_bytes // ALIGN * ALIGN)
        self.engine, self._owned = resolve_engine(io_engine, directory)
        self.pool = BufferPool(pin=False, region_bytes=self.nbytes, name=f"ckpt:{directory}")  # never meets a GPU
        self.buf = self.pool.acquire(self.nbytes)
        self.view = self.buf.memoryview

    def typed(self, dtype: Any) -> Any:
        return self.buf.tensor(dtype)

    def __enter__(self) -> "_Staging":
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.view
        self.pool.release(self.buf)
        try:
            self.pool.close()
        except BufferError:  # a view lives on in a traceback: the memory goes with it later
            pass
        if self._owned:
            self.engine.close()


def verify_checkpoint(directory: str, states: Sequence[Union[str, StateField]], numel: int, *,
                      io_engine: Any = None, stage: Optional[memoryview] = None,
                      stage_bytes: int = _STAGE_BYTES) -> Dict[str, Any]:
    """See :func:`_verify`; under the directory's shared lock."""
    with DirLock(os.path.abspath(directory), exclusive=False):
        return _verify(directory, states, numel, io_engine=io_engine, stage=stage, stage_bytes=stage_bytes)


def _verify(directory: str, states: Sequence[Union[str, StateField]], numel: int, *, io_engine: Any = None,
            stage: Optional[memoryview] = None, stage_bytes: int = _STAGE_BYTES) -> Dict[str, Any]:
    """Read checkpoint ``directory`` through once, touching nothing else: its manifest must
    hold ``states`` (names of fp32 states, or typed fields) of ``numel`` elements each, and
    every data file its size and crc32. Returns the manifest. For a load that must not stop
    half-way: check every file first (several of them, on several ranks), then load.
    ``stage``: a buffer to stream through (else one of ``stage_bytes`` is made), with ``io_engine``."""
    directory = os.path.abspath(directory)
    m = read_manifest(directory)
    want = {f.name: f for f in as_fields(list(states))} if len(states) else {}  # (a store of no state: steps only)
    types = manifest_fields(m)
    if sorted(m.get("states", [])) != sorted(want) or m.get("numel") != numel \
            or any(types.get(k) != f for k, f in want.items()):
        raise ValueError(f"{directory}: checkpoint holds {m.get('numel')!r} elements of states {m.get('states')} "
                         f"({m.get('dtype')}), expected {numel} of {sorted(want)} "
                         f"({'/'.join(sorted({f.dtype_name for f in want.values()}))})")

    def check(engine: Any, view: memoryview) -> None:
        for name in m["states"]:
            _check_file(engine, view, os.path.join(directory, m["files"][name]), want[name].nbytes(numel),
                        manifest_file_bytes(m, name) if "file_bytes" in m else None, int(m["crc32"][name]), name)

    if stage is not None and io_engine is not None:
        check(io_engine, stage)
    else:
        with _Staging(directory, stage_bytes, io_engine) as st:
            check(st.engine, st.view)
    return m


def _check_file(engine: Any, view: memoryview, path: str, used: int, size: Optional[int], want: int,
                name: str) -> None:
    """The file at ``path`` has ``size`` bytes (``used`` when None) and its first ``used`` the crc32 ``want``."""
    crc, offset = 0, 0
    with open_file(path, write=False, direct=False, nofollow=True) as f:
        need = used if size is None else size  # what load_tensors and load_store ask for
        if f.size < need:
            raise ValueError(f"{path}: {f.size} bytes, the manifest says {need}")
        while offset < used:
            n = min(len(view), used - offset)
            got = engine.read(f, offset, view[:n])
            if got != n:
                raise OSError(errno.EIO, f"short read: {got} of {n} bytes at {offset}", path)
            crc = zlib.crc32(view[:n], crc)
            offset += n
    if crc != want:
        raise OSError(errno.EIO, f"checkpoint data of {name} fails its crc32 ({crc:08x}, manifest "
                      f"{want:08x}); nothing was loaded", path)


def save_tensors(directory: str, states: Dict[str, List[Any]], meta: Dict[str, Any], *,
                 io_engine: Any = None, stage_bytes: int = _STAGE_BYTES, agree: Optional[Agree] = None,
                 fields: Optional[Sequence[StateField]] = None, numel: Optional[int] = None) -> str:
    """Write ``states`` (name -> CPU tensors of one dtype per state, fp32 for the optimizer's
    states, concatenated in order) as a checkpoint in ``directory``: the files and manifest of
    :func:`save_store`, streamed through one staging buffer of ``stage_bytes``; the previous
    checkpoint there is replaced only once this one is complete. ``fields``: the states'
    typed fields (needed for packed blocks: their tensors are the packed bytes, the blocks of
    each tensor following the last one's, and ``numel`` says how many values they hold);
    else each state's field is its tensors' dtype."""
    names = list(states)
    fields = _fields_for(names, states, fields)
    stored = {k: sum(t.numel() for t in states[k]) for k in names}
    if numel is None and any(f.blocked for f in fields.values()):
        raise ValueError("states in packed blocks: say how many values they hold (numel=)")
    # each state's values: what its storage holds for numel, or (not said) its element count
    numels = {k: (int(numel) if fields[k].storage_numel(int(numel)) == n else f"{n} stored")
              if numel is not None else n for k, n in stored.items()}
    if len(set(numels.values())) > 1:
        raise ValueError(f"every state needs the same number of elements, got {numels}")
    # a rule with no state (SGD without momentum): a manifest of no files, its meta (steps, groups) all
    numel = numels[names[0]] if names else int(numel or 0)
    new = NewGeneration(directory, names, {k: round_up(f.nbytes(numel), ALIGN) for k, f in fields.items()})

    def write() -> Dict[str, int]:
        with _Staging(new.directory, stage_bytes, io_engine) as st:
            return {k: _write_tensors(st, new, fields[k], states[k]) for k in names}

    manifest = dict(dtypes={k: f.dtype_name for k, f in fields.items()}, numel=numel, meta=meta,
                    fields=dict(fields))
    return _save(new, write, manifest, agree)


def _fields_for(names: List[str], states: Dict[str, List[Any]],
                fields: Optional[Sequence[StateField]]) -> Dict[str, StateField]:
    if fields is None:
        return {k: _state_dtype(k, states[k]) for k in names}
    given = {f.name: f for f in fields}
    if sorted(given) != sorted(names):
        raise ValueError(f"fields {sorted(given)} for the states {sorted(names)}")
    return {k: given[k] for k in names}


def _write_tensors(st: "_Staging", new: NewGeneration, field: StateField, tensors: List[Any]) -> int:
    k, size = field.name, field.itemsize
    stage = st.typed(field.storage_dtype)  # packed blocks: their bytes, as they are
    with open_file(new.tmps[k], write=True, create=True, exclusive=True, mode=0o600) as f:
        new.preallocate(f, k)
        crc, fill, offset = 0, 0, 0
        for piece in _flat_pieces(tensors, field.storage_dtype, writable=False):
            pos = 0
            while pos < piece.numel():
                n = min(piece.numel() - pos, stage.numel() - fill)
                stage[fill:fill + n].copy_(piece[pos:pos + n])
                fill, pos = fill + n, pos + n
                if fill == stage.numel():
                    crc = zlib.crc32(st.view, crc)
                    st.engine.write(f, offset, st.view)
                    offset, fill = offset + st.nbytes, 0
        if fill:
            used, padded = fill * size, round_up(fill * size, ALIGN)
            crc = zlib.crc32(st.view[:used], crc)
            st.view[used:padded] = bytes(padded - used)
            st.engine.write(f, offset, st.view[:padded])
        f.fsync()
    return crc


def load_tensors(directory: str, states: Dict[str, List[Any]], *, io_engine: Any = None,
                 stage_bytes: int = _STAGE_BYTES, fields: Optional[Sequence[StateField]] = None) -> Dict[str, Any]:
    """See :func:`_load_tensors`; under the directory's shared lock."""
    with DirLock(os.path.abspath(directory), exclusive=False):
        return _load_tensors(directory, states, io_engine=io_engine, stage_bytes=stage_bytes, fields=fields)


def _load_tensors(directory: str, states: Dict[str, List[Any]], *, io_engine: Any = None,
                  stage_bytes: int = _STAGE_BYTES, fields: Optional[Sequence[StateField]] = None) -> Dict[str, Any]:
    """Fill ``states`` (name -> contiguous CPU tensors of the state's dtype in the checkpoint,
    concatenated in order) from checkpoint ``directory``; returns its ``meta``. The tensors
    are filled as the data streams in and the crc32 is compared at the end of each file:
    after an error, treat them as garbage (load into scratch tensors first where that matters).
    ``fields``: what the caller keeps (packed blocks: tensors of the packed bytes); else each
    state's field is its tensors' dtype. The checkpoint must hold the same fields."""
    directory = os.path.abspath(directory)
    m = read_manifest(directory)
    names = list(states)
    if sorted(names) != sorted(m["states"]):
        raise ValueError(f"{directory}: checkpoint holds states {m['states']}, asked for {names}")
    types, mine = manifest_fields(m), _fields_for(names, states, fields)
    for k in names:
        if mine[k] != types.get(k):
            raise ValueError(f"{directory}: checkpoint holds {k} as {_kind(types[k])}, the tensors are "
                             f"{_kind(mine[k])}")
        n = sum(t.numel() for t in states[k])
        if n != mine[k].storage_numel(m["numel"]):
            raise ValueError(f"{directory}: checkpoint has {m['numel']} elements per state "
                             f"({mine[k].storage_numel(m['numel'])} of {mine[k].storage_dtype}), the tensors {n}")
    with _Staging(directory, stage_bytes, io_engine) as st:
        for k in names:
            _read_tensors(st, os.path.join(directory, m["files"][k]), mine[k], states[k],
                          m["numel"], manifest_file_bytes(m, k), int(m["crc32"][k]))
    return m.get("meta") or {}


def _read_tensors(st: "_Staging", path: str, field: StateField, tensors: List[Any], numel: int, file_bytes: int,
                  want: int) -> None:
    size, stage = field.itemsize, st.typed(field.storage_dtype)
    crc, avail, fill, offset = 0, 0, 0, 0
    with open_file(path, write=False) as f:
        if f.size < file_bytes:
            raise ValueError(f"{path}: {f.size} bytes, the manifest says {file_bytes}")
        if file_bytes < field.nbytes(numel):  # (the reads below stopped there and looped forever)
            raise ValueError(f"{path}: the manifest says {file_bytes} bytes for {field.nbytes(numel)} of data")
        for piece in _flat_pieces(tensors, field.storage_dtype, writable=True):
            pos = 0
            while pos < piece.numel():
                if fill == avail:
                    nbytes = min(st.nbytes, file_bytes - offset)
                    got = st.engine.read(f, offset, st.view[:nbytes])
                    if got != nbytes:
                        raise OSError(errno.EIO, f"short read: {got} of {nbytes} bytes at {offset}", path)
                    used = min(nbytes, field.nbytes(numel) - offset)
                    crc = zlib.crc32(st.view[:used], crc)
                    offset += nbytes
                    avail, fill = used // size, 0
                n = min(piece.numel() - pos, avail - fill)
                piece[pos:pos + n].copy_(stage[fill:fill + n])
                fill, pos = fill + n, pos + n
    if crc != want:
        raise OSError(errno.EIO, f"checkpoint data of {field.name} fails its crc32 ({crc:08x}, manifest "
                      f"{want:08x})", path)
