"""Several ranks begin a step together, or none does.

[Note: a step the ranks agree to begin] At stages 1-2 every rank's step takes collectives
(which params have a grad, GradScaler's found_inf, the reduction, the all-gather), and each
rank steps its shard with its own ``param_groups``. Two ways that went wrong (forty-fifth
session, a helper's multi-rank pass):

- a rank whose step failed before its first collective (a closure that raised, a Ctrl-C in
  it, a grad of the wrong dtype, an optimizer closed or failed on that rank only) left the
  others waiting in that collective until the process group's timeout, or, when it caught
  the error and stepped again, paired its next collective with theirs: gloo aborted the
  process on a size mismatch;
- ranks whose groups differ (an lr schedule stepped on one rank only, ``load_state_dict`` of
  different dicts) stepped each shard with its owner's values: the params agreed across
  ranks and matched neither rank's torch run, silently.

So everything a rank does before its first collective (the checks, ``begin_step``, the
closure, the checks of its local grads) runs here first, its failure caught; then one
all-reduce, the one that settles which params have a grad (``agree_on_grads``), also carries
GradScaler's found_inf, whether each rank failed, and each rank's facts: a fingerprint of
every group's hyperparameters as the kernels take them (and ``max_grad_norm``) and its step
count. A rank that failed raises its own error, the others a RuntimeError naming it; ranks
whose step counts differ all raise a ValueError, and so do ranks whose fingerprints differ
once their values, gathered then (a second collective, only then), differ by more than a
millionth; either way before anything changed (no failed state). A failure after the
first collective (in the kernel, the all-gather) is the stores' (offload="nvme" votes
before its commit); in RAM the others may still wait.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any, Iterator, List, Sequence, Tuple

from offload.kernels import get_backend
from offload.optim.guards import step_sigs
from offload.optim.options import check_group_rule
from offload.optim.protocol import optional
from offload.optim.sparse_grads import check_sparse_grad
from offload.optim.step_guard import check_work
from offload.zero import comm

__all__ = ["ranks_begin_together", "step_facts"]

_FACT_BITS = 62  # the all-reduce takes the max of int64s: facts are kept non-negative


@contextlib.contextmanager
def ranks_begin_together(opt: Any) -> Iterator[None]:
    """Run the block (the step's start, up to its first collective) and agree with the
    other ranks that every one got through it with the same facts; one rank: just the block."""
    agree = optional(opt._store, "agree_on_grads")
    if agree is None or getattr(opt._store, "world", 1) <= 1:
        yield
        return
    local_found_inf = getattr(opt, "found_inf", None)  # GradScaler's, set before step()
    try:
        yield
        check_local_grads(opt)
        get_backend(opt.backend).preflight(opt.num_threads)
        facts = step_facts(opt)
    except BaseException:
        agree(failed=True)
        raise
    rows = agree(failed=False, facts=facts)
    opt._found_inf_agreed(local_found_inf)
    if rows:
        refuse_divergence(opt, rows)


def check_local_grads(opt: Any) -> None:
    """The checks the step makes of each group and grad, on this rank's own grads (a sparse
    grad of a rule that takes one: the refusals of its conversion, at these stages always one)."""
    work = []
    for group in opt.param_groups:
        opt._check_group(group)
        check_group_rule(opt, group, "a group now")
        items = []
        for p in group["params"]:
            if p.grad is not None and p.grad.is_sparse and opt.SPARSE_GRADS:
                check_sparse_grad(opt, group, p, p.grad)
            elif p.grad is not None:
                items.append((p, p.grad))
        work.append((group, items))
    check_work(work, step_sigs(opt), opt.SPARSE_MESSAGE)


def hyperparameters(opt: Any) -> List[Tuple[str, Any]]:
    """Each group's rule and hyperparameters as the kernels take them, then max_grad_norm."""
    return [(opt.rule_of(g).name, tuple(sorted(opt.group_hyper(g).items()))) for g in opt.param_groups] + \
        [("max_grad_norm", opt._ctx.max_grad_norm)]


def step_facts(opt: Any) -> Tuple[int, int]:
    """(fingerprint of the groups' hyperparameters and max_grad_norm, step count summed over
    the groups' first params): what every rank must share to step its shard."""
    digest = hashlib.sha256(repr(hyperparameters(opt)).encode())
    steps = sum(opt._ctx.steps.get(g["params"][0]) for g in opt.param_groups if g["params"])
    return (int.from_bytes(digest.digest()[:8], "little") >> (64 - _FACT_BITS)) or 1, steps  # (never 0: refuse_divergence)


def refuse_divergence(opt: Any, rows: Sequence[Tuple[int, int, int]]) -> None:
    """``rows``: each rank's (failed, hyperparameters, steps), as the all-reduce gave them."""
    what = f"offload.{opt.TORCH_NAME} step (stage {getattr(opt, 'stage', '?')}, {len(rows)} ranks)"
    # A row all zeros is a rank that did not answer: a group whose collectives do nothing
    # (torch's "fake" backend, a test's emulated ranks), where there is nothing to compare.
    if not all(any(row) for r, row in enumerate(rows) if r != comm.world_and_rank(opt._store.group)[1]):
        return
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise RuntimeError(f"{what}: it failed on rank(s) {', '.join(map(str, failed))} before it began (that "
                           "rank raises its error); no rank stepped: the optimizer is as it was")
    differ: List[str] = []
    if len({row[1] for row in rows}) > 1:  # (every rank sees the same rows: all take this collective or none)
        far = _far_values(opt)
        if far:
            differ.append("their param_groups' hyperparameters (or max_grad_norm): " + far)
    if len({row[2] for row in rows}) > 1:
        differ.append("their step counts: " + ", ".join(f"rank {r}: {row[2]}" for r, row in enumerate(rows)))
    if differ:
        raise ValueError(f"{what}: the ranks differ in {'; and in '.join(differ)}. Each rank steps its shard "
                         "with its own param_groups and states, so they must be the same on every rank (an lr "
                         "schedule stepped on some ranks only, load_state_dict of different dicts, a step() "
                         "called on some ranks only); no rank stepped")


def _far_values(opt: Any, rel_tol: float = 1e-6) -> str:
    """The fingerprints differ: gather every rank's values and name those that differ beyond
    ``rel_tol`` ('' when none does: an lr a cosine schedule computed with another libm on
    another node differs in its last bits only, and is no reason to stop a job)."""
    import torch.distributed as dist

    group = opt._store.group
    mine = hyperparameters(opt)
    every: List[Any] = [None] * comm.world_and_rank(group)[0]
    dist.all_gather_object(every, mine, group=group)
    if len({len(v) for v in every}) > 1:  # (add_param_group on some ranks only)
        return "the number of param groups: " + ", ".join(f"rank {r}: {len(v) - 1}" for r, v in enumerate(every))
    out = []
    for i, (name, values) in enumerate(mine):
        if len({v[i][0] for v in every}) > 1:
            out.append(f"group {i}'s rule: " + ", ".join(f"rank {r}: {v[i][0]}" for r, v in enumerate(every)))
            continue
        theirs = [dict(v[i][1]) if isinstance(v[i][1], tuple) else {name: v[i][1]} for v in every]
        for key in sorted(set().union(*theirs)):
            got = [t.get(key) for t in theirs]
            if not all(_close(got[0], x, rel_tol) for x in got[1:]):
                where = f"group {i} {key}" if isinstance(values, tuple) else key
                out.append(f"{where}: " + ", ".join(f"rank {r}: {x!r}" for r, x in enumerate(got)))
    return "; ".join(out)


def _close(a: Any, b: Any, rel_tol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0)
    return a == b
