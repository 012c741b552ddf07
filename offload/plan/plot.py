"""Plot a step log: the per-step phase timeline and the bytes per tier (matplotlib, optional)."""
from __future__ import annotations

import os
from typing import Any, List, Mapping

from .report import PHASES

__all__ = ["plot_step_log"]

_TIERS = ("device", "pinned", "pageable", "nvme")
_MAX_BARS = 100


def plot_step_log(rows: List[Mapping[str, Any]], out: "str | os.PathLike[str]") -> str:
    """Draw ``rows`` (from ``read_step_log``) to ``out`` (PNG); returns the path.

    Top: seconds per phase for each step as grouped bars (phases of a pipelined step overlap,
    so stacking them would overstate the step; lines beyond 100 steps), the wall time of the
    step as a line.
    Bottom: bytes per tier and the process RSS per step, in GiB (2^30 bytes).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed; the figure goes to a file
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
    if not rows:
        raise ValueError("step log has no rows to plot")
    steps = [r["step"] for r in rows]
    names = sorted({k for r in rows for k in r["phases"]},
                   key=lambda k: (PHASES.index(k) if k in PHASES else len(PHASES), k))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    if len(rows) <= _MAX_BARS:
        width = 0.8 / max(1, len(names))
        for j, k in enumerate(names):
            xs = [s - 0.4 + (j + 0.5) * width for s in steps]
            ax1.bar(xs, [r["phases"].get(k, 0.0) * 1e3 for r in rows], width=width, label=k)
    else:  # bars of thousands of steps are unreadable (and slow to draw): one line per phase
        for k in names:
            ax1.plot(steps, [r["phases"].get(k, 0.0) * 1e3 for r in rows], linewidth=0.8, label=k)
    wall = [(s, r["step_s"] * 1e3) for s, r in zip(steps, rows) if r.get("step_s") is not None]
    if wall:
        ax1.plot([w[0] for w in wall], [w[1] for w in wall], "k.-", label="step (wall)")
    ax1.set_ylabel("ms")
    ax1.set_title("optimizer step: time per phase")
    ax1.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    gib = float(1 << 30)
    for t in _TIERS:
        ys = [r["bytes"].get(t, 0) / gib for r in rows]
        if any(ys):
            ax2.plot(steps, ys, marker=".", label=t)
    ax2.plot(steps, [int(r.get("rss") or 0) / gib for r in rows], "k--", label="process RSS")
    ax2.set_ylabel("GiB (2^30 B)")
    ax2.set_xlabel("step")
    ax2.set_title("bytes per tier")
    ax2.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out = os.fspath(out)
    # savefig would add ".png" to a name without a suffix (a directory's name too), writing
    # beside the path it was given while the report named that path
    fig.savefig(out, dpi=100, format=None if os.path.splitext(out)[1] else "png")
    plt.close(fig)
    return out
