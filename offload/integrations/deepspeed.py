"""``from_deepspeed_config(config, params)``: the optimizer a ZeRO-Offload JSON describes.

A user coming from DeepSpeed has a config such as::

    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
     "aio": {"block_size": 1048576, "queue_depth": 16},
     "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
     "gradient_clipping": 1.0, "bf16": {"enabled": true}}

Every key is either mapped to an option of :class:`offload.Adam` / :class:`offload.AdamW`
(or of :class:`offload.Adagrad`, :class:`offload.Lion`, :class:`offload.SGD` for those types)
(see :data:`MAPPED`, in deepspeed_keys.py), ignored because it configures something that is not the optimizer
(:data:`IGNORED`, each with the reason), or refused with a ``ValueError`` that names its key
path. DeepSpeed itself accepts combinations that fail later (deepspeedai/DeepSpeed#4998); here
they fail at once. ``"auto"`` values are the HF Trainer's to resolve: they are refused unless
the option they map to is passed as a keyword override.

The optimizer semantics follow DeepSpeed's ``_configure_basic_optimizer``: ``type: "Adam"``
is AdamW unless ``adam_w_mode`` is false (DeepSpeed's default is true); ``weight_decay``
defaults to 0 as in DeepSpeedCPUAdam and FusedAdam, and to torch's default with
``torch_adam: true``. ``Adagrad`` and ``Lion`` take the defaults of DeepSpeedCPUAdagrad
(torch's) and DeepSpeedCPULion / FusedLion (``lr=1e-3, betas=(0.9, 0.999)``, not
lion-pytorch's); ``SGD``, which DeepSpeed builds as ``torch.optim.SGD``, torch's.
"""
from __future__ import annotations

import errno
import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from offload._notes import add_note
from offload.config import IOConfig
from offload.integrations.deepspeed_keys import IGNORED, MAPPED, _REFUSED, _SECTIONS, _no_duplicate_keys
from offload.integrations.deepspeed_params import (check_dtypes, check_options, check_shard_matches, flat_params,
                                                    is_sharded)

__all__ = ["from_deepspeed_config", "deepspeed_kwargs", "deepspeed_shard_kwargs", "MAPPED", "IGNORED"]


class _Reader:
    """Reads one section of the config by key path; knows which option each key maps to so
    that an ``"auto"`` value passes only when that option is overridden."""

    def __init__(self, section: Any, path: str, overrides: Mapping[str, Any]) -> None:
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise ValueError(f"{path}: expected a JSON object, got {type(section).__name__} {section!r}")
        self.data, self.path, self.overrides = section, path, overrides

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def check_keys(self, known: Tuple[str, ...]) -> None:
        for name, value in self.data.items():
            path = self.key(name)
            if name in known or path in IGNORED:
                continue
            if path in _REFUSED and _enabled(value):
                raise ValueError(f"{path}: {_REFUSED[path]}")
            if path in _REFUSED:
                continue  # present but off ({"device": "none"}, false, 0): as if absent
            raise ValueError(f"{path}: unknown key (offload maps: {', '.join(sorted(known))}; "
                             "see offload.integrations.deepspeed.MAPPED and IGNORED)")

    def get(self, name: str, kind: str, default: Any = None, option: Optional[str] = None) -> Any:
        if name not in self.data:
            return default
        value = self.data[name]
        if value == "auto":
            if option is not None and option in self.overrides:
                return default
            hint = f"pass {option}=... to from_deepspeed_config, or " if option else ""
            raise ValueError(f"{self.key(name)}: \"auto\" is resolved by the HF Trainer's DeepSpeed "
                             f"integration, not here: {hint}write the value into the config")
        return _typed(value, kind, self.key(name))

    def resolved(self, name: str, kind: str, default: Any, option: str) -> Any:
        """As :meth:`get`, for a key whose value *is* the option's: an ``"auto"`` resolved by
        the override takes the override's value (not the default, which would contradict it)."""
        if self.data.get(name) == "auto" and option in self.overrides:
            return _typed(self.overrides[option], kind, f"{option}= (resolving {self.key(name)})")
        return self.get(name, kind, default, option)


def _enabled(value: Any) -> bool:
    if isinstance(value, Mapping):
        device = value.get("device", "none")
        return device not in (None, "none")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return bool(value)
    return value > 1  # zero_hpz_partition_size 1 and mics_shard_size -1 (DeepSpeed's defaults) are off


def _typed(value: Any, kind: str, path: str) -> Any:
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true or false, got {value!r}")
        return value
    if kind == "int":
        ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not ok:
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {value!r}")
        return value
    if kind == "pair":
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise ValueError(f"{path}: expected two numbers [beta1, beta2], got {value!r}")
        return (float(value[0]), float(value[1]))
    raise AssertionError(kind)  # a bug in this module, not in the config


def _load(config: Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, bytes, os.PathLike)):
        path = os.fsdecode(config)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f, object_pairs_hook=_no_duplicate_keys)
        except OSError as e:
            raise OSError(e.errno, f"cannot read the DeepSpeed config: {e.strerror}", path) from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from e
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a JSON object at the top, got {type(data).__name__}")
        return data
    raise TypeError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")


def _zero(cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the optimizer's kwargs, offload.shard's kwargs: empty below stage 3)."""
    z = _Reader(cfg.get("zero_optimization"), "zero_optimization", overrides)
    z.check_keys(("stage", "sub_group_size", "offload_optimizer", "offload_param", "stage3_max_live_parameters"))
    out: Dict[str, Any] = {}
    stage = z.resolved("stage", "int", 0, "stage")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got {stage}")
    out["stage"] = stage
    shard = _offload_param(z, stage)
    sub_group = z.get("sub_group_size", "int", None, "sub_group_size")
    if sub_group is not None:
        if sub_group <= 0:
            raise ValueError(f"zero_optimization.sub_group_size: must be > 0, got {sub_group}")
        out["sub_group_size"] = sub_group
    out.update(_offload_optimizer(z, stage, sub_group, overrides))
    return out, shard


def _offload_param(z: _Reader, stage: int) -> Dict[str, Any]:
    """offload.shard's kwargs of a stage-3 config (DeepSpeed's offload_param and
    stage3_max_live_parameters); {} below stage 3, where offload_param is refused."""
    o = _Reader(z.data.get("offload_param"), "zero_optimization.offload_param", {})
    o.check_keys(("device", "nvme_path"))
    device = o.get("device", "str", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"zero_optimization.offload_param.device: expected none, cpu or nvme, got {device!r}")
    if stage != 3:
        if device != "none":
            raise ValueError(f"zero_optimization.offload_param: parameter offload is ZeRO stage 3's, and the "
                             f"stage is {stage}; set zero_optimization.stage to 3 or remove offload_param")
        return {}
    out: Dict[str, Any] = {"offload_params": device}
    path = o.get("nvme_path", "str", None)
    if device == "nvme":
        if path is None:
            raise ValueError("zero_optimization.offload_param.nvme_path: required with device \"nvme\" "
                             "(a directory on a local NVMe disk for the param shards)")
        out["swap_dir"] = path
    elif path is not None:
        raise ValueError(f"zero_optimization.offload_param.nvme_path: only read with device \"nvme\", "
                         f"but device is {device!r}; remove it or set device to \"nvme\"")
    live = z.data.get("stage3_max_live_parameters")
    if live is not None and live != "auto":
        n = _typed(live, "float", "zero_optimization.stage3_max_live_parameters")
        if not n >= 1:
            raise ValueError(f"zero_optimization.stage3_max_live_parameters: must be >= 1, got {live!r}")
        out["max_live_params"] = int(min(n, 2 ** 62))
    return out


def _offload_optimizer(z: _Reader, stage: int, sub_group: Optional[int],
                       overrides: Mapping[str, Any]) -> Dict[str, Any]:
    o = _Reader(z.data.get("offload_optimizer"), "zero_optimization.offload_optimizer", overrides)
    o.check_keys(("device", "nvme_path", "buffer_count", "ratio"))
    device = o.resolved("device", "str", "none", "offload")
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"zero_optimization.offload_optimizer.device: expected none, cpu or nvme, got {device!r}")
    if device != "none" and stage == 0:
        raise ValueError("zero_optimization.offload_optimizer needs zero_optimization.stage 1, 2 or 3 "
                         "(DeepSpeed offloads only under ZeRO); set the stage")
    ratio = o.get("ratio", "float", 1.0)
    if ratio != 1.0:
        raise ValueError(f"zero_optimization.offload_optimizer.ratio: {ratio}: partial offload is not "
                         "implemented; offload keeps all the optimizer states off the device (1.0)")
    out: Dict[str, Any] = {"offload": device}
    path = o.get("nvme_path", "str", None, "swap_dir")
    if device == "nvme":
        if path is None and "swap_dir" not in overrides:
            raise ValueError("zero_optimization.offload_optimizer.nvme_path: required with device \"nvme\" "
                             "(a directory on a local NVMe disk)")
        if path is not None:
            out["swap_dir"] = path
    elif path is not None:
        raise ValueError(f"zero_optimization.offload_optimizer.nvme_path: only read with device \"nvme\", "
                         f"but device is {device!r}; remove it or set device to \"nvme\"")
    count = o.get("buffer_count", "int", None, "max_host_bytes")
    if count is not None and count < 1:
        raise ValueError(f"zero_optimization.offload_optimizer.buffer_count: must be >= 1, got {count}")
    if device == "nvme" and count is not None and sub_group is not None:
        out["max_host_bytes"] = count * sub_group * 4
    return out


def _aio(cfg: Mapping[str, Any], offload: str, overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"io_engine": IOConfig}`` of the aio section when ``offload`` is "nvme" (and the
    section differs from the defaults), else {}."""
    if "aio" not in cfg:
        return {}
    a = _Reader(cfg.get("aio"), "aio", overrides)
    a.check_keys(("block_size", "queue_depth", "use_gds"))
    if a.get("use_gds", "bool", False):
        raise ValueError("aio.use_gds: GPUDirect Storage is not implemented; the states go through host buffers")
    base = IOConfig()
    block = a.get("block_size", "int", base.block_size, "io_engine")
    depth = a.get("queue_depth", "int", base.queue_depth, "io_engine")
    if offload != "nvme":
        return {}  # as DeepSpeed: aio is read only when something is swapped to NVMe
    try:
        io = IOConfig(block_size=block, queue_depth=depth)
    except ValueError as e:
        raise ValueError(f"aio: {e}") from None
    return {} if io == base else {"io_engine": io}


def _shard_aio(cfg: Mapping[str, Any], shard: Mapping[str, Any], overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"io": IOConfig}`` for ``offload.shard`` when the param shards go to NVMe and the aio
    section differs from the defaults: their files are read and written as the states' are."""
    io = _aio(cfg, shard.get("offload_params", "none"), overrides)
    return {"io": io["io_engine"]} if io else {}


def _optimizer(cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> Tuple[type, Dict[str, Any]]:
    from offload.optim import Adam, AdamW

    if cfg.get("optimizer") is None:
        raise ValueError("optimizer: missing; from_deepspeed_config builds the optimizer from "
                         "optimizer.type (Adam, AdamW, Adagrad, Lion or SGD) and optimizer.params")
    section = _Reader(cfg["optimizer"], "optimizer", overrides)
    section.check_keys(("type", "params"))
    kind = section.get("type", "str", None)
    if kind is None or kind.lower() not in ("adam", "adamw") + tuple(_OTHERS):
        raise ValueError(f"optimizer.type: {kind!r} is not supported; offload implements Adam, AdamW, "
                         "Adagrad, Lion and SGD")
    p = _Reader(section.data.get("params"), "optimizer.params", overrides)
    if "max_grad_norm" in p.data:
        raise ValueError("optimizer.params.max_grad_norm: not an optimizer parameter in DeepSpeed; "
                         "use the top-level gradient_clipping")
    if kind.lower() in _OTHERS:
        return _other_optimizer(kind.lower(), p)
    p.check_keys(("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam",
                  "amsgrad"))
    w_mode = p.get("adam_w_mode", "bool", True)  # read (and checked) even where the type decides
    adamw = kind.lower() == "adamw" or w_mode
    torch_adam = p.get("torch_adam", "bool", False)
    out: Dict[str, Any] = {}
    for name, kind_ in (("lr", "float"), ("betas", "pair"), ("eps", "float"), ("bias_correction", "bool")):
        value = p.get(name, kind_, None, name)
        if value is not None:
            out[name] = value
    # DeepSpeedCPUAdam and FusedAdam default to no weight decay; torch's AdamW to 0.01.
    wd_default = (0.01 if adamw else 0.0) if torch_adam else 0.0
    out["weight_decay"] = p.get("weight_decay", "float", wd_default, "weight_decay")
    if p.get("amsgrad", "bool", False, "amsgrad"):  # torch's amsgrad (DeepSpeed's torch_adam path)
        out["amsgrad"] = True
    return (AdamW if adamw else Adam), out


# type -> (class name in offload, its params: name -> (kind, default or None: the class's))
_OTHERS: Dict[str, Tuple[str, Dict[str, Tuple[str, Any]]]] = {
    "adagrad": ("Adagrad", {"lr": ("float", None), "eps": ("float", None), "weight_decay": ("float", None),
                            "lr_decay": ("float", None), "initial_accumulator_value": ("float", None)}),
    "lion": ("Lion", {"lr": ("float", 1e-3), "betas": ("pair", (0.9, 0.999)), "weight_decay": ("float", None)}),
    "sgd": ("SGD", {"lr": ("float", None), "momentum": ("float", None), "dampening": ("float", None),
                    "weight_decay": ("float", None), "nesterov": ("bool", None)}),
}


def _other_optimizer(kind: str, p: "_Reader") -> Tuple[type, Dict[str, Any]]:
    import offload.optim as optim

    name, known = _OTHERS[kind]
    p.check_keys(tuple(known))
    out: Dict[str, Any] = {}
    for key, (kind_, default) in known.items():
        value = p.get(key, kind_, default, key)
        if value is not None:
            out[key] = value
    return getattr(optim, name), out


def _clipping(cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> Dict[str, Any]:
    top = _Reader(cfg, "", overrides)
    clip = top.get("gradient_clipping", "float", 0.0, "max_grad_norm")
    if clip < 0:
        raise ValueError(f"gradient_clipping: must be >= 0 (0: no clipping), got {clip}")
    return {"max_grad_norm": clip} if clip > 0 else {}


def _precision(cfg: Mapping[str, Any]) -> Optional[torch.dtype]:
    """The params' dtype the config says (float32 when neither is enabled); None when an
    ``enabled`` is ``"auto"`` (the HF template: the Trainer's bf16/fp16 flags decide; here the
    params' own dtype does) and none is true."""
    enabled, auto = {}, False
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        r = _Reader(cfg.get(name), name, {})
        r.check_keys(("enabled",))
        if r.get("auto_cast", "bool", False):
            raise ValueError("fp16.auto_cast: true is not supported; cast the model to float16 yourself")
        if r.data.get("enabled") == "auto":
            auto = True
        elif r.get("enabled", "bool", False):
            enabled[name] = dtype
    if len(enabled) > 1:
        raise ValueError("bf16.enabled and fp16.enabled: both true; enable one of them")
    return next(iter(enabled.values()), None if auto else torch.float32)


def _check_top(cfg: Mapping[str, Any]) -> None:
    for name, value in cfg.items():
        if name in _SECTIONS or name in IGNORED:
            continue
        if name in _REFUSED:
            if _enabled(value.get("enabled", False) if isinstance(value, Mapping) else value):
                raise ValueError(f"{name}: {_REFUSED[name]}")
            continue
        raise ValueError(f"{name}: unknown top-level key (see offload.integrations.deepspeed.MAPPED and IGNORED)")


def _translate(config: Any, overrides: Mapping[str, Any]) -> Tuple[type, Dict[str, Any], Optional[torch.dtype],
                                                                 Dict[str, Any]]:
    cfg = _load(config)
    _check_top(cfg)
    kwargs, shard = _zero(cfg, overrides)
    kwargs.update(_aio(cfg, kwargs["offload"], overrides))
    shard.update(_shard_aio(cfg, shard, overrides))
    cls, opt_kwargs = _optimizer(cfg, overrides)
    kwargs.update(opt_kwargs)
    kwargs.update(_clipping(cfg, overrides))
    dtype = _precision(cfg)
    kwargs.update(overrides)
    clip = overrides.get("max_grad_norm")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip == 0:
        # DeepSpeed's and the Trainer's 0 is "no clipping" (TrainingArguments(max_grad_norm=0)
        # resolving "gradient_clipping": "auto"); the optimizer's max_grad_norm takes None for it
        kwargs.pop("max_grad_norm")
    return cls, kwargs, dtype, shard


def deepspeed_kwargs(config: Any, **overrides: Any) -> Tuple[type, Dict[str, Any]]:
    """``(the offload optimizer class, kwargs)`` for a DeepSpeed config (a dict or a JSON
    path), without building anything: ``cls(params, **kwargs)`` is the optimizer (at stage 3,
    ``stage=3``, over the params of a model ``offload.shard`` changed, see
    :func:`deepspeed_shard_kwargs`; other params are refused).
    ``overrides`` are offload options that win over the config (and resolve its ``"auto"``
    values), e.g. ``lr=``, ``swap_dir=``, ``resume=True``. At stage 3 with the optimizer's
    states in RAM (``offload_optimizer`` cpu or none), the config's ``sub_group_size`` is left
    out: fp32 CPU shards step in place, each in one pass, and refuse it (DeepSpeed's default
    1e9, in most stage-3 templates, would cut nothing anyway); ``from_deepspeed_config``,
    which sees the params, drops it for those only."""
    cls, kwargs, _, _ = _translate(config, overrides)
    if kwargs.get("stage") == 3 and kwargs.get("offload") in ("none", "cpu") and "sub_group_size" not in overrides:
        kwargs.pop("sub_group_size", None)
    return cls, kwargs


def deepspeed_shard_kwargs(config: Any) -> Optional[Dict[str, Any]]:
    """The kwargs of ``offload.shard(model, **kwargs)`` for a stage-3 DeepSpeed config
    (``offload_params``, ``swap_dir`` from ``offload_param``, ``max_live_params`` from
    ``stage3_max_live_parameters``, ``io`` from ``aio`` with the params on NVMe); None below
    stage 3."""
    cfg = _load(config)
    _check_top(cfg)
    kwargs, shard = _zero(cfg, {})
    return dict(shard, **_shard_aio(cfg, shard, {})) if kwargs["stage"] == 3 else None





def from_deepspeed_config(config: Any, params: Any, **overrides: Any):
    """The :class:`offload.AdamW` (or ``Adam``) that DeepSpeed config ``config`` (a dict or
    the path of its JSON file) describes, over ``params`` (tensors or param groups, or an
    ``nn.Module``: its parameters).

    Stage 3 (``zero_optimization.stage: 3``) partitions the params themselves: given the
    model, this calls ``offload.shard(model, **deepspeed_shard_kwargs(config))`` on it first
    (in place, as ``deepspeed.initialize`` does; a collective on several ranks), then builds
    the optimizer over its shards. The optimizer's options are checked before the model is
    sharded; what depends on the shards (the swap pipeline's host budget) can fail only after,
    and then the model stays sharded (a note on the exception says so): passing it again
    takes its shards as they are, refusing a config that would have put them elsewhere.
    Given params, they must be those of a model ``offload.shard`` changed already (its
    settings then stand).

    See the module's docstring and :data:`MAPPED` / :data:`IGNORED` for what each key becomes;
    any other key, an unsupported value or an inconsistent combination is a ``ValueError``
    naming the key path. ``overrides`` are offload options that win over the config."""
    cls, kwargs, dtype, shard_kwargs = _translate(config, overrides)
    # Checked before a stage-3 model is sharded in place (the optimizer's own check of swap_dir
    # came after the shard), and named by the config's key.
    for key, where in (("offload_optimizer", kwargs), ("offload_param", shard_kwargs or {})):
        path = where.get("swap_dir")
        if path is not None and not os.path.isdir(os.path.expanduser(os.fsdecode(path))):  # "~/nvme" as the optimizer takes it
            name = (f"zero_optimization.{key}.nvme_path" if where is not kwargs or "swap_dir" not in overrides
                    else "swap_dir=")
            raise FileNotFoundError(errno.ENOENT, f"{name}: no such directory (create it on a local disk)", path)
    stage3 = kwargs.get("stage") == 3
    sharded_here = False
    if isinstance(params, torch.nn.Module):
        model = params
        if stage3 and not is_sharded(list(model.parameters())):
            from offload.shard import shard

            check_dtypes(list(model.parameters()), dtype)
            check_options(cls, kwargs)  # a shard cannot be undone: the options' errors come first
            shard(model, **shard_kwargs)
            sharded_here = True
        elif stage3:
            check_shard_matches(model, shard_kwargs)
        params = model.parameters()
    params = list(params)
    if stage3 and not is_sharded(params):
        raise ValueError("zero_optimization.stage: 3 partitions the params: pass the model "
                         "(from_deepspeed_config(config, model) calls offload.shard(model) on it), or call "
                         "offload.shard(model, ...) first and pass model.parameters()")
    check_dtypes(params, dtype)
    flat = flat_params(params)
    if (stage3 and "sub_group_size" not in overrides and kwargs.get("offload") in ("none", "cpu")
            and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in flat)):
        # fp32 CPU shards step in place, each in one pass: DeepSpeed's sub-groups (its
        # default 1e9 is in most stage-3 configs) have nothing to cut here
        kwargs.pop("sub_group_size", None)
    try:
        try:
            return cls(params, **kwargs)
        except ValueError as e:
            if "max_host_bytes" in str(e) and "max_host_bytes" not in overrides and "max_host_bytes" in kwargs:
                raise ValueError(
                    f"zero_optimization.sub_group_size x offload_optimizer.buffer_count x 4 B = "
                    f"{kwargs['max_host_bytes']} host bytes (DeepSpeed's buffer pool) is too small here: {e}; "
                    "lower sub_group_size, raise buffer_count, or pass max_host_bytes=...") from e
            raise
    except Exception as e:
        if sharded_here:
            add_note(e, "offload.shard() had sharded the model in this call before the optimizer failed, and a "
                     "shard is not undone: the model stays sharded. Fix the config and pass the same model "
                     "again (its shards are taken as they are), or build the model anew.")
        raise
