"""ZeRO partitioning on the CPU: flat layouts, and gloo ranks spawned by the test.

Spawning processes that import torch costs seconds, so the jobs run on the session's three
gloo ranks (tests/_ranks.py ``group``, shared with the other multi-rank files): on their first
job they make a sub-group of ranks 0-1 (which also exercises ``process_group=``), and then run
the jobs the tests send them (module-level functions named ``job_*``, on a world of 2 or 3);
results come back as tensors. References run in the test process: ``torch.optim.AdamW`` in fp32 on the grads the
ranks compute, summed and averaged as they do (``_averaged_grads``; never the global batch's
grads, which round otherwise: see ``_reference``), or (for bf16 params, whose rounding would
amplify any 1e-7 difference) step-locked in the workers on exactly the grads the model produced.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import offload
from offload.zero import FlatLayout, split_ranges
import _internals as internals
import _ranks

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks
STEPS = 20
HP = dict(lr=2e-2, betas=(0.85, 0.97), eps=1e-7, weight_decay=0.05)
# A large eps makes Adam sensitive to the scale of the grads (it is nearly invariant to it
# otherwise, and so is global-norm clipping): a grad averaged twice or not at all shows.
DDP_HP = dict(HP, eps=1e-2)


# ---------------------------------------------------------------------- layout (no processes)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_layout_pieces_cover_every_element_once(world):
    numels = [7, 0, 1, 4097, 33, 2]
    seen = torch.zeros(sum(numels), dtype=torch.int32)
    for rank in range(world):
        lay = FlatLayout(numels, world, rank)
        assert lay.padded % world == 0 and lay.padded - lay.total < world
        start, end = lay.shard_range()
        assert end - start == lay.shard
        for i in range(len(numels)):
            pc = lay.owned(i)
            if pc is None:
                continue
            assert start <= pc.lo < pc.hi <= end
            assert pc.lo - lay.offsets[i] == pc.param_offset
            seen[pc.lo:pc.hi] += 1
    assert torch.equal(seen, torch.ones_like(seen))


def test_split_ranges():
    assert split_ranges(3, 10, 4) == [(3, 7), (7, 10)]
    assert split_ranges(5, 5, 4) == []
    with pytest.raises(ValueError):
        split_ranges(0, 1, 0)


def test_stage_without_process_group_is_one_rank():
    # stage=2 asked for without torch.distributed: a world of one, same numbers as torch.
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(4))]
    ref = [nn.Parameter(p.detach().clone()) for p in ps]
    opt, topt = offload.AdamW(ps, stage=2, **HP), torch.optim.AdamW(ref, foreach=False, **HP)
    assert opt.memory_report()["store"] == "flat"
    for _ in range(3):
        for a, b in zip(ps, ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g, g.clone()
        opt.step()
        topt.step()
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- the model and data
def _model(dtype=torch.float32, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential()
    m.add_module("emb", nn.Linear(9, 24))
    m.add_module("frozen", nn.Linear(24, 24))
    m.frozen.requires_grad_(False)
    m.add_module("enc", nn.TransformerEncoderLayer(24, 2, dim_feedforward=40, dropout=0.0, batch_first=True))
    # The key part of the attention's input bias has a true gradient of zero (softmax is
    # shift-invariant); its rounding noise makes Adam's g / sqrt(v) a coin flip: freeze it.
    m.enc.self_attn.in_proj_bias.requires_grad_(False)
    m.add_module("head", nn.Linear(24, 5))
    return m.to(dtype)


def _batch(step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 4, 9, generator=g), torch.randn(GLOBAL_BATCH, 4, 5, generator=g)


def _loss(model, x, y):
    return (model(x.to(next(model.parameters()).dtype)).float() - y).pow(2).mean()


class _one_thread:
    """Torch on one thread for the block, as in the workers: a matmul's rounding may depend
    on how many threads split it, and the references must compute the ranks' grads."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def _averaged_grads(model, world, accumulate, loss_of):
    """The grads ``world`` ranks use: each rank's ``loss_of(rank, micro)`` accumulated over the
    micro-batches, summed over the ranks in rank order (a missing grad counts as zeros, as
    with DDP), times 1/world as the optimizer scales the sum. The same arithmetic as the ranks'
    (bit for bit on 2 ranks; on 3, gloo may sum in another order: a last-bit difference)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            loss_of(rank, micro).backward()
        total = [t if p.grad is None else t + p.grad for t, p in zip(total, params)]
    for p, t in zip(params, total):
        p.grad = t * (1.0 / world)


def _slice_loss(model, step, micro, world, rank):
    x, y = _batch(step, micro)
    n = GLOBAL_BATCH // world
    return _loss(model, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])


def _reference(steps, *, world, accumulate=1, max_grad_norm=None, overflow_at=None, start_sd=None, start_model=None,
               first_step=0, hp=HP, sched=False):
    """torch.optim.AdamW in fp32, in this process, on the grads ``world`` ranks compute
    (``world``: a number, or a function of the step for runs resumed on other ranks).

    Not on the global batch: its grads sum in another order than two averaged halves, and
    Adam turns that rounding into lr-sized differences where |g| is near eps (1.9e-5 on one
    element of 70k, on an Intel Xeon); the contract (rtol 1e-5, atol 1e-6) is about the same
    grads. The params still drift apart by the two optimizers' last bits, as in test_optim."""
    model = _model()
    if start_model is not None:
        model.load_state_dict(start_model)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **hp)
    if start_sd is not None:
        opt.load_state_dict(copy.deepcopy(start_sd))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.6) if sched else None
    with _one_thread():
        for step in range(first_step, first_step + steps):
            w = world(step) if callable(world) else world
            _averaged_grads(model, w, accumulate, lambda rank, micro: _slice_loss(model, step, micro, w, rank))
            if step != overflow_at:
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                opt.step()
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return model, opt


# ---------------------------------------------------------------------- jobs (run on every rank)
_GROUPS = {}  # world size -> process group, made by each rank on its first job (_job)


def _local(step, micro, group):
    """This rank's rows of the global batch (``_slice_loss`` takes the same in the references)."""
    x, y = _batch(step, micro)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def job_train(group, stage, steps, accumulate=1, max_grad_norm=None, overflow_at=None, bucket=None,
              start_sd=None, start_model=None, first_step=0, save_dir=None, load_dir=None, swap_dir=None,
              dtype=torch.float32, rank0_only=False, reduce_in_backward=False, unscale=False, sched=False,
              resume=False, leave_swap=False, no_sync=False):
    from offload.optim.flat_state import FlatState

    model = _model(dtype)
    if start_model is not None:
        model.load_state_dict(start_model)
    nvme = dict(offload="nvme", swap_dir=swap_dir, sub_group_size=1024, resume=resume) if swap_dir else {}
    # Read when the store is built; put back after, for the next job of this worker process.
    saved = FlatState.bucket_numel, FlatState.reduce_in_backward
    try:
        if bucket is not None:
            FlatState.bucket_numel = bucket
        FlatState.reduce_in_backward = reduce_in_backward
        opt = offload.AdamW(model.parameters(), stage=stage, max_grad_norm=max_grad_norm, process_group=group,
                            **HP, **nvme)
    finally:
        FlatState.bucket_numel, FlatState.reduce_in_backward = saved
    if start_sd is not None:
        opt.load_state_dict(start_sd)
    if load_dir is not None:
        opt.load_checkpoint(load_dir)  # masters, moments, steps, and the params themselves
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if overflow_at is not None else None
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.6) if sched else None
    for step in range(first_step, first_step + steps):
        for micro in range(accumulate):
            x, y = _local(step, micro, group)
            loss = _loss(model, x, y)
            if scaler is not None:
                if step == overflow_at:
                    loss = loss * float("inf")
                loss = scaler.scale(loss)
            if no_sync and micro < accumulate - 1:
                with opt.no_sync():  # the grads are sent once, after the last micro-batch
                    loss.backward()
            else:
                loss.backward()
        if scaler is not None:
            if unscale:
                scaler.unscale_(opt)  # in place, after the grads were sent: must be sent again
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    if save_dir is not None:
        opt.save_checkpoint(save_dir)
    if leave_swap:  # what a killed process leaves: the swap directory, its lock free
        internals.leave_swap_as_killed(opt)
        return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    opt.state_dict_rank0_only = rank0_only
    sd = opt.state_dict()
    report = opt.memory_report()
    opt.close()
    reducer = internals.backward_reduction(opt)
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "sd": sd,
            "skipped": opt.skipped_steps, "report": report,
            "launches": None if reducer is None else (reducer._seq, len(reducer._order))}


def _step_counts(opt, model):
    return [float(opt.state[p]["step"]) if "step" in opt.state[p] else None for p in model.parameters()]


def job_swap_failure(group, swap_dir, fail_rank, steps, where="write"):
    """nvme, stage 2: at step 2 one rank's swap step fails: its first sub-group write
    (``where="write"``), or its manifest write after every rank voted to commit
    (``"manifest"``, a full disk: the slot files are preallocated, the manifest is not).
    Every rank must raise (none may wait in the all-gather), keep its params and step counts,
    and retrying the step on every rank must give the uninterrupted run."""
    from offload.swap import SwapStepError
    from test_swap_util import FaultyEngine

    model = _model()
    opt = offload.AdamW(model.parameters(), stage=2, process_group=group, offload="nvme", swap_dir=swap_dir,
                        sub_group_size=1024, **HP)
    rank = dist.get_rank(group)
    store = internals.swap(opt).store
    faulty = FaultyEngine(store.engine, op="write", fail_at=0)
    store.engine = faulty
    out = {}
    for step in range(steps):
        x, y = _local(step, 0, group)
        _loss(model, x, y).backward()
        if step == 2:
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            counts = _step_counts(opt, model)
            real_manifest = store._write_manifest
            if rank == fail_rank and where == "write":
                faulty.arm(1)
            elif rank == fail_rank:
                def full():
                    raise OSError(28, "No space left on device (injected)", store.path)

                store._write_manifest = full
            try:
                opt.step()
            except SwapStepError as exc:
                out["error"] = str(exc)
            faulty.arm(0)
            store._write_manifest = real_manifest
            out["unchanged"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            out["counts_kept"] = counts == _step_counts(opt, model)
        opt.step()  # at step 2: the retry, with the same grads
        opt.zero_grad()
    opt.close()
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def job_checkpoint_failure(group, ckpt, fail_rank, swap_dir=None):
    """save_checkpoint, then load_checkpoint, each failing on one rank only (a full disk, an
    unreadable file): every rank must raise, none may wait for the failed one."""
    import errno as errno_

    import offload.optim.flat.checkpoints as fs
    import offload.zero.checkpoint as zc

    model = _model()
    nvme = dict(offload="nvme", swap_dir=swap_dir, sub_group_size=1024) if swap_dir else {}
    opt = offload.AdamW(model.parameters(), stage=2, process_group=group, **HP, **nvme)
    x, y = _local(0, 0, group)
    _loss(model, x, y).backward()
    opt.step()
    rank = dist.get_rank(group)
    errors = {}

    def disk_full(*a, **k):
        raise OSError(errno_.ENOSPC, "No space left on device (injected)", ckpt)

    for what, module, name in (("save", zc, "save_store" if swap_dir else "save_tensors"),
                               ("load", fs, "fill_store_from_shards" if swap_dir else "load_shards")):
        real = getattr(module, name)
        if rank == fail_rank:
            setattr(module, name, disk_full)
        try:
            if what == "save":
                opt.save_checkpoint(ckpt)
            else:
                opt.load_checkpoint(ckpt)
        except (OSError, RuntimeError) as exc:
            errors[what] = f"{type(exc).__name__}: {exc}"
        finally:
            setattr(module, name, real)
        if what == "save":
            opt.save_checkpoint(ckpt)  # with nothing failing it works again: the load has files
    opt.load_checkpoint(ckpt)
    opt.close()
    return errors


def _corrupt(ckpt_rank_dir, state="exp_avg_sq", at=4 * 5 + 1):
    """Flip one bit of a saved state's data (its crc32 in the manifest no longer matches)."""
    import json

    man = json.load(open(os.path.join(ckpt_rank_dir, "offload-ckpt.json")))
    path = os.path.join(ckpt_rank_dir, man["files"][state])
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def job_load_corrupt(group, ckpt, steps, swap_dir=None):
    """Save after step 1; the last rank's saved exp_avg_sq is corrupted; after step 2 every
    rank tries to load that checkpoint: all must raise with their optimizer untouched (params,
    step counts, moments: training on must give the uninterrupted run)."""
    model = _model()
    nvme = dict(offload="nvme", swap_dir=swap_dir, sub_group_size=1024) if swap_dir else {}
    opt = offload.AdamW(model.parameters(), stage=2, process_group=group, **HP, **nvme)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = {}
    for step in range(steps):
        x, y = _local(step, 0, group)
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            opt.save_checkpoint(ckpt)
            if rank == world - 1:
                _corrupt(os.path.join(ckpt, f"rank{rank}"))
        if step == 2:
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            counts = _step_counts(opt, model)
            try:
                opt.load_checkpoint(ckpt)
            except (OSError, RuntimeError) as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            out["unchanged"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            out["counts_kept"] = counts == _step_counts(opt, model)
    opt.close()
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def job_emit_failure(group, ckpt, swap_dir, fail_rank):
    """nvme: the load commits everywhere, then rebuilding the params from the swap files fails
    on one rank: every rank must raise, none may wait for it in the params' all-gather."""
    model = _model()
    opt = offload.AdamW(model.parameters(), stage=2, process_group=group, offload="nvme", swap_dir=swap_dir,
                        sub_group_size=1024, **HP)
    x, y = _local(0, 0, group)
    _loss(model, x, y).backward()
    opt.step()
    opt.save_checkpoint(ckpt)
    if dist.get_rank(group) == fail_rank:
        def broken(outs):
            raise OSError(5, "Input/output error (injected)", swap_dir)

        internals.swap(opt).emit_all = broken
    try:
        opt.load_checkpoint(ckpt)
        error = None
    except (OSError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    opt.close()
    return error


def job_error_of(group, job, **kwargs):
    """Run ``job`` and return its error as text (every rank reports, none is left queued)."""
    try:
        globals()[job](group=group, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def job_check_steps(group, steps):
    """comm.agree_on_step with this rank's entry of ``steps``: its step, or (step, previous step)."""
    from offload.zero import comm

    mine = steps[dist.get_rank(group)]
    step, previous = mine if isinstance(mine, (tuple, list)) else (mine, None)
    return comm.agree_on_step(step, previous, "resuming", group)


def job_bf16_locked(group, stage, steps, swap_dir=None):
    """bf16 params; a reference AdamW on fp32 masters fed the exact averaged grads each step."""
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in params]
    ref = torch.optim.AdamW(masters, foreach=False, **HP)
    nvme = dict(offload="nvme", swap_dir=swap_dir, sub_group_size=1024) if swap_dir else {}
    opt = offload.AdamW(params, stage=stage, process_group=group, **HP, **nvme)
    world = dist.get_world_size(group)
    worst = 0.0
    for step in range(steps):
        x, y = _local(step, 0, group)
        _loss(model, x, y).backward()
        for p, m in zip(params, masters):
            if p.grad is None:
                continue
            parts = [torch.empty(p.shape) for _ in range(world)]
            dist.all_gather(parts, p.grad.float(), group=group)
            m.grad = torch.stack(parts).sum(0) * (1.0 / world)  # as the optimizer scales the sum
        ref.step()
        opt.step()
        opt.zero_grad()
        ref.zero_grad()
        for p, m in zip(params, masters):
            ours = internals.master(opt, p)
            torch.testing.assert_close(ours, m.detach(), rtol=1e-5, atol=1e-6)
            if not torch.equal(p.detach(), ours.bfloat16()):
                raise AssertionError("bf16 param is not the RNE copy of its master")
            worst = max(worst, float((ours - m.detach()).abs().max()))
    sd = opt.state_dict()
    opt.close()
    return {"worst": worst, "sd_keys": sorted(sd["state"][0])}


def job_local_overflow(group):
    """An overflow on rank 0 only: every rank must skip the step."""
    model = _model()
    opt = offload.AdamW(model.parameters(), process_group=group, **HP)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _local(0, 0, group)
    loss = _loss(model, x, y) * (float("inf") if dist.get_rank(group) == 0 else 1.0)
    scaler.scale(loss).backward()
    scaler.step(opt)
    same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"skipped": opt.last_step_skipped, "unchanged": same}


def job_ddp(group, steps):
    """A DDP-wrapped model: grads arrive averaged; the optimizer only slices them."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = offload.AdamW(model.parameters(), stage=2, process_group=group, **DDP_HP)
    opt.grads_already_averaged = True
    for step in range(steps):
        x, y = _local(step, 0, group)
        _loss(ddp, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class _WithSide(nn.Module):
    """The test model plus a layer used on some ranks only (rank 0's rows in each step)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        torch.manual_seed(1)
        self.side = nn.Linear(5, 5)

    def forward(self, x, use_side):
        h = self.body(x)
        return h + self.side(h) if use_side else h


def _side_loss(model, step, world, rank):
    x, y = _batch(step, 0)
    n = GLOBAL_BATCH // world
    return (model(x[rank * n:(rank + 1) * n], rank == 0) - y[rank * n:(rank + 1) * n]).pow(2).mean()


def job_side(group, steps):
    model = _WithSide()
    opt = offload.AdamW(model.parameters(), process_group=group, **HP)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for step in range(steps):
        _side_loss(model, step, world, rank).backward()
        assert (model.side.weight.grad is None) == (rank != 0)
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "side_step": float(opt.state[model.side.weight]["step"])}


# ---------------------------------------------------------------------- the ranks
def _job(rank, world, name, world_size, kwargs):
    """Job ``name`` on the session's three gloo ranks (tests/_ranks.py ``group``), on ranks
    0..world_size-1: world 3 on the default group, world 2 on a sub-group of ranks 0-1 (which
    also exercises ``process_group=``), made on the first job these processes run."""
    if 2 not in _GROUPS:
        _GROUPS[3] = None  # the default group
        _GROUPS[2] = dist.new_group([0, 1])  # collective: every rank takes part
    # Tensors from the queue live in shared memory, mapped by every rank: private copies,
    # or every rank would increment the same "step" tensors of a loaded state_dict.
    kwargs = copy.deepcopy(kwargs)
    if rank >= world_size:  # not in this job's group
        return None
    return globals()[name](group=_GROUPS[world_size], **kwargs)


class Workers:
    def run(self, name: str, world: int, **kwargs):
        """Run job ``name`` on ranks 0..world-1 (world 2 or 3); their results, by rank."""
        out = _ranks.group(3).run(_job, name, world, kwargs, timeout=120)
        return [out[r] for r in range(world)]


@pytest.fixture(scope="module")
def pool():
    # The session's ranks, shared with the other multi-rank files (a pool of this file's own
    # cost a spawn of three interpreters).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return Workers()


def _assert_params(got, ref_model):
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_all_or_none_votes_and_undoes():
    from offload.zero.comm import all_or_none

    def run(answers, prepare_fails=False, commit_fails=False):
        votes, done = [], []

        def vote(ok):
            votes.append(ok)
            return answers[len(votes) - 1]

        def prepare():
            if prepare_fails:
                raise OSError(5, "bad file")
            return "p"

        def commit(p):
            if commit_fails:
                raise OSError(28, "full")
            done.append(p)

        def undo():
            done.append("undo")
            return "undone here"

        try:
            all_or_none(prepare, commit, undo, "loading X", vote)
            err = None
        except (OSError, RuntimeError) as exc:
            err = f"{type(exc).__name__}: {exc}"
        return votes, done, err

    assert run([[], []]) == ([True, True], ["p"], None)
    votes, done, err = run([[0]], prepare_fails=True)
    assert votes == [False] and done == [] and "bad file" in err
    votes, done, err = run([[1]])
    assert votes == [True] and done == [] and "loading X failed on rank 1" in err and "applied on no rank" in err
    votes, done, err = run([[], [0]], commit_fails=True)
    assert votes == [True, False] and done == [] and "full" in err
    votes, done, err = run([[], [2]])
    assert votes == [True, True] and done == ["p", "undo"] and err.endswith("as it committed; undone here")
    out = []
    assert all_or_none(lambda: 3, out.append, lambda: "", "x", None) == 3 and out == [3]


# ---------------------------------------------------------------------- distributed tests
@pytest.mark.parametrize("world,stage", [(2, 1), (3, 2)])  # stage 2 on 2 ranks: the tests below
def test_partitioned_fp32_matches_torch_adamw_on_global_batch(pool, world, stage):
    # Buckets of 1000 elements per rank: several per step, params straddling them and the shards.
    res = pool.run("job_train", world, stage=stage, steps=STEPS, accumulate=2, max_grad_norm=1.0, bucket=1000,
                   sched=True)
    ref, _ = _reference(STEPS, world=world, accumulate=2, max_grad_norm=1.0, sched=True)
    for r in res:
        _assert_params(r["params"], ref)
    # Each rank holds 1/N of the states (plus < N elements of padding).
    states = [r["report"]["detail"]["state_bytes"] for r in res]
    total = sum(p.numel() for p in ref.parameters())
    assert all(abs(s - 12 * total / world) <= 12 * world for s in states)


def test_grad_scaler_overflow_on_every_rank_skips_together(pool):
    res = pool.run("job_train", 2, stage=2, steps=6, overflow_at=2)
    ref, _ = _reference(6, world=2, overflow_at=2)
    for r in res:
        assert r["skipped"] == 1
        _assert_params(r["params"], ref)


def test_overflow_on_one_rank_skips_on_all(pool):
    res = pool.run("job_local_overflow", 2)
    assert all(r["skipped"] and r["unchanged"] for r in res)


@pytest.mark.parametrize("nvme", [False, True], ids=["host", "nvme"])
def test_bf16_params_partitioned_match_fp32_master_reference(pool, tmp_path, nvme):
    # nvme: each rank's shard of master and moments in its own swap directory.
    res = pool.run("job_bf16_locked", 3, stage=2, steps=8, swap_dir=str(tmp_path) if nvme else None)
    assert res[0]["sd_keys"] == ["exp_avg", "exp_avg_sq", "master", "step"]


def test_checkpoint_from_2_ranks_loads_into_3_ranks_1_rank_and_torch(pool):
    first = pool.run("job_train", 2, stage=2, steps=5)
    sd, params = first[0]["sd"], first[0]["params"]
    # state_dict() is full and identical on every rank.
    for k, st in first[1]["sd"]["state"].items():
        for key, v in st.items():
            assert torch.equal(v, sd["state"][k][key]), (k, key)
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    five, five_opt = _reference(5, world=2)
    _assert_params(params, five)
    tsd = five_opt.state_dict()
    for k, st in tsd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][k][key], st[key], rtol=1e-5, atol=1e-6)
        assert float(sd["state"][k]["step"]) == float(st["step"])
    ref, _ = _reference(5, world=3, start_sd=sd, start_model=params, first_step=5)  # torch.optim.AdamW loads it
    full, _ = _reference(10, world=lambda step: 2 if step < 5 else 3)
    _assert_params(ref.state_dict(), full)
    third = pool.run("job_train", 3, stage=2, steps=5, start_sd=sd, start_model=params, first_step=5)
    for r in third:
        _assert_params(r["params"], ref)
    # One process (no process group): offload.AdamW on fp32 CPU params.
    model = _model()
    model.load_state_dict(params)
    opt = offload.AdamW(model.parameters(), **HP)
    opt.load_state_dict(copy.deepcopy(sd))
    with _one_thread():
        for step in range(5, 10):
            x, y = _batch(step, 0)
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    one, _ = _reference(5, world=1, start_sd=sd, start_model=params, first_step=5)
    _assert_params(model.state_dict(), one)



def test_save_checkpoint_2_ranks_load_checkpoint_3_ranks(pool, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pool.run("job_train", 2, stage=2, steps=5, save_dir=ckpt)
    assert sorted(os.listdir(ckpt)) == ["rank0", "rank1"]
    ref, _ = _reference(10, world=lambda step: 2 if step < 5 else 3)
    # A fresh model (other initial values): load_checkpoint restores the params too.
    third = pool.run("job_train", 3, stage=1, steps=5, load_dir=ckpt, first_step=5,
                     start_model=_model(seed=7).state_dict())
    for r in third:
        _assert_params(r["params"], ref)


def test_nvme_checkpoint_of_2_ranks_loads_on_3_ranks_and_on_2(pool, tmp_path):
    # Saved from swap files; loaded into swap files of 3 ranks (resharded while streaming)
    # and of 2 ranks (the same shards), each time into a fresh model.
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    ckpt = str(tmp_path / "ckpt")
    pool.run("job_train", 2, stage=2, steps=5, save_dir=ckpt, swap_dir=str(tmp_path / "a"))
    for world, swap in ((3, "b"), (2, "c")):
        ref, _ = _reference(10, world=lambda step, world=world: 2 if step < 5 else world)
        res = pool.run("job_train", world, stage=2, steps=5, load_dir=ckpt, first_step=5,
                       start_model=_model(seed=7).state_dict(), swap_dir=str(tmp_path / swap))
        for r in res:
            _assert_params(r["params"], ref)
        assert os.listdir(tmp_path / swap) == []


def test_nvme_resume_on_3_ranks(pool, tmp_path):
    # Each rank reopens its own swap directory: steps from the manifest, params rebuilt from
    # the swapped masters (this rank's pieces) and all-gathered; a fresh model to start from.
    pool.run("job_train", 3, stage=2, steps=4, swap_dir=str(tmp_path), leave_swap=True)
    assert sorted(os.listdir(tmp_path)) == [f"offload-flat.rank{r}" for r in range(3)]
    res = pool.run("job_train", 3, stage=2, steps=4, first_step=4, swap_dir=str(tmp_path), resume=True,
                   start_model=_model(seed=7).state_dict())
    ref, _ = _reference(8, world=3)
    for r in res:
        _assert_params(r["params"], ref)
    assert os.listdir(tmp_path) == []


def test_a_job_killed_between_the_ranks_commits_resumes_at_the_step_all_ranks_hold(pool, tmp_path, caplog):
    # [Note: a rank one step ahead]: rank 1's directory as a kill before its commit of step 3
    # left it (step 2), ranks 0 and 2 committed step 3; they go back to step 2 and the run
    # goes on as if step 3 had never been taken.
    import shutil

    pool.run("job_train", 3, stage=2, steps=2, swap_dir=str(tmp_path), leave_swap=True)
    shutil.copytree(tmp_path / "offload-flat.rank1", tmp_path / "rank1-at-step-2")
    pool.run("job_train", 3, stage=2, steps=1, first_step=2, swap_dir=str(tmp_path), resume=True, leave_swap=True)
    shutil.rmtree(tmp_path / "offload-flat.rank1")
    os.rename(tmp_path / "rank1-at-step-2", tmp_path / "offload-flat.rank1")
    res = pool.run("job_train", 3, stage=2, steps=2, first_step=2, swap_dir=str(tmp_path), resume=True,
                   start_model=_model(seed=7).state_dict())
    ref, _ = _reference(4, world=3)
    for r in res:
        _assert_params(r["params"], ref)
    assert os.listdir(tmp_path) == []


def test_swap_failure_on_one_rank_applies_the_step_on_no_rank(pool, tmp_path):
    # [Note: ranks vote before commit]: rank 1's disk fails mid-step; ranks 0 and 2 must not
    # hang in the all-gather nor commit a step rank 1 lost. All three raise, keep the params
    # and step counts, and the retried step continues the uninterrupted run.
    res = pool.run("job_swap_failure", 3, swap_dir=str(tmp_path), fail_rank=1, steps=5)
    ref, _ = _reference(5, world=3)
    assert "restored from that step" in res[1]["error"] and "injected write error" in res[1]["error"]
    for r in (0, 2):
        assert "applied on no rank" in res[r]["error"] and "rank 1 failed" in res[r]["error"]
        assert "restored from that step" in res[r]["error"]
    for r in res:
        assert r["unchanged"] and r["counts_kept"]
        _assert_params(r["params"], ref)
    assert os.listdir(tmp_path) == []


def test_manifest_failure_on_one_rank_after_the_vote_is_undone_everywhere(pool, tmp_path):
    # Every rank voted to commit; rank 1's manifest write then fails (a full disk): ranks 0
    # and 2 undo their commit, all raise with the params and step counts of step 2, and the
    # retried step continues the uninterrupted run.
    res = pool.run("job_swap_failure", 3, swap_dir=str(tmp_path), fail_rank=1, steps=5, where="manifest")
    ref, _ = _reference(5, world=3)
    assert "could not be committed: No space left on device (injected)" in res[1]["error"]
    for r in (0, 2):
        assert "rank 1 could not commit it; this rank's commit was undone" in res[r]["error"]
    for r in res:
        assert r["unchanged"] and r["counts_kept"] and "restored from that step" in r["error"]
        _assert_params(r["params"], ref)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("nvme", [False, True], ids=["host", "nvme"])
def test_checkpoint_failure_on_one_rank_raises_on_every_rank(pool, tmp_path, nvme):
    swap = tmp_path / "swap"
    swap.mkdir()
    res = pool.run("job_checkpoint_failure", 3, ckpt=str(tmp_path / "ckpt"), fail_rank=2,
                   swap_dir=str(swap) if nvme else None)
    for what in ("save", "load"):
        assert res[2][what].startswith("OSError") and "injected" in res[2][what]
        for r in (0, 1):
            assert res[r][what].startswith("RuntimeError") and "failed on rank 2" in res[r][what]
    # The injected failure replaces the whole load: in host memory after the ranks agreed the
    # files are sound (the states may be half overwritten), with nvme before the commit.
    assert ("applied on no rank" if nvme else "loaded again") in res[0]["load"]


@pytest.mark.parametrize("nvme", [False, True], ids=["host", "nvme"])
def test_load_of_a_corrupt_checkpoint_changes_nothing_on_any_rank(pool, tmp_path, nvme):
    swap = tmp_path / "swap"
    swap.mkdir()
    ckpt = tmp_path / "ckpt"
    res = pool.run("job_load_corrupt", 3, ckpt=str(ckpt), steps=4, swap_dir=str(swap) if nvme else None)
    assert res[2]["error"].startswith("OSError") and "fails its crc32" in res[2]["error"]
    for r in (0, 1):
        assert res[r]["error"].startswith("RuntimeError") and "failed on rank 2" in res[r]["error"]
    ref, _ = _reference(4, world=3)
    for r in res:
        assert r["unchanged"] and r["counts_kept"]
        _assert_params(r["params"], ref)
    # One process loading the same 3-rank checkpoint: ranks 0 and 1 are sound, rank 2 is
    # not, and it must not be left with their part loaded and the rest old.
    model = _model()
    kw = dict(offload="nvme", swap_dir=str(swap), sub_group_size=1024) if nvme else {}
    opt = offload.AdamW(model.parameters(), stage=2, **HP, **kw)  # the flat store, on one rank
    with _one_thread():
        for step in range(4):
            x, y = _batch(step, 0)
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                with pytest.raises(OSError, match="fails its crc32"):
                    opt.load_checkpoint(str(ckpt))
    opt.close()
    _assert_params(model.state_dict(), _reference(4, world=1)[0])


def test_load_of_a_cut_short_checkpoint_changes_nothing(pool, tmp_path):
    # Old rank 1's data file cut after its last element but before the end of its padding:
    # the check must refuse what the load would refuse, before rank 0's part is copied in.
    import json

    pool.run("job_train", 2, stage=2, steps=2, save_dir=str(tmp_path / "ck"))
    man = json.load(open(tmp_path / "ck" / "rank1" / "offload-ckpt.json"))
    assert man["file_bytes"] > man["numel"] * 4  # padding to cut into
    os.truncate(tmp_path / "ck" / "rank1" / man["files"]["exp_avg_sq"], man["numel"] * 4)
    model = _model()
    opt = offload.AdamW(model.parameters(), stage=2, **HP)
    x, y = _batch(0, 0)
    _loss(model, x, y).backward()
    opt.step()
    before = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="bytes, the manifest says"):
        opt.load_checkpoint(str(tmp_path / "ck"))
    after = opt.state_dict()["state"]
    assert all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    opt.close()


def test_params_not_rebuilt_on_one_rank_raises_on_every_rank(pool, tmp_path):
    res = pool.run("job_emit_failure", 3, ckpt=str(tmp_path / "ck"), swap_dir=str(tmp_path), fail_rank=1)
    assert res[1].startswith("OSError") and "injected" in res[1]
    for r in (0, 2):
        assert res[r].startswith("RuntimeError") and "rebuilding the params from the swap files failed on rank 1" in res[r]
    assert len(pool.run("job_train", 3, stage=1, steps=1)) == 3  # no rank was left in a collective


def test_resume_failing_on_one_rank_raises_on_every_rank(pool, tmp_path):
    # Rank 1's swap directory is gone: it cannot resume, and the others must not wait for it in
    # the params' all-gather; the directories that were there are kept for another try.
    import shutil

    pool.run("job_train", 3, stage=2, steps=2, swap_dir=str(tmp_path), leave_swap=True)
    shutil.rmtree(tmp_path / "offload-flat.rank1")
    res = pool.run("job_error_of", 3, job="job_train", stage=2, steps=1, first_step=2, swap_dir=str(tmp_path),
                   resume=True)
    assert res[1].startswith("FileNotFoundError") and "no swap directory to resume from" in res[1]
    for r in (0, 2):
        assert res[r].startswith("RuntimeError") and "opening the swap files" in res[r]
        assert "failed on rank 1" in res[r]
    assert sorted(os.listdir(tmp_path)) == ["offload-flat.rank0", "offload-flat.rank2"]
    # the pool still answers: no rank was left inside a collective
    assert len(pool.run("job_train", 3, stage=1, steps=1)) == 3


def test_ranks_whose_swap_files_hold_different_steps_are_refused_together(pool):
    # a job killed between two ranks' commits: resuming would mix steps, then hang on a collective
    res = pool.run("job_error_of", 3, job="job_check_steps", steps=[2, 3, None])
    assert all(r.startswith("ValueError: resuming: the ranks' swap files hold different steps "
                            "(rank 0: step 2, rank 1: step 3)") for r in res), res
    assert pool.run("job_error_of", 3, job="job_check_steps", steps=[4, None, 4]) == [None] * 3
    # a rank ahead by one that no longer holds the others' step, or ranks two steps apart: refused
    for steps in ([(2, None), (3, 1), None], [(2, 1), (4, 3), (2, 1)], [(3, 2), (2, None), (1, 0)]):
        res = pool.run("job_error_of", 3, job="job_check_steps", steps=steps)
        assert all(r and "hold different steps" in r for r in res), (steps, res)


def test_a_rank_one_step_ahead_that_still_holds_the_step_before_goes_back(pool):
    # killed between the ranks' commits: the ranks ahead agree on the step the others hold
    assert pool.run("job_check_steps", 3, steps=[(3, 2), (2, 1), None]) == [2, 2, None]
    assert pool.run("job_check_steps", 3, steps=[(2, 1), (3, 2), (3, 2)]) == [2, 2, 2]
    assert pool.run("job_check_steps", 3, steps=[(5, 4), (5, 4), (5, 5)]) == [5, 5, 5]  # same step: as they are


def test_ddp_wrapped_model_with_grads_already_averaged(pool):
    res = pool.run("job_ddp", 3, steps=6)
    ref, _ = _reference(6, world=3, hp=DDP_HP)
    for r in res:
        _assert_params(r["params"], ref)


def test_partitioned_with_moments_on_nvme_matches_torch(pool, tmp_path):
    res = pool.run("job_train", 3, stage=2, steps=8, swap_dir=str(tmp_path))
    ref, _ = _reference(8, world=3)
    for r in res:
        assert r["report"]["tiers"]["nvme"] > 0
        _assert_params(r["params"], ref)


def test_state_dict_rank0_only(pool):
    res = pool.run("job_train", 3, stage=2, steps=3, rank0_only=True)
    _, ref_opt = _reference(3, world=3)
    for k, st in ref_opt.state_dict()["state"].items():
        torch.testing.assert_close(res[0]["sd"]["state"][k]["exp_avg"], st["exp_avg"], rtol=1e-5, atol=1e-6)
        for r in res[1:]:
            assert set(r["sd"]["state"][k]) == {"step"}


def test_param_with_grad_on_one_rank_only_steps_everywhere(pool):
    # Missing grads count as zeros in the average (as with DDP); every rank steps the param.
    res = pool.run("job_side", 3, steps=4)
    # The reference averages the three ranks' grads as they do, not the grad of the mean loss.
    model = _WithSide()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HP)
    with _one_thread():
        for step in range(4):
            _averaged_grads(model, 3, 1, lambda rank, _micro: _side_loss(model, step, 3, rank))
            opt.step()
            opt.zero_grad()
    for r in res:
        assert r["side_step"] == 4.0
        _assert_params(r["params"], model)


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_in_backward_with_accumulation_matches_torch(pool, stage):
    res = pool.run("job_train", 3, stage=stage, steps=6, accumulate=2, max_grad_norm=1.0, bucket=1000,
                   reduce_in_backward=True, sched=True)
    ref, _ = _reference(6, world=3, accumulate=2, max_grad_norm=1.0, sched=True)
    for r in res:
        _assert_params(r["params"], ref)


@pytest.mark.parametrize("no_sync", [False, True], ids=["every-micro-batch", "no_sync"])
def test_no_sync_reduces_the_accumulated_grads_once(pool, no_sync):
    # As DDP's no_sync(): the micro-batches inside start no reduction; the last one sends the
    # accumulated grads. Without it every backward reduces every bucket (twice per step here).
    res = pool.run("job_train", 2, stage=2, steps=4, accumulate=2, max_grad_norm=1.0, bucket=1000,
                   reduce_in_backward=True, no_sync=no_sync)
    ref, _ = _reference(4, world=2, accumulate=2, max_grad_norm=1.0)
    for r in res:
        _assert_params(r["params"], ref)
        launches, buckets = r["launches"]
        assert buckets > 1 and launches == 4 * buckets * (1 if no_sync else 2)


def test_reduce_in_backward_resends_grads_changed_after_backward(pool):
    # scaler.unscale_() divides the grads in place after they were sent; with an overflow
    # at step 2 on every rank as well.
    res = pool.run("job_train", 2, stage=2, steps=5, overflow_at=2, unscale=True, reduce_in_backward=True)
    ref, _ = _reference(5, world=2, overflow_at=2)
    for r in res:
        assert r["skipped"] == 1
        _assert_params(r["params"], ref)

