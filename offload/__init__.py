"""offload: train PyTorch models larger than accelerator memory.

``offload.AdamW(model.parameters(), lr=..., offload="nvme", swap_dir=...)`` in an unchanged
training loop keeps the fp32 optimizer states in host memory or NVMe swap files and updates
them with a SIMD CPU kernel.
"""
from offload._version import __version__
from offload.kernels import get_num_threads, set_num_threads
from offload.optim import SGD, Adagrad, Adam, AdamW, Lion, adam_step
from offload.integrations.deepspeed import from_deepspeed_config
from offload.shard import full_state_dict, shard

__all__ = ["Adam", "AdamW", "SGD", "Adagrad", "Lion", "adam_step", "from_deepspeed_config", "shard", "full_state_dict",
           "set_num_threads", "get_num_threads",
           "__version__"]
