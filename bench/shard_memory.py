"""Stage 3 with params on NVMe: host memory that does not grow with the model (issue #16).

    .venv/bin/python bench/shard_memory.py                          # 125M, 1B, 2B bf16, 3 steps each
    .venv/bin/python bench/shard_memory.py --sizes 125M,1B --steps 2
    .venv/bin/python bench/shard_memory.py --sizes 1B --compare-ram --repeat 3 # + params in RAM (the prefetch target)

Each size runs in its own process (its peak RSS is its own): a TinyGPT of ``--d-model``
(the same for every size, so the fetch units are the same size and only their number grows)
in bf16, ``offload.shard(offload_params="nvme")``, ``offload.AdamW(offload="nvme",
max_host_bytes=--host)``, the demo's loop on ``--batch`` x ``--seq`` tokens. Printed per size:

- peak RSS while training (VmHWM reset after the model is built: /proc/self/clear_refs) and
  while building (on the meta device, materialized unit by unit by ``offload.shard``'s
  ``init_fn``), against 1.15 x (host budget + activations + interpreter): the interpreter is
  the RSS before the model is built, the activations the bytes autograd saves in a forward
  (``saved_tensors_hooks``; the params' own memory left out): a few MB at 1 x 32 tokens;
- per step (median of the steps after the first): forward + backward, of which the param
  tier's reads and grad writes (bytes and seconds), and the optimizer step with its state I/O
  (``opt.step_stats()``), against the disk's limit (``--read-gbs`` / ``--write-gbs``, from
  ``offload bench-io``).

``--compare-ram`` also runs forward + backward with the params in RAM (``offload_params="cpu"``)
for the prefetch target: fwd+bwd on NVMe <= 1.25 x max(fwd+bwd in RAM, param bytes read / read rate);
``--repeat K`` makes that K pairs of runs (NVMe, then RAM, back to back) and reports each
pair's ratio and their median (a fwd+bwd on this VM moves by ~1.5x from one run to the next).
Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

GiB = float(1 << 30)


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _layers(params: float, d: int, vocab: int) -> int:
    return max(1, round((params - vocab * d) / (12 * d * d)))


def _worker(a: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    import torch.nn.functional as F

    import offload
    from offload.demo.model import GPTConfig, TinyGPT
    from offload.shard import runtime_of

    torch.manual_seed(0)
    interp = _status("VmRSS")
    cfg = GPTConfig(n_layer=_layers(a.params, a.d_model, 256), d_model=a.d_model, n_head=max(1, a.d_model // 128),
                    block_size=a.seq)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):  # never whole in memory: materialized unit by unit by shard()
        model = TinyGPT(cfg)
    torch.set_default_dtype(torch.float32)
    nparams = sum(p.numel() for p in model.parameters())
    parent = tempfile.mkdtemp(prefix="shard-mem-", dir=a.swap_dir)

    def init(m: torch.nn.Module) -> None:  # TinyGPT's init, module by module
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)
        if isinstance(m, torch.nn.LayerNorm):
            m.reset_parameters()

    try:
        model = offload.shard(model, offload_params=a.offload_params,
                              swap_dir=parent if a.offload_params == "nvme" else None, prefetch=a.prefetch,
                              init_fn=init)
        build_peak = _status("VmHWM")
        opt = offload.AdamW(model.parameters(), lr=1e-4, offload="nvme", swap_dir=parent, max_host_bytes=a.host)
        rt = runtime_of(model)
        tier = rt.tier
        g = torch.Generator().manual_seed(0)
        rows: List[Dict[str, float]] = []
        peaks: List[int] = []
        _reset_peak()
        params_at = {f.full.untyped_storage().data_ptr() for u in rt.units for f in u.flats}
        for step in range(a.steps):
            x = torch.randint(0, 256, (a.batch, a.seq), generator=g)
            r0 = (tier.bytes_read, tier.bytes_written) if tier else (0, 0)
            hwm = _status("VmHWM")  # the peak so far; each phase's own peak below
            _reset_peak()
            saved: Dict[int, int] = {}

            def pack(t):  # the activations: what autograd saves, the params' own memory left out
                st = t.untyped_storage()
                if st.data_ptr() not in params_at and st.device.type == "cpu":
                    saved[st.data_ptr()] = st.nbytes()
                return t

            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                _, loss = model(x, torch.roll(x, -1, dims=1))
            tf = time.perf_counter()
            loss.float().backward()
            t1 = time.perf_counter()
            fb_peak = _status("VmHWM")
            _reset_peak()
            r1 = (tier.bytes_read, tier.bytes_written) if tier else (0, 0)
            if not a.fwd_only:
                opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            step_peak = _status("VmHWM")
            _reset_peak()  # clear_refs resets VmHWM to the RSS now: put the run's peak back in the books
            peaks.append(max(hwm, fb_peak, step_peak))
            r2 = (tier.bytes_read, tier.bytes_written) if tier else (0, 0)
            stats = opt.step_stats() if not a.fwd_only else {}
            rows.append({"fwd_bwd_s": t1 - t0, "fwd_s": tf - t0, "bwd_s": t1 - tf, "step_s": t2 - t1,
                         "activations": sum(saved.values()), "loss": float(loss), "fb_peak": fb_peak,
                         "step_peak": step_peak,
                         "fb_read": r1[0] - r0[0], "fb_written": r1[1] - r0[1],
                         "step_read": r2[0] - r1[0], "step_written": r2[1] - r1[1],
                         "stats": {k: v for k, v in (stats.get("last") or stats).items()
                                   if isinstance(v, (int, float))} if isinstance(stats, dict) else {}})
        train_peak = max(peaks + [_status("VmHWM")])
        report = opt.memory_report()
        opt.close()
        print(json.dumps({"params": nparams, "layers": cfg.n_layer, "interp": interp, "build_peak": build_peak,
                          "train_peak": train_peak, "rows": rows, "live_peak": rt.schedule.peak_live,
                          "host_buffers": report.get("pinned_host", 0) + report.get("pageable_host", 0),
                          "tier_disk": tier.disk_bytes if tier else 0}))
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _run(a: argparse.Namespace, params: float, offload_params: str, fwd_only: bool = False) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--params", str(params), "--d-model", str(a.d_model),
           "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq), "--host", a.host,
           "--swap-dir", a.swap_dir, "--offload-params", offload_params, "--prefetch", str(a.prefetch)]
    if fwd_only:
        cmd.append("--fwd-only")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"worker failed ({' '.join(cmd)}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _parse_count(s: str) -> float:
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}
    return float(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else float(s)


def _median(rows: List[Dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in (rows[1:] or rows)]
    return statistics.median(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="125M,1B,2B")
    ap.add_argument("--d-model", type=int, default=1536)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--host", default="2GiB", help="max_host_bytes of the optimizer")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--swap-dir", default="/var/tmp")
    ap.add_argument("--read-gbs", type=float, default=2.4, help="the disk's read rate (offload bench-io)")
    ap.add_argument("--write-gbs", type=float, default=3.0)
    ap.add_argument("--compare-ram", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="--compare-ram: pairs of NVMe / RAM fwd+bwd runs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--params", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--offload-params", default="nvme", help=argparse.SUPPRESS)
    ap.add_argument("--fwd-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a)
        return
    results = []
    print(f"{'params':>8} {'layers':>6} {'train peak':>10} {'build peak':>10} {'bound':>7} {'fwd+bwd':>8} "
          f"{'tier rd':>8} {'tier wr':>8} {'step':>7} {'step/disk':>9}")
    for size in a.sizes.split(","):
        n = _parse_count(size)
        r = _run(a, n, "nvme")
        host = _parse_count(a.host.replace("GiB", "G").replace("MiB", "M")) if "iB" not in a.host else (
            float(a.host[:-3]) * (GiB if a.host.endswith("GiB") else 1 << 20))
        act = max(x["activations"] for x in r["rows"])
        bound = 1.15 * (host + act + r["interp"])
        fb, st = _median(r["rows"], "fwd_bwd_s"), _median(r["rows"], "step_s")
        rd = _median(r["rows"], "fb_read") + _median(r["rows"], "step_read")
        wr = _median(r["rows"], "fb_written") + _median(r["rows"], "step_written")
        # the optimizer's swap I/O: master + moments read and written (12 B/param each way, fp32)
        state_bytes = 12 * r["params"]
        disk_s = (rd + state_bytes) / (a.read_gbs * 1e9) + (wr + state_bytes) / (a.write_gbs * 1e9)
        r.update(size=size, bound=bound, activations=act, fwd_bwd_s=fb, step_s=st, disk_limit_s=disk_s)
        if a.compare_ram:
            # pairs of runs, NVMe then RAM, back to back: this VM's fwd+bwd moves by ~1.5x
            # between runs, so one pair is one sample; the ratio reported is the pairs' median
            param_read = _median(r["rows"], "fb_read")
            # what the disk must do in a forward + backward on NVMe: the param reads, and the
            # grad writes (which the RAM run makes too, the optimizer's states being on NVMe)
            r["fb_disk_s"] = param_read / (a.read_gbs * 1e9) + _median(r["rows"], "fb_written") / (a.write_gbs * 1e9)
            nvme, ratios = r, []
            for i in range(a.repeat):
                if i:
                    nvme = _run(a, n, "nvme", fwd_only=True)
                ram = _run(a, n, "cpu", fwd_only=True)
                nvme_s, ram_s = _median(nvme["rows"], "fwd_bwd_s"), _median(ram["rows"], "fwd_bwd_s")
                ratios.append(nvme_s / max(ram_s, param_read / (a.read_gbs * 1e9)))
                r.setdefault("pairs", []).append({
                    "nvme_fwd_bwd_s": nvme_s, "ram_fwd_bwd_s": ram_s,
                    "nvme_fwd_s": _median(nvme["rows"], "fwd_s"), "ram_fwd_s": _median(ram["rows"], "fwd_s")})
            r["ram_fwd_bwd_s"] = ram_s
            r["prefetch_ratios"] = ratios
            r["prefetch_ratio"] = statistics.median(ratios)
        results.append(r)
        print(f"{size:>8} {r['layers']:>6} {r['train_peak'] / GiB:>9.2f}G {r['build_peak'] / GiB:>9.2f}G "
              f"{bound / GiB:>6.2f}G {fb:>7.2f}s {rd / GiB:>7.2f}G {wr / GiB:>7.2f}G {st:>6.2f}s {st / disk_s:>8.2f}x")
        print(f"{'':>8} peak RSS by phase: fwd+bwd {max(x['fb_peak'] for x in r['rows']) / GiB:.2f}G, step "
              f"{max(x['step_peak'] for x in r['rows']) / GiB:.2f}G")
        if a.compare_ram:
            pairs = ", ".join(f"{p['nvme_fwd_bwd_s']:.2f}/{p['ram_fwd_bwd_s']:.2f}s (fwd {p['nvme_fwd_s']:.2f}/"
                              f"{p['ram_fwd_s']:.2f})" for p in r["pairs"])
            print(f"{'':>8} activations {act / 2**20:.0f} MiB; the disk's share of a fwd+bwd on NVMe (param reads + "
                  f"grad writes at --read-gbs/--write-gbs) {r['fb_disk_s']:.2f}s")
            print(f"{'':>8} fwd+bwd on NVMe / in RAM: {pairs}; NVMe / max(RAM, reads/disk) = "
                  f"{' '.join(f'{x:.2f}' for x in r['prefetch_ratios'])}, median {r['prefetch_ratio']:.2f} "
                  f"(target <= 1.25)")
    peaks = [r["train_peak"] for r in results]
    if len(peaks) > 1:
        print(f"train peaks spread: max/min = {max(peaks) / min(peaks):.3f} (target <= 1.10)")
    print(json.dumps({"bench": "shard_memory", "results": results}))


if __name__ == "__main__":
    main()
