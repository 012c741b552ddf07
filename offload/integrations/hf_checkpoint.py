"""Trainer checkpoints that hold the optimizer as a streamed checkpoint.

The Trainer saves ``torch.save(optimizer.state_dict())``, which pulls every NVMe-resident
state into RAM at each save. With ``TrainingArguments(save_only_model=True)`` it saves only
the model and ``trainer_state.json``; ``OffloadCallback(checkpoint=True)`` then adds to each
``checkpoint-N/``, in ``on_save`` (a public callback event, on every process):

- ``offload_states/``: ``opt.save_checkpoint`` (streamed from the swap files or host buffers);
- ``offload_scheduler.pt``: the LR scheduler's ``state_dict`` (small);
- ``offload_param_groups.json``, written last (a checkpoint without it is not whole: the job
  died while saving it): the groups' hyperparameters (lr, betas, ...), as torch's
  ``state_dict`` keeps them, so the first step after a resume uses the saved lr, and a
  fingerprint of the params (a sample of their values) that the resume compares with the
  weights the Trainer loaded; sealed with its crc32 as the checkpoint manifests are (an
  older release's bare list still loads);
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
import re
import struct
import zlib
from typing import Any, Dict, List, Optional

import torch

from offload.io.files import open_regular
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


def params_fingerprint(opt: Any) -> str:
    """A digest of the optimizer's params: each one's size and 16 of its values, evenly
    spaced (one small copy per param, whatever its device). Saved with a Trainer checkpoint
    and compared on resume: the weights the Trainer loaded must be those the optimizer's
    states were saved with."""
    crc = 0
    for group in opt.param_groups:
        for p in group["params"]:
            flat = p.detach().reshape(-1)
            n = flat.numel() if flat.device.type != "meta" else 0  # a placeholder has no values
            flat = flat if n else flat.new_empty(0, device="cpu")
            idx = torch.linspace(0, max(n - 1, 0), steps=min(n, 16)).round().long().to(flat.device)
            sample = flat[idx].to(device="cpu", dtype=torch.float32).numpy().tobytes()
            crc = zlib.crc32(struct.pack("<q", n) + sample, crc)
    return f"{crc:08x}"


def save_trainer_checkpoint(ckpt_dir: str, opt: Any, scheduler: Any, args: Any) -> None:
    """Write the optimizer (streamed), the scheduler, the RNG and, last, the groups file
    (the checkpoint is whole once it is there) into ``ckpt_dir`` (called on every process:
    the streamed save is collective across ranks)."""
    opt.save_checkpoint(os.path.join(ckpt_dir, STATES_DIR))
    torch.save(_rng_state(args), os.path.join(ckpt_dir, _rng_file(args)))
    if not args.should_save:  # the files below are the same on every process
        return
    if scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(ckpt_dir, SCHEDULER_FILE))
    _write_groups(ckpt_dir, opt, fingerprint=params_fingerprint(opt))


def _write_groups(ckpt_dir: str, opt: Any, fingerprint: Optional[str] = None) -> None:
    data: Dict[str, Any] = {"format": GROUPS_FORMAT, "param_groups": _hypers(opt)}
    if fingerprint is not None:
        data["params_fingerprint"] = fingerprint
    _write_json(os.path.join(ckpt_dir, GROUPS_FILE), fsutil.sealed(data))


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


def _read_groups(path: str) -> Dict[str, Any]:
    """The saved groups file (``param_groups``, ``params_fingerprint`` where saved), its seal
    checked ([Note: sealed manifests] in offload/swap/fsutil.py); a bare list is an older
    release's file (no seal)."""
    # a FIFO there blocked the open forever ([Note: a FIFO where a file was] in offload/io/files.py)
    fd = open_regular(path, os.O_RDONLY | os.O_CLOEXEC, 0o600, "cannot read the optimizer's param groups")
    with os.fdopen(fd, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as exc:  # (a UnicodeDecodeError too: bytes that are not text)
            raise ValueError(f"{path}: not valid JSON ({exc}): the file is damaged or truncated; nothing was "
                             "loaded") from None
    if isinstance(data, list):
        return {"param_groups": data}
    data = fsutil.unsealed(data, path)
    if not isinstance(data, dict) or data.get("format") != GROUPS_FORMAT or not isinstance(data.get("param_groups"), list):
        raise ValueError(f"{path}: not an offload param-groups file; nothing was loaded")
    return data


def complete(ckpt_dir: str) -> bool:
    """Whether ``ckpt_dir`` holds a whole optimizer checkpoint (its groups file, written last).
    Whatever is there in the groups file's place counts: the load's read of it says what is
    wrong with it (a FIFO, a directory), where "the job died while saving" would mislead."""
    return os.path.isdir(os.path.join(ckpt_dir, STATES_DIR)) and os.path.lexists(os.path.join(ckpt_dir, GROUPS_FILE))


def _newest_complete(ckpt_dir: str) -> Optional[str]:
    """The newest ``checkpoint-N`` beside ``ckpt_dir`` that holds a whole optimizer checkpoint."""
    parent = os.path.dirname(os.path.abspath(ckpt_dir))
    found = []
    for name in os.listdir(parent) if os.path.isdir(parent) else ():
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        path = os.path.join(parent, name)
        if m and os.path.abspath(path) != os.path.abspath(ckpt_dir) and complete(path):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def load_trainer_checkpoint(ckpt_dir: str, opt: Any, scheduler: Any, check_params: bool = False) -> None:
    """Load what :func:`save_trainer_checkpoint` wrote (the RNG is the Trainer's to load).
    The groups file is read and checked first: a damaged one loads nothing. With
    ``check_params``, the optimizer's params (the weights the Trainer resumed) must be those
    the checkpoint was saved with (where it recorded them)."""
    states = os.path.join(ckpt_dir, STATES_DIR)
    groups = os.path.join(ckpt_dir, GROUPS_FILE)
    if not complete(ckpt_dir):
        if os.path.isdir(states) or os.path.isfile(os.path.join(ckpt_dir, "trainer_state.json")):
            newest = _newest_complete(ckpt_dir)
            hint = (f"resume from {newest} (trainer.train(resume_from_checkpoint=...)), the newest whole one, "
                    f"or remove {ckpt_dir}" if newest else f"no checkpoint beside it holds a whole one")
            raise FileNotFoundError(errno.ENOENT, f"this checkpoint holds no whole optimizer checkpoint (the job "
                                    "died while saving it, after the model was saved, or it was saved without "
                                    f"OffloadCallback(checkpoint=True)): {hint}; nothing was loaded", groups if os.path.isdir(states) else states)
        raise FileNotFoundError(errno.ENOENT, "no streamed optimizer checkpoint here (saved with "
                                "OffloadCallback(checkpoint=True) or streamed_accelerate_checkpoints? with the "
                                "Trainer, pass resume_from= if the checkpoint is elsewhere)", states)
    saved = _read_groups(groups)
    recorded = saved.get("params_fingerprint")
    if check_params and recorded is not None and recorded != params_fingerprint(opt):
        raise ValueError(f"{ckpt_dir}: its optimizer states were saved with other weights than the model the "
                         "Trainer resumed (a checkpoint of another run, or of another step?): pass the directory "
                         "given to trainer.train(resume_from_checkpoint=...) as OffloadCallback(resume_from=...); "
                         "nothing was loaded")
    sched = os.path.join(ckpt_dir, SCHEDULER_FILE)
    sched_state = None
    if scheduler is not None and os.path.exists(sched):
        try:  # read before anything loads: a damaged file loads nothing
            sched_state = torch.load(sched, weights_only=True)
        except Exception as exc:
            raise ValueError(f"{sched}: the scheduler's state cannot be read ({exc}): the file is damaged or "
                             "truncated; nothing was loaded") from None
    opt.load_checkpoint(states)
    _restore_hypers(opt, saved["param_groups"], groups)
    if sched_state is not None:
        scheduler.load_state_dict(sched_state)


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
        raise TypeError("streamed_accelerate_checkpoints needs the offload optimizer itself (offload.Adam, AdamW, "
                        f"SGD, Adagrad or Lion), not {type(optimizer).__name__}: keep it out of accelerator.prepare")
    # A read of accelerate's list of prepared optimizers: the one place that says whether
    # save_state would torch.save this optimizer as well.
    if any(offload_optimizer(o) is opt for o in getattr(accelerator, "_optimizers", [])):
        raise ValueError("the optimizer went through accelerator.prepare, so save_state would also "
                         "torch.save its state_dict (every state in RAM): build it again and keep it out of "
                         "prepare; step it when accelerator.sync_gradients")

    def save(models: Any, weights: Any, output_dir: str) -> None:
        opt.save_checkpoint(os.path.join(output_dir, STATES_DIR))
        if accelerator.is_main_process:
            _write_groups(output_dir, opt)  # sealed, as the Trainer's (no fingerprint: accelerate
            # loads the model after this hook's load, so there is nothing to compare it with)

    def load(models: Any, input_dir: str) -> None:
        load_trainer_checkpoint(input_dir, opt, None)

    return accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)
