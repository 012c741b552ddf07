"""[Note: GradScaler across ranks] torch's GradScaler looks for inf/nan in each rank's
*local* grads (with DDP they are averaged already, so the ranks agree; here each rank reduces
the grads inside the step). The flat store all-reduces the ``found_inf`` GradScaler hands the
step (``GradSource.agree`` in flat/grads.py; the stage-3 store in its ``begin_step``), so every
rank skips a step together. But
``GradScaler.update()`` then reads its own per-device flags, not the optimizer's: after an
overflow on some ranks only, those ranks halved their loss scale and the others did not, and
the next steps summed grads scaled by different factors, silently (forty-fifth session).

GradScaler passes the optimizer no reference to itself (the ``grad_scaler`` keyword is
deprecated), so the agreed flag is written into the scaler found up the stack: the frame of
``GradScaler.step`` (torch/amp/grad_scaler.py, also the one of torch.cuda.amp's and FSDP's
ShardedGradScaler, which inherit it) holds the scaler and the optimizer, and its
``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]`` are the flags ``update()``
sums. A step not called by GradScaler.step has nothing to write back.

A rank without any grad this step (an empty batch: its missing grads count as zeros, [Note: a
grad on some ranks only] in flat/grads.py) is one GradScaler recorded no flag for: its
``step`` hands the optimizer ``sum([])``, the int 0, and its ``update()`` raises "No inf checks
were recorded" after a step the others took (and a skip agreed elsewhere was not applied there:
the int was not replaced, so that rank stepped alone). The stores take that 0 as a flag
(``as_flag``) and the agreed one is recorded as the rank's only flag (forty-eighth session,
the 2-rank history fuzz: gloo aborted on the next mismatched collective).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

_SCALER_MODULE = "torch.amp.grad_scaler"


def as_flag(found_inf: Any) -> Optional[torch.Tensor]:
    """GradScaler's ``found_inf`` as a tensor (None: no scaler; the int 0 it hands a step when
    this rank has no grad to check becomes a float32 zero)."""
    if found_inf is None or isinstance(found_inf, torch.Tensor):
        return found_inf
    return torch.full((), float(found_inf), dtype=torch.float32)


def share_found_inf(optimizer: Any, agreed: torch.Tensor) -> bool:
    """Write the ranks' agreed ``found_inf`` into the flags of the GradScaler whose ``step``
    called ``optimizer.step``; whether one was found. Only an inf found elsewhere changes a
    flag (the agreement is a MAX: a rank's own inf is in its flags already)."""
    from offload.shard.callers import caller

    frame = caller(frozenset({"step"}), _SCALER_MODULE, start=2)
    if frame is None or frame.f_locals.get("optimizer") is not optimizer:
        return False
    states = getattr(frame.f_locals.get("self"), "_per_optimizer_states", None)
    flags = (states or {}).get(id(optimizer), {}).get("found_inf_per_device")
    if flags is None:
        return False
    if not flags:  # this rank had no grad: the agreed flag is its only one
        flags[agreed.device] = agreed.detach().to(torch.float32).reshape(()).clone()
        return True
    if float(agreed) > 0 and not any(float(f) > 0 for f in flags.values()):
        next(iter(flags.values())).fill_(1.0)  # update() sums the flags: one is enough
    return True
