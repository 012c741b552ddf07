"""torch's own calls on a model after ``offload.shard()``: each works as on the model before
it, or is refused before it changes anything (offload/shard/guards.py [Note: calls on a
sharded model]). Before these guards, ``.half()`` / ``.to("meta")`` rebound the shards while
the forward kept reading the old buffer, ``apply(init)`` writes were lost on NVMe and on
several ranks, a full ``load_state_dict(strict=False)`` loaded nothing, a deep copy
trained nothing, and ``DistributedDataParallel`` overwrote every rank's shards with rank 0's."""
from __future__ import annotations

import copy
import functools
import io
import os
import pickle
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

import offload
from offload.shard import gathered_params
from tests._ranks import free_port, run_ranks


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture(params=["none", "nvme"])
def model(request):
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        torch.manual_seed(0)
        nvme = request.param == "nvme"
        yield offload.shard(_Net(), offload_params=request.param, swap_dir=tmp if nvme else None)


def _fill(value):
    def init(m):
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.fill_(value)
    return init


class _OtherCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint that is not torch's (recompute.py tells torch's by its node's name)."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0].detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.fn(x)
        torch.autograd.backward(y, grad)
        return None, x.grad


def _checkpointed(how, blocks):
    """The root's forward (as a model's own checkpointing flag sets it) with ``blocks`` (indices)
    each in a checkpoint: "non_reentrant", "reentrant" (torch's), "other" (_OtherCheckpoint)."""
    from torch.utils.checkpoint import checkpoint

    def forward(m, x):
        for i in blocks:
            b = m.blocks[i]
            x = _OtherCheckpoint.apply(b, x) if how == "other" else checkpoint(b, x, use_reentrant=how == "reentrant")
        return m.head(x)
    return forward


def _train_step(model, how, blocks, x):
    model.forward = functools.partial(_checkpointed(how, blocks), model)  # an instance attribute: del restores
    try:
        model(x).sum().backward()
    finally:
        del model.forward


@pytest.mark.parametrize("how", ["non_reentrant", "reentrant", "other"])
def test_activation_checkpointing_trains_as_unsharded(model, how):
    """Each block in its own checkpoint (non-reentrant: block 0 twice, as layers sharing weights;
    reentrant: see the next test): the sharded model's steps equal torch's on the model before
    shard()."""
    torch.manual_seed(0)
    ref = _Net()
    blocks = [0, 1, 0] if how == "non_reentrant" else [0, 1]
    x = torch.randn(4, 8, requires_grad=True)  # a reentrant checkpoint needs an input that does
    opt = offload.AdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=False)
    for _ in range(2):
        _train_step(model, how, blocks, x)
        opt.step()
        opt.zero_grad()
        _checkpointed(how, blocks)(ref, x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = gathered_params(model)
    for k, v in ref.named_parameters():
        torch.testing.assert_close(got[k], v.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("how", ["reentrant", "other"])
def test_a_unit_in_two_reentrant_checkpoints_is_refused_and_training_goes_on(model, how):
    """A reentrant checkpoint's uses of a unit are known only when its backward recomputes them:
    block 0 twice is recomputed again after its grads were reduced. Refused by name (torch's:
    before the recompute; another scheme's: at the end of the backward), and a plain step
    still trains."""
    x = torch.randn(4, 8, requires_grad=True)
    opt = offload.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        _train_step(model, how, [0, 1, 0], x)
    opt.zero_grad()
    before = gathered_params(model)
    model(x.detach()).sum().backward()
    opt.step()
    after = gathered_params(model)
    assert all(torch.isfinite(after[k]).all() for k in after)
    assert all(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_the_whole_model_in_a_checkpoint(model, reentrant):
    """checkpoint(model, x): the root's forward is recomputed too (reentrant: before any hook of
    ours ran in that backward, since the forward ran under no_grad) and trains as unsharded; a
    second backward through it (retain_graph=True) is refused ([Note: one backward per forward],
    reentrant: by the recompute itself), and training goes on."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ref = _Net()
    x = torch.randn(4, 8, requires_grad=True)
    opt = offload.AdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=False)
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            checkpoint(m, x, use_reentrant=reentrant).sum().backward()
            o.step()
            o.zero_grad()
    got = gathered_params(model)
    for k, v in ref.named_parameters():
        torch.testing.assert_close(got[k], v.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    loss = checkpoint(model, x, use_reentrant=reentrant).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same forward"):
        loss.backward()
    opt.zero_grad()
    checkpoint(model, x, use_reentrant=reentrant).sum().backward()
    opt.step()
    assert any(not torch.equal(got[k], v) for k, v in gathered_params(model).items())


@pytest.mark.parametrize("call", [lambda m: m.half(), lambda m: m.double(), lambda m: m.to(torch.bfloat16),
                                  lambda m: m.to("meta"), lambda m: m.blocks[0].half(),
                                  lambda m: m.blocks[0].a.to(torch.float16), lambda m: m.share_memory(),
                                  lambda m: m.to_empty(device="cpu")],
                         ids=["half", "double", "bf16", "meta", "unit-half", "leaf-module-half", "share_memory",
                              "to_empty"])
def test_casts_and_moves_are_refused_unchanged(model, call):
    before = gathered_params(model)
    with pytest.raises(RuntimeError, match="offload.shard"):
        call(model)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    after = gathered_params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda_is_refused_clearly(model):
    # torch's own reason follows ours: "not compiled with CUDA" from a CPU build, "no NVIDIA
    # driver" from a CUDA build on a machine without a GPU (seen with Python 3.12's torch)
    with pytest.raises(RuntimeError, match="offload.shard.*sharded params.*(CUDA|NVIDIA)"):
        model.cuda()


def test_noop_conversions_still_train(model):
    model.to("cpu").float().to("cpu:0").to(torch.device("cpu", 0))  # cpu:0: accelerate's device on CPU ranks
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    before = gathered_params(model)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    after = gathered_params(model)
    assert all(not torch.equal(before[k], after[k]) for k in before)


def test_apply_init_writes_the_shards(model):
    model.apply(_fill(0.5))
    got = gathered_params(model)
    for k, v in got.items():
        if k.endswith("weight"):
            assert torch.equal(v, torch.full_like(v, 0.5)), k


def test_apply_writing_another_unit_is_refused(model):
    def bad(m):
        if m is model:  # the root's turn comes last: blocks.0 is released by then
            with torch.no_grad():
                model.blocks[0].a.weight.fill_(1.0)
    if runtime_is_alias_ram(model):
        model.apply(bad)  # the views are the shard itself: the write lands
        assert torch.equal(gathered_params(model)["blocks.0.a.weight"], torch.ones(8, 8))
        return
    with pytest.raises(RuntimeError, match=r"apply\(fn\) wrote into params of units \['blocks.0'\]"):
        model.apply(bad)


def runtime_is_alias_ram(model):
    flat = offload.shard.runtime_of(model).units[0].flats[0]
    return flat._alias and flat.tier is None


def test_load_state_dict_of_the_model_before_shard(model):
    torch.manual_seed(5)
    full = _Net().state_dict()
    assert not model.load_state_dict(full).missing_keys
    got = gathered_params(model)
    assert all(torch.equal(got[k], full[k]) for k in got)
    torch.manual_seed(6)
    part = {k: v for k, v in _Net().state_dict().items() if k.startswith("head.")}
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(part)
    res = model.load_state_dict(part, strict=False)
    assert "blocks.0.a.weight" in res.missing_keys
    assert torch.equal(gathered_params(model)["head.weight"], part["head.weight"])
    with pytest.raises(RuntimeError, match="load_state_dict.*submodule"):
        model.blocks[0].load_state_dict({k[len("blocks.0."):]: v for k, v in full.items()
                                         if k.startswith("blocks.0.")}, strict=False)
    assert model.load_state_dict(model.state_dict()).missing_keys == []  # the shards' own keys still load


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_are_refused(model, how):
    save = {"deepcopy": copy.deepcopy, "pickle": pickle.dumps, "torch.save": lambda m: torch.save(m, io.BytesIO())}
    with pytest.raises(TypeError, match="not supported.*full_state_dict"):
        save[how](model)
    torch.save(model.state_dict(), io.BytesIO())  # the state_dict is plain tensors


def test_a_rebound_or_parametrized_shard_is_refused_at_the_forward(model):
    class Neg(nn.Module):
        def forward(self, x):
            return -x

    parametrize.register_parametrization(model.blocks[0], "_shard_float32", Neg())
    with pytest.raises(RuntimeError, match="'blocks.0._shard_float32' was replaced"):
        model(torch.randn(4, 8))


def test_a_shard_rebound_with_data_is_refused_at_the_forward(model):
    model.head.weight  # noqa: B018  (reads work)
    model._shard_float32.data = torch.zeros_like(model._shard_float32)
    with pytest.raises(RuntimeError, match="'_shard_float32' was replaced"):
        model(torch.randn(4, 8))


def _ddp_above(m):
    """DDP over a module holding the sharded one reads that module's ignore list, not the
    sharded one's: it broadcast rank 0's shards over rank 1's, silently. Its first forward
    refuses now, on both ranks; a DDP told to ignore the shards trains the rest. fully_shard
    over such a module refuses at once, replicate at its first forward."""
    ignoring = nn.Sequential(m, nn.Linear(3, 3))
    shard_names = [n for n, _ in ignoring.named_parameters() if "_shard_" in n]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ignoring, shard_names)
    ddp = torch.nn.parallel.DistributedDataParallel(ignoring)
    ddp(torch.randn(4, 8)).sum().backward()
    let_be = all(p.grad is not None for p in ignoring.parameters())
    from torch.distributed.fsdp import fully_shard
    try:
        fully_shard(nn.Sequential(m))  # its module walk took the shards, as fully_shard(m) did
        return False
    except RuntimeError as e:
        composable_refused = "offload.shard() sharded" in str(e)
    from torch.distributed._composable import replicate
    try:
        replicate(nn.Sequential(m))(torch.randn(4, 8))  # replicate's init waits for the first forward
        return False
    except RuntimeError as e:
        composable_refused = composable_refused and "offload.shard() sharded" in str(e) and "replicate()" in str(e)
    ddp = torch.nn.parallel.DistributedDataParallel(nn.Sequential(m))
    try:
        ddp(torch.randn(4, 8))
        return False
    except RuntimeError as e:
        return let_be and composable_refused and "DistributedDataParallel over a module holding" in str(e) and \
            "_shard_" in str(e)


def _two_ranks(rank, port, offload_params, out):
    import traceback

    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
            torch.manual_seed(0)
            m = offload.shard(_Net(), offload_params=offload_params,
                              swap_dir=tmp if offload_params == "nvme" else None)
            m.apply(_fill(0.25))
            filled = all(torch.equal(v, torch.full_like(v, 0.25)) for k, v in gathered_params(m).items()
                         if k.endswith("weight"))
            torch.manual_seed(5)
            full = _Net().state_dict()
            m.load_state_dict(full)
            loaded = all(torch.equal(v, full[k]) for k, v in gathered_params(m).items())
            try:
                m.half()
                refused = False
            except RuntimeError:
                refused = True
            # DDP broadcast rank 0's shards over rank 1's, silently, then averaged unlike grads
            before = [p.detach().clone() for p in m.parameters()]
            ddp_refused = []
            for wrapped in (m, m.blocks[0]):
                try:
                    torch.nn.parallel.DistributedDataParallel(wrapped)
                    ddp_refused.append(False)
                except RuntimeError as e:
                    ddp_refused.append("offload.shard() sharded" in str(e))
            # FSDP2's fully_shard put DTensors in place of the shards: a step failed on one rank
            # and hung the other; replicate is DDP's composable form
            from torch.distributed._composable import replicate
            from torch.distributed.fsdp import fully_shard
            for api in (fully_shard, replicate):
                for wrapped in (m, m.blocks[0]):
                    try:
                        api(wrapped)
                        ddp_refused.append(False)
                    except RuntimeError as e:
                        ddp_refused.append("offload.shard() sharded" in str(e))
            unchanged = all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
            out.put((rank, True, (filled, loaded, refused, all(ddp_refused) and unchanged, _ddp_above(m))))
            dist.barrier()
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    # put() hands the result to the queue's feeder thread: let it write before os._exit
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.mark.parametrize("offload_params", ["none", "nvme"])
def test_two_ranks_apply_load_and_cast(offload_params):
    got = run_ranks(_two_ranks, 2, (offload_params,), timeout=180)
    assert got == {0: (True,) * 5, 1: (True,) * 5}
