"""``save_pretrained`` of a sharded Hugging Face model: the whole model's weights, under the
names ``from_pretrained`` reads.

[Note: save_pretrained of a sharded model] transformers' ``save_pretrained`` (and the
Trainer's ``save_model`` and checkpoints, which call it) writes ``model.state_dict()``: for a
model ``shard()`` changed, this rank's flat shards under ``<unit>._shard_<dtype>``. The file
was written without a word, and ``from_pretrained`` then reported every weight missing and
initialised the model afresh: the trained weights were lost. So ``guards.install`` gives the
root of a model that has a ``save_pretrained`` its own: when no state dict is given, or the
one given holds shards, it passes transformers the whole model's state dict
(``full_state_dict``: the names before ``shard()``, tied ones included, frozen params and
persistent buffers), and transformers writes it as for any model (its shard size, safetensors
metadata, config). Like ``full_state_dict`` it is a collective with several ranks: every rank
calls it (accelerate's and transformers' own convention, ``is_main_process`` on rank 0); rank
0 writes, the others take part in the gathers and write nothing. The dict sits whole in rank
0's memory, as transformers' save needs it; for a model larger than RAM stream it to one file
with ``offload.shard.full_state_dict(model, path)``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

__all__ = ["sharded_save_pretrained"]


def _holds_shards(model: nn.Module, state_dict: Any) -> bool:
    if not hasattr(state_dict, "keys"):
        return False
    shard_keys = {n for n, p in model.named_parameters() if hasattr(p, "_offload_shard")}
    return any(k in shard_keys for k in state_dict.keys())


def sharded_save_pretrained(model: nn.Module, rank: int, save_directory: Any, *args: Any,
                            state_dict: Optional[Any] = None, **kwargs: Any) -> Any:
    """transformers' ``save_pretrained`` of ``model`` (this process is ``rank`` of its
    group) with its whole state dict (see the note)."""
    from offload.shard.fullstate import full_state_dict

    save = type(model).save_pretrained
    if state_dict is not None and not _holds_shards(model, state_dict):
        return save(model, save_directory, *args, state_dict=state_dict, **kwargs)
    whole = full_state_dict(model)  # rank 0: the dict; the other ranks: {} (they took part)
    if rank != 0:
        return None
    return save(model, save_directory, *args, state_dict=whole, **kwargs)
