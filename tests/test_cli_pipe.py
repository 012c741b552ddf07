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
