"""A step with compressed states as the scheme defines it: decode, the float32 rule, encode.

``compose_step`` is the torch reference backend's compressed step, and the oracle the tests
hold the native and numba kernels to: given a backend's own float32 rule method, the
compressed step of that backend must equal decode -> that method -> encode bit for bit
(quant.py's notes). It decodes whole states to float32 buffers, which the fused kernels
never do; it is a reference, not a fast path.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from . import quant
from .fields import StateField

__all__ = ["compose_step", "decode_state", "encode_state"]


def decode_state(field: StateField, t: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 values of state tensor ``t`` stored as ``field``."""
    if field.blocked:
        return quant.decode_blocks(t.reshape(-1), numel, field.signed, field.code)
    return t.reshape(-1).float().clone()


def encode_state(field: StateField, values: torch.Tensor, out: torch.Tensor, *,
                 stochastic: bool, seed: int, offset: int, stream: int, exact: bool = False) -> None:
    """Store float32 ``values`` into state tensor ``out`` (``field``'s storage), in place.
    ``exact``: blocks by ``quant.encode_blocks_exact`` (loading values, never in a step)."""
    flat = out.view(-1)
    if field.blocked:
        encode = quant.encode_blocks_exact if exact else quant.encode_blocks
        flat.copy_(encode(values, field.signed, field.code))
    elif field.dtype == torch.bfloat16:
        rounded = (quant.round_bf16_stochastic(values, seed, offset, stream) if stochastic
                   else quant.round_bf16_nearest(values))
        flat.copy_(rounded)
    else:
        flat.copy_(values)


def compose_step(fp32_step: Callable, fields: Sequence[StateField], param: torch.Tensor,
                 grad: torch.Tensor, states: Tuple[torch.Tensor, ...],
                 param_lowp: Optional[torch.Tensor], num_threads: Optional[int], hyper: tuple,
                 q: quant.QuantArgs) -> None:
    """One compressed step through ``fp32_step(param, grad, states, param_lowp, num_threads,
    hyper)`` (a backend's float32 rule method): states decoded, stepped, encoded; a bfloat16
    param stepped in float32 and rounded stochastically (stream 0)."""
    n = param.numel()
    p32 = param.reshape(-1).float().clone() if param.dtype != torch.float32 else param.view(-1)
    s32 = tuple(decode_state(f, t, n) for f, t in zip(fields, states))
    fp32_step(p32, grad, s32, param_lowp, num_threads, hyper)
    for k, (f, t, v) in enumerate(zip(fields, states, s32)):
        encode_state(f, v, t, stochastic=q.stochastic_states, seed=q.seed, offset=q.offset,
                     stream=1 + k)
    if param.dtype == torch.bfloat16:
        param.view(-1).copy_(quant.round_bf16_stochastic(p32, q.seed, q.offset, 0))
