"""Spawned gloo ranks for the multi-rank tests: one place for the port, the processes, the
result queue and the clean-up (a rank that fails reports its traceback; a hung rank is killed)."""
import torch.multiprocessing as mp
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(outq, count: int, timeout: float) -> dict:
    """``count`` (rank, ok, value) results by rank; AssertionError with a failed rank's traceback."""
    got = {}
    for _ in range(count):
        rank, ok, value = outq.get(timeout=timeout)
        if not ok:
            raise AssertionError(f"rank {rank} failed:\n{value}")
        got[rank] = value
    return got


def _stop(procs, timeout: float) -> None:
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()


def run_ranks(target, world: int, args: tuple = (), timeout: float = 300) -> dict:
    """Run ``target(rank, port, *args, out)`` on ``world`` spawned processes once; the values
    each put as (rank, ok, value) into ``out``, by rank."""
    ctx = mp.get_context("spawn")
    port = free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port) + tuple(args) + (out,), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(out, world, timeout)
    finally:
        _stop(procs, 10)


class Workers:
    """``world`` spawned processes running ``target(rank, world, port, inq, outq)``: each job
    sent with ``send`` goes to every rank, ``collect`` gathers their results; ``None`` ends them."""

    def __init__(self, target, world: int) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.world = world
        self.inq = [ctx.Queue() for _ in range(world)]
        self.outq = ctx.Queue()
        self.procs = [ctx.Process(target=target, args=(r, world, port, self.inq[r], self.outq), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def send(self, job, timeout: float) -> dict:
        for q in self.inq:
            q.put(job)
        return _collect(self.outq, self.world, timeout)

    def close(self) -> None:
        for q in self.inq:
            q.put(None)
        _stop(self.procs, 5)
