"""Every numeric option of `offload plan`, `offload bench-io` and `offload demo` refuses a
bad value as a usage error: exit status 2 and a message naming the option, never a
traceback (`--params 1e400` was an OverflowError)."""
from __future__ import annotations

import contextlib
import io
import os

import pytest


def _cli(*argv: str):
    from offload.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


PLAN = ("plan", "--no-probe")
PLAN_BAD = [
    ("--params", "1e400", "too large"),
    ("--params", "nan", "invalid parameter count"),
    ("--params", "inf", "invalid parameter count"),
    ("--params", "-1", ">= 0"),
    ("--params", "abc", "invalid parameter count"),
    ("--params", "1.5", "whole number"),              # was rounded to 2 params
    ("--params", "1.0000000001B", "whole number"),    # was rounded to 1,000,000,000
    ("--unit-params", "2.5", "whole number"),
    ("--unit-params", "0", ">= 1"),       # was exit 1, from the planner, after parsing
    ("--max-live-params", "0", ">= 1"),
    ("--world-size", "0", ">= 1"),
    ("--world-size", "-1", ">= 1"),
    ("--world-size", "1e400", "whole number"),
    ("--world-size", "2.5", "whole number"),
    ("--stage", "4", "<= 3"),
    ("--stage", "-1", ">= 0"),
    ("--ranks-per-node", "0", ">= 1"),
    ("--sub-group-size", "nan", "whole number"),
    ("--sub-group-size", "-3", ">= 1"),
    ("--device-memory", "1e400GiB", "too large"),
    ("--device-memory", "-1", ">= 0"),
    ("--host-memory", "abc", "invalid byte size"),
    ("--host-memory", "nan", "invalid byte size"),
    ("--max-host-bytes", "1e400GiB", "too large"),
    ("--max-host-bytes", "0", "> 0"),
    ("--max-host-bytes", "-1", ">= 0"),
    ("--nvme-capacity", "1e400", "too large"),
    ("--nvme-capacity", "inf", "invalid byte size"),
    ("--disk-gbps", "nan", "finite number > 0"),
    ("--disk-gbps", "inf", "finite number > 0"),
    ("--disk-read-gbps", "-1", "finite number > 0"),
    ("--disk-write-gbps", "0", "finite number > 0"),
    ("--kernel-gparams", "1e400", "finite number > 0"),
    ("--kernel-gparams", "abc", "expected a number"),
]


@pytest.mark.parametrize("option,value,fragment", PLAN_BAD)
def test_plan_numeric_options_are_usage_errors(option, value, fragment):
    args = list(PLAN) + ([] if option == "--params" else ["--params", "1B"]) + [f"{option}={value}"]
    rc, out, err = _cli(*args)
    assert rc == 2, (rc, out, err)
    assert f"argument {option}: " in err and fragment in err, err
    assert "Traceback" not in err and not out


BENCH_BAD = [
    ("--size", "1e400GiB", "too large"),
    ("--size", "-1", ">= 0"),
    ("--size", "abc", "invalid byte size"),
    ("--size", "0", "> 0"),
    ("--size", "1e30", "more than 2**62 bytes"),  # was an OverflowError from posix_fallocate
    ("--size", "9223372036854775807", "more than 2**62 bytes"),
    ("--block-size", "1e400", "too large"),
    ("--block-size", "1M,-1", ">= 0"),
    ("--block-size", "0", "> 0"),
    ("--block-size", "3", "multiple of 4096"),   # was exit 1, after parsing (while 0 was 2)
    ("--block-size", "1M,6K", "multiple of 4096"),
    ("--queue-depth", "0", ">= 1"),
    ("--queue-depth", "8,1e400", "whole number"),
    ("--queue-depth", "99999999999", "io_uring's largest ring"),
    ("--queue-depth", "8,32,8", "8 given more than once"),  # a row twice in one table
    ("--block-size", "1M,1024K", "1048576 given more than once"),
    ("--engine", "uring,threads,uring", "uring given more than once"),
    ("--rw", "read,read", "read given more than once"),
    ("--loops", "0", ">= 1"),
    ("--loops", "abc", "whole number"),
]


@pytest.mark.parametrize("option,value,fragment", BENCH_BAD)
def test_bench_io_numeric_options_are_usage_errors(tmp_path, option, value, fragment):
    rc, out, err = _cli("bench-io", "--dir", str(tmp_path), f"{option}={value}")
    assert rc == 2, (rc, out, err)
    assert f"argument {option}: " in err and fragment in err, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # refused before the test file was made


def test_bench_io_refuses_an_empty_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _cli("bench-io", "--dir", "", "--size", "1M")
    assert rc == 2 and "argument --dir: an empty path" in err, (rc, err)
    assert list(tmp_path.iterdir()) == []  # the current directory was not measured


@pytest.mark.parametrize("option,value,fragment", [
    ("--params", "1e400", "too large"),
    ("--params", "-5", ">= 0"),
    ("--max-host-bytes", "1e400GiB", "too large"),
    # `args.x or default` made these 0s the defaults: a 30-step run, a 10M model, ...
    ("--steps", "0", ">= 1"),
    ("--params", "0", ">= 10,000"),
    ("--batch-size", "0", ">= 1"),
    ("--seq-len", "0", ">= 1"),
    ("--threads", "0", ">= 1"),
    ("--compare-steps", "-1", ">= 0"),
    ("--max-host-bytes", "0", "> 0"),   # was exit 1, after a "host budget:" line
    ("--rtol", "-1", "finite number >= 0"),
    ("--rtol", "nan", "finite number >= 0"),
    ("--lr", "inf", "finite number > 0"),
])
def test_demo_numeric_options_are_usage_errors(option, value, fragment):
    rc, out, err = _cli("demo", f"{option}={value}")
    assert rc == 2 and f"argument {option}: " in err and fragment in err, err


def test_good_values_still_reach_the_plan():
    import json

    rc, out, err = _cli("plan", "--params", "1.5B", "--world-size", "4", "--stage", "2", "--ranks-per-node", "2",
                        "--host-memory", "256GiB", "--device-memory", "80GiB", "--max-host-bytes", "2GiB",
                        "--nvme-capacity", "1e12", "--offload", "nvme", "--kernel-gparams", "2.5",
                        "--disk-read-gbps", "3", "--disk-write-gbps", "1.5", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    i = doc["inputs"]
    assert (i["num_params"], i["world_size"], i["stage"], i["ranks_per_node"], i["max_host_bytes"]) == \
        (1_500_000_000, 4, 2, 2, 2 << 30)
    assert doc["capacity"] == {"device": 80 << 30, "host": (256 << 30) // 2, "nvme": 10 ** 12 // 2}
    assert doc["step"]["kernel_gparams"] == 2.5 and doc["step"]["disk_write_gbps"] == 1.5


@pytest.mark.parametrize("value,count", [("1.1B", 1_100_000_000), ("7.5B", 7_500_000_000), ("1.5k", 1_500),
                                         ("1.23456789e9", 1_234_567_890), (7.5e9, 7_500_000_000), ("0.5k", 500)])
def test_parse_count_takes_decimals_that_are_whole_counts(value, count):
    from offload.plan import parse_count

    assert parse_count(value) == count


@pytest.mark.parametrize("value", ["1.5", 1.5, "0.0001k"])
def test_parse_count_refuses_a_fraction_of_a_param(value):
    from offload.plan import parse_count

    with pytest.raises(ValueError, match="whole number"):
        parse_count(value)


def test_parse_count_refuses_a_count_too_large_to_hold():
    from offload.plan import parse_count

    with pytest.raises(ValueError, match="too large"):
        parse_count("1e400")
    with pytest.raises(ValueError, match="too large"):
        parse_count("1e308B")


@pytest.mark.parametrize("argv,fragment", [
    (("bench-io", "--size", "5M", "--block-size", "2M"), "--size 5242880 is not a multiple of --block-size 2097152"),
    (("demo", "--quick", "--compare-steps", "99"), "--compare-steps must be between 0 and --steps (6), got 99"),
])
def test_options_that_disagree_are_usage_errors_before_any_work(tmp_path, argv, fragment):
    # checks that relate two options ran after parsing, as errors (status 1)
    if argv[0] == "bench-io":
        argv = argv[:1] + ("--dir", str(tmp_path)) + argv[1:]
    rc, out, err = _cli(*argv)
    assert rc == 2 and err == f"offload {argv[0]}: error: {fragment}\n", (rc, err)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_demo_swap_dir_that_is_a_file_is_said_so(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, out, err = _cli("demo", "--quick", "--swap-dir", str(f))
    assert rc == 1 and f"--swap-dir is not a directory: {str(f)!r}" in err and "Errno 20" in err, err
    rc, out, err = _cli("demo", "--quick", "--swap-dir", str(tmp_path / "missing"))
    assert rc == 1 and "--swap-dir does not exist" in err and "Errno 2]" in err, err


@pytest.mark.parametrize("value,got", [("0.3K", "307.2"), ("1e-3K", "1.024"), ("0.0000001K", "0.0001024")])
def test_parse_bytes_refuses_a_fraction_of_a_byte_in_any_unit(value, got):
    # truncated before: 307, 1 and 0 bytes, while "1.3" was refused as not whole
    from offload.config import parse_bytes

    with pytest.raises(ValueError, match=rf"not a whole number of bytes: {got}\)"):
        parse_bytes(value)


@pytest.mark.parametrize("value,n", [("1P", 1 << 50), ("2PiB", 2 << 50), ("1PB", 10 ** 15), ("1E", 1 << 60),
                                     ("4EiB", 1 << 62), ("0.5EiB", 1 << 59), ("1.5K", 1536), ("1024e-3K", None)])
def test_parse_bytes_takes_peta_and_exa_units_within_the_limit(value, n):
    from offload.config import parse_bytes

    if n is None:
        with pytest.raises(ValueError, match="not a whole number of bytes"):
            parse_bytes(value)
    else:
        assert parse_bytes(value) == n
    with pytest.raises(ValueError, match=r"more than 2\*\*62 bytes \(4 EiB\)"):
        parse_bytes("5EiB")


@pytest.mark.parametrize("value", ["1_000", "+5", "\u0661\u0662", "1_0K"])
def test_byte_sizes_and_counts_read_the_same_numbers(value):
    # float() took "1_000", "+5" and Arabic-Indic digits for parse_bytes; parse_count refused them
    from offload.config import parse_bytes
    from offload.plan import parse_count

    with pytest.raises(ValueError, match="invalid byte size"):
        parse_bytes(value)
    with pytest.raises(ValueError, match="invalid parameter count"):
        parse_count(value)


def test_a_fractional_byte_size_is_a_usage_error(tmp_path):
    rc, out, err = _cli("bench-io", "--dir", str(tmp_path), "--size", "0.3K")
    assert rc == 2 and "argument --size: invalid byte size: '0.3K' (not a whole number of bytes" in err, err


@pytest.mark.parametrize("argv", [
    ("bench-io", "--json", "{d}/x", "--tune", "{d}/x"),
    ("bench-io", "--json", "{d}/a.png", "--plot", "{d}/./a.png"),
    ("bench-io", "--plot", "{d}/a.png", "--tune", "{d}/link"),   # a symlink to a.png
    ("demo", "--quick", "--json", "{d}/x", "--step-log", "{d}/x"),
])
def test_two_outputs_naming_one_file_are_a_usage_error(tmp_path, argv):
    # the second output overwrote the first, silently
    os.symlink(tmp_path / "a.png", tmp_path / "link")
    argv = [a.format(d=tmp_path) for a in argv]
    if argv[0] == "bench-io":
        argv[1:1] = ["--dir", str(tmp_path), "--size", "1M"]
    rc, out, err = _cli(*argv)
    first, second = [a for a in argv if a.startswith("--") and a in ("--json", "--plot", "--tune", "--step-log")]
    assert rc == 2 and f"offload {argv[0]}: error: {first} and {second} name the same file" in err, (rc, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]  # nothing measured, nothing written
