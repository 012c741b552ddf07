"""``offload clean DIR``: remove swap directories left by killed processes.

A swap directory whose ``flock`` is free belongs to no live process (``kill -9``, a crash, a
lost node); it still holds a full copy of the optimizer states. Directories in use are
listed with the pid holding them and left alone, and so are directories whose contents do
not show that offload made them (no lock file holding a pid, or a manifest.json that is not
offload's). The test files a killed ``offload bench-io`` left (``offload-bench-io.<pid>.dat``,
unlocked) are removed too; one in use is left alone, and a file kept with ``--keep``
(another name) is not touched.
"""
from __future__ import annotations

import argparse
import os

__all__ = ["add_parser", "run"]


def add_parser(subparsers: "argparse._SubParsersAction", name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="remove swap directories left by killed processes",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("swap_dir", metavar="DIR", help="the swap_dir given to the optimizer")
    p.add_argument("-n", "--dry-run", action="store_true", help="only say what would be removed")
    p.set_defaults(run=run)
    return p


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def run(args: argparse.Namespace) -> int:
    from offload.swap.cleanup import clean_dir

    res = clean_dir(args.swap_dir, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path, nbytes in res["removed"]:
        print(f"{verb} {path} ({_gib(nbytes)}; its process is gone)")
    for path, pid in res["held"]:
        if pid < 0:  # [Note: a directory being made] in offload/swap/fsutil.py
            print(f"kept {path}: being made, or locked by a process that has not written its pid yet")
        else:
            print(f"kept {path}: in use by live process {pid}")
    for path, why in res["skipped"]:
        print(f"skipped {path}: {why}")
    if not any(res.values()):
        print(f"no offload swap directories or bench-io test files in {args.swap_dir}")
    total = sum(n for _, n in res["removed"])
    files = sum(1 for path, _ in res["removed"] if os.path.basename(path).startswith("offload-bench-io."))
    dirs = len(res["removed"]) - files
    also = f" and {files} bench-io test file{'' if files == 1 else 's'}" if files else ""
    print(f"{verb} {dirs} director{'y' if dirs == 1 else 'ies'}{also}, {_gib(total)}; {len(res['held'])} in use")
    return 0
