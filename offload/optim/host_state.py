"""States of fp32 CPU params kept in host memory, in torch's own layout.

This is the store behind ``offload="none"`` and ``offload="cpu"`` for fp32 CPU params:
the param is its own fp32 master and is updated in place; the rule's states (each step's
``hyper.rule``: ``exp_avg`` and ``exp_avg_sq`` for Adam, ``momentum_buffer`` for SGD, ...)
live in ``optimizer.state[p]`` exactly as torch's optimizers keep them, so ``state_dict()``
needs no translation (compressed states, ``state_dtype="bfloat16"`` / ``"int8"``, are the
exception: see [Note: compressed states in the host store] below).

[Note: store interface] Every state store (this one, ``SwappedState`` for NVMe, the flat
store for device params) offers the methods of ``offload/optim/protocol.py``; the optimizer
class drives them the same way.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.optim.optimizer import _get_scalar_dtype

from offload.kernels.fields import ADAM, Rule, StateField, field_names
from offload.kernels.quant import rounding_seed
from offload.optim.host_dtypes import (HOST_ONLY_DTYPES, as_param_layout, fill_value, float64_step, real_numel,
                                       real_view, refuse_float64)
from offload.optim.context import StepContext
from offload.optim.functional import rule_step
from offload.optim.host_prepared import PreparedGroups
from offload.optim.state_codec import filled, from_torch_layout, is_stored_form, stored_nbytes, to_torch_layout
from offload.swap.ckpt_dir import manifest_path
from offload.swap.ckpt_schema import check_steps_cover

log = logging.getLogger(__name__)

__all__ = ["HostState", "StepBatch", "MIN_COMPRESSED_NUMEL", "nothing_to_swap"]

MIN_COMPRESSED_NUMEL = 4096
"""A param of fewer elements keeps float32 states whatever ``state_dtype`` says."""

# One param group's work for a step: its hyperparameters and (param, grad, step) triples,
# step being the number after incrementing.
StepBatch = Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor, int]]]


class HostState:
    """fp32 CPU params updated in place, moments in ``opt.state[p]`` (torch's, reached
    through the step context's ``torch_state``).

    [Note: compressed states in the host store] With ``state_dtype="bfloat16"`` each state
    in ``opt.state[p]`` is a bf16 tensor of p's shape; with ``"int8"`` a 1-D uint8 tensor of
    packed blocks (``field.storage_numel(p.numel())`` bytes: 256 codes and a float32 absmax
    per block of 256 elements, kernels/quant.py), so the raw entry is not torch's layout;
    ``state_dict()`` gives float32 (state_codec.py). The blocks are per param (each param's
    states start a block), and a param of fewer than ``MIN_COMPRESSED_NUMEL`` (4096)
    elements keeps float32 states, as bitsandbytes and torchao do: biases and norms are few
    bytes and the most sensitive to quantization. A step rounds with
    ``quant.rounding_seed(step, index)``, index the param's position in the optimizer
    (param_groups order), from element 0 of the param.
    """

    kind = "host"
    # (class defaults: an optimizer pickled before compressed states existed unpickles as float32)
    state_dtype = "float32"
    stochastic_states = True
    _prepared: Optional[PreparedGroups] = None
    _optional: Tuple[StateField, ...] = ()  # (see keep_optional; a pickle from before has none)
    _unstepped = False  # states made before the first step (Adagrad's sum: make_states)

    def __init__(self, *, ctx: StepContext, backend: Optional[str], num_threads: Optional[int],
                 fields: Sequence[StateField] = ADAM.fields, fill: Optional[Dict[str, float]] = None,
                 state_dtype: str = "float32", stochastic_states: bool = True):
        """``fields``: every state the optimizer's rules keep, float32 (what checkpoints and
        reports cover); ``fill[name]``: the value a new state starts at (0 when absent; plain
        numbers, so the store holds nothing of its optimizer); ``state_dtype``: how a param of
        at least ``MIN_COMPRESSED_NUMEL`` elements stores them; ``stochastic_states``: bf16
        states round stochastically (else to nearest even)."""
        # The moments live in torch's opt.state, which torch's load_state_dict replaces: the
        # context's TorchState always holds the current one (never a copy kept here).
        if ctx.torch_state is None:
            raise ValueError("HostState keeps the moments in torch's opt.state: its context needs a torch_state")
        self.ctx = ctx
        self._torch = ctx.torch_state
        self._backend = backend
        self._num_threads = num_threads
        # the float32 fields: with compressed states, a param's own are stored_fields(p)
        self.fields = tuple(StateField(f.name) for f in fields)
        self.names = field_names(self.fields)
        self._fill = dict(fill or {})
        Rule("fields", self.fields).with_state_dtype(state_dtype)  # refuses an unknown state_dtype
        self.state_dtype = state_dtype
        self.stochastic_states = bool(stochastic_states)
        self._prepared = PreparedGroups()  # [Note: prepared batches]

    @staticmethod
    def check_param(index: int, p: torch.Tensor) -> None:
        if p.device.type != "cpu":
            raise ValueError(
                f"parameter {index} is on {p.device}; this optimizer updates fp32 CPU params in "
                "place: pass device params when the optimizer is built (they get a flat fp32 master)"
            )
        if p.dtype not in (torch.float32,) + HOST_ONLY_DTYPES:
            raise ValueError(
                f"parameter {index} has dtype {p.dtype}; this optimizer updates fp32 CPU params in "
                "place: pass fp16/bf16 params when the optimizer is built (they get a flat fp32 master)"
            )

    # ---------------------------------------------------------------- stored forms
    def compressed(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s states are stored as ``state_dtype`` (else float32; a complex or
        float64 param's stay complex64 or float64, torch's layout: [Note: complex params])."""
        return self.state_dtype != "float32" and p.numel() >= MIN_COMPRESSED_NUMEL and p.dtype == torch.float32

    def rule_for(self, rule: Rule, p: torch.Tensor) -> Rule:
        """``rule`` with its states stored as ``p``'s are."""
        return rule.with_state_dtype(self.state_dtype) if self.compressed(p) else rule

    def stored_fields(self, p: torch.Tensor) -> Tuple[StateField, ...]:
        """Every state field of ``p`` as stored (an optional one where ``p`` holds it)."""
        st = self._torch.state.get(p, {})
        return self.rule_for(Rule("fields", self.fields + tuple(f for f in self._optional if f.name in st)), p).fields

    def keep_optional(self, fields: Sequence[StateField]) -> None:
        """States a param may hold beyond ``fields`` (its optimizer's rules when built): an
        Adam param's max_exp_avg_sq, once a group turned amsgrad on or a load brought one.
        Stored as the others (state_dtype), in checkpoints where a param holds one ([Note:
        kept states in checkpoints] in ckpt_holding.py) and read from those that have it."""
        self._optional = tuple(StateField(f.name) for f in fields if f.name not in self.names)

    def _held_fields(self, params: List[torch.Tensor]) -> Tuple[StateField, ...]:
        """``fields`` and the optional ones a param of ``params`` holds: what a checkpoint holds."""
        held = [f for f in self._optional if any(f.name in self._torch.state.get(p, {}) for p in params)]
        return self.fields + tuple(held)

    def _stored(self, field: StateField, p: torch.Tensor, t: Any) -> torch.Tensor:
        """``t`` (an entry of opt.state[p], or None) in ``field``'s storage form."""
        n = p.numel()
        if field.dtype == torch.float32:  # torch's own layout, as it always was
            return torch.full_like(p, fill_value(p, self._fill.get(field.name, 0.0)),
                                   memory_format=torch.preserve_format) if t is None else t
        if t is None:  # encoded chunk by chunk: no float32 copy of the state
            return filled(field, self._fill.get(field.name, 0.0), p.shape)
        if is_stored_form(field, t, n) and (field.blocked or t.shape == p.shape):
            return t
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == n:
            # torch's layout (a loaded state dict, Adagrad's initial sum): encoded once here
            return from_torch_layout(field, t, p.shape)
        raise ValueError(f"opt.state[p][{field.name!r}] of a param of {n} elements is "
                         f"{getattr(t, 'dtype', type(t).__name__)} with {getattr(t, 'numel', lambda: '?')()} "
                         f"elements; expected {field.describe()} storage or float32 values of p's shape")

    def _states(self, p: torch.Tensor, fields: Tuple[StateField, ...]) -> List[torch.Tensor]:
        st = self._torch.state[p]
        for field in fields:
            t = st.get(field.name)
            stored = self._stored(field, p, t)
            if stored is not t:
                st[field.name] = stored
        return [st[f.name] for f in fields]

    def settle(self, params: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Encode the states torch's layout put into ``opt.state`` (a load, Adagrad's
        initial sum) as they are stored, so ``opt.state`` and ``memory_report()`` show the
        stored form before the next step."""
        if self.state_dtype == "float32":
            return
        for p in self._torch.params() if params is None else params:
            st = self._torch.state.get(p)
            if st and any(f.name in st for f in self.fields):
                self._states(p, tuple(f for f in self.stored_fields(p) if f.name in st))

    def make_states(self, p: torch.Tensor) -> None:
        """Every state of ``p`` that ``opt.state[p]`` lacks, made as stored and filled with its
        start value (Adagrad's initial sum at construction): a compressed one is encoded
        from one block, never through a float32 copy of the whole state."""
        self._states(p, self.stored_fields(p))
        self._unstepped = True  # states before the first step: load_checkpoint loads them at step 0

    def step(self, batches: List[StepBatch]) -> Dict[str, float]:
        t0 = time.perf_counter()
        index = {id(p): i for i, p in enumerate(self._torch.params())} if self.state_dtype != "float32" else {}
        if self._prepared is None:  # (an optimizer pickled before it existed)
            self._prepared = PreparedGroups()
        self._prepared.keep_slots(len(batches))
        for slot, (hyper, items) in enumerate(batches):
            if self.state_dtype == "float32":
                plain, packed = items, []
            else:
                plain = [it for it in items if not self.compressed(it[0])]
                packed = [it for it in items if self.compressed(it[0])]
            if not plain:
                self._prepared.forget(slot)  # (a group with nothing to step keeps no storages alive)
            elif not self._prepared.step(slot, self._backend, self._num_threads, self._torch.state,
                                         hyper, plain):
                self._step_part(hyper, hyper.rule, plain, index)
                self._prepared.remember(slot, self._backend, self._num_threads, self._torch.state, hyper, plain)
            if packed:
                self._step_part(hyper, hyper.rule.with_state_dtype(self.state_dtype), packed, index)
        return {"kernel": time.perf_counter() - t0}

    def _step_part(self, hyper: Any, rule: Rule, items: List[Tuple[torch.Tensor, torch.Tensor, int]],
                   index: Dict[int, int]) -> None:
        """One rule_step call over ``items``, whose states are all stored as ``rule``'s."""
        wide = [it for it in items if it[0].dtype == torch.float64]
        if wide:  # torch's arithmetic in float64: [Note: float64 params]
            float64_step(rule, hyper, [p for p, _, _ in wide], [g for _, g, _ in wide],
                         [tuple(self._states(p, rule.fields)) for p, _, _ in wide], [s for _, _, s in wide])
            items = [it for it in items if it[0].dtype != torch.float64]
            if not items:
                return
        params = [p for p, _, _ in items]
        states = [self._states(p, rule.fields) for p in params]
        extra: Dict[str, Any] = {}
        if rule != hyper.rule:
            extra = dict(rule=rule, stochastic_states=self.stochastic_states,
                         rounding_seeds=[rounding_seed(s, index[id(p)]) for p, _, s in items])
        # complex params, their grads and states as float32 pairs: [Note: complex params]
        real = real_view if any(p.is_complex() for p in params) else _same
        rule_step([real(p) for p in params], [real(g) for _, g, _ in items],
                  {k: [real(s[j]) for s in states] for j, k in enumerate(rule.names)},
                  [s for _, _, s in items], hyper, backend=self._backend, num_threads=self._num_threads, **extra)

    def export_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``p``'s states in torch's layout: the very tensors when stored as float32, new
        float32 tensors of p's shape when compressed."""
        st = self._torch.state.get(p, {})
        return {f.name: self.torch_layout(f, p, st[f.name]) for f in self.stored_fields(p) if f.name in st}

    def torch_layout(self, field: StateField, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """State ``t`` of ``p`` (stored as ``field``, or still in torch's layout) as torch keeps it."""
        if field.dtype == torch.float32 or not is_stored_form(field, t, p.numel()):
            return t  # float32 already (not yet encoded: see settle)
        return to_torch_layout(field, t, p.numel(), p.shape)

    def import_state(self, p: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        # torch's load_state_dict already placed the tensors in opt.state[p].
        pass

    def reset_state(self, p: torch.Tensor) -> None:
        # torch's load_state_dict replaced opt.state: a param without an entry has no moments.
        pass

    # The one checkpoint format ([Note: one checkpoint format] in offload/zero/ckpt_states.py),
    # so that one saved with offload="cpu" loads with offload="nvme" and back. Moments of
    # params that have not stepped yet are written as their initial values with step 0, as
    # SwappedState does.
    def _checkpoint_tensors(self, params: List[torch.Tensor],
                            fields: Tuple[StateField, ...]) -> Dict[str, List[torch.Tensor]]:
        """Each state of each param, float32 and 1-D (float32 states: see save_checkpoint)."""
        states: Dict[str, List[torch.Tensor]] = {f.name: [] for f in fields}
        for p in params:
            st = self._torch.state.get(p, {})
            for key in states:
                t = st.get(key)
                if t is None:  # (its values are never read back: a param at step 0 loads no state)
                    t = torch.full_like(p, fill_value(p, self._fill.get(key, 0.0)))
                states[key].append(real_view(t.detach()).reshape(-1).contiguous())
        return states

    def _stored_tensors(self, params: List[torch.Tensor], fields: Tuple[StateField, ...]
                        ) -> Tuple[Dict[str, List[torch.Tensor]], Dict[str, List[StateField]]]:
        """Each state of each param as stored (encoded without keeping it where opt.state
        still holds torch's layout: a save changes nothing), and its field."""
        states: Dict[str, List[torch.Tensor]] = {f.name: [] for f in fields}
        forms: Dict[str, List[StateField]] = {f.name: [] for f in fields}
        for p in params:
            st = self._torch.state.get(p, {})
            for f in self.rule_for(Rule("fields", fields), p).fields:
                t = self._stored(f, p, st.get(f.name))
                states[f.name].append(real_view(t).reshape(-1) if t.is_complex() else t)
                forms[f.name].append(f)
        return states, forms

    def save_checkpoint(self, directory: str, extra: Optional[Dict[str, object]] = None) -> str:
        """The states as stored: float32 states in the format every stage-0 store writes;
        compressed ones as each param's stored tensor (packed int8 blocks or bf16, float32
        for a small param), byte for byte ([Note: packed host checkpoints] in
        offload/zero/ckpt_packed.py: no one typed field holds per-param blocks and float32
        small params). Both load into every stage-0 store and state_dtype."""
        from offload.zero.ckpt_packed import save_packed
        from offload.zero.ckpt_states import save_states

        params = self._torch.params()
        refuse_float64(params, "save_checkpoint")
        numels = [real_numel(p) for p in params]
        meta = dict(extra or {}, steps=self.ctx.steps.all(params), shapes=[list(p.shape) for p in params])
        fields = self._held_fields(params)
        if self.state_dtype == "float32":
            return save_states(directory, numels, self._checkpoint_tensors(params, fields), meta)
        states, forms = self._stored_tensors(params, fields)
        return save_packed(directory, numels, states, forms, meta)

    def _read_checkpoint(self, directory: str, params: List[torch.Tensor]
                         ) -> Tuple[Dict[str, Any], Dict[str, List[torch.Tensor]]]:
        """(meta, name -> each param's state): as stored where the checkpoint holds the form
        this store keeps (bit for bit), else float32 of p's shape (``settle`` encodes it).
        Read into new tensors: a failed load leaves the current state untouched."""
        from offload.zero.ckpt_convert import read_converted
        from offload.zero.ckpt_packed import read_packed, saved_names
        from offload.zero.ckpt_states import load_states

        numels = [real_numel(p) for p in params]
        theirs = saved_names(directory) if self._optional else ()
        fields = self.fields + tuple(f for f in self._optional if f.name in theirs)  # (keep_optional)
        names = field_names(fields)
        packed = read_packed(directory, numels, names)  # [Note: packed host checkpoints]
        if packed is not None:
            meta, forms, stored = packed
            return meta, {k: [self._kept(forms[k][i], p, stored[k][i], fields) for i, p in enumerate(params)]
                          for k in names}
        converted = read_converted(directory, numels, fields)  # other state dtypes: [Note: converting loads]
        if converted is not None:
            meta, scratch = converted
        else:
            scratch = {k: [torch.empty(n, dtype=torch.float32) for n in numels] for k in names}
            meta = load_states(directory, numels, scratch, fields)
        return meta, {k: [as_param_layout(t, p) for t, p in zip(v, params)] for k, v in scratch.items()}

    def _kept(self, form: StateField, p: torch.Tensor, t: torch.Tensor,
              fields: Tuple[StateField, ...]) -> torch.Tensor:
        """State ``t`` of ``p`` read as ``form``: as it is when ``p`` keeps that form (stored
        as ``fields`` are), else decoded to float32 of p's shape."""
        mine = next((f for f in self.rule_for(Rule("fields", fields), p).fields if f.name == form.name), None)
        if form == mine:
            return t if form.blocked else as_param_layout(t, p)
        return to_torch_layout(form, t, p.numel(), p.shape)

    def load_checkpoint(self, directory: str) -> None:
        params = self._torch.params()
        refuse_float64(params, "load_checkpoint")
        meta, scratch = self._read_checkpoint(directory, params)
        if meta.get("shapes") != [list(p.shape) for p in params]:
            raise ValueError(f"{directory}: checkpoint of params with other shapes")
        # all checked before any state changes: a failed load leaves every param's state as it was
        check_steps_cover(meta, len(params), manifest_path(directory))
        state = self._torch.state
        for i, (p, step) in enumerate(zip(params, meta["steps"])):
            state.pop(p, None)  # a new entry, as torch's load_state_dict makes
            if step == 0 and not self._unstepped:
                continue  # (Adagrad's params have their sum from the start: a written one is kept)
            self.ctx.steps.set(p, step)  # first: torch's key order (step, exp_avg, exp_avg_sq)
            if step == 0:
                state[p]["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            for key in scratch:
                state[p][key] = scratch[key][i]
        self.settle(params)

    def memory_report(self) -> Dict[str, Any]:
        nbytes = 0
        for st in self._torch.state.values():
            for key in self.names + field_names(self._optional):
                t = st.get(key)
                if isinstance(t, torch.Tensor):
                    nbytes += stored_nbytes(t)  # as stored: bf16, packed int8 blocks or float32
        report: Dict[str, Any] = {"device": 0, "pinned": 0, "pageable": nbytes, "nvme": 0}
        if self.state_dtype != "float32":
            report["state_dtype"] = self.state_dtype
        return report

    def close(self, keep_swap: bool = False) -> None:
        # (keep_swap: offload="nvme" where nothing went to swap files, SGD without momentum's
        # fp32 params stepped in place: there is nothing to keep)
        if self._prepared is not None:
            self._prepared.clear()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def nothing_to_swap(opt: Any) -> bool:
    """``offload="nvme"`` for fp32 CPU params at stage 0 whose rules keep no state per
    element (SGD without momentum): the swap files would hold nothing, so the host store
    steps the params in place, as ``offload="cpu"`` does (the swap-only options then act on
    nothing), with a log line saying so. torch's optimizer tests and a loop that passes
    ``offload="nvme"`` to every optimizer train on instead of meeting a ValueError. A
    momentum switched on later keeps its buffers in host memory (the host store steps each
    group by its own rule)."""
    if opt.config.offload != "nvme" or any(rule.names for rule in opt.rules()):
        return False
    log.warning("%s: no state to swap (the rule keeps none per element, as SGD without momentum): "
                "offload='nvme' steps the params in place as offload='cpu' does, and writes no swap files",
                type(opt).__name__)
    return True

