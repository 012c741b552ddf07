"""[Note: a reader that went away] in cli/_outcome.py: a command whose stdout reader closed the
pipe ends quietly with 141; a BrokenPipeError from anything else stays a failure."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from offload.cli import main

PLAN = ["plan", "--params", "1B", "--no-probe"]


@pytest.mark.parametrize("argv", [["info", "--json"], [*PLAN]])
def test_a_closed_stdout_pipe_ends_the_command_quietly_with_141(argv):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte: every write fails
    try:
        child = subprocess.run([sys.executable, "-m", "offload", *argv], stdout=write_end,
                               stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert child.returncode == 141, child.stderr
    for noise in ("Broken pipe", "BrokenPipeError", "Traceback", "Exception ignored", "error"):
        assert noise not in child.stderr, child.stderr


def test_a_broken_pipe_that_is_not_stdout_is_a_failure(monkeypatch, capsys):
    from offload.cli import info

    def other_pipe():
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a child process the command writes to
    monkeypatch.setattr(info, "collect", other_pipe)
    assert main(["info", "--json"]) == 1
    out, err = capsys.readouterr()
    assert "offload info: error: [Errno 32] Broken pipe" in err
    assert '"exit_code": 1' in out


def test_a_closed_stdout_is_one_write_error_line_not_a_traceback():
    # `offload info >&-`: Python makes sys.stdout None; the final flush was an AttributeError
    # traceback, and every line before it went nowhere (clean removed directories unsaid)
    child = subprocess.run(["sh", "-c", 'exec "$0" -m offload info >&-', sys.executable],
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert child.returncode == 1
    assert child.stderr == "offload: write error: Bad file descriptor\n", child.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["plan", "--help"]])
def test_help_that_cannot_be_written_is_a_write_error(monkeypatch, capsys, argv):
    # `offload --help >/dev/full`: argparse swallowed the failed write and exited 0
    import errno
    import io

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sys, "stdout", Full())
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 1
    assert capsys.readouterr().err == "offload: write error: No space left on device\n"
