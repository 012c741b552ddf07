"""``offload info``: what this machine offers the engine, and why a piece is missing.

The ``ds_report`` of this project: versions, CPU and the ISA that runs, each kernel backend
with the reason it is or is not available, threads, CUDA, io_uring, transparent huge pages
and the locked-memory limit.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import sys
from typing import Any, Dict

__all__ = ["add_parser", "run", "collect", "cpu_model"]


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="report versions, CPU ISA, backends, io_uring, huge pages")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (benchmarks print it too)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def _memlock() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes ({soft / 2**20:.0f} MiB)"


def _io_status() -> Dict[str, Any]:
    try:
        from offload.io import engine_status
    except ImportError as exc:
        return {"error": f"io layer unavailable: {exc}"}
    return engine_status()


def collect() -> Dict[str, Any]:
    import torch

    from offload._version import __version__
    from offload.kernels import backend_status, get_backend, get_num_threads, native_isa, supported_isas

    backends = {name: {"available": ok, "reason": reason} for name, (ok, reason) in backend_status().items()}
    try:
        selected = get_backend().name
    except (RuntimeError, ValueError) as exc:
        selected = f"none ({exc})"
    try:
        isa = native_isa()
    except (RuntimeError, ValueError) as exc:  # no native library, or a bad OFFLOAD_ISA
        isa = f"unavailable ({exc})"
    if isa is None:  # native_isa() says None without the library: the table printed "None"
        isa = f"unavailable ({backends.get('native', {}).get('reason') or 'no native library'})"
    try:
        prefetch = get_backend("native").prefetch_setting()
    except (RuntimeError, ValueError) as exc:  # no native library, or a bad OFFLOAD_PREFETCH
        prefetch = f"unavailable ({exc})"
    try:
        pool = get_backend("native").pool_setting()
    except (RuntimeError, ValueError) as exc:  # no native library, or a bad OFFLOAD_POOL
        pool = f"unavailable ({exc})"
    cuda = torch.cuda.is_available()
    return {
        "offload": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "isa_supported": list(supported_isas()),
        "isa_selected": isa,
        "prefetch": prefetch,
        "thread_pool": pool,
        "backend_selected": selected,
        "backends": backends,
        "num_threads": get_num_threads(),
        "torch_num_threads": torch.get_num_threads(),
        "cuda": {
            "available": cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "version": torch.version.cuda,
        },
        "io": _io_status(),
        "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "ulimit_memlock": _memlock(),
    }


def _render(info: Dict[str, Any]) -> str:
    rows = [
        ("offload", info["offload"]),
        ("python", info["python"]),
        ("torch", info["torch"]),
        ("platform", info["platform"]),
        ("cpu", f"{info['cpu']} ({info['cpu_count']} logical CPUs)"),
        ("ISA supported", ", ".join(info["isa_supported"]) or "none"),
        ("ISA selected", info["isa_selected"]),
        ("software prefetch", info["prefetch"]),
        ("kernel thread pool", info["thread_pool"]),
        ("kernel backend", info["backend_selected"]),
    ]
    for name, st in info["backends"].items():
        rows.append((f"  {name}", ("yes" if st["available"] else "NO") + (f": {st['reason']}" if st["reason"] else "")))
    rows.append(("kernel threads", f"{info['num_threads']} (torch: {info['torch_num_threads']})"))
    cuda = info["cuda"]
    rows.append(("CUDA", ", ".join(cuda["devices"]) if cuda["available"] else f"not available (torch built with CUDA {cuda['version']})"))
    for key, value in info["io"].items():
        rows.append((f"io {key}", str(value)))
    rows.append(("transparent huge pages", info["transparent_hugepage"]))
    rows.append(("ulimit -l", info["ulimit_memlock"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print(_render(info))
    return 0
