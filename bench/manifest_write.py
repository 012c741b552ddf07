"""What one swap commit's manifest costs: its bytes and the time of its atomic write (JSON,
seal, tmp + fsync + rename + fsync of the directory), by number of params.

    .venv/bin/python bench/manifest_write.py                     # 2,000 and 20,000 params
    .venv/bin/python bench/manifest_write.py --params 500 --reps 50 --dir /var/tmp

Each manifest names every param's shape, dtype and step count (the resume checks) and, since
the twenty-second session, the commit before the last ([Note: a rank one step ahead] in
offload/swap/agreement.py); a step commits one. An ``offload.AdamW(offload="nvme")`` over
``--params`` fp32 params of 1,000 elements takes two steps, then the store's manifest write
is timed alone ``--reps`` times (the median is printed). Run it from another checkout with
PYTHONPATH to compare two versions side by side; the disk's fsync dominates small manifests.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import offload


def measure(nparams: int, reps: int, parent: str) -> dict:
    d = tempfile.mkdtemp(prefix="offload-bench-manifest-", dir=parent)
    try:
        ps = [torch.zeros(1000, requires_grad=True) for _ in range(nparams)]
        opt = offload.AdamW(ps, offload="nvme", swap_dir=d)
        for p in ps:
            p.grad = torch.ones(1000)
        opt.step()
        opt.step()
        store = opt._store.store  # the SwappedState's SwapStore: its manifest write alone
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            store._write_manifest()
            times.append(time.perf_counter() - t)
        size = os.path.getsize(os.path.join(store.path, "manifest.json"))
        opt.close()
        return {"params": nparams, "manifest_bytes": size, "write_ms": 1e3 * statistics.median(times)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="2000,20000", help="comma-separated numbers of params")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dir", default="/var/tmp", help="where the swap directory goes (a real disk)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    print(f"offload from {os.path.dirname(os.path.dirname(offload.__file__))}")
    for n in (int(x) for x in args.params.split(",")):
        if n < 1:
            ap.error("--params must be >= 1")
        r = measure(n, args.reps, args.dir)
        print(f"{r['params']:>7} params: manifest {r['manifest_bytes']:>9,} B, write {r['write_ms']:7.2f} ms (median)")


if __name__ == "__main__":
    main()
