"""Helpers shared by the swap tests (no tests here): engine wrappers that slow down or break
I/O, deterministic params and grads, and an in-RAM reference step with the same kernel."""
from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nbytes(buf: Any) -> int:
    return int(getattr(buf, "nbytes", None) or len(buf))


class _Ticket:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Optional[List[int]] = None
        self.error: Optional[BaseException] = None


class SlowEngine:
    """Runs each batch on ``inner`` only after ``delay`` seconds, from a thread of its own, so
    data lands in the buffer late (a pipeline that forgets to wait computes on stale data).
    Logs submits and completions, and records a violation whenever a read is submitted for a
    byte range of a file that has a write in flight."""

    name = "slow"

    def __init__(self, inner: Any, *, read_delay: float = 0.02, write_delay: float = 0.02,
                 hold: Any = None) -> None:
        self.inner = inner
        self.hold = hold  # (op, ranges) -> threading.Event to wait for before doing the I/O, or None
        self.hold_timeouts: List[str] = []
        self.delay = {"read": read_delay, "write": write_delay}
        self.lock = threading.Lock()
        self.log: List[Tuple[str, str, List[Tuple[str, int, int]], float]] = []
        self.in_flight_writes: List[Tuple[str, int, int]] = []
        self.violations: List[str] = []

    def submit(self, reqs: Sequence[Any]) -> _Ticket:
        reqs = list(reqs)
        op = reqs[0].op
        ranges = [(r.file.path, r.offset, r.offset + _nbytes(r.buf)) for r in reqs]
        with self.lock:
            if op == "read":
                for p, a, b in ranges:
                    for q, c, d in self.in_flight_writes:
                        if p == q and a < d and c < b:
                            self.violations.append(f"read {p}[{a}:{b}] while write [{c}:{d}] in flight")
            else:
                self.in_flight_writes.extend(ranges)
            self.log.append(("submit", op, ranges, time.perf_counter()))
        ticket = _Ticket()

        gate = self.hold(op, ranges) if self.hold is not None else None

        def work() -> None:
            time.sleep(self.delay[op])
            if gate is not None and not gate.wait(5.0):
                self.hold_timeouts.append(f"{op} {ranges}")
            try:
                ticket.result = self.inner.wait(self.inner.submit(reqs))
            except BaseException as exc:  # handed to wait()
                ticket.error = exc
            with self.lock:
                if op == "write":
                    for r in ranges:
                        self.in_flight_writes.remove(r)
                self.log.append(("done", op, ranges, time.perf_counter()))
            ticket.event.set()

        threading.Thread(target=work, daemon=True).start()
        return ticket

    def wait(self, ticket: _Ticket, timeout: Optional[float] = None) -> List[int]:
        ticket.event.wait()
        if ticket.error is not None:
            raise ticket.error
        return list(ticket.result or [])

    def poll(self, ticket: _Ticket) -> bool:
        return ticket.event.is_set()

    def close(self) -> None:
        pass


class FaultyEngine:
    """Passes batches to ``inner`` but makes the ``fail_at``-th batch of ``op`` fail: with
    ``mode="eio"`` ``wait`` raises OSError(EIO); with ``mode="short"`` it reports 4096 bytes
    fewer than asked (as an engine that gave up on a short transfer would)."""

    name = "faulty"

    def __init__(self, inner: Any, *, op: str, fail_at: int, mode: str = "eio") -> None:
        self.inner, self.op, self.fail_at, self.mode = inner, op, fail_at, mode
        self.count = self.serial = 0
        self.tickets: Dict[int, Tuple[Any, bool, List[Any]]] = {}

    def arm(self, fail_at: int) -> None:
        self.count, self.fail_at = 0, fail_at

    def submit(self, reqs: Sequence[Any]) -> int:
        reqs = list(reqs)
        bad = False
        if reqs and reqs[0].op == self.op:
            self.count += 1
            bad = self.count == self.fail_at
        t = self.inner.submit(reqs)
        self.serial += 1
        key = self.serial
        self.tickets[key] = (t, bad, reqs)
        return key

    def wait(self, key: int, timeout: Optional[float] = None) -> List[int]:
        t, bad, reqs = self.tickets.pop(key)
        res = self.inner.wait(t)
        if bad and self.mode == "eio":
            raise OSError(errno.EIO, f"injected {self.op} error", reqs[0].file.path)
        if bad and self.mode == "short":
            res = [n - 4096 for n in res]
        return res

    def poll(self, key: int) -> bool:
        return self.inner.poll(self.tickets[key][0])

    def close(self) -> None:
        pass


def faulty_swap_engines(monkeypatch: Any) -> List[FaultyEngine]:
    """Every io engine a swap store opens from now on, wrapped in a disarmed FaultyEngine (the
    list, in opening order; ``.op`` and ``.arm(n)`` set what fails): the io seam
    offload.swap.store.resolve_engine, patched before the optimizer is built."""
    import offload.swap.store as swap_store

    real, made = swap_store.resolve_engine, []

    def wrap(io_engine: Any, directory: str) -> Tuple[Any, bool]:
        engine, owned = real(io_engine, directory)
        faulty = FaultyEngine(engine, op="write", fail_at=0)
        if owned:  # the store closes what it owns: the real engine, through its wrapper
            faulty.close = engine.close  # type: ignore[method-assign]
        made.append(faulty)
        return faulty, owned

    monkeypatch.setattr(swap_store, "resolve_engine", wrap)
    return made


def threads_engine() -> Any:
    from offload.io import open_engine

    return open_engine("threads", queue_depth=8, block_size=1 << 20)


# Sizes that break SIMD tails and sub-group boundaries, one-element params, split into 2
# param groups at SPLIT: the layout the SwappedState tests share.
SIZES = [1, 7, 4097, 3000, 1, 2500, 1030]
SPLIT = 3


def swapped_state(tmp_path: Any, params: Sequence[torch.Tensor], **kw: Any) -> Any:
    """A SwappedState over ``params`` in ``tmp_path`` with small sub-groups (1024) and buffers."""
    from offload.optim.swapped_state import SwappedState

    kw.setdefault("max_host_bytes", 1 << 20)
    kw.setdefault("sub_group_size", 1024)
    return SwappedState(params, swap_dir=str(tmp_path), **kw)


def make_params(sizes: Sequence[int], seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def make_grad(p_index: int, numel: int, step: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + p_index)
    return torch.randn(numel, generator=g)


HYPERS = [
    dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True),
    dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, decoupled=False, maximize=True),
]


def skipped(step: int, i: int) -> bool:
    """Which params have no grad in a step (exercises params left out of a step)."""
    return (step + i) % 4 == 0


def batches_for(params: Sequence[torch.Tensor], steps: List[int], step: int, split: int, seed: int = 0):
    """Two param groups ([:split], [split:]) with HYPERS; increments ``steps`` of params
    that get a grad; returns the batches for SwappedState.step."""
    out = []
    for gi, idx in enumerate((range(0, split), range(split, len(params)))):
        items = []
        for i in idx:
            if skipped(step, i):
                continue
            steps[i] += 1
            items.append((params[i], make_grad(i, params[i].numel(), step, seed), steps[i]))
        out.append((HYPERS[gi], items))
    return out


class Reference:
    """The same updates done in RAM on whole tensors with the same kernel."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        from offload.kernels import get_backend

        self.kernel = get_backend()
        self.params = [p.clone() for p in params]
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.steps = [0] * len(params)

    def step(self, step: int, split: int, seed: int = 0) -> None:
        batches = batches_for(self.params, self.steps, step, split, seed)
        for hyper, items in batches:
            for p, g, st in items:
                i = next(k for k, q in enumerate(self.params) if q is p)
                self.kernel.adam_step(p.view(-1), g.view(-1), self.m[i].view(-1), self.v[i].view(-1),
                                      step=st, **hyper)


def run_python(code: str, *args: str, timeout: float = 60) -> "Any":
    """``python -c code *args`` with this checkout importable: forked from a warm interpreter
    (tests/_forkserver.py; a fresh one cost ~2 s of importing torch, for each of ~25 children),
    with text pipes for stdout and stderr, as ``subprocess.Popen`` gives."""
    from _forkserver import spawn

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.path.join(REPO, "tests"))
    return spawn(code, *args, env=env)
