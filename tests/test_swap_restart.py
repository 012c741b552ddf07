"""A fixed swap_dir after a crash (issue 17, s.2): resume="discard" and resume="auto".

The Trainer-like sequence: a job checkpoints at step 4 (weights and the streamed optimizer),
goes on to step 6 and dies (kill -9, or SIGTERM as a preemption); it is restarted with the
same swap_dir, loads the weights of step 4 (before the optimizer is built, as the Trainer
does), builds the optimizer and loads the checkpoint. Before resume="discard" this restart
was refused (FileExistsError), and resume=True refused fp32 params (their fingerprint is that
of step 4, the swap files hold step 6). The restarted run must equal an uninterrupted one bit
for bit. A directory that a live process holds is never removed.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

import pytest
import torch

import offload
from offload.swap.fsutil import DirectoryBusy
from test_swap_util import run_python

SIZES = [(40, 50), (50,), (1200,)]  # 3250 elements: four sub-groups of 1024
HP = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, sub_group_size=1024)
SAVED, CRASH, TOTAL = 4, 6, 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_params(dtype_name):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DTYPES[dtype_name])) for s in SIZES]


def make_opt(params, swap_dir, **kw):
    return offload.AdamW(params, offload="nvme", swap_dir=str(swap_dir), **HP, **kw)


def train(params, opt, first, last):
    """Steps ``first``..``last``; each step's grads depend on the step number and the params
    only, elementwise (no reduction whose order could depend on threads)."""
    for k in range(first, last + 1):
        g = torch.Generator().manual_seed(1000 + k)
        for p in params:
            p.grad = (p.detach().float() - torch.randn(p.shape, generator=g)).to(p.dtype)
        opt.step()
        opt.zero_grad()


def save(ckpt, params, opt):
    """What a Trainer checkpoint with OffloadCallback(checkpoint=True) holds: the weights and
    the streamed optimizer."""
    os.makedirs(ckpt, exist_ok=True)
    torch.save([p.detach().clone() for p in params], os.path.join(ckpt, "weights.pt"))
    opt.save_checkpoint(os.path.join(ckpt, "offload_states"))


def crash_run(dtype_name, swap_dir, ckpt, how):
    """The first job (in a child process): checkpoint at SAVED, die at CRASH."""
    params = make_params(dtype_name)
    opt = make_opt(params, swap_dir)
    train(params, opt, 1, SAVED)
    save(ckpt, params, opt)
    train(params, opt, SAVED + 1, CRASH)
    sys.stdout.flush()
    os.kill(os.getpid(), getattr(signal, how))


def _crash(dtype_name, swap_dir, ckpt, how):
    code = "import sys; from test_swap_restart import crash_run; crash_run(*sys.argv[1:])"
    proc = run_python(code, dtype_name, str(swap_dir), str(ckpt), how)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -getattr(signal, how), out + err
    left = os.path.join(swap_dir, "offload-run.rank0" if dtype_name == "float32" else "offload-flat.rank0")
    assert os.path.exists(os.path.join(left, "manifest.json")), err  # what the restart finds
    return left


def _state(opt):
    return [{k: v.clone() for k, v in s.items()} for s in opt.state_dict()["state"].values()]


def _assert_same(params, opt, ref_params, ref_opt):
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    got, want = _state(opt), _state(ref_opt)
    assert len(got) == len(want) == len(SIZES)
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype_name, how", [("float32", "SIGKILL"), ("bfloat16", "SIGKILL"),
                                             ("float32", "SIGTERM")])
def test_restart_from_an_older_checkpoint_with_the_same_swap_dir(workdir, dtype_name, how, caplog):
    swap, ckpt = workdir / "swap", workdir / f"checkpoint-{SAVED}"
    swap.mkdir()
    left = _crash(dtype_name, swap, ckpt, how)

    params = make_params(dtype_name)
    with torch.no_grad():  # the Trainer loads the weights before it builds the optimizer
        for p, w in zip(params, torch.load(ckpt / "weights.pt", weights_only=True)):
            p.copy_(w)
    with pytest.raises(FileExistsError, match=f"holds step {CRASH} .*resume='discard'"):
        make_opt(params, swap)  # what the issue saw
    if dtype_name == "float32":
        for resume in (True, "auto"):  # the swap files are newer than these params: never mixed
            with pytest.raises(ValueError, match=f"not those of step {CRASH} .*resume='discard'"):
                make_opt(params, swap, resume=resume)
    assert os.path.exists(os.path.join(left, "manifest.json"))  # refusals remove nothing

    with caplog.at_level(logging.WARNING, logger="offload.swap.store"):
        opt = make_opt(params, swap, resume="discard")
    assert f"removed the swap directory (step {CRASH})" in caplog.text
    opt.load_checkpoint(str(ckpt / "offload_states"))
    train(params, opt, SAVED + 1, TOTAL)

    ref_params = make_params(dtype_name)
    (workdir / "ref").mkdir()
    ref_opt = make_opt(ref_params, workdir / "ref")
    train(ref_params, ref_opt, 1, TOTAL)
    _assert_same(params, opt, ref_params, ref_opt)
    opt.close()
    ref_opt.close()
    assert os.listdir(swap) == []


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_auto_resumes_matching_states_and_starts_afresh_when_nothing_was_left(workdir, dtype_name):
    """resume="auto" with nothing left starts afresh; after a crash (the directory kept,
    unlocked) with the params of the last step it continues as an uninterrupted run."""
    params = make_params(dtype_name)
    opt = make_opt(params, workdir, resume="auto")
    train(params, opt, 1, CRASH)
    opt.close(keep_swap=True)  # as a dead process leaves it
    if dtype_name == "bfloat16":  # rebuilt from the swapped masters
        with torch.no_grad():
            for p in params:
                p.zero_()
    opt = make_opt(params, workdir, resume="auto")
    assert [int(s["step"]) for s in opt.state_dict()["state"].values()] == [CRASH] * len(SIZES)
    train(params, opt, CRASH + 1, TOTAL)

    ref_params = make_params(dtype_name)
    (workdir / "ref").mkdir()
    ref_opt = make_opt(ref_params, workdir / "ref")
    train(ref_params, ref_opt, 1, TOTAL)
    _assert_same(params, opt, ref_params, ref_opt)
    opt.close()
    ref_opt.close()


def test_auto_refuses_what_other_params_left_and_discard_removes_it(workdir):
    params = make_params("float32")
    opt = make_opt(params, workdir)
    train(params, opt, 1, 2)
    opt.close(keep_swap=True)
    other = [torch.nn.Parameter(torch.randn(3000))]
    with pytest.raises(ValueError, match=r"found no swap directory of these params \(1 fp32 params, 3000 "
                                         r"elements\) but .*offload-run.rank0 holds step 2 of other params "
                                         r"\(3 fp32 params, 3250 elements\).*resume='discard'"):
        make_opt(other, workdir, resume="auto")
    assert sorted(os.listdir(workdir / "offload-run.rank0")) == sorted(
        ["lock", "manifest.json", "reserve.bin", "slot0.bin", "slot1.bin"])
    opt = make_opt(other, workdir, resume="discard")
    assert opt.state_dict()["state"] == {}
    opt.close()
    assert os.listdir(workdir) == []


def test_auto_with_several_optimizers_finds_each_its_own(workdir):
    """Two optimizers left their directories; restarted in the other order with a third,
    new one: each of the two resumes its own states, the third starts afresh."""
    a, b = [torch.nn.Parameter(torch.randn(3000))], [torch.nn.Parameter(torch.randn(2000))]
    oa, ob = make_opt(a, workdir), make_opt(b, workdir)
    train(a, oa, 1, 2)
    train(b, ob, 1, 3)
    oa.close(keep_swap=True)
    ob.close(keep_swap=True)
    ob, oa = make_opt(b, workdir, resume="auto"), make_opt(a, workdir, resume="auto")
    oc = make_opt([torch.nn.Parameter(torch.randn(1000))], workdir, resume="auto")
    assert [int(s["step"]) for o in (oa, ob) for s in o.state_dict()["state"].values()] == [2, 3]
    assert oc.state_dict()["state"] == {} and len(os.listdir(workdir)) == 3
    for o in (oa, ob, oc):
        o.close()
    assert os.listdir(workdir) == []


HOLDER = """
import sys, torch, offload
from test_swap_restart import make_params, make_opt, train
params = make_params(sys.argv[2])
opt = make_opt(params, sys.argv[1])
train(params, opt, 1, 2)
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin
train(params, opt, 3, 3)  # the directory is still ours
print("stepped", int(opt.state_dict()["state"][0]["step"]), flush=True)
opt.close()
"""


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_a_directory_held_by_a_live_process_is_never_removed(workdir, dtype_name):
    from _forkserver import spawn

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                        os.path.dirname(__file__)]))
    proc = spawn(HOLDER, str(workdir), dtype_name, env=env, stdin=True)  # forked from a warm interpreter
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        (path,) = [workdir / n for n in os.listdir(workdir)]
        before = {n: os.stat(path / n).st_ino for n in os.listdir(path)}
        params = make_params(dtype_name)
        for resume in ("discard", "auto"):
            with pytest.raises(DirectoryBusy, match=f"in use by process {proc.pid}"):
                make_opt(params, workdir, resume=resume)
            assert {n: os.stat(path / n).st_ino for n in os.listdir(path)} == before
        out, err = proc.communicate("", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.split() == ["stepped", "3"], out + err
    assert os.listdir(workdir) == []


def test_discard_in_the_same_process_leaves_a_live_optimizer_alone(workdir):
    """A restart in the same process (a notebook, after an exception) while the first
    optimizer is still alive: "discard" takes a directory of its own."""
    first = make_params("float32")
    opt1 = make_opt(first, workdir)
    train(first, opt1, 1, 2)
    params = make_params("float32")
    opt2 = make_opt(params, workdir, resume="discard")
    assert sorted(os.listdir(workdir)) == ["offload-run-2.rank0", "offload-run.rank0"]
    train(first, opt1, 3, 3)
    train(params, opt2, 1, 3)
    _assert_same(params, opt2, first, opt1)
    opt1.close()
    opt2.close()


@pytest.mark.parametrize("value, exc, match", [
    ("yes", ValueError, r"Invalid resume: 'yes' \(True, False, 'auto' or 'discard'\)"),
    ("True", ValueError, "Invalid resume"),
    (1, TypeError, r"resume must be True or False \(or 'auto' / 'discard'\), got int 1"),
    (None, TypeError, "resume must be True or False"),
])
def test_resume_values_are_checked(workdir, value, exc, match):
    with pytest.raises(exc, match=match):
        make_opt(make_params("float32"), workdir, resume=value)
    assert os.listdir(workdir) == []


@pytest.mark.parametrize("mode", ["auto", "discard"])
def test_restart_modes_need_swap_files(mode):
    with pytest.raises(ValueError, match="resume acts only on swap files and needs offload='nvme'"):
        offload.AdamW(make_params("float32"), offload="cpu", resume=mode)


# ---------------------------------------------------------------- through the Trainer itself
class _Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.SiLU(), torch.nn.Linear(65, 1)).to(dtype)

    def forward(self, x, labels=None):
        out = self.body(x.to(self.body[0].weight.dtype)).squeeze(-1).float()
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


def trainer_run(out, swap, dtype_name, ckpt=None, kill_at=0, **offload_kw):
    """Trainer with the optimizer built by the Trainer (after it loads the weights of
    checkpoint ``ckpt``), checkpoints every 3 steps; ``kill_at``: SIGKILL after that step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from offload.integrations.hf import OffloadCallback, offload_optimizer

    class Die(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(33, generator=g), "labels": torch.randn((), generator=g)} for _ in range(48)]
    model = _Net(DTYPES[dtype_name])
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, save_steps=3, save_only_model=True, report_to=[], use_cpu=True,
                             logging_steps=1, max_grad_norm=0.0, disable_tqdm=True, seed=3)
    kwargs = dict(lr=1e-2, max_grad_norm=1.0, offload="nvme", swap_dir=str(swap), **offload_kw)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=(offload.AdamW, kwargs),
                      callbacks=[OffloadCallback(checkpoint=True), Die()])
    trainer.train(resume_from_checkpoint=ckpt)
    opt = offload_optimizer(trainer.optimizer)
    final = [p.detach().clone() for p in model.parameters()]
    state = _state(opt)
    opt.close()
    return final, state, [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_trainer_restart_after_kill_with_the_same_swap_dir(workdir, dtype_name):
    """The issue's sequence through the Trainer: checkpoint-3, killed after step 5, restarted
    from checkpoint-3 with the same swap_dir and resume='discard': the same as a run that
    was never interrupted."""
    pytest.importorskip("transformers")
    out, swap = workdir / "out", workdir / "swap"
    swap.mkdir()
    code = "import sys; from test_swap_restart import trainer_run; trainer_run(*sys.argv[1:4], kill_at=5)"
    proc = run_python(code, str(out), str(swap), dtype_name)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    assert len(os.listdir(swap)) == 1 and (out / "checkpoint-3").is_dir() and not (out / "checkpoint-6").exists()
    with pytest.raises(FileExistsError, match="holds step 5 left by an earlier run"):
        trainer_run(out, swap, dtype_name, ckpt=str(out / "checkpoint-3"))  # the issue
    if dtype_name == "float32":  # the swap files (step 5) are newer than the weights of checkpoint-3
        with pytest.raises(ValueError, match="not those of step 5"):
            trainer_run(out, swap, dtype_name, ckpt=str(out / "checkpoint-3"), resume=True)
    resumed = trainer_run(out, swap, dtype_name, ckpt=str(out / "checkpoint-3"), resume="discard")
    (workdir / "ref_swap").mkdir()
    full = trainer_run(workdir / "ref_out", workdir / "ref_swap", dtype_name)
    assert resumed[2] == full[2] and [s for s, _ in full[2]] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed[0], full[0]):
        assert torch.equal(a, b)
    for a, b in zip(resumed[1], full[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.listdir(swap) == []


# ---------------------------------------------------------------- several ranks
def _ranks_job(rank, world, swap, out):
    """On each of ``world`` gloo ranks (ZeRO-2, bf16 params; the session's group of
    tests/_ranks.py): a run that dies at step 2, then resume="auto" (refused), then
    resume="discard" against a fresh run."""
    import json

    res = {}
    try:
        params = make_params("bfloat16")
        opt = make_opt(params, swap, stage=2)
        train(params, opt, 1, 2)
        opt.close(keep_swap=True)  # as a dead job leaves it
        try:
            make_opt(make_params("bfloat16"), swap, stage=2, resume="auto")
            res["auto"] = "no error"
        except Exception as exc:
            res["auto"] = f"{type(exc).__name__}: {exc}"
        params, ref = make_params("bfloat16"), make_params("bfloat16")
        opt = make_opt(params, swap, stage=2, resume="discard")
        os.makedirs(os.path.join(swap, f"ref{rank}"), exist_ok=True)
        ref_opt = make_opt(ref, os.path.join(swap, f"ref{rank}"), stage=2)
        train(params, opt, 1, 3)
        train(ref, ref_opt, 1, 3)
        res["same"] = all(torch.equal(a, b) for a, b in zip(params, ref))
        res["steps"] = [int(s["step"]) for s in opt.state_dict()["state"].values()]
        opt.close()
        ref_opt.close()
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)


def test_two_ranks_discard_and_auto_is_refused(workdir, tmp_path):
    """resume="auto" is refused on every rank (they could disagree); "discard" works on each."""
    import json

    from _ranks import group

    swap, out = workdir / "swap", tmp_path / "results"
    swap.mkdir()
    out.mkdir()
    group(2).run(_ranks_job, str(swap), str(out))  # a spawn of its own cost ~3 s
    for rank in range(2):
        res = json.load(open(out / f"rank{rank}.json"))
        assert "error" not in res, res
        assert res["auto"].startswith("ValueError: resume='auto' decides on each rank alone") or \
            res["auto"].startswith("RuntimeError: opening the swap files"), res  # raised on every rank
        assert res["same"] and res["steps"] == [3] * len(SIZES), res
    assert sorted(os.listdir(swap)) == ["ref0", "ref1"] and not os.listdir(swap / "ref0")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_offload_config_checks_resume_too(value):
    """A config built from a file (from_dict) does not pass through the constructor's checks."""
    from offload.config import OffloadConfig, from_dict

    with pytest.raises(ValueError, match=r"resume must be True, False, 'auto' or 'discard', got"):
        from_dict(OffloadConfig, dict(offload="nvme", swap_dir="/var/tmp", resume=value))
    assert from_dict(OffloadConfig, dict(offload="nvme", swap_dir="/var/tmp", resume="discard")).resume == "discard"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_auto_starts_afresh_over_a_directory_never_committed(workdir, dtype_name):
    """A Ctrl-C or a kill while the optimizer was built (after the store's first manifest,
    before the commit of step 0, whose "extra" it fills) left a directory no resume can open
    (manifest_check.check_committed); resume="auto" refused it ("build the optimizer without
    resume=True"), though nothing was left: it starts afresh, as over a half-made directory."""
    import json

    from offload.swap import fsutil

    params = make_params(dtype_name)
    make_opt(params, workdir).close(keep_swap=True)
    (left,) = [workdir / n for n in os.listdir(workdir)]
    m = json.loads((left / "manifest.json").read_text())
    m["extra"] = {}
    (left / "manifest.json").write_text(json.dumps(fsutil.sealed(m)))
    opt = make_opt(params, workdir, resume="auto")
    assert not opt.state_dict()["state"]
    train(params, opt, 1, 2)
    ref_params = make_params(dtype_name)
    (workdir / "ref").mkdir()
    ref_opt = make_opt(ref_params, workdir / "ref")
    train(ref_params, ref_opt, 1, 2)
    _assert_same(params, opt, ref_params, ref_opt)
    opt.close()
    ref_opt.close()
