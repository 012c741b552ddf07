"""OffloadCallback(checkpoint=True) when a job dies while the optimizer is being saved, and
when the Trainer resumes from a checkpoint the callback would not look in.

- The Trainer deletes old checkpoints (save_total_limit) before the callback's on_save saves
  the optimizer: a job killed in between kept only a checkpoint without one. The callback
  now applies the limit itself after its save, and a resume from the unfinished checkpoint
  names the newest whole one.
- The callback loads ``output_dir/checkpoint-<step>``; resumed from a directory elsewhere,
  with a checkpoint of the same step from another run in output_dir, it loaded that run's
  moments without a word. The weights' fingerprint saved with the states now refuses it."""
import os

import pytest
import torch

import offload
from offload.integrations import hf
from offload.integrations.hf_checkpoint import GROUPS_FILE, STATES_DIR

from test_hf_checkpoint import Net, _data
from _lazy import lazy_import

transformers = lazy_import("transformers")  # on first use: tests/_lazy.py


class Died(Exception):
    pass


def _trainer(out, seed=3, limit=None, die_at=None, resume_from=None, **cb):
    from transformers import Trainer, TrainingArguments

    model = Net()
    if seed != 3:
        torch.manual_seed(seed)
        for p in model.parameters():
            p.data.normal_()
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload="cpu")
    if die_at is not None:
        save = opt.save_checkpoint

        def dying_save(directory):  # the process dies inside the streamed save at step die_at
            if str(directory).endswith(f"checkpoint-{die_at}{os.sep}{STATES_DIR}"):
                os.makedirs(directory, exist_ok=True)
                raise Died()
            save(directory)

        opt.save_checkpoint = dying_save
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=6, save_steps=2,
                             save_total_limit=limit, save_only_model=True, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=seed, logging_steps=1)
    callback = hf.OffloadCallback(checkpoint=True, resume_from=resume_from, **cb)
    return Trainer(model=model, args=args, train_dataset=_data(), optimizers=(opt, None), callbacks=[callback]), opt


def test_a_job_killed_while_saving_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "out"
    trainer, opt = _trainer(out, limit=1, die_at=4)
    with pytest.raises(Died):
        trainer.train()
    assert trainer.args.save_total_limit is None  # held by the callback for the run (it died)
    # step 2's whole checkpoint is still there; step 4's has the model but no optimizer
    assert (out / "checkpoint-2" / GROUPS_FILE).is_file()
    assert (out / "checkpoint-4").is_dir() and not (out / "checkpoint-4" / GROUPS_FILE).exists()
    opt.close()
    # the Trainer's resume_from_checkpoint=True takes checkpoint-4: the callback names step 2's
    trainer, opt = _trainer(out, limit=1)
    with pytest.raises(FileNotFoundError, match="resume from .*checkpoint-2") as info:
        trainer.train(resume_from_checkpoint=True)
    assert "nothing was loaded" in str(info.value)
    opt.close()
    trainer, opt = _trainer(out, limit=1)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert trainer.state.global_step == 6 and trainer.args.save_total_limit == 1  # given back
    assert sorted(os.listdir(out)) == ["checkpoint-6"]  # the limit, applied after each whole save
    opt.close()


def test_the_limit_keeps_whole_checkpoints_only_after_the_save(tmp_path):
    out = tmp_path / "out"
    trainer, opt = _trainer(out, limit=2)
    trainer.train()
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6"]
    assert all((out / c / GROUPS_FILE).is_file() for c in ("checkpoint-4", "checkpoint-6"))
    assert trainer.args.save_total_limit == 2
    opt.close()


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    trainer, opt = _trainer(tmp_path / "a")  # the run to resume: its checkpoints in a/
    trainer.train()
    opt.close()
    trainer, opt = _trainer(tmp_path / "b", seed=11)  # another run's checkpoints in b/
    trainer.train()
    opt.close()
    # resumed from a/checkpoint-4 with output_dir b/: the callback would read b/checkpoint-4
    trainer, opt = _trainer(tmp_path / "b")
    with pytest.raises(ValueError, match="saved with other weights than the model the Trainer resumed"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    opt.close()
    # told where, it loads that run's states
    trainer, opt = _trainer(tmp_path / "b", resume_from=str(tmp_path / "a" / "checkpoint-4"))
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    assert trainer.state.global_step == 6
    opt.close()
    # and the check can be waived
    trainer, opt = _trainer(tmp_path / "b", verify_weights=False)
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    opt.close()


def test_a_train_interrupted_in_the_process_gives_its_held_limit_back_on_the_next(tmp_path):
    # The callback holds save_total_limit for a run and gives it back in on_train_end, which a
    # train() that raised (Ctrl-C in a notebook) never reached: the next train() of the same
    # Trainer found None, and kept every checkpoint.
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt

    out = tmp_path / "out"
    trainer, opt = _trainer(out, limit=2)
    interrupt = Interrupt()
    trainer.add_callback(interrupt)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    trainer.remove_callback(interrupt)
    trainer.train(resume_from_checkpoint=True)  # from checkpoint-2, in the same process
    assert trainer.state.global_step == 6 and trainer.args.save_total_limit == 2
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6"]
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, hf.OffloadCallback))
    assert cb._limit is None and cb._sync is None
    resumed = [p.detach().clone() for p in trainer.model.parameters()]
    opt.close()
    trainer, opt = _trainer(tmp_path / "straight", limit=2)
    trainer.train()
    for a, b in zip(resumed, trainer.model.parameters()):
        assert torch.equal(a, b)
    opt.close()
