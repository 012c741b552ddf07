"""The ZeRO paper's table of model-state memory per device (Rajbhandari et al., 2020, figure 1
and table 1): the data-parallel baseline and the three partitioning stages, for Ψ params,
K bytes of optimizer state per param (12 for mixed-precision Adam) and N_d ranks.

``offload plan --params 7.5B --world-size 64 --zero-table`` prints it. The rows are the
paper's arithmetic only (2-byte params and grads, everything on the device); where this
engine puts the same bytes is ``estimate``'s business.
"""
from __future__ import annotations

from typing import Any, Dict, List

from .placement import zero_paper_bytes

__all__ = ["ZERO_ROWS", "zero_table", "format_zero_table"]

# (stage, the paper's name, its formula)
ZERO_ROWS = (
    (0, "baseline", "(2 + 2 + K)Ψ"),
    (1, "P_os", "(2 + 2)Ψ + KΨ/N_d"),
    (2, "P_os+g", "2Ψ + (2 + K)Ψ/N_d"),
    (3, "P_os+g+p", "(2 + 2 + K)Ψ/N_d"),
)


def _check(num_params: Any, world_size: Any, k: Any) -> None:
    for name, v, low in (("num_params", num_params, 0), ("world_size", world_size, 1), ("k", k, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")


def zero_table(num_params: int, world_size: int, k: int = 12) -> List[Dict[str, Any]]:
    """One row per stage: ``stage``, ``name``, ``formula``, ``bytes`` (per device, exact, as a
    float: KΨ/N_d need not be whole) and ``gb`` (10^9 B, one decimal: the paper's figure)."""
    _check(num_params, world_size, k)
    rows = []
    for stage, name, formula in ZERO_ROWS:
        b = zero_paper_bytes(num_params, world_size, stage, k)
        rows.append({"stage": stage, "name": name, "formula": formula, "bytes": b, "gb": round(b / 1e9, 1)})
    return rows


def format_zero_table(num_params: int, world_size: int, k: int = 12) -> str:
    """The table as text, with the inputs substituted."""
    lines = [f"ZeRO paper, model states per device: Ψ = {num_params:,} params, K = {k}, N_d = {world_size} "
             "(2-byte params and grads; GB = 10^9 B)",
             f"  {'stage':<6}{'name':<10}{'formula':<22}{'GB':>10}{'GiB':>10}"]
    for r in zero_table(num_params, world_size, k):
        lines.append(f"  {r['stage']:<6}{r['name']:<10}{r['formula']:<22}{r['bytes'] / 1e9:>10.2f}"
                     f"{r['bytes'] / (1 << 30):>10.2f}")
    return "\n".join(lines)
