"""Activation checkpointing of a sharded model (offload/shard/recompute.py [Note: activation
checkpointing]): ``torch.utils.checkpoint`` around each block, around several blocks at once,
around the whole forward, and inside a block's own forward, reentrant and not, params in RAM
and on NVMe, 1 and 2 gloo ranks: training equals torch.optim.AdamW over the unsharded model
with the same checkpointing (the numerics contract), and equals the sharded run without
checkpointing bit for bit (the recompute changes no grad). During the recompute, units are
gathered again and released: the live window stays a few units, not the whole model. A
Hugging Face model with its activation checkpointing on trains as well."""
from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import offload
from offload.demo.model import GPTConfig
from offload.shard import gathered_params, runtime_of
import test_shard_train as base
from test_shard_train import HP, _assert_params, _batch, pools  # noqa: F401  (pools: the fixture)

STEPS = 4


class CkptNet(base.Net):
    """TinyGPT with checkpointed regions (``how``): "blocks" each block; "span" the first two
    blocks as one region (the region calls two units), "all" every block as one; "whole" the
    whole forward, root params and loss included (non-reentrant only: its input, token ids,
    needs no grad); "inside" each block's forward checkpoints its own body (the unit's hooks
    stay outside the region, as a Hugging Face layer's since transformers 5); "none" none."""

    def __init__(self, cfg, how, reentrant):
        super().__init__(cfg)
        self.how, self.reentrant = how, reentrant
        if how == "inside":
            for b in self.blocks:
                b.forward = functools.partial(self._inside, b)

    def _ckpt(self, fn, *args):
        return checkpoint(fn, *args, use_reentrant=self.reentrant)

    def _inside(self, block, x):
        return self._ckpt(type(block).forward.__get__(block), x)

    @staticmethod
    def _blocks(blocks, h):
        for b in blocks:
            h = b(h)
        return h

    def _body(self, idx, targets):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        if self.how in ("span", "all"):
            first = 2 if self.how == "span" else len(self.blocks)
            x = self._ckpt(functools.partial(self._blocks, self.blocks[:first]), x)
            rest = self.blocks[first:]
        else:
            rest = self.blocks
        for b in rest:
            x = self._ckpt(b, x) if self.how == "blocks" else b(x)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(self, idx, targets):
        if self.how == "whole":
            return self._ckpt(self._body, idx, targets)
        return self._body(idx, targets)


def _model(how, reentrant, n_layer=3):
    torch.manual_seed(0)
    return CkptNet(GPTConfig(n_layer=n_layer, d_model=32, n_head=2, block_size=base.T), how, reentrant)


def _world():
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _loss(model, step, world, rank, micro=0):
    x, y = _batch(step, micro)
    n = base.GLOBAL_BATCH // world
    return model(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])


def _reference(world, how, reentrant, accumulate=1):
    """torch.optim.AdamW over the unsharded model, on the grads the ranks average (each rank's
    summed over ``accumulate`` micro-batches)."""
    model = _model(how, reentrant)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, foreach=False, **HP)
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            for micro in range(accumulate):
                _loss(model, step, world, rank, micro).backward()
            total = [t + p.grad for t, p in zip(total, params)]
        for p, t in zip(params, total):
            p.grad = t * (1.0 / world)
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def job_ckpt(group, how, reentrant, offload_params, n_layer=3, steps=STEPS, accumulate=1, budget_blocks=None,
             compiled=None):
    """``accumulate`` micro-batches a step, all but the last under ``opt.no_sync()``;
    ``budget_blocks``: max_live_bytes of the root and that many blocks; ``compiled``: (what,
    backend), what "blocks" (each block's ``compile()``) or "model" (the root's)."""
    world, rank = _world()
    swap = tempfile.mkdtemp(prefix="shard-ckpt-", dir="/var/tmp") if offload_params == "nvme" else None
    try:
        model = _model(how, reentrant, n_layer)
        cap = None
        if budget_blocks is not None:
            sizes = [sum(f.nbytes for f in u.flats) for u in runtime_of(offload.shard(_model(how, reentrant, n_layer),
                                                                                     process_group=group)).units]
            cap = sizes[0] + budget_blocks * sizes[1]
        model = offload.shard(model, process_group=group, offload_params=offload_params, swap_dir=swap,
                              max_live_bytes=cap)
        if compiled is not None:
            for m in (model.blocks if compiled[0] == "blocks" else [model]):
                m.compile(backend=compiled[1])
        opt = offload.AdamW(model.parameters(), **HP)
        rt = runtime_of(model)
        between = []
        for step in range(steps):
            for micro in range(accumulate):
                with opt.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                    _loss(model, step, world, rank, micro).backward()
                between.append(rt.live_bytes())
            opt.step()
            opt.zero_grad()
        out = {"params": gathered_params(model), "peak": rt.schedule.peak_live, "between": between,
               "units": [sum(f.nbytes for f in u.flats) for u in rt.units], "replans": rt.schedule.replans}
        opt.close()
        if rt.tier is not None:
            rt.tier.close()
        return out
    finally:
        if compiled is not None:
            torch._dynamo.reset()  # the next job's compiles start from nothing (Module._call_impl is shared)
        if swap:
            shutil.rmtree(swap, ignore_errors=True)


def _run(pools, world, **kw):  # noqa: F811
    if world == 1:
        return [job_ckpt(None, **kw)]
    return pools(world).run("test_shard_checkpointing:job_ckpt", **kw)


_PLAIN: dict = {}


def _plain(pools, world, offload_params):  # noqa: F811
    """The sharded run without checkpointing (the same for every mode: made once)."""
    key = (world, offload_params)
    if key not in _PLAIN:
        _PLAIN[key] = _run(pools, world, how="none", reentrant=False, offload_params=offload_params)
    return _PLAIN[key]


MODES = [("blocks", False), ("span", False), ("whole", False), ("inside", False),
         ("blocks", True), ("span", True), ("inside", True)]


@pytest.mark.parametrize("offload_params", ["none", "nvme"])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how,reentrant", MODES, ids=[f"{h}-{'reentrant' if r else 'non_reentrant'}" for h, r in MODES])
def test_checkpointed_training_matches_torch_adamw(pools, world, how, reentrant, offload_params):
    ref = _reference(world, how, reentrant)
    outs = _run(pools, world, how=how, reentrant=reentrant, offload_params=offload_params)
    for out, same in zip(outs, _plain(pools, world, offload_params)):
        _assert_params(out["params"], ref)
        for k, v in same["params"].items():  # the recompute gives the grads of the plain backward
            assert torch.equal(out["params"][k], v), k
        assert all(b == 0 for b in out["between"])  # nothing stays gathered after a backward
        assert out["replans"] == 0  # every step's recompute in the same order: the plan holds


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how,reentrant", [("all", False), ("all", True)])
def test_the_live_window_budget_holds_nothing_more(pools, world, how, reentrant):
    """max_live_bytes of the root and one block: the recompute keeps no unit for its backward;
    the peak is the unit recomputed and (non-reentrant) the one whose backward waits for it."""
    ref = _reference(world, how, reentrant)
    outs = _run(pools, world, how=how, reentrant=reentrant, offload_params="nvme", budget_blocks=1)
    for out in outs:
        _assert_params(out["params"], ref)
        root, block = out["units"][0], out["units"][1]
        assert out["peak"] <= root + (1 if reentrant else 2) * block, out


@pytest.mark.parametrize("how,reentrant", [("span", False), ("blocks", True)])
def test_accumulation_without_sync(pools, how, reentrant):
    """Two micro-batches a step, the first under no_sync (its grads stay whole in the units)."""
    ref = _reference(2, how, reentrant, accumulate=2)
    for out in _run(pools, 2, how=how, reentrant=reentrant, offload_params="nvme", accumulate=2):
        _assert_params(out["params"], ref)


@pytest.mark.parametrize("world", [1, 2])
def test_params_on_the_host_tier(pools, world):
    """offload_params="cpu" (on a machine without CUDA, the host shards of the CPU path)."""
    ref = _reference(world, "span", False)
    for out in _run(pools, world, how="span", reentrant=False, offload_params="cpu"):
        _assert_params(out["params"], ref)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how,reentrant", [("whole", False), ("all", False), ("all", True)])
def test_the_recompute_gathers_a_few_units_at_a_time(pools, world, how, reentrant):
    """Six blocks in one region (or the whole forward): the recompute runs every unit's forward
    inside one backward node; without releasing them as it goes, all six were gathered at once."""
    outs = _run(pools, world, how=how, reentrant=reentrant, offload_params="nvme", n_layer=6, steps=2)
    for out in outs:
        root, blocks = out["units"][0], out["units"][1:]
        assert len(blocks) == 6
        # the unit in use, the one the recompute holds for its backward, one prefetched
        assert out["peak"] <= root + 3 * max(blocks) < root + sum(blocks), out



COMPILED = [(1, "blocks", "eager"), (1, "blocks", "aot_eager"), (1, "model", "aot_eager"), (2, "blocks", "eager")]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("world,what,backend", COMPILED, ids=[f"{w}-{m}-{b}" for w, m, b in COMPILED])
def test_compiled_checkpointed_units(pools, world, what, backend, reentrant):
    """torch.compile of the checkpointed blocks (or of the whole model), params on NVMe: a
    compiled module compiles its hooks too, and dynamo traced the gather schedule and the param
    tier (an AssertionError from inside dynamo, where the tier reads a swap file's pages with
    numpy). The hooks run eagerly (hooks.py ``_eager``), the forward between them compiled."""
    ref = _reference(world, "blocks", reentrant)
    for out in _run(pools, world, how="blocks", reentrant=reentrant, offload_params="nvme",
                    compiled=(what, backend)):
        _assert_params(out["params"], ref)
        assert all(b == 0 for b in out["between"])


def job_emulated(group, how, reentrant, offload_params):
    """The device path (offload/shard/device.py) with emulated streams (tests/stream_emulation.py:
    a released unit's storage is resized to 0 bytes, a read before a gather's wait is stale)
    against the plain CPU path: the same bits."""
    from stream_emulation import Emulation

    plain = job_ckpt(group, how, reentrant, offload_params, steps=3)
    with pytest.MonkeyPatch.context() as mp:
        emu = Emulation()
        emu.install_stage3(mp, optimizer=offload_params == "none")
        with emu:
            dev = job_ckpt(group, how, reentrant, offload_params, steps=3)
    return {"differ": sorted(k for k, v in plain["params"].items() if not torch.equal(dev["params"][k], v)),
            "gathers": dict(emu.queued).get("gather", 0), "torn": list(emu.torn)}


@pytest.mark.parametrize("offload_params", ["none", "cpu"])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how,reentrant", [("span", False), ("whole", False), ("span", True)])
def test_the_device_path_emulated(pools, world, how, reentrant, offload_params):
    outs = [job_emulated(None, how, reentrant, offload_params)] if world == 1 else pools(world).run(
        "test_shard_checkpointing:job_emulated", how=how, reentrant=reentrant, offload_params=offload_params)
    for out in outs:
        assert out["gathers"] > 0 and out["torn"] == [] and out["differ"] == [], out

def _hf_model(reentrant):
    """test_shard_llama's LlamaForCausalLM (head tied), its activation checkpointing on."""
    import test_shard_llama as llama

    model = llama._llama(True)
    kw = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 (the old name warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    model.train()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    return model


def job_hf(group, reentrant):
    import test_shard_llama as llama

    world, rank = _world()
    model = offload.shard(_hf_model(reentrant), process_group=group)
    opt = offload.AdamW(model.parameters(), **llama.LLAMA_HP)
    for step in range(STEPS):
        ids = llama._ids(step, world, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"params": gathered_params(model)}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("world", [1, 2])
def test_hugging_face_activation_checkpointing(pools, world, reentrant):  # noqa: F811
    pytest.importorskip("transformers")
    import test_shard_llama as llama

    model = _hf_model(reentrant)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, foreach=False, **llama.LLAMA_HP)
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            ids = llama._ids(step, world, rank)
            model(input_ids=ids, labels=ids).loss.backward()
            total = [t + p.grad for t, p in zip(total, params)]
        for p, t in zip(params, total):
            p.grad = t * (1.0 / world)
        opt.step()
    ref = {k: v.detach() for k, v in model.named_parameters()}
    outs = [job_hf(None, reentrant)] if world == 1 else pools(world).run("test_shard_checkpointing:job_hf",
                                                                          reentrant=reentrant)
    for out in outs:
        _assert_params(out["params"], ref)
