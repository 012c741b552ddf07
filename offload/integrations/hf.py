"""Hugging Face ``Trainer`` and ``accelerate`` glue for :class:`offload.AdamW` / ``Adam``.

Neither tool calls ``opt.no_sync()``: with CUDA params the grad hook then copies every grad
to the host once per micro-batch (4x the device-to-host traffic with accumulation 4). Both say
where a micro-batch stands in one public place, accelerate's ``GradientState.sync_gradients``
(``Accelerator.accumulate`` sets it, and the Trainer sets it before each micro-batch's
forward). :func:`follow_accumulation` reads it in a forward pre-hook on the model and keeps
the optimizer inside ``no_sync()`` for the micro-batches that do not sync, so the last
backward of each accumulation window copies the accumulated grads once.

``OffloadCallback`` does that for the Trainer and also:

- sets ``opt.grads_already_averaged = True`` when the Trainer wraps the model in DDP (several
  processes, no DeepSpeed, no FSDP): DDP has averaged the grads, so the optimizer only slices
  them instead of reducing them a second time;
- puts ``opt.last_grad_norm`` (the norm ``max_grad_norm=`` clipped with) into the training
  logs as ``grad_norm`` where the Trainer logged none (it computes its own only when
  ``TrainingArguments.max_grad_norm > 0`` or, from transformers 5, always);
- with ``checkpoint=True`` and ``TrainingArguments(save_only_model=True)``, saves the
  optimizer into each ``checkpoint-N/`` as a streamed checkpoint and loads it on resume
  (:mod:`offload.integrations.hf_checkpoint`; a restart with the crashed job's ``swap_dir``
  builds the optimizer with ``resume="discard"``, since that load replaces every state). The
  resume checks that the weights the Trainer loaded are those the states were saved with
  (``verify_weights=False`` skips it), and ``save_total_limit`` is applied by the callback
  after the optimizer is saved, so a job killed while saving it keeps the previous whole
  checkpoint (the Trainer would have deleted it first).

transformers and accelerate are imported only when used: this module imports without them.
"""
from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from typing import Any, Optional

import torch

from offload.integrations.unwrap import offload_optimizer

__all__ = ["OffloadCallback", "follow_accumulation", "AccumulationSync", "offload_optimizer",
           "streamed_accelerate_checkpoints"]


def _sync_gradients() -> bool:
    from accelerate.state import GradientState

    return bool(GradientState().sync_gradients)


_FOLLOWER: "weakref.WeakKeyDictionary[Any, AccumulationSync]" = weakref.WeakKeyDictionary()


class AccumulationSync:
    """A forward pre-hook that keeps ``opt`` inside ``opt.no_sync()`` while accelerate's
    ``sync_gradients`` is false. Made by :func:`follow_accumulation`; ``remove()`` ends it."""

    def __init__(self, opt: Any, model: torch.nn.Module) -> None:
        self._opt = weakref.ref(opt)
        self._inside: Optional[contextlib.ExitStack] = None
        self._handle = model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation: no backward follows, nothing to decide
        opt = self._opt()
        if opt is None:
            return
        # One follower per optimizer (the callback attached twice, follow_accumulation called
        # again): each no_sync() restores the flag it found on leaving, so two followers left
        # in the order they entered put it back to True, and the optimizer stayed in no_sync()
        # for good. The first one to run drives it; the others do nothing.
        if _FOLLOWER.setdefault(opt, self) is not self:
            return
        accumulate = not _sync_gradients()
        if accumulate and self._inside is None:
            self._inside = contextlib.ExitStack()
            self._inside.enter_context(opt.no_sync())
        elif not accumulate and self._inside is not None:
            self._leave()

    def _leave(self) -> None:
        inside, self._inside = self._inside, None
        if inside is not None:
            inside.close()

    @property
    def accumulating(self) -> bool:
        """True between a non-syncing micro-batch's forward and the next syncing one's."""
        return self._inside is not None

    def remove(self) -> None:
        """Remove the hook and leave ``no_sync()`` if inside it (a later step then sends the
        grads still on the device itself)."""
        self._handle.remove()
        self._leave()
        opt = self._opt()
        if opt is not None and _FOLLOWER.get(opt) is self:
            del _FOLLOWER[opt]  # another follower of it may take over


def _ddp_world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def follow_accumulation(optimizer: Any, model: torch.nn.Module) -> AccumulationSync:
    """Let accelerate's gradient accumulation skip the per-micro-batch grad copies of
    ``optimizer`` (an offload optimizer, or accelerate's wrapper of one): call it after
    ``accelerator.prepare`` and train with ``with accelerator.accumulate(model):`` as usual.

    A DDP-wrapped ``model`` with several ranks also sets ``opt.grads_already_averaged``; with
    several ranks and an unwrapped model it warns, since it cannot tell whether DDP will wrap
    it later."""
    try:
        import accelerate.state  # noqa: F401  (the signal this follows lives there)
    except ImportError as e:
        raise ImportError("follow_accumulation reads accelerate's GradientState: pip install accelerate") from e
    opt = offload_optimizer(optimizer)
    if opt is None:
        raise TypeError("follow_accumulation needs an offload optimizer (offload.Adam, AdamW, SGD, Adagrad or "
                        f"Lion) or accelerate's wrapper of one, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _ddp_world() > 1:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            opt.grads_already_averaged = True
        elif not getattr(opt, "grads_already_averaged", False):
            warnings.warn("follow_accumulation: several ranks and a model that is not DDP-wrapped here: if DDP "
                          "wraps it later (accelerator.prepare), set opt.grads_already_averaged = True, or call "
                          "this after prepare; otherwise the optimizer reduces the grads itself (right, and what "
                          "it should do without DDP)", stacklevel=2)
    return AccumulationSync(opt, model)


def _trainer_wraps_in_ddp(args: Any) -> bool:
    """Whether the Trainer will wrap the model in DDP: several processes, and neither
    DeepSpeed nor FSDP (accelerate's prepare wraps a model with trainable params then)."""
    from transformers.training_args import ParallelMode

    return (getattr(args, "world_size", 1) > 1 and args.parallel_mode == ParallelMode.DISTRIBUTED
            and not getattr(args, "deepspeed", None) and not getattr(args, "fsdp", None))


def _make_callback_class() -> type:
    from transformers import TrainerCallback

    class OffloadCallback(TrainerCallback):
        """Trainer callback for an offload optimizer: gradient accumulation without a grad
        copy per micro-batch, ``grads_already_averaged`` under DDP, ``grad_norm`` in the logs.

        ``Trainer(..., optimizers=(opt, sched), callbacks=[OffloadCallback()])``; the
        optimizer is the Trainer's (or pass ``optimizer=``)."""

        def __init__(self, optimizer: Any = None, *, accumulation: bool = True, log_grad_norm: bool = True,
                     checkpoint: bool = False, resume_from: Optional[str] = None, verify_weights: bool = True):
            self.optimizer, self.accumulation, self.log_grad_norm = optimizer, accumulation, log_grad_norm
            self.checkpoint, self.resume_from, self.verify_weights = checkpoint, resume_from, verify_weights
            self._opt: Any = None
            self._sync: Optional[AccumulationSync] = None
            self._limit: Optional[int] = None  # save_total_limit, applied here (see on_save)

        @classmethod
        def attach(cls, trainer: Any, **kwargs: Any) -> "OffloadCallback":
            """Add a new callback *first* among the trainer's: ``callbacks=[...]`` puts it after
            the default ones, and the printers and ``report_to`` loggers read a log before a
            later ``on_log`` adds ``grad_norm`` to it (``trainer.state.log_history`` gets it
            either way)."""
            callback = cls(**kwargs)
            trainer.callback_handler.callbacks.insert(0, callback)
            return callback

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self._limit, self._sync = _end_interrupted_run(args, self._limit, self._sync)
            self._opt = offload_optimizer(self.optimizer if self.optimizer is not None else optimizer)
            if self._opt is None:
                warnings.warn("OffloadCallback: the Trainer's optimizer is not an offload optimizer (offload.Adam, "
                              "AdamW, SGD, Adagrad or Lion); the callback does nothing", stacklevel=2)
                return
            if _trainer_wraps_in_ddp(args):
                self._opt.grads_already_averaged = True
            if self.accumulation and args.gradient_accumulation_steps > 1 and model is not None:
                self._sync = AccumulationSync(self._opt, model)
            if self.checkpoint:
                self._resume(args, state, kwargs.get("lr_scheduler"))
                self._limit = _hold_save_limit(args)

        def _resume(self, args, state, scheduler) -> None:
            _resume_trainer(self._opt, args, state, scheduler, self.resume_from, self.verify_weights)

        def on_save(self, args, state, control, lr_scheduler=None, **kwargs):
            if self.checkpoint and self._opt is not None:
                from offload.integrations.hf_checkpoint import save_trainer_checkpoint

                ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
                save_trainer_checkpoint(ckpt, self._opt, lr_scheduler, args)
                if self._limit is not None and args.should_save:  # now the older ones may go
                    _rotate_checkpoints()(output_dir=args.output_dir, save_total_limit=self._limit,
                                          best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)

        def on_train_end(self, args, state, control, **kwargs):
            if self._sync is not None:
                self._sync.remove()
                self._sync = None
            if self._limit is not None:
                args.save_total_limit, self._limit = self._limit, None
                _keep_only_best(args, state)

        def on_log(self, args, state, control, logs=None, **kwargs):
            norm = None if self._opt is None else self._opt.last_grad_norm
            if not self.log_grad_norm or norm is None or logs is None or "loss" not in logs:
                return
            if "grad_norm" not in logs:
                logs["grad_norm"] = norm
                last = state.log_history[-1] if state.log_history else None
                if last is not None and last.get("step") == state.global_step and "loss" in last:
                    last.setdefault("grad_norm", norm)

    return OffloadCallback


def _end_interrupted_run(args: Any, limit: Optional[int], sync: Optional[AccumulationSync]) -> tuple:
    """What a train() that raised (a KeyboardInterrupt in a notebook) left, its on_train_end
    never run: give back the save_total_limit it held (or this and every later train() of the
    process would keep every checkpoint), and end its accumulation hook. Returns (None, None)."""
    if limit is not None:
        args.save_total_limit = limit
    if sync is not None:
        sync.remove()
    return None, None


def _resume_trainer(opt: Any, args: Any, state: Any, scheduler: Any, resume_from: Optional[str],
                    verify_weights: bool) -> None:
    """OffloadCallback(checkpoint=True)'s load at train begin (see the module notes)."""
    from offload.integrations.hf_checkpoint import load_trainer_checkpoint

    if not args.save_only_model:
        raise ValueError("OffloadCallback(checkpoint=True) needs TrainingArguments(save_only_model=True): "
                         "without it the Trainer also saves torch.save(optimizer.state_dict()), which "
                         "pulls every optimizer state into RAM at each save")
    if state.global_step > 0:  # resumed: the Trainer loaded the model and its state
        # The callback is not told which directory the Trainer resumed from; a checkpoint of
        # the same step in output_dir from another run is caught by the params' fingerprint
        # (load_trainer_checkpoint's check_params).
        where = resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        load_trainer_checkpoint(where, opt, scheduler, check_params=verify_weights)


def _hold_save_limit(args: Any) -> Optional[int]:
    """The Trainer deletes old checkpoints (save_total_limit) before on_save: a job that died
    while the optimizer was being saved there kept only a checkpoint without it. The callback
    holds the limit (args.save_total_limit None meanwhile) and applies it once the optimizer
    is saved; returns it, or None where it leaves it to the Trainer."""
    if args.save_total_limit and args.save_total_limit > 0 and _rotate_checkpoints() is not None:
        limit, args.save_total_limit = args.save_total_limit, None
        return limit
    return None


def _rotate_checkpoints() -> Any:
    """transformers' ``rotate_checkpoints`` (a function since transformers 5), or None."""
    try:
        from transformers.trainer_utils import rotate_checkpoints
    except ImportError:
        return None
    return rotate_checkpoints


def _keep_only_best(args: Any, state: Any) -> None:
    """What the Trainer does at the end of training with ``save_total_limit=1`` and a best
    checkpoint (it read the limit while the callback held it): delete the others."""
    import shutil

    from transformers.trainer_utils import sort_checkpoints

    best = state.best_model_checkpoint
    if not (args.should_save and best is not None and args.save_total_limit == 1):
        return
    for ckpt in sort_checkpoints(output_dir=args.output_dir, best_model_checkpoint=best):
        if not os.path.samefile(ckpt, best):
            shutil.rmtree(ckpt, ignore_errors=True)


_CLASSES: dict = {}


def streamed_accelerate_checkpoints(accelerator: Any, optimizer: Any) -> tuple:
    """See :func:`offload.integrations.hf_checkpoint.streamed_accelerate_checkpoints`."""
    from offload.integrations.hf_checkpoint import streamed_accelerate_checkpoints as hooks

    return hooks(accelerator, optimizer)


def __getattr__(name: str) -> Any:
    # PEP 562: the callback subclasses transformers.TrainerCallback, so it is made on first
    # use; importing this module needs no transformers.
    if name == "OffloadCallback":
        if name not in _CLASSES:
            _CLASSES[name] = _make_callback_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
