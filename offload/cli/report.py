"""``offload report FILE``: summarise a step log (``offload.plan.StepLogger``) and plot it."""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Dict, List

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name,
        help="summarise and plot a per-step JSON-lines log",
        description="Read the JSON lines written by offload.plan.StepLogger: step time, time per "
                    "phase, overlap efficiency, bytes per tier; optionally draw them.",
    )
    p.add_argument("file", help="step log (one JSON object per line)")
    p.add_argument("--plot", metavar="OUT_PNG", help="draw the phase timeline and per-tier bytes (matplotlib)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(run=run)
    return p


def _read(path: str) -> List[Dict[str, Any]]:
    """The log's rows; the lines it leaves out are said on stderr, one warning each."""
    from offload.plan.report import StepLogWarning, read_step_log

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StepLogWarning)
        rows = read_step_log(path)
    for w in caught:
        if issubclass(w.category, StepLogWarning):
            print(f"offload report: warning: {w.message}", file=sys.stderr)
        else:  # not ours: hand it back to the warnings machinery unchanged
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return rows


def run(args: argparse.Namespace) -> int:
    from offload.plan.report import format_log_summary, summarize_step_log

    rows = _read(args.file)
    summary = summarize_step_log(rows)
    if args.plot:
        from offload.plan.plot import plot_step_log
        summary["plot"] = plot_step_log(rows, args.plot)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(format_log_summary(summary))
        if args.plot:
            print(f"plot written to {summary['plot']}")
    return 0
