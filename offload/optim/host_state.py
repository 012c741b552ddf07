"""States of fp32 CPU params kept in host memory, in torch's own layout.

This is the store behind ``offload="none"`` and ``offload="cpu"`` for fp32 CPU params:
the param is its own fp32 master and is updated in place; the rule's states (each step's
``hyper.rule``: ``exp_avg`` and ``exp_avg_sq`` for Adam, ``momentum_buffer`` for SGD, ...)
live in ``optimizer.state[p]`` exactly as torch's optimizers keep them, so ``state_dict()``
needs no translation.

[Note: store interface] Every state store (this one, ``SwappedState`` for NVMe, the flat
store for device params) offers the methods of ``offload/optim/protocol.py``; the optimizer
class drives them the same way.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.kernels.fields import ADAM, StateField, field_names
from offload.optim.context import StepContext
from offload.optim.functional import rule_step

__all__ = ["HostState", "StepBatch"]

# One param group's work for a step: its hyperparameters and (param, grad, step) triples,
# step being the number after incrementing.
StepBatch = Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor, int]]]


class HostState:
    """fp32 CPU params updated in place, moments in ``opt.state[p]`` (torch's, reached
    through the step context's ``torch_state``)."""

    kind = "host"

    def __init__(self, *, ctx: StepContext, backend: Optional[str], num_threads: Optional[int],
                 fields: Sequence[StateField] = ADAM.fields, fill: Optional[Dict[str, float]] = None):
        """``fields``: every state the optimizer's rules keep (what checkpoints and reports
        cover); ``fill[name]``: the value a new state starts at (0 when absent; plain numbers, so the
        store holds nothing of its optimizer)."""
        # The moments live in torch's opt.state, which torch's load_state_dict replaces: the
        # context's TorchState always holds the current one (never a copy kept here).
        if ctx.torch_state is None:
            raise ValueError("HostState keeps the moments in torch's opt.state: its context needs a torch_state")
        self.ctx = ctx
        self._torch = ctx.torch_state
        self._backend = backend
        self._num_threads = num_threads
        self.fields = tuple(fields)
        self.names = field_names(self.fields)
        self._fill = dict(fill or {})

    @staticmethod
    def check_param(index: int, p: torch.Tensor) -> None:
        if p.device.type != "cpu":
            raise ValueError(
                f"parameter {index} is on {p.device}; this optimizer updates fp32 CPU params in "
                "place: pass device params when the optimizer is built (they get a flat fp32 master)"
            )
        if p.dtype != torch.float32:
            raise ValueError(
                f"parameter {index} has dtype {p.dtype}; this optimizer updates fp32 CPU params in "
                "place: pass fp16/bf16 params when the optimizer is built (they get a flat fp32 master)"
            )

    def _states(self, p: torch.Tensor, names: Tuple[str, ...]) -> List[torch.Tensor]:
        st = self._torch.state[p]
        for name in names:
            if name not in st:
                st[name] = torch.full_like(p, self._fill.get(name, 0.0), memory_format=torch.preserve_format)
        return [st[name] for name in names]

    def step(self, batches: List[StepBatch]) -> Dict[str, float]:
        t0 = time.perf_counter()
        for hyper, items in batches:
            if not items:
                continue
            names = hyper.rule.names
            params = [p for p, _, _ in items]
            states = [self._states(p, names) for p in params]
            rule_step(params, [g for _, g, _ in items], {k: [s[j] for s in states] for j, k in enumerate(names)},
                      [s for _, _, s in items], hyper, backend=self._backend, num_threads=self._num_threads)
        return {"kernel": time.perf_counter() - t0}

    def export_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        st = self._torch.state.get(p, {})
        return {k: st[k] for k in self.names if k in st}

    def import_state(self, p: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        # torch's load_state_dict already placed the tensors in opt.state[p].
        pass

    def reset_state(self, p: torch.Tensor) -> None:
        # torch's load_state_dict replaced opt.state: a param without an entry has no moments.
        pass

    # The one checkpoint format ([Note: one checkpoint format] in offload/zero/ckpt_states.py),
    # so that one saved with offload="cpu" loads with offload="nvme" and back. Moments of
    # params that have not stepped yet are written as zeros with step 0, as SwappedState does.
    def _checkpoint_tensors(self) -> Tuple[List[torch.Tensor], Dict[str, List[torch.Tensor]]]:
        params = self._torch.params()
        states: Dict[str, List[torch.Tensor]] = {k: [] for k in self.names}
        for p in params:
            st = self._torch.state.get(p, {})
            for key in states:
                t = st.get(key)
                t = (torch.full((p.numel(),), self._fill.get(key, 0.0), dtype=torch.float32) if t is None
                     else t.detach().reshape(-1).contiguous())
                states[key].append(t)
        return params, states

    def save_checkpoint(self, directory: str, extra: Optional[Dict[str, object]] = None) -> str:
        from offload.zero.ckpt_states import save_states

        params, states = self._checkpoint_tensors()
        steps = self.ctx.steps.all(params)
        meta = dict(extra or {}, steps=steps, shapes=[list(p.shape) for p in params])
        return save_states(directory, [p.numel() for p in params], states, meta)

    def load_checkpoint(self, directory: str) -> None:
        from offload.zero.ckpt_states import load_states

        params = self._torch.params()
        scratch = {k: [torch.empty(p.numel(), dtype=torch.float32) for p in params] for k in self.names}
        # Loaded into scratch first: a failed load leaves the current state untouched.
        meta = load_states(directory, [p.numel() for p in params], scratch, self.fields)
        if meta.get("shapes") != [list(p.shape) for p in params]:
            raise ValueError(f"{directory}: checkpoint of params with other shapes")
        state = self._torch.state
        for i, (p, step) in enumerate(zip(params, meta["steps"])):
            state.pop(p, None)  # a new entry, as torch's load_state_dict makes
            if int(step) == 0:
                continue
            self.ctx.steps.set(p, int(step))  # first: torch's key order (step, exp_avg, exp_avg_sq)
            for key in self.names:
                state[p][key] = scratch[key][i].view(p.shape)

    def memory_report(self) -> Dict[str, int]:
        nbytes = 0
        for st in self._torch.state.values():
            for key in self.names:
                t = st.get(key)
                if isinstance(t, torch.Tensor):
                    nbytes += t.numel() * t.element_size()
        return {"device": 0, "pinned": 0, "pageable": nbytes, "nvme": 0}

    def close(self) -> None:
        pass
