"""Parameter counts from a Hugging Face style ``config.json``, read locally, nothing downloaded.

Why by hand: the planner must answer "does a 70B model fit?" before anyone has the weights
or even ``transformers`` installed, so the count is computed from the shapes the config
describes. Families covered (by ``model_type``):

- decoder-only with gated MLP and RMSNorm: ``llama``, ``mistral``, ``mixtral`` (experts),
  ``qwen2`` (q/k/v biases), ``qwen3`` (q/k norms), ``gemma``/``gemma2`` (head_dim given),
  ``phi3`` (fused qkv, same count);
- ``gpt2`` (learned positions, LayerNorm with bias, Conv1D with bias, tied LM head).

Other types are a ``ValueError`` naming the type and the supported ones, never a guess.
The formulas are checked in tests against models built with ``transformers`` from the same
config, and against published totals (Llama-2-7B: 6,738,415,616; GPT-2: 124,439,808).
"""
from __future__ import annotations

import errno
import json
import os
from typing import Any, List, Mapping, Tuple, Union

__all__ = ["params_from_hf_config", "unit_sizes_from_hf_config", "load_hf_config", "SUPPORTED_MODEL_TYPES"]

_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
SUPPORTED_MODEL_TYPES = _LLAMA_LIKE + ("gpt2",)


def load_hf_config(path: Union[str, "os.PathLike[str]"]) -> dict:
    """Read ``config.json`` (or ``DIR/config.json``); a missing file names the path."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "model config not found (expected a Hugging Face config.json)", path)
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except UnicodeDecodeError as exc:  # alone it named neither the file nor what it should be
        raise ValueError(f"{path}: not a JSON text file ({exc.reason} at byte {exc.start}); expected a "
                         "Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None, required: bool = True) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if required and default is None:
        raise ValueError(f"config has none of the keys {', '.join(names)} (model_type {cfg.get('model_type')!r})")
    return default


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config key {name} must be a positive integer, got {value!r}")
    return value


def _llama_like(cfg: Mapping[str, Any]) -> Tuple[int, int, int]:
    """(params outside the layers, params per layer, layers)."""
    mt = cfg.get("model_type")
    h = _positive_int("hidden_size", _get(cfg, "hidden_size"))
    layers = _positive_int("num_hidden_layers", _get(cfg, "num_hidden_layers"))
    inter = _positive_int("intermediate_size", _get(cfg, "intermediate_size"))
    vocab = _positive_int("vocab_size", _get(cfg, "vocab_size"))
    heads = _positive_int("num_attention_heads", _get(cfg, "num_attention_heads"))
    kv_heads = _positive_int("num_key_value_heads", _get(cfg, "num_key_value_heads", default=heads))
    head_dim = _positive_int("head_dim", _get(cfg, "head_dim", default=h // heads))
    # transformers' defaults differ per family; a config written by save_pretrained has the key.
    tie_default = mt in ("gemma", "gemma2", "qwen3")
    tie = bool(cfg.get("tie_word_embeddings", tie_default))
    q_out, kv_out = heads * head_dim, kv_heads * head_dim

    attn = h * q_out + 2 * h * kv_out + q_out * h            # q, k, v, o projections
    if mt == "qwen2":                                        # q/k/v carry biases in Qwen2
        attn += q_out + 2 * kv_out
    elif cfg.get("attention_bias"):                          # llama's option: bias on q,k,v,o
        attn += q_out + 2 * kv_out + h
    if mt == "qwen3":                                        # RMSNorm on q and k per head
        attn += 2 * head_dim
    mlp = 3 * h * inter                                      # gate, up, down (gated MLP)
    if cfg.get("mlp_bias"):
        mlp += 2 * inter + h
    if mt == "mixtral":
        experts = _positive_int("num_local_experts", _get(cfg, "num_local_experts"))
        mlp = experts * mlp + h * experts                    # experts + router
    norms = 2 * h                                            # input + post-attention RMSNorm
    if mt == "gemma2":
        norms = 4 * h                                        # also pre/post feed-forward norms
    per_layer = attn + mlp + norms
    embed = vocab * h
    lm_head = 0 if tie else vocab * h
    return embed + h + lm_head, per_layer, layers            # + final norm


def _gpt2(cfg: Mapping[str, Any]) -> Tuple[int, int, int]:
    h = _positive_int("n_embd", _get(cfg, "n_embd", "hidden_size"))
    layers = _positive_int("n_layer", _get(cfg, "n_layer", "num_hidden_layers"))
    vocab = _positive_int("vocab_size", _get(cfg, "vocab_size"))
    pos = _positive_int("n_positions", _get(cfg, "n_positions", "max_position_embeddings"))
    inner = _get(cfg, "n_inner", default=4 * h)
    inner = _positive_int("n_inner", inner)
    per_layer = (
        2 * h                          # ln_1
        + h * 3 * h + 3 * h            # c_attn (Conv1D with bias)
        + h * h + h                    # attn c_proj
        + 2 * h                        # ln_2
        + h * inner + inner            # mlp c_fc
        + inner * h + h                # mlp c_proj
    )
    tie = bool(cfg.get("tie_word_embeddings", True))
    return vocab * h + pos * h + 2 * h + (0 if tie else vocab * h), per_layer, layers


def _parts(config: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> Tuple[int, int, int]:
    cfg = config if isinstance(config, Mapping) else load_hf_config(config)
    mt = cfg.get("model_type")
    if mt in _LLAMA_LIKE:
        return _llama_like(cfg)
    if mt == "gpt2":
        return _gpt2(cfg)
    raise ValueError(
        f"model_type {mt!r} is not supported by the planner's config reader; "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (or pass --params N)"
    )


def params_from_hf_config(config: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> int:
    """Trainable parameter count of the model a Hugging Face ``config.json`` describes.

    ``config`` is a path to the file, a directory holding it, or the parsed mapping.
    """
    rest, per_layer, layers = _parts(config)
    return rest + layers * per_layer


def unit_sizes_from_hf_config(config: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> List[int]:
    """The fetch units stage 3 would gather for this model, in params: the root unit (the
    embeddings, the final norm and an untied LM head: the params outside the decoder layers,
    gathered for the whole forward and backward) first, then one unit per decoder layer (the
    policy ``unit={DecoderLayer}``, or offload.shard's default: the elements of a ModuleList)."""
    rest, per_layer, layers = _parts(config)
    return [rest] + [per_layer] * layers
