"""`offload report` on damaged step logs: rows of the wrong types are left out with a warning
naming the line, a last line cut by a kill is left out, and no traceback ever reaches the user."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from offload.plan import StepLogger, read_step_log, summarize_step_log
from offload.plan.report import StepLogWarning


def _cli(*argv: str):
    from offload.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _good_log(path, steps=4):
    """Rows with step_s = 10 + s ms and kernel = s ms, s = 1..steps."""
    with StepLogger(path) as lg:
        for s in range(1, steps + 1):
            lg.log(s, phases={"kernel": s * 1e-3}, step_s=0.010 + s * 1e-3, bytes={"nvme": 1 << 20}, rss=1000 + s)


BAD_ROWS = [
    {"step": 9, "phases": 5},
    {"step": 9, "bytes": "lots"},
    {"step": "nine"},
    {"step": 9, "step_s": "abc"},
    {"step": 9, "rss": "lots"},
    {"step": 9, "phases": {"kernel": "fast"}},
    {"step": 9, "bytes": {"nvme": [1]}},
    {"step": 9, "overlap_efficiency": {"x": 1}},
    {"phases": {}},
]


def test_rows_of_the_wrong_types_are_left_out_with_a_warning_naming_the_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    _good_log(path)
    with open(path, "a") as f:
        for row in BAD_ROWS:
            f.write(json.dumps(row) + "\n")
    with pytest.warns(StepLogWarning) as record:
        rows = read_step_log(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    messages = [str(w.message) for w in record]
    assert len(messages) == len(BAD_ROWS)
    for k, msg in enumerate(messages):
        assert f"steps.jsonl:{5 + k}: row left out" in msg
    assert "'phases'" in messages[0] and "5" in messages[0]
    assert "'lots'" in messages[1]

    rc, out, err = _cli("report", str(path), "--json")
    assert rc == 0, err
    assert "Traceback" not in err
    assert err.count("offload report: warning:") == len(BAD_ROWS)
    assert "steps.jsonl:5: row left out" in err and "steps.jsonl:13: row left out" in err
    doc = json.loads(out)
    # only the four good rows: step_s 11..14 ms, kernel 1..4 ms
    assert doc["rows"] == 4 and doc["last_step"] == 4
    assert doc["step_s_mean"] == pytest.approx(0.0125, rel=1e-12)
    assert doc["phase_s_mean"] == {"kernel": pytest.approx(0.0025, rel=1e-12)}
    assert doc["peak_rss"] == 1004 and doc["peak_bytes"]["nvme"] == 1 << 20


def test_a_log_of_only_bad_rows_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 1, "phases": 5}\n{"step": 2, "bytes": "lots"}\n')
    rc, out, err = _cli("report", str(path))
    assert rc == 1 and "Traceback" not in err
    assert "bad.jsonl:1" in err and "bad.jsonl:2" in err and "no rows" in err


@pytest.mark.parametrize("cut", [1, 17, -2])
def test_a_last_line_cut_by_a_kill_is_summarised_up_to_the_cut(tmp_path, cut):
    path = tmp_path / "killed.jsonl"
    _good_log(path, steps=5)
    lines = path.read_text().splitlines(keepends=True)
    # the kill came while row 5 was being written: a prefix of it, no newline
    path.write_text("".join(lines[:4]) + lines[4][:cut])
    with pytest.warns(StepLogWarning, match=r"killed.jsonl:5: last line cut short"):
        rows = read_step_log(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    rc, out, err = _cli("report", str(path))
    assert rc == 0, err
    assert "4 steps logged (1..4)" in out
    assert "step: mean 12.50 ms" in out
    assert "killed.jsonl:5: last line cut short" in err and "Traceback" not in err


def test_a_complete_line_that_is_not_json_is_still_an_error(tmp_path):
    # Only a last line without its newline can be a kill's doing; a whole line of garbage
    # means the file is not a step log.
    path = tmp_path / "mixed.jsonl"
    _good_log(path, steps=2)
    with open(path, "a") as f:
        f.write('{"step": 3, "phases"\n')
    rc, _, err = _cli("report", str(path))
    assert rc == 1 and "mixed.jsonl:3: not a JSON line" in err


def test_summary_of_rows_read_back_is_unchanged_by_the_checks(tmp_path):
    path = tmp_path / "ok.jsonl"
    _good_log(path, steps=3)
    with open(path, "a") as f:
        # readers ignore keys they do not know, and null where the schema allows it
        f.write(json.dumps({"step": 4, "step_s": None, "overlap_efficiency": None, "rss": None,
                            "phases": None, "bytes": {"nvme": 5, "tape": "lots"}, "extra": [1]}) + "\n")
    rows = read_step_log(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    s = summarize_step_log(rows)
    assert s["step_s_mean"] == pytest.approx(0.012, rel=1e-12)
    assert s["peak_bytes"]["nvme"] == 1 << 20


def test_a_binary_file_is_named_as_not_a_step_log(tmp_path):
    # A UnicodeDecodeError alone: "error: 'utf-8' codec can't decode byte 0xa1 ...", no file named.
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\xa1\xff\x00binary")
    rc, _, err = _cli("report", str(path))
    assert rc == 1 and f"{path}: not a step log: not UTF-8 text" in err and "Traceback" not in err, err
