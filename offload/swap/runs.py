"""Which swap directory is whose: a store is identified by its params, and resumes with its layout.

[Note: identity] One process may hold several swap stores on one ``swap_dir`` (two models,
two optimizers): their directories are named ``<run>``, ``<run>-2``, ... in creation order.
A resumed process that builds its optimizers in another order would take the other model's
directory, and when the two have the same number of elements nothing else would notice. So
each manifest records an identity of its params (a digest of their shapes, dtypes and
numels, and a short summary for messages), and ``resume=True`` opens the directory whose
identity matches, whatever its name; directories of older manifests, which have none, are
tried in creation order after those.

[Note: same identity] Several stores with the same identity (two models of the same shapes
and dtypes: a GAN's G and D of one architecture, two heads) are told apart by what else the
manifest records of the params. A store whose params are their own master (fp32 params
updated in place; bf16 params with ``master_dtype="bfloat16"`` in a one-rank job) records a
fingerprint of their values at each commit: the caller's ``check`` compares it, raising
``ParamsMismatch`` for other values, and the next directory of the identity is tried, so
each store finds its own whatever the order (when none matches, the first's error is raised,
naming the others). A store whose params are rebuilt from the master in the swap files (fp16
or bf16 params with an fp32 master, device or partitioned params) has no such record, and its
params are no evidence (fresh initial weights, alike for two models seeded alike, or whatever
the user loaded); own-master params in a job of several ranks are checked only once the
ranks agree on a step (a rank one step ahead goes back). Their directories are taken in
creation order, as before, with a warning (once per directory set and process) naming them:
the optimizers must be built in the order they were created, or given separate swap_dirs.
Comparing the params with the rounding of each directory's master was considered and not
done: it tells the directories apart only when the params hold the very step the swap files
hold (kept in place; a restart after a crash usually loads an older model checkpoint), and
it would read every candidate's master (sampled per piece and rank, device and paged params
included) at each resume.

[Note: layout on resume] The sub-group size fixes where each sub-group sits in the slot
files, so a resumed store must use the one in the manifest, whatever ``max_host_bytes`` now
is (the budget only sets the buffers). A ``sub_group_size`` given explicitly must agree
with it; a budget too small for three buffers of it is refused, naming the bound to pass.

[Note: restarts] A job restarted with the same ``swap_dir`` finds the directory its dead
predecessor left (its flock is free; a live process's is held). ``resume=False`` refuses it,
since its states may be the only copy; ``resume=True`` continues from it and fails when it is
missing. Two more modes:

- ``"auto"``: resume a left directory whose identity matches these params (for fp32
  in-place params, whose values are the user's, the manifest's fingerprint must match them
  too, checked by the state); start afresh when nothing was left; refuse, naming what
  differs, when what was left belongs to other params. One process only: ranks deciding
  each for itself could disagree, one resuming and another starting afresh.
- ``"discard"``: remove the directory a dead run left where this store goes, and start
  afresh. The recipe for a restart from a checkpoint that restores the optimizer (the
  Trainer's and accelerate's, through offload.integrations.hf): the checkpoint is older
  than the swap files, so they must not be resumed (fp32 params of the checkpoint do not
  match the swap's fingerprint), and the checkpoint's load replaces every state anyway.

Neither mode touches a directory whose lock is held: that raises ``DirectoryBusy``.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from offload.swap import fsutil
from offload.kernels.fields import StateField
from offload.swap.layout import ALIGN, SwapLayout, as_fields, elems_per_page, round_up
from offload.swap.pipeline import DEFAULT_MAX_HOST_BYTES, MIN_BUFFERS, plan_sub_groups
from offload.swap.fsutil import private_dir_name
from offload.swap.store import MANIFEST, SwapStore

__all__ = ["ParamsMismatch", "make_identity", "open_store", "open_run_store"]

_MAX_STORES = 64
_warned: Set[Tuple[str, ...]] = set()  # the directory sets already warned about ([Note: same identity])


class ParamsMismatch(ValueError):
    """A resume check's refusal of a directory whose identity matches but whose recorded
    fingerprint is not these params' values: another directory of the identity may be this
    store's ([Note: same identity])."""


def make_identity(facts: Dict[str, Any], summary: str) -> Dict[str, str]:
    """``{"digest", "summary"}`` for JSON ``facts`` (shapes, dtypes, numels ...)."""
    text = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    return {"digest": hashlib.sha256(text.encode()).hexdigest()[:32], "summary": summary}


def open_store(swap_dir: str, numel: int, state_names: Sequence[Union[str, StateField]], *, identity: Dict[str, str],
               max_host_bytes: Optional[int], sub_group_size: Optional[int], run_name: str, rank: int,
               verify: bool, resume: Union[bool, str], io_engine: Any,
               check: Optional[Callable[[SwapStore], bool]] = None) -> Tuple[SwapStore, int]:
    """(store, pipeline buffers) for ``numel`` elements of ``state_names``: a new directory,
    or with ``resume`` the one whose identity matches (see the module notes); ``store.resumed``
    says which ``resume="auto"`` chose. ``state_names``: names (fp32 states) or typed fields.
    ``check(store)``: the caller's resume check of a directory opened, whose errors refuse it
    (the directory stays), but for ``ParamsMismatch``, after which the next directory of the
    identity is tried; it returns whether a fingerprint recognised these params (False:
    several directories of the identity are a guess, warned: [Note: same identity])."""
    fields = as_fields(list(state_names))
    discard = resume == "discard"
    if resume == "auto":
        resume, unfinished = _auto_resume(swap_dir, run_name, rank, identity)
        discard = discard or unfinished  # a directory never committed goes, as a half-made one does
    if discard or not resume:
        sg, nbuf = plan_sub_groups(numel, fields, max_host_bytes, sub_group_size)
        store = open_run_store(swap_dir, SwapLayout(numel, sg, fields), fields, run_name=run_name, rank=rank,
                               verify=verify, resume=False, io_engine=io_engine, identity=identity,
                               discard_stale=discard)
        return store, nbuf
    return _resume(fsutil.check_parent_dir(swap_dir), numel, fields, identity=identity, max_host_bytes=max_host_bytes,
                   sub_group_size=sub_group_size, run_name=run_name, rank=rank, verify=verify, io_engine=io_engine,
                   check=check)


def _resume(parent: str, numel: int, fields: Sequence[StateField], *, identity: Dict[str, str],
            max_host_bytes: Optional[int], sub_group_size: Optional[int], run_name: str, rank: int, verify: bool,
            io_engine: Any, check: Optional[Callable[[SwapStore], bool]]) -> Tuple[SwapStore, int]:
    """``open_store``'s resume: the directories of the identity in creation order, then those
    without one; the first that opens and passes ``check`` ([Note: same identity])."""
    refused: List[str] = []
    ours: List[str] = []  # directories another optimizer of this process holds
    mismatched: List[Tuple[str, ParamsMismatch]] = []  # (path, error): the fingerprint names other values
    matching, unknown = _candidates(parent, run_name, rank, identity, refused)
    for name, manifest in matching + unknown:
        where = os.path.join(parent, private_dir_name(name, rank), MANIFEST)
        sg, nbuf = _resume_plan(manifest, where, numel, fields, max_host_bytes, sub_group_size)
        try:
            store = SwapStore(parent, SwapLayout(numel, sg, fields), state_names=fields, run_name=name,
                              rank=rank, verify=verify, resume=True, io_engine=io_engine, identity=identity)
        except fsutil.DirectoryBusy as exc:
            if exc.pid != os.getpid():
                raise
            ours.append(exc.filename)
            continue  # another optimizer of this process resumed it
        try:
            known = bool(check(store)) if check is not None else False
        except ParamsMismatch as exc:
            store.close(remove=False)
            mismatched.append((store.path, exc))
            continue  # another store's of the same shapes, maybe: ours may follow
        except BaseException:
            store.close(remove=False)  # a directory we were asked to resume stays
            raise
        if not known and len(matching) > 1:
            _warn_same_identity(parent, [os.path.join(parent, private_dir_name(n, rank)) for n, _ in matching],
                                store.path, identity)
        return store, nbuf
    if mismatched:
        others = [p for p, _ in mismatched[1:]] + [f"{p} (in use by another optimizer of this process)" for p in ours]
        err = mismatched[0][1]
        if not others:
            raise err
        raise ParamsMismatch(f"{err}. The other swap directories of params of these shapes and dtypes "
                             f"({identity['summary']}) do not hold these params either: {'; '.join(others)}") from None
    first = os.path.join(parent, private_dir_name(run_name, rank))
    if ours:  # matched these params (a live directory always has its identity)
        raise fsutil.DirectoryBusy(errno.EBUSY, "resume=True but the swap directory holding these params is in "
                                   "use by another optimizer of this process: close it first (its close("
                                   "keep_swap=True) keeps the directory for the resume)", ours[0], os.getpid())
    if refused:
        raise ValueError(f"{parent}: resume=True but no swap directory of run {run_name!r}, rank {rank} holds the "
                         f"states of these params ({identity['summary']}): {'; '.join(refused)}")
    raise FileNotFoundError(errno.ENOENT, "resume=True but there is no swap directory to resume from", first)


def _warn_same_identity(parent: str, paths: List[str], chosen: str, identity: Dict[str, str]) -> None:
    """Several directories of this identity and no fingerprint to tell them apart: a
    warning, once per directory set and process ([Note: same identity])."""
    key = (parent, identity["digest"], *paths)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"{parent}: {len(paths)} swap directories hold the states of params of the same shapes and dtypes "
                  f"({identity['summary']}): {', '.join(paths)}. Nothing in them tells them apart (no fingerprint "
                  f"of the params' values is kept with a master in the swap files), so they are resumed in creation order: this optimizer takes "
                  f"{chosen}. Build the optimizers in the order they were first created, or give each its own "
                  "swap_dir; in another order each would take another's states, and its params their weights")


def _auto_resume(swap_dir: str, run_name: str, rank: int, identity: Dict[str, str]) -> Tuple[bool, bool]:
    """``resume="auto"``: whether a directory left by a dead run holds these params' states
    (True), nothing was left (False), or only other params' states were (ValueError); and
    whether a directory left was never committed (its process died while building the
    optimizer, before the commit of step 0: manifest_check.check_committed), which no resume
    can open and a fresh store must replace."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise ValueError("resume='auto' decides on each rank alone, so ranks could disagree (one resuming, "
                         "another starting afresh): with several ranks pass resume=True, or resume='discard' "
                         "when a checkpoint restores the optimizer")
    parent = fsutil.check_parent_dir(swap_dir)
    other: List[str] = []
    unfinished = False
    for path in _left_dirs(parent, run_name, rank):
        try:
            m = fsutil.read_json(os.path.join(path, MANIFEST))
        except FileNotFoundError:
            continue  # a creation that died half-way: nothing to resume
        except (OSError, ValueError):
            return True, False  # resume=True names what is wrong with it
        if isinstance(m, dict) and not m.get("extra"):
            # its first manifest, written before the optimizer's commit of step 0 (a Ctrl-C or a
            # kill while the masters were first written): nothing to resume either
            unfinished = True
            continue
        found = m.get("identity") if isinstance(m, dict) else None
        if not isinstance(found, dict) or found.get("digest") == identity["digest"]:
            return True, False  # a match, or a manifest of an older offload (without identity): resume=True checks it
        other.append(f"{path} holds step {m.get('step', '?')} of other params ({found.get('summary')})")
    if other:
        raise ValueError(f"{parent}: resume='auto' found no swap directory of these params ({identity['summary']}) "
                         f"but {'; '.join(other)}: pass resume='discard' to remove it and start afresh, or "
                         "another swap_dir or run name")
    return False, unfinished


def _left_dirs(parent: str, run_name: str, rank: int) -> List[str]:
    """The directories of ``run_name`` and ``rank`` whose lock is free: left by a dead process."""
    out = []
    for k in range(1, _MAX_STORES + 1):
        path = os.path.join(parent, private_dir_name(run_name if k == 1 else f"{run_name}-{k}", rank))
        if not os.path.lexists(path):
            continue
        fd, holder = fsutil.try_lock(path)
        if fd is not None:
            os.close(fd)  # free: nobody uses it; the store takes the lock again
            out.append(path)
        elif holder is None:
            out.append(path)  # no lock file: a creation that died before taking it
    return out


def _candidates(parent: str, run_name: str, rank: int, identity: Dict[str, str],
                refused: List[str]) -> Tuple[List[Tuple[str, Dict[str, Any]]], List[Tuple[str, Dict[str, Any]]]]:
    """(run name, manifest or {}) of the directories to try: those of this identity, and those
    of a manifest without one (an older offload's), each in creation order."""
    matching, unknown = [], []
    for k in range(1, _MAX_STORES + 1):
        name = run_name if k == 1 else f"{run_name}-{k}"
        path = os.path.join(parent, private_dir_name(name, rank))
        if not os.path.lexists(path):
            continue
        try:
            m = fsutil.read_json(os.path.join(path, MANIFEST))
        except (OSError, ValueError):
            m = None  # the store says precisely what is wrong, if nothing else matches
        found = m.get("identity") if isinstance(m, dict) else None
        if not isinstance(found, dict):
            unknown.append((name, m if isinstance(m, dict) else {}))
        elif found.get("digest") == identity["digest"]:
            matching.append((name, m))
        else:
            refused.append(f"{path} holds the states of other params ({found.get('summary')})")
    return matching, unknown


def _resume_plan(manifest: Dict[str, Any], path: str, numel: int, fields: Sequence[StateField],
                 max_host_bytes: Optional[int], sub_group_size: Optional[int]) -> Tuple[int, int]:
    """(sub_group_size, buffers) to resume the directory of ``manifest`` (see [Note: layout on
    resume]); the errors name ``path``, the manifest it was read from (its sub_group_size may
    be damage)."""
    kept = manifest.get("sub_group_size")
    page = elems_per_page(fields)
    if not (isinstance(kept, int) and not isinstance(kept, bool) and kept > 0 and kept % page == 0):
        return plan_sub_groups(numel, fields, max_host_bytes, sub_group_size)  # the store names the bad field
    if sub_group_size is not None:
        asked = min(round_up(int(sub_group_size), page), round_up(numel, page))
        if asked != kept:
            raise ValueError(f"{path}: sub_group_size={sub_group_size} but the swap directory was written with "
                             f"sub_group_size={kept}: pass sub_group_size={kept} (or None) to resume; to change "
                             "it, save_checkpoint() and load_checkpoint() into a new run")
    try:
        return plan_sub_groups(numel, fields, max_host_bytes, kept)
    except ValueError:
        groups = -(-numel // kept)
        need = min(MIN_BUFFERS, groups) * sum(round_up(f.nbytes(kept), ALIGN) for f in fields)
        bound = DEFAULT_MAX_HOST_BYTES if max_host_bytes is None else max_host_bytes
        err = ValueError(f"{path}: max_host_bytes={bound} cannot hold the pipeline buffers of the swap directory to "
                         f"resume, written with sub_group_size={kept}: pass max_host_bytes >= {need} to resume it; to "
                         "change the layout, save_checkpoint() and load_checkpoint() into a new run")
        # as plan_sub_groups' error: a caller that shrank the bound (paged_bound) restates it
        err.buffer_bytes, err.resume_sub_group = need, kept
        raise err from None


def open_run_store(swap_dir: str, layout: SwapLayout, state_names: Sequence[Union[str, StateField]], *,
                   run_name: str, rank: int, verify: bool, resume: bool, io_engine: Any,
                   identity: Optional[Dict[str, Any]] = None, discard_stale: bool = False) -> SwapStore:
    """A new store (or with ``resume``, the directory of the same name): ``<run_name>``, or
    for a second store of this same process on the same ``swap_dir`` ``<run_name>-2``, a
    third ``<run_name>-3``...: names follow creation order (never id()). :func:`open_store`
    resumes by identity instead ([Note: identity])."""
    for k in range(1, _MAX_STORES + 1):
        name = run_name if k == 1 else f"{run_name}-{k}"
        try:
            return SwapStore(swap_dir, layout, state_names=state_names, run_name=name, rank=rank,
                             verify=verify, resume=resume, io_engine=io_engine, identity=identity,
                             discard_stale=discard_stale)
        except fsutil.DirectoryBusy as exc:
            if exc.pid != os.getpid():
                raise
    raise RuntimeError(f"{_MAX_STORES} swap stores of this process already use {swap_dir}")
