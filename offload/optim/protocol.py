"""What the optimizer asks of a state store: the store protocol, in one place.

A *store* keeps the optimizer states (and, for low-precision or device params, the fp32
master) somewhere and runs the update there. Three exist: ``HostState`` (fp32 CPU params,
the rule's states in ``opt.state``), ``SwappedState`` (fp32 CPU params updated in place,
the rule's states in swap files: the one-shard face of ``SwappedShards``) and ``FlatState``
(a flat fp32 master and the states for device / fp16 / bf16 / partitioned params, in host
buffers or, with ``offload="nvme"``, in ``SwappedShards``).
``offload.optim.base.RuleOptimizer`` (Adam, AdamW, SGD, Adagrad, Lion) drives all three
through the methods below and nothing else; ``Store`` lists what every store has, ``OPTIONAL`` what only some have, and
``optional(store, name)`` is the one way to ask for the latter.

[Note: the step context] The other way, a store never reads an attribute of its optimizer
and keeps no reference to it, strong or weak. It is built from explicit arguments (the
param groups, the OffloadConfig, the backend, the thread count, the process group) and the
optimizer's ``StepContext`` (``offload/optim/context.py``; the store keeps it as ``ctx``),
which the optimizer owns (``opt._ctx``, built before the store) and keeps current: the flags users set on the
optimizer (``no_sync()``, ``grads_already_averaged``, ``state_dict_rank0_only``,
``max_grad_norm`` are properties over it), GradScaler's ``grad_scale`` / ``found_inf``
(put into it at the start of each ``step()``; a store that agrees ``found_inf`` across
ranks writes it back there and the optimizer hands it to GradScaler), the step counts
(``ctx.steps``: torch's ``opt.state[p]["step"]``, the one place they live; the optimizer
advances them before ``store.step`` and each work item carries its param's count) and
torch's current containers (``ctx.torch_state``). Hooks on the optimizer that a store needs
are the optimizer's (``offload/optim/guards.py``): they call the store's ``begin_step``,
``before_load`` and ``after_load``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, runtime_checkable

import torch

__all__ = ["Store", "OPTIONAL", "optional"]


@runtime_checkable
class Store(Protocol):
    """The methods every store has, each with its contract."""

    kind: str
    """"host", "nvme" or "flat": shown in memory_report() and in error messages."""

    def step(self, batches: List[Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor, int]]]]) -> Dict[str, float]:
        """Update every (param, grad, step) of every (hyper, items) batch; seconds per phase."""

    def export_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Full-shaped copies of ``p``'s states for state_dict() ({} when it has none; collective when partitioned)."""

    def import_state(self, p: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        """Take ``p``'s states from a loaded state_dict entry."""

    def reset_state(self, p: torch.Tensor) -> None:
        """Zero ``p``'s moments (a loaded state_dict has no entry for it, as torch)."""

    def memory_report(self) -> Dict[str, Any]:
        """Bytes held per tier ("device", "pinned", "pageable", "nvme") and store details."""

    def close(self, keep_swap: bool = False) -> None:
        """Release buffers (and swap files unless ``keep_swap``); idempotent."""


OPTIONAL: Dict[str, str] = {
    "master": "(p) -> tensor: p's full fp32 master, when the store keeps one apart from p (the flat store); "
              "a collective when partitioned",
    "add_param_group": "(group) -> None: take a param group added after construction",
    "check_param": "(index, p) -> None: raise ValueError when the store cannot hold p (no add_param_group)",
    "agree_on_grads": "(failed=False, facts=(0, 0)) -> each rank's (failed, *facts) or None: settle, across "
                      "ranks, which params have a grad this step and GradScaler's found_inf (a collective, the "
                      "step's first: [Note: a step the ranks agree to begin]); called before grads()",
    "grads": "(p) -> grad or None: the grad the step uses for p (p.grad when absent); never a collective",
    "prepare_grads": "() -> None: move this step's grads to where the kernel reads them (timed as grad_transfer)",
    "global_grad_sumsq": "(work) -> (sum of squares, nonfinite): the grad norm over every rank, for clipping",
    "save_checkpoint": "(directory, extra) -> None: stream the states to a checkpoint directory",
    "load_checkpoint": "(directory) -> None: load states and steps from a checkpoint directory, all or nothing",
    "clear_failure": "(accept_params) -> None: leave the failed state a failed step left the store in",
    "begin_step": "() -> None: a step begins (GradScaler's facts are in the context); may replace ctx.found_inf "
                  "by the ranks' agreed flag (a collective, on every rank)",
    "before_load": "(state_dict, params) -> None: torch's load_state_dict is about to replace opt.state "
                   "(params: the optimizer's, in the dict's numbering)",
    "after_load": "() -> None: torch's load_state_dict is done (before the user's post hooks)",
    "params_written": "() -> None: the step's params were marked written (their _version bumped, "
                      "[Note: stepped params are marked written] in step_guard.py): record their versions",
    "end_load": "() -> None: load_state_dict is over, done or failed: drop what before_load kept",
    "drop_released_grads": "() -> None: forget the grads backward released to the host (release_grads): "
                           "called by opt.zero_grad() and after each step()",
    "commit_writes": "() -> None: commit the states written since the last step (write_state: an assigned "
                     "opt.state[p][k], Adagrad's initial sum, a restarted param) with the step counts as they "
                     "are; called before a step advances them ([Note: writes before the counts] in step_guard.py)",
    "keep_optional": "(fields) -> None: states a param may hold beyond the store's fields (an Adam param's "
                     "max_exp_avg_sq with no amsgrad group when built): kept, checkpointed and loaded where held",
    "resumed": "bool (a property): the states came from a swap directory a previous run left (resume=); "
               "the constructor's initial states then do not replace them",
}
"""The methods only some stores have, and the contract of each (the optimizer falls back
to torch's behaviour, or refuses with a clear error, where a store lacks one)."""


def optional(store: Any, name: str) -> Optional[Callable[..., Any]]:
    """The store's method ``name`` (one of ``OPTIONAL``), or None when it has none."""
    if name not in OPTIONAL:
        raise AttributeError(f"{name!r} is not an optional method of the store protocol "
                             f"(offload/optim/protocol.py): one of {sorted(OPTIONAL)}")
    return getattr(store, name, None)
