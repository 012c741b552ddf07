"""The runtime side of the bill: a JSON line per step, and text forms of the optimizer's reports.

``StepLogger(path)`` appends one JSON object per line (the schema below); ``offload report
FILE`` reads the lines back, summarises them and plots them. ``format_memory_report`` and
``format_step_stats`` print what ``opt.memory_report()`` and ``opt.step_stats()`` return.

[Note: step log schema, version 1]
    {"schema": "offload.steplog/1", "step": int, "time": unix seconds (float),
     "step_s": wall seconds of the optimizer step,
     "phases": {"grad_transfer": s, "unscale_clip": s, "kernel": s, "swap_read": s,
                "swap_write": s, "h2d": s, "allgather": s, "wait_<phase>": s, ...},
     "overlap_efficiency": ideal / actual or null,
     "bytes": {"device": B, "pinned": B, "pageable": B, "nvme": B},
     "rss": process resident bytes}
Readers ignore keys they do not know, so writers may add some; phases absent in a step are 0.
"""
from __future__ import annotations

import errno
import json
import math
import os
import statistics
import time
import warnings
from typing import Any, Dict, IO, List, Mapping, Optional

from offload.optim.stats import PHASES, process_rss_bytes

__all__ = [
    "StepLogger",
    "attach",
    "read_step_log",
    "summarize_step_log",
    "format_memory_report",
    "format_step_stats",
    "format_log_summary",
    "STEPLOG_SCHEMA",
    "StepLogWarning",
    "PHASES",
]

STEPLOG_SCHEMA = "offload.steplog/1"
_TIERS = ("device", "pinned", "pageable", "nvme")
# The memory layer names its tiers pinned_host/pageable_host; the report speaks the plan's names.
_TIER_ALIASES = {"pinned_host": "pinned", "pageable_host": "pageable"}


def _tiers(mapping: Optional[Mapping[str, Any]]) -> Dict[str, int]:
    out = {t: 0 for t in _TIERS}
    for k, v in (mapping or {}).items():
        k = _TIER_ALIASES.get(k, k)
        if k in out and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = int(v)
    return out


class StepLogger:
    """Append one JSON line per optimizer step to ``path`` (flushed, so a crash keeps the lines).

    ``log(step, phases=..., bytes=..., ...)`` with explicit values, or ``log_optimizer(step,
    opt)`` which reads ``opt.step_stats()["last"]`` and ``opt.memory_report()``.
    """

    def __init__(self, path: "str | os.PathLike[str]", *, append: bool = False) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, "directory for the step log does not exist", parent)
        if append:
            _drop_cut_row(self.path)
        self._fh: Optional[IO[str]] = open(self.path, "a" if append else "w", encoding="utf-8")

    def log(self, step: int, *, phases: Optional[Mapping[str, float]] = None, step_s: Optional[float] = None,
            overlap_efficiency: Optional[float] = None, bytes: Optional[Mapping[str, int]] = None,
            rss: Optional[int] = None, **extra: Any) -> Dict[str, Any]:
        if self._fh is None:
            raise ValueError(f"step log {self.path} is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        ph = {}
        for k, v in (phases or {}).items():
            if k in ("step", "overlap_efficiency"):
                continue
            fv = float(v)
            if not math.isfinite(fv) or fv < 0:
                raise ValueError(f"phase {k!r} must be a finite number of seconds >= 0, got {v!r}")
            ph[str(k)] = fv
        row: Dict[str, Any] = {
            "schema": STEPLOG_SCHEMA,
            "step": step,
            "time": time.time(),
            "step_s": None if step_s is None else float(step_s),
            "phases": ph,
            "overlap_efficiency": None if overlap_efficiency is None else float(overlap_efficiency),
            "bytes": _tiers(bytes),
            "rss": process_rss_bytes() if rss is None else int(rss),
        }
        row.update(extra)
        self._fh.write(json.dumps(row, sort_keys=True) + "\n")
        self._fh.flush()
        return row

    def log_optimizer(self, step: int, opt: Any, **extra: Any) -> Dict[str, Any]:
        """Log the last step of an ``offload.Adam``/``AdamW`` from its own reports."""
        stats = opt.step_stats() if hasattr(opt, "step_stats") else {}
        last = dict(stats.get("last") or {})
        mem = opt.memory_report() if hasattr(opt, "memory_report") else {}
        return self.log(
            step,
            phases={k: v for k, v in last.items() if k not in ("step", "overlap_efficiency")},
            step_s=last.get("step"),
            overlap_efficiency=last.get("overlap_efficiency"),
            bytes=mem.get("tiers"),
            rss=mem.get("rss"),
            **extra,
        )

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "StepLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def attach(opt: Any, *, every: int = 1, path: "Optional[str | os.PathLike[str]]" = None,
           logger: Any = None) -> Any:
    """Report an optimizer's steps while it trains: a JSON line per step and/or a log line.

    ``path``: append one JSON line per step (the schema above) to that file. ``every``: emit
    ``format_step_stats`` and ``format_memory_report`` through ``logging`` (``logger``, by
    default ``logging.getLogger("offload.report")`` at INFO) every ``every`` steps; 0 turns the
    log lines off. Uses torch's public ``register_step_post_hook``, so it works with any
    ``offload.Adam``/``AdamW`` and needs nothing from the training loop. Returns a handle whose
    ``remove()`` detaches it and closes the file.
    """
    import logging

    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"every must be an integer >= 0, got {every!r}")
    if not hasattr(opt, "register_step_post_hook") or not hasattr(opt, "step_stats"):
        raise TypeError("attach needs an offload optimizer (offload.Adam, AdamW, SGD, Adagrad or Lion), "
                        f"got {type(opt).__name__}")
    log = logger or logging.getLogger("offload.report")
    writer = StepLogger(path, append=True) if path is not None else None
    count = [0]
    seen_empty = [0]

    def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        count[0] += 1
        if writer is not None:
            empty = optimizer.step_stats().get("empty", 0)
            writer.log_optimizer(count[0], optimizer, skipped=bool(getattr(optimizer, "last_step_skipped", False)),
                                 **({"empty": True} if empty > seen_empty[0] else {}))
            seen_empty[0] = empty
        if every and count[0] % every == 0:
            log.info("step %d\n%s\n%s", count[0], format_step_stats(optimizer.step_stats()),
                     format_memory_report(optimizer.memory_report()))

    hook = opt.register_step_post_hook(_after_step)

    class _Handle:
        def remove(self) -> None:
            hook.remove()
            if writer is not None:
                writer.close()

    return _Handle()


class StepLogWarning(UserWarning):
    """A line of a step log that ``read_step_log`` left out (it says which and why)."""


def _number(v: Any, *, nonneg: bool = True) -> bool:
    """A finite JSON number (never a bool), >= 0 unless told otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    return v >= 0 or not nonneg


def _row_problem(row: Mapping[str, Any]) -> Optional[str]:
    """Why a parsed row cannot be summarised (a known field of the wrong type), or None."""
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"'step' must be an integer >= 0, got {step!r}"
    for key, nonneg in (("step_s", True), ("overlap_efficiency", False), ("rss", True)):
        v = row.get(key)
        if v is not None and not _number(v, nonneg=nonneg):
            return f"{key!r} must be a finite number{' >= 0' if nonneg else ''} or null, got {v!r}"
    phases = row.get("phases")
    if phases is not None and not isinstance(phases, dict):
        return f"'phases' must be an object of seconds per phase, got {phases!r}"
    bad = next((k for k, v in (phases or {}).items() if not _number(v)), None)
    if bad is not None:
        return f"phase {bad!r} must be a finite number of seconds >= 0, got {phases[bad]!r}"
    tiers = row.get("bytes")
    if tiers is not None and not isinstance(tiers, dict):
        return f"'bytes' must be an object of bytes per tier, got {tiers!r}"
    bad = next((k for k, v in (tiers or {}).items() if _TIER_ALIASES.get(k, k) in _TIERS and not _number(v)), None)
    if bad is not None:
        return f"bytes of tier {bad!r} must be a number >= 0, got {tiers[bad]!r}"
    return None


def _drop_cut_row(path: str) -> None:
    """Before appending: a kill in the middle of a row's write leaves the file without a
    final newline; the next row would then be glued to that fragment in the middle of the
    file. Cut the fragment off (it never was a whole row) and say so."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return
        keep, pos = 0, size
        while pos > 0:  # the last newline, read backwards in blocks
            start = max(0, pos - 65536)
            at = os.pread(fd, pos - start, start).rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            pos = start
        os.ftruncate(fd, keep)
    finally:
        os.close(fd)
    warnings.warn(f"{path}: dropped a last row cut short ({size - keep} bytes, probably by a kill while it was "
                  "written) before appending", StepLogWarning, stacklevel=3)


def _row_after_fragment(line: str) -> Optional[Dict[str, Any]]:
    """The whole row that ends ``line`` after a cut fragment, or None. Rows are written with
    sorted keys, so each one starts with ``{"bytes":``."""
    at = line.find('{"bytes":', 1)
    while at > 0:
        try:
            row = json.loads(line[at:])
        except json.JSONDecodeError:
            at = line.find('{"bytes":', at + 1)
            continue
        return row if isinstance(row, dict) else None
    return None


def _parse_line(path: str, lineno: int, raw: str) -> Optional[Dict[str, Any]]:
    """One line as a row; None (with a warning) for a row to leave out; ValueError for a
    line that is not a step log's."""
    line = raw.strip()
    if not line:
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        if not raw.endswith("\n"):
            # The logger writes a row and its newline in one write, so only a kill in the
            # middle of that write leaves a last line without one: the run's last row.
            warnings.warn(f"{path}:{lineno}: last line cut short ({exc.msg}), probably by a kill while it "
                          f"was written; summarising the {lineno - 1} lines before it", StepLogWarning,
                          stacklevel=3)
            return None
        glued = _row_after_fragment(line)
        if glued is not None:
            # An older release appended a resumed run's first row right after a row a kill
            # had cut short (it did not drop the fragment first): keep the whole row.
            warnings.warn(f"{path}:{lineno}: a row cut short by a kill is glued to the next one; the "
                          "fragment is left out", StepLogWarning, stacklevel=3)
            row = glued
        else:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected an object with a 'step' key")
    problem = _row_problem(row)
    if problem is not None:
        warnings.warn(f"{path}:{lineno}: row left out: {problem}", StepLogWarning, stacklevel=3)
        return None
    row["phases"] = {str(k): float(v) for k, v in (row.get("phases") or {}).items()}
    row["bytes"] = _tiers(row.get("bytes"))
    return row


def read_step_log(path: "str | os.PathLike[str]") -> List[Dict[str, Any]]:
    """The rows of a step log.

    A line that is not a JSON object is a ``ValueError`` naming file and line. Two kinds of
    line are left out with a ``StepLogWarning`` naming the line instead, so that what the log
    does hold can still be read: a row whose known fields have the wrong type (``"phases":
    5``, ``"bytes": "lots"``), and a last line cut short by a kill (no newline at its end).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "step log not found", path)
    rows = []
    try:
        with open(path, "r", encoding="utf-8") as f:
            for lineno, raw in enumerate(f, 1):
                row = _parse_line(path, lineno, raw)
                if row is not None:
                    rows.append(row)
    except UnicodeDecodeError as exc:  # alone it named neither the file nor what it should be
        raise ValueError(f"{path}: not a step log: not UTF-8 text ({exc.reason}); "
                         "expected the JSON lines written by StepLogger or `offload demo --step-log`") from None
    return rows


def summarize_step_log(rows: List[Mapping[str, Any]]) -> Dict[str, Any]:
    """Means and medians of the step and each phase, mean overlap efficiency, peak bytes.
    Rows of skipped steps (inf/NaN grads) and of steps with no grads (``skipped``, ``empty``:
    ``attach`` writes them) are counted apart and left out of the times, as ``step_stats()``
    leaves them out of its means."""
    if not rows:
        raise ValueError("step log has no rows")
    timed = [r for r in rows if not r.get("skipped") and not r.get("empty")]
    steps = [float(r["step_s"]) for r in timed if r.get("step_s") is not None]
    names = sorted({k for r in timed for k in r["phases"]},
                   key=lambda k: (PHASES.index(k) if k in PHASES else len(PHASES), k))
    phases = {k: statistics.fmean(r["phases"].get(k, 0.0) for r in timed) for k in names}
    eff = [float(r["overlap_efficiency"]) for r in timed if r.get("overlap_efficiency") is not None]
    return {
        "rows": len(rows),
        "skipped_rows": sum(1 for r in rows if r.get("skipped")),
        "empty_rows": sum(1 for r in rows if r.get("empty") and not r.get("skipped")),
        "first_step": rows[0]["step"],
        "last_step": rows[-1]["step"],
        "step_s_mean": statistics.fmean(steps) if steps else None,
        "step_s_median": statistics.median(steps) if steps else None,
        "phase_s_mean": phases,
        "overlap_efficiency_mean": statistics.fmean(eff) if eff else None,
        "peak_bytes": {t: max(r["bytes"][t] for r in rows) for t in _TIERS},
        "peak_rss": max(int(r.get("rss") or 0) for r in rows),
    }


def _b(n: Optional[float]) -> str:
    from .render import fmt_bytes
    return fmt_bytes(n)


def format_log_summary(summary: Mapping[str, Any]) -> str:
    left = [f"{summary[k]} {what}" for k, what in (("skipped_rows", "skipped (inf/NaN grads)"),
                                                   ("empty_rows", "with no grads")) if summary.get(k)]
    lines = [f"{summary['rows']} steps logged ({summary['first_step']}..{summary['last_step']})"
             + (f"; {', '.join(left)}: not in the times" if left else "")]
    if summary["step_s_mean"] is not None:
        lines.append(f"step: mean {summary['step_s_mean'] * 1e3:.2f} ms, median {summary['step_s_median'] * 1e3:.2f} ms")
    total = summary["step_s_mean"]
    if summary["phase_s_mean"]:
        lines.append("phase means (phases overlap, so shares can add up to more than 100 %):")
    else:
        lines.append("no phase times logged")
    for k, v in summary["phase_s_mean"].items():
        share = f"{100 * v / total:6.1f} %" if total else ""
        lines.append(f"  {k:<16}{v * 1e3:10.2f} ms {share}")
    if summary["overlap_efficiency_mean"] is not None:
        lines.append(f"overlap efficiency (ideal / actual): mean {summary['overlap_efficiency_mean']:.3f}")
    lines.append("peak bytes: " + ", ".join(f"{t} {_b(v)}" for t, v in summary["peak_bytes"].items())
                 + f"; peak RSS {_b(summary['peak_rss'])}")
    return "\n".join(lines)


def format_memory_report(report: Mapping[str, Any]) -> str:
    """Text for ``opt.memory_report()``: bytes per tier (binary units), details, RSS."""
    tiers = _tiers(report.get("tiers", report))
    head = "optimizer memory"
    if report.get("offload") is not None:
        head += f" (offload={report['offload']}" + (f", store {report['store']}" if report.get("store") else "") + ")"
    lines = [head + ":"]
    for t in _TIERS:
        lines.append(f"  {t:<10}{_b(tiers[t]):>14}")
    lines.append(f"  {'total host':<10}{_b(tiers['pinned'] + tiers['pageable']):>14}")
    detail = report.get("detail") or {}
    for k, v in detail.items():
        lines.append(f"  {k}: {_detail_value(k, v)}")
    if report.get("rss") is not None:
        lines.append(f"  process RSS {_b(report['rss'])}")
    return "\n".join(lines)


def _detail_value(key: str, v: Any) -> str:
    """A detail of ``memory_report()``: a byte count (``*_bytes``) in binary units, any
    other number as itself (``world``, ``rank``, ``stage``, ``shard_numel`` are counts: shown
    as bytes they read ``world: 1 B`` and 3,000,000 elements as ``2.86 MiB``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if key.endswith("_bytes"):
        return _b(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def format_step_stats(stats: Mapping[str, Any]) -> str:
    """Text for ``opt.step_stats()``: last step and running mean per phase, overlap efficiency."""
    last = dict(stats.get("last") or {})
    mean = dict(stats.get("mean") or {})
    empty = f", {stats['empty']} with no grads" if stats.get("empty") else ""
    lines = [f"optimizer steps: {stats.get('steps', 0)} (skipped {stats.get('skipped', 0)}{empty})"]
    if not last:
        lines.append("  no step yet")
        return "\n".join(lines)
    keys = [k for k in PHASES if k in last or k in mean]
    keys += sorted(k for k in set(last) | set(mean) if k not in PHASES and k not in ("step", "overlap_efficiency"))
    lines.append(f"  {'phase':<16}{'last ms':>10}{'mean ms':>10}")
    for k in ["step"] + keys:
        lv = last.get(k)
        mv = mean.get(k)
        lines.append(f"  {k:<16}{'' if lv is None else f'{lv * 1e3:.2f}':>10}{'' if mv is None else f'{mv * 1e3:.2f}':>10}")
    if "overlap_efficiency" in last:
        m = mean.get("overlap_efficiency")
        lines.append(f"  overlap efficiency: last {last['overlap_efficiency']:.3f}" + ("" if m is None else f", mean {m:.3f}"))
    return "\n".join(lines)
