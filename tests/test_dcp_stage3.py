"""torch.distributed.checkpoint (DCP) at stage 3 ([Note: shards in DCP] in
offload/shard/dcp_chunks.py). Every rank's shard and its optimizer states have the same key on
every rank; DCP took them for one replicated tensor, saved one rank's and loaded it into all
(a resumed two-rank run was off by 1e3). Now ``dcp.save`` writes each rank's chunk at its
offset and ``dcp.load`` reads the chunks a rank holds, whatever the world size that saved
them: the whole params and states after a load are the saved ones bit for bit at 1, 2 and 3
ranks (with three, the last rank's chunk of a 272-element unit is all padding), and a resumed
run at the same world size is the uninterrupted one."""
from __future__ import annotations

import copy
import io
import os
import pickle

import pytest
import torch

import offload
from _ranks import group
from offload.shard.dcp_chunks import ShardChunk, mark_chunk
from _lazy import lazy_import

dcp = lazy_import("torch.distributed.checkpoint")  # on first use: tests/_lazy.py
dcp_sd = lazy_import("torch.distributed.checkpoint.state_dict")
# one rank runs in this process, without a process group: DCP says so, as it should
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16-int8": (torch.bfloat16, {"state_dtype": "int8"}),  # the fp32 master and int8 states
}


def _build(cfg, swap_dir=None):
    dtype, kw = CONFIGS[cfg]
    torch.manual_seed(0)
    # units of 272 elements: not a multiple of the 256-element chunk granule
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
                                  for _ in range(3)]).to(dtype)
    if swap_dir is None:
        offload.shard(model, unit={torch.nn.Linear})
    else:  # the params and the optimizer's states in swap files
        for sub in ("params", "states"):
            os.makedirs(os.path.join(swap_dir, sub), exist_ok=True)
        offload.shard(model, unit={torch.nn.Linear}, offload_params="nvme", swap_dir=os.path.join(swap_dir, "params"))
        kw = dict(kw, offload="nvme", swap_dir=os.path.join(swap_dir, "states"))
    return model, offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)


def _train(model, opt, steps, seed, rank):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        model(torch.randn(8, 16, generator=gen).to(dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _whole(model, opt, world):
    """Every param and state of the whole model, as lists: the params gathered by name, each
    shard param's states gathered over the ranks (the padding cut off)."""
    import torch.distributed as dist

    out = {k: v.float().tolist() for k, v in offload.shard.full_state_dict(model, rank0_only=False).items()}
    sd = opt.state_dict()
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        total = sum(n for _, n in p._offload_shard.flat.slots)
        for key, t in sorted(sd["state"][i].items()):
            if key == "step":
                out[f"{i}.step"] = float(t)
                continue
            t = t.local() if isinstance(t, ShardChunk) else t
            parts = [torch.empty_like(t) for _ in range(world)] if world > 1 else [t]
            if world > 1:
                dist.all_gather(parts, t.contiguous())
            out[f"{i}.{key}"] = torch.cat(parts)[:total].float().tolist()
    return out


def _whole_then_two_steps(model, opt, world, rank):
    """(the whole state now, the params after two more steps on this rank's data); ends both."""
    whole = _whole(model, opt, world)
    _train(model, opt, 2, 2, rank)
    after = [p.detach().float().tolist() for p in model.parameters()]
    opt.close()
    offload.shard.runtime_of(model).remove()
    return whole, after


def _options(flatten):
    return dcp_sd.StateDictOptions(flatten_optimizer_state_dict=flatten)


def save_job(rank, world, path, cfg, flatten, swap_dir=None, how="save"):
    """Train, save through DCP (``how``: ``dcp.save``, ``dcp.async_save``, or ``dcp.save`` of a
    deepcopy); (the whole state saved, after two more steps: params)."""
    model, opt = _build(cfg, swap_dir and f"{swap_dir}/{rank}")
    _train(model, opt, 2, 1, rank)
    msd, osd = dcp_sd.get_state_dict(model, opt, options=_options(flatten))
    if how == "async":  # its stager copies the tensors first (the copies stay chunks)
        dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path).result()
    else:
        dcp.save(copy.deepcopy({"model": msd, "optim": osd}) if how == "deepcopy" else {"model": msd, "optim": osd},
                 checkpoint_id=path)
    return _whole_then_two_steps(model, opt, world, rank)


def load_job(rank, world, path, cfg, flatten, swap_dir=None):
    """A new model and optimizer loaded through DCP; (its whole state, after two more steps)."""
    model, opt = _build(cfg, swap_dir and f"{swap_dir}/{rank}")
    msd, osd = dcp_sd.get_state_dict(model, opt, options=_options(flatten))
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    dcp_sd.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                          options=_options(flatten))
    return _whole_then_two_steps(model, opt, world, rank)


def _on(world, fn, *args):
    """``fn`` on ``world`` gloo ranks (one: in this process, with no process group)."""
    if world == 1:
        return {0: fn(0, 1, *args)}
    return group(world).run(fn, *args, timeout=240)


@pytest.mark.parametrize("cfg,flatten", [("fp32", False), ("fp32", True), ("bf16-int8", True)])
def test_two_ranks_resume_is_the_uninterrupted_run(tmp_path, cfg, flatten):
    path = str(tmp_path / "ckpt")
    saved = _on(2, save_job, path, cfg, flatten)
    loaded = _on(2, load_job, path, cfg, flatten)
    for rank in range(2):
        assert loaded[rank][0] == saved[rank][0]  # every param and state, bit for bit
        assert loaded[rank][1] == saved[rank][1]  # and two more steps on each rank's data
    assert saved[0][0] == saved[1][0]


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (2, 3), (1, 2)])
def test_a_checkpoint_loads_at_another_world_size(tmp_path, save_world, load_world):
    path = str(tmp_path / "ckpt")
    saved = _on(save_world, save_job, path, "fp32", False)[0][0]
    loaded = _on(load_world, load_job, path, "fp32", False)
    for rank in range(load_world):
        assert loaded[rank][0] == saved


@pytest.mark.parametrize("how", ["async", "deepcopy"])
def test_async_save_and_a_deepcopy_save_every_ranks_chunk(tmp_path, how):
    path = str(tmp_path / "ckpt")
    saved = _on(2, save_job, path, "fp32", False, None, how)
    loaded = _on(2, load_job, path, "fp32", False)
    for rank in range(2):
        assert loaded[rank] == saved[rank]


def test_params_and_states_swapped_to_nvme(tmp_path):
    path, swap = str(tmp_path / "ckpt"), str(tmp_path / "swap")
    saved = _on(2, save_job, path, "fp32", True, swap)
    loaded = _on(2, load_job, path, "fp32", True, swap)
    for rank in range(2):
        assert loaded[rank] == saved[rank]


def full_state_job(rank, world):
    """DCP's getters with full_state_dict=True: refused on several ranks (they would return each
    rank's chunks as the whole), the whole units in one process; full_state_dict=False as before."""
    model, opt = _build("fp32")
    _train(model, opt, 1, 1, rank)
    full = dcp_sd.StateDictOptions(full_state_dict=True)
    got = {}
    for name, call in [("model", lambda: dcp_sd.get_model_state_dict(model, options=full)),
                       ("optim", lambda: dcp_sd.get_optimizer_state_dict(model, opt, options=full)),
                       ("both", lambda: dcp_sd.get_state_dict(model, opt, options=full))]:
        try:
            out = call()
            got[name] = sorted(out) if name == "model" else "returned"
        except RuntimeError as exc:
            got[name] = str(exc)
    msd = dcp_sd.get_model_state_dict(model)
    got["chunked"] = sorted(msd) == sorted(model.state_dict())
    offload.shard.runtime_of(model).remove()
    return got


@pytest.mark.parametrize("world", [1, 2])
def test_full_state_dict_true_is_refused_on_several_ranks(world):
    got = _on(world, full_state_job)
    for rank in range(world):
        assert got[rank]["chunked"], got
        if world == 1:
            assert got[rank]["optim"] == got[rank]["both"] == "returned", got
            assert got[rank]["model"] == sorted(dcp_sd.get_model_state_dict(_build("fp32")[0]))
            continue
        for name in ("model", "optim", "both"):
            assert got[rank][name].startswith("torch.distributed.checkpoint's full_state_dict=True gathers "
                                              "DTensors only: on a model offload.shard sharded over 2 ranks"), got
            assert "offload.shard.full_state_dict(model, path)" in got[rank][name]


def test_a_shard_chunk_is_the_shards_memory_and_pickles_as_a_plain_tensor():
    model, opt = _build("fp32")
    _train(model, opt, 1, 1, 0)
    key, shard = next(iter(model.named_parameters()))
    value = model.state_dict()[key]
    assert isinstance(value, ShardChunk) and value.data_ptr() == shard.data_ptr()
    assert value.shape == value.size() == shard.shape == (512,) and value._chunk == (272, 0, 272)
    assert type(value + 1) is torch.Tensor and torch.equal(value.local(), shard.detach())
    for copied in (value.clone(), value.detach(), value.to("cpu"), value.to(torch.float64)):
        assert isinstance(copied, ShardChunk) and copied._chunk == value._chunk and torch.equal(copied, value)
    assert model.state_dict(keep_vars=True)[key] is shard  # keep_vars: the Parameter itself
    state = opt.state_dict()["state"][0]
    assert isinstance(state["exp_avg"], ShardChunk) and not isinstance(state["step"], ShardChunk)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert type(back["model"][key]) is torch.Tensor and torch.equal(back["model"][key], shard.detach())
    assert type(pickle.loads(pickle.dumps(value))) is torch.Tensor
    copied = copy.deepcopy(value)
    assert isinstance(copied, ShardChunk) and copied._chunk == value._chunk and copied.data_ptr() != value.data_ptr()
    assert torch.equal(copied, value)
    model.load_state_dict(model.state_dict())  # a ShardChunk loads as a plain tensor would
    opt.load_state_dict(opt.state_dict())
    assert not isinstance(shard, ShardChunk) and not any(isinstance(v, ShardChunk) for v in opt.state[shard].values())
    opt.close()


def test_mark_chunk_refuses_a_tensor_shorter_than_its_chunk():
    with pytest.raises(ValueError, match="1-D tensor of at least"):
        mark_chunk(torch.zeros(4), 10, 0, 5)
    with pytest.raises(ValueError, match="1-D tensor"):
        mark_chunk(torch.zeros(2, 4), 10, 0, 5)
