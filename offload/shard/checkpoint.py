"""Checkpoints of a sharded model and its optimizer, saved on N ranks, loaded on any M.

[Note: stage 3 checkpoint] ``save_checkpoint(model, optimizer, DIR)`` writes one file per
rank, ``offload-shard.<gen>.rank<r>.pt`` (``torch.save``: this rank's chunk of every unit
flat, ``FlatParam.shard_values()``, the optimizer's ``state_dict()`` entry of each shard
param: torch's layout, states of ``chunk`` elements, float32 even for int8 / bf16 states,
and ``step``, and this rank's persistent buffers: ckpt_buffers.py), then rank 0 writes the
manifest ``offload-shard.json`` last, atomically (tmp file, fsync, rename:
fsutil.write_json_atomic): world size, each flat's unit, dtype, chunk and params (names,
shapes, slots), the buffers' names and shapes, the optimizer's class, state names, param_groups'
hyperparameters (ckpt_groups), each flat's step and state names, each file's bytes and
crc32. A generation number in the file names keeps the previous checkpoint's files until
the new manifest names the new ones, so a save killed at any point leaves the previous
checkpoint loadable; ``offload-shard.pending.json`` (written before any rank file) names what
a save creates, so the next save removes what a killed one left (no name pattern decides,
as swap/ckpt_dir.py). Rank 0 holds ckpt_dir's exclusive directory lock while it saves; each
rank a shared one while it loads.

``load_checkpoint`` on M ranks: in each flat's element space (the params end to end, then
zero padding) rank r's new chunk is ``[r * chunk_M, (r + 1) * chunk_M)``; it reads, with
``torch.load(mmap=True)``, only the old ranks' files whose chunks overlap it, after checking
their size and crc32, and copies the overlaps (beyond the old padded end: zeros, as the
padding is). Everything is checked and built first, on every rank, and the ranks agree
(``_agree``) before any of them changes its model or optimizer: a bad checkpoint is refused
on every rank, with the same ValueError, or loaded on all. The optimizer's states go in
through its own ``load_state_dict`` (int8 / bf16 states are encoded there).
"""
from __future__ import annotations

import os
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from offload.shard.api import runtime_of
from offload.shard.ckpt_buffers import (apply_buffers, buffers_from, check_buffers, describe_buffers,
                                        persistent_buffers, warn_without)
from offload.shard.ckpt_plan import (check_model, check_optimizer, describe_flats, element_keys, group_of,
                                     optimizer_entries, overlaps, rebuild_scalar, scalar_of)
from offload.swap import fsutil
from offload.swap.ckpt_dir import DirLock, remove_quiet
from offload.swap.ckpt_groups import decode_groups, encode_groups

__all__ = ["save_checkpoint", "load_checkpoint", "MANIFEST", "FORMAT", "VERSION"]

FORMAT = "offload-shard-ckpt"
VERSION = 1
MANIFEST = "offload-shard.json"
PENDING = "offload-shard.pending.json"
_READ = 16 << 20
_KINDS = {k.__name__: k for k in (ValueError, TypeError, OSError, FileNotFoundError, NotImplementedError)}


def _rank_name(gen: int, rank: int) -> str:
    return f"offload-shard.{gen}.rank{rank}.pt"


def _tmp_name(gen: int, rank: int) -> str:
    return f".{_rank_name(gen, rank)}.tmp"


def _before_manifest() -> None:
    """Between the rank files and the manifest: a seam for the kill -9 test, nothing else."""


# ---------------------------------------------------------------------- the ranks agree
def _agree(fn: Callable[[], Any], what: str, group: Any, world: int, share: bool = False) -> List[Any]:
    """Run ``fn`` on this rank; every rank learns whether every rank's succeeded (a
    collective). A failure raises on every rank: its own exception where it happened, the
    same kind (ValueError, TypeError, OSError) naming the rank elsewhere, so no rank goes on
    alone. ``share``: returns every rank's result (small, picklable), else [this rank's]."""
    err: Optional[BaseException] = None
    out = None
    try:
        out = fn()
    except Exception as exc:  # reported to every rank, then raised
        err = exc
    if world == 1:
        if err is not None:
            raise err
        return [out]
    mine = (None if err is None else (type(err).__name__, str(err)), out if share and err is None else None)
    got: List[Any] = [None] * world
    dist.all_gather_object(got, mine, group=group)
    if err is not None:
        raise err
    for r, (failure, _) in enumerate(got):
        if failure is not None:
            kind = _KINDS.get(failure[0], RuntimeError)
            raise kind(f"{what} failed on rank {r}: {failure[1]}")
    return [v for _, v in got] if share else [out]


def _releasing(fn: Callable[[], Any], held: Dict[str, Any]) -> Callable[[], Any]:
    """``fn``, then this rank's directory lock released, both before the last agreement: a
    rank leaves save_checkpoint / load_checkpoint only once every rank's lock is gone, so its
    next call on the directory (a load right after the save, a save right after the load)
    never meets the lock another rank has not yet let go of (CheckpointBusy)."""
    def run() -> Any:
        try:
            return fn()
        finally:
            lock = held.pop("lock", None)
            if lock is not None:
                lock.release()
    return run


def _sharded(model: nn.Module) -> Tuple[List[Any], Any, int, int]:
    runtime = runtime_of(model)
    if runtime is None:
        raise ValueError("a stage 3 checkpoint needs a module changed by offload.shard()")
    flats = [(u.name, f) for u in runtime.units for f in u.flats]
    group = flats[0][1].shard._offload_shard.group if flats else None
    return flats, group, runtime.world, runtime.rank


class _Crc:
    """A file object that sums the crc32 and the bytes of what goes through it, and keeps the
    OSError a write raised: torch.save's writer turns it into a RuntimeError without errno or
    path ("unexpected pos ..."), which is all a full disk would show."""

    def __init__(self, f: Any) -> None:
        self.f, self.crc, self.n = f, 0, 0
        self.error: Optional[OSError] = None

    def write(self, b: Any) -> int:
        self.crc = zlib.crc32(b, self.crc)
        self.n += len(memoryview(b).cast("B"))
        try:
            return self.f.write(b)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


# ---------------------------------------------------------------------- save
@torch.no_grad()
def save_checkpoint(model: nn.Module, optimizer: Any, directory: str) -> str:
    """Save this rank's shards of ``model`` (changed by ``offload.shard``) and the states of
    ``optimizer`` (None: the params only) into ``directory``: a collective every rank of the
    model's group calls, between steps. Loadable on any number of ranks
    (``load_checkpoint``); the previous checkpoint in ``directory`` stays loadable until the
    new one is complete. Returns the directory."""
    flats, group, world, rank = _sharded(model)
    bufs = persistent_buffers(model)
    directory = os.path.abspath(directory)
    entries = _agree(lambda: optimizer_entries(optimizer, [f for _, f in flats]), "saving the checkpoint",
                     group, world)[0]
    held: Dict[str, Any] = {}
    try:
        gen = _agree(lambda: _begin(directory, world, held) if rank == 0 else None,
                     f"starting a checkpoint in {directory}", group, world, share=True)[0]
        infos = _agree(lambda: _write_rank(directory, gen, rank, flats, entries, bufs),
                       f"writing the checkpoint files in {directory}", group, world, share=True)
        _agree(_releasing(lambda: _commit(directory, gen, world, flats, optimizer, infos, held, bufs) if rank == 0
                          else None, held), f"writing the checkpoint manifest in {directory}", group, world)
    finally:
        lock = held.pop("lock", None)
        if lock is not None:
            lock.release()
    return directory


def _begin(directory: str, world: int, held: Dict[str, Any]) -> int:
    """Rank 0: the lock, the generation, the pending record (what this save will create,
    and what an earlier save that died left) before any rank file exists."""
    fsutil.make_checkpoint_dir(directory)
    held["lock"] = DirLock(directory, exclusive=True)
    old = read_manifest(directory, fsutil.SAVE_ADVICE) if os.path.lexists(os.path.join(directory, MANIFEST)) else None
    try:
        pending = fsutil.read_json(os.path.join(directory, PENDING))
    except (FileNotFoundError, ValueError):
        pending = None
    keep = set(old["files"]) if old else set()
    # a save that died left its new files (killed before its manifest) or the ones it retires
    # (after it, before their removal: "old", as swap/ckpt_dir.py records them)
    named = list(pending.get("files") or []) + list(pending.get("old") or []) if isinstance(pending, dict) else []
    left = [n for n in named if isinstance(n, str) and os.path.basename(n) == n and n not in keep]
    gen = max(int(old["gen"]) if old else 0, int(pending.get("gen", 0)) if isinstance(pending, dict) else 0) + 1
    mine = [_rank_name(gen, r) for r in range(world)] + [_tmp_name(gen, r) for r in range(world)]
    fsutil.write_json_atomic(directory, PENDING, {"gen": gen, "files": sorted(set(mine + left)),
                                                  "old": sorted(keep)})
    held.update(old=old, left=left)
    return gen


def _write_rank(directory: str, gen: int, rank: int, flats: List[Any], entries: List[Any],
                bufs: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """This rank's file: written as a tmp file, fsynced, renamed to its final name."""
    payload = {"format": FORMAT, "rank": rank, "params": [f.shard_values() for _, f in flats], "states": entries,
               "buffers": {k: b.detach().to("cpu", copy=True) for k, b in bufs.items()}}
    tmp, final = os.path.join(directory, _tmp_name(gen, rank)), os.path.join(directory, _rank_name(gen, rank))
    w = None
    try:
        with open(tmp, "wb") as f:
            w = _Crc(f)
            torch.save(payload, w)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:
        remove_quiet(tmp)  # a full disk: free what the partial file took (the pending record names it too)
        err = w.error if w is not None and w.error is not None else exc
        if not isinstance(err, OSError):
            raise
        raise OSError(err.errno, f"writing the checkpoint file failed: {err.strerror}", tmp) from exc
    os.rename(tmp, final)
    fsutil.fsync_dir(directory)
    scalars = [None if e is None else {k: scalar_of(v) for k, v in e.items() if k not in element_keys(e, f.chunk)}
               for e, (_, f) in zip(entries, flats)]
    states = [None if e is None else sorted(element_keys(e, f.chunk)) for e, (_, f) in zip(entries, flats)]
    return {"file": _rank_name(gen, rank), "bytes": w.n, "crc32": w.crc, "scalars": scalars, "states": states}


def _commit(directory: str, gen: int, world: int, flats: List[Any], optimizer: Any, infos: List[Dict[str, Any]],
            held: Dict[str, Any], bufs: Dict[str, torch.Tensor]) -> None:
    """Rank 0: the manifest (the checkpoint exists from here on), then the previous
    generation's files and the leftovers of a save that died, then the pending record."""
    for r, info in enumerate(infos[1:], 1):
        if info["scalars"] != infos[0]["scalars"] or info["states"] != infos[0]["states"]:
            raise ValueError(f"rank {r}'s optimizer states differ from rank 0's in their steps or names "
                             f"({info['scalars']} against {infos[0]['scalars']}): a step that ran on some ranks "
                             "only (one interrupted on the others), or not one stage 3 optimizer")
    desc = describe_flats(flats)
    for d, sc, st, (_, f) in zip(desc, infos[0]["scalars"], infos[0]["states"], flats):
        d.update(scalars=sc, states=st, group=None if optimizer is None else group_of(optimizer, f.shard))
    opt = None
    if optimizer is not None:
        names = getattr(optimizer, "state_names", None)
        opt = {"class": type(optimizer).__name__, "state_names": list(names()) if names is not None else None,
               "param_groups": encode_groups(optimizer.param_groups)}
    manifest = {"format": FORMAT, "version": VERSION, "gen": gen, "world": world, "flats": desc, "buffers": describe_buffers(bufs),
                "optimizer": opt,
                "files": [i["file"] for i in infos], "bytes": [i["bytes"] for i in infos],
                "crc32": [i["crc32"] for i in infos]}
    _before_manifest()
    fsutil.write_json_atomic(directory, MANIFEST, fsutil.sealed(manifest))
    old = held.get("old")
    done = set(manifest["files"])
    stale = [n for n in (list(old["files"]) if old else []) + list(held.get("left") or []) if n not in done]
    if all([remove_quiet(os.path.join(directory, n)) for n in stale]):
        remove_quiet(os.path.join(directory, PENDING))
    fsutil.fsync_dir(directory)


def read_manifest(directory: str, advice: str = fsutil.LOAD_ADVICE) -> Dict[str, Any]:
    """The manifest of the stage 3 checkpoint in ``directory``, its shape checked."""
    path = os.path.join(directory, MANIFEST)
    try:
        m = fsutil.unsealed(fsutil.read_json(path), path, advice)
    except FileNotFoundError:
        raise FileNotFoundError(2, "no stage 3 checkpoint here (its manifest is missing)", path) from None
    except NotADirectoryError:
        raise fsutil.not_a_checkpoint_dir(directory, "load") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a stage 3 checkpoint manifest")
    if m.get("version") != VERSION:
        raise ValueError(f"{path}: checkpoint format version {m.get('version')!r}, this offload reads {VERSION}")
    world = m.get("world")
    files = m.get("files")
    if not isinstance(world, int) or world < 1 or not isinstance(files, list) or len(files) != world \
            or not all(isinstance(n, str) and os.path.basename(n) == n for n in files) \
            or not isinstance(m.get("flats"), list) or len(m.get("crc32") or []) != world \
            or len(m.get("bytes") or []) != world:
        raise ValueError(f"{path}: the manifest's world, files, crc32 or flats are malformed")
    return m


# ---------------------------------------------------------------------- load
@torch.no_grad()
def load_checkpoint(model: nn.Module, optimizer: Any, directory: str) -> None:
    """Load a checkpoint of ``save_checkpoint`` (saved on any number of ranks) into
    ``model`` (changed by ``offload.shard`` alike: same params, units and dtypes) and
    ``optimizer`` (the same class and states; None: the params only). A collective every
    rank calls, between steps. All or nothing on every rank: ValueError (naming what
    differs, or the file that is missing, truncated or corrupt) before anything changes."""
    flats, group, world, rank = _sharded(model)
    bufs = persistent_buffers(model)
    directory = os.path.abspath(directory)
    held: Dict[str, Any] = {}
    try:
        prepared, loaded, share = _agree(lambda: _prepare(directory, flats, bufs, optimizer, world, rank, held),
                                         f"loading the checkpoint in {directory}", group, world)[0]
        if share:  # saved on another number of ranks: every rank takes the old rank 0's, which rank 0 read
            loaded = _agree(lambda: loaded if rank == 0 else None, f"loading the buffers in {directory}", group,
                            world, share=True)[0]
        _agree(_releasing(lambda: _apply(prepared, flats, optimizer, bufs, loaded), held),
               f"loading the checkpoint in {directory}", group, world)
    finally:
        lock = held.pop("lock", None)
        if lock is not None:
            lock.release()
    if loaded is None:
        warn_without(bufs, directory)


def _prepare(directory: str, flats: List[Any], bufs: Dict[str, torch.Tensor], optimizer: Any, world: int, rank: int,
             held: Dict[str, Any]) -> Tuple[Tuple[List[torch.Tensor], Any], Any, bool]:
    """Check everything and build this rank's new shards and optimizer state dict (no change
    yet); its buffers ([Note: stage 3 checkpoint buffers]: None in a checkpoint without them,
    and on the ranks but 0 when the world size changed: ``share``, rank 0 passes them on)."""
    held["lock"] = DirLock(directory, exclusive=False)
    m = read_manifest(directory)
    path = os.path.join(directory, MANIFEST)
    check_model(m, flats, path)
    check_buffers(m, bufs, path)
    check_optimizer(m, optimizer, flats, path)
    spans = [overlaps(d["chunk"], m["world"], f.chunk, rank) for d, (_, f) in zip(m["flats"], flats)]
    files = {q: _open_checked(directory, m, q) for q in sorted({q for s in spans for q, *_ in s})}
    values, entries = [], []
    for i, ((_, f), span, d) in enumerate(zip(flats, spans, m["flats"])):
        values.append(_gather(span, f.chunk, f.dtype, lambda q: files[q]["params"][i], d["chunk"], files, m, i))
        if d.get("states") is None or optimizer is None:
            entries.append(None)
            continue
        entry = {k: rebuild_scalar(v) for k, v in (d.get("scalars") or {}).items()}
        for key in d["states"]:
            like = _state_like(files, i, key)
            entry[key] = _gather(span, f.chunk, like, lambda q: files[q]["states"][i][key], d["chunk"], files, m, i)
        entries.append(entry)
    loaded, share = None, m.get("buffers") is not None and m["world"] != world
    src = rank if m["world"] == world else 0
    if m.get("buffers") is not None and (src == rank or rank == 0):
        loaded = buffers_from(m, files.get(src) or _open_checked(directory, m, src),
                              os.path.join(directory, m["files"][src]))
    return (values, None if optimizer is None else _state_dict(m, optimizer, flats, entries, path)), loaded, share


def _state_like(files: Dict[int, Any], i: int, key: str) -> torch.dtype:
    for data in files.values():
        st = data["states"][i]
        if st is not None and key in st:
            return st[key].dtype
    return torch.float32  # no old rank overlaps this chunk (all padding): zeros of any float type


def _gather(span: List[Tuple[int, int, int, int]], chunk: int, dtype: torch.dtype, source: Callable[[int], Any],
            old_chunk: int, files: Dict[int, Any], m: Dict[str, Any], i: int) -> torch.Tensor:
    """This rank's new chunk of one flat (or one state of it) from the old ranks' pieces."""
    out = torch.zeros(chunk, dtype=dtype)
    for q, lo, hi, dst in span:
        t = source(q)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != old_chunk:
            raise ValueError(f"{m['files'][q]}: flat {i} holds {getattr(t, 'shape', type(t).__name__)}, the "
                             f"manifest says {old_chunk} elements: not the file the manifest names")
        out[dst:dst + hi - lo].copy_(t[lo:hi])
    return out


def _open_checked(directory: str, m: Dict[str, Any], q: int) -> Dict[str, Any]:
    """Old rank ``q``'s file, its size and crc32 checked against the manifest, mmapped."""
    path = os.path.join(directory, m["files"][q])
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise ValueError(f"{path}: the checkpoint's file of rank {q} (of {m['world']}) is missing") from None
    if size != m["bytes"][q]:
        raise ValueError(f"{path}: {size} bytes, the manifest says {m['bytes'][q]}: the file is truncated or "
                         "was replaced")
    crc = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(_READ)
            if not b:
                break
            crc = zlib.crc32(b, crc)
    if crc != m["crc32"][q]:
        raise ValueError(f"{path}: crc32 {crc:#010x}, the manifest says {m['crc32'][q]:#010x}: the file is corrupt")
    data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("rank") != q \
            or len(data.get("params") or []) != len(m["flats"]) or len(data.get("states") or []) != len(m["flats"]):
        raise ValueError(f"{path}: not rank {q}'s file of this checkpoint")
    return data


def _state_dict(m: Dict[str, Any], optimizer: Any, flats: List[Any], entries: List[Any],
                path: str) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """The optimizer's state dict for this rank's shard params (the built entries under
    their indices, the saved hyperparameters over the current groups'), and each group's
    keys the checkpoint does not hold."""
    groups = optimizer.param_groups
    saved = decode_groups((m.get("optimizer") or {}).get("param_groups"), groups, path,
                          getattr(optimizer, "check_group", None))
    index = {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}
    state = {index[id(f.shard)]: e for (_, f), e in zip(flats, entries) if e is not None}
    out_groups, start = [], 0
    for g, hyper in zip(groups, saved):
        out_groups.append(dict({k: v for k, v in g.items() if k != "params"}, **hyper,
                               params=list(range(start, start + len(g["params"])))))
        start += len(g["params"])
    # the keys the checkpoint could not hold keep their values (torch's load deep-copies them)
    kept = [{k: v for k, v in g.items() if k != "params" and k not in hyper} for g, hyper in zip(groups, saved)]
    return {"state": state, "param_groups": out_groups}, kept


def _apply(prepared: Tuple[List[torch.Tensor], Any], flats: List[Any], optimizer: Any, bufs: Dict[str, torch.Tensor],
           loaded: Optional[Dict[str, torch.Tensor]]) -> None:
    values, loadable = prepared
    if loadable is not None and getattr(optimizer, "_store", None) is not None:
        from offload.optim.state_io import check_loadable

        # all or nothing: checked before the params change, in the form the optimizer's load
        # takes it to (SGD's torch layout holds no "step": its load counts one)
        check_loadable(optimizer, optimizer.loadable_form(loadable[0]))
    # The params first: a load without masters (fp32 params) takes them from the params, so they
    # must hold the checkpoint's values by then (the step started from the old ones)
    for (_, f), v in zip(flats, values):
        f.set_shard_values(v)
    if loaded is not None:
        apply_buffers(bufs, loaded)
    if loadable is not None:
        sd, kept = loadable
        optimizer.load_state_dict(sd)
        for g, keys in zip(optimizer.param_groups, kept):
            g.update(keys)
