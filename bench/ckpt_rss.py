"""Peak RSS of optimizer checkpoints through HF Trainer and accelerate: streamed against torch.save.

A bf16 model whose optimizer states (fp32 master + exp_avg + exp_avg_sq, 12 B/param) live on
disk (``offload="nvme"``) and are at least twice the process's training RSS trains a few steps
through a real ``transformers.Trainer``; then, in that process:

- (a) Trainer save: ``OffloadCallback(checkpoint=True)`` with ``save_only_model=True`` and
  ``save_steps`` (probe callbacks around it time it and read its peak RSS);
- (a) accelerate save: ``Accelerator.save_state`` with ``streamed_accelerate_checkpoints``;
- (c) ``torch.save(opt.state_dict(), ...)``: what both tools do by default;

and in a fresh process, as a restart would:

- (b) Trainer load: ``trainer.train(resume_from_checkpoint=...)``, then a few more steps;
- (b) accelerate load: ``Accelerator.load_state`` with the same hooks;
- (d) ``opt.load_state_dict(torch.load(...))``: the tools' default load.

Peak RSS is VmHWM after resetting it (``echo 5 > /proc/self/clear_refs``) at the start of
each phase; the training RSS is the highest VmHWM over a training step (forward, backward,
optimizer step), each step measured alone. Target (issue 17): a save or a load peaks at
<= 1.05x the training RSS.

    python bench/ckpt_rss.py --dir /var/tmp/ckpt_rss            # 302M params, 3.6 GB of states

Prints a table and a final JSON line; removes its directory unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GIB = 1 << 30


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


class Window:
    """Peak RSS and seconds from start() to stop()."""

    def start(self) -> None:
        reset_hwm()
        self.before = status_bytes("VmRSS")
        self.t0 = time.perf_counter()

    def stop(self) -> dict:
        return {"peak": status_bytes("VmHWM"), "before": self.before, "seconds": time.perf_counter() - self.t0}


def measured(fn, *a, **kw) -> dict:
    w = Window()
    w.start()
    fn(*a, **kw)
    return w.stop()


class Net(torch.nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16)
                                          for _ in range(layers)])
        for lin in self.body:  # small weights: activations stay finite through the layers
            torch.nn.init.normal_(lin.weight, std=width ** -0.5)

    def forward(self, x, labels=None):
        out = self.body(x).float().mean(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


def data(width: int, n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(width, generator=g).to(torch.bfloat16), "labels": torch.randn((), generator=g)}
            for _ in range(n)]


def probes():
    """Two callbacks: ``pre`` runs before OffloadCallback and ``post`` after it, so the window
    from pre to post holds only the integration's own save or load."""
    from transformers import TrainerCallback

    rec = {"train": [], "trainer_model_save": None, "trainer_save": None, "trainer_load": None}
    win = Window()

    class Pre(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            win.start()

        def on_step_end(self, args, state, control, **kw):
            rec["train"].append(win.stop())
            win.start()  # the Trainer's own save (model, trainer state, RNG) comes next

        def on_save(self, args, state, control, **kw):
            rec["trainer_model_save"] = win.stop()
            win.start()

        def on_train_begin(self, args, state, control, **kw):
            win.start()

    class Post(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            rec["trainer_save"] = win.stop()

        def on_train_begin(self, args, state, control, **kw):
            if state.global_step > 0:
                rec["trainer_load"] = win.stop()

    return Pre(), Post(), rec


def build(a, swap: str):
    import offload

    os.makedirs(swap, exist_ok=True)
    model = Net(a.width, a.layers)
    opt = offload.AdamW(model.parameters(), lr=1e-4, offload="nvme", swap_dir=swap,
                        max_host_bytes=a.host_mib << 20)
    return model, opt


def trainer_run(a, model, opt, max_steps: int, save: bool, resume=None) -> dict:
    from transformers import Trainer, TrainingArguments

    from offload.integrations import hf

    pre, post, rec = probes()
    args = TrainingArguments(output_dir=os.path.join(a.dir, "out"), per_device_train_batch_size=a.batch,
                             max_steps=max_steps, save_strategy="steps" if save else "no", save_steps=a.steps,
                             save_only_model=True, report_to=[], use_cpu=True, logging_steps=1000,
                             disable_tqdm=True, seed=3, lr_scheduler_type="constant")
    trainer = Trainer(model=model, args=args, train_dataset=data(a.width, a.batch * max_steps),
                      optimizers=(opt, None), callbacks=[pre, hf.OffloadCallback(checkpoint=True), post])
    trainer.train(resume_from_checkpoint=resume)
    return rec


def accelerate_with_hooks(opt):
    from accelerate import Accelerator

    from offload.integrations.hf import streamed_accelerate_checkpoints

    acc = Accelerator(cpu=True)
    streamed_accelerate_checkpoints(acc, opt)
    return acc


def torch_save(opt, path: str) -> None:
    sd = opt.state_dict()
    torch.save(sd, path)
    del sd


def torch_load(opt, path: str) -> None:
    opt.load_state_dict(torch.load(path, weights_only=True))


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def phase_save(a) -> dict:
    model, opt = build(a, os.path.join(a.dir, "swap_a"))
    out = {"params": sum(p.numel() for p in model.parameters()), "rss_built": status_bytes("VmRSS")}
    rec = trainer_run(a, model, opt, a.steps, save=True)
    out.update(train=rec["train"], trainer_model_save=rec["trainer_model_save"], trainer_save=rec["trainer_save"])
    acc = accelerate_with_hooks(opt)
    out["accelerate_save"] = measured(acc.save_state, os.path.join(a.dir, "acc"))
    out["torch_save"] = measured(torch_save, opt, os.path.join(a.dir, "optimizer.pt"))
    out["torch_file_bytes"] = os.path.getsize(os.path.join(a.dir, "optimizer.pt"))
    out["streamed_bytes"] = tree_bytes(os.path.join(a.dir, "out", f"checkpoint-{a.steps}", "offload_states"))
    opt.close()
    return out


def phase_load(a) -> dict:
    model, opt = build(a, os.path.join(a.dir, "swap_b"))
    ckpt = os.path.join(a.dir, "out", f"checkpoint-{a.steps}")
    rec = trainer_run(a, model, opt, a.steps + a.more, save=False, resume=ckpt)
    out = {"train": rec["train"], "trainer_load": rec["trainer_load"]}
    acc = accelerate_with_hooks(opt)
    out["accelerate_load"] = measured(acc.load_state, os.path.join(a.dir, "acc"))
    out["torch_load"] = measured(torch_load, opt, os.path.join(a.dir, "optimizer.pt"))
    opt.close()
    return out


def child(a) -> None:
    torch.set_num_threads(a.threads)
    out = phase_save(a) if a.phase == "save" else phase_load(a)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(a, phase: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--dir", a.dir, "--width", str(a.width),
           "--layers", str(a.layers), "--steps", str(a.steps), "--more", str(a.more), "--batch", str(a.batch),
           "--host-mib", str(a.host_mib), "--threads", str(a.threads)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the {phase} process failed (exit {proc.returncode})")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    res["process_seconds"] = time.perf_counter() - t
    return res


def report(save: dict, load: dict) -> dict:
    n = save["params"]
    train_a = max(r["peak"] for r in save["train"])
    train_b = max(r["peak"] for r in load["train"])
    rows = [("Trainer save, streamed (OffloadCallback)", save["trainer_save"], train_a),
            ("accelerate save_state, streamed (hooks)", save["accelerate_save"], train_a),
            ("torch.save(opt.state_dict())", save["torch_save"], train_a),
            ("Trainer resume, streamed (OffloadCallback)", load["trainer_load"], train_b),
            ("accelerate load_state, streamed (hooks)", load["accelerate_load"], train_b),
            ("opt.load_state_dict(torch.load(...))", load["torch_load"], train_b),
            ("(Trainer's own model save, not ours)", save["trainer_model_save"], train_a)]
    print(f"params {n / 1e6:.1f}M bf16; optimizer states 12 B/param = {12 * n / GIB:.2f} GiB; training RSS "
          f"(peak of a step) {train_a / GIB:.2f} GiB in the save process, {train_b / GIB:.2f} GiB in the load "
          f"process; states / training RSS = {12 * n / train_a:.2f}")
    print(f"files: streamed {save['streamed_bytes'] / GIB:.2f} GiB, torch.save {save['torch_file_bytes'] / GIB:.2f} GiB")
    print(f"{'what':44s} {'peak RSS GiB':>12s} {'/ training':>10s} {'+MiB':>7s} {'seconds':>8s}")
    result = {"params": n, "states_bytes": 12 * n, "train_rss_save": train_a, "train_rss_load": train_b,
              "states_over_train_rss": round(12 * n / train_a, 3), "torch_file_bytes": save["torch_file_bytes"],
              "streamed_bytes": save["streamed_bytes"],
              "train_step_seconds": [round(r["seconds"], 2) for r in save["train"] + load["train"]], "rows": {}}
    for name, r, base in rows:
        extra = (r["peak"] - r["before"]) / (1 << 20)  # above the RSS at the start of the window
        print(f"{name:44s} {r['peak'] / GIB:12.2f} {r['peak'] / base:10.3f} {extra:7.0f} {r['seconds']:8.2f}")
        result["rows"][name] = {"peak": r["peak"], "ratio": round(r["peak"] / base, 3), "extra_mib": round(extra),
                                "seconds": round(r["seconds"], 2)}
    result["process_seconds"] = [round(save["process_seconds"], 1), round(load["process_seconds"], 1)]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp/ckpt_rss", help="swap and checkpoint dirs (removed at the end)")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=18, help="bf16 Linear(width, width) layers, no bias")
    p.add_argument("--steps", type=int, default=2, help="training steps before the save")
    p.add_argument("--more", type=int, default=1, help="training steps after the resume")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--host-mib", type=int, default=64, help="max_host_bytes of the optimizer, MiB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep --dir")
    p.add_argument("--phase", choices=["save", "load"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase:
        return child(a)
    if os.path.exists(a.dir):
        raise SystemExit(f"{a.dir} exists: remove it or pass another --dir")
    os.makedirs(a.dir)
    try:
        save = run_child(a, "save")
        load = run_child(a, "load")
        print("JSON " + json.dumps(report(save, load)))
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
