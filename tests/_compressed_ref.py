"""A plain-torch reference of the host store's compressed states, per param.

Each step of each param: decode its stored states with quant.py's scheme, run torch's own
single-tensor update (torch.optim.AdamW / SGD / Adagrad with foreach=False; Lion as
lion-pytorch writes it) on them, encode them back (int8 blocks; bf16 rounded stochastically
with ``rounding_seed(step, index)``, stream 1 + the state's position, from element 0). A
param of fewer than 4096 elements keeps float32 states. Nothing here calls offload's
kernels or stores: the torch backend must give the same bits.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

from offload.kernels import quant

SMALL = 4096
SIGNED = {"exp_avg": True, "momentum_buffer": True, "exp_avg_sq": False, "sum": False}
NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "adagrad": ("sum",), "lion": ("exp_avg",)}


def compressed(state_dtype: str, numel: int) -> bool:
    return state_dtype != "float32" and numel >= SMALL


def decode(state_dtype: str, name: str, stored: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if not compressed(state_dtype, p.numel()):
        return stored.clone()
    if state_dtype == "int8":
        return quant.decode_blocks(stored, p.numel(), SIGNED[name]).view(p.shape)
    return stored.float().view(p.shape)


def encode(state_dtype: str, name: str, values: torch.Tensor, seed: int, k: int, *,
           stochastic: bool = True) -> torch.Tensor:
    if not compressed(state_dtype, values.numel()):
        return values.clone()
    if state_dtype == "int8":
        return quant.encode_blocks(values.reshape(-1), SIGNED[name])
    if not stochastic:
        return quant.round_bf16_nearest(values).view(values.shape)
    return quant.round_bf16_stochastic(values, seed, 0, 1 + k).view(values.shape)


def initial(state_dtype: str, name: str, p: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """A new state as the host store makes it (the fill encoded once, bf16 to nearest)."""
    return encode(state_dtype, name, torch.full(p.shape, fill), 0, 0, stochastic=False)


def torch_update(rule: str, hyper: Dict, p: torch.Tensor, g: torch.Tensor, vals: Dict[str, torch.Tensor],
                 step: int) -> None:
    """One torch update of ``p`` (in place) and ``vals`` (float32, replaced in place)."""
    if rule == "lion":  # lion-pytorch's update_fn
        lr, (b1, b2), wd = hyper["lr"], hyper.get("betas", (0.9, 0.99)), hyper.get("weight_decay", 0.0)
        m = vals["exp_avg"]
        p.mul_(1 - lr * wd)
        p.add_(m.clone().lerp_(g, 1 - b1).sign_(), alpha=-lr)
        m.lerp_(g, 1 - b2)
        return
    cls = {"adam": torch.optim.AdamW, "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[rule]
    opt = cls([p], foreach=False, **hyper)
    st = {"step": torch.tensor(float(step - 1))} if rule != "sgd" else {}
    if not (rule == "sgd" and step == 1):  # torch's first SGD step starts the buffer itself
        st.update(vals)
    opt.state[p] = st
    p.grad = g
    opt.step()
    p.grad = None
    for k in vals:
        vals[k].copy_(opt.state[p][k])


class Reference:
    """The reference optimizer over clones of ``params`` (indexed as the optimizer's)."""

    def __init__(self, rule: str, params: Sequence[torch.Tensor], state_dtype: str, hyper: Dict,
                 fill: float = 0.0, update: Callable = torch_update) -> None:
        """``update``: the float32 update (``torch_update``'s signature)."""
        self.rule, self.state_dtype, self.hyper, self.update = rule, state_dtype, dict(hyper), update
        self.params = [p.detach().clone() for p in params]
        self.names = NAMES[rule]
        self.states: List[Dict[str, torch.Tensor]] = [
            {n: initial(state_dtype, n, p, fill) for n in self.names} for p in self.params]
        self.steps = [0] * len(self.params)

    def step(self, grads: Sequence[torch.Tensor], multiplier: float = 1.0) -> None:
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            self.steps[i] += 1
            s = self.steps[i]
            g = g.float() * multiplier if multiplier != 1.0 else g.float()
            vals = {n: decode(self.state_dtype, n, self.states[i][n], p) for n in self.names}
            self.update(self.rule, self.hyper, p, g, vals, s)
            seed = quant.rounding_seed(s, i)
            self.states[i] = {n: encode(self.state_dtype, n, vals[n], seed, k) for k, n in enumerate(self.names)}

