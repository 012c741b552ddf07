"""Plain torch calls on a sharded model: each one works as it would on the model before
``shard()``, or is refused before it changes anything.

[Note: calls on a sharded model] ``shard()`` moves a trainable param's values into its unit's
shard (an ``nn.Parameter`` of the unit module) and leaves, under the names the param had, plain
tensors that are views of the unit's full buffer (flat_unit.py [Note: flat unit layout]). torch's
own module methods know nothing of that, and some of them did something silently wrong:

- ``_apply`` (``to``, ``half``, ``float``, ``double``, ``bfloat16``, ``cuda``, ``cpu``,
  ``to_empty``, ``share_memory``, ``type``): it rebinds the shard to a new tensor (``p.data =``)
  while the views, which the forward reads, keep the old buffer, so the optimizer then steps a
  copy the forward never sees (``.to("meta")`` left meta shards and a model that still ran).
  Here every module whose subtree holds a sharded param's shard or view gets an ``_apply`` that
  first tries the function on a small tensor of each shard's dtype and compute device:
  when it returns that tensor itself (``model.to("cpu")``, ``.float()`` of an fp32 model), or a
  copy of it where it was (``.to("cpu:0")``, which accelerate does on several CPU ranks), it is
  a no-op for the shards, which it then leaves alone; a new tensor (a cast, a move, ``to_empty``),
  a tensor now in shared memory, or an error (``.cuda()`` without CUDA) is refused with a
  ``RuntimeError`` before anything changed. Buffers and frozen params are then converted as
  torch does.
- ``apply(fn)`` (an init writing params in place): on one CPU rank with the params in RAM the
  views are the shard itself and the writes land; elsewhere they went into a released buffer
  (or evicted pages of the swap file) and were lost. Here ``apply`` gathers each unit for the
  time its modules are visited (unit by unit, the root unit for the whole call: never the
  whole model at once; a collective with several ranks, as ``shard()`` is) and writes this
  rank's chunk back; a write into a unit that was not gathered then (an ancestor's init
  looping over its descendants) raises once the walk is over, naming the unit.
- ``load_state_dict``: the root's takes the keys the model had before ``shard()`` too and loads
  them as ``offload.shard.load_weights`` does (each rank its own slices); a submodule given those
  keys refuses (they were silently ignored with ``strict=False``).
- ``save_pretrained`` (transformers, the root only) writes the whole model's weights under
  their names (save_pretrained.py [Note: save_pretrained of a sharded model]): it wrote the
  shards, which ``from_pretrained`` then took for missing weights.
- ``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` refuse (``__reduce_ex__`` of the
  runtime, its flats and the shards' info): a copy shared the swap files and process groups of
  the original, or lost the views' aliasing of the shard and trained nothing.
- ``DistributedDataParallel(model)`` refuses (``RuntimeError``, from the list of names DDP
  reads first, ``_ddp_params_and_buffers_to_ignore``): it broadcast rank 0's shards over every
  other rank's at construction, and then averaged grads of shards that are not the same
  elements, silently. The shards' grads are reduce-scattered by offload itself (hooks.py).
- ``DistributedDataParallel`` over a module *above* the one ``shard()`` was given (a wrapper
  holding the sharded model) reads that wrapper's ignore list, not the sharded module's, and
  was accepted: its constructor had already broadcast rank 0's shards over the others' (and
  its reducer would wait for shard grads autograd never gives). The root unit's first forward
  under it raises (``refuse_ddp_above``: DDP marks the forward it runs, ``_active_ddp_module``),
  on every rank alike, before any step; a DDP told to ignore the shards' names is let be.
  ``fully_shard`` over such a wrapper is refused before it takes a param, from the registry
  lookup of its module walk (``_RefuseComposable._taken_from_above``).
- torch's composable ``fully_shard`` (FSDP2) and ``replicate`` refuse too (``RuntimeError``,
  from their registry on the module, ``_RefuseComposable``): ``fully_shard`` put DTensors in
  place of the shards, which offload's hooks and the optimizer do not read; on two ranks the
  first step failed on one rank ("mixed torch.Tensor and DTensor") and hung the other until
  gloo's timeout.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Dict, List, Set

import torch
import torch.nn as nn

from offload.memory import paging
from offload.shard.save_pretrained import sharded_save_pretrained

__all__ = ["install", "refuse_copy", "refuse_ddp_above"]


class _RefuseDDP:
    """A sharded module's ``_ddp_params_and_buffers_to_ignore``: DDP's constructor reads it
    (``set(...)``) before it touches a param (see the note)."""

    def __iter__(self) -> Any:
        raise RuntimeError(
            "DistributedDataParallel over a model offload.shard() sharded (ZeRO stage 3): its params are "
            "this rank's shards, whose grads offload reduce-scatters itself; DDP would broadcast rank 0's "
            "shards over every other rank's and average grads of different elements. Train the sharded "
            "model without DDP (accelerate and the Hugging Face Trainer wrap the model in DDP under torchrun)")


_REFUSE_DDP = _RefuseDDP()


def refuse_ddp_above(units: List[Any], passed: "weakref.WeakSet[Any]") -> None:
    """Raise when the running forward is a ``DistributedDataParallel``'s that manages a shard
    (see the note); ``passed`` holds the DDP modules already found not to (checked once)."""
    ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or ddp in passed:
        return
    managed = {id(p) for p in getattr(ddp, "_module_parameters", ())}
    names = [flat.where for u in units for flat in u.flats if id(flat.shard) in managed]
    if not names:
        passed.add(ddp)
        return
    raise RuntimeError(
        "DistributedDataParallel over a module holding a model offload.shard() sharded (ZeRO stage 3), "
        f"whose shard params it manages ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): its "
        "constructor has already broadcast rank 0's shards over every other rank's, and it would average "
        "grads of different elements. Build the model again and train it without DDP (offload reduce-scatters "
        "the shards' grads itself)")


def _composable_refusal(api: str) -> RuntimeError:
    """``api``: the API's name, or None where the lookup cannot tell (both ask the registry)."""
    named = f"{api}()" if api else "fully_shard() or replicate()"
    return RuntimeError(
        f"torch's {named} over a model offload.shard() sharded (ZeRO stage 3), or over a module holding one: "
        "its params are already this rank's shards, which offload gathers and whose grads it reduce-scatters "
        "itself; sharding or replicating them again would leave offload's gathers and the optimizer on other "
        f"tensors than {api or 'torch'}'s. Use one of the two (offload.shard with an offload optimizer, or "
        f"{api or 'torch'}'s API with its own)")


class _RefuseComposable(dict):
    """A sharded module's entry in torch's registry of composable distributed APIs
    (``fully_shard``, ``replicate``; torch.distributed._composable.contract): before either
    touches a param, it asks whether ``fully_shard`` is there (``"fully_shard" in registry``,
    by fully_shard's contract and by replicate) and adds its own name (``setdefault``), both
    refused here. Other lookups answer as an empty registry: FSDP's module walk, which
    torch.distributed.checkpoint's state_dict helpers run, asks for ``"replicate"``. That same
    walk is how ``fully_shard`` over a module *above* a sharded one finds the params it takes
    (``_get_managed_modules``, whose frame is then on the stack): refused there too, unless
    every shard below is in its ``ignored_params``."""

    def __init__(self, flats: List[Any]) -> None:
        super().__init__()
        self.flats = flats

    def __contains__(self, name: object) -> bool:
        if name == "fully_shard" or (name == "replicate" and self._taken_from_above()):
            raise _composable_refusal(None)  # asked by fully_shard's contract and by replicate alike
        return dict.__contains__(self, name)

    def _taken_from_above(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:  # as deep as the module walk's recursion (the model's nesting)
            if frame.f_code.co_name == "_get_managed_modules" and "fsdp" in frame.f_globals.get("__name__", ""):
                ignored = {id(p) for p in frame.f_locals.get("ignored_params") or ()}
                return any(id(f.shard) not in ignored for f in self.flats)
            frame = frame.f_back
        return False

    def setdefault(self, name: Any, default: Any = None) -> Any:
        raise _composable_refusal(str(name))


def _composable_registry_key() -> Any:
    """The module attribute torch's composable APIs keep their registry under (a name made at
    import), or None where this torch has none."""
    try:
        from torch.distributed._composable.contract import REGISTRY_KEY
    except (ImportError, AttributeError):
        return None
    return REGISTRY_KEY if isinstance(REGISTRY_KEY, str) else None


def refuse_copy(self: Any, protocol: Any = None) -> Any:
    """``__reduce_ex__`` of what a sharded model holds: deepcopy, pickle, torch.save refuse."""
    raise TypeError("copy.deepcopy / pickle / torch.save of a model sharded by offload.shard() (or of its shard "
                    "params) is not supported: its shards are this rank's, tied to its process groups and swap "
                    "files. Save the weights with offload.shard.full_state_dict(model, path) (or "
                    "offload.shard.save_checkpoint) and shard a newly built model with weights=path")


class _SkipShards:
    """``fn`` for everything but the shards and their grads (left as they are)."""

    def __init__(self, fn: Any, skip: Set[int]) -> None:
        self.fn, self.skip = fn, skip

    def __call__(self, t: Any) -> Any:
        return t if id(t) in self.skip else self.fn(t)


def _check_apply_fn(fn: Any, flats: List[Any]) -> None:
    """Refuse ``fn`` (what ``nn.Module._apply`` maps over the tensors) unless it leaves every
    shard as it is (see the note)."""
    for dtype, device in {(f.dtype, f.full.device) for f in flats}:
        probe = torch.tensor([1.25, -3.5], dtype=dtype, device=device)  # values a copy keeps, to_empty() not
        was = f"{str(dtype).replace('torch.', '')} on {device}"
        try:
            out = fn(probe)
        except Exception as e:
            raise RuntimeError(f"offload.shard: this conversion of the model (.to(), .cuda(), .half(), ...) fails on "
                               f"its sharded params ({was}): {type(e).__name__}: {e}. The shards keep the dtype and "
                               "device they were sharded with: move or cast the model before offload.shard()") from e
        if out is probe and device.type == "cpu" and probe.is_shared():
            raise RuntimeError("offload.shard: model.share_memory() on a sharded model: its shards live in this "
                               "process's buffers (or swap file) and are gathered over its process group, so no "
                               "other process can use them; train with torch.distributed ranks instead")
        if out is not probe and _a_copy_in_place(out, probe):
            continue  # .to("cpu:0") of a CPU tensor (accelerate's device on several CPU ranks): the shards stay
        if out is not probe:
            now = f"{str(out.dtype).replace('torch.', '')} on {out.device}" if isinstance(out, torch.Tensor) else "?"
            what = f"{was} -> {now}" if now != was else f"{was}: new tensors (.to_empty())"
            raise RuntimeError(f"offload.shard: .to() / .half() / .float() / .bfloat16() / .double() / .cuda() / "
                               f".cpu() / .to_empty() on a sharded model would change its sharded params ({what}), "
                               "which the forward would then no longer read. Cast or move the model before "
                               "offload.shard() (the shards keep the dtype and device they were sharded with)")


def _a_copy_in_place(out: Any, probe: torch.Tensor) -> bool:
    """Whether ``out`` is ``probe`` copied where it was (same dtype, device and values): what
    ``.to("cpu:0")`` gives for a CPU tensor, whose device has no index. Left to the shards it
    would only have replaced them by copies (the views would keep the old buffer)."""
    return isinstance(out, torch.Tensor) and out.dtype == probe.dtype and out.device == probe.device and \
        torch.equal(out, probe)


def _guarded_apply(module: nn.Module, flats: List[Any], fn: Any, recurse: bool = True) -> nn.Module:
    _check_apply_fn(fn, flats)
    skip = {id(f.shard) for f in flats} | {id(f.shard.grad) for f in flats if f.shard.grad is not None}
    return type(module)._apply(module, _SkipShards(fn, skip), recurse)


class _ApplyWalk:
    """The units ``apply`` holds gathered while it visits their modules (see the note)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.depth: Dict[int, int] = {}  # unit index -> nesting of the applies holding it
        self.outer = 0
        self.seen: Dict[int, int] = {}  # id(flat) -> full._version once written back

    def bring_in(self, unit: Any) -> None:
        handles = unit.gather(self.runtime.schedule.group)
        for h, _ in handles:
            h.wait()

    def write_back(self, unit: Any) -> None:
        for flat in unit.flats:
            if flat._alias and flat.tier is None:
                pass  # the views are the shard (flat_unit.py [Note: one rank's full buffer is its shard])
            elif flat._alias:
                paging.store([flat.full])  # the swap file's pages, written
            else:
                lo = flat.rank * flat.chunk
                flat.set_shard_values(flat.full[lo:lo + flat.chunk])
            flat.free()
            self.seen[id(flat)] = flat.full._version

    def lost_writes(self, before: Dict[int, int]) -> List[str]:
        out = []
        for u in self.runtime.units:
            for flat in u.flats:
                if flat._alias and flat.tier is None:
                    continue
                if flat.full._version != self.seen.get(id(flat), before[id(flat)]):
                    out.append(u.name or "<root>")
        return sorted(set(out))


def _guarded_module_apply(module: nn.Module, units: List[Any], walk: _ApplyWalk, fn: Any) -> nn.Module:
    runtime = walk.runtime
    if runtime.in_forward or runtime.in_backward:
        raise RuntimeError("offload.shard: module.apply() inside the forward or backward of a sharded model")
    outer = walk.outer == 0
    if outer:
        runtime._drop_stale()  # a forward whose backward never ran: its gathered units released
        walk.seen = {}
        before = {id(f): f.full._version for u in runtime.units for f in u.flats}
    walk.outer += 1
    mine = [u for u in units if walk.depth.get(u.index, 0) == 0]
    try:
        for u in units:
            walk.depth[u.index] = walk.depth.get(u.index, 0) + 1
        for u in mine:
            walk.bring_in(u)
        type(module).apply(module, fn)
        for u in mine:
            walk.write_back(u)
    finally:
        for u in units:
            walk.depth[u.index] -= 1
        walk.outer -= 1
    if outer:
        lost = walk.lost_writes(before)
        if lost:
            raise RuntimeError(f"offload.shard: apply(fn) wrote into params of units {lost} while they were not "
                               "gathered (a unit is gathered while apply visits its own modules): those writes are "
                               "lost. Write a module's own params from fn(module), or initialise before "
                               "offload.shard() (or with shard(init_fn=) on a meta model)")
    return module


def _full_load(module: nn.Module, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
    """The root's load_state_dict: the keys of the model before shard() load as load_weights does."""
    from offload.shard.weights import full_keys, load_weights

    if set(state_dict) & full_keys(module):
        if assign:
            raise RuntimeError("offload.shard: load_state_dict(assign=True) on a sharded model: its params cannot "
                               "be replaced by the dict's tensors; load without assign=")
        return load_weights(module, state_dict, strict=strict)
    return type(module).load_state_dict(module, state_dict, strict=strict, assign=assign)


def _refuse_full_keys(names: Set[str], shard_key: str, module: nn.Module, state_dict: Any, prefix: str,
                      *args: Any) -> None:
    hits = [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] in names]
    if hits:
        raise RuntimeError(f"offload.shard: load_state_dict() on a submodule of a sharded model got the names of "
                           f"its params before offload.shard() ({hits[:3]}): it holds this rank's shards now "
                           f"({shard_key!r}). Load the whole model's dict into the model passed to offload.shard() "
                           "(or offload.shard.load_weights(model, path))")


def install(root: nn.Module, runtime: Any) -> None:
    """The guards on every module whose subtree holds a shard or a view of one (see the note)."""
    from offload.shard.weights import full_keys

    leaf_of: Dict[int, Any] = {}
    for u in runtime.units:
        for flat in u.flats:
            for leaf in flat.leaves:
                leaf_of[id(leaf)] = (u, flat)
    unit_of_module = {id(u.module): u for u in runtime.units}
    sub: Dict[int, Dict[int, Any]] = {}  # id(module) -> {id(flat): (unit, flat)} of its subtree
    below: Dict[int, Set[int]] = {}  # id(module) -> ids of the modules strictly below it

    def walk(m: nn.Module) -> None:
        if id(m) in sub:
            return
        own: Dict[int, Any] = {}
        for v in m.__dict__.values():  # the views: plain attributes
            hit = leaf_of.get(id(v))
            if hit is not None:
                own[id(hit[1])] = hit
        for p in m._parameters.values():  # the shards
            if getattr(p, "_offload_shard", None) is not None:
                own[id(p._offload_shard.flat)] = (unit_of_module[id(m)], p._offload_shard.flat)
        under: Set[int] = set()
        for c in m.children():
            walk(c)
            own.update(sub[id(c)])
            under |= below[id(c)] | {id(c)}
        sub[id(m)], below[id(m)] = own, under

    walk(root)
    registry_key = _composable_registry_key()
    full = full_keys(root)
    names = {id(m): n for n, m in root.named_modules()}
    walk_state = _ApplyWalk(runtime)
    for m in root.modules():
        found = sub.get(id(m))
        if not found:
            continue
        flats = [f for _, f in found.values()]
        units = list({u.index: u for u, _ in found.values() if id(u.module) not in below[id(m)]}.values())
        # instance attributes: found before the class's methods, which they call (the note)
        m.__dict__["_apply"] = functools.partial(_guarded_apply, m, flats)
        m.__dict__["apply"] = functools.partial(_guarded_module_apply, m, units, walk_state)
        m.__dict__["_ddp_params_and_buffers_to_ignore"] = _REFUSE_DDP
        if registry_key is not None and registry_key not in m.__dict__:
            m.__dict__[registry_key] = _RefuseComposable(flats)
        if m is root:
            m.__dict__["load_state_dict"] = functools.partial(_full_load, m)
            if callable(getattr(type(m), "save_pretrained", None)):  # transformers' (save_pretrained.py)
                m.__dict__["save_pretrained"] = functools.partial(sharded_save_pretrained, m, runtime.rank)
        else:
            n = names[id(m)]
            mine = {k[len(n) + 1:] for k in full if k.startswith(n + ".")}
            shard_key = next((n + "." + k for k, p in m.named_parameters() if hasattr(p, "_offload_shard")), n)
            m._register_load_state_dict_pre_hook(functools.partial(_refuse_full_keys, mine, shard_key),
                                                 with_module=True)
