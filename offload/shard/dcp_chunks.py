"""A stage-3 shard in ``torch.distributed.checkpoint`` (DCP): each rank's chunk of its unit's
flat buffer, at its offset, not a tensor every rank holds whole.

[Note: shards in DCP] ``model.state_dict()`` of a sharded model holds this rank's shard under
the same key on every rank (``blocks.0._shard_float32``), and the optimizer's states of that
param are shard-sized too. DCP takes a plain tensor that every rank saves under one key for a
replicated one: ``dcp.save`` kept one rank's bytes and ``dcp.load`` gave them to every rank,
silently (a two-rank run resumed with params off by 1e3 here). FSDP2 avoids it with DTensor
params; ours are plain ``nn.Parameter``s, so the tensors that go into the dicts
(``model.state_dict()``'s values, ``opt.state_dict()``'s states of a shard param) are
``ShardChunk``s: the same memory, with DCP's protocol of a sharded tensor (the methods
DTensor implements, ``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``). The key names a 1-D tensor of the unit's element count (the
padding left out), of which this rank holds ``[rank * chunk, rank * chunk + live)``.
``dcp.save`` then writes every rank's chunk, and ``dcp.load`` reads into each rank's shard the
elements its chunk covers, whatever the world size that saved them (the flat layout does not
depend on it: [Note: flat unit layout] in flat_unit.py); a rank whose chunk is all padding
saves and reads nothing. Where DCP's load compares ``size()`` with the checkpoint, a chunk
answers the whole tensor's size, as a DTensor does; everywhere else its own (``_asked_by_dcp_load``).

Only the tensors handed out are ``ShardChunk``s, never the param or the store's own. One
pickles as a plain tensor, so ``torch.save`` and ``torch.load(weights_only=True)`` see
nothing of it; its copies (``clone``, ``to``, ``copy.deepcopy``, DCP's async stager and
``cpu_offload``) are ``ShardChunk``s too, as a DTensor's are DTensors.

[Note: DCP's full_state_dict on shards] DCP's ``get_model_state_dict`` /
``get_optimizer_state_dict`` / ``get_state_dict`` with ``full_state_dict=True`` gather
DTensors only: on several ranks they returned each rank's chunk of every unit and of its
states as if it were the whole, silently. Asked that way (its getter's frame above, its
``info.full_state_dict``), a chunk on several ranks refuses with a RuntimeError on every rank
(``callers.check_not_gathered``), pointing at ``offload.shard.full_state_dict`` (the whole weights,
gathered) and at ``full_state_dict=False`` for ``dcp.save`` / ``dcp.load``. In one process a
chunk is the whole unit, as ``model.state_dict()`` gives it, and is let be.
"""
from __future__ import annotations

import sys
from typing import Any, List

import torch

from offload.shard.callers import check_not_gathered

__all__ = ["ShardChunk", "mark_chunk", "chunk_of", "mark_param_states", "unmarked"]


def chunk_of(flat: Any) -> tuple:
    """(the unit's element count, this rank's first element, live elements of its chunk)."""
    total = sum(n for _, n in flat.slots)
    lo = flat.rank * flat.chunk
    return total, lo, max(0, min(flat.chunk, total - lo))


class ShardChunk(torch.Tensor):
    """This rank's shard (or a state of it) as DCP sees it: elements ``[lo, lo + live)`` of a
    1-D tensor of ``total`` (see the note). It is the shard's memory (``_make_subclass``: no
    copy) and computes as a plain tensor (ops return plain tensors, its copies are chunks;
    ``size()`` and ``.shape`` are this rank's), with the three methods DCP looks up on a
    sharded tensor."""

    _chunk: tuple

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _COPIES and isinstance(out, torch.Tensor) and type(out) is not cls:
            # a copy of the chunk stays one, as a DTensor's stays a DTensor: DCP's async stager
            # (new_empty, set_ to the staged storage, then the __dict__), get_state_dict's
            # cpu_offload of a device shard (to), a user's clone
            out = out.as_subclass(cls)
            out._chunk = args[0]._chunk
        return out

    def size(self, *dim: Any) -> Any:  # type: ignore[override]
        if not dim and _asked_by_dcp_load():
            return torch.Size([self._chunk[0]])
        return torch.Tensor.size(self, *dim)

    def local(self) -> torch.Tensor:
        """The same memory as a plain tensor."""
        return self.as_subclass(torch.Tensor)

    def _metadata(self) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        _total, lo, live = self._chunk
        return ChunkStorageMetadata(offsets=torch.Size([lo]), sizes=torch.Size([live]))

    def __create_write_items__(self, fqn: str, obj: Any) -> List[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        total, lo, live = self._chunk
        if live == 0:  # all padding: nothing of the tensor is this rank's
            return []
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([lo])), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._metadata(),
                                                      properties=TensorProperties.create_from_tensor(self.local()),
                                                      size=torch.Size([total])))]

    def __create_chunk_list__(self) -> List[Any]:
        return [self._metadata()] if self._chunk[2] else []

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        _total, lo, live = self._chunk
        if index.offset is not None and tuple(index.offset) != (lo,):
            raise ValueError(f"DCP asked {index.fqn!r} for the chunk at {tuple(index.offset)}; "
                             f"this rank's is at ({lo},)")
        return self.local()[:live]  # a view: DCP's load writes into the shard's memory

    def __reduce_ex__(self, proto: int) -> Any:
        # torch.save / pickle: a plain tensor (torch.load(weights_only=True) knows no subclass)
        return self.local().__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict) -> "ShardChunk":
        if id(self) not in memo:
            memo[id(self)] = self.clone()
        return memo[id(self)]

    def __repr__(self, **kwargs: Any) -> str:
        total, lo, live = self._chunk
        return f"ShardChunk(elements [{lo}, {lo + live}) of {total}: {self.local()!r})"


_COPIES = frozenset({torch.Tensor.new_empty, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda,
                     torch.Tensor.clone, torch.Tensor.detach, torch.Tensor.contiguous, torch.Tensor.pin_memory})


def _asked_by_dcp_load() -> bool:
    """Whether DCP's load plan calls: it compares ``size()`` with the checkpoint's size of the
    tensor, the whole tensor's (DTensor's ``size()``). Every other caller (DCP's async stager,
    which views the staged storage at ``size()``, torch.save, the user) gets this rank's. Were
    torch to move that check, a load would fail loudly ("Size mismatch"), never load wrong bytes."""
    try:
        caller = sys._getframe(2)
    except ValueError:  # called with no Python frame above size() (from C)
        return False
    return caller.f_code.co_name == "create_default_local_load_plan" and \
        caller.f_globals.get("__name__") == "torch.distributed.checkpoint.default_planner"


def mark_chunk(t: torch.Tensor, total: int, lo: int, live: int) -> ShardChunk:
    """``t``'s memory (1-D, at least ``live`` elements) as elements ``[lo, lo + live)`` of a
    1-D tensor of ``total`` for DCP (see the note)."""
    if t.dim() != 1 or t.numel() < live:
        raise ValueError(f"a DCP chunk of {live} elements needs a 1-D tensor of at least that many, got {tuple(t.shape)}")
    out = torch.Tensor._make_subclass(ShardChunk, t.detach(), False)
    out._chunk = (int(total), int(lo), int(live))
    return out


def mark_param_states(entry: dict, param: torch.Tensor) -> dict:
    """``entry`` (a state_dict entry of ``param``) with each shard-sized 1-D state replaced by
    a marked alias, when ``param`` is a stage-3 shard; ``entry`` itself otherwise."""
    info = getattr(param, "_offload_shard", None)
    flat = getattr(info, "flat", None)
    if flat is None:
        return entry
    check_not_gathered(getattr(flat, "world", 1))
    total, lo, live = chunk_of(flat)
    return {k: mark_chunk(v, total, lo, live)
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == flat.chunk else v
            for k, v in entry.items()}


def unmarked(state_dict: Any) -> Any:
    """An optimizer ``state_dict`` whose ``ShardChunk`` states are plain tensors again (the same
    memory): what a load keeps (a host store adopts the loaded tensors) is never a chunk."""
    state = state_dict.get("state") if isinstance(state_dict, dict) else None
    if not isinstance(state, dict) or not any(isinstance(v, ShardChunk) for e in state.values()
                                              if isinstance(e, dict) for v in e.values()):
        return state_dict
    out = dict(state_dict)
    out["state"] = {k: {n: v.local() if isinstance(v, ShardChunk) else v for n, v in e.items()}
                    if isinstance(e, dict) else e for k, e in state.items()}
    return out
