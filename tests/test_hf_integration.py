"""offload.integrations.hf: Trainer / accelerate gradient accumulation without a grad copy per
micro-batch, grads_already_averaged under DDP, grad_norm in the Trainer's logs (issue 17)."""
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.nn as nn

import offload
from offload.integrations import hf
from stream_emulation import Emulation
from _lazy import lazy_import

accelerate = lazy_import("accelerate")  # on first use: tests/_lazy.py
transformers = lazy_import("transformers")


def _reset_accelerate():
    # accelerate keeps its state in process-wide singletons; each run starts from none.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    _reset_accelerate()
    yield
    _reset_accelerate()


@pytest.fixture
def emu(monkeypatch):
    with Emulation().install(monkeypatch) as e:
        yield e


def test_imports_without_transformers_and_accelerate():
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['accelerate'] = None\n"
            "import offload.integrations.hf as hf, torch, offload\n"
            "opt = offload.AdamW(torch.nn.Linear(2, 2).parameters())\n"
            "try:\n    hf.follow_accumulation(opt, torch.nn.Linear(2, 2))\n"
            "except ImportError as e:\n    assert 'pip install accelerate' in str(e), e\n"
            "else:\n    raise SystemExit('no ImportError')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(33, 65), nn.SiLU(), nn.Linear(65, 1))

    def forward(self, x, labels=None):
        out = self.body(x).squeeze(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out} if labels is not None else out


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 33, generator=g), torch.randn(4, generator=g)) for _ in range(n)]


def _accelerate_run(follow: bool, emu):
    from accelerate import Accelerator

    acc = Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = Net()
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload="cpu")
    model, opt = acc.prepare(model, opt)
    sync = hf.follow_accumulation(opt, model) if follow else None
    for x, y in _batches(8):  # two accumulation windows of 4 micro-batches
        with acc.accumulate(model):
            acc.backward(model(x, y)["loss"])
            opt.step()
            opt.zero_grad()
        if sync is not None:
            assert sync.accumulating == (not acc.sync_gradients)
    if sync is not None:
        sync.remove()
    params = [p.detach().clone() for p in model.parameters()]
    offload_opt = hf.offload_optimizer(opt)
    offload_opt.close()
    _reset_accelerate()
    return params


def test_accelerate_accumulate_copies_each_grad_once(emu):
    trainable = len(list(Net().parameters()))
    before = emu.queued["grad"]
    plain = _accelerate_run(False, emu)
    per_micro_batch = emu.queued["grad"] - before
    assert per_micro_batch == 8 * trainable  # what accelerate alone costs: a copy per micro-batch
    before = emu.queued["grad"]
    followed = _accelerate_run(True, emu)
    assert emu.queued["grad"] - before == 2 * trainable  # once per accumulation window
    for a, b in zip(followed, plain):
        assert torch.equal(a, b)  # the same accumulated grads reach the step


def test_two_followers_of_one_optimizer_leave_no_sync_as_one_does(emu):
    # Each no_sync() restores the flag it found: two followers (follow_accumulation twice, the
    # callback attached twice) left it in the order they entered it, and the optimizer stayed
    # inside no_sync() for good: no grad copied in backward any more, after the first window.
    from accelerate import Accelerator

    acc = Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = Net()
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload="cpu")
    model, opt = acc.prepare(model, opt)
    followers = [hf.follow_accumulation(opt, model), hf.follow_accumulation(opt, model)]
    trainable = len(list(model.parameters()))
    before = emu.queued["grad"]
    for i, (x, y) in enumerate(_batches(8)):  # two accumulation windows of 4 micro-batches
        with acc.accumulate(model):
            acc.backward(model(x, y)["loss"])
            assert emu.queued["grad"] - before == trainable * ((i + 1) // 4)  # copied by the window's last
            opt.step()
            opt.zero_grad()
    for f in followers:
        f.remove()
    x, y = _batches(1)[0]
    model(x, y)["loss"].backward()  # outside accumulate and without followers: copied at once
    assert emu.queued["grad"] - before == 3 * trainable
    params = [p.detach().clone() for p in model.parameters()]  # (the backward above was not stepped)
    hf.offload_optimizer(opt).close()
    _reset_accelerate()
    for a, b in zip(params, _accelerate_run(True, emu)):  # one follower
        assert torch.equal(a, b)


def _trainer(callbacks, tmp_path, accumulation=4, max_steps=2):
    from transformers import Trainer, TrainingArguments

    model = Net()
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload="cpu", max_grad_norm=0.5)
    data = [{"x": x[0], "labels": y[0]} for x, y in _batches(32)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=max_steps,
                             gradient_accumulation_steps=accumulation, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, max_grad_norm=0.0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None), callbacks=callbacks)
    trainer.train()
    opt.close()
    return model, trainer


def test_trainer_accumulation_copies_each_grad_once(emu, tmp_path):
    trainable = len(list(Net().parameters()))
    before = emu.queued["grad"]
    plain, _ = _trainer([], tmp_path)
    assert emu.queued["grad"] - before == 2 * 4 * trainable
    before = emu.queued["grad"]
    followed, trainer = _trainer([hf.OffloadCallback()], tmp_path)
    assert emu.queued["grad"] - before == 2 * trainable
    for a, b in zip(followed.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, hf.OffloadCallback))
    assert cb._sync is None  # removed at the end of training: the optimizer is not left inside no_sync


def test_trainer_logs_the_optimizers_grad_norm(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model = Net()
    opt = offload.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
    x, y = _batches(1)[0]
    model(x, y)["loss"].backward()
    opt.step()
    cb, state, control = hf.OffloadCallback(), TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control, model=model, optimizer=opt)
    state.global_step = 1
    state.log_history.append({"loss": 1.0, "step": 1})
    logs = {"loss": 1.0}
    cb.on_log(args, state, control, logs=logs)
    assert logs["grad_norm"] == opt.last_grad_norm and state.log_history[-1]["grad_norm"] == opt.last_grad_norm
    theirs = {"loss": 1.0, "grad_norm": 7.0}
    cb.on_log(args, state, control, logs=theirs)
    assert theirs["grad_norm"] == 7.0  # the Trainer's own is kept
    evaluation = {"eval_loss": 2.0}
    cb.on_log(args, state, control, logs=evaluation)
    assert "grad_norm" not in evaluation
    opt.close()


def test_trainer_run_logs_grad_norm_each_step(tmp_path):
    _, trainer = _trainer([hf.OffloadCallback()], tmp_path, accumulation=1, max_steps=3)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]
    assert len(norms) == 3 and all(n > 0 for n in norms)


def test_attach_puts_the_callback_before_the_loggers(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    seen = []

    class Logger(TrainerCallback):  # stands for a report_to logger: added before user callbacks
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    model = Net()
    opt = offload.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=[], optimizers=(opt, None), callbacks=[Logger()])
    cb = hf.OffloadCallback.attach(trainer)
    assert trainer.callback_handler.callbacks[0] is cb
    cb.on_train_begin(args, trainer.state, trainer.control, model=model, optimizer=opt)
    x, y = _batches(1)[0]
    model(x, y)["loss"].backward()
    opt.step()
    trainer.state.global_step = 1
    trainer.log({"loss": 1.0})
    assert seen[-1]["grad_norm"] == opt.last_grad_norm
    opt.close()


def test_trainer_ddp_sets_grads_already_averaged():
    from transformers.training_args import ParallelMode

    ddp = types.SimpleNamespace(world_size=2, parallel_mode=ParallelMode.DISTRIBUTED, deepspeed=None, fsdp=None)
    assert hf._trainer_wraps_in_ddp(ddp)
    assert not hf._trainer_wraps_in_ddp(types.SimpleNamespace(**{**vars(ddp), "fsdp": "full_shard"}))
    assert not hf._trainer_wraps_in_ddp(types.SimpleNamespace(**{**vars(ddp), "world_size": 1}))


def test_follow_accumulation_under_ddp(monkeypatch, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        monkeypatch.setattr(hf, "_ddp_world", lambda: 2)  # as with torchrun: several ranks
        model = Net()
        opt = offload.AdamW(model.parameters(), lr=1e-2, stage=0)
        hf.follow_accumulation(opt, nn.parallel.DistributedDataParallel(model)).remove()
        assert opt.grads_already_averaged is True
        opt2 = offload.AdamW(model.parameters(), lr=1e-2, stage=0)
        with pytest.warns(UserWarning, match="not DDP-wrapped.*grads_already_averaged"):
            hf.follow_accumulation(opt2, model).remove()
        assert not getattr(opt2, "grads_already_averaged", False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            monkeypatch.setattr(hf, "_ddp_world", lambda: 1)
            hf.follow_accumulation(opt2, model).remove()  # one rank: nothing to say
    finally:
        dist.destroy_process_group()


def test_bad_arguments():
    with pytest.raises(TypeError, match="needs an offload optimizer"):
        hf.follow_accumulation(torch.optim.SGD(Net().parameters(), lr=1.0), Net())
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        hf.follow_accumulation(offload.AdamW(Net().parameters()), "model")
