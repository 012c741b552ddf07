"""The planner's answer: bytes per rank and tier, what fits, and the predicted step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .placement import OPTIMIZER_COMPONENTS, TIERS, zero_paper_bytes
from .render import explain_text, plan_table

__all__ = ["Plan"]


@dataclass
class Plan:
    """Bytes per rank and tier, what fits, and the predicted optimizer step."""

    inputs: Dict[str, Any]
    """Normalised inputs (dtype names as strings, sizes in bytes)."""
    breakdown: Dict[str, Dict[str, int]]
    """tier -> component -> bytes per rank (components in ``COMPONENTS``)."""
    capacity: Dict[str, Optional[int]]
    """``device``, ``host`` (per rank share of the node's memory) and ``nvme`` (free space)."""
    step: Dict[str, Any]
    """Predicted optimizer step: ``kernel_s``, ``io_s``, ``read_bytes``, ``write_bytes``,
    ``step_time_s`` (``None`` where a rate is unknown), and the rates used."""
    supported: bool = True
    """False for a configuration this engine does not offer (none at present: stage 3 is
    planned with ``offload.shard``'s layout)."""
    notes: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    """Reasons the engine would refuse this configuration (it then does not fit)."""
    sharding: Dict[str, Any] = field(default_factory=dict)
    """``offload_params`` and ``release_grads``; at stage 3 also the units, this rank's shard,
    the live window and the per-step I/O split (``io``), see offload/plan/stage3.py."""

    # derived views -------------------------------------------------------------------------
    @property
    def per_rank(self) -> Dict[str, int]:
        """tier -> bytes per rank."""
        return {t: sum(self.breakdown[t].values()) for t in TIERS}

    @property
    def optimizer_bytes(self) -> Dict[str, int]:
        """tier -> bytes the optimizer allocates itself (no user params or grads)."""
        return {t: sum(v for c, v in self.breakdown[t].items() if c in OPTIMIZER_COMPONENTS) for t in TIERS}

    @property
    def host_bytes(self) -> int:
        return self.per_rank["pinned"] + self.per_rank["pageable"]

    @property
    def fits(self) -> Dict[str, Optional[bool]]:
        """``device``/``host``/``nvme`` -> True, False or None (capacity not given)."""
        need = {"device": self.per_rank["device"], "host": self.host_bytes, "nvme": self.per_rank["nvme"]}
        out: Dict[str, Optional[bool]] = {}
        for k, n in need.items():
            cap = self.capacity.get(k)
            out[k] = None if cap is None else n <= cap
        return out

    @property
    def fits_all(self) -> bool:
        """Supported and no tier known to overflow (an unknown capacity counts as fitting)."""
        return self.supported and not self.problems and all(v is not False for v in self.fits.values())

    @property
    def step_time_s(self) -> Optional[float]:
        return self.step.get("step_time_s")

    @property
    def zero_paper_bytes(self) -> float:
        i = self.inputs
        return zero_paper_bytes(i["num_params"], i["world_size"], i["stage"], i["k"])

    def to_dict(self) -> Dict[str, Any]:
        """The stable JSON form (``offload plan --json``); keys pinned by a test."""
        return {
            "schema": "offload.plan/1",
            "inputs": dict(self.inputs),
            "supported": self.supported,
            "per_rank": self.per_rank,
            "breakdown": {t: dict(self.breakdown[t]) for t in TIERS},
            "optimizer_bytes": self.optimizer_bytes,
            "capacity": dict(self.capacity),
            "fits": self.fits,
            "fits_all": self.fits_all,
            "step": dict(self.step),
            "zero_paper_bytes": int(round(self.zero_paper_bytes)),
            "notes": list(self.notes),
            "problems": list(self.problems),
            "sharding": dict(self.sharding),
        }

    def explain(self) -> str:
        return explain_text(self)

    def table(self) -> str:
        return plan_table(self)
