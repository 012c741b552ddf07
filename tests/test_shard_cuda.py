"""Stage 3 on a device (issue #16 item 2): ``offload.shard`` of a model on CUDA gathers and
reduces on side streams (offload/shard/device.py [Note: stage 3 on a device]).

- emulated (CI, no GPU): the device path runs with CPU tensors standing for device memory and
  tests/stream_emulation.py's streams for the gather and reduce streams (an async copy runs
  only when a GPU would have had to run it); TinyGPT trained with offload.shard +
  offload.AdamW equals the plain CPU path bit for bit, on 1 and 2 gloo ranks, params "none"
  (the optimizer steps the shards as device params: the flat store's device path), "cpu"
  (pinned host shards, stepped in place) and "nvme" (the tier's pages, copied to a pinned
  buffer for the gather). Without the compute stream's wait on a gather,
  the forward reads stale bytes and the run differs: the emulated test can fail.
- ``cuda``-marked (skipped without a GPU; bench/gpu_check.sh runs them): the same on a real
  device, against the unsharded model stepped by torch.optim.AdamW on that device, within the
  numerics contract; NCCL on 2 ranks when there are 2 GPUs.
"""
from __future__ import annotations

import datetime
import math
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import offload
from offload.demo.model import GPTConfig, TinyGPT
from offload.shard import device as shard_device
from stream_emulation import Emulation
import _ranks

CFG = GPTConfig(block_size=16, n_layer=3, n_head=2, d_model=32)
HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
STEPS = 3
BATCH = 4  # sequences per step over all ranks


def _world():
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _batch(step, device="cpu"):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def _mine(t, world, rank):
    n = BATCH // world
    return t[rank * n:(rank + 1) * n]


def train(offload_params, device="cpu", steps=STEPS, max_grad_norm=None):
    """TinyGPT sharded on ``device``, trained ``steps`` steps: (losses, gathered params on the CPU)."""
    world, rank = _world()
    torch.manual_seed(0)
    model = TinyGPT(CFG).to(device)
    swap = tempfile.mkdtemp(prefix="shard-cuda-", dir="/var/tmp") if offload_params == "nvme" else None
    model = offload.shard(model, offload_params=offload_params, swap_dir=swap)
    opt = offload.AdamW(model.parameters(), max_grad_norm=max_grad_norm, **HP)
    losses = []
    for step in range(steps):
        x, y = _batch(step, device)
        _, loss = model(_mine(x, world, rank), _mine(y, world, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = offload.shard.gathered_params(model)
    opt.close()
    if swap:
        shutil.rmtree(swap, ignore_errors=True)
    return losses, params


def _emulated(offload_params, drop=None):
    """``train`` on the device path, emulated: (losses, params, copies queued per stream, torn).
    ``drop``: a wait taken away: "gather" (the compute stream's on a gather), "reduce" (the
    compute stream's on a reduction), "host" (the host's on a bucket's copy down)."""
    with pytest.MonkeyPatch.context() as mp:
        emu = Emulation()
        emu.install_stage3(mp, optimizer=offload_params == "none")
        if drop in ("gather", "reduce"):
            waits = shard_device.compute_waits
            mp.setattr(shard_device, "compute_waits", lambda side, ev: None if side.name == drop else waits(side, ev))
        elif drop == "host":
            mp.setattr(shard_device, "host_waits", lambda side, ev: None)
        with emu:
            losses, params = train(offload_params)
        return losses, params, dict(emu.queued), list(emu.torn)


def _differences(a, b):
    """Names whose tensors differ in any bit (a NaN where the other has one counts as equal)."""
    return sorted(k for k in a if not torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)))


def job_compare(rank, world, offload_params):
    """On every rank: the emulated device path against the plain CPU path."""
    ref_losses, ref = train(offload_params)
    losses, params, queued, torn = _emulated(offload_params)
    return dict(losses=losses, ref_losses=ref_losses, differ=_differences(params, ref), queued=queued, torn=torn,
                names=len(ref))


def job_missing_wait(rank, world, drop, offload_params):
    ref_losses, ref = train(offload_params)
    losses, params, queued, _ = _emulated(offload_params, drop=drop)
    return dict(losses=losses, ref_losses=ref_losses, differ=_differences(params, ref), queued=queued)


def _on_ranks(world, fn, *args):
    if world == 1:
        return {0: fn(0, 1, *args)}
    return _ranks.group(world).run(fn, *args, timeout=300)


# ---------------------------------------------------------------------- emulated (CI)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("offload_params", ["none", "cpu", "nvme"])
def test_emulated_device_path_equals_the_cpu_path(world, offload_params):
    for rank, got in _on_ranks(world, job_compare, offload_params).items():
        assert got["names"] > 0
        assert got["queued"].get("gather", 0) > 0 and got["queued"].get("reduce", 0) > 0, got["queued"]
        assert got["torn"] == [], got["torn"]
        assert got["losses"] == got["ref_losses"], (rank, got["losses"], got["ref_losses"])
        assert got["differ"] == [], (rank, got["differ"])


@pytest.mark.parametrize("world, drop, offload_params", [(1, "gather", "cpu"), (2, "gather", "cpu"),
                                                         (1, "gather", "none"), (1, "reduce", "none"),
                                                         (1, "host", "cpu")])
def test_emulation_catches_a_missing_wait(world, drop, offload_params):
    """A wait taken away (the compute stream's on a gather or a reduction, the host's on a
    grad's copy down): stale bytes are read and the run differs, so the tests above can fail.
    (Two gloo ranks reduce through host memory: the host waits for the whole reduce stream.)"""
    for rank, got in _on_ranks(world, job_missing_wait, drop, offload_params).items():
        assert got["queued"].get(drop if drop != "host" else "reduce", 0) > 0
        assert got["differ"] or got["losses"] != got["ref_losses"], (rank, got)


def test_emulated_without_overlap_equals_the_cpu_path():
    """``overlap = False`` (bench/shard_gpu.py's baseline): the gathers' copies go on the
    compute stream, in order: nothing queued on the gather stream, the same bits."""
    ref_losses, ref = train("cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shard_device, "overlap", False)
        losses, params, queued, torn = _emulated("cpu")
    assert queued.get("gather", 0) == 0 and queued.get("reduce", 0) > 0, queued
    assert torn == [] and losses == ref_losses
    assert _differences(params, ref) == []


def test_emulated_one_rank_gathers_ahead_by_its_last_order():
    """schedule.py [Note: one rank's plan]: from the second forward and backward on, one rank
    on a device issues a unit's copy while the unit before it is in use (prefetch=1), in the
    last phase's order, instead of when the unit is asked for (the copies could then never
    overlap compute: bench/shard_gpu.py measured 1.00x). The same bits as the CPU path."""
    from offload.shard.schedule import GatherSchedule

    ahead = []
    issue = GatherSchedule._issue_next

    def counting(self, *args, **kwargs):
        ahead.append((self.phase, self.plan[self.issued], self.plans_alone))
        return issue(self, *args, **kwargs)

    ref_losses, ref = train("cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GatherSchedule, "_issue_next", counting)
        losses, params, queued, torn = _emulated("cpu")
    assert {phase for phase, _, _ in ahead} == {"fwd", "bwd"} and all(alone for _, _, alone in ahead), ahead
    # every unit but the first of each planned phase is issued ahead (STEPS - 1 planned steps)
    units = len(set(i for _, i, _ in ahead))
    assert len(ahead) >= 2 * (STEPS - 1) * units - 2 * (STEPS - 1), (units, ahead)
    assert torn == [] and losses == ref_losses
    assert _differences(params, ref) == []


class _Reordered(torch.nn.Module):
    """Linear units run in ``self.order`` (changed between steps by the test)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        self.order = list(range(6))

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return x


@pytest.mark.parametrize("budget_units", [None, 1])
@pytest.mark.parametrize("orders", [[[0, 1, 2, 3, 4, 5], [5, 0, 1, 2, 3, 4], [5, 0, 1, 2, 3, 4]],
                                    [[0, 1, 2, 3, 4, 5], [0, 1, 4, 5, 2, 3], [3, 2, 1, 0, 5, 4]]])
def test_emulated_one_rank_order_change_gathers_only_what_is_asked(orders, budget_units):
    """[Note: one rank's plan]: a step whose unit order differs from the last one's (a unit far
    ahead in the plan asked for first) gathers that unit only: never more than the unit in
    use and ``prefetch`` (1) ahead live at once, the root aside, and the same bits as the CPU
    path. With ``max_live_params`` of one unit, nothing is gathered ahead at all."""
    from offload.shard.schedule import GatherSchedule

    from offload.shard.flat_unit import chunk_for

    unit_params = chunk_for(64 * 64 + 64, 1)  # a unit's gathered size: padded to whole blocks
    limit = None if budget_units is None else budget_units * unit_params

    def run(emulated: bool):
        torch.manual_seed(0)
        model = offload.shard(_Reordered(), offload_params="cpu", max_live_params=limit)
        opt = offload.AdamW(model.parameters(), **HP)
        live, out = [], []
        track = GatherSchedule._track

        def tracking(self):
            track(self)
            live.append(sum(1 for u in self.units if u.index and u.live_bytes()))

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(GatherSchedule, "_track", tracking)
            for step, order in enumerate(orders):
                model.order = order
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
        params = offload.shard.gathered_params(model)
        opt.close()
        return out, params, live

    ref_losses, ref, _ = run(False)
    with pytest.MonkeyPatch.context() as mp:
        emu = Emulation()
        emu.install_stage3(mp, optimizer=False)
        with emu:
            losses, params, live = run(True)
        assert emu.queued.get("gather", 0) > 0
    assert live and max(live) <= (2 if limit is None else budget_units), live
    assert losses == ref_losses and _differences(params, ref) == []


def test_emulated_one_rank_forward_that_raises_with_a_gather_ahead():
    """A forward that raises while a unit is gathered ahead ([Note: one rank's plan]) leaves
    nothing behind: the next steps give the CPU path's bits and every unit is released after
    each step."""
    from offload.shard import runtime_of

    class Boom(Exception):
        pass

    def boom(module, args):
        raise Boom()

    def run():
        torch.manual_seed(0)
        model = offload.shard(_Reordered(), offload_params="cpu")
        opt = offload.AdamW(model.parameters(), **HP)
        losses, live = [], []
        for step in range(5):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            if step == 2:  # on the plan by now: block 3's pre-hook raises with block 4 gathered ahead
                handle = model.blocks[3].register_forward_pre_hook(boom)
                with pytest.raises(Boom):
                    model(x)
                handle.remove()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            live.append(sum(f.allocated() for u in runtime_of(model).units for f in u.flats))
        params = offload.shard.gathered_params(model)
        opt.close()
        return losses, params, live

    ref_losses, ref, _ = run()
    with pytest.MonkeyPatch.context() as mp:
        emu = Emulation()
        emu.install_stage3(mp, optimizer=False)
        with emu:
            losses, params, live = run()
    assert live == [0] * 5, live
    assert losses == ref_losses and _differences(params, ref) == []


def test_gpu_check_script_parses_and_its_stage3_bench_skips_without_cuda():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["bash", "-n", os.path.join(root, "bench", "gpu_check.sh")], check=True)
    script = open(os.path.join(root, "bench", "gpu_check.sh")).read()
    assert "bench/shard_gpu.py" in script and "tests/test_shard_cuda.py" in script
    if torch.cuda.is_available():
        pytest.skip("a CUDA device: gpu_check.sh runs the bench itself")
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "shard_gpu.py"), "--iters", "1"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr
    assert "no CUDA device: skipped" in out.stdout


# ---------------------------------------------------------------------- on a real GPU
def _reference(device, world, max_grad_norm=None):
    """The unsharded model stepped by torch.optim.AdamW on ``device``, fed the average of
    every rank's grads (the mean loss over the whole batch): (losses of this rank's part, params)."""
    _, rank = _world()
    torch.manual_seed(0)
    model = TinyGPT(CFG).to(device)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HP)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, device)
        parts = [model(_mine(x, world, r), _mine(y, world, r))[1] for r in range(world)]
        (sum(parts) / world).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(parts[rank].item())
    return losses, {k: v.detach().cpu() for k, v in model.named_parameters()}


def _assert_contract(got, ref):
    losses, params = got
    ref_losses, ref_params = ref
    for a, b in zip(losses, ref_losses):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (losses, ref_losses)
    assert set(params) == set(ref_params)
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("offload_params", ["none", "cpu", "nvme"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_rank_matches_torch_adamw(offload_params):
    got = train(offload_params, device="cuda")
    _assert_contract(got, _reference("cuda", 1))


@pytest.mark.parametrize("offload_params", ["none", "cpu"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clipping_matches_torch(offload_params):
    """max_grad_norm with the shards' grads on the device (none) or on the host (cpu)."""
    got = train(offload_params, device="cuda", max_grad_norm=0.5)
    _assert_contract(got, _reference("cuda", 1, max_grad_norm=0.5))


def _nccl_rank(rank, port, offload_params, out):
    try:
        torch.cuda.set_device(rank)
        os.environ.setdefault("NCCL_DEBUG", "WARN")
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        got = train(offload_params, device=f"cuda:{rank}")
        _assert_contract(got, _reference(f"cuda:{rank}", 2))
        out.put((rank, True, None))
    except BaseException:
        import traceback
        out.put((rank, False, traceback.format_exc()))


@pytest.mark.parametrize("offload_params", ["none", "cpu"])
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_nccl_two_ranks_match_torch_adamw(offload_params):
    _ranks.run_ranks(_nccl_rank, 2, (offload_params,), timeout=300)
