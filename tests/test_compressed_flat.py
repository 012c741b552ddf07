"""Compressed states (bf16, int8 blocks) and the bf16 master in the flat store (host memory).

Reference: a plain-torch loop that applies quant.py's scheme around torch's own update
(torch.optim.AdamW / SGD / Adagrad with foreach=False, lion-pytorch's Lion): per param and
step, decode the stored states, run torch's single-tensor step on an fp32 copy, encode the
states again (bf16 round to nearest, int8 blocks from the param's first element), and round
the param (nearest from the fp32 master, or stochastically with the store's seed and the
param's flat offset when it is its own master). With the torch backend the store must give
the same bits: params, masters and the stored bytes of every state. The layout the reference
assumes is written out here (params at multiples of 256 with int8 states), not taken from
the store. Two gloo ranks (stage 1 and 2, every rank with the same grads, so that their average
is the one rank's grad) give the same bits as one rank: each rank checks its shard against
the same reference.
"""
from __future__ import annotations

import math
from typing import List, Optional

import pytest
import torch

import offload
from offload.kernels import quant
from offload.kernels.fields import NONNEGATIVE_STATES
from offload.optim.flat_state import FlatState
from test_rules_optim import CASES as RULE_CASES, RefLion, _groups

import _internals as internals
from _ranks import group

CASES = dict(RULE_CASES)
CASES["adamw"] = (offload.AdamW, torch.optim.AdamW, None,
                  [dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1),
                   dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0)])
SIZES = (1, 7, 15, 16, 17, 300, 4097)
FROZEN, SIDE = 2, 4  # no grad ever; a grad on even steps only (its step count lags)
STEPS = 6


BACKEND = "torch"
"""The store is held to the scheme around torch's own update, which the torch reference
backend runs bit for bit whatever OFFLOAD_BACKEND says (the native and numba kernels are held
to the torch reference's compressed step in their own tests)."""


def flat_offsets(sizes, align: int) -> List[int]:
    """Where each param starts in its flat group: end to end, each on a multiple of ``align``."""
    out, acc = [], 0
    for n in sizes:
        acc = -(-acc // align) * align
        out.append(acc)
        acc += n
    return out


class RefCompressed:
    """quant.py's scheme around torch's update, one param at a time (see the module doc)."""

    def __init__(self, params, groups: List[int], hypers, ref_cls, names, state_dtype: str,
                 master_bf16: bool, fill: float = 0.0) -> None:
        """``groups``: each param's flat group (one per torch param group here: the store
        makes a flat group per (group added, device, dtype))."""
        self.params = [p.detach().clone() for p in params]
        self.hypers, self.ref_cls, self.names = hypers, ref_cls, names
        self.state_dtype, self.master_bf16, self.groups = state_dtype, master_bf16, groups
        self.offsets = [0] * len(params)
        for k in set(groups):
            mine = [i for i, g in enumerate(groups) if g == k]
            for i, off in zip(mine, flat_offsets([params[i].numel() for i in mine],
                                                 256 if state_dtype == "int8" else 1)):
                self.offsets[i] = off
        self.masters = [None if master_bf16 else p.detach().float().clone() for p in params]
        self.stored = [{k: self.encode(k, torch.full((p.numel(),), float(fill))) for k in names}
                       for p in params]
        self.steps = [0] * len(params)

    def encode(self, name: str, v: torch.Tensor, rounding=None) -> torch.Tensor:
        """``rounding``: (seed, offset) of a step (bf16 states round stochastically, on the
        stream of the state's position); None: a load or the initial fill (nearest)."""
        if self.state_dtype == "int8":  # a load: [Note: exact re-encoding] (quant.py)
            encode = quant.encode_blocks_exact if rounding is None else quant.encode_blocks
            return encode(v, signed=name not in NONNEGATIVE_STATES)
        if self.state_dtype == "bfloat16":
            if rounding is None:
                return quant.round_bf16_nearest(v)
            seed, offset = rounding
            return quant.round_bf16_stochastic(v, seed, offset, 1 + self.names.index(name))
        return v.clone()

    def decode(self, name: str, t: torch.Tensor, n: int) -> torch.Tensor:
        if self.state_dtype == "int8":
            return quant.decode_blocks(t, n, signed=name not in NONNEGATIVE_STATES)
        return t.float().clone()

    def step(self, grads: List[Optional[torch.Tensor]], multiplier: float) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self._step_one(i, g, multiplier)

    def _step_one(self, i: int, g: torch.Tensor, multiplier: float) -> None:
        n = self.params[i].numel()
        t = self.steps[i] = self.steps[i] + 1
        p32 = (self.params[i].float() if self.master_bf16 else self.masters[i]).reshape(-1).clone()
        ref = self.ref_cls([p32], **self.hypers[i], **({} if self.ref_cls is RefLion else {"foreach": False}))
        decoded = {k: self.decode(k, self.stored[i][k], n) for k in self.names}
        state = dict(decoded)
        if self.ref_cls is torch.optim.SGD and t == 1:
            state = {}  # torch's first SGD step copies d_p into a new buffer
        if self.ref_cls is not RefLion and self.ref_cls is not torch.optim.SGD:
            state["step"] = torch.tensor(float(t - 1))
        ref.state[p32] = state
        gg = g.reshape(-1).float()
        p32.grad = gg * multiplier if multiplier != 1.0 else gg
        ref.step()
        seed = quant.rounding_seed(t, self.groups[i])
        for k in self.names:  # (SGD without momentum leaves its buffer as decoded: encoded again)
            self.stored[i][k] = self.encode(k, ref.state[p32].get(k, decoded[k]), (seed, self.offsets[i]))
        if self.master_bf16:
            new = quant.round_bf16_stochastic(p32, seed, self.offsets[i], 0)
        else:
            self.masters[i] = p32.detach().view_as(self.params[i]).clone()
            new = p32.to(self.params[i].dtype)  # fp32 params: the master itself
        self.params[i] = new.view_as(self.params[i])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN-safe, dtype-blind equality)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def check_against(opt, params, ref: RefCompressed, where: str) -> None:
    """Params, masters and the stored bytes of every state equal the reference's, bit for bit."""
    groups = internals.flat_groups(opt)
    for i, p in enumerate(params):
        assert torch.equal(_bits(p), _bits(ref.params[i])), f"{where}: param {i} differs"
        fg = groups[ref.groups[i]]
        mine = [j for j, q in enumerate(fg.params) if q is p]
        assert mine, f"{where}: param {i} is not in flat group {ref.groups[i]}"
        off, n = fg.layout.offsets[mine[0]], p.numel()
        assert off == ref.offsets[i], f"{where}: param {i} at flat {off}, expected {ref.offsets[i]}"
        start, end = fg.layout.shard_range()
        a, b = max(off, start), min(off + n, end)  # this rank's piece of the param
        if a >= b:
            continue
        for k in ref.names:
            f = fg.field(k)
            lo = f.storage_offset(a - off)  # a block boundary: the layout is block-aligned
            want = ref.stored[i][k].view(-1)[lo:lo + f.storage_numel(b - a)]
            got = fg.state_range(k, a - start, b - start)
            assert torch.equal(_bits(got), _bits(want)), f"{where}: {k} of param {i} [{a}, {b}) differs"
        if not ref.master_bf16:
            assert torch.equal(_bits(fg.master[a - start:b - start]),
                               _bits(ref.masters[i].view(-1)[a - off:b - off])), \
                f"{where}: master of param {i} differs"


def _make(case, state_dtype, master_bf16, sizes=SIZES, dtype=torch.bfloat16, **opt_kw):
    cls, ref_cls, _, hypers = CASES[case]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(dtype).requires_grad_(j != FROZEN)
              for j, n in enumerate(sizes)]
    opt = cls(_groups(params, hypers), backend=BACKEND, state_dtype=state_dtype,
              master_dtype="bfloat16" if master_bf16 else None, **opt_kw)
    half = len(params) // 2
    per_param = [hypers[0]] * half + [hypers[1]] * (len(params) - half)
    groups = [0] * half + [1] * (len(params) - half)
    names = opt.state_names()
    # (Adagrad: torch fills every sum with the constructor's initial_accumulator_value, 0 here,
    # whatever a group says)
    ref = RefCompressed(params, groups, per_param, ref_cls, names, state_dtype, master_bf16)
    return opt, params, ref


def train(monkeypatch, case="adamw", state_dtype="int8", master_bf16=False, *, sizes=SIZES, steps=STEPS,
          accumulate=1, hook=False, device_path=False, scaler=False, overflow_at=None,
          max_grad_norm=None, sub_group_size=None, **opt_kw):
    if monkeypatch is not None:  # (None: a spawned rank, which patches nothing)
        monkeypatch.setattr(FlatState, "copy_cpu_grads", hook or device_path)
        monkeypatch.setattr(FlatState, "stage_cpu_params", device_path)
    opt, params, ref = _make(case, state_dtype, master_bf16, sizes, max_grad_norm=max_grad_norm,
                             sub_group_size=sub_group_size, **opt_kw)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaler else None
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(accumulate):
            live = [p for j, p in enumerate(params) if p.requires_grad and not (j == SIDE and step % 2)]
            loss = sum((p.float() * torch.randn(p.shape, generator=gen)).sum() for p in live)
            if overflow_at == step and micro == 0:
                loss = loss * float("inf")
            (gs.scale(loss) if gs else loss).backward()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        skip = any(g is not None and not torch.isfinite(g.float()).all() for g in grads)
        if not skip:
            inv = 1.0 / gs.get_scale() if gs else 1.0
            mult = inv
            if max_grad_norm is not None:  # the store's clip coefficient (offload/optim/clip.py)
                sumsq = sum(float(torch.dot(g.double().view(-1), g.double().view(-1))) for g in grads
                            if g is not None)
                norm = math.sqrt(sumsq) * inv
                mult = inv * min(1.0, max_grad_norm / (norm + 1e-6))
            ref.step(grads, mult)
        if gs:
            gs.step(opt)
            gs.update()
        else:
            opt.step()
        assert opt.last_step_skipped == skip
        opt.zero_grad()
        check_against(opt, params, ref, f"step {step}")
    return opt, params, ref


@pytest.mark.parametrize("master_bf16", [False, True], ids=["master-fp32", "master-bf16"])
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rule_matches_the_scheme_around_torch(monkeypatch, case, state_dtype, master_bf16):
    opt, params, ref = train(monkeypatch, case, state_dtype, master_bf16)
    # the frozen param never stepped; the side one stepped half as often
    assert ref.steps[FROZEN] == 0 and ref.steps[SIDE] == STEPS // 2
    sd = opt.state_dict()["state"]  # torch's layout: the decoded fp32 states
    for i, p in enumerate(params):
        if ref.steps[i] == 0:
            assert case == "adagrad" or i not in sd or set(sd[i]) <= {"step"}  # (torch's Adagrad has them)
            continue
        if opt.param_groups[ref.groups[i]].get("momentum", 1) == 0:  # torch's SGD keeps no buffer without momentum
            assert "momentum_buffer" not in sd.get(i, {})
            continue
        for k in ref.names:
            want = ref.decode(k, ref.stored[i][k], p.numel()).view_as(p)
            assert sd[i][k].dtype == torch.float32 and torch.equal(sd[i][k], want)
        assert ("master" in sd[i]) == (not master_bf16)  # a bf16 master: the params are it
    opt.close()


def test_the_fp32_master_path_still_writes_the_nearest_bf16(monkeypatch):
    # int8 states with an fp32 master: the param is the RNE copy of the master, every step
    opt, params, ref = train(monkeypatch, "adamw", "int8", False, steps=3)
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), internals.master(opt, p).to(torch.bfloat16))


@pytest.mark.parametrize("master_bf16", [False, True], ids=["master-fp32", "master-bf16"])
def test_hook_copies_sub_groups_and_device_staging(monkeypatch, master_bf16):
    # The CUDA path on the CPU (hook copies into the padded host grad buffer, staging that
    # holds the bf16 master and goes to the params sub-group by sub-group); sub-groups of
    # 300 elements are cut at 512 (whole blocks), inside the 4097-element param.
    opt, _, _ = train(monkeypatch, "adamw", "int8", master_bf16, device_path=True, sub_group_size=300,
                      accumulate=2)
    assert opt._store._sub == 512


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_gradient_accumulation_with_hook_copies(monkeypatch, state_dtype):
    train(monkeypatch, "lion", state_dtype, True, accumulate=3, hook=True)


def test_grad_scaler_overflow_skips_and_unscales(monkeypatch):
    opt, _, _ = train(monkeypatch, "adamw", "int8", True, scaler=True, overflow_at=2)
    assert opt.skipped_steps == 1


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_clip_by_global_norm(monkeypatch, state_dtype):
    opt, _, _ = train(monkeypatch, "sgd-momentum", state_dtype, True, max_grad_norm=0.5)
    assert opt.last_grad_norm > 0.5  # clipping was active


def test_a_large_param_spans_many_blocks(monkeypatch):
    train(monkeypatch, "adamw", "int8", True, sizes=(5, 2 ** 20 + 3, 7, 16, 17), steps=2)


# ---------------------------------------------------------------- two gloo ranks
def _rank_job(rank, world, stage, dtype_name, case, state_dtype, master_bf16, in_backward):
    # The rank lives on for other jobs (tests/_ranks.py group): the class settings go back.
    saved = FlatState.bucket_numel, FlatState.reduce_in_backward
    FlatState.bucket_numel = 1200  # buckets (segments of the step) of 512 elements per rank
    FlatState.reduce_in_backward = in_backward  # the buckets' reductions started by the grad hooks
    try:
        opt, params, ref = train(None, case, state_dtype, master_bf16, stage=stage, sub_group_size=300,
                                 dtype=getattr(torch, dtype_name))
        shards = [fg.layout.shard for fg in internals.flat_groups(opt)]
        opt.state_dict()  # a collective: every rank
        opt.close()
        return shards
    finally:
        FlatState.bucket_numel, FlatState.reduce_in_backward = saved


def _two_ranks(*args):
    # One group of two ranks for the session: a spawn per case cost ~3 s.
    return group(2).run(_rank_job, *args, timeout=300)


@pytest.mark.parametrize("stage,dtype,case,state_dtype,master_bf16,in_backward", [
    (2, "bfloat16", "adamw", "int8", True, False),
    (1, "bfloat16", "adamw", "bfloat16", False, False),
    (2, "float32", "lion", "int8", False, True),
    (2, "bfloat16", "sgd-momentum", "bfloat16", True, False),
    (1, "float32", "adagrad", "bfloat16", False, False),
    (2, "bfloat16", "adamw", "int8", False, True),
])
def test_two_ranks_equal_one_rank(stage, dtype, case, state_dtype, master_bf16, in_backward):
    """Each rank's shard, its params after the all-gather, and its masters equal the one-rank
    reference bit for bit (block-aligned shards, flat offsets that do not depend on the world
    size); a 4097-element param straddles the two shards, sub-groups and buckets cut it."""
    got = _two_ranks(stage, dtype, case, state_dtype, master_bf16, in_backward)
    if state_dtype == "int8":
        assert all(s % 256 == 0 for s in got[0])


# ---------------------------------------------------------------- state_dict both ways
def _torch_trained(sizes, steps=3):
    """torch.optim.AdamW's state_dict after a few steps on fp32 params (and those params)."""
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(n, generator=gen).requires_grad_() for n in sizes]
    topt = torch.optim.AdamW(ps, lr=1e-2, foreach=False)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        topt.step()
    return ps, topt.state_dict()


@pytest.mark.parametrize("master_bf16", [False, True], ids=["master-fp32", "master-bf16"])
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_a_torch_state_dict_loads_encoded_and_comes_back_decoded(state_dtype, master_bf16):
    sizes = (7, 300, 4097, 17)
    tps, tsd = _torch_trained(sizes)
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in tps]
    before = [p.detach().clone() for p in params]
    opt = offload.AdamW(params, lr=1e-2, backend=BACKEND, state_dtype=state_dtype,
                        master_dtype="bfloat16" if master_bf16 else None)
    opt.load_state_dict(tsd)
    fg = internals.flat_groups(opt)[0]
    ref = RefCompressed(params, [0] * len(params), [{}] * len(params), torch.optim.AdamW,
                        ("exp_avg", "exp_avg_sq"), state_dtype, master_bf16)
    sd = opt.state_dict()["state"]
    for i, p in enumerate(params):
        off = fg.layout.offsets[i]
        for k in ("exp_avg", "exp_avg_sq"):
            want = ref.encode(k, tsd["state"][i][k].reshape(-1).float())  # quantized on the way in
            got = fg.state_range(k, off, off + p.numel())
            assert torch.equal(_bits(got), _bits(want)), (i, k)
            assert sd[i][k].dtype == torch.float32  # and decoded on the way out
            assert torch.equal(sd[i][k], ref.decode(k, want, p.numel()).view_as(p))
        assert int(sd[i]["step"]) == 3
        assert torch.equal(p.detach(), before[i])  # loading states leaves the params alone
        if not master_bf16:  # the master comes from the params (torch's dict has none)
            assert torch.equal(fg.master[off:off + p.numel()], p.detach().float().reshape(-1))
        else:
            assert "master" not in sd[i]
    opt.close()


def test_loading_a_dict_without_a_params_state_resets_it_to_encoded_zeros():
    sizes = (300, 17)
    params = [torch.randn(n).to(torch.bfloat16).requires_grad_() for n in sizes]
    opt = offload.AdamW(params, lr=1e-2, backend=BACKEND, state_dtype="int8", master_dtype="bfloat16")
    for p in params:
        p.grad = torch.randn(p.shape).to(torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    del sd["state"][1]
    opt.load_state_dict(sd)
    fg = internals.flat_groups(opt)[0]
    off = fg.layout.offsets[1]
    for k in ("exp_avg", "exp_avg_sq"):
        zeros = quant.encode_blocks(torch.zeros(17), signed=k == "exp_avg")
        assert torch.equal(fg.state_range(k, off, off + 17), zeros)
        assert not torch.equal(fg.state_range(k, 0, 300), quant.encode_blocks(torch.zeros(300), k == "exp_avg"))
    opt.close()


def test_a_bf16_master_needs_bf16_params():
    p16 = torch.randn(7).to(torch.float16).requires_grad_()
    with pytest.raises(ValueError, match="needs bfloat16 params"):
        offload.AdamW([p16], lr=1e-2, master_dtype="bfloat16")


def test_the_flat_layout_pads_only_for_blocked_states():
    from offload.zero.partition import FlatLayout

    plain = FlatLayout((7, 300, 17), world=2, rank=1)  # today's layout, unchanged
    assert plain.offsets == (0, 7, 307) and plain.shard == 162 and plain.total == 324
    lay = FlatLayout((7, 300, 17), world=2, rank=1, align=256)
    assert lay.offsets == (0, 256, 768) and lay.total == 785 and lay.shard == 512
    assert [(pc.index, pc.lo, pc.hi, pc.param_offset) for pc in lay.pieces(*lay.shard_range())] == \
        [(1, 512, 556, 256), (2, 768, 785, 0)]
    with pytest.raises(ValueError, match="align"):
        FlatLayout((1,), align=0)


def test_a_non_contiguous_param_is_its_own_master_too():
    # a transposed bf16 param goes through a temporary that must start from its values
    torch.manual_seed(5)
    base = torch.randn(17, 33).to(torch.bfloat16).t()  # (33, 17), strides (1, 33)
    ours = [base.clone().requires_grad_(), torch.randn(300).to(torch.bfloat16).requires_grad_()]
    assert not ours[0].is_contiguous()
    same = [p.detach().contiguous().clone().requires_grad_() for p in ours]
    opts = [offload.AdamW(ps, lr=1e-2, backend=BACKEND, state_dtype="int8", master_dtype="bfloat16")
            for ps in (ours, same)]
    for _ in range(3):
        for a, b in zip(ours, same):
            g = torch.randn(a.shape).to(torch.bfloat16)
            a.grad, b.grad = g.clone(), g.clone()
        for o in opts:
            o.step()
    for a, b in zip(ours, same):
        assert torch.equal(a.detach(), b.detach())
    assert not torch.equal(ours[0].detach(), base)  # it moved
