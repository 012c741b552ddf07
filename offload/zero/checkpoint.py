"""Checkpoints of flat groups as per-rank shards, loadable on any number of ranks.

[Note: flat checkpoints] ``save_shards(DIR)`` writes, per rank, ``DIR/rank<r>/`` with that
rank's shards of master, exp_avg and exp_avg_sq (the swap layer's streamed checkpoint
format, ``offload.swap.checkpoint.save_tensors``) and a meta block with the world size, the
numels of each flat group and whatever the caller adds (the optimizer: every param's step).
``load_shards(DIR)`` on M ranks reads the N shards back through the same ``FlatLayout``
arithmetic and keeps, on each rank, the intersection with its new shard: N -> M with no
gather and no full copy in memory (one old shard at a time), reading only the old ranks whose
shards overlap the new one. ``check_shards`` first reads those files through and checks their
crc32, so a load can refuse a bad checkpoint before it overwrites anything (the optimizer
agrees on that across ranks, then loads: see FlatState.load_checkpoint).

With ``offload="nvme"`` the states are a swap store whose element space is exactly a rank's
file (the shards of the groups end to end): ``save_shards_from_store`` streams it out with
the swap layer's ``save_store``, and ``fill_store_from_shards`` streams a checkpoint back
into the store's free slots, sub-group by sub-group, reading from each old rank's files the
runs that land in it (N -> M without ever holding a shard in memory).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from offload.io import open_file
from offload.kernels import quant
from offload.kernels.fields import ADAM, StateField, field_names
from offload.kernels.quant import BLOCK
from offload.swap.checkpoint import (stream_groups, load_store, load_tensors, read_manifest, save_store, save_tensors,
                                     verify_checkpoint)
from offload.swap.ckpt_dir import CKPT_MANIFEST, DirLock
from offload.swap.ckpt_schema import check_steps_cover
from offload.swap.pipeline import vote_failed
from offload.zero.comm import all_or_none, broadcast, comm_device, failed_ranks
from offload.zero.flat_group import FlatGroup
from offload.zero.partition import FlatLayout

__all__ = ["save_shards", "check_shards", "load_shards", "save_shards_from_store", "fill_store_from_shards",
           "reading_shards", "SHARD_FIELDS", "IN_PLACE_FIELDS", "checkpoint_fields"]

# The two kinds of checkpoint and swapped store (the one list of their state fields):
SHARD_FIELDS: Tuple[StateField, ...] = ADAM.with_master()
"""The flat store's: a flat group's ``fg.master``, ``fg.exp_avg``, ... (fp16/bf16 or device params)."""
IN_PLACE_FIELDS: Tuple[StateField, ...] = ADAM.fields
"""Stage 0's: fp32 CPU params are their own master, updated in place; only Adam's fields."""


def checkpoint_fields(manifest: Dict[str, Any]) -> Tuple[StateField, ...]:
    """The typed fields a checkpoint manifest holds: its ``fields`` (names and dtypes), or,
    in a manifest of the previous release, its ``states`` all of its one ``dtype``."""
    if isinstance(manifest.get("fields"), list):  # with each field's block (packed int8 states)
        return tuple(StateField.from_description(d) for d in manifest["fields"])
    return tuple(StateField.from_description({"name": n, "dtype": manifest.get("dtype", "float32")})
                 for n in manifest.get("states") or [])


def _describe(fields: Sequence[StateField]) -> str:
    names = ", ".join(f"{f.name} ({f.dtype_name}{' in blocks of %d, %s code' % (f.block, f.code) if f.block else ''})"
                      for f in fields)
    if not fields:  # a rule without state per element saved only its steps and param_groups
        names = "no state (a rule that keeps none, as SGD without momentum)"
    if any(f.name == "master" for f in fields):
        return f"{names}: the flat store's (fp16/bf16 or device params, or stage 1/2)"
    # no master: fp32 CPU params are their own, and bf16 params with master_dtype="bfloat16" too
    return (f"{names}: no fp32 master (fp32 CPU params updated in place at stage 0, offload='none', 'cpu' or "
            "'nvme'; or bf16 params with master_dtype='bfloat16')")


def save_shards(directory: str, groups: List[FlatGroup], *, world: int, rank: int, meta: Dict[str, Any],
                process_group: Any = None) -> None:
    fields = _fields_of(groups)
    states = {f.name: [fg.state(f.name) for fg in groups if fg.layout.shard] for f in fields}
    full_meta = dict(meta, kind="flat", world=world, rank=rank, groups=[list(fg.layout.numels) for fg in groups])
    numel = sum(fg.layout.shard for fg in groups)  # packed blocks: shards of whole blocks, end to end
    _save_on_every_rank(lambda agree: save_tensors(_rank_dir(directory, rank), states, full_meta, agree=agree,
                                                   fields=fields, numel=numel),
                        full_meta, directory, world, process_group)


def _fields_of(groups: List[FlatGroup]) -> Tuple[StateField, ...]:
    """What the flat groups keep per element (one rule for all: the store's)."""
    return groups[0].fields if groups else SHARD_FIELDS


def _rank_dir(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}")


def _save_on_every_rank(save: Callable[[Any], Any], meta: Dict[str, Any], directory: str, world: int,
                        process_group: Any, before: Optional[Callable[[], Any]] = None) -> None:
    """[Note: shards saved all or none] Every rank writes its shard's files, the ranks agree,
    every rank replaces its manifest, they agree again (a rank whose commit went through
    while another's failed puts its previous manifest back): the ranks' shards stay those of
    one save. ``save_id`` (rank 0's, broadcast) in every shard's meta catches what no vote
    can, a rank killed between the commits; the load refuses shards of two saves. The last
    vote is a barrier: no rank returns (and loads) while another still holds its lock.
    ``before``: run first, inside the first half (a rank failing there is voted on too)."""
    what = f"save_checkpoint({directory!r})"
    vote = None if world == 1 else functools.partial(failed_ranks, group=process_group)
    meta["save_id"] = _save_id(vote is not None, process_group)

    entered = []

    def agree(prepare: Callable[[], Any], commit: Callable[[Any], None], undo: Callable[[], str]) -> Any:
        entered.append(True)
        return all_or_none(lambda: (before and before(), prepare())[1], commit, undo, what, vote)

    try:
        save(agree)
    except BaseException:
        if vote is not None:
            if not entered:  # failed before its first vote: cast it, as all_or_none would have
                vote_failed(vote, what)
            try:
                vote(True)
            except Exception:  # the process group itself is broken: the error raised says enough
                pass
        raise
    if vote is not None:
        vote(True)


def _save_id(shared: bool, group: Any) -> int:
    t = torch.tensor([int.from_bytes(os.urandom(6), "little")], dtype=torch.int64)
    if shared:
        t = t.to(comm_device(group))
        broadcast(t, 0, group)
    return int(t.item())


def _flat_meta(directory: str, mine: List[List[int]],
               fields: Sequence[StateField] = SHARD_FIELDS) -> Tuple[Dict[str, Any], int]:
    """Rank 0's meta and the world size of checkpoint ``directory``, checked against ``mine``
    (the numels of each flat group) and the ``fields`` the loading store keeps."""
    where = os.path.join(directory, "rank0")
    if not os.path.lexists(os.path.join(where, CKPT_MANIFEST)) and os.path.lexists(os.path.join(directory, CKPT_MANIFEST)):
        raise ValueError(f"{directory}: a checkpoint of the previous release's single-directory format, which holds "
                         f"{_describe(checkpoint_fields(read_manifest(directory)))}; this optimizer keeps "
                         f"{_describe(fields)}: load it with an optimizer of the kind that saved it")
    manifest = read_manifest(where)
    theirs = checkpoint_fields(manifest)
    # first: the other kind of store groups its params otherwise too
    if theirs != tuple(fields) and not recodes(theirs, fields):
        hint = ""
        if any(f.name == "master" for f in theirs) and not any(f.name == "master" for f in fields):
            # fp32 CPU params at stage 0 keep no master; stage 1 or 2 takes the flat store,
            # whatever the world size (one process included)
            hint = " (fp32 CPU params: pass stage=1 or 2, as the job that saved it ran, in any world size)"
        how = ("the same state_dtype / master_dtype); to convert, move its state_dict() (float32, torch's layout) "
               "into this one with load_state_dict()")
        if {f.name for f in theirs} - {f.name for f in fields} == {"max_exp_avg_sq"}:
            # (a store built without amsgrad keeps no third field; its load_state_dict refuses too)
            how = ("amsgrad=True in at least one param group: a group may turn it off after, and its params keep "
                   "their max_exp_avg_sq, as torch's)")
        raise ValueError(f"{directory}: the checkpoint holds {_describe(theirs)}; this optimizer keeps "
                         f"{_describe(fields)}: load it with an optimizer of the kind that saved it{hint} ({how}")
    first = manifest.get("meta", {})
    old_world = int(first.get("world", 0))
    if first.get("kind") != "flat" or first.get("groups") != mine or old_world < 1:
        raise ValueError(f"{directory}: not a flat-store checkpoint of these params (params of other shapes: its "
                         f"groups of numels {first.get('groups')}, ours {mine})")
    # one count per param (the groups' numels), checked before anything is loaded
    check_steps_cover(first, sum(len(g) for g in mine), os.path.join(where, CKPT_MANIFEST), required=False)
    return first, old_world


def recodes(theirs: Sequence[StateField], mine: Sequence[StateField]) -> bool:
    """Whether a checkpoint of fields ``theirs`` differs from ``mine`` only in int8 codes a
    load converts block by block as it reads (the first int8 checkpoints' "unsigned"
    exp_avg_sq, [Note: square-root code] in kernels/quant.py): same names, dtypes, blocks."""
    return (len(theirs) == len(mine) and tuple(theirs) != tuple(mine)
            and all(a == b or (a.name, a.dtype, a.block) == (b.name, b.dtype, b.block) and a.block
                    for a, b in zip(theirs, mine)))


def stored_fields(directory: str, fields: Sequence[StateField]) -> Tuple[StateField, ...]:
    """The fields rank 0 of flat checkpoint ``directory`` stores: ``fields``, or theirs where
    they differ only in codes (:func:`recodes`). The files are read as stored, then recoded."""
    theirs = checkpoint_fields(read_manifest(os.path.join(directory, "rank0")))
    return theirs if recodes(theirs, fields) else tuple(fields)


def recode(packed: torch.Tensor, theirs: StateField, mine: StateField) -> None:
    """Whole packed blocks of ``theirs`` (a 1-D uint8 tensor) in ``mine``'s code, in place."""
    if theirs.code != mine.code:
        quant.recode_blocks(packed, theirs.signed, theirs.code, mine.code)


def _old_layouts(layouts: Sequence[FlatLayout], old_world: int) -> List[List[FlatLayout]]:
    """Each old rank's layouts of the same groups. The block alignment is the loader's: it
    follows from the fields (blocked int8 moments align to their blocks), which
    :func:`_flat_meta` has checked are the saver's, so the old shards are as long as saved."""
    return [[FlatLayout(lay.numels, old_world, r, lay.align) for lay in layouts] for r in range(old_world)]


def _needed(layouts: Sequence[FlatLayout], olds: List[List[FlatLayout]]) -> List[int]:
    """The old ranks whose shards overlap this rank's new ones (the only files it reads)."""
    def overlap(new: FlatLayout, old: FlatLayout) -> bool:
        return max(new.shard_range()[0], old.shard_range()[0]) < min(new.shard_range()[1], old.shard_range()[1])

    return sorted({r for r, old in enumerate(olds) for lay, o in zip(layouts, old) if lay.shard and overlap(lay, o)})


def _check_rank_meta(path: str, meta: Dict[str, Any], r: int, old_world: int, first: Dict[str, Any]) -> None:
    if meta.get("rank") != r or meta.get("world") != old_world:
        raise ValueError(f"{path}: meta says rank {meta.get('rank')} of {meta.get('world')}, expected {r} of {old_world}")
    if meta.get("save_id") != first.get("save_id"):  # (None in both for the previous release's shards)
        raise ValueError(f"{path}: this shard was written by another save than rank 0's (save id "
                         f"{meta.get('save_id')}, rank 0's {first.get('save_id')}): a save was interrupted on some "
                         "ranks and the directory holds no complete checkpoint; load an older one or save again")


def check_shards(directory: str, layouts: Sequence[FlatLayout], *, engine: Any = None,
                 stage: Any = None, fields: Sequence[StateField] = SHARD_FIELDS) -> Dict[str, Any]:
    """Read through every file of checkpoint ``directory`` that this rank's shards of
    ``layouts`` need (manifests, sizes, crc32), changing nothing; returns rank 0's meta.
    The first half of a load that must not stop half-way (see FlatState.load_checkpoint)."""
    mine = [list(lay.numels) for lay in layouts]
    first, old_world = _flat_meta(directory, mine, fields)
    theirs = stored_fields(directory, fields)
    olds = _old_layouts(layouts, old_world)
    for r in _needed(layouts, olds):
        path = os.path.join(directory, f"rank{r}")
        m = verify_checkpoint(path, list(theirs), sum(lay.shard for lay in olds[r]), io_engine=engine,
                              stage=stage)
        _check_rank_meta(path, m.get("meta") or {}, r, old_world, first)
    return first


def load_shards(directory: str, groups: List[FlatGroup]) -> Dict[str, Any]:
    """Fill the groups' shards from checkpoint ``directory``; returns rank 0's meta. Copies as
    it reads, one old shard at a time: run :func:`check_shards` first, or a bad file met
    half-way leaves the groups part old, part new."""
    mine = [list(fg.layout.numels) for fg in groups]
    fields = _fields_of(groups)
    first, old_world = _flat_meta(directory, mine, fields)
    theirs = stored_fields(directory, fields)
    olds = _old_layouts([fg.layout for fg in groups], old_world)
    for r in _needed([fg.layout for fg in groups], olds):
        scratch = {f.name: [torch.empty(f.storage_numel(lay.shard), dtype=f.storage_dtype) for lay in olds[r]
                            if lay.shard] for f in fields}
        path = os.path.join(directory, f"rank{r}")
        _check_rank_meta(path, load_tensors(path, scratch, fields=theirs), r, old_world, first)
        for t, f in zip(theirs, fields):  # a shard is whole blocks (the last one padded)
            for x in scratch[f.name]:
                recode(x, t, f)
        it = {k: iter(v) for k, v in scratch.items()}
        for fg, lay in zip(groups, olds[r]):
            if not lay.shard:
                continue
            src = {k: next(it[k]) for k in scratch}
            o0, o1 = lay.shard_range()
            n0, n1 = fg.layout.shard_range()
            a, b = max(o0, n0), min(o1, n1, fg.layout.total)
            if a < b:  # packed blocks: whole blocks (shards of whole blocks), the last one partial
                for f in fields:
                    n = f.storage_numel(b - a)
                    dst, at = fg.state(f.name), f.storage_offset(a - n0)
                    dst[at:at + n].copy_(src[f.name][f.storage_offset(a - o0):][:n])
    return first


def save_shards_from_store(directory: str, store: Any, buffers: List[Any], *, layouts: Sequence[FlatLayout],
                           meta: Dict[str, Any], process_group: Any = None,
                           before: Optional[Callable[[], Any]] = None) -> None:
    """``save_shards`` for a swap store holding this rank's shards of ``layouts`` end to end
    (master, exp_avg, exp_avg_sq): streamed through ``buffers``, never a shard in memory.
    ``before``: what must come first (committing the store's pending changes)."""
    world, rank = layouts[0].world, layouts[0].rank
    full_meta = dict(meta, kind="flat", world=world, rank=rank, groups=[list(lay.numels) for lay in layouts])
    _save_on_every_rank(lambda agree: save_store(store, buffers, _rank_dir(directory, rank), full_meta, agree=agree),
                        full_meta, directory, world, process_group, before)


def _bases(layouts: Sequence[FlatLayout], fields: Sequence[StateField], directory: str) -> List[int]:
    """Where each group's shard starts in a rank's element space (its files, its swap store),
    and the end: end to end; on whole blocks with packed int8 fields ([Note: blocks in the
    swap space] in optim/swapped_shards.py), which reshard N -> M as they are only when every
    shard is whole blocks (so that no block straddles two ranks)."""
    unit = BLOCK if any(f.blocked for f in fields) else 1
    if unit > 1 and any(lay.shard % unit for lay in layouts if lay.shard):
        raise ValueError(f"{directory}: states in blocks of {unit} move to another world size only with shards of "
                         f"whole blocks; these shards have {[lay.shard for lay in layouts]} elements")
    out, total = [], 0
    for lay in layouts:
        total = -(-total // unit) * unit
        out.append(total)
        total += lay.shard
    return out + [total]


@contextlib.contextmanager
def reading_shards(directory: str) -> Iterator[None]:
    """The shared lock of every rank directory of checkpoint ``directory`` for the whole of
    a load (its check and its copy), so no save slips in between ([Note: checkpoint lock])."""
    try:
        world = int(read_manifest(_rank_dir(directory, 0)).get("meta", {}).get("world", 1))  # (checked: ckpt_schema)
        # the rank directories there, not each of range(world): a world of 2**40 spun here
        ranks = sorted(int(n[4:]) for n in os.listdir(directory) if n[4:].isdigit() and n == f"rank{int(n[4:])}")
    except (OSError, ValueError, TypeError, AttributeError):
        world, ranks = 1, [0]  # the load's own reading says what is wrong
    with contextlib.ExitStack() as stack:
        for r in ranks:
            if r < world and os.path.isdir(_rank_dir(directory, r)):
                stack.enter_context(DirLock(_rank_dir(directory, r), exclusive=False))
        yield


def fill_store_from_shards(directory: str, layouts: Sequence[FlatLayout], store: Any, buffers: List[Any],
                           fields: Sequence[StateField] = SHARD_FIELDS) -> Tuple[Dict[str, Any], Dict[int, Any]]:
    """Stream a flat checkpoint of any world size into the free slots of ``store`` (this
    rank's shards of ``layouts`` end to end, holding ``fields``). Returns (meta, written) for
    ``store.commit``; nothing is committed here, so a bad checkpoint leaves the store as it was."""
    mine = [list(lay.numels) for lay in layouts]
    first, old_world = _flat_meta(directory, mine, fields)
    theirs = stored_fields(directory, fields)
    world, rank = layouts[0].world, layouts[0].rank
    if old_world == world and theirs == tuple(fields):  # the same shards: the rank's files are the store, as they are
        meta, written = load_store(store, buffers, os.path.join(directory, f"rank{rank}"))
        _check_rank_meta(os.path.join(directory, f"rank{rank}"), meta, rank, world, first)
        return first, written
    names = list(field_names(fields))
    olds = _old_layouts(layouts, old_world)
    old_base, new_base = _bases(olds[0], fields, directory), _bases(layouts, fields, directory)
    need = _needed(layouts, olds)
    files: Dict[Tuple[int, str], Any] = {}
    engine, layout = store.engine, store.layout
    try:
        for r in need:
            path = os.path.join(directory, f"rank{r}")
            m = verify_checkpoint(path, list(theirs), old_base[-1], io_engine=engine, stage=buffers[0].memoryview)
            _check_rank_meta(path, m.get("meta") or {}, r, old_world, first)
            for name in names:
                files[(r, name)] = open_file(os.path.join(path, m["files"][name]), write=False, direct=False)
        written: Dict[int, Any] = {}

        def process(g: int, buf: Any) -> None:
            s, e = layout.group_range(g)
            spans = layout.state_spans(g)  # each field's place in the region (fields of any size)
            view = buf.memoryview
            view[:layout.group_bytes(g)] = bytes(layout.group_bytes(g))  # padding stays zero
            for k, lay in enumerate(layouts):
                a, b = max(s, new_base[k]), min(e, new_base[k] + lay.shard)
                if a >= b:
                    continue
                pos0 = lay.shard_range()[0] + a - new_base[k]  # flat position in group k
                for r in need:
                    o0, o1 = olds[r][k].shard_range()
                    x, y = max(pos0, o0), min(pos0 + b - a, o1, lay.total)
                    if x >= y:
                        continue
                    for j, f in enumerate(fields):
                        file_off = f.nbytes(old_base[k] + x - o0)
                        at = spans[j][0] + f.nbytes(a - s + x - pos0)
                        dst = view[at:at + f.nbytes(y - x)]
                        name = f.name
                        got = engine.read(files[(r, name)], file_off, dst)
                        if got != len(dst):
                            raise OSError(errno.EIO, f"short read: {got} of {len(dst)} bytes at {file_off}",
                                          files[(r, name)].path)
            for j, (t, f) in enumerate(zip(theirs, fields)):  # a sub-group's state: whole blocks
                if t.code != f.code:
                    at, used, _ = spans[j]
                    recode(torch.frombuffer(view, dtype=torch.uint8, count=used, offset=at), t, f)
            written[g] = store.checksum(g, buf) if store.verify else None

        stream_groups(engine, buffers, list(range(layout.num_groups)), lambda g, buf: [], process, store.write_requests)
    finally:
        for f in files.values():
            f.close()
    return first, written
