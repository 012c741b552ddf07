"""What each DeepSpeed config key becomes in ``offload.from_deepspeed_config``
(offload/integrations/deepspeed.py): mapped to an option, accepted with no effect, or refused.
The tables are public (``MAPPED``, ``IGNORED``) so that a user can look a key up."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

__all__ = ["MAPPED", "IGNORED"]

MAPPED: Dict[str, str] = {
    "zero_optimization.stage": "stage= (0, 1, 2); 3: offload.shard(model) first, then the optimizer over its shards",
    "zero_optimization.offload_param.device": "stage 3: offload.shard(offload_params=) (none, cpu, nvme)",
    "zero_optimization.offload_param.nvme_path": "stage 3: offload.shard(swap_dir=), the param shards' directory",
    "zero_optimization.stage3_max_live_parameters": "stage 3: offload.shard(max_live_params=)",
    "zero_optimization.sub_group_size": "sub_group_size=",
    "zero_optimization.offload_optimizer.device": "offload= (none, cpu, nvme)",
    "zero_optimization.offload_optimizer.nvme_path": "swap_dir=",
    "zero_optimization.offload_optimizer.buffer_count":
        "max_host_bytes = buffer_count x sub_group_size x 4 B (DeepSpeed's pool), with sub_group_size",
    "zero_optimization.offload_optimizer.ratio": "1.0 only (no partial offload)",
    "aio.block_size": "io_engine=IOConfig(block_size=)",
    "aio.queue_depth": "io_engine=IOConfig(queue_depth=)",
    "aio.use_gds": "false only (no GPUDirect Storage)",
    "optimizer.type": "Adam, AdamW, Adagrad, Lion or SGD (case-insensitive)",
    "optimizer.params.lr": "lr=",
    "optimizer.params.betas": "betas=",
    "optimizer.params.eps": "eps=",
    "optimizer.params.weight_decay": "weight_decay= (default 0, as DeepSpeedCPUAdam)",
    "optimizer.params.bias_correction": "bias_correction=",
    "optimizer.params.adam_w_mode": "AdamW when true (the default), Adam when false",
    "optimizer.params.torch_adam": "torch's defaults for weight_decay (the kernel is ours either way)",
    "optimizer.params.amsgrad": "amsgrad= (torch's; DeepSpeed's own CPU and fused Adam refuse it)",
    "optimizer.params.momentum": "SGD: momentum= (torch.optim.SGD's, as DeepSpeed builds it)",
    "optimizer.params.dampening": "SGD: dampening=",
    "optimizer.params.nesterov": "SGD: nesterov=",
    "optimizer.params.lr_decay": "Adagrad: lr_decay= (torch.optim.Adagrad's)",
    "optimizer.params.initial_accumulator_value": "Adagrad: initial_accumulator_value=",
    "gradient_clipping": "max_grad_norm= (0: no clipping)",
    "bf16.enabled": "checked: every floating param must be bfloat16",
    "fp16.enabled": "checked: every floating param must be float16 (scale with torch.amp.GradScaler)",
}
"""DeepSpeed key path -> what it becomes here."""

_NOT_OPTIMIZER = "not an optimizer setting (the training loop's or the launcher's)"
_DS_COMM = "tunes DeepSpeed's own buckets and streams; offload's stage 1/2 has its own"
_NO_EFFECT = "no counterpart: offload always does this its own way"
_LOSS_SCALE = "DeepSpeed's loss scaler: use torch.amp.GradScaler with the optimizer"

IGNORED: Dict[str, str] = {
    **{k: _NOT_OPTIMIZER for k in (
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "prescale_gradients",
        "gradient_predivide_factor", "communication_data_type", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb",
        "csv_monitor", "comet", "comms_logger", "checkpoint", "data_types", "seed", "sparse_gradients")},
    "scheduler": "the LR schedule: build it on the returned optimizer (torch.optim.lr_scheduler, "
                 "transformers.get_scheduler)",
    **{f"zero_optimization.{k}": _DS_COMM for k in (
        "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size", "round_robin_gradients",
        "use_multi_rank_bucket_allreduce", "load_from_fp32_weights", "elastic_checkpoint",
        "ignore_unused_parameters", "legacy_stage1", "memory_efficient_linear", "log_trace_cache_warnings")},
    **{f"zero_optimization.{k}": "DeepSpeed's stage-3 tuning (prefetch buckets, persistence threshold, reuse "
                                  "distance, 16-bit save): offload.shard prefetches whole units, one ahead" for k in (
        "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
        "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "stage3_use_all_reduce_for_fetch_params",
        "stage3_module_granularity_threshold", "stage3_allgather_sequential")},
    **{f"zero_optimization.offload_optimizer.{k}": _NO_EFFECT for k in (
        "pin_memory", "pipeline_read", "pipeline_write", "fast_init")},
    **{f"zero_optimization.offload_param.{k}": _NO_EFFECT for k in (
        "pin_memory", "buffer_count", "buffer_size", "max_in_cpu")},
    **{f"aio.{k}": _NO_EFFECT for k in ("intra_op_parallelism", "thread_count", "single_submit",
                                         "overlap_events")},
    **{f"fp16.{k}": _LOSS_SCALE for k in ("loss_scale", "initial_scale_power", "loss_scale_window",
                                          "hysteresis", "consecutive_hysteresis", "min_loss_scale")},
    "fp16.auto_cast": "false only: cast the model yourself",
    "bf16.immediate_grad_update": _NO_EFFECT,
}
"""DeepSpeed key path -> why it is accepted and has no effect here."""

_REFUSED: Dict[str, str] = {
    "zero_optimization.cpu_offload": "the deprecated spelling: use offload_optimizer: {\"device\": \"cpu\"}",
    "zero_optimization.cpu_offload_param": "the deprecated spelling: use offload_param: {\"device\": \"cpu\"} "
                                           "with stage 3",
    "zero_optimization.zero_quantized_weights": "quantized ZeRO++ communication is not implemented",
    "zero_optimization.zero_quantized_gradients": "quantized ZeRO++ communication is not implemented",
    "zero_optimization.zero_hpz_partition_size": "hierarchical partitioning (ZeRO++) is not implemented",
    "zero_optimization.mics_shard_size": "MiCS sharding is not implemented",
    "amp": "apex AMP: use torch.amp with bf16 or GradScaler with fp16",
}

_SECTIONS = ("zero_optimization", "aio", "optimizer", "gradient_clipping", "bf16", "fp16")


def _no_duplicate_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """json.load's object_pairs_hook for a config file: json keeps the last of two equal keys
    silently (a second "optimizer" block would replace the first); DeepSpeed refuses them."""
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key}: given twice in one JSON object (DeepSpeed refuses that too); keep one")
        out[key] = value
    return out
