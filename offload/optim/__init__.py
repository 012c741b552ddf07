"""Optimizers: ``Adam``, ``AdamW`` and the functional ``adam_step`` they call."""
from offload.optim.adam import Adam, AdamW
from offload.optim.functional import AdamHyper, adam_step

__all__ = ["Adam", "AdamW", "AdamHyper", "adam_step"]
