"""What the compressed-state benches share (state_accuracy.py, adam.py, swap.py, e2e.py).

- ``parse_list``: a comma-separated option checked against its allowed values.
- ``nominal_bytes``: bytes per param of master + states for a row, from the fields
  (``Rule.with_state_dtype``), as the issue counts them (12 for fp32 Adam, ~4 for int8 states
  with a bf16 master).
- ``CompressedCalls``: counts the kernel backend's compressed-step calls while a block runs.
  A store that does not know ``state_dtype`` yet steps float32 states without a word (the
  option is only stored on the optimizer), so a bench that trusted the option would print a
  float32 figure under an int8 label. Every compressed row is therefore checked: the step
  must have reached ``backend._compressed`` with the asked storage, else the row says so
  and prints no number.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional, Sequence, Tuple

import torch

STATE_DTYPES = ("float32", "bfloat16", "int8")
MASTER_DTYPES = ("float32", "bfloat16")
LARGE = 1 << 20  # a param size where the packed blocks' absmax overhead is at its limit


def parse_list(text: str, allowed: Sequence[str], what: str) -> Tuple[str, ...]:
    """``"a,b"`` -> ("a", "b"), each in ``allowed`` (ValueError naming the option otherwise)."""
    items = tuple(s.strip() for s in str(text).split(",") if s.strip())
    if not items:
        raise ValueError(f"{what}: expected a comma-separated list of {list(allowed)}, got {text!r}")
    bad = [s for s in items if s not in allowed]
    if bad:
        raise ValueError(f"{what}: unknown value(s) {bad}; expected some of {list(allowed)}")
    return tuple(dict.fromkeys(items))  # order kept, duplicates dropped


def adam_rule(state_dtype: str):
    from offload.kernels.fields import ADAM

    return ADAM.with_state_dtype(state_dtype)


def states_bytes(state_dtype: str, rule=None) -> float:
    """Bytes per param of the states alone (packed 8-bit blocks: 260 bytes per 256)."""
    rule = rule if rule is not None else adam_rule(state_dtype)
    return sum(f.nbytes(LARGE) for f in rule.fields) / LARGE


def nominal_bytes(param_dtype: str, state_dtype: str, master_dtype: Optional[str]) -> float:
    """Master + states per param: an fp32 param is its own master (4); a bf16 param has an
    fp32 master (4 more than its own 2) unless ``master_dtype="bfloat16"`` (then 2 in all)."""
    if param_dtype == "float32":
        master = 4.0
    else:
        master = 2.0 if master_dtype == "bfloat16" else 6.0
    return master + states_bytes(state_dtype)


def row_label(param_dtype: str, state_dtype: str, master_dtype: Optional[str]) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
    label = f"{short[param_dtype]} params, {short[state_dtype]} states"
    if param_dtype == "bfloat16":
        label += f", {short[master_dtype or 'float32']} master"
    return label


class CompressedCalls:
    """Counts ``backend._compressed`` calls (the one seam every compressed step goes through,
    offload/kernels/_rule_step.py) while the ``with`` block runs: how many, and of which kind
    (param dtype, each state field's dtype and block, whether bf16 states round stochastically).

    ``force_stochastic`` (True / False): the bf16 states' rounding of every call, whatever the
    optimizer asked, so that both roundings can be compared on the same kernels where the
    optimizer offers only one (its default is then what ``summary()["stochastic_states"]``
    says of a run without forcing)."""

    def __init__(self, backend, force_stochastic: Optional[bool] = None) -> None:
        self.backend = backend
        self.force = force_stochastic
        self.calls = 0
        self.kinds: Counter = Counter()

    def __enter__(self) -> "CompressedCalls":
        inner = self.backend._compressed
        self._had_own = "_compressed" in vars(self.backend)

        def counted(method, fields, param, *rest):
            q = rest[-1]  # QuantArgs, the last argument of _compressed
            if self.force is not None:
                q = q._replace(stochastic_states=self.force)
            self.calls += 1
            self.kinds[(str(param.dtype).replace("torch.", ""),
                        tuple((f.dtype_name, f.block) for f in fields), bool(q.stochastic_states))] += 1
            return inner(method, fields, param, *rest[:-1], q)

        self._inner = inner
        self.backend._compressed = counted
        return self

    def __exit__(self, *exc) -> None:
        if self._had_own:
            self.backend._compressed = self._inner
        else:
            del self.backend._compressed

    def missing(self, state_dtype: str, master_dtype: Optional[str]) -> Optional[str]:
        """Why the block did not run what ``state_dtype`` / ``master_dtype`` ask (None: it did)."""
        want_states = state_dtype != "float32"
        want_master = master_dtype == "bfloat16"
        if not (want_states or want_master):
            return None
        if not self.calls:
            return ("no step reached the compressed kernel: the store stepped float32 states "
                    "(it does not support state_dtype/master_dtype yet)")
        kinds = list(self.kinds)
        if want_states and not any(_has_state(k[1], state_dtype) for k in kinds):
            return f"the compressed kernel never saw {state_dtype} states (saw {kinds})"
        if want_master and not any(k[0] == "bfloat16" for k in kinds):
            return f"the compressed kernel never stepped a bfloat16 param as its own master (saw {kinds})"
        return None

    def summary(self) -> dict:
        bf16 = {k[2] for k in self.kinds if any(name == "bfloat16" for name, _ in k[1])}
        return {"calls": self.calls, "kinds": {repr(k): v for k, v in self.kinds.items()},
                "stochastic_states": sorted(bf16)}  # of the calls with bf16 states


def _has_state(fields: Iterable[Tuple[str, int]], state_dtype: str) -> bool:
    if state_dtype == "int8":
        return any(block for _, block in fields)
    return any(name == state_dtype for name, _ in fields)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
