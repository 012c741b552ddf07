"""A tiny GPT-style decoder: the model the demo trains.

Byte-level (vocabulary 256), learned positions, pre-LayerNorm blocks of causal self-attention
(``torch.nn.functional.scaled_dot_product_attention``) and a GELU MLP, and an output head tied
to the token embedding (as GPT-2), so every parameter is an ordinary fp32 ``nn.Parameter``
that any optimizer can own. No dropout: the demo compares our optimizer with
``torch.optim.AdamW`` loss for loss, so the forward pass must be a pure function of the
parameters and the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "TinyGPT", "config_for_params"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder."""

    vocab_size: int = 256
    """Byte-level tokens; see :mod:`offload.demo.corpus`."""
    block_size: int = 128
    """Longest context (learned position embeddings)."""
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")

    @property
    def num_params(self) -> int:
        """Exact parameter count of :class:`TinyGPT` with this config (tied head counted once)."""
        d, L = self.d_model, self.n_layer
        per_block = (
            2 * 2 * d               # two LayerNorms
            + 3 * d * d             # qkv (no bias)
            + d * d + d             # attention output
            + 4 * d * d + 4 * d     # MLP in
            + 4 * d * d + d         # MLP out
        )
        return self.vocab_size * d + self.block_size * d + L * per_block + 2 * d


def config_for_params(num_params: int, *, block_size: int = 128, vocab_size: int = 256) -> GPTConfig:
    """The decoder shape whose size is closest to ``num_params``.

    Depth grows with the cube root of the size and the width is a multiple of 32 with heads of
    32 or 64 channels, roughly GPT-2's aspect ratio (width ~ 64 x depth), so ``--params 5M``
    and ``--params 1B`` both give sensible models.
    """
    if num_params < 10_000:
        raise ValueError(f"num_params must be >= 10000 for a meaningful decoder, got {num_params}")
    best = None
    base_layers = max(1, round((num_params / 49152) ** (1 / 3)))
    for n_layer in range(max(1, base_layers - 1), base_layers + 2):
        width = math.sqrt(max(num_params - vocab_size * 64, 1) / (12 * n_layer))
        for d_model in {max(32, 32 * math.floor(width / 32)), max(32, 32 * math.ceil(width / 32))}:
            head = 64 if d_model % 64 == 0 and d_model >= 512 else 32
            cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                            n_head=d_model // head, d_model=d_model)
            key = (abs(cfg.num_params - num_params), n_layer != base_layers)
            if best is None or key < best[0]:
                best = (key, cfg)
    return best[1]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        # No bias on q, k, v: a key bias gets a zero gradient in exact arithmetic (softmax
        # ignores a shift shared by all scores), i.e. only rounding noise, which Adam turns
        # into lr-sized random steps. Dropping it keeps two runs comparable weight for weight.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim) as scaled_dot_product_attention wants.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2's init: weights N(0, 0.02), biases 0, LayerNorms 1/0, and the projections that
        # write into the residual stream scaled by 1/sqrt(2 * n_layer) so its variance does not
        # grow with depth. Deterministic under torch.manual_seed.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        for block in self.blocks:
            for residual_out in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(residual_out.weight, 0.0, 0.02 / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: "torch.Tensor | None" = None):
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        # Tied head: the output projection is the token embedding matrix itself.
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss
