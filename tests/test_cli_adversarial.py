"""The command-line tools under bad input and signals (an adversarial probe, thirty-third
session): output files refused before the work where os.access says yes (root under /proc, a
name too long), SIGTERM and Ctrl-C in the demo and in plan's disk probe leave no files and exit
143 / 130, the progress bar fits the terminal, bad choices are usage errors, warnings go to
stderr, error numbers match their words."""
from __future__ import annotations

import glob
import io
import os
import signal
import subprocess
import sys
import time

import pytest

from offload.cli import bench_io, main

LONG = "a" * 300  # longer than NAME_MAX (255): os.access does not see it, open() does


# -- 1. an output file that cannot be written is refused before the work, also where
#       os.access says yes (a name too long; root under /proc and /sys) -----------------------

@pytest.mark.parametrize("flag", ["--json", "--plot", "--tune"])
def test_bench_io_output_with_a_name_too_long_is_refused_before_the_sweep(tmp_path, capsys, monkeypatch, flag):
    def no_sweep(args):
        raise AssertionError("the sweep ran")
    monkeypatch.setattr(bench_io, "sweep", no_sweep)
    assert main(["bench-io", "--dir", str(tmp_path), "--size", "4MiB", flag, str(tmp_path / LONG)]) == 1
    err = capsys.readouterr().err
    assert f"{flag}: cannot write the file" in err and "too long" in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/proc/self"), reason="root's os.access under /proc")
def test_bench_io_output_under_proc_is_refused_before_the_sweep_for_root(tmp_path, capsys, monkeypatch):
    def no_sweep(args):
        raise AssertionError("the sweep ran")
    monkeypatch.setattr(bench_io, "sweep", no_sweep)
    assert main(["bench-io", "--dir", str(tmp_path), "--size", "4MiB", "--tune", "/proc/offload-s33.json"]) == 1
    assert "--tune: cannot write the file" in capsys.readouterr().err


def test_an_existing_output_file_is_probed_without_being_truncated(tmp_path):
    from offload.cli.bench_io_output import probe_writable

    f = tmp_path / "rows.json"
    f.write_text("keep me")
    probe_writable(str(f))
    assert f.read_text() == "keep me"
    probe_writable(str(tmp_path / "new.json"))
    assert sorted(os.listdir(tmp_path)) == ["rows.json"]


def test_demo_output_with_a_name_too_long_is_refused_before_training(tmp_path, capsys, monkeypatch):
    from offload.cli import demo

    def no_training(*a, **k):
        raise AssertionError("the demo trained")
    monkeypatch.setattr(demo, "_run", no_training)
    assert main(["demo", "--quick", "--no-progress", "--swap-dir", str(tmp_path),
                 "--json", str(tmp_path / LONG)]) == 1
    assert "--json: cannot write this file" in capsys.readouterr().err


# -- 2. SIGTERM in `offload demo` removes its temporary swap directory ---------------------------

def test_demo_sigterm_removes_its_temporary_swap_dir_and_exits_143(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "offload", "demo", "--quick", "--steps", "400",
                             "--compare-steps", "0", "--no-progress", "--swap-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not glob.glob(str(tmp_path / "offload-demo-*" / "offload-run.rank0" / "slot0.bin")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no swap files appeared"
            time.sleep(0.02)
        time.sleep(0.3)  # a step or two
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (proc.returncode, err)
    assert "offload demo: terminated" in err and "Traceback" not in err, err
    assert "kept after SIGTERM" not in err, err  # not said of a directory removed a moment later
    assert os.listdir(tmp_path) == []


# -- 3. `offload plan`'s disk probe: Ctrl-C and SIGTERM ------------------------------------------

def _ctrl_c(*a, **k):
    raise KeyboardInterrupt


def test_disk_probe_ctrl_c_is_not_replaced_by_a_buffer_error(tmp_path, monkeypatch):
    import torch

    from offload.plan.rates import DiskProbe

    monkeypatch.setattr(torch, "randint", _ctrl_c)  # Ctrl-C while a buffer is viewed
    with pytest.raises(KeyboardInterrupt):
        DiskProbe(str(tmp_path), nbytes=8 << 20, chunk=1 << 20)
    assert os.listdir(tmp_path) == []


def test_plan_ctrl_c_in_the_disk_probe_says_interrupted_and_exits_130(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch, "randint", _ctrl_c)
    rc = main(["plan", "--params", "1B", "--offload", "nvme", "--swap-dir", str(tmp_path), "--kernel-gparams", "1"])
    err = capsys.readouterr().err
    assert rc == 130 and "offload plan: interrupted" in err and "BufferError" not in err, err
    assert os.listdir(tmp_path) == []


def test_plan_sigterm_in_the_disk_probe_removes_its_file_and_exits_143(tmp_path, monkeypatch, capsys):
    from offload.plan import rates

    seen = []

    def measure(self):
        seen.append(os.listdir(tmp_path))  # the probe file is there now
        os.kill(os.getpid(), signal.SIGTERM)
        return 1.0, 1.0

    monkeypatch.setattr(rates.DiskProbe, "measure", measure)
    received = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        rc = main(["plan", "--params", "1B", "--offload", "nvme", "--swap-dir", str(tmp_path),
                   "--kernel-gparams", "1"])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen and seen[0], "the probe made no file"
    assert rc == 143 and "offload plan: terminated" in capsys.readouterr().err and not received
    assert os.listdir(tmp_path) == []


# -- 4. bench-io's progress bar on a terminal ----------------------------------------------------

class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_fits_the_terminal_and_a_stop_ends_its_line(monkeypatch):
    from offload.cli.bench_io_output import Progress

    monkeypatch.setenv("COLUMNS", "80")
    s = _Tty()
    p = Progress(100, stream=s)
    p.step("threads read bs=128K qd=1 loop 1/5 with a long label to fill the line")
    p.advance(10)
    drawn = [x for x in s.getvalue().split("\r") if x]
    assert drawn and all(len(x) < 80 for x in drawn), [len(x) for x in drawn]
    p.abort()
    assert s.getvalue().endswith("\n")


def test_demo_progress_bar_fits_the_terminal_and_clears_what_was_longer(monkeypatch):
    from offload.cli import demo

    s = _Tty()
    monkeypatch.setattr(demo.sys, "stderr", s)
    monkeypatch.setattr(demo, "_columns", lambda: 60)
    p = demo.Progress(30, "offload")
    p.update(1, "loss 5.5432 tok/s 12345.6 with a long tail of text to wrap the line")
    p.update(2, "short")
    drawn = [x for x in s.getvalue().split("\r") if x]
    assert [len(x) for x in drawn] == [59, 59], drawn  # padded: the longer line's end is overwritten


# -- 5. `offload info` without the native library ----------------------------------------------

def test_info_without_the_native_library_does_not_print_none(monkeypatch):
    import offload.kernels as kernels
    from offload.cli import info

    monkeypatch.setattr(kernels, "native_isa", lambda: None)
    data = info.collect()
    assert data["isa_selected"] is not None and data["isa_selected"].startswith("unavailable")
    assert "  None" not in info._render(data)


# -- 6. `offload plan`: a bad value of a fixed set is a usage error, as for --state-dtype -------

@pytest.mark.parametrize("opt", [["--optimizer", "bogus"], ["--offload", "disk"], ["--param-dtype", "int4"],
                                 ["--grad-dtype", "fp64"], ["--param-device", "tpu"],
                                 ["--stage", "3", "--offload-params", "disk"]])
def test_plan_bad_choice_is_a_usage_error(opt, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--params", "1B", "--no-probe", *opt])
    assert e.value.code == 2
    assert f"argument {opt[-2]}" in capsys.readouterr().err


@pytest.mark.parametrize("opt", [["--optimizer", "AdamW"], ["--param-dtype", "torch.float16"], ["--param-device", "CPU"]])
def test_plan_still_takes_what_the_api_takes(opt, capsys):
    assert main(["plan", "--params", "1B", "--no-probe", *opt]) == 0


# -- 7. messages and streams ---------------------------------------------------------------------

def test_bench_io_keep_warning_goes_to_stderr(tmp_path, capsys):
    from offload.cli.bench_io_file import remove_data_file

    remove_data_file(None, str(tmp_path / "offload-bench-io.1.dat"), keep=True)
    out, err = capsys.readouterr()
    assert "nothing kept" in err and out == ""


def test_bench_io_dir_that_is_a_file_says_enotdir(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["bench-io", "--dir", str(f), "--size", "4MiB", "--engine", "threads"]) == 1
    assert "[Errno 20] not a directory" in capsys.readouterr().err


def test_clean_of_a_missing_directory_says_no_such_directory(tmp_path, capsys):
    assert main(["clean", str(tmp_path / "missing")]) == 1
    assert "[Errno 2] no such directory" in capsys.readouterr().err


# -- 6. the README's exit statuses, as a user reads them (forty-fifth session's README audit) -----

def test_a_failure_is_one_line_on_stderr_also_after_the_kernel_loaded():
    # plan's probe loads the kernel library, whose INFO note ("kernel backend: native") came
    # before the error line: the CLI logs warnings and errors only, unless -v
    proc = subprocess.run([sys.executable, "-m", "offload", "plan", "--params", "1B", "--param-dtype", "fp32",
                           "--master-dtype", "bfloat16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("offload plan: error: "), \
        proc.stderr


def test_no_command_is_a_usage_error_on_stderr(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: offload") and err.rstrip().endswith(
        "offload: error: a command is required"), (out, err)


def test_a_plan_that_does_not_fit_points_at_cheapest(capsys):
    base = ["plan", "--params", "7.5B", "--device-memory", "16GiB", "--host-memory", "64GiB", "--no-probe",
            "--kernel-gparams", "1"]
    assert main(base) == 0
    assert "does not fit: --cheapest searches" in capsys.readouterr().out
    assert main(["plan", "--params", "1M", "--no-probe", "--kernel-gparams", "1"]) == 0
    assert "--cheapest" not in capsys.readouterr().out


def test_plan_json_of_a_swap_dir_that_is_not_utf8_is_valid_utf8(tmp_path, capsys):
    # json.dumps wrote the path's undecodable byte as a lone surrogate, "\udcff": jq refuses it
    import json

    d = os.path.join(os.fsencode(str(tmp_path)), b"sw\xff")
    os.mkdir(d)
    assert main(["plan", "--params", "1B", "--offload", "nvme", "--swap-dir", os.fsdecode(d), "--no-probe",
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert "\\udcff" not in out
    out.encode("utf-8")  # no surrogate left to refuse
    assert json.loads(out)["inputs"]["swap_dir"] == f"{tmp_path}/sw\\xff"
