"""How well does each int8 code hold Adam's second moment? The error of sqrt(exp_avg_sq), what
Adam divides by, after a few steps of the int8 state, side by side for the first code (the
unsigned map over v / absmax, as bitsandbytes and torchao code it) and the square-root code
(the unsigned map over sqrt(v / absmax), what offload ships: [Note: square-root code] in
offload/kernels/quant.py).

    .venv/bin/python bench/state_error.py                      # 1M elements, 4 decades, 20 steps
    .venv/bin/python bench/state_error.py --decades 2,4,6 --steps 50

Each element's grads have a scale of its own, log-uniform over ``--decades`` decades (within
one block of 256, as the rows of a weight matrix differ), times a fresh normal draw per step.
Per step, as the kernels do: decode the state, v = beta2 * v + (1 - beta2) * g * g in float32,
encode; a float32 run on the same grads is the reference. After the steps, per code:

- **median / p99 rel. error** of sqrt(v) against the float32 run;
- **zeroed**: the share of elements whose v decodes to 0 where the float32 v is not;
- **worst update ratio**: max over elements of (sqrt(v) + eps) / (sqrt(v_int8) + eps), the
  factor by which Adam's step of that element (m / (sqrt(v) + eps), m exact) grows through
  the int8 state: a zeroed v makes it m / eps.

Plain torch over quant.py's encode / decode (the kernels give the same bits). Prints a table,
then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from offload.kernels import quant  # noqa: E402

CODES = ("unsigned", "sqrt")


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6}.get(text[-1:], 1)
    n = int(float(text[:-1] if scale > 1 else text) * scale)
    if n < quant.BLOCK:
        raise argparse.ArgumentTypeError(f"--size must be at least {quant.BLOCK}, got {text!r}")
    return n


def parse_decades(text: str) -> list:
    try:
        out = [float(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        out = []
    if not out or any(not 0 <= d <= 30 for d in out):
        raise argparse.ArgumentTypeError(f"--decades: expected comma-separated numbers in [0, 30], got {text!r}")
    return out


def measure(n: int, decades: float, steps: int, beta2: float = 0.999, eps: float = 1e-8,
            seed: int = 0) -> dict:
    """One row per code (see the module's docstring) for ``n`` elements."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (-decades * torch.rand(n, generator=g))
    ref = torch.zeros(n)
    packed = {c: quant.encode_blocks(torch.zeros(n), False, c) for c in CODES}
    b2, w = torch.tensor(beta2, dtype=torch.float32), torch.tensor(1 - beta2, dtype=torch.float32)
    for _ in range(steps):
        grad = torch.randn(n, generator=g) * scale
        ref = ref * b2 + w * grad * grad
        for c in CODES:
            v = quant.decode_blocks(packed[c], n, False, c)
            packed[c] = quant.encode_blocks(v * b2 + w * grad * grad, False, c)
    rows = {}
    live = ref > 0
    for c in CODES:
        v = quant.decode_blocks(packed[c], n, False, c)
        rel = ((v.sqrt() - ref.sqrt()).abs() / ref.sqrt())[live]
        ratio = (ref.sqrt() + eps) / (v.sqrt() + eps)
        rows[c] = {"median_rel_error": rel.median().item(), "p99_rel_error": rel.quantile(0.99).item(),
                   "zeroed": ((v == 0) & live).float().mean().item(), "worst_update_ratio": ratio.max().item()}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1M"), help="elements (default 1M)")
    ap.add_argument("--decades", type=parse_decades, default=[4.0],
                    help="comma-separated spans of the grads' scales, in decades (default 4)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    out = []
    print(f"int8 exp_avg_sq after {args.steps} steps, {args.size} elements, beta2 0.999, eps 1e-8 (sqrt(v) against float32)")
    print(f"{'decades':>8} {'code':>9} {'median err':>11} {'p99 err':>9} {'zeroed':>8} {'worst update x':>15}")
    for d in args.decades:
        rows = measure(args.size, d, args.steps, seed=args.seed)
        for c, r in rows.items():
            print(f"{d:8g} {c:>9} {r['median_rel_error']:11.2%} {r['p99_rel_error']:9.2%} {r['zeroed']:8.2%} "
                  f"{r['worst_update_ratio']:15.3g}")
            out.append(dict(decades=d, code=c, **r))
    print(json.dumps({"size": args.size, "steps": args.steps, "rows": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
