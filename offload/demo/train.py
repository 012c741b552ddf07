"""The demo's training loop: the same few dozen steps with our optimizer and with torch's.

``run(cfg, optimizer="offload"|"torch", on_step=...)`` builds the model and the data from
``cfg.seed`` alone, so two runs see the same initial weights and the same batches, and the
only difference left between them is the optimizer. That is what makes the loss comparison
at the end of ``offload demo`` a test of the engine rather than of luck: with dropout off,
a fixed thread count and ``torch.optim.AdamW(foreach=False)`` as the reference, the losses of
the two runs agree to about 1e-7 for the first steps and drift only by rounding later.

The loop is a plain torch loop (forward, backward, ``opt.step()``, ``opt.zero_grad()``,
``scheduler.step()``): the point of the engine is that nothing else changes.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.demo.corpus import Batches
from offload.swap.fstype import filesystem_type
from offload.demo.model import GPTConfig, TinyGPT, config_for_params
from offload.swap import cleanup

__all__ = [
    "DemoConfig", "StepRecord", "RunResult", "run", "compare_losses", "default_swap_parent",
    "filesystem_type", "state_bytes", "swapped_bytes", "default_max_host_bytes",
]

# Bytes of optimizer state per fp32 param: master (the param itself here), exp_avg, exp_avg_sq.
STATE_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class DemoConfig:
    """Everything that decides a demo run; the defaults are ``offload demo``'s."""

    params: int = 10_000_000
    """Target parameter count; the model shape comes from ``config_for_params``."""
    steps: int = 30
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    """Peak learning rate, reached after ``warmup`` steps, then cosine decay to 10 %."""
    warmup: int = 5
    betas: Tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    offload: str = "nvme"
    """``"nvme"`` (states in swap files), ``"cpu"`` (host memory) or ``"none"``."""
    device: str = "cpu"
    """Where the model runs: ``"cpu"`` or ``"cuda"``."""
    dtype: str = "float32"
    """The params' dtype: ``"float32"`` (on the CPU they are their own fp32 master) or
    ``"bfloat16"`` (the optimizer keeps fp32 masters: in swap files with ``offload="nvme"``)."""
    swap_parent: Optional[str] = None
    """Directory in which the run's temporary swap directory is made (None: see
    ``default_swap_parent``)."""
    max_host_bytes: Optional[int] = None
    """Bound on the optimizer's host buffers (None: ``default_max_host_bytes``)."""
    seed: int = 0
    threads: Optional[int] = None
    """torch intra-op threads (None: leave torch's default)."""
    state_dtype: str = "float32"
    """Our optimizer's ``state_dtype`` (``"float32"``, ``"bfloat16"``, ``"int8"``)."""
    master_dtype: Optional[str] = None
    """Our optimizer's ``master_dtype`` (``"bfloat16"``: bf16 params are their own master)."""
    torch_impl: str = "single"
    """The ``torch.optim.AdamW`` to run as ``optimizer="torch"``: ``"single"`` (foreach=False,
    the reference of the numerics contract, and torch's own default for CPU tensors) or
    ``"fused"`` (fused=True, torch's fastest CPU path: the fair speed contender)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.offload not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {self.offload!r}")
        if self.torch_impl not in ("single", "fused"):
            raise ValueError(f"torch_impl must be 'single' or 'fused', got {self.torch_impl!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def model_config(self) -> GPTConfig:
        return config_for_params(self.params, block_size=self.seq_len)


@dataclass
class StepRecord:
    """One training step as the progress display and the plot see it."""

    step: int
    loss: float
    seconds: float
    """Wall time of the whole iteration (forward, backward, optimizer step)."""
    opt_seconds: float
    """Wall time of ``opt.step()`` alone."""
    tokens_per_s: float
    tiers: Dict[str, int] = field(default_factory=dict)
    """Optimizer bytes per tier after the step (empty for torch's optimizer)."""
    phases: Dict[str, float] = field(default_factory=dict)
    """``opt.step_stats()["last"]`` after the step (empty for torch's optimizer)."""
    rss: int = 0


@dataclass
class RunResult:
    optimizer: str
    """``"offload"`` or ``"torch"``."""
    offload: str
    """Where our optimizer kept its states (``cfg.offload``); unused for torch's."""
    model: GPTConfig
    records: List[StepRecord]
    memory_report: Optional[Dict[str, Any]] = None
    step_stats: Optional[Dict[str, Any]] = None
    max_host_bytes: Optional[int] = None
    swap_dir: Optional[str] = None
    swap_bytes_on_disk: int = 0
    """Bytes of the files under the swap directory at the end of training (before close)."""
    leftover_files: List[str] = field(default_factory=list)
    """Files the optimizer left in the swap directory after ``close()`` (should be none)."""

    @property
    def losses(self) -> List[float]:
        return [r.loss for r in self.records]

    @property
    def tokens_per_s(self) -> float:
        """Throughput over the steps after the first (which pays for warm-up and file creation)."""
        rows = self.records[1:] or self.records
        return sum(r.tokens_per_s * r.seconds for r in rows) / max(sum(r.seconds for r in rows), 1e-12)


def default_swap_parent() -> str:
    """Where the demo puts its temporary swap directory when not told: a real disk.

    /var/tmp first (persistent-storage temp by convention, unlike /tmp which is often
    tmpfs, i.e. RAM: swapping to it would only move the bytes from one RAM to another and
    O_DIRECT is refused there), then the current directory.
    """
    for candidate in ("/var/tmp", os.getcwd()):
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK) \
                and filesystem_type(candidate) not in ("tmpfs", "ramfs"):
            return candidate
    return os.getcwd()


def state_bytes(num_params: int) -> int:
    """fp32 master + exp_avg + exp_avg_sq."""
    return STATE_BYTES_PER_PARAM * num_params


def swapped_bytes(num_params: int) -> int:
    """exp_avg + exp_avg_sq: what goes to the swap files for fp32 CPU params (each param is its
    own fp32 master and stays where it is)."""
    return 8 * num_params


def default_max_host_bytes(num_params: int) -> int:
    """A quarter of the swapped states, in whole 2 MiB units, at least 2 MiB.

    Small enough that the states cannot sit in the optimizer's host buffers (the offload is
    real: every step streams them through the budget), large enough for a pipeline of a few
    sub-groups. 2 MiB is the swap layer's allocation unit (one huge-page-aligned region).
    """
    unit = 2 << 20
    return max(unit, swapped_bytes(num_params) // 4 // unit * unit)


def _lr_lambda(steps: int, warmup: int) -> Callable[[int], float]:
    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = (i - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _dir_bytes(path: str) -> Tuple[int, List[str]]:
    total, files = 0, []
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            try:
                total += os.stat(full).st_blocks * 512  # allocated, not apparent, size
            except OSError:
                continue
            files.append(os.path.relpath(full, path))
    return total, sorted(files)


def _make_optimizer(kind: str, model: torch.nn.Module, cfg: DemoConfig, swap_dir: Optional[str],
                    max_host_bytes: Optional[int]):
    common = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if kind == "torch":
        if cfg.torch_impl == "fused":
            return torch.optim.AdamW(model.parameters(), fused=True, **common)
        # foreach=False: the single-tensor path is the reference of our numerics contract.
        return torch.optim.AdamW(model.parameters(), foreach=False, **common)
    if kind != "offload":
        raise ValueError(f"optimizer must be 'offload' or 'torch', got {kind!r}")
    import offload

    extra: Dict[str, Any] = {"offload": cfg.offload, "state_dtype": cfg.state_dtype,
                             "master_dtype": cfg.master_dtype}
    if cfg.offload == "nvme":
        extra.update(swap_dir=swap_dir, max_host_bytes=max_host_bytes)
    return offload.AdamW(model.parameters(), **common, **extra)


def run(cfg: DemoConfig, optimizer: str = "offload", *, steps: Optional[int] = None,
        on_step: Optional[Callable[[StepRecord], None]] = None) -> RunResult:
    """Train ``steps`` (default ``cfg.steps``) steps from ``cfg.seed`` with one optimizer.

    With ``optimizer="offload"`` and ``cfg.offload == "nvme"`` the swap files go to a fresh
    temporary directory under ``cfg.swap_parent``, removed at the end whatever happens; the
    result says how many bytes were on disk and whether the optimizer left any file behind.
    """
    steps = cfg.steps if steps is None else steps
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    mcfg = cfg.model_config
    torch.manual_seed(cfg.seed)
    model = TinyGPT(mcfg).to(device=device, dtype=getattr(torch, cfg.dtype))
    data = Batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)

    use_swap = optimizer == "offload" and cfg.offload == "nvme"
    swap_dir = None
    max_host = None
    if use_swap:
        parent = cfg.swap_parent or default_swap_parent()
        if not os.path.isdir(parent):
            raise FileNotFoundError(2, "swap directory does not exist", parent)
        swap_dir = tempfile.mkdtemp(prefix="offload-demo-", dir=parent)
        max_host = cfg.max_host_bytes if cfg.max_host_bytes is not None else default_max_host_bytes(mcfg.num_params)
    result = RunResult(optimizer=optimizer, offload=cfg.offload, model=mcfg, records=[], max_host_bytes=max_host, swap_dir=swap_dir)
    opt = None
    try:
        opt = _make_optimizer(optimizer, model, cfg, swap_dir, max_host)
        # The schedule spans cfg.steps even when this run stops earlier (the torch rerun of the
        # first steps), so both runs see the same learning rate at every step.
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.steps, cfg.warmup))
        tokens = cfg.batch_size * cfg.seq_len
        has_report = hasattr(opt, "memory_report")
        for i in range(steps):
            x, y = data[i]
            x, y = x.to(device), y.to(device)
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            loss_value = float(loss.item())  # syncs the device before the clock stops
            t2 = time.perf_counter()
            rec = StepRecord(step=i + 1, loss=loss_value, seconds=t2 - t0, opt_seconds=t2 - t1,
                             tokens_per_s=tokens / max(t2 - t0, 1e-12))
            if has_report:
                report = opt.memory_report()
                rec.tiers, rec.rss = dict(report["tiers"]), int(report.get("rss") or 0)
            if hasattr(opt, "step_stats"):
                rec.phases = dict(opt.step_stats().get("last") or {})
            result.records.append(rec)
            if on_step is not None:
                on_step(rec)
        if has_report:
            result.memory_report = opt.memory_report()
        if hasattr(opt, "step_stats"):
            result.step_stats = opt.step_stats()
        if swap_dir is not None:
            result.swap_bytes_on_disk, _ = _dir_bytes(swap_dir)
    finally:
        torch.set_num_threads(threads_before)
        if opt is not None and hasattr(opt, "close"):
            with cleanup.removing():  # its temporary swap_dir goes next, Ctrl-C or not
                opt.close()
        if swap_dir is not None:
            _, result.leftover_files = _dir_bytes(swap_dir)
            result.leftover_files += [os.path.relpath(os.path.join(r, d), swap_dir)
                                      for r, ds, _ in os.walk(swap_dir) for d in ds]
            shutil.rmtree(swap_dir, ignore_errors=True)
    return result


def compare_losses(ours: List[float], reference: List[float], *, rtol: float = 1e-5) -> Tuple[float, bool]:
    """(max relative difference, within ``rtol``?) over the steps both runs made."""
    n = min(len(ours), len(reference))
    if n == 0:
        raise ValueError("no steps to compare")
    worst = 0.0
    for a, b in zip(ours[:n], reference[:n]):
        if not (math.isfinite(a) and math.isfinite(b)):
            return float("inf"), False
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst, worst <= rtol
