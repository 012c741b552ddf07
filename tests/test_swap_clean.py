"""`offload clean`: all or nothing per directory, and no empty path."""
from __future__ import annotations

import os

import pytest

from offload.cli import main
from offload.swap import SwapLayout, SwapStore
from offload.swap.cleanup import clean_dir


def _left(d):
    st = SwapStore(str(d), SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
    path = st.path
    st.close(remove=False)
    return path


@pytest.mark.parametrize("dry_run", [False, True])
def test_clean_skips_a_directory_with_a_subdirectory_whole(tmp_path, capsys, dry_run):
    path = _left(tmp_path)
    before = sorted(os.listdir(path))
    os.mkdir(os.path.join(path, "extra"))
    assert main(["clean"] + (["--dry-run"] if dry_run else []) + [str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"skipped {path}: unexpected non-file entry in a swap directory; removed nothing" in out
    assert sorted(os.listdir(path)) == sorted(before + ["extra"])  # nothing was removed
    os.rmdir(os.path.join(path, "extra"))
    res = clean_dir(str(tmp_path))
    assert [p for p, _ in res["removed"]] == [path] and os.listdir(tmp_path) == []


def test_clean_refuses_an_empty_path(tmp_path, capsys, monkeypatch):
    _left(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["clean", ""]) == 1
    assert "swap_dir must name a directory, got ''" in capsys.readouterr().err
    assert len(os.listdir(tmp_path)) == 1  # the current directory was not scanned
    with pytest.raises(ValueError, match="must name a directory"):
        clean_dir("")
    clean_dir(str(tmp_path))
