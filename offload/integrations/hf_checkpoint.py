"""Trainer checkpoints that hold the optimizer as a streamed checkpoint.

The Trainer saves ``torch.save(optimizer.state_dict())``, which pulls every NVMe-resident
state into RAM at each save. With ``TrainingArguments(save_only_model=True)`` it saves only
the model and ``trainer_state.json``; ``OffloadCallback(checkpoint=True)`` then adds to each
``checkpoint-N/``, in ``on_save`` (a public callback event, on every process):

- ``offload_states/``: ``opt.save_checkpoint`` (streamed from the swap files or host buffers);
- ``offload_param_groups.json``: the groups' hyperparameters (lr, betas, ...), as torch's
  ``state_dict`` keeps them, so the first step after a resume uses the saved lr; sealed with
  its crc32 as the checkpoint manifests are (an older release's bare list still loads);
- ``offload_scheduler.pt``: the LR scheduler's ``state_dict`` (small);
- ``rng_state.pth`` / ``rng_state_<process>.pth``: the RNG states in the Trainer's own file
  format, which the Trainer restores itself at the point of the data where it saved them.

``trainer.train(resume_from_checkpoint=...)`` loads the model and the trainer state; the
callback's ``on_train_begin`` then loads the rest from the checkpoint of the resumed step.
No name here contains "optimizer": the Trainer takes any such folder for an optimizer file.

For accelerate, :func:`streamed_accelerate_checkpoints` does the same through
``register_save_state_pre_hook`` / ``register_load_state_pre_hook``.

A restart after a crash with the same ``swap_dir``: build the optimizer with
``resume="discard"``. The dead job left its swap directory at a later step than the
checkpoint (refused by the default ``resume=False``; ``resume=True`` would mix them, and
refuses fp32 params whose fingerprint is the checkpoint's); the load here replaces every
state anyway, so the left directory is removed and the optimizer starts afresh. A directory a
live process holds is never removed ([Note: restarts] in offload/swap/runs.py).
"""
from __future__ import annotations

import errno
import json
import os
import random
from typing import Any, Dict, List

import torch

from offload.swap import fsutil

__all__ = ["STATES_DIR", "save_trainer_checkpoint", "load_trainer_checkpoint", "streamed_accelerate_checkpoints"]

STATES_DIR = "offload_states"
GROUPS_FILE = "offload_param_groups.json"
GROUPS_FORMAT = "offload-param-groups"
SCHEDULER_FILE = "offload_scheduler.pt"


def _hypers(opt: Any) -> List[Dict[str, Any]]:
    out = []
    for group in opt.param_groups:
        entry = {}
        for key, value in group.items():
            if key == "params":
                entry["num_params"] = len(value)
                continue
            if isinstance(value, torch.Tensor):  # a Tensor lr: saved as its float value
                value = value.item() if value.numel() == 1 else value.tolist()
            entry[key] = list(value) if isinstance(value, tuple) else value
        out.append(entry)
    return out


def _rng_file(args: Any) -> str:
    # The Trainer's names (Trainer._load_rng_state): one file, or one per process.
    return f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"


def _rng_state(args: Any) -> Dict[str, Any]:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        distributed = args.world_size > 1
        state["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return state


def save_trainer_checkpoint(ckpt_dir: str, opt: Any, scheduler: Any, args: Any) -> None:
    """Write the optimizer (streamed), its groups, the scheduler and the RNG into ``ckpt_dir``
    (called on every process: the streamed save is collective across ranks)."""
    opt.save_checkpoint(os.path.join(ckpt_dir, STATES_DIR))
    torch.save(_rng_state(args), os.path.join(ckpt_dir, _rng_file(args)))
    if not args.should_save:  # the files below are the same on every process
        return
    _write_json(os.path.join(ckpt_dir, GROUPS_FILE), fsutil.sealed({"format": GROUPS_FORMAT, "param_groups": _hypers(opt)}))
    if scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(ckpt_dir, SCHEDULER_FILE))


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _restore_hypers(opt: Any, saved: List[Dict[str, Any]], path: str) -> None:
    if len(saved) != len(opt.param_groups):
        raise ValueError(f"{path}: {len(saved)} param groups saved, the optimizer has {len(opt.param_groups)}")
    for i, (group, entry) in enumerate(zip(opt.param_groups, saved)):
        if entry.get("num_params") != len(group["params"]):
            raise ValueError(f"{path}: group {i} held {entry.get('num_params')} params, it holds "
                             f"{len(group['params'])} now")
        for key, value in entry.items():
            if key == "num_params" or key not in group:
                continue
            if isinstance(group[key], torch.Tensor):
                group[key].fill_(value)  # keep a Tensor lr a tensor (schedulers hold it)
            else:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


def _read_groups(path: str) -> List[Dict[str, Any]]:
    """The saved groups, their seal checked ([Note: sealed manifests] in offload/swap/fsutil.py);
    a bare list is an older release's file (no seal)."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}): the file is damaged or truncated; nothing was "
                             "loaded") from None
    if isinstance(data, list):
        return data
    data = fsutil.unsealed(data, path)
    if not isinstance(data, dict) or data.get("format") != GROUPS_FORMAT or not isinstance(data.get("param_groups"), list):
        raise ValueError(f"{path}: not an offload param-groups file; nothing was loaded")
    return data["param_groups"]


def load_trainer_checkpoint(ckpt_dir: str, opt: Any, scheduler: Any) -> None:
    """Load what :func:`save_trainer_checkpoint` wrote (the RNG is the Trainer's to load).
    The groups file is read and checked first: a damaged one loads nothing."""
    states = os.path.join(ckpt_dir, STATES_DIR)
    if not os.path.isdir(states):
        raise FileNotFoundError(errno.ENOENT, "no streamed optimizer checkpoint here (saved with "
                                "OffloadCallback(checkpoint=True) or streamed_accelerate_checkpoints? with the "
                                "Trainer, pass resume_from= if the checkpoint is elsewhere)", states)
    groups = os.path.join(ckpt_dir, GROUPS_FILE)
    saved = _read_groups(groups)
    opt.load_checkpoint(states)
    _restore_hypers(opt, saved, groups)
    sched = os.path.join(ckpt_dir, SCHEDULER_FILE)
    if scheduler is not None and os.path.exists(sched):
        scheduler.load_state_dict(torch.load(sched, weights_only=True))


def streamed_accelerate_checkpoints(accelerator: Any, optimizer: Any) -> tuple:
    """Make ``accelerator.save_state(DIR)`` / ``load_state(DIR)`` save and load ``optimizer``
    (an offload optimizer) as a streamed checkpoint in ``DIR/offload_states``, through
    accelerate's public save/load state pre-hooks. Returns the two hook handles.

    The optimizer must not go through ``accelerator.prepare``: accelerate would then also
    ``torch.save(optimizer.state_dict())``, every state in RAM. Step it yourself where
    accelerate would: ``if accelerator.sync_gradients: opt.step(); opt.zero_grad()``. The
    scheduler, the RNG and the model go through ``prepare`` / ``save_state`` as usual. A job
    restarted with a crashed one's ``swap_dir`` builds the optimizer with ``resume="discard"``
    (see the module notes): ``load_state`` replaces every state."""
    from offload.integrations.unwrap import offload_optimizer

    opt = offload_optimizer(optimizer)
    if opt is None or opt is not optimizer:
        raise TypeError("streamed_accelerate_checkpoints needs the offload.Adam/AdamW itself, not "
                        f"{type(optimizer).__name__}: keep it out of accelerator.prepare")
    # A read of accelerate's list of prepared optimizers: the one place that says whether
    # save_state would torch.save this optimizer as well.
    if any(offload_optimizer(o) is opt for o in getattr(accelerator, "_optimizers", [])):
        raise ValueError("the optimizer went through accelerator.prepare, so save_state would also "
                         "torch.save its state_dict (every state in RAM): build it again and keep it out of "
                         "prepare; step it when accelerator.sync_gradients")

    def save(models: Any, weights: Any, output_dir: str) -> None:
        opt.save_checkpoint(os.path.join(output_dir, STATES_DIR))
        if accelerator.is_main_process:
            _write_json(os.path.join(output_dir, GROUPS_FILE), _hypers(opt))

    def load(models: Any, input_dir: str) -> None:
        load_trainer_checkpoint(input_dir, opt, None)

    return accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)
