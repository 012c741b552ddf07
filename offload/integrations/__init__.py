"""Glue between offload and the tools people train with.

- :mod:`offload.integrations.deepspeed`: ``from_deepspeed_config(config, params)`` builds the
  optimizer from a ZeRO-Offload / ZeRO-Infinity JSON.
- :mod:`offload.integrations.deepspeed_ops`: ``DeepSpeedCPUAdam``, ``DeepSpeedCPUAdagrad``,
  ``DeepSpeedCPULion`` with DeepSpeed's arguments, on offload's optimizers.
- :mod:`offload.integrations.torchao`: torchao's ``CPUOffloadOptimizer(params, optimizer_class,
  ...)`` call, answered by the offload optimizer of that rule.
- :mod:`offload.integrations.hf`: Trainer callbacks (grad norm in the logs, gradient
  accumulation without a grad copy per micro-batch) and accelerate's accumulation.

Nothing here is imported by ``offload`` itself except ``from_deepspeed_config``;
transformers and accelerate are imported only when their glue is used.
"""
from offload.integrations.deepspeed import from_deepspeed_config, deepspeed_kwargs

__all__ = ["from_deepspeed_config", "deepspeed_kwargs"]
