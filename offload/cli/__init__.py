"""The ``offload`` command. Each subcommand is a module with ``add_parser`` and ``run``."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import List, Optional

__all__ = ["main", "build_parser"]

# subcommand -> module under offload.cli (imported lazily so `offload info` stays fast and
# works even when an optional piece, e.g. matplotlib, is missing).
SUBCOMMANDS = {
    "bench-io": "bench_io",
    "plan": "plan",
    "report": "report",
    "info": "info",
    "clean": "clean",
    "demo": "demo",
}


def build_parser() -> argparse.ArgumentParser:
    from offload._version import __version__

    parser = argparse.ArgumentParser(
        prog="offload",
        description="Train PyTorch models larger than accelerator memory.",
    )
    parser.add_argument("--version", action="version", version=f"offload {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"offload.cli.{module_name}")
        module.add_parser(sub, name)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from ._signals import Terminated

    try:
        return int(args.run(args) or 0)
    except (OSError, ValueError, RuntimeError, NotImplementedError) as exc:
        print(f"offload {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"offload {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:  # SIGTERM, in a command that turns it into an exception (cli/_signals.py)
        print(f"offload {args.command}: terminated", file=sys.stderr)
        return 143
