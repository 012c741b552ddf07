"""The optimizer's attributes that live in its step context (``offload/optim/context.py``).

Users and integrations set ``grads_already_averaged``, ``state_dict_rank0_only`` and
``max_grad_norm`` as attributes of the optimizer (offload/integrations/hf.py does); GradScaler
sets ``grad_scale`` and ``found_inf`` on it for one ``step()``; torch replaces ``state`` and
``param_groups`` when it loads. This mixin of ``offload.Adam`` / ``AdamW`` turns each into
the step context's, which is all a store reads ([Note: the step context] in protocol.py).
"""
from __future__ import annotations

from typing import Any, Optional

from offload.optim.protocol import optional
from offload.optim.scaler_sync import share_found_inf

__all__ = ["ContextAttributes"]


class ContextAttributes:
    """Needs ``self._ctx`` (a StepContext) and ``self._store``."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("state", "param_groups") and "_ctx" in self.__dict__:
            self._ctx.rebind(**{name: value})  # torch replaced one of its containers

    @property
    def grads_already_averaged(self) -> bool:
        """The grads arrive averaged across ranks already (a DDP-wrapped model): the flat
        store slices them instead of reducing them again ([Note: DDP] in flat/grads.py)."""
        return self._ctx.grads_already_averaged

    @grads_already_averaged.setter
    def grads_already_averaged(self, value: bool) -> None:
        self._ctx.grads_already_averaged = bool(value)

    @property
    def state_dict_rank0_only(self) -> bool:
        """Several ranks: ``state_dict()`` keeps the gathered full states on rank 0 only."""
        return self._ctx.state_dict_rank0_only

    @state_dict_rank0_only.setter
    def state_dict_rank0_only(self, value: bool) -> None:
        self._ctx.state_dict_rank0_only = bool(value)

    @property
    def max_grad_norm(self) -> Optional[float]:
        """Global-norm clipping inside the step (None: off)."""
        return self._ctx.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Optional[float]) -> None:
        self._ctx.max_grad_norm = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, and with ``release_grads`` the grads backward released to the host too
        (``p.grad`` is None already: [Note: releasing grads] in offload/optim/flat/grads.py)."""
        super().zero_grad(set_to_none)
        drop = optional(self._store, "drop_released_grads")
        if drop is not None:
            drop()

    def _begin_step(self) -> None:
        """This step's facts into the context: GradScaler sets ``grad_scale`` and
        ``found_inf`` on the optimizer for this call only (torch/amp/grad_scaler.py). A
        store that agrees ``found_inf`` across ranks replaces it in the context, and the
        agreed flag goes into GradScaler's own flags, which its ``update()`` reads after the
        step ([Note: GradScaler across ranks] in scaler_sync.py)."""
        found_inf = getattr(self, "found_inf", None)
        self._ctx.begin_step(getattr(self, "grad_scale", None), found_inf)
        begin = optional(self._store, "begin_step")
        if begin is not None:
            begin()
        self._found_inf_agreed(found_inf)

    def _found_inf_agreed(self, local: Any) -> None:
        """The store replaced GradScaler's ``local`` found_inf by the ranks' agreed one: it goes
        back to the scaler ([Note: GradScaler across ranks] in scaler_sync.py)."""
        if self._ctx.found_inf is not local:
            self.found_inf = self._ctx.found_inf
            share_found_inf(self, self._ctx.found_inf)
