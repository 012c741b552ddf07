"""Functional steps over lists of tensors (``rule_step`` for any rule, ``adam_step``): the core the optimizer classes call.

Mirrors ``torch.optim.adam.adam``: the class validates and keeps state, this function
picks the implementation (``offload.kernels`` backend: native, numba or torch) and runs one
fused pass per tensor. Step numbers come in as arguments; nothing is cached between calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, List, Mapping, Optional, Sequence, Tuple

import torch

from offload.kernels import get_backend
from offload.kernels._rule_step import StepEntry
from offload.kernels._checks import check_compressed_args, check_grad_scale, check_states, check_step_args
from offload.kernels.fields import ADAM, Rule
from offload.kernels.quant import QuantArgs

__all__ = ["AdamHyper", "RuleHyper", "adam_step", "rule_step"]


@dataclass(frozen=True)
class RuleHyper:
    """One param group's step as the kernels take it: its rule and that rule's
    hyperparameters (``values``: (name, value) pairs, without step and grad_scale)."""

    rule: Rule
    values: Tuple[Tuple[str, Any], ...]
    grad_scale: float = 1.0
    """Multiplier applied to every grad inside the pass (1/loss-scale times clip coefficient)."""

    def kernel_kwargs(self, step: int) -> dict:
        return dict(self.values, step=step, grad_scale=self.grad_scale)


@dataclass(frozen=True)
class AdamHyper:
    """The hyperparameters of one Adam param group for one step, as the kernels take them
    (a ``RuleHyper`` of ``ADAM`` with named fields)."""

    rule: ClassVar[Rule] = ADAM

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool = False
    bias_correction: bool = True
    grad_scale: float = 1.0
    """Multiplier applied to every grad inside the pass (1/loss-scale times clip coefficient)."""

    def kernel_kwargs(self, step: int) -> dict:
        return dict(
            lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
            weight_decay=self.weight_decay, step=step, decoupled=self.decoupled,
            bias_correction=self.bias_correction, maximize=self.maximize,
            grad_scale=self.grad_scale,
        )


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[int],
    hyper: AdamHyper,
    *,
    params_lowp: Optional[Sequence[Optional[torch.Tensor]]] = None,
    backend: Optional[str] = None,
    num_threads: Optional[int] = None,
) -> None:
    """One Adam/AdamW step on each ``(param, grad, exp_avg, exp_avg_sq, step)``, in place:
    ``rule_step`` with the moments by name."""
    if len(exp_avgs) != len(exp_avg_sqs):
        raise ValueError(f"adam_step: list lengths differ: exp_avgs {len(exp_avgs)}, exp_avg_sqs "
                         f"{len(exp_avg_sqs)}")
    rule_step(params, grads, {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}, steps, hyper,
              params_lowp=params_lowp, backend=backend, num_threads=num_threads)


def rule_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Mapping[str, Sequence[torch.Tensor]],
    steps: Sequence[int],
    hyper: Any,
    *,
    params_lowp: Optional[Sequence[Optional[torch.Tensor]]] = None,
    backend: Optional[str] = None,
    num_threads: Optional[int] = None,
    rule: Optional[Rule] = None,
    rounding_seeds: Optional[Sequence[int]] = None,
    stochastic_states: bool = False,
) -> None:
    """One step of ``hyper.rule`` (an ``AdamHyper`` or ``RuleHyper``) on each param, in place.

    ``states``: {field name: one tensor per param}, the rule's fields exactly. ``params``
    and the states are fp32 CPU tensors; ``grads`` fp32, fp16 or bf16 of the same shapes.
    Non-contiguous tensors are updated through a contiguous copy (correct, slower).
    ``steps`` are the step numbers *after* incrementing (1 on the first step).

    Compressed states: ``rule`` is ``hyper.rule`` with its states stored another way
    (``Rule.with_state_dtype``: each state a bf16 tensor of the param's size, or uint8
    packed blocks), ``rounding_seeds`` one uint32 per param (``quant.rounding_seed``; the
    stochastic rounding streams start at element 0 of each param) and ``stochastic_states``
    whether bf16 states round stochastically (else to nearest even).
    """
    rule, n = _rule_of(hyper, rule), len(params)
    names = rule.names
    check_states(rule, states, names)
    lists = [states[k] for k in names]
    if not (len(grads) == len(steps) == n and all(len(lst) == n for lst in lists)):
        raise ValueError(f"{_who(rule)}: list lengths differ: params {n}, grads {len(grads)}, "
                         + ", ".join(f"{k} {len(lst)}" for k, lst in zip(names, lists)) + f", steps {len(steps)}")
    if params_lowp is not None and len(params_lowp) != n:
        raise ValueError(f"{_who(rule)}: list lengths differ: params {n}, params_lowp {len(params_lowp)}")
    kernel = get_backend(backend)
    quant = _quant_args(rule, n, rounding_seeds, stochastic_states)
    _check_all(rule, params, grads, lists, steps, hyper, params_lowp, num_threads, quant)
    entries, copied = [], []
    per_param = list(zip(*lists)) if lists else [()] * n  # each param's states
    for i in range(n):
        p, g, st = params[i], grads[i], per_param[i]
        if not p.numel():
            continue
        lowp = params_lowp[i] if params_lowp is not None else None
        q = None if quant is None else quant[i]
        if p.is_contiguous() and g.is_contiguous() and _all_contiguous(st) \
                and (lowp is None or lowp.is_contiguous()):
            entries.append(StepEntry(p, g, st, lowp, int(steps[i]), q))
            continue
        tensors = (p, g, *st) + (() if lowp is None else (lowp,))
        _no_shared_elements(i, rule, tensors)
        dense = tuple(t.contiguous() for t in tensors)
        copied.append((tensors, dense))
        k = 2 + len(st)
        entries.append(StepEntry(dense[0], dense[1], dense[2:k], dense[k] if lowp is not None else None,
                                 int(steps[i]), q))
    if copied and _copies_share_memory(params, grads, per_param, params_lowp):
        # [Note: aliased copies] (_copies_share_memory): one param at a time, in order
        for i in range(n):
            rule_step(*_one_param(i, params, grads, names, lists, steps), hyper,
                      params_lowp=None if params_lowp is None else [params_lowp[i]], backend=backend,
                      num_threads=num_threads, rule=rule if rule != hyper.rule else None,
                      rounding_seeds=None if rounding_seeds is None else [rounding_seeds[i]],
                      stochastic_states=stochastic_states)
        return
    try:  # checked above (_check_all): the kernel does not check each tensor again
        kernel.checked_rule_steps(rule, entries, hyper, num_threads)
    finally:
        # A non-contiguous tensor was updated through a copy: write it back (the grad was only
        # read), also when a later tensor's step raised (the default loop steps one by one).
        for tensors, dense in copied:
            for j, (orig, tmp) in enumerate(zip(tensors, dense)):
                if j != 1 and orig is not tmp:
                    orig.copy_(tmp.view_as(orig))


def _rule_of(hyper: Any, rule: Optional[Rule]) -> Rule:
    """The rule that steps: ``hyper.rule``, or ``rule``, the same update with its states
    stored another way."""
    if rule is None or rule == hyper.rule:
        return hyper.rule
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be an offload.kernels.fields.Rule, got {type(rule).__name__}")
    if rule.name != hyper.rule.name:
        raise ValueError(f"rule_step: rule {rule.name!r} is not the hyperparameters' rule {hyper.rule.name!r} "
                         "(only its states may be stored another way)")
    return rule


def _quant_args(rule: Rule, n: int, seeds: Optional[Sequence[int]],
                stochastic: bool) -> Optional[List[QuantArgs]]:
    """Each param's rounding (None: a float32 rule without seeds, today's call)."""
    if seeds is None:
        if rule.state_dtype != "float32":
            raise ValueError(f"{_who(rule)}: states stored as {rule.state_dtype} need rounding_seeds "
                             "(one per param: quant.rounding_seed(step, index))")
        return None
    if len(seeds) != n:
        raise ValueError(f"{_who(rule)}: list lengths differ: params {n}, rounding_seeds {len(seeds)}")
    _check_bool("stochastic_states", stochastic)
    return [QuantArgs(seed, 0, stochastic) for seed in seeds]


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _check_all(rule, params, grads, lists, steps, hyper, params_lowp, num_threads, quant) -> None:
    """Every tensor and the scale, before the first is updated: a bad second tensor must not
    leave the first one stepped (the kernels check again, per call, at the pointer level)."""
    check_grad_scale(hyper.grad_scale)
    for i, (p, g, step) in enumerate(zip(params, grads, steps)):
        lowp = params_lowp[i] if params_lowp is not None else None
        try:
            if quant is None:
                check_step_args(p, g, rule.fields, [lst[i] for lst in lists], lowp, step, num_threads,
                                contiguous=False)
            else:  # (its checks want contiguous tensors: the flat forms the kernel gets)
                check_compressed_args(_flat(p), _flat(g), rule.fields, [_flat(lst[i]) for lst in lists],
                                      None if lowp is None else _flat(lowp), step, num_threads, quant[i])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{_who(rule)}: tensor {i}: {exc}") from None


def _one_param(i, params, grads, names, lists, steps) -> tuple:
    """rule_step's first four arguments for param ``i`` alone."""
    return [params[i]], [grads[i]], {k: [lst[i]] for k, lst in zip(names, lists)}, [steps[i]]


def _no_shared_elements(i: int, rule: Rule, tensors: Tuple[torch.Tensor, ...]) -> None:
    """Before a param is stepped through copies: no tensor the step writes back (all but
    the grad) has elements sharing memory (an expand()ed param). Its write-back would fail
    after the kernel ran, the group half stepped. (Contiguous tensors cannot share.)"""
    names = ("param", "grad") + rule.names + ("param_lowp",)
    for j, t in enumerate(tensors):
        if j != 1 and not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1:
            raise ValueError(f"{_who(rule)}: tensor {i}: {names[j]} has elements that share memory (strides "
                             f"{tuple(t.stride())}, as expand() makes): a step would write each of them more than once")


def _copies_share_memory(params, grads, per_param, params_lowp) -> bool:
    """Whether a param with a non-contiguous tensor (stepped through copies) has a tensor
    whose storage another param's tensors use too. (Storages, not byte ranges: this runs
    only when a copy is made, the slow path, and a false alarm costs speed only.)

    [Note: aliased copies] Such a param (one transposed param listed twice, as torch allows
    with a warning) would be stepped in the batch from the same values as the other, and the
    last copy written back over the first: a step lost. rule_step then steps one param at a
    time, in order: the result of the calls one after another, as for contiguous tensors
    ([Note: aliased entries] in native/batch_alias.h)."""
    tensors = [(params[i], grads[i], *per_param[i]) + (() if params_lowp is None or params_lowp[i] is None
                                                        else (params_lowp[i],))
               for i in range(len(params)) if params[i].numel()]
    owner: dict = {}
    for i, ts in enumerate(tensors):
        copied = not _all_contiguous(ts)
        for t in ts:
            key = t.untyped_storage().data_ptr()
            first = owner.setdefault(key, (i, copied))
            if first[0] != i and (copied or first[1]):
                return True
    return False


def _who(rule: Rule) -> str:
    return "adam_step" if rule is ADAM else f"rule_step({rule.name!r})"


def _all_contiguous(ts: Tuple[torch.Tensor, ...]) -> bool:
    for t in ts:
        if not t.is_contiguous():
            return False
    return True


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
