"""The ``offload`` command under an early Ctrl-C / SIGTERM and with ``--json`` on failure
(thirty-fourth session).

A signal while the command imports torch used to land inside that import: a traceback, or
nothing at all when it landed in the NumPy import torch's C++ init makes (torch catches the
failure and goes on without NumPy; the command then ran to the end and exited 0). The
subprocess tests make that moment deterministic instead of a matter of timing: a meta-path
hook in the child stops at the first import of a chosen module, says so in a file, and waits
there for the test's "go" file; the test sends its signal(s) in between.
[Note: signals while the command starts] in offload/cli/_signals.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from offload.cli import main

# The child: the hook, then what the console script `offload` runs.
_CHILD = textwrap.dedent("""
    import os, sys, time
    BLOCKED, GO, TARGET = os.environ["T_BLOCKED"], os.environ["T_GO"], os.environ["T_MODULE"]

    class Stop:
        done = False
        def find_spec(self, name, path=None, target=None):
            if name == TARGET and not Stop.done:
                Stop.done = True
                open(BLOCKED, "w").close()
                while not os.path.exists(GO):
                    time.sleep(0.005)
            return None

    sys.meta_path.insert(0, Stop())
    from offload.cli import command
    command()
""")
# offload.cli.main([...]) called by a program that goes on after it (a notebook)
_IN_PROCESS_CHILD = _CHILD.replace("from offload.cli import command\ncommand()\n",
                                   "from offload.cli import main\nprint('alive after', main(sys.argv[1:]))\n")
assert _IN_PROCESS_CHILD != _CHILD

PLAN = ["plan", "--params", "1B", "--no-probe"]


def _stopped_child(tmp_path, module, argv, signums, go=True, child=_CHILD):
    """Run the command, send ``signums`` while it waits in the import of ``module``, let it
    go on (``go``); returns (returncode, stdout, stderr)."""
    blocked, gofile = tmp_path / "blocked", tmp_path / "go"
    env = dict(os.environ, T_BLOCKED=str(blocked), T_GO=str(gofile), T_MODULE=module)
    proc = subprocess.Popen([sys.executable, "-c", child, *argv], env=env, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not blocked.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"the child never imported {module}"
            time.sleep(0.005)
        for signum in signums:
            proc.send_signal(signum)
            time.sleep(0.05)  # each handled on its own
        if go:
            gofile.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


# torch: the import where an early Ctrl-C left a traceback. numpy: its first import, inside
# torch's C++ init, where the Ctrl-C was swallowed and plan printed its table and exited 0.
@pytest.mark.parametrize("module", ["torch", "numpy"])
def test_ctrl_c_while_torch_is_imported_says_interrupted_and_exits_130(tmp_path, module):
    rc, out, err = _stopped_child(tmp_path, module, PLAN, [signal.SIGINT])
    assert rc == 130, (rc, out, err)
    assert err.strip().splitlines()[-1] == "offload plan: interrupted" and "Traceback" not in err, err
    assert out == ""  # the command never ran


def test_sigterm_while_torch_is_imported_says_terminated_and_exits_143(tmp_path):
    rc, out, err = _stopped_child(tmp_path, "torch", PLAN, [signal.SIGTERM])
    assert rc == 143, (rc, out, err)
    assert err.strip().splitlines()[-1] == "offload plan: terminated" and "Traceback" not in err, err


def test_ctrl_c_with_json_while_torch_is_imported_prints_the_error_object(tmp_path):
    rc, out, err = _stopped_child(tmp_path, "numpy", [*PLAN, "--json"], [signal.SIGINT])
    assert rc == 130 and "Traceback" not in err, (rc, err)
    assert json.loads(out) == {"schema": "offload.error/1",
                               "error": {"command": "plan", "exit_code": 130, "message": "interrupted"}}


def test_a_second_ctrl_c_ends_an_import_that_hangs_at_once(tmp_path):
    # no "go": the import would wait forever; the second Ctrl-C must not
    rc, out, err = _stopped_child(tmp_path, "torch", PLAN, [signal.SIGINT, signal.SIGINT], go=False)
    assert rc == 130 and err.strip() == "offload: interrupted", (rc, err)


def test_a_second_ctrl_c_in_process_interrupts_the_import_and_leaves_the_caller_alive(tmp_path):
    # offload.cli.main([...]) in a notebook: the second Ctrl-C called os._exit and ended the kernel
    rc, out, err = _stopped_child(tmp_path, "torch", PLAN, [signal.SIGINT, signal.SIGINT], go=False,
                                  child=_IN_PROCESS_CHILD)
    assert rc == 0 and out.strip() == "alive after 130", (rc, out, err)
    assert err.strip().endswith(": interrupted") and "Traceback" not in err, err


def test_a_sigterm_held_in_process_is_not_dropped_by_a_ctrl_c_after_it(tmp_path):
    # the Ctrl-C went to the caller's handler and the SIGTERM held before it was never delivered
    rc, out, err = _stopped_child(tmp_path, "torch", PLAN, [signal.SIGTERM, signal.SIGINT], go=False,
                                  child=_IN_PROCESS_CHILD)
    assert rc == -signal.SIGTERM, (rc, out, err)  # its default action, as without the hold


def test_a_ctrl_c_held_in_process_goes_to_the_callers_own_sigint_handler(monkeypatch, capsys):
    # offload.cli.main([...]) in a process with a SIGINT handler of its own (a notebook, a loop
    # that stops at the end of its step): a Ctrl-C while the command was held became a
    # KeyboardInterrupt and exit status 130, and the caller's handler never ran
    from offload.cli import _command

    seen = []
    parse = _command._parse

    def ctrl_c_while_held(argv):
        os.kill(os.getpid(), signal.SIGINT)  # recorded by the hold, not yet handled
        assert seen == []
        return parse(argv)
    monkeypatch.setattr(_command, "_parse", ctrl_c_while_held)
    before = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        handler = signal.getsignal(signal.SIGINT)
        assert main(PLAN) == 0
        assert seen == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert "predicted optimizer step" in capsys.readouterr().out


def _in_a_fresh_interpreter(*statements: str) -> None:
    subprocess.run([sys.executable, "-c", "; ".join(statements)], check=True, timeout=120)


def test_import_offload_does_not_import_torch_until_a_name_is_used():
    _in_a_fresh_interpreter(
        "import sys, offload", "assert 'torch' not in sys.modules, 'torch imported'",
        "assert offload.AdamW.__module__ == 'offload.optim.adam'", "assert 'torch' in sys.modules",
        "assert offload.kernels.get_backend", "assert 'AdamW' in dir(offload)",
        "import pytest", "pytest.raises(AttributeError, getattr, offload, 'no_such_name')")


def test_offload_shard_stays_the_function_whoever_loads_the_subpackage_first():
    # the subpackage offload.shard, loaded by the optimizer's import (or by the user's), was
    # bound over the function of that name once names became lazy: offload.shard(model)
    # raised "'module' object is not callable" in 250 tests
    _in_a_fresh_interpreter(
        "import sys, offload.shard.api, offload.optim, offload",
        "assert offload.shard is sys.modules['offload.shard'].shard, offload.shard",
        "import offload.shard.units", "from offload.shard import load_weights",
        "assert offload.shard is sys.modules['offload.shard'].shard", "assert callable(offload.full_state_dict)")


# -- --json on failure: one error object on stdout, the line on stderr, the exit status --------

def _error_object(out):
    doc = json.loads(out)
    assert set(doc) == {"schema", "error"} and doc["schema"] == "offload.error/1", doc
    return doc["error"]


def test_plan_json_error_prints_the_error_object(tmp_path, capsys):
    assert main([*PLAN, "--json", "--swap-dir", str(tmp_path / "missing")]) == 1
    out, err = capsys.readouterr()
    e = _error_object(out)
    assert e["command"] == "plan" and e["exit_code"] == 1 and "swap directory does not exist" in e["message"], e
    assert err.startswith("offload plan: error: [Errno 2] swap directory does not exist"), err


def test_report_json_error_prints_the_error_object(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.jsonl"), "--json"]) == 1
    e = _error_object(capsys.readouterr().out)
    assert e["command"] == "report" and e["exit_code"] == 1 and "step log not found" in e["message"], e


def test_info_json_interrupted_prints_the_error_object(monkeypatch, capsys):
    from offload.cli import info

    def ctrl_c():
        raise KeyboardInterrupt
    monkeypatch.setattr(info, "collect", ctrl_c)
    assert main(["info", "--json"]) == 130
    out, err = capsys.readouterr()
    assert _error_object(out) == {"command": "info", "exit_code": 130, "message": "interrupted"}
    assert err == "offload info: interrupted\n"


@pytest.mark.parametrize("argv", [[*PLAN, "--json", "--stage", "7"], ["plan", "--json"], ["info", "--jso", "--x"]])
def test_json_usage_error_prints_the_error_object_and_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    e = _error_object(out)
    assert e["exit_code"] == 2 and e["command"] == argv[0] and e["message"] in err, (e, err)
    assert err.startswith("usage: offload"), err


def test_without_json_a_failure_leaves_stdout_empty(tmp_path, capsys):
    assert main([*PLAN, "--swap-dir", str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit):
        main([*PLAN, "--stage", "7"])
    assert capsys.readouterr().out == ""


def test_bench_io_json_names_a_file_so_a_failure_prints_no_object(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["bench-io", "--dir", str(f), "--size", "4MiB", "--json", str(tmp_path / "rows.json")]) == 1
    assert capsys.readouterr().out == "" and not (tmp_path / "rows.json").exists()
