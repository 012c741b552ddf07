"""ZeRO stage 3 of CPU or CUDA params (on CUDA the transfers run on side streams: device.py):
``offload.shard(module)`` shards a model's params over the ranks, gathers each fetch unit
just in time for its forward and backward, and reduce-scatters its grads as soon as its
backward is done (api.py; the layout in flat_unit.py, the units'
policy in units.py, the collectives' order in schedule.py and grads.py, the hooks in
hooks.py). Offload optimizers step the shards as stage 3 (offload/optim/shard_store.py).
Params on NVMe are paged through a swap file (tier.py). A meta-device model is materialized
unit by unit (materialize.py); weights load streamed, each rank its own slices (weights.py);
``full_state_dict`` gathers and streams them back (fullstate.py). Checkpoints of the shards
and the optimizer's states reshard N -> M (checkpoint.py)."""
from offload.shard.api import OFFLOAD_PARAMS, gathered_params, runtime_of, shard
from offload.shard.checkpoint import load_checkpoint, save_checkpoint
from offload.shard.fullstate import full_state_dict
from offload.shard.splits import split_no_decay
from offload.shard.weights import load_weights

# ``offload.shard`` is the function (offload/__init__.py imports it over this package's name),
# so the helpers the docs call ``offload.shard.<name>`` hang on it too.
for _f in (gathered_params, runtime_of, load_weights, full_state_dict, save_checkpoint, load_checkpoint,
           split_no_decay):
    setattr(shard, _f.__name__, _f)
del _f

__all__ = ["shard", "runtime_of", "gathered_params", "load_weights", "full_state_dict", "save_checkpoint",
           "load_checkpoint", "split_no_decay", "OFFLOAD_PARAMS"]
