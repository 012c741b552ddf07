"""The step face every backend shares: ``rule_step`` (states by name) and ``adam_step``.

``rule_step(rule, param, grad, states, *, step, param_lowp=None, num_threads=None,
**hyper)`` applies one optimizer rule (``offload.kernels.fields.RULES``: Adam, SGD, Adagrad, Lion) to
``param`` and the rule's states, given by field name; every tensor is checked against its
field before any memory is touched. ``adam_step(param, grad, exp_avg, exp_avg_sq, ...)`` is
the older face with the moments in field order; both end in the backend's ``_adam``, so
neither pays for the other's argument form on the per-param hot path.
"""
from __future__ import annotations

import errno
from typing import Any, Callable, Dict, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ._checks import (check_adam_args, check_compressed_args, check_states, check_step_args, check_threads,
                      written_overlap)
from .fields import ADAGRAD, ADAM, ADAM_AMSGRAD, LION, RULES, SGD, SGD_PLAIN, Rule, StateField
from .quant import QuantArgs
from .rule_consts import adagrad_args, lion_args, sgd_args, sgd_plain_args

__all__ = ["RULE_CODES", "RuleStepFace", "StepEntry", "batch_plan", "batchable", "bound_args", "resolve_rule"]

# rule -> its code in the native face (OFFLOAD_RULE_* in native/offload_native.h); a new
# rule is one entry here and one in _KERNELS, plus its method on each backend
RULE_CODES = {ADAM: 0, SGD: 1, SGD_PLAIN: 1, ADAGRAD: 2, LION: 3, ADAM_AMSGRAD: 4}


def _adam_args(step, lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction=True,
               maximize=False, grad_scale=1.0) -> tuple:
    """Adam's hyperparameters (keywords) as fold_adam's positional arguments."""
    return (lr, beta1, beta2, eps, weight_decay, step, decoupled, bias_correction, maximize,
            grad_scale)


class _Kernel(NamedTuple):
    """What a step of one rule needs, computed once (a Rule's names are rebuilt per access)."""

    rule: Rule
    names: Tuple[str, ...]
    fields: Tuple[StateField, ...]
    args: Callable[..., tuple]
    """``args(step, **hyper)``: the rule's hyperparameters as its backend method takes them
    (Python's own argument binding: the cheapest check per call)."""
    hyper: Tuple[str, ...]
    required: int
    """The first ``required`` names of ``hyper`` have no default."""
    method: str
    """The backend method: ``method(param, grad, states, param_lowp, num_threads, args)``."""


_KERNELS = {ADAM: _Kernel(ADAM, ADAM.names, ADAM.fields, _adam_args,
                          ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled",
                           "bias_correction", "maximize", "grad_scale"), 6, "_adam"),
            ADAM_AMSGRAD: _Kernel(ADAM_AMSGRAD, ADAM_AMSGRAD.names, ADAM_AMSGRAD.fields, _adam_args,
                                  ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled",
                                   "bias_correction", "maximize", "grad_scale"), 6,
                                  "_adam_amsgrad"),
            SGD: _Kernel(SGD, SGD.names, SGD.fields, sgd_args,
                         ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                          "grad_scale"), 2, "_sgd"),
            SGD_PLAIN: _Kernel(SGD_PLAIN, (), (), sgd_plain_args,
                               ("lr", "weight_decay", "maximize", "grad_scale"), 1, "_sgd"),
            ADAGRAD: _Kernel(ADAGRAD, ADAGRAD.names, ADAGRAD.fields, adagrad_args,
                             ("lr", "lr_decay", "weight_decay", "eps", "maximize", "grad_scale"),
                             1, "_adagrad"),
            LION: _Kernel(LION, LION.names, LION.fields, lion_args,
                          ("lr", "beta1", "beta2", "weight_decay", "maximize", "grad_scale"),
                          1, "_lion")}
_ADAM_KERNEL = _KERNELS[ADAM]


_RESOLVED: Dict[Rule, Rule] = {}
"""Compressed rules already resolved (a handful: each rule in its state forms)."""


def resolve_rule(rule: Union[Rule, str]) -> Rule:
    """``rule`` (a ``Rule`` or its name) if the kernels implement it; else ValueError. A rule
    with compressed states (``Rule.with_state_dtype``) resolves as itself."""
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown optimizer rule {rule!r}; the kernels implement {sorted(RULES)}")
        rule = RULES[rule]
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be an offload.kernels.fields.Rule or its name, got {type(rule).__name__}")
    base = RULES.get(rule.name)
    if base is None or base not in _KERNELS or not _compressed_form_of(rule, base):
        known = ", ".join(f"{r.name} {[f.describe() for f in r.fields]}" for r in _KERNELS)
        raise ValueError(f"no kernel for rule {rule.name!r} with fields "
                         f"{[f.describe() for f in rule.fields]}; the kernels implement: {known} "
                         f"(each with its states as float32, bfloat16 or int8 blocks: "
                         f"Rule.with_state_dtype)")
    return rule


def _compressed_form_of(rule: Rule, base: Rule) -> bool:
    """Whether ``rule`` is ``base`` with each state stored in a form the kernels take."""
    return any(rule == base.with_state_dtype(d) for d in ("float32", "bfloat16", "int8"))


def _hyper_error(k: _Kernel, hyper: Mapping[str, object]) -> Optional[TypeError]:
    """The error for missing or unexpected names; None if the names were right (the
    TypeError was a check of a value's type, already worded)."""
    missing = [name for name in k.hyper[:k.required] if name not in hyper]
    extra = sorted(name for name in hyper if name not in k.hyper)
    if not missing and not extra:
        return None
    return TypeError(f"rule {k.rule.name!r} takes the hyperparameters {list(k.hyper)}; "
                     f"missing {missing}, unexpected {extra}")


def _bind(k: _Kernel, step, hyper: Mapping[str, object]) -> tuple:
    """``hyper`` as the rule's backend method takes it; a TypeError naming the missing or
    unexpected names when they are wrong."""
    try:
        return k.args(step, **hyper)
    except TypeError:
        err = _hyper_error(k, hyper)
        if err is None:
            raise
        raise err from None


class StepEntry(NamedTuple):
    """One tensor of a batched step (``RuleStepFace.checked_rule_steps``): contiguous tensors
    of any shape, checked by the caller."""

    param: torch.Tensor
    grad: torch.Tensor
    states: Tuple[torch.Tensor, ...]
    """In the field order of the rule as stored."""
    param_lowp: Optional[torch.Tensor]
    step: int
    quant: Optional[QuantArgs]
    """None: a float32 rule over a float32 param (``checked_rule_step``); else the rounding
    of compressed states or a bfloat16 param (``rule_step``'s compressed path)."""


def _resolved(rule: Rule) -> Rule:
    known = _RESOLVED.get(rule)
    if known is None:  # resolving builds the rule's three forms: once per rule, not per call
        known = _RESOLVED[rule] = resolve_rule(rule)
    return known


def batch_plan(rule: Rule, entries: Sequence[StepEntry], hyper: Any
               ) -> Iterator[Tuple[_Kernel, Rule, tuple, Optional[QuantArgs], tuple]]:
    """(kernel, rule as stored, (param, grad, states, param_lowp), quant, hyperparameters as
    the kernel's method takes them) of each non-empty entry; ``hyper.kernel_kwargs(step)``
    is bound once per distinct step."""
    bound: Dict[int, tuple] = {}
    for e in entries:
        if not e.param.numel():
            continue
        if e.quant is None:
            k, stored = (_ADAM_KERNEL if rule is ADAM else _KERNELS[rule]), rule
        else:
            stored = _resolved(rule)
            k = _KERNELS[stored.base]
        args = bound.get(e.step)
        if args is None:
            args = bound[e.step] = _bound(k, hyper, e.step)
        yield k, stored, (e.param, e.grad, e.states, e.param_lowp), e.quant, args


def _bound(k: _Kernel, hyper: Any, step: int) -> tuple:
    kwargs = hyper.kernel_kwargs(step)
    kwargs.pop("step", None)  # (bound positionally)
    return _bind(k, step, kwargs)


def batchable(rule: Rule) -> bool:
    """Whether ``checked_rule_steps`` takes ``rule`` with float32 entries (``quant`` None):
    a float32 rule of its own kernel, as ``rule_step`` steps it without its compressed path."""
    return rule is ADAM or rule in _KERNELS


def bound_args(rule: Rule, hyper: Any, step: int) -> Tuple[_Kernel, tuple]:
    """(kernel, hyperparameters as its method takes them) of float32 ``rule`` at ``step``,
    as ``batch_plan`` binds them."""
    k = _ADAM_KERNEL if rule is ADAM else _KERNELS[rule]
    return k, _bound(k, hyper, step)


def _refuse_overlap(param, states, names, param_lowp) -> None:
    why = param.numel() and written_overlap(param, states, names, param_lowp)
    if why:
        raise ValueError(why)


class RuleStepFace:
    """Mixin: a backend defines each rule's method, for Adam ``_adam(param, grad, states,
    param_lowp, num_threads, hyper)``, called with checked, non-empty tensors, ``states`` in
    field order and ``hyper`` in ``fold_adam``'s argument order."""

    # Whether this backend's kernels refuse a step whose written tensors overlap (EINVAL).
    refuses_overlap = False

    def _unaliased(self, run: Callable[[], None], param, states, names, param_lowp) -> None:
        """``run()`` (one step), refused if the tensors it writes overlap (a param that is its
        own exp_avg). A backend whose kernel refuses that itself (native: batch_alias.h) is
        not checked first: the check cost ~3 us per call on the flat store's per-item path,
        the kernel's is free. Its EINVAL is explained here instead."""
        if not self.refuses_overlap:
            _refuse_overlap(param, states, names, param_lowp)
            return run()
        try:
            return run()
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                _refuse_overlap(param, states, names, param_lowp)
            raise

    def preflight(self, num_threads: Optional[int] = None) -> None:
        """Raise what a step would raise about its setting (the thread count; the native
        backend: OFFLOAD_ISA, OFFLOAD_PREFETCH), before anything is updated: the optimizers
        call it with the step's other checks, so a typo in the environment is refused as
        bad input, not met halfway through a step ([Note: failed steps] in step_guard.py)."""
        check_threads(num_threads)

    def rule_step(self, rule: Union[Rule, str], param: torch.Tensor, grad: torch.Tensor,
                  states: Mapping[str, torch.Tensor], *, step: int,
                  param_lowp: Optional[torch.Tensor] = None, num_threads: Optional[int] = None,
                  rounding_seed: int = 0, element_offset: int = 0,
                  stochastic_states: bool = False, **hyper) -> None:
        """One step of ``rule`` over ``param`` and ``states`` ({field name: tensor}), in place.

        Compressed states (``rule`` from ``Rule.with_state_dtype``) and a bfloat16 ``param``
        (its own master, rounded stochastically) go through ``_compressed``; the rounding
        streams take ``rounding_seed`` (uint32) and ``element_offset`` (the index of
        param's first element), [Note: stochastic rounding to bfloat16] in quant.py."""
        k = _ADAM_KERNEL if rule is ADAM else _KERNELS.get(rule)
        if k is None and isinstance(rule, str):  # a name: its float32 rule, not the compressed path
            k = _KERNELS.get(RULES.get(rule))
        if k is None or param.dtype != torch.float32:
            return self._rule_step_compressed(rule, param, grad, states, step, param_lowp,
                                              num_threads, QuantArgs(rounding_seed, element_offset,
                                                                     bool(stochastic_states)), hyper)
        ordered = check_states(k.rule, states, k.names)
        n = check_step_args(param, grad, k.fields, ordered, param_lowp, step, num_threads)
        args = _bind(k, step, hyper)
        if n:
            self._unaliased(lambda: getattr(self, k.method)(param, grad, ordered, param_lowp, num_threads, args),
                            param, ordered, k.names, param_lowp)

    def checked_rule_step(self, rule: Rule, param: torch.Tensor, grad: torch.Tensor,
                          states: Tuple[torch.Tensor, ...], *, step: int,
                          param_lowp: Optional[torch.Tensor] = None, num_threads: Optional[int] = None,
                          **hyper) -> None:
        """``rule_step`` of a float32 ``rule`` whose 1-D contiguous tensors (``states`` in
        field order) the caller has checked already, as ``functional.rule_step`` does for
        every tensor before the first is updated: the per-tensor checks are not run twice
        (they were a tenth of a small param's step)."""
        k = _ADAM_KERNEL if rule is ADAM else _KERNELS[rule]
        args = _bind(k, step, hyper)
        if param.numel():
            getattr(self, k.method)(param, grad, states, param_lowp, num_threads, args)

    def checked_rule_steps(self, rule: Rule, entries: Sequence[StepEntry], hyper: Any,
                           num_threads: Optional[int] = None) -> None:
        """One step of ``rule`` (as ``functional.rule_step`` passes it) over every entry,
        whose tensors the caller has checked; ``hyper.kernel_kwargs(step)`` gives each
        entry's hyperparameters. This default steps them one by one through the flat forms;
        the native backend runs the whole batch in one call."""
        names = rule.names
        for i, e in enumerate(entries):  # refused before any entry is stepped, as the native batch
            why = e.param.numel() and written_overlap(e.param, e.states, names, e.param_lowp)
            if why:
                raise ValueError(f"tensor {i}: {why}")
        for e in entries:
            fp, fg, fs = e.param.view(-1), e.grad.view(-1), tuple(t.view(-1) for t in e.states)
            fl = None if e.param_lowp is None else e.param_lowp.view(-1)
            if e.quant is None:
                self.checked_rule_step(rule, fp, fg, fs, param_lowp=fl, num_threads=num_threads,
                                       **hyper.kernel_kwargs(e.step))
            else:
                self.rule_step(rule, fp, fg, dict(zip(names, fs)), param_lowp=fl, num_threads=num_threads,
                               rounding_seed=e.quant.seed, element_offset=e.quant.offset,
                               stochastic_states=e.quant.stochastic_states, **hyper.kernel_kwargs(e.step))

    def _rule_step_compressed(self, rule, param, grad, states, step, param_lowp, num_threads,
                              q: QuantArgs, hyper) -> None:
        rule = _resolved(rule) if isinstance(rule, Rule) else resolve_rule(rule)
        k = _KERNELS[rule.base]
        ordered = check_states(rule, states, k.names)
        n = check_compressed_args(param, grad, rule.fields, ordered, param_lowp, step,
                                  num_threads, q)
        args = _bind(k, step, hyper)
        if n:
            self._unaliased(lambda: self._compressed(k.method, rule.fields, param, grad, ordered, param_lowp,
                                                     num_threads, args, q),
                            param, ordered, k.names, param_lowp)

    def _compressed(self, method: str, fields: Tuple[StateField, ...], param: torch.Tensor,
                    grad: torch.Tensor, states: Tuple[torch.Tensor, ...],
                    param_lowp: Optional[torch.Tensor], num_threads: Optional[int], hyper: tuple,
                    q: QuantArgs) -> None:
        """One step of the rule whose float32 method is ``method`` ("_adam", ...) with states
        stored as ``fields`` (bfloat16, or packed int8 blocks) and/or a bfloat16 ``param``;
        ``hyper`` as ``method`` takes it. Same bits as ``compressed_ref.compose_step`` around
        this backend's own ``method``."""
        raise NotImplementedError(f"backend {getattr(self, 'name', type(self).__name__)!r} "
                                  f"has no compressed-state kernel")

    def adam_step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float, step: int, decoupled: bool,
                  bias_correction: bool = True, maximize: bool = False,
                  grad_scale: float = 1.0, param_lowp: Optional[torch.Tensor] = None,
                  num_threads: Optional[int] = None) -> None:
        """``rule_step(ADAM, param, grad, {"exp_avg": ..., "exp_avg_sq": ...}, ...)``."""
        n = check_adam_args(param, grad, exp_avg, exp_avg_sq, param_lowp, step, num_threads)
        if n:
            hyper = (lr, beta1, beta2, eps, weight_decay, step, decoupled, bias_correction, maximize, grad_scale)
            self._unaliased(lambda: self._adam(param, grad, (exp_avg, exp_avg_sq), param_lowp, num_threads, hyper),
                            param, (exp_avg, exp_avg_sq), ADAM.names, param_lowp)

    def _adam(self, param: torch.Tensor, grad: torch.Tensor, states: Tuple[torch.Tensor, ...],
              param_lowp: Optional[torch.Tensor], num_threads: Optional[int], hyper: tuple) -> None:
        raise NotImplementedError

    def _adam_amsgrad(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        """Adam with amsgrad=True: ``states`` (exp_avg, exp_avg_sq, max_exp_avg_sq), ``hyper``
        as ``_adam`` takes it."""
        raise NotImplementedError

    # SGD (both rules: ``states`` is () without momentum), Adagrad and Lion: ``hyper`` is
    # what rule_consts' sgd_args / adagrad_args / lion_args return
    def _sgd(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        raise NotImplementedError

    def _adagrad(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        raise NotImplementedError

    def _lion(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        raise NotImplementedError
