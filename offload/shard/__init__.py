"""ZeRO stage 3 on the CPU: ``offload.shard(module)`` shards a model's params over the ranks,
gathers each fetch unit just in time for its forward and backward, and reduce-scatters its
grads as soon as its backward is done (api.py; the layout in flat_unit.py, the units'
policy in units.py, the collectives' order in schedule.py and grads.py, the hooks in
hooks.py). Offload optimizers step the shards as stage 3 (offload/optim/shard_store.py).
Checkpoints of the shards and the optimizer's states reshard N -> M (checkpoint.py)."""
from offload.shard.api import OFFLOAD_PARAMS, gathered_params, runtime_of, shard
from offload.shard.checkpoint import load_checkpoint, save_checkpoint

__all__ = ["shard", "runtime_of", "gathered_params", "OFFLOAD_PARAMS", "save_checkpoint", "load_checkpoint"]
