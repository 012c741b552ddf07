"""The optimizer frame every offload optimizer shares: an optimizer is its rule.

``RuleOptimizer`` owns what does not depend on the update: the store selection (``HostState``,
``SwappedState``, ``FlatState``), the step (guards, context, clipping, GradScaler,
``no_sync``, the failed state), ``state_dict`` / ``load_state_dict``, checkpoints and
reports. A subclass (``Adam``, ``AdamW``, ``SGD``, ``Adagrad``, ``Lion``) gives torch's
``__init__`` (signature, defaults, validation messages), the kernel rule of a param group
(``rule_of``: ``offload.kernels.fields``) and the group's hyperparameters as that rule's
kernel takes them (``group_hyper``). The stores take the rule from each step's work (a
``RuleHyper``) and their buffers, swap files and checkpoint files from its fields.

They subclass ``torch.optim.Optimizer`` so that LR schedulers, ``GradScaler`` and
checkpoint code that expect a torch optimizer accept them (torchao's CPUOffloadOptimizer
does the same for the same reason).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _get_scalar_dtype

from offload.kernels import get_backend
from offload.kernels.fields import Rule, StateField, field_names, union_rule
from offload.optim.cleared import close_optimizer
from offload.optim.clip import grad_multiplier
from offload.optim.context import StepContext
from offload.optim.context_attrs import ContextAttributes
from offload.optim.functional import RuleHyper
from offload.optim.guards import eager, one_at_a_time, register_guards, register_store_hooks, step_sigs
from offload.optim.held_loads import held_load, load_checkpoint_into
from offload.optim.host_dtypes import host_params
from offload.optim.host_state import HostState, nothing_to_swap
from offload.optim.options import (OPTIMIZER_OPTIONS, check_compression, check_extras, check_group_keys, check_group_rule,
                                   check_group_values, check_master_dtype, check_param_dtype, check_release_grads,
                                   clear_execution_flags, make_config, options_now, refuse_release_grads, unexpected_keyword)
from offload.optim.protocol import optional
from offload.optim.state_codec import STOCHASTIC_BF16_STATES
from offload.optim.state_io import load_state_dict_into, state_dict_of
from offload.optim.sparse_grads import dense_grad
from offload.optim.state_view import attach as attach_state_views
from offload.optim.step_agreement import ranks_begin_together
from offload.optim.step_guard import canonical_sig, check_work, clear_failure, defer_sigint, gc_paused, snapshot, store_step
from offload.optim.stats import StepStats, process_rss_bytes
from offload.zero.wrapped import default_stage

__all__ = ["RuleOptimizer"]

log = logging.getLogger("offload.optim")


class RuleOptimizer(ContextAttributes, Optimizer):
    """A torch optimizer whose update is a kernel rule, over any store (see the module doc)."""

    # What a subclass gives: its rule for a group (``rule_of``), the kernel's hyperparameters for a group
    # (``group_hyper``), the param_group keys older state dicts may lack (``GROUP_DEFAULTS``), whether it
    # steps sparse grads ([Note: sparse grads] in sparse_grads.py) or refuses them (``SPARSE_MESSAGE``).
    GROUP_DEFAULTS: Tuple[Tuple[str, Any], ...] = (("maximize", False), ("foreach", None), ("differentiable", False))
    SPARSE_GRADS, SPARSE_MESSAGE = False, "this optimizer does not support sparse gradients"
    TORCH_NAME = "Adam/AdamW"
    """How messages name the class (``offload.{TORCH_NAME}``) and torch's counterpart."""

    def __init__(self, params, defaults: Dict[str, Any], *, backend: Optional[str] = None,
                 offload: str = "none", swap_dir: Optional[str] = None,
                 max_host_bytes: "Optional[int | str]" = None, sub_group_size: Optional[int] = None,
                 verify: bool = False, resume: bool = False, io_engine: Optional[str] = None,
                 num_threads: Optional[int] = None, max_grad_norm: Optional[float] = None,
                 stage: Optional[int] = None, process_group: Any = None,
                 state_dtype: str = "float32", master_dtype: Optional[str] = None,
                 release_grads: bool = False, **unknown: Any) -> None:
        """``defaults``: the subclass's checked hyperparameters (torch's ``defaults``); the
        rest are the offload options, checked here before ``params`` is touched, as torch does
        (an unknown one is the TypeError Python gives, naming the class the user called).
        ``state_dtype`` / ``master_dtype``: how the states and the master are stored
        (offload/kernels/quant.py; the stores keep the rule's fields as ``rules()`` gives them;
        ``master_dtype="bfloat16"`` needs bfloat16 params: options.check_master_dtype)."""
        if unknown:
            raise unexpected_keyword(type(self).__name__, next(iter(unknown)), type(self).__init__, RuleOptimizer.__init__)
        self._given_options = {k: v for k, v in locals().items() if k in OPTIMIZER_OPTIONS}  # (check_group_keys)
        check_extras(max_grad_norm=max_grad_norm, num_threads=num_threads, stage=stage,
                     bias_correction=getattr(self, "bias_correction", True))
        check_compression(state_dtype, master_dtype)
        self.state_dtype = state_dtype
        self.master_dtype = master_dtype
        self.release_grads = check_release_grads(release_grads, offload)  # [Note: releasing grads] in flat/grads.py
        config = make_config(offload=offload, swap_dir=swap_dir, max_host_bytes=max_host_bytes,
                             sub_group_size=sub_group_size, verify=verify, resume=resume, io_engine=io_engine)
        get_backend(backend)  # a forced backend that cannot load fails here, with its reason
        if params is None:
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            "but got None")
        self._store = None
        self._closed = False
        # What the store may know of this optimizer (offload/optim/context.py): built before
        # torch's __init__ sets `state` and `param_groups`, which __setattr__ hands to it.
        self._ctx = StepContext.fresh(max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        # (add_param_group checks the groups torch's __init__ adds before master_dtype is set)
        check_master_dtype(master_dtype, self._all_params(), self.TORCH_NAME)
        self.config = config
        self.backend = backend
        self.num_threads = num_threads
        # GradScaler hands us the scale and found_inf instead of unscaling the grads itself,
        # so the unscale happens inside the kernel pass (torch/amp/grad_scaler.py).
        self._step_supports_amp_scaling = True
        self.last_step_skipped = False
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None
        self._stats = StepStats()
        self._init_states()
        self._store_rule: Optional[Rule] = None  # set for a flat or swapped store
        self._store = self._make_store(stage, process_group)
        self._seed_store()
        self._registered = self._all_params()
        register_guards(self)
        register_store_hooks(self)

    # ---------------------------------------------------------------- what a subclass gives
    def rule_of(self, group: Dict[str, Any]) -> Rule:
        """The kernel rule that steps ``group`` (``offload.kernels.fields``)."""
        raise NotImplementedError

    def group_hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """``group``'s hyperparameters as the rule's kernel takes them (without step and grad_scale)."""
        raise NotImplementedError

    def rules(self) -> Tuple[Rule, ...]:
        """Every rule this optimizer's groups use (one, unless groups differ in kind), with
        its states stored as ``state_dtype`` says (``Rule.with_state_dtype``)."""
        out: List[Rule] = []
        for group in self.param_groups:
            rule = self.rule_of(group).with_state_dtype(getattr(self, "state_dtype", "float32"))
            if rule not in out:
                out.append(rule)
        return tuple(out)

    def state_fields(self) -> Tuple[StateField, ...]:
        """The per-element state fields of every rule here, and of a flat or swapped store's
        rule (which holds them for every group, also after a group's rule changed since):
        what state_dict entries and checkpoints hold."""
        store_rule = getattr(self, "_store_rule", None)
        fields: List[StateField] = list(store_rule.fields) if store_rule is not None else []
        for rule in self.rules():
            fields += [f for f in rule.fields if f not in fields]
        return tuple(fields)

    def state_names(self) -> Tuple[str, ...]:
        return field_names(self.state_fields())

    def store_rule(self) -> Rule:
        """The one rule of a flat or swapped store (its buffers and files have one set of
        fields): with groups of different rules, the one whose fields hold the others'
        (``fields.union_rule``: adam within adam_amsgrad). Every param then holds the union's
        fields, also where its group's rule leaves one unused (a plain Adam group's
        max_exp_avg_sq: 4 bytes per element more, counted by memory_report and the planner),
        and each group steps with its own rule on its own fields. Rules of unrelated fields
        are refused."""
        rules = self.rules()
        union = union_rule(rules)
        if union is None:
            raise ValueError(f"{type(self).__name__}: param groups of different rules "
                             f"({[r.name for r in rules]}) need the host store: fp32 CPU params at stage 0 "
                             f"with offload='none' or 'cpu' (the flat and swapped stores keep one set of "
                             f"state fields for every group: a rule whose fields hold every other's)")
        return union

    def state_fill(self, name: str) -> float:
        """The value a new state ``name`` starts at (Adagrad's ``initial_accumulator_value``)."""
        return 0.0

    def _init_states(self) -> None:
        """States torch creates at construction (Adagrad's); none by default."""

    def _seed_store(self) -> None:
        """States ``_init_states`` put into ``opt.state`` go to a flat or swapped store
        (Adagrad's filled ``sum``); the host store keeps them where they are."""
        if getattr(self._store, "kind", None) == "host":
            self._store.settle()  # encoded as the states are stored (state_dtype)
            return
        names, resumed = self.state_names(), bool(optional(self._store, "resumed"))
        for p in self._all_params():
            st = self.state.get(p)
            seed = {k: st.pop(k) for k in names if st and dict.__contains__(st, k)}  # (held, not read on access)
            if seed and not resumed:  # resumed: the swap files hold the states (a sum that grew)
                self._store.import_state(p, seed)

    # ---------------------------------------------------------------- store selection
    def _all_params(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _make_store(self, stage: Optional[int], process_group: Any):
        from offload.optim.shard_store import stage3_store

        store = stage3_store(self, stage, process_group)  # params of offload.shard: [Note: stage 3 store]
        if store is not None:
            return store
        params = self._all_params()
        world = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size(process_group)
        # A stage chosen for one process may be wrong later: the step pre-hook of
        # offload.optim.guards checks that the job did not gain ranks since.
        self._stage_auto_single = stage is None and world == 1
        self._process_group = process_group
        stage = default_stage(stage, world, self._ctx.max_grad_norm, self.TORCH_NAME)  # zero/wrapped.py
        self.stage = stage
        host_ok = host_params(params, stage=stage, offload=self.config.offload, cls_name=self.TORCH_NAME)
        refuse_release_grads(self.release_grads, stage == 0 and host_ok, getattr(self, "_in_stage3", False))
        if stage == 0 and host_ok and (self.config.offload in ("none", "cpu") or nothing_to_swap(self)):
            if self.config.sub_group_size is not None:
                raise ValueError(f"sub_group_size={self.config.sub_group_size} would be ignored: fp32 CPU params "
                                 f"with offload={self.config.offload!r} are updated in place, each in one pass "
                                 "(sub-groups cut the flat master of device or fp16/bf16 params, and the swap "
                                 "files of offload='nvme'); drop it")
            return HostState(ctx=self._ctx, backend=self.backend, num_threads=self.num_threads,
                             fields=self.state_fields(), fill={k: self.state_fill(k) for k in self.state_names()},
                             state_dtype=self.state_dtype, stochastic_states=STOCHASTIC_BF16_STATES)
        # a flat or swapped store keeps one rule's fields for every group
        self._set_store_rule()
        if stage == 0 and host_ok and self.config.offload == "nvme":
            from offload.optim.swapped_state import SwappedState

            cfg = self.config
            return SwappedState(params, swap_dir=cfg.swap_dir, max_host_bytes=cfg.max_host_bytes,
                                sub_group_size=cfg.sub_group_size, verify=cfg.verify, resume=cfg.resume,
                                io_engine=cfg.io, backend=self.backend, num_threads=self.num_threads, ctx=self._ctx,
                                rule=self._store_rule, stochastic_states=STOCHASTIC_BF16_STATES)
        return self._flat_store(stage, process_group)

    def _set_store_rule(self) -> Rule:
        self._store_rule = self.store_rule()
        return self._store_rule

    def _flat_store(self, stage: int, process_group: Any):
        from offload.optim.flat.store import FlatState

        return FlatState(self.param_groups, config=self.config, ctx=self._ctx, backend=self.backend,
                         num_threads=self.num_threads, stage=stage, process_group=process_group,
                         rule=self._store_rule or self._set_store_rule(),
                         master_dtype=getattr(self, "master_dtype", None), release_grads=self.release_grads)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        check_group_keys(param_group, self.TORCH_NAME, options_now(self))
        super().add_param_group(param_group)
        try:
            base = len(self._all_params()) - len(self.param_groups[-1]["params"])
            for i, p in enumerate(self.param_groups[-1]["params"]):
                check_param_dtype(base + i, p, self.TORCH_NAME)
            if self._store is not None:
                check_master_dtype(self.master_dtype, self.param_groups[-1]["params"], self.TORCH_NAME, base)
            # What the states are laid out for (step_guard.check_work), also in torch's __init__.
            self._param_sigs = snapshot(self._all_params())
            check_group_values(self, self.param_groups[-1], f"param group {len(self.param_groups) - 1}")
            if self._store is None:
                return
            self._check_open()
            check_group_rule(self, self.param_groups[-1], "the new group")
            self._store_add_group(self.param_groups[-1])
            self._registered = self._all_params()
        except BaseException:
            self.param_groups.pop()  # refused: the optimizer stays as it was
            self._param_sigs = snapshot(self._all_params())
            raise

    def _store_add_group(self, group: Dict[str, Any]) -> None:
        add = optional(self._store, "add_param_group")
        if add is not None:
            add(group)
            return
        check = optional(self._store, "check_param")
        if check is None:
            raise NotImplementedError(f"add_param_group after construction is not supported with "
                                      f"offload={self.config.offload!r}")
        base = len(self._all_params()) - len(group["params"])
        for i, p in enumerate(group["params"]):
            check(base + i, p)

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError(f"{type(self).__name__} is closed: close() released its states and swap files; "
                               "build a new optimizer (and load_checkpoint() to continue)")

    # ---------------------------------------------------------------- pickling, old formats
    def __getstate__(self) -> Dict[str, Any]:
        """Pickle, deepcopy and ``torch.save(opt)`` take the host store's optimizer (fp32 CPU params, moments
        in ``self.state``) without, as torch's, its hooks and an LR scheduler's ``step`` wrapper (a copy
        stepped the original). The other stores' flat buffers, swap files and locks refuse a copy."""
        if not isinstance(self._store, HostState):
            kind = getattr(self._store, "kind", type(self._store).__name__)
            raise TypeError(f"cannot pickle or copy {type(self).__name__} with offload={self.config.offload!r} "
                            f"({kind} store: its states live in flat host buffers or swap files, not in the object): "
                            "save opt.state_dict() or opt.save_checkpoint(DIR) instead, and load it into a new optimizer")
        return {k: v for k, v in self.__dict__.items() if k != "step" and not k.startswith("_optimizer_")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # Also called by torch's load_state_dict with {"state", "param_groups"}: as torch's Adam.__setstate__,
        # fill the flags older checkpoints lack and turn a float step (torch < 1.12) into a tensor of torch's dtype.
        sigs = state.get("_param_sigs")  # present only in a pickle's full __dict__
        super().__setstate__(state)  # a __dict__.update: __setattr__ does not see it
        self._ctx.rebind(state=self.state, param_groups=self.param_groups)
        if sigs is not None:
            # A copy holds new param objects: the registered signatures are keyed by id(p),
            # so re-key them by position (keeping what was registered, not what is now).
            by_index = {i: canonical_sig(sig) for i, sig in sigs.values()}
            self._param_sigs = {id(p): (i, by_index[i]) for i, p in enumerate(self._all_params())}
        for group in self.param_groups:
            for key, default in self.GROUP_DEFAULTS:
                group.setdefault(key, default)
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=_get_scalar_dtype())

    # ---------------------------------------------------------------- the step
    def _hyper(self, group: Dict[str, Any], grad_scale: float) -> RuleHyper:
        return RuleHyper(self.rule_of(group), tuple(self.group_hyper(group).items()), grad_scale)

    def _grads_with_params(self) -> List[Tuple[Dict[str, Any], List[Tuple[torch.Tensor, torch.Tensor]]]]:
        agree = optional(self._store, "agree_on_grads")
        if agree is not None:
            agree()  # several ranks: a collective, before any grads() (never one inside it)
        grads_fn = optional(self._store, "grads")
        out = []
        for group in self.param_groups:
            self._check_group(group)
            check_group_rule(self, group, "a group now")  # before anything changes: not a failed step
            items = []
            for p in group["params"]:
                g = grads_fn(p) if grads_fn is not None else p.grad
                if g is None:
                    continue
                if g.is_sparse:  # SGD, Adagrad: its dense equivalent; others refuse ([Note: sparse grads])
                    g = dense_grad(self, group, p, g)
                items.append((p, g.resolve_neg() if g.is_neg() else g))  # a lazy negation: memory holds -g
            out.append((group, items))
        return out

    def _check_group(self, group: Dict[str, Any]) -> None:
        """Refuse, before the step changes anything, a group the kernels cannot step."""

    def _grad_multiplier(self, work) -> Optional[float]:
        """1/loss-scale times the clip coefficient, or None when the step must be skipped."""
        multiplier, self._t_prepare, norm = grad_multiplier(self._ctx, self._store, work, backend=self.backend,
                                                            num_threads=self.num_threads)
        if norm is not None:
            self.last_grad_norm = norm
        return multiplier

    # Eager under torch.compile: a step of swap I/O, locks and timers gains nothing from tracing (graph
    # breaks at each) and the store's attributes set inside it are invisible to the traced frame.
    @eager
    @torch.no_grad()
    @one_at_a_time
    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        with ranks_begin_together(self):  # several ranks: [Note: a step the ranks agree to begin]
            self._check_open()
            self._check_not_failed()
            self._begin_step()
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
        t0 = time.perf_counter()
        work = self._grads_with_params()
        # Everything is checked before anything changes ([Note: failed steps] in step_guard.py), the environment too
        check_work(work, step_sigs(self), self.SPARSE_MESSAGE)
        get_backend(self.backend).preflight(self.num_threads)
        self._t_prepare = 0.0
        t_clip = time.perf_counter()
        multiplier = self._grad_multiplier(work)
        t_clip = time.perf_counter() - t_clip - self._t_prepare
        self.last_step_skipped = multiplier is None
        if multiplier is None:
            self.skipped_steps += 1
            self._stats.record({"unscale_clip": t_clip, "grad_transfer": self._t_prepare},
                               time.perf_counter() - t0, skipped=True)
            return loss
        with defer_sigint(), gc_paused():  # a Ctrl-C lands after the step, never in the middle of it
            phases = self._store_step(work, multiplier)
            attach_state_views(self)  # opt.state[p]["exp_avg"] of params that stepped first now
            phases["unscale_clip"] = phases.get("unscale_clip", 0.0) + t_clip
            phases["grad_transfer"] = phases.get("grad_transfer", 0.0) + self._t_prepare
            empty = self.stage == 0 and not any(items for _, items in work)  # (stages 1-2: a shard steps anyway)
            self._stats.record(phases, time.perf_counter() - t0, empty=empty)
        return loss

    def _store_step(self, work, multiplier: float) -> Dict[str, float]:
        return store_step(self, [(self._hyper(group, multiplier), items) for group, items in work])

    def _check_not_failed(self) -> None:
        failure = getattr(self, "_failure", None)
        if failure:
            raise RuntimeError(f"the previous step failed and left the optimizer in the failed state: {failure}")

    def clear_failure(self, accept_params: bool = False) -> None:
        """Leave the failed state a failed step put the optimizer in (see the README, "When a step fails").
        With ``offload="nvme"`` and fp32 CPU params, first restore the params of the step the swap files
        hold: they are checked against the manifest's fingerprint (ValueError when they differ).
        ``accept_params=True`` goes on from the params and states as they are instead (the elements already
        updated by the failed step then get that step's update once more when it is retried). No-op if none failed."""
        self._check_open()
        clear_failure(self, accept_params)

    # ---------------------------------------------------------------- state_dict
    def state_dict(self) -> Dict[str, Any]:
        """torch's layout, the moments (and bf16/fp16 params' fp32 masters) included, read
        from wherever the store keeps them, compressed states decoded to float32. It changes nothing in the optimizer: the entries
        are new dicts (torch's own are the very dicts of ``opt.state``), and the post hooks
        run on the full dict, after the merge."""
        self._check_open()
        return state_dict_of(self, super().state_dict)

    def loadable_form(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """``state_dict`` in the form this optimizer's load checks and takes (SGD's, Lion's: their own layouts)."""
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As torch's, all or nothing: the whole dict is checked first (a bad entry changes
        nothing), and with ``offload="nvme"`` the loaded states go to the free swap slots and
        are committed once. Ends a failed state (see ``clear_failure``)."""
        self._check_open()

        def whole() -> None:
            load_state_dict_into(self, state_dict, super(RuleOptimizer, self).load_state_dict)
            self._failure = None
        held_load(self, "load_state_dict()", whole)
        clear_execution_flags(type(self).__name__, self.param_groups)

    @contextlib.contextmanager
    def no_sync(self):
        """For gradient accumulation, as DDP's and FSDP's ``no_sync()``: the backward passes
        inside leave their grads where autograd accumulates them. The grad hooks then copy
        nothing to the host (CUDA params) and start no reduction (several ranks with
        ``reduce_in_backward``); the first backward after the block sends the accumulated
        grads once, instead of once per micro-batch. Several ranks must use it alike (the
        same backward passes inside and outside on every rank), as with DDP. A ``step()``
        whose grads were never sent still works: it sends them then, synchronously.
        Nothing changes for fp32 CPU params at stage 0, whose grads are used in place."""
        before = self._ctx.no_sync
        self._ctx.no_sync = True
        try:
            yield self
        finally:
            self._ctx.no_sync = before

    # ---------------------------------------------------------------- reports
    def memory_report(self) -> Dict[str, Any]:
        """Bytes this optimizer holds per tier (its own accounting) and the process RSS; a flat or swapped
        store counts all its fields for every param ([Note: groups of different rules] in kernels/fields.py); 0 once closed."""
        tiers = {} if self._closed else dict(self._store.memory_report())
        return {
            "offload": self.config.offload,
            "store": getattr(self._store, "kind", type(self._store).__name__),
            "tiers": {k: int(tiers.get(k, 0)) for k in ("device", "pinned", "pageable", "nvme")},
            "detail": {k: v for k, v in tiers.items() if k not in ("device", "pinned", "pageable", "nvme")},
            "rss": process_rss_bytes(),
        }

    def step_stats(self) -> Dict[str, Any]:
        """The last step's time per phase, the running mean, overlap efficiency (stats.StepStats)."""
        return self._stats.summary()

    def save_checkpoint(self, directory: str) -> None:
        """Stream the states to ``directory`` (only files named ``offload-ckpt*`` and, for the
        flat store, ``rank<r>/`` are ours there) with the param_groups' hyperparameters."""
        from offload.optim.state_io import restart_all_cleared
        from offload.swap.ckpt_groups import encode_groups
        self._check_open()
        save = optional(self._store, "save_checkpoint")
        if save is None:
            raise NotImplementedError(f"save_checkpoint is not available for this store ({type(self._store).__name__}); "
                                      "use torch.save(opt.state_dict())")
        restart_all_cleared(self, commit=True)  # [Note: cleared before a save] in state_io.py
        save(directory, {"param_groups": encode_groups(self.param_groups), **self.checkpoint_meta()})

    def checkpoint_meta(self) -> Dict[str, Any]:
        """What a subclass adds to its checkpoints' meta (Adam: ckpt_holding.py)."""
        return {}

    def load_checkpoint(self, directory: str) -> None:
        """States, steps and (as load_state_dict) the param_groups' hyperparameters; a
        checkpoint of other groups is refused before anything is loaded. A Ctrl-C waits
        until the load is whole ([Note: loads hold Ctrl-C] in held_loads.py)."""
        load_checkpoint_into(self, directory)

    def close(self, keep_swap: bool = False) -> None:
        """Release host buffers and remove swap files (also done at interpreter exit); idempotent, no step
        after. ``keep_swap=True`` (``offload="nvme"``) keeps the swap directory, unlocked and at its last
        committed step, for a new optimizer with ``resume=True`` (here or in another process)."""
        close_optimizer(self, keep_swap)  # [Note: cleared before a kept close] in cleared.py

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
