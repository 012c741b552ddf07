"""OffloadCallback(checkpoint=True): Trainer checkpoints hold the optimizer as a streamed
checkpoint (no optimizer.pt), and resume_from_checkpoint continues bit for bit (issue 17, s.1)."""
import json
import os

import pytest
import torch
import torch.nn as nn

import offload
from offload.integrations import hf
from offload.integrations.hf_checkpoint import GROUPS_FILE, STATES_DIR
from offload.swap import fsutil
from _lazy import lazy_import

transformers = lazy_import("transformers")  # on first use: tests/_lazy.py


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # Dropout: the resumed run must also continue the RNG where the first one saved it.
        self.body = nn.Sequential(nn.Linear(33, 65), nn.Dropout(0.3), nn.SiLU(), nn.Linear(65, 1))

    def forward(self, x, labels=None):
        out = self.body(x).squeeze(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


def _data():
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(33, generator=g), "labels": torch.randn((), generator=g)} for _ in range(48)]


def _train(out, offload_kw, resume=None, save_only_model=True):
    from transformers import Trainer, TrainingArguments

    model = Net()
    opt = offload.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, **offload_kw)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, save_steps=3, save_only_model=save_only_model, lr_scheduler_type="cosine",
                             warmup_steps=2, report_to=[], use_cpu=True, logging_steps=1, max_grad_norm=0.0,
                             disable_tqdm=True, seed=3)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), optimizers=(opt, None),
                      callbacks=[hf.OffloadCallback(checkpoint=True)])
    trainer.train(resume_from_checkpoint=resume)
    final = [p.detach().clone() for p in model.parameters()]
    moments = {k: v for k, v in opt.state_dict()["state"].items()}
    lrs = [(h["step"], h["loss"], h["learning_rate"], h["grad_norm"]) for h in trainer.state.log_history
           if "loss" in h]
    opt.close()
    return final, moments, lrs


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_trainer_resume_is_bit_for_bit(tmp_path, where):
    def kw(name):
        if where == "cpu":
            return {"offload": "cpu"}
        (tmp_path / name).mkdir()
        return {"offload": "nvme", "swap_dir": str(tmp_path / name)}

    full, full_moments, full_lrs = _train(tmp_path / "out", kw("swap_a"))
    ckpt = tmp_path / "out" / "checkpoint-3"
    assert (ckpt / STATES_DIR).is_dir() and (ckpt / "rng_state.pth").is_file()
    assert not (ckpt / "optimizer.pt").exists()  # nothing pulled every state into one torch.save
    resumed, moments, lrs = _train(tmp_path / "out", kw("swap_b"), resume=str(ckpt))
    # The history holds the first run's steps 1-3 (from trainer_state.json) and steps 4-6 of
    # this one: the same losses, learning rates (the schedule) and grad norms.
    assert lrs == full_lrs and [s for s, *_ in lrs] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, full):
        assert torch.equal(a, b)
    for i, st in full_moments.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(moments[i][key], st[key]), (i, key)


def test_checkpoint_needs_save_only_model(tmp_path):
    with pytest.raises(ValueError, match=r"needs TrainingArguments\(save_only_model=True\)"):
        _train(tmp_path / "out", {"offload": "cpu"}, save_only_model=False)


def test_resume_without_streamed_checkpoint_says_where(tmp_path):
    _train(tmp_path / "out", {"offload": "cpu"})
    ckpt = tmp_path / "out" / "checkpoint-3"
    import shutil

    shutil.rmtree(ckpt / STATES_DIR)
    with pytest.raises(FileNotFoundError) as info:
        _train(tmp_path / "out", {"offload": "cpu"}, resume=str(ckpt))
    assert info.value.filename == os.path.join(str(ckpt), STATES_DIR)


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerate_run(tmp_path, swap, save_at=None, load_from=None, steps=6):
    """Steps 1..steps of an accumulation-2 loop; saves after step `save_at`, or starts from
    `load_from` (the first `save_at`-step run's state) and does the remaining steps."""
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LambdaLR

    _reset_accelerate()
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = Net()
    (tmp_path / swap).mkdir()
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload="nvme", swap_dir=str(tmp_path / swap))
    sched = LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    model, sched = acc.prepare(model, sched)  # the optimizer stays out of prepare
    hf.streamed_accelerate_checkpoints(acc, opt)
    sync = hf.follow_accumulation(opt, model)
    first = 0
    if load_from is not None:
        acc.load_state(load_from)
        first = save_at
    batches = [(d["x"].view(1, -1).repeat(2, 1) + i, d["labels"].view(1).repeat(2)) for i, d in enumerate(_data())]
    for step in range(first, steps):
        for micro in range(2):
            x, y = batches[2 * step + micro]
            with acc.accumulate(model):
                acc.backward(model(x, y)["loss"])
                if acc.sync_gradients:
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        if save_at is not None and load_from is None and step + 1 == save_at:
            acc.save_state(str(tmp_path / "state"))
    sync.remove()
    out = [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"], opt.param_groups[0]["lr"]
    opt.close()
    _reset_accelerate()
    return out


def test_accelerate_save_and_load_state_stream_the_optimizer(tmp_path):
    full, full_state, full_lr = _accelerate_run(tmp_path, "swap_a", save_at=3)
    saved = tmp_path / "state"
    assert (saved / STATES_DIR).is_dir()
    assert not list(saved.glob("optimizer*"))  # accelerate saved no torch.save(state_dict())
    resumed, state, lr = _accelerate_run(tmp_path, "swap_b", save_at=3, load_from=str(saved))
    assert lr == full_lr
    for a, b in zip(resumed, full):
        assert torch.equal(a, b)
    for i, st in full_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[i][key], st[key]), (i, key)
    # the groups file is sealed as the Trainer's is: a changed lr loads nothing
    groups = saved / GROUPS_FILE
    assert fsutil.SEAL in json.loads(groups.read_text())
    groups.write_text(groups.read_text().replace('"lr": 0.01', '"lr": 0.02', 1))
    with pytest.raises(ValueError, match="fails its own checksum"):
        _accelerate_run(tmp_path, "swap_c", save_at=3, load_from=str(saved))


def test_accelerate_refuses_a_prepared_optimizer():
    from accelerate import Accelerator

    _reset_accelerate()
    acc = Accelerator(cpu=True)
    model = Net()
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    prepared = acc.prepare(opt)
    with pytest.raises(TypeError, match="keep it out of accelerator.prepare"):
        hf.streamed_accelerate_checkpoints(acc, prepared)
    with pytest.raises(ValueError, match="went through accelerator.prepare"):
        hf.streamed_accelerate_checkpoints(acc, opt)
    opt.close()
    _reset_accelerate()
