"""What ``offload bench-io`` prints and draws: the progress bar, the table of rows and the
throughput plot; and the check, before the sweep, that its output files can be written."""
from __future__ import annotations

import errno
import os
import stat
import sys
import time
from typing import Dict, Sequence

__all__ = ["Progress", "check_outputs", "format_table", "plot"]


def _human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'tool':<9} {'engine':<12} {'rw':<5} {'bs':>5} {'qd':>3} {'dir':>3} {'GB/s':>6} {'GiB/s':>6} "
            f"{'IOPS':>8} {'p50 us':>9} {'p99 us':>9} {'p99.9 us':>9} {'usr%':>5} {'sys%':>5} {'vs fio':>6}  note")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["rw"], r["block_size"], r["queue_depth"], r["tool"] != "offload",
                                         -r["gbps"])):
        eng = r["engine"] + ("+THP" if r.get("hugepages") else "")
        ratio = f"{r['vs_fio']:.2f}" if r.get("vs_fio") else ""
        lines.append(
            f"{r['tool']:<9} {eng:<12} {r['rw']:<5} {_human(r['block_size']):>5} {r['queue_depth']:>3} "
            f"{'y' if r['direct'] else 'n':>3} {r['gbps']:6.2f} {r['gibps']:6.2f} {r['iops']:8.0f} "
            f"{r['lat_p50_us']:9.0f} {r['lat_p99_us']:9.0f} {r['lat_p999_us']:9.0f} {r['cpu_usr_pct']:5.0f} "
            f"{r['cpu_sys_pct']:5.0f} {ratio:>6}  {r.get('note', '')}")
    lines.append("GB/s = 10^9 bytes/s, GiB/s = 2^30 bytes/s; latency per request from submission to completion; "
                 "usr%/sys% = CPU time of the whole process (fio: of fio) in % of one CPU; "
                 "vs fio = offload GB/s / best fio GB/s of the same rw, bs, qd.")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
    rws = sorted({r["rw"] for r in rows})
    # One colour per contender, one line style per queue depth: lines stay readable with
    # a dozen series.
    contenders = sorted({(r["tool"], r["engine"], bool(r.get("hugepages"))) for r in rows})
    colours = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(contenders)}
    qds = sorted({r["queue_depth"] for r in rows})
    styles = {qd: ["-", "--", ":", "-."][i % 4] for i, qd in enumerate(reversed(qds))}
    fig, axes = plt.subplots(1, len(rws), figsize=(6 * len(rws), 4.5), squeeze=False)
    for ax, rw in zip(axes[0], rws):
        series: Dict[tuple, list] = {}
        for r in rows:
            if r["rw"] == rw:
                series.setdefault(((r["tool"], r["engine"], bool(r.get("hugepages"))), r["queue_depth"]),
                                  []).append((r["block_size"], r["gbps"]))
        for (c, qd), pts in sorted(series.items()):
            pts.sort()
            label = f"{c[0]} {c[1]}{'+THP' if c[2] else ''} qd={qd}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colours[c], linestyle=styles[qd],
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (bytes)")
        ax.set_ylabel("GB/s (10^9 B/s)")
        ax.set_title(f"{rw}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    # savefig would add ".png" to a name without a suffix, writing beside the path given
    fig.savefig(path, dpi=120, format=None if os.path.splitext(os.fspath(path))[1] else "png")
    plt.close(fig)


def probe_writable(path: str) -> None:
    """Raise the OSError that writing ``path`` would raise, leaving nothing behind: a new file
    is created and removed again, an existing one opened for appending (not truncated).
    ``os.access`` is not enough: for root it says yes under /proc and /sys (which refuse the
    file with ENOENT or EACCES) and it does not check the name's length (ENAMETOOLONG)."""
    if os.path.exists(path):
        if not stat.S_ISREG(os.stat(path).st_mode):
            return  # a device or a pipe (/dev/stdout, a FIFO): an open could block, or be its reader's EOF
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC))
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    os.close(fd)
    os.unlink(path)


def check_outputs(args) -> None:
    """Refuse, before the sweep, an output file that could not be written after it: a sweep
    of a few GiB takes minutes, and its --json, --plot and --tune were lost to a typo."""
    for flag in ("json", "plot", "tune"):
        path = getattr(args, flag)
        if not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise OSError(errno.EISDIR, f"--{flag}: is a directory, expected a file name", path)
        if not os.path.isdir(parent):
            raise OSError(errno.ENOENT, f"--{flag}: no such directory", parent)
        try:
            probe_writable(path)
        except OSError as exc:
            raise OSError(exc.errno, f"--{flag}: cannot write the file ({exc.strerror})", path) from None
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None


def terminal_columns(stream) -> int:
    """The width of the terminal ``stream`` draws on (at least 20): ``COLUMNS`` when set, as
    shutil's, else the stream's own terminal (not stdout's: with stdout redirected, shutil's
    fallback drew 150 columns on an 80-column stderr), else 80."""
    try:
        return max(20, int(os.environ["COLUMNS"]))
    except (KeyError, ValueError):
        pass
    try:
        return max(20, os.get_terminal_size(stream.fileno()).columns)
    except (OSError, ValueError, AttributeError):
        return 80


class Progress:
    """A progress bar with ETA on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, stream=None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.label = ""
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._last = 0.0

    def step(self, label: str) -> None:
        self.label = label
        if not self.tty:
            self._draw(force=True)

    def advance(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        if self.tty:
            self._draw()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = self.done / self.total
        elapsed = now - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        eta_s = "--:--" if eta != eta else f"{int(eta) // 60}:{int(eta) % 60:02d}"
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        text = f"[{bar}] {100 * frac:3.0f}% ETA {eta_s}  {self.label}"
        if self.tty:
            # One column short of the terminal's width: a longer line wraps, and "\r" then
            # goes back to the start of its last row only, so each redraw scrolled a new line.
            width = terminal_columns(self.stream) - 1
            self.stream.write("\r" + text[:width].ljust(width))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.done = self.total
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def abort(self) -> None:
        """End the bar's line where the sweep stopped (Ctrl-C, SIGTERM, an error), so the
        message that follows starts a line of its own instead of being glued to the bar."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
