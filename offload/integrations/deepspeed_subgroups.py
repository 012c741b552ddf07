"""``DeepSpeedCPUAdam.step_subgroup`` / ``rollback_subgroup``, DeepSpeed's sub-group calls.

[Note: DeepSpeed's sub-group steps]
DeepSpeed's ZeRO-3 offload steps its fp32 partition one sub-group at a time: it points
``param_groups[0]["params"]`` at the sub-group's flat tensor and calls ``step_subgroup(i)``,
whose states live in ``opt.state[i]`` (keyed by the sub-group's index, not by a param: one flat
tensor after another shares the slot), with ``"step"`` a Python int; ``rollback_subgroup(i)``
undoes the last step of sub-group ``i`` (an overflow found after the optimizer ran). Scripts and
DeepSpeed's own tests (``tests/unit/ops/adam/test_cpu_adam.py``, ``TestCPUAdamSubgroup``)
call them on ``DeepSpeedCPUAdam``; here they are the same calls, states and counts:

- the update is offload's kernel (``rule_step``): the bits ``step()`` gives from the same
  states, AdamW or Adam (``adamw_mode``), the optimizer's ``bias_correction``, the group's
  ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``maximize``;
- the states are the sub-group's, apart from the optimizer's own store: float32, or bfloat16
  (``fp32_optimizer_states=False``) rounded as the store rounds them; a bfloat16 / float16
  param is updated through a float32 copy and rounded back to nearest, and no master is kept,
  as DeepSpeed keeps none;
- one param with a grad per call: DeepSpeed shapes the sub-group's state like the param it
  first sees, so a second param would be stepped on another's moments;
- ``state_dict()`` is not their checkpoint (DeepSpeed's engine saves its sub-groups' states
  itself): over fp32 params (the host store) it lists them under their int keys, where one
  may meet a param's index, as DeepSpeed's does; over bf16/fp16 params (a flat store) it
  keeps their ``"step"`` only;
- refused, before anything changes: ``offload="nvme"`` (the states would sit in RAM beside the
  swap files), ``stage >= 1``, ``max_grad_norm`` (these calls do not clip; DeepSpeed's engine
  clips before them), ``state_dtype="int8"``, params or grads off the CPU, sparse grads.

``rollback_subgroup`` inverts the update in float32 arithmetic, as DeepSpeed's
``adam_rollback`` does: the param from the current moments, then the moments from the grad
(``m = (m' - (1 - beta1) g) / beta1``, the same for ``v`` with ``g**2``). It is not bit-exact
(the divisions round; a param that came out of the step rounded to bfloat16 comes back within
that rounding), and it needs the grad of the step it undoes still in ``p.grad``. DeepSpeed's
undoes only float32 tensors (on others it prints an error and lowers the count alone) and
always as AdamW; here every param dtype and both modes, and a step that cannot be inverted
(``beta1`` or ``beta2`` 0, ``lr * weight_decay == 1`` in AdamW mode) raises ValueError.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from offload.kernels.fields import ADAM
from offload.kernels.quant import rounding_seed
from offload.optim.functional import rule_step
from offload.optim.state_codec import STOCHASTIC_BF16_STATES

__all__ = ["SubgroupSteps"]


def _salt(subgroup_id: Any) -> int:
    """The rounding streams' salt of a sub-group: its index (DeepSpeed's are ints); 0 for
    another key (``hash`` of a str differs from run to run)."""
    return subgroup_id if isinstance(subgroup_id, int) and not isinstance(subgroup_id, bool) else 0


def _with_closure(closure: Optional[Callable[[], Any]]) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SubgroupSteps:
    """The two calls, for a subclass of :class:`offload.Adam` (``adam_w_mode`` set)."""

    def _subgroup_param(self, what: str) -> Tuple[Dict[str, Any], torch.Tensor]:
        """The one (group, param) with a grad, after the refusals of the module docstring."""
        self._check_open()
        why = None
        if self.config.offload == "nvme":
            why = "offload='nvme' (its states would sit in RAM beside the swap files)"
        elif self.stage:
            why = (f"stage={self.stage} (each rank holds a shard of every param, not a sub-group; stage=0, the "
                   "default of these classes, steps each rank's own sub-groups as DeepSpeed's)")
        elif self._ctx.max_grad_norm is not None:
            why = "max_grad_norm (it does not clip: DeepSpeed's engine clips before it)"
        elif self.state_dtype not in ("float32", "bfloat16"):
            why = f"state_dtype={self.state_dtype!r} (its states are float32 or bfloat16)"
        if why is not None:
            raise NotImplementedError(f"DeepSpeedCPUAdam.{what} is not supported with {why}; use step()")
        pairs = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if len(pairs) != 1:
            raise ValueError(f"DeepSpeedCPUAdam.{what} steps the one param of a sub-group (DeepSpeed sets "
                             f"param_groups[0]['params'] to the sub-group's flat tensor), but {len(pairs)} params "
                             "have a grad")
        group, p = pairs[0]
        if p.device.type != "cpu" or p.grad.device.type != "cpu":
            raise ValueError(f"DeepSpeedCPUAdam.{what}: the param and its grad must be on the CPU, got "
                             f"{p.device} and {p.grad.device}")
        if p.grad.is_sparse or p.grad.layout != torch.strided:
            raise ValueError(f"DeepSpeedCPUAdam.{what} takes dense grads, got layout {p.grad.layout}")
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"DeepSpeedCPUAdam.{what} steps float32, bfloat16 or float16 params, got {p.dtype}")
        return group, p

    def _subgroup_rule(self):
        return ADAM.with_state_dtype(self.state_dtype)

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of sub-group ``subgroup_id``'s param on ``opt.state[subgroup_id]``
        ([Note: DeepSpeed's sub-group steps])."""
        loss = _with_closure(closure)
        group, p = self._subgroup_param("step_subgroup")
        rule = self._subgroup_rule()
        state = self.state[subgroup_id]
        if len(state) == 0:
            dtype = torch.float32 if self.state_dtype == "float32" else torch.bfloat16
            state["step"] = 0
            state["exp_avg"] = torch.zeros(p.shape, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype)
        for key in ("exp_avg", "exp_avg_sq"):
            t = state.get(key)
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                raise ValueError(f"DeepSpeedCPUAdam.step_subgroup({subgroup_id!r}): its {key} has shape "
                                 f"{getattr(t, 'shape', None)}, the param {tuple(p.shape)}: one sub-group's param "
                                 "keeps its shape")
        step = int(state["step"]) + 1
        master, lowp = (p, None) if p.dtype == torch.float32 else (p.float(), p)
        extra = {} if rule is ADAM else dict(rule=rule, stochastic_states=STOCHASTIC_BF16_STATES,
                                               rounding_seeds=[rounding_seed(step, _salt(subgroup_id))])
        rule_step([master], [p.grad], {"exp_avg": [state["exp_avg"]], "exp_avg_sq": [state["exp_avg_sq"]]},
                  [step], self._adam_hyper(group, 1.0), params_lowp=None if lowp is None else [lowp],
                  backend=self.backend, num_threads=self.num_threads, **extra)
        state["step"] = step
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Undo the last ``step_subgroup(sub_group_id)`` (its grad still in ``p.grad``)."""
        loss = _with_closure(closure)
        state = self.state.get(sub_group_id)  # (not self.state[...]: that would make one)
        if not state:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {sub_group_id} "
                               "as it has not been initialized.")
        if int(state.get("step", 0)) <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}")
        group, p = self._subgroup_param("rollback_subgroup")
        h = self._adam_hyper(group, 1.0)
        if h.beta1 == 0 or h.beta2 == 0 or (h.decoupled and h.lr * h.weight_decay == 1):
            raise ValueError(f"DeepSpeedCPUAdam.rollback_subgroup({sub_group_id!r}): a step with beta1={h.beta1}, "
                             f"beta2={h.beta2}, lr * weight_decay={h.lr * h.weight_decay} cannot be undone "
                             "(it forgot what it replaced)")
        old_p, m, v = _undo_adam(p.float(), p.grad.float(), state["exp_avg"].float(), state["exp_avg_sq"].float(),
                                 int(state["step"]), h)
        p.copy_(old_p)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        state["step"] = int(state["step"]) - 1
        return loss


def _undo_adam(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
               h: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The param and moments before Adam step ``step`` (torch's update, in float32)."""
    g = -g if h.maximize else g
    bc1 = 1 - h.beta1 ** step if h.bias_correction else 1.0
    bc2 = 1 - h.beta2 ** step if h.bias_correction else 1.0
    update = (h.lr / bc1) * m / (v.sqrt() / bc2 ** 0.5 + h.eps)
    p = p + update
    if h.decoupled:
        p = p / (1 - h.lr * h.weight_decay)
    elif h.weight_decay:
        g = g + h.weight_decay * p  # the grad the step used: decay of the param before it
    m = (m - (1 - h.beta1) * g) / h.beta1
    v = (v - (1 - h.beta2) * g * g) / h.beta2
    return p, m, v
