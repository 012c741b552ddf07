"""swap/fstype.py: a swap_dir on a kernel interface file system (/proc, /sys, cgroup) is
refused up front naming it; before, it failed at the first mkdir or write with a bare errno
("No such file or directory: '/proc/offload-run.rank0'"), or made a control group."""
from __future__ import annotations

import errno

import pytest
import torch

import offload
from offload.swap.fstype import PSEUDO_FILE_SYSTEMS, _unescape, filesystem_type


def _pseudo_mounts():
    found = {}
    with open("/proc/self/mounts") as fh:
        for line in fh:
            dev, mnt, fstype = line.split()[:3]
            if fstype in PSEUDO_FILE_SYSTEMS and fstype not in found:
                found[fstype] = _unescape(mnt)
    return sorted(found.items())


@pytest.mark.parametrize("fstype, mnt", _pseudo_mounts())
def test_a_swap_dir_on_a_kernel_interface_is_refused_naming_it(fstype, mnt):
    assert filesystem_type(mnt) == fstype
    p = torch.nn.Parameter(torch.randn(37))
    with pytest.raises(OSError, match=rf"swap_dir is on a {fstype} file system \(a kernel interface") as info:
        offload.AdamW([p], offload="nvme", swap_dir=mnt)
    assert info.value.errno == errno.EINVAL and info.value.filename == mnt


def test_proc_is_among_them():
    assert ("proc", "/proc") in _pseudo_mounts()  # (the test above is not empty on any Linux)


def test_a_disk_directory_is_not_refused(tmp_path):
    assert filesystem_type(str(tmp_path)) not in PSEUDO_FILE_SYSTEMS
    p = torch.nn.Parameter(torch.randn(37))
    offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path)).close()


def test_mount_points_are_unescaped_as_the_kernel_escapes_them():
    assert _unescape("/mnt/my\\040disk\\011x\\134y") == "/mnt/my disk\tx\\y"


@pytest.mark.parametrize("offload_to", ["cpu", "nvme"])
def test_a_checkpoint_directory_on_a_kernel_interface_is_refused_naming_it(tmp_path, offload_to):
    # It failed at its mkdir with a bare "No such file or directory: '/proc/...'" (and on a
    # writable cgroup2 mount, made a control group: /proc only here, where a mkdir cannot succeed).
    p = torch.nn.Parameter(torch.randn(37))
    kw = {"swap_dir": str(tmp_path)} if offload_to == "nvme" else {}
    opt = offload.AdamW([p], lr=1e-2, offload=offload_to, **kw)
    try:
        p.grad = torch.ones_like(p)
        opt.step()
        with pytest.raises(OSError, match=r"checkpoint directory is on a proc file system") as info:
            opt.save_checkpoint("/proc/offload-checkpoint-test")
        assert info.value.errno == errno.EINVAL and info.value.filename.startswith("/proc/offload-checkpoint-test")
    finally:
        opt.close()
