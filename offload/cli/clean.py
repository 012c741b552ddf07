"""``offload clean DIR``: remove swap directories left by killed processes.

A swap directory whose ``flock`` is free belongs to no live process (``kill -9``, a crash, a
lost node); it still holds a full copy of the optimizer states. Directories in use are
listed with the pid holding them and left alone.
"""
from __future__ import annotations

import argparse

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
        print(f"kept {path}: in use by live process {pid}")
    for path, why in res["skipped"]:
        print(f"skipped {path}: {why}")
    if not any(res.values()):
        print(f"no offload swap directories in {args.swap_dir}")
    total = sum(n for _, n in res["removed"])
    print(f"{verb} {len(res['removed'])} director{'y' if len(res['removed']) == 1 else 'ies'}, {_gib(total)}; "
          f"{len(res['held'])} in use")
    return 0
