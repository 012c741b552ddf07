"""A step log appended to after a kill: the cut row never ends up in the middle of the file."""
from __future__ import annotations

import pytest

from offload.plan import StepLogger, read_step_log
from offload.plan.report import StepLogWarning


def _write(path, steps, append=False):
    with StepLogger(path, append=append) as log:
        for s in steps:
            log.log(s, phases={"kernel": 0.01}, step_s=0.0125, bytes={"pinned": 1 << 20}, rss=1 << 30)


@pytest.mark.parametrize("cut", [1, 17, -2])
def test_appending_after_a_kill_drops_the_cut_row(tmp_path, cut):
    path = tmp_path / "run.jsonl"
    _write(path, [1, 2, 3])
    text = path.read_text()
    last = text.rstrip("\n").rfind("\n") + 1
    path.write_text(text[:last] + text[last:][:cut])  # killed while row 3 was written
    with pytest.warns(StepLogWarning, match="dropped a last row cut short"):
        _write(path, [3, 4], append=True)  # the resumed run
    rows = read_step_log(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert path.read_text().count("\n") == 4


def test_appending_to_a_whole_log_changes_nothing_before(tmp_path, recwarn):
    path = tmp_path / "run.jsonl"
    _write(path, [1, 2])
    before = path.read_bytes()
    _write(path, [3], append=True)
    assert path.read_bytes().startswith(before)
    assert [r["step"] for r in read_step_log(path)] == [1, 2, 3]
    assert not [w for w in recwarn if issubclass(w.category, StepLogWarning)]


def test_a_one_line_fragment_is_dropped_whole(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text('{"schema": "offload.steplog/1", "st')  # killed during the very first row
    with pytest.warns(StepLogWarning, match="35 bytes"):
        _write(path, [1], append=True)
    assert [r["step"] for r in read_step_log(path)] == [1]


def test_a_cut_row_left_mid_file_by_an_older_release_is_left_out(tmp_path):
    path = tmp_path / "old.jsonl"
    _write(path, [1, 2])
    lines = path.read_text().splitlines(keepends=True)
    # the resumed run's first row was written right after the fragment, on the same line
    path.write_text(lines[0] + lines[1][:20] + lines[0].replace('"step": 1', '"step": 3'))
    with pytest.warns(StepLogWarning, match="old.jsonl:2: a row cut short by a kill is glued"):
        rows = read_step_log(path)
    assert [r["step"] for r in rows] == [1, 3]


def test_a_glued_line_with_no_whole_row_is_still_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write(path, [1])
    with open(path, "a") as f:
        f.write('{"bytes": {"nvme": 1}, "st{"bytes": 7\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        read_step_log(path)
