"""The ``offload`` command. Each subcommand is a module with ``add_parser`` and ``run``
(offload/cli/_command.py lists them).

Exit status (README.md, "Exit status"): 0 done, 1 failed, 2 usage error, 130 Ctrl-C, 143
SIGTERM; a failure with ``--json`` also prints an error object on stdout (cli/_outcome.py).
"""
# Only the signal guard is imported before main() holds Ctrl-C and SIGTERM: argparse, logging
# and json took ~30 ms more, in which a Ctrl-C was a traceback ([Note: signals while the
# command starts] in cli/_signals.py).
from __future__ import annotations

from ._signals import CommandSignals

__all__ = ["main", "command", "build_parser"]


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Run ``offload ARGV...`` and return its exit status. ``own_process``: this process is
    the command (the console script, ``python -m offload``), so that a second Ctrl-C while it
    starts may end it ([Note: signals while the command starts] in cli/_signals.py)."""
    with CommandSignals(own_process) as signals:
        from ._command import run_held

        return run_held(argv, signals)


def command() -> None:
    """The ``offload`` console script: ``main`` in a process of its own, then exit."""
    import sys

    sys.exit(main(own_process=True))


def build_parser():
    """The ``offload`` argument parser (``argparse.ArgumentParser``)."""
    from ._command import build_parser as build

    return build()
