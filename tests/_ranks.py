"""Spawned gloo ranks for the multi-rank tests: one place for the port, the processes, the
result queue and the clean-up (a rank that fails reports its traceback; a hung rank is killed)."""
import os
import socket

import torch.multiprocessing as mp


def _context():
    """multiprocessing's forkserver with torch and offload imported once per test process: a
    rank is forked from it instead of being a fresh interpreter importing them again (~3 s of
    CPU each, about twenty per suite pass, on CI's two cores). The server imports and runs no
    torch op, so a fork of it holds no thread pool or lock (as tests/_forkserver.py's zygote).
    torch._dynamo too: torch imports it at the first ``add_param_group`` of any optimizer
    (``torch._disable_dynamo``), ~1.7 s of CPU in every rank (forty-second session: the ranks
    of eight rank-heavy modules took 71 CPU-s instead of 106)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "offload"])
    return ctx


def _in_env(env: dict, target, *args) -> None:
    """``target(*args)`` under the caller's environment: the fork server's is the one it
    started with, and a rank must see what the test set since (as a spawned one would)."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def _process(ctx, target, args):
    return ctx.Process(target=_in_env, args=(dict(os.environ), target) + tuple(args), daemon=True)


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
    """Run ``target(rank, port, *args, out)`` on ``world`` new processes once; the values
    each put as (rank, ok, value) into ``out``, by rank."""
    ctx = _context()
    port = free_port()
    out = ctx.Queue()
    procs = [_process(ctx, target, (r, port) + tuple(args) + (out,)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(out, world, timeout)
    finally:
        _stop(procs, 10)


class Workers:
    """``world`` processes running ``target(rank, world, port, inq, outq)``: each job
    sent with ``send`` goes to every rank, ``collect`` gathers their results; ``None`` ends them."""

    def __init__(self, target, world: int) -> None:
        ctx = _context()
        port = free_port()
        self.world = world
        self.inq = [ctx.Queue() for _ in range(world)]
        self.outq = ctx.Queue()
        self.procs = [_process(ctx, target, (r, world, port, self.inq[r], self.outq)) for r in range(world)]
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


def serve(rank: int, world: int, port: int, inq, outq) -> None:
    """A ``Workers`` target for any test module: one gloo group of ``world`` ranks for the
    process's life; each job ``(module, function, args, kwargs)`` runs as
    ``function(rank, world, *args, **kwargs)`` on the default group and its value goes back."""
    import datetime
    import importlib
    import os
    import queue
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A job that fails on one rank leaves the other in a collective: it raises after this
    # timeout (gloo's default is 30 min) while the test has already thrown the group away.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    parent = os.getppid()
    while True:
        try:
            job = inq.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died without closing us
                break
            continue
        if job is None:
            break
        module, name, args, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            outq.put((rank, True, fn(rank, world, *args, **kwargs)))
        except BaseException:
            outq.put((rank, False, traceback.format_exc()))
    # No destroy_process_group() nor interpreter teardown (gloo's destructors wait for the
    # peers): nothing is left to flush, so leave at once.
    outq.close()
    outq.join_thread()
    os._exit(0)


class Group:
    """``world`` gloo ranks kept for the whole session (starting them costs seconds:
    two interpreters importing torch), running jobs in turn. A job that fails on any rank
    throws the processes away (a rank may be stuck in a collective, or hold a stale result),
    the next job spawns fresh ones.

    Jobs run in one process after another, so a job puts back what it changes in the
    process (class attributes, environment), and returns plain Python values: a tensor sent
    through the queue lives in shared memory tied to the sender."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._workers = None

    def run(self, fn, *args, timeout: float = 180, **kwargs) -> dict:
        """``fn(rank, world, *args, **kwargs)`` on every rank (``fn`` importable by its
        module's name, as a test module's functions are); the values by rank."""
        if self._workers is None:
            self._workers = Workers(serve, self.world)
        try:
            return self._workers.send((fn.__module__, fn.__name__, args, kwargs), timeout)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._workers is not None:
            workers, self._workers = self._workers, None
            workers.close()


_GROUPS: dict = {}


def group(world: int) -> Group:
    """The session's group of ``world`` ranks (made on first use, closed at exit)."""
    if world not in _GROUPS:
        if not _GROUPS:
            import atexit
            atexit.register(lambda: [g.close() for g in _GROUPS.values()])
        _GROUPS[world] = Group(world)
    return _GROUPS[world]
