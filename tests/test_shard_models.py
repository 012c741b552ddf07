"""offload.shard with bf16 params and with a transformers GPT-2 (tied head, HF's blocks as
units), on 1 and 2 gloo ranks; and the argument checks of shard()."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import offload
from offload.shard import gathered_params, runtime_of
from test_shard_train import HP, _batch, _model, pools  # noqa: F401  (pools: the fixture)

GPT2 = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


def _world():
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**GPT2)
    return transformers.GPT2LMHeadModel(cfg, attn_implementation="eager") if _takes_attn() else \
        transformers.GPT2LMHeadModel(cfg)


def _takes_attn():
    import inspect

    import transformers
    return "attn_implementation" in inspect.signature(transformers.PreTrainedModel.__init__).parameters


def _gpt2_loss(model, step, world, rank):
    x, _ = _batch(step, 0)
    n = x.shape[0] // world
    ids = x[rank * n:(rank + 1) * n]
    return model(input_ids=ids, labels=ids).loss


def job_gpt2(group, steps):
    world, rank = _world()
    model = offload.shard(_gpt2(), process_group=group)
    opt = offload.AdamW(model.parameters(), **HP)
    losses = []
    for step in range(steps):
        loss = _gpt2_loss(model, step, world, rank)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"params": gathered_params(model), "losses": losses, "units": len(runtime_of(model).units)}


def _gpt2_reference(steps, world):
    model = _gpt2()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, foreach=False, **HP)
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            _gpt2_loss(model, step, world, rank).backward()
            total = [t + p.grad for t, p in zip(total, params)]
        for p, t in zip(params, total):
            p.grad = t * (1.0 / world)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("world", [1, 2])
def test_gpt2_trains_and_matches_torch(pools, world):  # noqa: F811
    steps = 3
    ref = _gpt2_reference(steps, world)
    outs = [job_gpt2(None, steps=steps)] if world == 1 else pools(world).run("test_shard_models:job_gpt2",
                                                                              steps=steps)
    for out in outs:
        assert out["units"] == 1 + GPT2["n_layer"]  # the root and the blocks of transformer.h
        assert set(out["params"]) == set(ref)  # the tied lm_head.weight is transformer.wte.weight
        for k, v in ref.items():
            torch.testing.assert_close(out["params"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def job_bf16(group, steps, fixed=False):
    world, rank = _world()
    model = offload.shard(_model().to(torch.bfloat16), process_group=group)
    opt = offload.AdamW(model.parameters(), **HP)
    losses = []
    for step in range(steps):
        x, y = _batch(0 if fixed else step, 0)
        n = x.shape[0] // world
        loss = model(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"params": gathered_params(model), "losses": losses,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def test_bf16_shards_on_one_rank_equal_the_unsharded_model_bit_for_bit():
    steps = 5
    out = job_bf16(None, steps)
    assert out["dtypes"] == ["torch.bfloat16"]
    model = _model().to(torch.bfloat16)
    opt = offload.AdamW(model.parameters(), **HP)
    for step in range(steps):
        x, y = _batch(step, 0)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    for k, v in model.named_parameters():
        assert torch.equal(out["params"][k], v.detach()), k


def test_bf16_two_ranks_train_alike(pools):  # noqa: F811
    outs = pools(2).run("test_shard_models:job_bf16", steps=6, fixed=True)
    for k, v in outs[0]["params"].items():
        assert torch.equal(outs[1]["params"][k], v), k
        assert v.dtype == torch.bfloat16 and torch.isfinite(v.float()).all()
    assert outs[0]["losses"][-1] < outs[0]["losses"][0] - 0.05  # one batch, learnt


# ---------------------------------------------------------------------- shard()'s checks
def test_shard_refuses_bad_arguments():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        offload.shard(torch.zeros(3))
    with pytest.raises(ValueError, match="offload_params must be one of"):
        offload.shard(nn.Linear(2, 2), offload_params="disk")
    with pytest.raises(ValueError, match="needs swap_dir"):
        offload.shard(nn.Linear(2, 2), offload_params="nvme")
    with pytest.raises(ValueError, match="unit="):
        offload.shard(nn.Linear(2, 2), unit=0)
    with pytest.raises(TypeError, match="unit="):
        offload.shard(nn.Linear(2, 2), unit={int})
    m = offload.shard(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already sharded"):
        offload.shard(m)


def test_stage3_optimizer_refuses_a_mix_and_a_stage():
    m = offload.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not shards of offload.shard"):
        offload.AdamW(list(m.parameters()) + [extra])
    with pytest.raises(ValueError, match="partitioned already"):
        offload.AdamW(m.parameters(), stage=2)


def test_units_by_class_and_by_size_and_the_layout():
    from offload.shard.flat_unit import BLOCK

    m = offload.shard(_model(), unit={type(_model().blocks[0].mlp)})
    rt = runtime_of(m)
    assert [u.name for u in rt.units] == ["", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    for u in rt.units:
        for f in u.flats:
            assert f.chunk % BLOCK == 0 and f.padded >= sum(n for _, n in f.slots)
    m2 = offload.shard(_model(), unit=4000)
    names = [u.name for u in runtime_of(m2).units]
    assert names[0] == "" and all(n for n in names[1:]) and len(names) > 2
    # the module's names: the shards, registered on their units; the originals are plain tensors
    assert sorted(dict(m.named_parameters())) == ["_shard_float32"] + [f"blocks.{i}.mlp._shard_float32" for i in range(3)]
    assert not isinstance(m.blocks[0].mlp[0].weight, nn.Parameter) and m.blocks[0].mlp[0].weight.requires_grad


def test_one_rank_recovers_from_a_forward_that_raised():
    m = offload.shard(_model())
    x, y = _batch(0, 0)
    with pytest.raises(ValueError):
        m(x, y[:, :3])  # targets of the wrong shape: cross_entropy raises inside the root's forward
    loss = m(x, y)
    loss.backward()
    assert runtime_of(m).live_bytes() == 0 and all(p.grad is not None for p in m.parameters())
