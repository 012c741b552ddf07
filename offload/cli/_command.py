"""What ``offload`` does once its signals are held (offload/cli/__init__.py): parse, import
the engine, run the command, and turn its end into an exit status (cli/_outcome.py)."""
from __future__ import annotations

import argparse
import errno
import importlib
import logging
import sys
from typing import List, Optional

from ._outcome import (BadUsage, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_PIPE_CLOSED, EXIT_TERMINATED, EXIT_USAGE, drop_stdout,
                       fail, json_requested, stdout_reader_gone, write_error)
from ._signals import CommandSignals, Terminated

__all__ = ["SUBCOMMANDS", "build_parser", "run_held"]

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

# What every command imports before it runs, while signals are held ([Note: signals while
# the command starts] in cli/_signals.py): torch (and the NumPy its C++ init imports) and
# the engine, what `import offload` imported before it became lazy.
ENGINE_MODULES = ("torch", "offload.kernels", "offload.optim")


class UsageError(Exception):
    """argparse's error, raised instead of printed so that main can add the --json object."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # the subcommands' parsers are of this class too
        raise UsageError(self, message)

    def _print_message(self, message: str, file=None) -> None:
        """argparse's, without swallowing a failed write to stdout: `offload --help >/dev/full`
        lost the help and exited 0. A reader that went away ends as in run_held (141, quietly)."""
        if not message:
            return
        file = file or sys.stderr
        try:
            file.write(message)
            file.flush()
        except OSError as exc:
            if file is not sys.stdout:
                return  # stderr (a usage error's message): nowhere else to say it, as argparse
            if isinstance(exc, BrokenPipeError) and stdout_reader_gone():
                drop_stdout()
                raise SystemExit(EXIT_PIPE_CLOSED) from None
            raise SystemExit(write_error(exc.errno)) from None


def build_parser() -> argparse.ArgumentParser:
    from offload._version import __version__

    parser = _Parser(
        prog="offload",
        description="Train PyTorch models larger than accelerator memory.",
    )
    parser.add_argument("--version", action="version", version=f"offload {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level (else warnings and errors only)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"offload.cli.{module_name}")
        module.add_parser(sub, name)
    return parser


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    """The arguments; a usage error says so as argparse does (usage, then the message), adds
    the --json object, and exits 2 (SystemExit, as argparse)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return build_parser().parse_args(argv)
    except UsageError as exc:
        command = next((a for a in argv if a in SUBCOMMANDS), None)
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {exc}", file=sys.stderr)
        fail(command, EXIT_USAGE, str(exc), json_requested(command, argv=argv), said=True)
        raise SystemExit(EXIT_USAGE) from None


def run_held(argv: Optional[List[str]], signals: CommandSignals) -> int:
    """``main`` within ``signals``: the command's exit status."""
    args = None
    if sys.stdout is None:  # Python's stdout when its descriptor was closed (`offload info >&-`)
        return write_error(errno.EBADF)  # before any work: its output would be lost
    try:
        args = _parse(argv)
        # Warnings and errors only, unless -v: a failure is one line on stderr (the README's
        # exit statuses), not that line after the library's INFO notes (which backend loaded).
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.WARNING,
            format="%(levelname)s %(name)s: %(message)s",
        )
        if not getattr(args, "command", None):
            parser = build_parser()
            parser.print_help(sys.stderr)
            print(f"{parser.prog}: error: a command is required", file=sys.stderr)
            return EXIT_USAGE
        for name in ENGINE_MODULES:
            importlib.import_module(name)
        signals.ready()  # from here a Ctrl-C raises KeyboardInterrupt, a SIGTERM Terminated
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's exit
        return code
    except BadUsage as exc:
        command = getattr(args, "command", None)
        return fail(command, EXIT_USAGE, str(exc), json_requested(command, args))
    except (OSError, ValueError, RuntimeError, NotImplementedError) as exc:
        if isinstance(exc, BrokenPipeError) and stdout_reader_gone():  # [Note: a reader that went away]
            drop_stdout()
            return EXIT_PIPE_CLOSED
        command = getattr(args, "command", None)
        return fail(command, EXIT_FAILURE, str(exc), json_requested(command, args))
    except KeyboardInterrupt:
        return _stopped(args, EXIT_INTERRUPTED, "interrupted")
    except Terminated:  # SIGTERM (cli/_signals.py)
        return _stopped(args, EXIT_TERMINATED, "terminated")
    except Exception as exc:  # a bug: its traceback follows; a --json reader still gets an object
        command = getattr(args, "command", None)
        if command:
            fail(command, EXIT_FAILURE, f"{type(exc).__name__}: {exc}", json_requested(command, args))
        raise


def _stopped(args: Optional[argparse.Namespace], code: int, word: str) -> int:
    command = getattr(args, "command", None)
    return fail(command, code, word, json_requested(command, args) if args is not None else False)
