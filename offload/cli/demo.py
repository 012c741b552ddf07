"""``offload demo``: a small GPT trained with its optimizer states on disk, checked against torch.

The user's first contact with the engine. It trains a byte-level decoder (offload.demo) for a
few dozen steps with ``offload.AdamW(..., offload="nvme")`` under a host-memory budget smaller
than the optimizer states, shows a progress bar, the loss and tokens/s, the optimizer's own
memory report and step-time breakdown, then reruns the same steps with
``torch.optim.AdamW`` from the same seed and prints the two loss curves side by side. The
exit status is 1 when they disagree beyond ``--rtol``, so the demo is also a test.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from ._args import byte_size, count, distinct_outputs, integer, rate, tolerance
from ._outcome import BadUsage

__all__ = ["add_parser", "run"]

# A tiny model gains nothing from a second torch thread, and on a busy machine threads
# that wait for each other make each step many times slower: --quick uses one.
# Training is chaotic: two optimizers that differ by rounding (ours vs torch's, or torch's
# fused vs single-tensor paths) give nearly equal losses for the first steps, and a loss
# spike later amplifies the difference by orders of magnitude. The first steps are the test.
# (The figures: bench/RESULTS.md, "Figures that were in code comments".)
DEFAULT_COMPARE = 10
QUICK = dict(params=500_000, steps=6, batch_size=4, seq_len=64, threads=1)


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="train a small GPT with optimizer states on disk and check it against torch.optim.AdamW",
        description="Train a small byte-level GPT for a few dozen steps with offload.AdamW "
                    "(states in NVMe swap files under a host-memory budget), then rerun the same "
                    "steps with torch.optim.AdamW from the same seed and compare the losses. "
                    "Exit status 1 if they differ by more than --rtol.",
    )
    p.add_argument("--steps", type=integer(1), default=None, help="training steps (default 30; --quick: 6)")
    p.add_argument("--params", type=count(10_000, " (the smallest decoder the demo builds)"), default=None,
                   metavar="N",
                   help="model size, e.g. 5M, 50M, 1e8 (default 10M; --quick: 500K)")
    p.add_argument("--offload", choices=("nvme", "cpu"), default="nvme",
                   help="where the optimizer states live (default nvme)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs (default cpu)")
    p.add_argument("--swap-dir", default=None, metavar="DIR",
                   help="directory in which a temporary swap directory is made and removed "
                        "(default /var/tmp unless it is tmpfs, else the current directory)")
    p.add_argument("--max-host-bytes", type=byte_size(minimum=1), default=None, metavar="BYTES",
                   help="bound on the optimizer's host buffers, e.g. 64MiB "
                        "(default a quarter of the optimizer states)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--batch-size", type=integer(1), default=None, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=integer(1), default=None, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=rate(), default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--compare-steps", type=integer(0), default=None, metavar="N",
                   help="first steps rerun with torch.optim.AdamW for the comparison (default 10, at most "
                        "--steps; 0: skip). Later steps drift apart by amplified rounding (a loss spike "
                        "turns 1e-7 into 1e-5), which says nothing about the optimizer")
    p.add_argument("--rtol", type=tolerance(), default=1e-5, help="tolerance of the loss comparison (default 1e-5)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw loss and memory per step (matplotlib)")
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="write one JSON line per step (read by `offload report FILE`)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary as JSON to FILE")
    p.add_argument("--threads", type=integer(1), default=None, metavar="N",
                   help="torch intra-op threads (default torch's own; --quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny model for a few steps (a few seconds; what the tests run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


# ----------------------------------------------------------------------------- display helpers
def _fmt_bytes(n: Optional[float]) -> str:
    from offload.plan.render import fmt_bytes

    return fmt_bytes(n)


def _fmt_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _columns() -> int:
    from .bench_io_output import terminal_columns

    return terminal_columns(sys.stderr)


class Progress:
    """A one-line progress bar on stderr; on a non-terminal, a line per ~10 % instead."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self._last_printed = 0

    def update(self, done: int, text: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        width = 24
        filled = int(width * done / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = f"{self.label} [{bar}] {done}/{self.total} {text} eta {eta:4.0f}s"
        if self.tty:
            # cut and padded to one column short of the terminal: a longer line wraps and each
            # "\r" redraw scrolled a new row; a shorter one left the end of the one before
            width = _columns() - 1
            line = line[:width].ljust(width)
            sys.stderr.write("\r" + line + ("\n" if done == self.total else ""))
            sys.stderr.flush()
        elif done == self.total or done == 1 or done - self._last_printed >= max(1, self.total // 10):
            self._last_printed = done
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


def _comparison_rows(ours: List[float], ref: List[float]) -> List[str]:
    n = min(len(ours), len(ref))
    idx = list(range(n))
    if n > 12:
        idx = list(range(8)) + [-1] + list(range(n - 3, n))
    lines = [f"  {'step':>4}  {'offload.AdamW':>14}  {'torch AdamW':>14}  {'rel diff':>9}"]
    for i in idx:
        if i < 0:
            lines.append(f"  {'...':>4}")
            continue
        rel = abs(ours[i] - ref[i]) / max(abs(ref[i]), 1e-12)
        lines.append(f"  {i + 1:>4}  {ours[i]:>14.6f}  {ref[i]:>14.6f}  {rel:>9.1e}")
    return lines


def _plot(path: str, ours, ref, budget: Optional[int]) -> str:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'offload[plot]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in ours.records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, ours.losses, label=f"offload.AdamW (offload={ours.offload})", lw=2)
    if ref is not None:
        ax1.plot([r.step for r in ref.records], ref.losses, "--", label="torch.optim.AdamW", lw=1.5)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss (nats/byte)")
    ax1.set_title(f"TinyGPT {_fmt_count(ours.model.num_params)} params")
    ax1.legend()
    mib = 2 ** 20
    host = [(r.tiers.get("pinned", 0) + r.tiers.get("pageable", 0)) / mib for r in ours.records]
    nvme = [r.tiers.get("nvme", 0) / mib for r in ours.records]
    rss = [r.rss / mib for r in ours.records]
    ax2.plot(steps, nvme, label="optimizer: NVMe swap files")
    ax2.plot(steps, host, label="optimizer: host buffers")
    ax2.plot(steps, rss, label="process RSS")
    if budget:
        ax2.axhline(budget / mib, color="grey", ls=":", label="max_host_bytes")
    ax2.set_xlabel("step")
    ax2.set_ylabel("MiB")
    ax2.set_title("memory per tier")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _planned_bytes(num_params: int, offload: str, budget: Optional[int]) -> Dict[str, int]:
    """What ``offload.plan.estimate`` says this optimizer holds per tier (fp32 CPU params)."""
    import torch

    from offload.plan import estimate

    plan = estimate(num_params, offload=offload, param_dtype=torch.float32, param_device="cpu",
                    max_host_bytes=budget if offload == "nvme" else None)
    return dict(plan.optimizer_bytes)


# ----------------------------------------------------------------------------- the command
def run(args) -> int:
    import torch

    from offload.demo.train import DemoConfig

    steps = _chosen(args, "steps")
    cfg = DemoConfig(
        params=_chosen(args, "params"),
        steps=steps,
        batch_size=_chosen(args, "batch_size"),
        seq_len=_chosen(args, "seq_len"),
        lr=args.lr,
        warmup=min(DemoConfig.warmup, max(1, steps // 3)),
        offload=args.offload,
        device=args.device,
        swap_parent=args.swap_dir,
        max_host_bytes=args.max_host_bytes,
        seed=args.seed,
        threads=_chosen(args, "threads"),
    )
    compare_steps = min(cfg.steps, DEFAULT_COMPARE) if args.compare_steps is None else args.compare_steps
    if not 0 <= compare_steps <= cfg.steps:
        raise BadUsage(f"--compare-steps must be between 0 and --steps ({cfg.steps}), got {compare_steps}")
    outputs = [("--json", args.json), ("--plot", args.plot), ("--step-log", args.step_log)]
    distinct_outputs(outputs)
    if args.swap_dir is not None and not os.path.isdir(args.swap_dir):  # (a file there was ENOENT too)
        if os.path.exists(args.swap_dir):
            raise NotADirectoryError(errno.ENOTDIR, "--swap-dir is not a directory", args.swap_dir)
        raise FileNotFoundError(errno.ENOENT, "--swap-dir does not exist", args.swap_dir)
    for option, path in outputs:
        _check_writable_target(option, path)

    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    from ._signals import sigterm_raises

    try:
        # SIGTERM removes the temporary swap directory, as Ctrl-C does: with SIGTERM's default
        # action it stayed under --swap-dir, one level below where `offload clean` looks.
        with sigterm_raises():
            return _run(args, cfg)
    finally:
        torch.set_num_threads(threads_before)  # the demo may run in-process (tests)


def _chosen(args, name: str):
    """The option as given, else --quick's value, else DemoConfig's default. Tested against
    None: ``args.x or default`` turned ``--steps 0`` into a 30-step run."""
    from offload.demo.train import DemoConfig

    value = getattr(args, name)
    if value is not None:
        return value
    return (QUICK if args.quick else {}).get(name, getattr(DemoConfig, name))


def _check_writable_target(option: str, path: Optional[str]) -> None:
    """Refuse an output file whose directory is missing or read-only before training, not
    after minutes of it (``--json /nonexistent/x.json`` failed only at the end)."""
    if path is None:
        return
    if os.path.isdir(path):
        raise IsADirectoryError(21, f"{option}: a directory; name a file", path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(2, f"{option}: the directory for this file does not exist; create it "
                                   "or name a file in an existing directory", path)
    from .bench_io_output import probe_writable

    try:  # os.access says yes to root under /proc and /sys, and ignores a name too long
        probe_writable(path)
    except OSError as exc:
        raise OSError(exc.errno, f"{option}: cannot write this file ({exc.strerror}); name a file in a "
                                 "writable directory", path) from None


def _run(args, cfg) -> int:
    import torch

    compare_steps = min(cfg.steps, DEFAULT_COMPARE) if args.compare_steps is None else args.compare_steps
    show = not args.no_progress
    m = cfg.model_config
    n = m.num_params
    print(f"offload demo: TinyGPT, {n:,} params ({m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, "
          f"tied byte-level head), batch {cfg.batch_size} x {cfg.seq_len} tokens, {cfg.steps} steps on {cfg.device}, "
          f"{torch.get_num_threads()} torch threads")
    budget = _print_budget(cfg, n)

    t0 = time.perf_counter()
    ours = _train_logged(args, cfg, show)
    elapsed = time.perf_counter() - t0
    print(f"\ntrained {cfg.steps} steps in {elapsed:.1f} s: loss {ours.losses[0]:.3f} -> {ours.losses[-1]:.3f}, "
          f"{ours.tokens_per_s:,.0f} tokens/s (steps 2..{cfg.steps})")
    from offload.demo.train import state_bytes

    summary: Dict[str, Any] = {
        "params": n, "steps": cfg.steps, "offload": cfg.offload, "device": cfg.device,
        "losses": ours.losses, "tokens_per_s": ours.tokens_per_s, "seconds": elapsed,
        "max_host_bytes": budget, "state_bytes": state_bytes(n),
    }
    ok = _report_memory(ours, cfg, n, budget, summary)
    ok &= _report_swap_dir(ours, summary)
    ref = None
    if compare_steps:
        ref = _compare(args, cfg, ours, compare_steps, show, summary)
        ok &= summary["compare_passed"]
    if args.plot:
        print(f"plot: {_plot(args.plot, ours, ref, budget)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1, default=str)
    print("demo: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


def _print_budget(cfg, n: int) -> Optional[int]:
    """Say where the optimizer states go; returns the host budget (nvme) or None."""
    from offload.demo.train import default_max_host_bytes, default_swap_parent, filesystem_type, state_bytes, \
        swapped_bytes

    if cfg.offload != "nvme":
        print(f"optimizer: offload.AdamW(offload=\"{cfg.offload}\"), fp32 states in host memory "
              f"({_fmt_bytes(state_bytes(n))})")
        return None
    parent = cfg.swap_parent or default_swap_parent()
    budget = cfg.max_host_bytes if cfg.max_host_bytes is not None else default_max_host_bytes(n)
    swapped = swapped_bytes(n)
    print(f"optimizer: offload.AdamW(offload=\"nvme\"), swap files in a temporary directory under {parent} "
          f"({filesystem_type(parent) or 'unknown fs'})")
    print(f"host budget: max_host_bytes = {_fmt_bytes(budget)}, "
          f"{'smaller' if budget < swapped else 'NOT smaller'} than the swapped states "
          f"(exp_avg + exp_avg_sq = {_fmt_bytes(swapped)}; the fp32 params are their own master)")
    return budget


def _train_logged(args, cfg, show: bool):
    """Train with offload.AdamW behind a progress bar; write the step log if asked."""
    from offload.demo.train import run as train
    from offload.plan import StepLogger

    logger = StepLogger(args.step_log) if args.step_log else None
    bar = Progress(cfg.steps, "train", show)

    def on_step(rec) -> None:
        bar.update(rec.step, f"loss {rec.loss:6.3f} {rec.tokens_per_s:8,.0f} tok/s "
                             f"step {rec.seconds:5.2f}s (opt {rec.opt_seconds:5.2f}s)")

    ours = train(cfg, "offload", on_step=on_step)
    if logger is not None:
        for rec in ours.records:
            phases = {k: v for k, v in rec.phases.items() if k not in ("step", "overlap_efficiency")}
            logger.log(rec.step, phases=phases, step_s=rec.phases.get("step", rec.opt_seconds),
                       overlap_efficiency=rec.phases.get("overlap_efficiency"), bytes=rec.tiers, rss=rec.rss,
                       loss=rec.loss, tokens_per_s=rec.tokens_per_s, iteration_s=rec.seconds)
        logger.close()
    return ours


def _report_memory(ours, cfg, n: int, budget: Optional[int], summary: Dict[str, Any]) -> bool:
    """The optimizer's memory report, the planner's figure next to it, the budget check."""
    from offload.plan import format_memory_report

    if ours.memory_report is None:
        return True
    print()
    print(format_memory_report(ours.memory_report))
    tiers = ours.memory_report["tiers"]
    host = tiers["pinned"] + tiers["pageable"]
    summary["memory_report"] = ours.memory_report
    if cfg.device == "cpu":
        planned = _planned_bytes(n, cfg.offload, budget)
        summary["planned_bytes"] = planned
        print("  planner (`offload plan`) for this configuration: "
              + ", ".join(f"{t} {_fmt_bytes(planned[t])}" for t in ("pinned", "pageable", "nvme")))
    if budget is None:
        return True
    within = host <= budget
    print(f"  host buffers {_fmt_bytes(host)} {'<=' if within else '>'} max_host_bytes "
          f"{_fmt_bytes(budget)}: {'OK' if within else 'OVER BUDGET'}; "
          f"states on disk {_fmt_bytes(tiers['nvme'])} (allocated in the swap files: "
          f"{_fmt_bytes(ours.swap_bytes_on_disk)})")
    return within


def _report_swap_dir(ours, summary: Dict[str, Any]) -> bool:
    """The step-time breakdown, and whether the swap directory was removed without leftovers."""
    from offload.plan import format_step_stats

    if ours.step_stats is not None:
        print()
        print(format_step_stats(ours.step_stats))
        summary["step_stats"] = ours.step_stats
    if ours.swap_dir is None:
        return True
    cleaned = not ours.leftover_files
    summary["swap_dir"] = ours.swap_dir
    summary["swap_cleaned"] = cleaned
    print(f"swap directory {ours.swap_dir}: "
          + ("removed, nothing left behind" if cleaned else f"files left behind: {ours.leftover_files}"))
    return cleaned


def _compare(args, cfg, ours, compare_steps: int, show: bool, summary: Dict[str, Any]):
    """Rerun the first steps with torch.optim.AdamW and compare the losses; returns its run."""
    from offload.demo.train import compare_losses, run as train

    print(f"\nrerunning the first {compare_steps} steps with torch.optim.AdamW(foreach=False), same seed and batches")
    bar = Progress(compare_steps, "torch", show)
    ref = train(cfg, "torch", steps=compare_steps,
                on_step=lambda r: bar.update(r.step, f"loss {r.loss:6.3f} {r.tokens_per_s:8,.0f} tok/s"))
    worst, passed = compare_losses(ours.losses, ref.losses, rtol=args.rtol)
    print("\n".join(_comparison_rows(ours.losses, ref.losses)))
    print(f"max relative difference over {compare_steps} steps: {worst:.2e} (rtol {args.rtol:g}): "
          f"{'PASS' if passed else 'FAIL'}")
    print(f"throughput: offload.AdamW(offload=\"{cfg.offload}\") {ours.tokens_per_s:,.0f} tokens/s, "
          f"torch.optim.AdamW in RAM {ref.tokens_per_s:,.0f} tokens/s "
          f"({ours.tokens_per_s / max(ref.tokens_per_s, 1e-12):.2f}x)")
    summary.update(torch_losses=ref.losses, max_rel_diff=worst, compare_passed=passed,
                   torch_tokens_per_s=ref.tokens_per_s)
    return ref
