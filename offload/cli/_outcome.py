"""How a failed ``offload`` command ends: one line on stderr, an exit status, and with
``--json`` one JSON object on stdout.

[Note: --json on failure] ``offload info|plan|report --json`` print one JSON object on stdout.
On failure stdout was empty, and a script piping it into ``jq`` or ``json.loads`` got a parse
error instead of the reason. A failure (an error, a usage error, Ctrl-C, SIGTERM) now prints

    {"schema": "offload.error/1", "error": {"command": ..., "exit_code": ..., "message": ...}}

besides the line on stderr, and the exit status is non-zero as before. ``bench-io`` and
``demo`` take ``--json FILE``: a failed run writes no FILE (an existing one is left as it was).

[Note: a reader that went away] ``offload info --json | head -c1``: the reader closes the pipe,
and the next write to stdout raised BrokenPipeError, which ended the command as a failure
("error: [Errno 32] Broken pipe", exit 1), or, when the output was still in Python's buffer,
as "Exception ignored ... BrokenPipeError" at the interpreter's exit. A reader closing early
chose to read no more, as with any Unix filter: the command ends quietly with the status a
shell reports for a process SIGPIPE ended (141, what coreutils give), stdout pointed at
/dev/null so that nothing is written there again. Only when stdout's reader is gone: a
BrokenPipeError from another pipe stays an error.
"""
from __future__ import annotations

import json
import os
import select
import sys
from typing import Optional, Sequence

__all__ = ["EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_PIPE_CLOSED",
           "json_requested", "fail", "stdout_reader_gone", "drop_stdout", "write_error", "BadUsage"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2          # argparse's own
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended
EXIT_TERMINATED = 143   # 128 + SIGTERM
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: stdout's reader went away ([Note: a reader that went away])

class BadUsage(ValueError):
    """A bad option value or combination that argparse cannot see (``--size`` not a multiple of
    ``--block-size``): raised by a command before it does any work, it ends as argparse's
    usage errors do, with status 2 (the README's table), not 1."""


# the commands whose --json is a flag that prints to stdout (bench-io's and demo's name a file)
JSON_ON_STDOUT = ("info", "plan", "report")


def json_requested(command: Optional[str], args: object = None, argv: Sequence[str] = ()) -> bool:
    """Whether the command prints JSON on stdout: ``args.json`` once parsed, else (a usage
    error) ``--json`` or a prefix argparse would take for it among ``argv``."""
    if command not in JSON_ON_STDOUT:
        return False
    if args is not None:
        return getattr(args, "json", None) is True
    return any(len(a) >= 3 and "--json".startswith(a) for a in argv)


def fail(command: Optional[str], exit_code: int, message: str, as_json: bool, said: bool = False) -> int:
    """Say ``message`` on stderr (``offload CMD: error: message``; ``offload CMD: interrupted``)
    unless ``said`` already (argparse's usage error), and as the error object on stdout when
    ``as_json``; returns ``exit_code``."""
    prefix = f"offload {command}" if command else "offload"
    error = "" if exit_code in (EXIT_INTERRUPTED, EXIT_TERMINATED) else "error: "
    if not said:
        print(f"{prefix}: {error}{message}", file=sys.stderr)
    if as_json:
        doc = {"schema": "offload.error/1",
               "error": {"command": command, "exit_code": exit_code, "message": message}}
        try:
            print(json.dumps(doc, indent=2, sort_keys=True), flush=True)
        except OSError:  # stdout closed (a reader that went away): stderr said it already
            drop_stdout()
    return exit_code


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end is closed: poll reports POLLERR
    for the write end of a pipe without readers."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR and POLLHUP are reported whatever the mask
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def drop_stdout() -> None:
    """Point stdout's descriptor at /dev/null: what Python still buffers for it goes there at
    the interpreter's exit, not into a second BrokenPipeError ([Note: a reader that went away])."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def write_error(err: int) -> int:
    """Say that stdout could not be written (``offload: write error: Bad file descriptor``, as
    coreutils say it) and return EXIT_FAILURE: a closed stdout (``>&-``, which Python makes
    ``sys.stdout = None``: every print went nowhere, and the final flush was an AttributeError
    traceback) or a full one (``--help >/dev/full`` exited 0)."""
    try:
        print(f"offload: write error: {os.strerror(err) if err else 'unknown error'}", file=sys.stderr)
    except (AttributeError, OSError, ValueError):
        pass
    return EXIT_FAILURE
