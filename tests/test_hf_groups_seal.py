"""The Trainer checkpoint's ``offload_param_groups.json`` is sealed with its crc32 ([Note: sealed
manifests] in offload/swap/fsutil.py) and read before the states: a changed lr or a truncated
file fails the load naming the file, and loads nothing; an older release's bare list loads.
Through the module's own save/load (no transformers needed: the Trainer only calls them)."""
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

import offload
from offload.integrations.hf_checkpoint import GROUPS_FILE, load_trainer_checkpoint, save_trainer_checkpoint
from offload.io import NotRegularFile
from offload.swap import fsutil
from _no_hang import within

ARGS = SimpleNamespace(process_index=0, world_size=1, should_save=True)


def _opt(lr):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (7, 4097)]
    return ps, offload.AdamW(ps, lr=lr, weight_decay=0.01)


def _saved(tmp_path):
    ps, opt = _opt(0.0125)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    save_trainer_checkpoint(str(tmp_path), opt, None, ARGS)
    return opt, tmp_path / GROUPS_FILE


def test_the_groups_round_trip_sealed(tmp_path):
    _, path = _saved(tmp_path)
    assert fsutil.SEAL in json.loads(path.read_text())
    _, new = _opt(0.5)
    load_trainer_checkpoint(str(tmp_path), new, None)
    assert new.param_groups[0]["lr"] == 0.0125 and float(new.state_dict()["state"][1]["step"]) == 1


def _untouched(opt):
    return opt.param_groups[0]["lr"] == 0.5 and not opt.state_dict()["state"]


def test_a_changed_lr_loads_nothing(tmp_path):
    _, path = _saved(tmp_path)
    text = path.read_text()
    new_text = re.sub(r'("lr": ?)0\.0125', r'\g<1>0.0175', text, count=1)
    assert new_text != text
    path.write_text(new_text)
    _, new = _opt(0.5)
    with pytest.raises(ValueError, match=re.escape(f"{path}: the manifest fails its own checksum")):
        load_trainer_checkpoint(str(tmp_path), new, None)
    assert _untouched(new)


def test_a_truncated_file_loads_nothing(tmp_path):
    _, path = _saved(tmp_path)
    path.write_text(path.read_text()[:40])
    _, new = _opt(0.5)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not valid JSON")):
        load_trainer_checkpoint(str(tmp_path), new, None)
    assert _untouched(new)


def test_an_older_bare_list_still_loads(tmp_path):
    _, path = _saved(tmp_path)
    m = fsutil.unsealed(json.loads(path.read_text()), str(path))
    path.write_text(json.dumps(m["param_groups"]))  # as the previous release wrote it
    _, new = _opt(0.5)
    load_trainer_checkpoint(str(tmp_path), new, None)
    assert new.param_groups[0]["lr"] == 0.0125


def test_a_missing_groups_file_loads_nothing(tmp_path):
    _, path = _saved(tmp_path)
    os.unlink(path)
    _, new = _opt(0.5)
    with pytest.raises(FileNotFoundError):
        load_trainer_checkpoint(str(tmp_path), new, None)
    assert _untouched(new)


def test_a_damaged_scheduler_file_loads_nothing(tmp_path):
    from offload.integrations.hf_checkpoint import SCHEDULER_FILE

    ps, opt = _opt(0.0125)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    save_trainer_checkpoint(str(tmp_path), opt, sched, ARGS)
    path = tmp_path / SCHEDULER_FILE
    path.write_bytes(path.read_bytes()[:50])
    _, new = _opt(0.5)
    new_sched = torch.optim.lr_scheduler.LambdaLR(new, lambda s: 0.5 ** s)
    with pytest.raises(ValueError, match=re.escape(f"{path}: the scheduler's state cannot be read")):
        load_trainer_checkpoint(str(tmp_path), new, new_sched)
    assert _untouched(new) and new_sched.last_epoch == 0


@pytest.mark.parametrize("what", ["FIFO", "directory"])
def test_a_fifo_or_directory_in_the_groups_files_place_is_refused_naming_it(tmp_path, what):
    # the groups file's open blocked forever on a FIFO ([Note: a FIFO where a file was] in
    # offload/io/files.py); and the load said "the job died while saving it" for either
    _, path = _saved(tmp_path)
    os.unlink(path)
    os.mkfifo(path) if what == "FIFO" else os.mkdir(path)
    _, new = _opt(0.5)
    with within(5), pytest.raises(NotRegularFile, match=f"not a regular file \\(a {what}\\)") as e:
        load_trainer_checkpoint(str(tmp_path), new, None)
    assert e.value.filename == str(path)
    assert _untouched(new)


def test_a_groups_file_of_bytes_that_are_not_text_loads_nothing(tmp_path):
    _, path = _saved(tmp_path)
    path.write_bytes(b"\xff\xfe\x00" + path.read_bytes())  # a bare UnicodeDecodeError, naming no file
    _, new = _opt(0.5)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not valid JSON")):
        load_trainer_checkpoint(str(tmp_path), new, None)
    assert _untouched(new)
