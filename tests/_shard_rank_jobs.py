"""Two-rank jobs of tests/test_shard_transformers.py on a plain torch model, so that the
ranks do not import transformers (~5 s each on CI's two cores): what they check is offload's
side of ``save_pretrained`` and ``split=``, which does not depend on the model's library."""
import os

import torch
import torch.nn as nn

import offload


class Net(nn.Module):
    """Blocks of Linear + LayerNorm (biases and norm weights: the Trainer's no-decay
    params), with a ``save_pretrained`` in transformers' convention."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x

    def save_pretrained(self, path, state_dict=None, is_main_process=True):
        if is_main_process:
            torch.save(state_dict, os.path.join(path, "weights.pt"))


def _net():
    torch.manual_seed(0)
    return Net()


def _no_decay(model):
    """The Trainer's no-decay params: biases and LayerNorm params (a sharded model's are in
    its ``bias_and_norm`` flats)."""
    return [p for _, m in model.named_modules() for n, p in m.named_parameters(recurse=False)
            if n.endswith("bias_and_norm") or n == "bias" or isinstance(m, nn.LayerNorm)]


def _steps(model):
    nd = _no_decay(model)
    decay = [p for p in model.parameters() if all(p is not q for q in nd)]
    opt = offload.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": nd, "weight_decay": 0.0}], lr=1e-2)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def split_rank(rank, world):
    """Each rank the same batch: the averaged grads equal one rank's, so the sharded model
    must end where the unsharded one does in this process (same threads, same GEMM bits)."""
    plain = _net()
    _steps(plain)
    model = offload.shard(_net(), split=offload.shard.split_no_decay)
    assert any("bias_and_norm" in n for n, _ in model.named_parameters())
    _steps(model)
    whole = offload.shard.full_state_dict(model, rank0_only=False)
    return sorted(k for k, v in plain.state_dict().items() if not torch.equal(whole[k], v))


def save_on_ranks(rank, world, path):
    """Every rank calls save_pretrained (is_main_process on rank 0): rank 0's file must hold
    the whole model, which rank 0 returns with the gathered dict."""
    model = offload.shard(_net())
    _steps(model)
    whole = offload.shard.full_state_dict(model, rank0_only=False)
    model.save_pretrained(path, is_main_process=rank == 0)
    return whole, (torch.load(os.path.join(path, "weights.pt")) if rank == 0 else None)
