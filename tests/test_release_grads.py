"""``release_grads=True``: ZeRO-Offload's device footprint for stages 0-2 (issue #16, item 3).

Backward frees each grad once it is on the host ([Note: releasing grads] in
offload/optim/flat/grads.py). There is no GPU in CI: bf16 CPU params with
``FlatState.copy_cpu_grads`` stand for device params (the hook copies their grads to the host
buffer, as for CUDA params), and a run with the CUDA streams emulated (tests/stream_emulation.py)
checks the queued copies. The reference is the same training without ``release_grads``: the
params must be equal bit for bit after every step, with gradient accumulation, clipping,
frozen and sometimes-unused params, on one and two gloo ranks, with states on cpu and nvme.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import offload
import _ranks
from offload.optim.flat_state import FlatState
from offload.plan import estimate

STEPS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(17, 33)
        self.frozen = nn.Linear(33, 33)
        self.frozen.requires_grad_(False)
        self.side = nn.Linear(33, 33)  # used on even steps only: no grad on odd ones
        self.out = nn.Linear(33, 7)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.frozen(torch.nn.functional.gelu(self.inp(x)))
        if use_side:
            h = h + self.side(h)
        return self.out(h)


def _model(dtype: torch.dtype) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def train(release: bool, *, dtype=torch.bfloat16, accumulate=1, steps=STEPS, max_grad_norm=None, offload_to="cpu",
          swap_dir=None, no_sync=False, zero_grad="opt", group=None, stage=None, rank=0, check=None):
    """The params after each step and the optimizer's memory_report()["detail"] at the end.
    ``no_sync``: every micro-batch but the last inside ``opt.no_sync()`` ("all": every one, the
    step sends the grads); ``zero_grad``: "opt"
    (opt.zero_grad()) or "model" (model.zero_grad(): released grads are dropped by the step)."""
    model = _model(dtype)
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, max_grad_norm=max_grad_norm,
              offload=offload_to, release_grads=release)
    if offload_to == "nvme":
        kw.update(swap_dir=swap_dir, max_host_bytes=1 << 20)
    if group is not None:
        kw.update(stage=stage, process_group=group)
    opt = offload.AdamW(model.parameters(), **kw)
    gen = torch.Generator().manual_seed(1 + rank)
    history = []
    try:
        for step in range(steps):
            for micro in range(accumulate):
                x = torch.randn(6, 17, generator=gen).to(dtype)
                inside = no_sync == "all" or (no_sync and micro < accumulate - 1)
                with opt.no_sync() if inside else _null():
                    model(x, use_side=step % 2 == 0).float().pow(2).mean().backward()
                if release and not inside:
                    assert all(p.grad is None for p in model.parameters()), "a grad is left on a param"
            opt.step()
            if release:  # (no_sync="all": the step sent and freed them)
                assert all(p.grad is None for p in model.parameters()), "a grad is left on a param"
            if check is not None:
                check(opt)
            (opt if zero_grad == "opt" else model).zero_grad()
            history.append([p.detach().clone() for p in model.parameters()])
        detail = dict(opt.memory_report()["detail"])
    finally:
        opt.close()
    return history, detail


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _equal(a, b) -> None:
    for step, (xs, ys) in enumerate(zip(a, b)):
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert torch.equal(x, y), f"step {step}, param {i}: {(x.float() - y.float()).abs().max()}"


@pytest.fixture
def device_path(monkeypatch):
    """CPU params take the device path (hook copies to the host grad buffer)."""
    monkeypatch.setattr(FlatState, "copy_cpu_grads", True)


# --------------------------------------------------------------------------- one rank

@pytest.mark.parametrize("offload_to", ["cpu", "nvme"])
@pytest.mark.parametrize("accumulate,max_grad_norm", [(1, None), (3, None), (1, 0.05), (3, 0.05)])
def test_one_rank_same_params_bit_for_bit(device_path, tmp_path, offload_to, accumulate, max_grad_norm):
    runs = []
    for release in (False, True):
        sd = tmp_path / f"swap{int(release)}"
        sd.mkdir()
        runs.append(train(release, accumulate=accumulate, max_grad_norm=max_grad_norm, offload_to=offload_to,
                          swap_dir=str(sd))[0])
    _equal(*runs)


def test_clipping_was_active_and_norm_is_readable(device_path):
    norms = {}
    for release in (False, True):
        seen = []
        train(release, accumulate=2, max_grad_norm=0.05, check=lambda opt: seen.append(opt.last_grad_norm))
        norms[release] = seen
    assert norms[True] == norms[False] and all(n > 0.05 for n in norms[True])  # clipping acted on every step


def test_model_zero_grad_only_the_step_drops_released_grads(device_path):
    # a loop calling model.zero_grad() (p.grad is None already): the step consumed the host copies
    _equal(train(False, accumulate=2)[0], train(True, accumulate=2, zero_grad="model")[0])


def test_opt_zero_grad_drops_released_grads(device_path):
    model = _model(torch.bfloat16)
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload="cpu", release_grads=True)
    ref_model = _model(torch.bfloat16)
    ref = offload.AdamW(ref_model.parameters(), lr=1e-2, offload="cpu")
    x, y = torch.randn(4, 17).bfloat16(), torch.randn(4, 17).bfloat16()
    model(x, True).float().sum().backward()
    opt.zero_grad()  # drops what that backward released
    model(y, True).float().sum().backward()
    opt.step()
    ref_model(y, True).float().sum().backward()
    ref.step()
    _equal([list(model.parameters())], [list(ref_model.parameters())])


def test_no_sync_keeps_grads_then_releases_bit_for_bit(device_path):
    _equal(train(False, accumulate=3)[0], train(True, accumulate=3, no_sync=True)[0])


def test_step_right_after_no_sync_takes_the_grads_left_on_params(device_path):
    # every micro-batch inside no_sync(): the step itself moves the grads to the host
    def run(release):
        model = _model(torch.bfloat16)
        opt = offload.AdamW(model.parameters(), lr=1e-2, offload="cpu", release_grads=release)
        for k in range(2):
            with opt.no_sync():
                model(torch.full((3, 17), 0.5 + k).bfloat16(), True).float().sum().backward()
        assert model.out.weight.grad is not None  # no_sync leaves them where autograd puts them
        opt.step()
        assert (model.out.weight.grad is None) == release
        return [p.detach().clone() for p in model.parameters()]
    _equal([run(False)], [run(True)])


def test_emulated_cuda_streams_bit_for_bit_and_bounded_queue(monkeypatch):
    from stream_emulation import Emulation

    # 2 buckets of 600 elements may be queued: the model's grads (1,954 elements) are more
    monkeypatch.setattr(FlatState, "bucket_numel", 600)
    with Emulation().install(monkeypatch) as emu:
        ref = train(False, accumulate=3, max_grad_norm=0.05)[0]
        emu.torn.clear()  # (the reference's accumulation tears copies it then makes again: harmless)
        got, detail = train(True, accumulate=3, max_grad_norm=0.05)
        assert not emu.torn, emu.torn
    _equal(ref, got)
    largest = 33 * 33  # side.weight; the queue holds more than one grad, never more than the bound
    assert largest < detail["grad_peak_numel"] <= 2 * 600


def test_grad_peak_without_queue_is_the_largest_grad(device_path):
    # synchronous copies (no side stream): one grad alive at a time
    _, detail = train(True)
    assert detail["release_grads"] is True and detail["grad_peak_numel"] == 33 * 33


@pytest.mark.parametrize("make", [
    lambda ps, **kw: offload.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, **kw),
    lambda ps, **kw: offload.Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
    lambda ps, **kw: offload.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1, **kw),
    lambda ps, **kw: offload.Adam(ps, lr=1e-2, state_dtype="int8", **kw),
], ids=["sgd", "lion", "adagrad", "adam-int8"])
def test_every_offload_optimizer_takes_it(device_path, make):
    def run(release):
        model = _model(torch.bfloat16)
        opt = make(model.parameters(), offload="cpu", release_grads=release)
        gen = torch.Generator().manual_seed(3)
        out = []
        for step in range(3):
            for _ in range(2):
                model(torch.randn(4, 17, generator=gen).bfloat16(), step % 2 == 0).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            out.append([p.detach().clone() for p in model.parameters()])
        opt.close()
        return out
    _equal(run(False), run(True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_holds_the_params_only_after_backward():
    # real CUDA params (bench/gpu_check.sh runs the cuda-marked tests): the grads' memory is
    # back with the allocator once the copies are done, and the params equal the run without
    def run(release):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).to("cuda", torch.bfloat16)
        opt = offload.AdamW(model.parameters(), lr=1e-2, offload="cpu", release_grads=release)
        x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16, generator=None)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        held = []
        for _ in range(3):
            for _ in range(2):
                loss = model(x).float().pow(2).mean()
                loss.backward()
                del loss
                torch.cuda.synchronize()
                held.append(torch.cuda.memory_allocated() - base)
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        params = [p.detach().cpu() for p in model.parameters()]
        opt.close()
        return params, max(held)
    ref, held_ref = run(False)
    got, held = run(True)
    _equal([ref], [got])
    grads = 4 * (1024 * 1024 + 1024) * 2
    assert held_ref >= grads and held < grads // 8, (held_ref, held)


# --------------------------------------------------------------------------- refused

def test_grad_scaler_is_refused_before_anything_changes(device_path):
    model = _model(torch.float16)
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload="cpu", release_grads=True)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(model(torch.randn(3, 17).half(), True).float().sum()).backward()
    with pytest.raises(RuntimeError, match="release_grads=True cannot be used with torch.amp.GradScaler"):
        scaler.step(opt)
    _equal([before], [list(model.parameters())])
    assert all(not st for st in opt.state.values())  # no step counted


@pytest.mark.parametrize("kw,err,match", [
    (dict(release_grads="yes"), TypeError, "release_grads must be True or False"),
    (dict(release_grads=True), ValueError, "needs offload='cpu' or 'nvme'"),
    (dict(release_grads=True, offload="none"), ValueError, "needs offload='cpu' or 'nvme'"),
])
def test_bad_values(kw, err, match):
    with pytest.raises(err, match=match):
        offload.AdamW(_model(torch.bfloat16).parameters(), **kw)


def test_fp32_cpu_params_refused():
    # the host store: grads are host memory read in place; nothing to release
    with pytest.raises(ValueError, match="fp32 CPU params at stage 0"):
        offload.AdamW(nn.Linear(3, 3).parameters(), offload="cpu", release_grads=True)


def test_cpu_params_without_the_device_path_refused():
    with pytest.raises(ValueError, match="parameter 0 is on the CPU"):
        offload.AdamW(_model(torch.bfloat16).parameters(), offload="cpu", release_grads=True)


def test_shard_params_refused():
    model = offload.shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    with pytest.raises(ValueError, match="stages 0-2"):
        offload.AdamW(model.parameters(), offload="cpu", release_grads=True)


# --------------------------------------------------------------------------- planner

def test_planner_bound_is_the_runtime_bound():
    n = 1_000_000_000
    plan = estimate(n, offload="cpu", param_dtype="bf16", release_grads=True)
    assert plan.sharding["device_grad_numel"] == min(n, FlatState.inflight * FlatState.bucket_numel)
    assert plan.breakdown["device"]["grads"] == plan.sharding["device_grad_numel"] * 2


# --------------------------------------------------------------------------- two gloo ranks

def _rank_job(rank, world, job):
    """One case on a rank of the session's two gloo ranks (tests/_ranks.py ``group``): both
    runs, without and with release_grads. The ranks serve other files' jobs too, so the class
    settings go back after."""
    kwargs = copy.deepcopy(job)
    saved = FlatState.copy_cpu_grads, FlatState.bucket_numel
    FlatState.copy_cpu_grads = True  # the CPU params stand for device params
    try:
        if kwargs.get("swap_dir"):
            kwargs["swap_dir"] = os.path.join(kwargs["swap_dir"], f"r{rank}")
            os.makedirs(kwargs["swap_dir"], exist_ok=True)
        stage = kwargs.pop("stage", 2)
        FlatState.bucket_numel = kwargs.pop("bucket_numel", 1 << 22)
        out = {}
        for release in (False, True):
            hist, detail = _train_stage(release, stage, rank, kwargs)
            out[release] = (hist, detail)
        return out
    finally:
        FlatState.copy_cpu_grads, FlatState.bucket_numel = saved


def _train_stage(release, stage, rank, kwargs):
    kw = dict(kwargs)
    if kw.get("swap_dir"):
        kw["swap_dir"] = os.path.join(kw["swap_dir"], str(int(release)))
        os.makedirs(kw["swap_dir"], exist_ok=True)
    return train(release, group=dist.group.WORLD, stage=stage, rank=rank, **kw)


class _Ranks:
    def send(self, job, timeout):
        """``job`` on both ranks; their values by rank."""
        return _ranks.group(2).run(_rank_job, job, timeout=timeout)


@pytest.fixture(scope="module")
def ranks():
    # The session's two ranks, shared with the other multi-rank files (a spawn of this
    # file's own cost ~3 s).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return _Ranks()


@pytest.mark.parametrize("case", [
    dict(stage=2),
    dict(stage=2, bucket_numel=600),  # several buckets, params across their edges
    dict(stage=1, bucket_numel=600),
    dict(stage=2, max_grad_norm=0.05),
    dict(stage=2, accumulate=3, no_sync=True, bucket_numel=600),
    dict(stage=2, accumulate=2, no_sync="all", bucket_numel=600),
    dict(stage=2, accumulate=3, no_sync=True, max_grad_norm=0.05, offload_to="nvme"),
    dict(stage=2, offload_to="nvme"),
], ids=["stage2", "buckets", "stage1", "clip", "accumulate-no_sync", "all-no_sync", "accumulate-clip-nvme", "nvme"])
def test_two_ranks_same_params_bit_for_bit(ranks, tmp_path, case):
    if case.get("offload_to") == "nvme":
        case = dict(case, swap_dir=str(tmp_path))
    out = ranks.send(case, timeout=240)
    for rank in (0, 1):
        _equal(out[rank][False][0], out[rank][True][0])
    _equal(out[0][True][0], out[1][True][0])  # the ranks agree
    assert out[0][True][1]["release_grads"] and out[0][True][1]["grad_peak_numel"] > 0


@pytest.mark.parametrize("bucket_numel", [1 << 22, 600])
def test_two_ranks_accumulation_without_no_sync_within_the_contract(ranks, bucket_numel):
    # each backward's sum across ranks is added in fp32 (the grads of the earlier backward are
    # freed): another order of the same sums, so equal within rounding, not bit for bit
    out = ranks.send(dict(stage=2, accumulate=3, dtype=torch.float32, bucket_numel=bucket_numel), timeout=240)
    for rank in (0, 1):
        for xs, ys in zip(out[rank][False][0], out[rank][True][0]):
            for x, y in zip(xs, ys):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


def test_two_ranks_comm_slots_are_the_planners(ranks):
    # the in-backward reduction's send slots, as the planner counts them for N_d = 2
    out = ranks.send(dict(stage=2, dtype=torch.float32), timeout=240)
    n = sum(p.numel() for p in _model(torch.float32).parameters())
    plan = estimate(n, world_size=2, stage=2, offload="cpu", param_dtype="fp32", release_grads=True)
    base = estimate(n, world_size=2, stage=2, offload="cpu", param_dtype="fp32")
    planned = plan.breakdown["device"]["comm_buffers"] - base.breakdown["device"]["comm_buffers"]
    with_release, without = out[0][True][1], out[0][False][1]
    # gloo: the slots live on the host, counted with the grads; without release_grads there are none
    assert with_release["grad_bytes"] - without["grad_bytes"] == planned


def test_two_ranks_grads_leave_as_backward_makes_them(ranks, monkeypatch):
    # buckets of 2 x 300 elements, 2 in flight: the planner's bound is 1,200 grad elements; each
    # bucket is contiguous and sent once backward has passed it, so the grads alive at once are
    # those bound plus the largest grad that straddles a bucket edge (side.weight, 1,089), not
    # the half of the model a reduce-scatter bucket would wait for
    out = ranks.send(dict(stage=2, bucket_numel=600, accumulate=2, dtype=torch.float32), timeout=240)
    n = sum(p.numel() for p in _model(torch.bfloat16).parameters())
    monkeypatch.setattr(FlatState, "bucket_numel", 600)  # as the ranks had it
    plan = estimate(n, world_size=2, stage=2, offload="cpu", param_dtype="fp32", release_grads=True)
    assert plan.sharding["device_grad_numel"] == 1200 == 2 * FlatState.inflight * 300
    for rank in (0, 1):
        for xs, ys in zip(out[rank][False][0], out[rank][True][0]):  # (accumulation: in another order)
            for x, y in zip(xs, ys):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
        peak = out[rank][True][1]["grad_peak_numel"]
        assert 0 < peak <= 1200 + 33 * 33, peak
