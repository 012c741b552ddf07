"""Real clients of the optimizer: Hugging Face ``Trainer`` and a plain loop under ``torchrun``.

Each trains the same model twice from the same seed, once with ``offload.AdamW`` and once
with ``torch.optim.AdamW(foreach=False)`` (the reference of the numerics contract), and
requires the loss of every step, and the final weights, to agree within rtol 1e-5.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import offload

RTOL = 1e-5
# Final weights after a whole training run: a few elements, such as the key biases of
# attention, have a gradient that is zero in exact arithmetic (softmax ignores a shift of all
# scores) and only rounding noise in practice; Adam normalises that noise into steps of
# about lr, so those elements agree only to a small fraction of lr, not to 1e-6.
PARAM_ATOL = 1e-5


# ----------------------------------------------------------------------------- HF Trainer
def _hf_run(tmp_path, make_optimizer, tag):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install 'offload[test]')")
    pytest.importorskip("accelerate", reason="accelerate not installed (Trainer needs it; pip install 'offload[test]')")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from offload.demo.corpus import Batches

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    # A tiny GPT-2 built from a config: nothing is downloaded. Dropout off, so the two runs
    # differ only by their optimizer.
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    batches = Batches(batch_size=16, seq_len=32, seed=0)
    x, _ = batches[0]
    train = [{"input_ids": row, "labels": row} for row in x]  # GPT-2 shifts labels itself

    class RecordingTrainer(Trainer):
        # Trainer's own log rounds the loss to 4 digits: record the exact value of each step.
        losses = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss))
            return loss

    args = TrainingArguments(
        output_dir=str(tmp_path / f"out-{tag}"), per_device_train_batch_size=4, max_steps=8,
        learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear", seed=0, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    optimizer = make_optimizer(model)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=train, optimizers=(optimizer, None))
    trainer.losses = []
    trainer.train()
    if hasattr(optimizer, "close"):
        optimizer.close()
    return trainer.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    """The torch.optim.AdamW run, shared by the parametrised tests below."""
    def reference(model):
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)

    return _hf_run(tmp_path_factory.mktemp("hf-ref"), reference, "torch")


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_hf_trainer_matches_torch_adamw_step_for_step(tmp_path, target, hf_reference):
    swap = tmp_path / "swap"
    swap.mkdir()

    def ours(model):
        extra = {"swap_dir": str(swap), "max_host_bytes": "2MiB"} if target == "nvme" else {}
        return offload.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, offload=target, **extra)

    losses, params = _hf_run(tmp_path, ours, "ours")
    ref_losses, ref_params = hf_reference
    assert len(losses) == len(ref_losses) == 8
    # Trainer's scheduler (linear warm-up and decay) drove our lr: losses move, and match.
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=PARAM_ATOL, msg=lambda m, name=name: f"{name}: {m}")
    assert os.listdir(swap) == []  # close() removed the swap files


# ----------------------------------------------------------------------------- torchrun (gloo)
_DDP_SCRIPT = textwrap.dedent(
    """
    import copy, os, sys
    import torch, torch.distributed as dist
    import offload
    from offload.demo.corpus import Batches
    from offload.demo.model import GPTConfig, TinyGPT

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=2, n_head=2, d_model=48, block_size=32))
    reference = copy.deepcopy(model)
    mode, swap_dir = sys.argv[2], sys.argv[3]
    if mode == "zero2":
        # A plain loop: no DDP wrapper, the optimizer averages the grads across ranks itself
        # (ZeRO stage 2 by default with more than one rank: each rank keeps half the states).
        opt = offload.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, offload="cpu")
    else:
        # stage=0: plain data parallelism, every rank keeps all the states, here in its own
        # swap files (one private directory per rank under swap_dir); grads averaged by hand.
        opt = offload.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, offload="nvme", stage=0,
                            swap_dir=swap_dir, max_host_bytes="2MiB")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    data = Batches(batch_size=4 * world, seq_len=32, seed=0)
    losses, ref_losses = [], []
    for i in range(8):
        x, y = data[i]
        _, loss = model(x.chunk(world)[rank], y.chunk(world)[rank])  # this rank's half of the batch
        loss.backward()
        if mode == "stage0":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        # The single-process reference on the whole batch (every rank runs it; it is tiny).
        _, ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref_flat = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        torch.save({"losses": losses, "ref_losses": ref_losses, "params": gathered, "ref": ref_flat,
                    "stage": opt.stage, "world": world}, sys.argv[1])
    opt.close()
    dist.destroy_process_group()
    # gloo's C++ worker threads sometimes abort the interpreter's teardown ("terminate called
    # without an active exception", SIGABRT, in about 1 run in 6 here with torch.optim alone
    # too; see pytorch/pytorch PR 179291): leave without it, the results are on disk.
    sys.stdout.flush()
    os._exit(0)
    """
)


@pytest.mark.parametrize("mode", ["zero2", "stage0"])
def test_torchrun_two_ranks_gloo_matches_torch_adamw(tmp_path, mode):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    script = tmp_path / "loop.py"
    script.write_text(_DDP_SCRIPT)
    out = tmp_path / "result.pt"
    swap = tmp_path / "swap"
    swap.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(offload.__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(out), mode, str(swap)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = torch.load(out)
    assert r["world"] == 2 and r["stage"] == (2 if mode == "zero2" else 0)
    assert os.listdir(swap) == []  # each rank's swap files were removed by close()
    assert r["losses"][-1] < r["losses"][0]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=RTOL, atol=0)
    # Both ranks hold the same weights, equal to the single-process reference.
    torch.testing.assert_close(r["params"][1], r["params"][0], rtol=0, atol=0)
    torch.testing.assert_close(r["params"][0], r["ref"], rtol=RTOL, atol=PARAM_ATOL)
