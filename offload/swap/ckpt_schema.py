"""The structure of a checkpoint manifest (``offload-ckpt.json``), checked as it is read.

A sealed manifest is as its writer made it, but an older release's manifest has no seal, and
a writer's bug (or a hand edit sealed again) may hold anything: a step count ``"x"`` made a
load fail half way, with a bare ``ValueError`` naming no file, after some params had taken
the checkpoint's state. So :func:`check_checkpoint_manifest` looks at every field a load
uses, before anything is loaded, and names the file and the field:
``<path>: field 'meta.steps[1]': expected an integer in [0, 2147483647], got 'x'``.
Fields an older format lacks stay optional here; their readers say what is missing.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from offload.kernels.fields import StateField
from offload.swap.manifest_check import step_counts_problem

_UINT32 = 1 << 32

__all__ = ["MAX_WORLD", "check_checkpoint_manifest", "check_steps_cover", "manifest_error"]


def manifest_error(path: str, field: str, what: str) -> ValueError:
    return ValueError(f"{path}: field '{field}': {what}")


def _int_list_of_lists(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, list) and all(_nat(n) for n in v) for v in x)


def _nat(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


MAX_WORLD = 1 << 20
"""The most ranks a checkpoint may name (a load looks for each one's directory)."""


def _check_meta(meta: Dict[str, Any], path: str) -> None:
    world = meta.get("world", 1)
    if not (_nat(world) and 1 <= world <= MAX_WORLD):
        raise manifest_error(path, "meta.world", f"expected an integer in [1, {MAX_WORLD}], got {world!r:.80}")
    if "rank" in meta and not (_nat(meta["rank"]) and meta["rank"] < world):
        raise manifest_error(path, "meta.rank", f"expected an integer in [0, {world - 1}], got {meta['rank']!r:.80}")
    if "steps" in meta:
        problem = step_counts_problem(meta["steps"])
        if problem is not None:
            raise manifest_error(path, f"meta.steps{problem[0]}", f"expected {problem[1]}, got {problem[2]}")
    for key in ("shapes", "groups"):
        if key in meta and not _int_list_of_lists(meta[key]):
            raise manifest_error(path, f"meta.{key}", f"expected lists of integers >= 0, got {meta[key]!r:.80}")


def _check_states(m: Dict[str, Any], path: str) -> None:
    """numel, states, and per state: crc32, file_bytes, dtypes, fields (StateField's own check
    of a description, its error named)."""
    if not _nat(m.get("numel")):
        raise manifest_error(path, "numel", f"expected an integer >= 0, got {m.get('numel')!r:.80}")
    states = m.get("states")
    if not (isinstance(states, list) and all(isinstance(n, str) for n in states)):
        raise manifest_error(path, "states", f"expected a list of state names, got {states!r:.80}")
    if not _nat(m.get("gen")):
        raise manifest_error(path, "gen", f"expected an integer >= 0, got {m.get('gen')!r:.80}")
    crcs = m.get("crc32")
    if not (isinstance(crcs, dict) and all(_nat(crcs.get(n)) and crcs[n] < _UINT32 for n in states)):
        raise manifest_error(path, "crc32", f"expected a crc32 per state, got {crcs!r:.80}")
    fb = m.get("file_bytes", 0)
    if not (_nat(fb) or isinstance(fb, dict) and all(_nat(fb.get(n)) for n in states)):
        raise manifest_error(path, "file_bytes", f"expected bytes (per state), got {fb!r:.80}")
    if "dtype" in m and not isinstance(m["dtype"], str):
        raise manifest_error(path, "dtype", f"expected a dtype name, got {m['dtype']!r:.80}")
    dtypes = m.get("dtypes", {})
    for key, d in (dtypes.items() if isinstance(dtypes, dict) else [("", dtypes)]):
        if not isinstance(d, str) or _described(dict(name="x", dtype=d)) is not None:
            raise manifest_error(path, f"dtypes{key and f'[{key!r}]'}", f"expected a dtype name, got {d!r:.80}")
    fields = m.get("fields", [])
    for i, d in enumerate(fields if isinstance(fields, list) else [fields]):
        problem = _described(d) if isinstance(d, dict) and isinstance(d.get("name"), str) else "not a field"
        if problem is not None:
            raise manifest_error(path, f"fields[{i}]" if isinstance(fields, list) else "fields",
                                 f"expected a state field ({{name, dtype, ...}}), got {d!r:.80} ({problem})")


def _described(d: Dict[str, Any]) -> Optional[str]:
    """Why StateField cannot be made of description ``d``, or None."""
    try:
        StateField.from_description(d)
    except (ValueError, TypeError, KeyError) as exc:
        return str(exc)
    return None


def check_checkpoint_manifest(m: Dict[str, Any], path: str) -> None:
    """ValueError naming ``path`` and the field where manifest ``m`` (a dict of the right
    format and version) is not as a writer makes it."""
    _check_states(m, path)
    meta = m.get("meta", {})
    if not isinstance(meta, dict):
        raise manifest_error(path, "meta", f"expected an object, got {meta!r:.80}")
    _check_meta(meta, path)



def check_steps_cover(meta: Dict[str, Any], nparams: int, path: str, *, required: bool = True) -> None:
    """ValueError naming ``path`` unless ``meta`` holds one step count per param (``nparams``);
    their type and range were checked as the manifest was read. Called before a load changes
    anything: a shorter list loaded the first params and left the others' old state."""
    steps = meta.get("steps")
    if steps is None and not required:
        return
    if not isinstance(steps, list) or len(steps) != nparams:
        raise manifest_error(path, "meta.steps", f"expected {nparams} step counts, one per param, got {steps!r:.80}")
