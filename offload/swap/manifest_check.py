"""Check the structure of a swap manifest before anything trusts it (``resume=True``).

A manifest is valid JSON written atomically by us, but the file is on a disk anyone with our
uid can edit, and an older or damaged one may lack fields. Every field that a resumed store
or step uses is checked here, and an error names the file and the field, instead of a
KeyError at resume or an IndexError deep inside a later step.
"""
from __future__ import annotations

import errno
import os
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.kernels.fields import StateField

__all__ = ["VERIFY_BLOCK", "block_checksums", "check_manifest", "check_group_sums", "check_steps", "step_counts_problem",
           "MAX_STEP", "check_committed", "check_identity", "previous_commit", "previous_json"]

_UINT32 = 1 << 32
VERIFY_BLOCK = 1 << 20
_FP32 = StateField("state").itemsize  # a manifest written before typed fields holds fp32 states only


def block_checksums(view: memoryview, nbytes: int) -> List[int]:
    """crc32 of each VERIFY_BLOCK piece of the first ``nbytes`` of ``view`` (zlib releases the
    GIL on large buffers): what a manifest's checksums hold."""
    return [zlib.crc32(view[i:min(i + VERIFY_BLOCK, nbytes)]) for i in range(0, nbytes, VERIFY_BLOCK)]


def check_group_sums(got: List[List[int]], want: List[List[int]], *, g: int, step: int, names: Sequence[str],
                     base: int, spans: Sequence[Tuple[int, int, int]], path: str) -> None:
    """OSError EIO naming the first block of sub-group ``g`` (at file offset ``base``, its
    states at ``spans``) whose crc32 in ``got`` is not the manifest's (``want``)."""
    for k, (gk, wk) in enumerate(zip(got, want)):
        for b, (x, y) in enumerate(zip(gk, wk)):
            if x != y:
                offset = base + spans[k][0] + b * VERIFY_BLOCK
                raise OSError(errno.EIO, f"checksum mismatch in block {b} ({VERIFY_BLOCK} bytes at file offset "
                              f"{offset}) of {names[k]} of sub-group {g} (step {step}): crc32 {x:08x}, manifest "
                              f"{y:08x}", path)


def _bad(path: str, field: str, what: str) -> ValueError:
    return ValueError(f"{path}: damaged swap manifest: {field} {what}; remove the directory "
                      "(`offload clean`) and start again, or load a checkpoint")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _need(m: Dict[str, Any], path: str, field: str, kind: Any, what: str) -> Any:
    if field not in m:
        raise _bad(path, field, "is missing")
    v = m[field]
    ok = _is_int(v) if kind is int else isinstance(v, kind)
    if not ok:
        raise _bad(path, field, f"must be {what}, got {v!r:.80}")
    return v


def check_manifest(m: Any, path: str, *, nstates: int, verify_block: int,
                   itemsizes: Optional[Sequence[int]] = None, fields: Optional[Sequence[StateField]] = None) -> None:
    """Raise ValueError naming ``path`` and the field when ``m`` is not a well-formed manifest.
    ``fields``: the states' typed fields (their bytes, packed blocks included, size the
    checksum lists); else ``itemsizes`` (bytes per element), else fp32."""
    if not isinstance(m, dict):
        raise ValueError(f"{path}: not an offload swap manifest (a JSON {type(m).__name__}, not an object)")
    for field, kind, what in (("run", str, "a string"), ("rank", int, "an integer"), ("dtype", str, "a string"),
                              ("numel", int, "an integer"), ("sub_group_size", int, "an integer"),
                              ("step", int, "an integer"), ("states", list, "a list"),
                              ("ranges", list, "a list"), ("slots", list, "a list"), ("valid", list, "a list"),
                              ("extra", dict, "an object")):
        _need(m, path, field, kind, what)
    if not 0 <= m["step"] <= MAX_STEP:  # (ranks agree on it in an int64 tensor: comm.agree_on_step)
        raise _bad(path, "step", f"must be in [0, {MAX_STEP}], got {m['step']}")
    groups = len(m["ranges"])
    for i, r in enumerate(m["ranges"]):
        if not (isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) and 0 <= r[0] < r[1]):
            raise _bad(path, f"ranges[{i}]", f"must be [start, end) with 0 <= start < end, got {r!r:.80}")
    _check_list(m["slots"], groups, path, "slots", lambda s: _is_int(s) and s in (0, 1), "0 or 1")
    _check_list(m["valid"], groups, path, "valid", lambda v: isinstance(v, bool), "true or false")
    if "verify" in m and not isinstance(m["verify"], bool):
        raise _bad(path, "verify", f"must be true or false, got {m['verify']!r:.80}")
    _check_per_state(m, path)
    _check_extra(m["extra"], path, "extra")
    if fields is None:
        fields = [StateField(f"state{k}", {1: torch.uint8, 2: torch.bfloat16}.get(size, torch.float32))
                  for k, size in enumerate(itemsizes or [_FP32] * nstates)]
    _check_checksums(m.get("checksums"), m["ranges"], path, list(fields), verify_block)
    ident = m.get("identity")
    if ident is not None and not (isinstance(ident, dict) and isinstance(ident.get("digest"), str)):
        raise _bad(path, "identity", f"must be an object with a digest, got {ident!r:.80}")
    if m.get("previous") is not None:
        _check_previous(m, path, list(fields), verify_block)


def _check_previous(m: Dict[str, Any], path: str, fields: List[StateField], verify_block: int) -> None:
    """The commit before the last ([Note: a rank one step ahead] in agreement.py): the same
    fields as the manifest's own, for the same sub-groups, at most its step."""
    prev = m["previous"]
    if not isinstance(prev, dict):
        raise _bad(path, "previous", f"must be an object or null, got {type(prev).__name__}")
    for field, kind, what in (("step", int, "an integer"), ("slots", list, "a list"), ("valid", list, "a list"),
                              ("extra", dict, "an object")):
        if not (_is_int(prev.get(field)) if kind is int else isinstance(prev.get(field), kind)):
            raise _bad(path, f"previous.{field}", f"must be {what}, got {prev.get(field)!r:.80}")
    dropped = prev.get("extra_dropped", [])
    if not (isinstance(dropped, list) and all(isinstance(k, str) for k in dropped)):
        raise _bad(path, "previous.extra_dropped", f"must be a list of keys, got {dropped!r:.80}")
    _check_extra(prev["extra"], path, "previous.extra")
    if not 0 <= prev["step"] <= m["step"]:
        raise _bad(path, "previous.step", f"must be in [0, {m['step']}], got {prev['step']}")
    groups = len(m["ranges"])
    _check_list(prev["slots"], groups, path, "previous.slots", lambda s: _is_int(s) and s in (0, 1), "0 or 1")
    _check_list(prev["valid"], groups, path, "previous.valid", lambda v: isinstance(v, bool), "true or false")
    _check_checksums(prev.get("checksums"), m["ranges"], path, fields, verify_block)


def previous_commit(m: Dict[str, Any]) -> Optional[Tuple[List[int], List[bool], Dict[int, Any], int, Dict[str, Any]]]:
    """(slots, valid, checksums, step, extra) of a checked manifest's commit before the last,
    or None (none recorded, or its data overwritten since)."""
    prev = m.get("previous")
    if prev is None:
        return None
    sums = {int(k): v for k, v in (prev.get("checksums") or {}).items()}
    extra = {k: v for k, v in m["extra"].items() if k not in prev.get("extra_dropped", [])}
    extra.update(prev["extra"])
    return list(prev["slots"]), list(prev["valid"]), sums, prev["step"], extra


def previous_json(before: Tuple[List[int], List[bool], Dict[int, Any], int, Dict[str, Any]],
                  verify: bool, extra_now: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest's ``previous`` for :func:`previous_commit`; of its ``extra`` only what
    differs from ``extra_now`` (the step counts; the params' facts stay the same), so the
    manifest does not double in size."""
    slots, valid, sums, step, extra = before
    changed = {k: v for k, v in extra.items() if k not in extra_now or extra_now[k] != v}
    out = {"step": step, "slots": slots, "valid": valid, "extra": changed,
           "checksums": {str(k): v for k, v in sums.items()} if verify else None}
    dropped = sorted(set(extra_now) - set(extra))
    if dropped:
        out["extra_dropped"] = dropped
    return out


def _check_per_state(m: Dict[str, Any], path: str) -> None:
    """``states`` and the lists of one entry per state: ``dtypes``, ``blocks``, ``codes``
    (absent from older manifests, which check_codes fills in; null is damage)."""
    states = m["states"]
    if not all(isinstance(n, str) for n in states):
        raise _bad(path, "states", f"must be a list of state names, got {states!r:.80}")
    for field, ok, what in (("dtypes", lambda d: isinstance(d, str), "a dtype name"),
                            ("blocks", lambda b: _is_int(b) and b >= 0, "an integer >= 0"),
                            ("codes", lambda c: isinstance(c, str), "a code name")):
        if field not in m:
            continue
        xs = m[field]
        if not (isinstance(xs, list) and len(xs) == len(states)):
            raise _bad(path, field, f"must be a list of {len(states)} entries (one per state), got {xs!r:.80}")
        for i, x in enumerate(xs):
            if not ok(x):
                raise _bad(path, f"{field}[{i}]", f"must be {what}, got {x!r:.80}")


def _nat(x: Any) -> bool:
    return _is_int(x) and x >= 0


def _shape_tree(x: Any, depth: int = 3) -> bool:
    """A list whose entries are integers >= 0, dtype names or such lists: ``extra.shapes``
    holds each param's shape ([5000]), a flat store each group's ([[5000, "torch.bfloat16"]])."""
    return isinstance(x, list) and all(_nat(v) or isinstance(v, str) or depth > 1 and _shape_tree(v, depth - 1)
                                       for v in x)


def _holding(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(v, list) and all(_nat(i) for i in v) for v in x.values())


# The facts a commit records in ``extra`` that a resume reads, where present (an ``extra`` of
# the first manifest, before any commit, is empty; ``previous.extra`` holds what changed):
# the identity of the params (swapped_state.py, flat/swapped.py, swapped_shards.py), the
# fingerprint, and the optimizer's commit_meta (context.py OPT_META; its "holding":
# ckpt_holding.py). Each is compared or read by code that trusts its type.
_EXTRA: Tuple[Tuple[str, Any, str], ...] = (
    ("kind", lambda v: isinstance(v, str), "a string"),
    ("fingerprint", lambda v: isinstance(v, str), "a string"),
    ("world", lambda v: _is_int(v) and 1 <= v <= 1 << 20, "an integer in [1, 1048576]"),
    ("rank", _nat, "an integer >= 0"),
    ("numels", lambda v: isinstance(v, list) and all(_nat(n) for n in v), "a list of integers >= 0"),
    ("groups", lambda v: isinstance(v, list) and all(isinstance(g, list) and all(_nat(n) for n in g) for g in v),
     "lists of integers >= 0"),
    ("shapes", lambda v: isinstance(v, list) and all(_shape_tree(s) for s in v), "a list of shapes"),
    ("dtypes", lambda v: isinstance(v, list) and all(isinstance(d, str) for d in v), "a list of dtype names"),
    ("optimizer", lambda v: isinstance(v, dict) and _holding(v.get("holding", {})),
     "an object (its holding: state name -> param indices)"),
)


def _check_extra(extra: Dict[str, Any], path: str, where: str) -> None:
    for key, ok, what in _EXTRA:
        if key in extra and not ok(extra[key]):
            raise _bad(path, f"{where}.{key}", f"must be {what}, got {extra[key]!r:.80}")
    world, rank = extra.get("world"), extra.get("rank")
    if _is_int(world) and _is_int(rank) and rank >= world:
        raise _bad(path, f"{where}.rank", f"must be below world ({world}), got {rank}")
    if "steps" in extra:
        problem = step_counts_problem(extra["steps"])
        if problem is not None:
            raise _bad(path, f"{where}.steps{problem[0]}", f"must be {problem[1]}, got {problem[2]}")


def _check_list(xs: List[Any], n: int, path: str, field: str, ok: Any, what: str) -> None:
    if len(xs) != n:
        raise _bad(path, field, f"has {len(xs)} entries for {n} sub-groups")
    for i, x in enumerate(xs):
        if not ok(x):
            raise _bad(path, f"{field}[{i}]", f"must be {what}, got {x!r:.80}")


def _check_checksums(sums: Any, ranges: Sequence[List[int]], path: str, fields: List[StateField], block: int) -> None:
    nstates = len(fields)
    if sums is None:
        return
    if not isinstance(sums, dict):
        raise _bad(path, "checksums", f"must be an object or null, got {type(sums).__name__}")
    for key, per_state in sums.items():
        field = f"checksums[{key!r}]"
        if not (key.isdigit() and int(key) < len(ranges)):
            raise _bad(path, field, f"names no sub-group (0..{len(ranges) - 1})")
        s, e = ranges[int(key)]
        if not (isinstance(per_state, list) and len(per_state) == nstates):
            raise _bad(path, field, f"must hold {nstates} lists of block checksums")
        for k, sums_k in enumerate(per_state):
            blocks = -(-fields[k].nbytes(e - s) // block)
            if not (isinstance(sums_k, list) and len(sums_k) == blocks
                    and all(_is_int(c) and 0 <= c < _UINT32 for c in sums_k)):
                raise _bad(path, f"{field}[{k}]", f"must be {blocks} crc32 values")


MAX_STEP = (1 << 31) - 1
"""The largest per-param step count a manifest or a checkpoint may hold: 68 years at a step a
second (a float32 step tensor, torch's, stops counting at 2**24 already); more is damage."""


def step_counts_problem(steps: Any) -> Optional[Tuple[str, str, str]]:
    """(index, what was expected, what is there) of the first thing wrong in per-param step
    counts ``steps``, or None when they are a list of integers in [0, MAX_STEP]: what a swap
    manifest's ``extra.steps`` and a checkpoint's ``meta.steps`` hold."""
    if not isinstance(steps, list):
        return "", "a list", f"{steps!r:.80}"
    for i, s in enumerate(steps):
        if not (_is_int(s) and 0 <= s <= MAX_STEP):
            return f"[{i}]", f"an integer in [0, {MAX_STEP}]", f"{s!r:.80}"
    return None


def check_steps(extra: Dict[str, Any], path: str, nparams: Optional[int]) -> List[int]:
    """The per-param step counts the optimizer committed in ``extra``."""
    check_committed(extra, path)
    steps = extra.get("steps")
    if steps is None:
        raise _bad(path, "extra.steps", "is missing")
    problem = step_counts_problem(steps)
    if problem is not None:
        raise _bad(path, f"extra.steps{problem[0]}", f"must be {problem[1]}, got {problem[2]}")
    if nparams is not None and len(steps) != nparams:
        raise _bad(path, "extra.steps", f"has {len(steps)} step counts for {nparams} params")
    return list(steps)


def check_committed(extra: Dict[str, Any], path: str) -> None:
    """A store writes its first manifest with an empty ``extra`` and the optimizer's commit of
    step 0 fills it: a process killed in between (the masters' first write can take seconds)
    leaves a directory with nothing to resume, which is not "the states of other params"."""
    if not extra:
        raise ValueError(f"{path}: the swap directory was never committed (its process ended while creating "
                         "it, before its first states were written): nothing to resume; remove it (`offload "
                         f"clean {os.path.dirname(os.path.dirname(path))}`) and build the optimizer without "
                         "resume=True")


def check_identity(identity: Dict[str, Any], extra: Dict[str, Any], path: str) -> bool:
    """A resumed directory ``path`` holds, in its manifest's ``extra``, the facts of the params
    given (``identity``: a flat store's world, rank, numels, shapes) and their step counts.
    False: nothing of the params' values is checked ([Note: same identity] in swap/runs.py)."""
    manifest = os.path.join(path, "manifest.json")
    check_committed(extra, manifest)
    # "shapes" is newer than the other facts: a directory written without it is checked without it
    want = {k: v for k, v in identity.items() if k != "shapes" or k in extra}
    found = {k: extra.get(k) for k in want}
    if found != want:
        raise ValueError(f"{path}: the swap directory holds the states of other params or ranks ({found}, this "
                         f"optimizer {identity})")
    groups = identity.get("groups")
    check_steps(extra, manifest, sum(len(g) for g in groups) if isinstance(groups, list) else None)
    return False


def check_codes(m: Dict[str, Any], path: str, fields: Sequence[StateField]) -> None:
    """The int8 codes of resumed manifest ``m`` (its ``dtypes`` and ``blocks`` filled in) are
    ``fields``' ([Note: square-root code] in kernels/quant.py): written with the blocks since
    the square-root code; a uint8 state in blocks without one is in the first code, whose
    swap files this release cannot step (checkpoints convert; swap files are not). Fills in
    the keys of typed fields that older manifests lack."""
    m.setdefault("dtypes", [m["dtype"]] * len(m["states"]))  # before typed fields: one dtype for all
    m.setdefault("blocks", [0] * len(m["states"]))  # fp32/bf16 states: written without the key
    m.setdefault("codes", [("unsigned" if d == "uint8" else "signed") if b else ""
                           for d, b in zip(m["dtypes"], m["blocks"])])
    codes = [f.code for f in fields]
    if m["codes"] != codes and m["blocks"] == [f.block for f in fields]:
        raise ValueError(f"{path}: swap directory of int8 states in the codes {m['codes']}, this offload keeps "
                         f"{codes} (the unsigned states' square-root code came later) and cannot resume it: "
                         "load a checkpoint of that run (checkpoints convert), or clean the directory "
                         "(`offload clean`) and start again")
