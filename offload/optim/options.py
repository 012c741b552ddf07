"""Checks of the optimizer's constructor arguments, before anything is built.

torch's own arguments (``lr``, ``betas``, ``eps``, ...) are checked as ``torch.optim.Adam``
checks them, with its messages and exception types, so code written against torch fails the
same way here; where torch lets a raw Python error through (``betas=(0.9,)``, ``lr="0.1"``) a
clear ``ValueError``/``TypeError`` naming the argument is raised instead, of the same type
where torch's is a TypeError. The offload options are checked for type and for whether they
do anything with the chosen ``offload`` target: an option that would be silently ignored
(``resume=True`` without swap files) is refused, since the user who passed it believes it
took effect.
"""
from __future__ import annotations

import math
import numbers
import os
import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from offload.config import IOConfig, OffloadConfig, parse_bytes
from offload.kernels._threads import MAX_THREADS
from offload.optim.host_dtypes import COMPLEX_DTYPES, COMPLEX_RULE_CLASSES

__all__ = ["check_group_rule", "options_now", "check_hyper", "check_extras", "check_compression", "check_master_dtype", "make_config", "check_param_dtype", "io_config", "check_loaded_groups",
           "clear_execution_flags", "check_release_grads", "refuse_release_grads", "unexpected_keyword"]

# Options that act only on swap files; with offload="none" or "cpu" they would do nothing.
NVME_ONLY = ("swap_dir", "max_host_bytes", "verify", "resume", "io_engine")

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_number(x: Any) -> bool:
    # numbers.Real: numpy scalars from config files compare as torch's checks need.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_scalar(name: str, x: Any, *, tensor_ok: bool) -> None:
    if _is_number(x) or (tensor_ok and isinstance(x, torch.Tensor)):
        return
    kind = "a float or a 1-element Tensor" if tensor_ok else "a float"
    raise TypeError(f"{name} must be {kind}, got {type(x).__name__} {x!r}")


def _check_one_element(name: str, x: Any) -> None:
    _check_scalar(name, x, tensor_ok=True)
    if isinstance(x, torch.Tensor) and x.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element")


def _check_lr(lr: Any, foreach: Optional[bool], capturable: bool) -> None:
    _check_scalar("lr", lr, tensor_ok=True)
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def _check_betas(betas: Any, foreach: Optional[bool], capturable: bool) -> Tuple[Any, Any]:
    if isinstance(betas, (str, bytes, torch.Tensor)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        _check_scalar(f"betas[{i}]", b, tensor_ok=True)
        if isinstance(b, torch.Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, torch.Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor) and foreach and not capturable:
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
    # As torch's _to_scalar: a 1-element Tensor of any shape becomes 0-dim.
    return tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() else b for b in betas)


def check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any, amsgrad: bool, *, foreach: Optional[bool],
                capturable: bool, differentiable: bool, fused: Optional[bool]) -> Tuple[Any, Any]:
    """torch.optim.Adam's checks, in its order; returns ``betas`` as torch stores them."""
    _check_lr(lr, foreach, capturable)
    _check_one_element("eps", eps)  # (a Tensor too, as torch's constructor and step take one)
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    betas = _check_betas(betas, foreach, capturable)
    _check_one_element("weight_decay", weight_decay)
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    check_torch_flags(foreach=foreach, differentiable=differentiable, fused=fused)
    if capturable:
        raise NotImplementedError(
            "offload.Adam/AdamW: capturable=True (CUDA graphs) is not supported: the step runs on the "
            "host with swap I/O, which a graph cannot capture; use torch.optim.AdamW(capturable=True) "
            "or capturable=False")
    if differentiable:
        refuse_differentiable("Adam/AdamW", "AdamW")
    return betas


def check_torch_flags(*, foreach: Optional[bool], differentiable: bool, fused: Optional[bool]) -> None:
    """torch's own refusals of flag combinations, with its type and message (RuntimeError), so
    code that handles torch's errors sees the same here; they come before ours."""
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if foreach and fused:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def refuse_differentiable(ours: str, torchs: str) -> None:
    raise NotImplementedError(
        f"offload.{ours}: differentiable=True is not supported: the kernels update the states in "
        f"place outside autograd; use torch.optim.{torchs}(differentiable=True) or differentiable=False (only "
        f"offload.{torchs} itself turns into it: offload/optim/differentiable.py)")


def _check_bool(name: str, value: Any) -> None:
    # A string such as "no" or "false" is truthy: taking it as True would do the opposite of
    # what the user wrote.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def unexpected_keyword(cls_name: str, name: str, *inits: Any) -> TypeError:
    """Python's TypeError for an unknown keyword ``name``, naming the class the user called
    (not the base whose ``__init__`` took the rest) and the closest known one among ``inits``'
    keywords (a typo such as ``max_host_byte``)."""
    import difflib
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    known = [p.name for init in inits for p in inspect.signature(init).parameters.values()
             if p.kind in kinds and p.name not in ("self", "params", "defaults")]
    close = difflib.get_close_matches(name, known, n=1)
    return TypeError(f"{cls_name}.__init__() got an unexpected keyword argument {name!r}"
                     + (f"; did you mean {close[0]!r}?" if close else ""))


def check_extras(*, max_grad_norm: Any, num_threads: Any, stage: Any, bias_correction: Any) -> None:
    """The offload-specific numbers: type and range, so nothing fails later inside a step."""
    if max_grad_norm is not None:
        if not _is_number(max_grad_norm):
            raise TypeError(f"max_grad_norm must be a float or None, got {type(max_grad_norm).__name__} "
                            f"{max_grad_norm!r}")
        if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be a finite number > 0)")
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int):
            raise TypeError(f"num_threads must be an int >= 1 or None, got {type(num_threads).__name__} "
                            f"{num_threads!r}")
        if not 1 <= num_threads <= MAX_THREADS:
            raise ValueError(f"Invalid num_threads: {num_threads} (1 to {MAX_THREADS})")
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        raise ValueError(f"Invalid stage: {stage!r} (0, 1, 2, or 3 over the params of offload.shard(model))")
    _check_bool("bias_correction", bias_correction)


def check_release_grads(release_grads: Any, offload: Any) -> bool:
    """``release_grads`` frees each device grad once backward has copied it to the host
    ([Note: releasing grads] in offload/optim/flat/grads.py): the host must keep the grads,
    which it does only when the states are offloaded there (or to NVMe)."""
    _check_bool("release_grads", release_grads)
    if release_grads and offload not in ("cpu", "nvme"):
        raise ValueError(f"release_grads=True frees device grads once copied to the host, where the offloaded "
                         f"states are stepped; it needs offload='cpu' or 'nvme', got offload={offload!r}")
    return release_grads


def refuse_release_grads(release_grads: bool, host_store: bool, stage3: bool) -> None:
    """``release_grads`` with a store whose grads are not device memory copied to the host:
    stage 3 (offload.shard frees each unit's full grads once reduce-scattered already), and
    fp32 CPU params at stage 0 (their grads are host memory the kernel reads in place)."""
    if not release_grads or not (host_store or stage3):
        return
    if stage3:
        raise ValueError("release_grads=True is for stages 0-2: the params of offload.shard() are stage 3, whose "
                         "full grads are freed once reduce-scattered already; drop release_grads")
    raise ValueError("release_grads=True frees device grads once copied to the host; fp32 CPU params at stage 0 "
                     "have their grads in host memory already, read in place by the step: drop release_grads")


def check_compression(state_dtype: Any, master_dtype: Any) -> None:
    """``state_dtype`` ("float32", "bfloat16", "int8") and ``master_dtype`` (None, "float32",
    "bfloat16"): what the optimizer keeps per element (offload/kernels/quant.py)."""
    from offload.kernels.fields import STATE_DTYPES

    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
    if master_dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"master_dtype must be None, 'float32' or 'bfloat16', got {master_dtype!r}")


def check_master_dtype(master_dtype: Any, params: Any, cls_name: str = "Adam/AdamW", base: int = 0) -> None:
    """``master_dtype="bfloat16"``: every param is bfloat16 (each its own master, stepped in
    float32 and rounded stochastically, so no fp32 copy is kept); fp32 params are their own
    float32 master already, and fp16 params have no bf16 form to be. ``base``: the index of
    ``params[0]`` among the optimizer's params (a group added later)."""
    if master_dtype != "bfloat16":
        return
    params = list(params)
    bad = [(base + i, p) for i, p in enumerate(params) if isinstance(p, torch.Tensor) and p.dtype != torch.bfloat16]
    if not bad:
        return
    index, p = bad[0]
    if base == 0 and len(bad) == len(params) and all(p.dtype == torch.float32 and p.device.type == "cpu" for _, p in bad):
        raise ValueError(
            f"offload.{cls_name}: master_dtype='bfloat16' makes no sense for fp32 CPU params: each is its own "
            "float32 master, updated in place (a bfloat16 master is for bfloat16 params, which then keep no fp32 "
            "copy); drop master_dtype (and use state_dtype='bfloat16' or 'int8' for fewer state bytes)")
    raise ValueError(
        f"offload.{cls_name}: master_dtype='bfloat16' needs bfloat16 params (each its own master, updated with "
        f"stochastic rounding); parameter {index} has dtype {p.dtype}: convert the model to bfloat16 "
        "(model.to(torch.bfloat16)) or drop master_dtype")


def io_config(io_engine: Any) -> IOConfig:
    """``io_engine``: None or an engine name, an ``IOConfig`` (``load_tuning(path)``), or the
    path of a tuning file written by ``offload bench-io --tune``."""
    if io_engine is None:
        return IOConfig()
    if isinstance(io_engine, IOConfig):
        return io_engine
    if isinstance(io_engine, (str, bytes, os.PathLike)):
        text = os.fsdecode(io_engine)
        if text in ("auto", "uring", "threads", "aiofiles"):
            return IOConfig(engine=text)
        if os.path.sep in text or text.endswith(".json") or os.path.exists(text):
            from offload.io.tuning import load_tuning

            return load_tuning(text)
        raise ValueError(f"unknown io engine {text!r}; expected auto, uring, threads, aiofiles, an IOConfig "
                         "or the path of a tuning file (offload bench-io --tune)")
    raise TypeError(f"io_engine must be None, an engine name, an IOConfig or a tuning file's path, got "
                    f"{type(io_engine).__name__} {io_engine!r}")


def _bytes_option(value: Any) -> Optional[int]:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"max_host_bytes: {exc}") from None


def _swap_dir(value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise TypeError(f"swap_dir must be a path (str, bytes or os.PathLike), got {type(value).__name__} {value!r}")
    # "~/nvme" as a shell and DeepSpeed's users write it (a config file's path is not expanded
    # by any shell): else it would name a directory "~" under the working directory
    return os.path.expanduser(os.fsdecode(value))


def _check_resume(value: Any) -> None:
    """``resume``: a bool as before, or one of the restart modes of offload/swap/runs.py
    ([Note: restarts]). Any other string is refused: "yes" or "false" taken as True would do
    what the user did not write."""
    if isinstance(value, bool) or (isinstance(value, str) and value in ("auto", "discard")):
        return
    if isinstance(value, str):
        raise ValueError(f"Invalid resume: {value!r} (True, False, 'auto' or 'discard')")
    raise TypeError(f"resume must be True or False (or 'auto' / 'discard'), got {type(value).__name__} {value!r}")


def _refuse_unused(offload: str, given: dict) -> None:
    unused = [name for name in NVME_ONLY if given[name] is not None and given[name] is not False]
    if offload != "nvme" and unused:
        raise ValueError(
            f"{', '.join(unused)} {'acts' if len(unused) == 1 else 'act'} only on swap files and "
            f"{'needs' if len(unused) == 1 else 'need'} offload='nvme'; with "
            f"offload={offload!r} {'it' if len(unused) == 1 else 'they'} would be ignored: drop "
            f"{'it' if len(unused) == 1 else 'them'} or pass offload='nvme'")


def make_config(*, offload: Any, swap_dir: Any, max_host_bytes: Any, sub_group_size: Any, verify: Any,
                resume: Any, io_engine: Any) -> OffloadConfig:
    """The ``OffloadConfig`` of the constructor's offload options, refusing any that would do nothing."""
    if not isinstance(offload, str):
        raise TypeError(f"offload must be 'none', 'cpu' or 'nvme', got {type(offload).__name__} {offload!r}")
    _check_bool("verify", verify)
    _check_resume(resume)
    if sub_group_size is not None and (isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int)):
        raise TypeError(f"sub_group_size must be an int > 0 or None, got {type(sub_group_size).__name__} "
                        f"{sub_group_size!r}")
    if offload in ("none", "cpu"):
        _refuse_unused(offload, dict(swap_dir=swap_dir, max_host_bytes=max_host_bytes, verify=verify,
                                     resume=resume, io_engine=io_engine))
    return OffloadConfig(offload=offload, swap_dir=_swap_dir(swap_dir), max_host_bytes=_bytes_option(max_host_bytes),
                         sub_group_size=sub_group_size, verify=verify, resume=resume, io=io_config(io_engine))


def check_param_dtype(index: int, p: torch.Tensor, cls_name: str = "Adam/AdamW") -> None:
    """The param dtypes some store steps: fp32, fp16, bf16; float64 and complex64 in the host
    store ([Note: float64 params], [Note: complex params]: complex64 not with Lion). Others
    (complex128, integers) raise NotImplementedError. ``cls_name``: the optimizer's."""
    if not isinstance(p, torch.Tensor) or p.dtype in PARAM_DTYPES + (torch.float64,):
        return
    if p.dtype in COMPLEX_DTYPES and cls_name in COMPLEX_RULE_CLASSES:
        return
    if p.dtype in COMPLEX_DTYPES:  # Lion: torch.sign refuses complex, and torch has no Lion
        raise NotImplementedError(
            f"offload.{cls_name}: parameter {index} has dtype {p.dtype}; {cls_name}'s update is sign(...), "
            "which has no complex form: pass real params (torch.view_as_real(p) steps each part alone)")
    theirs = "torch.optim.AdamW (or torch.optim.Adam)" if cls_name == "Adam/AdamW" else f"torch.optim.{cls_name}"
    if cls_name not in COMPLEX_RULE_CLASSES:
        theirs = f"a {cls_name} that keeps {p.dtype} states"
    raise NotImplementedError(
        f"offload.{cls_name}: parameter {index} has dtype {p.dtype}; the stores step fp32, fp16, bf16, float64 "
        f"and complex64 params: use {theirs} for {p.dtype} params")


# The optimizer's own options: one value for the whole optimizer (one store, one layout).
OPTIMIZER_OPTIONS = ("backend", "offload", "swap_dir", "max_host_bytes", "sub_group_size", "verify", "resume",
                     "io_engine", "num_threads", "max_grad_norm", "stage", "process_group", "state_dtype",
                     "master_dtype", "release_grads")


def _same_option(a: Any, b: Any) -> bool:
    """The same value: of one type, or numbers (1 and 1.0), or paths (a str and a Path)."""
    if isinstance(a, os.PathLike) or isinstance(b, os.PathLike):
        try:
            return os.fspath(a) == os.fspath(b)
        except TypeError:
            return False
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    try:
        return a is b or ((type(a) is type(b) or numbers) and bool(a == b))
    except Exception:  # (an option whose == raises or is not a truth value)
        return False


def options_now(opt: Any) -> Dict[str, Any]:
    """The constructor's options of ``opt`` (``_given_options``), with the value of those a
    user may set since (``opt.max_grad_norm = ...``) as it is now."""
    given = dict(getattr(opt, "_given_options", None) or {})
    ctx = getattr(opt, "_ctx", None)
    if "max_grad_norm" in given and ctx is not None:
        given["max_grad_norm"] = ctx.max_grad_norm
    return given


def check_group_keys(group: Any, cls_name: str, given: Optional[Dict[str, Any]] = None) -> None:
    """A param group that sets one of the optimizer's own options (``state_dtype`` per
    group, say) to another value than the constructor's would be kept and ignored, as torch
    keeps unknown keys: refused instead. ``given``: the constructor's options as passed; a
    group that repeats one of them is taken (torch's ZeroRedundancyOptimizer puts its
    keywords, ``offload=`` and the rest, into every group of the optimizer it builds)."""
    if not isinstance(group, dict):
        return  # torch's add_param_group says what a group must be
    given = given or {}
    mine = [k for k in OPTIMIZER_OPTIONS if k in group and not (k in given and _same_option(group[k], given[k]))]
    if mine:
        differs = [f"the group's {k}={group[k]!r}, the optimizer's {given[k]!r}" for k in mine if k in given]
        raise ValueError(f"offload.{cls_name}: {', '.join(repr(k) for k in mine)} "
                         f"{'is an option' if len(mine) == 1 else 'are options'} of the whole optimizer, not of a "
                         "param group (a group's value would be ignored): "
                         + (f"{'; '.join(differs)}" if differs else "pass it to the constructor"))


# Flags of a loaded torch param group that say how torch ran its step, not what it computes:
# the states they come with are the usual ones, so such a dict loads and the flags are cleared.
EXECUTION_FLAGS = ("capturable", "differentiable")


def check_group_rule(opt: Any, group: Dict[str, Any], what: str) -> None:
    """A flat or swapped store keeps one rule's states for every group: a group that needs
    a state it does not keep (SGD's momentum from 0 where no group had one, amsgrad where no
    group had it) is refused before anything changes. A rule whose fields the store holds
    steps on those (``Rule.holds``). ``what``: "a group now" (a step), "the new group"
    (add_param_group)."""
    store_rule = getattr(opt, "_store_rule", None)
    rule = store_rule and opt.rule_of(group)
    if rule and not store_rule.holds(rule):
        raise ValueError(f"{type(opt).__name__}: {what} needs rule {rule.name!r} {list(rule.names)}, but the store "
                         f"keeps the states of rule {store_rule.name!r} {list(store_rule.names)} for every group; "
                         f"build a new optimizer whose groups need them at construction (amsgrad, or SGD "
                         f"momentum, in one group at least)")


def check_group_values(opt: Any, group: Dict[str, Any], where: str) -> None:
    """``group`` passes the optimizer's constructor checks (its ``check_group``), or the
    check's own exception is raised with ``where`` (``"param group 1"``) before its message.
    torch checks only the constructor's arguments: a group added or loaded with ``lr=None``
    was taken and every later step failed."""
    check = getattr(opt, "check_group", None)
    if check is None:
        return
    try:
        check(group)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        raise type(exc)(f"{where}: {exc}") from None


def loaded_group_rule(opt: Any, theirs: Any) -> Any:
    """The rule a param group of a loaded dict will step with (None: not knowable here, e.g.
    the dict of another optimizer type). torch's load_state_dict takes every key of the
    loaded group but ``params``, then fills what it lacks from the class's defaults
    (``__setstate__``); so does this view of it."""
    rule_of = getattr(opt, "rule_of", None)
    if rule_of is None or not isinstance(theirs, dict):
        return None
    group = dict(getattr(opt, "GROUP_DEFAULTS", ()))
    group.update({k: v for k, v in theirs.items() if k != "params"})
    try:
        return rule_of(group)
    except (KeyError, TypeError, ValueError):
        return None


def check_loaded_groups(opt: Any, state_dict: Any) -> None:
    """A flat or swapped store keeps one rule's fields for every group: a dict whose groups
    need a state it does not keep (``amsgrad=True`` into an Adam store without it) is
    refused before anything is loaded, so the optimizer stays as it was (not loaded, then
    unable to step). The host store keeps each param's own states: any dict loads there."""
    store_rule = getattr(opt, "_store_rule", None)
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if store_rule is None or not isinstance(groups, list):
        return
    for i, theirs in enumerate(groups[:len(opt.param_groups)]):
        rule = loaded_group_rule(opt, theirs)
        if rule is not None and not store_rule.holds(rule):
            raise ValueError(
                f"{type(opt).__name__}.load_state_dict: the state dict's param_groups[{i}] needs rule "
                f"{rule.name!r} {list(rule.names)}, but this optimizer's {opt.config.offload!r} store keeps "
                f"the states of rule {store_rule.name!r} {list(store_rule.names)} for every group; build "
                f"the optimizer with the dict's settings (amsgrad=...) and load it there")


def clear_execution_flags(cls_name: str, param_groups: Any) -> None:
    """After a load: the step here is neither capturable nor differentiable, and the loaded
    param_groups say so rather than what the dict said (with a warning)."""
    for i, group in enumerate(param_groups):
        on = [flag for flag in EXECUTION_FLAGS if group.get(flag)]
        if on:
            warnings.warn(f"{cls_name}.load_state_dict: param_groups[{i}] had {', '.join(f + '=True' for f in on)}, "
                          "which this optimizer does not support; set to False (the loaded states are the same)",
                          UserWarning, stacklevel=3)
            group.update({flag: False for flag in on})
