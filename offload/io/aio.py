"""The asyncio face (``AsyncIO``) and its synchronous adapter, the ``aiofiles`` engine.

For users whose loop is asyncio: ``await aio.read(f, offset, buf)``. Built on aiofiles: each
``preadv``/``pwritev`` runs through ``aiofiles.os.wrap`` in a thread pool of ``queue_depth``
workers, so the loop never blocks on the disk. ``AiofilesEngine`` runs the same coroutines on
a private event loop thread so that the benchmark (and anyone without a loop) can measure and
use it like the other engines.
"""
from __future__ import annotations

import asyncio
import errno
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Sequence

from .engine import Engine, IORequest, _Piece

__all__ = ["AsyncIO", "AiofilesEngine"]


def _aiofiles_os():
    try:
        import aiofiles.os
    except ImportError as exc:
        raise RuntimeError(f"the aiofiles engine needs the aiofiles package ({exc}); pip install aiofiles") from None
    return aiofiles.os


class _Core(Engine):
    """Splitting, tickets and per-piece coroutines, shared by both faces."""

    name = "aiofiles"

    def __init__(self, *, queue_depth: int, block_size: int, direct: Optional[bool],
                 executor: Optional[ThreadPoolExecutor] = None) -> None:
        super().__init__(queue_depth=queue_depth, block_size=block_size, direct=direct)
        aos = _aiofiles_os()
        import os

        self._preadv = aos.wrap(os.preadv)
        self._pwritev = aos.wrap(os.pwritev)
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="offload-aio")
        self._sem: Optional[asyncio.Semaphore] = None
        self._sem_loop: Optional[asyncio.AbstractEventLoop] = None
        self._inflight = 0

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem, self._sem_loop = asyncio.Semaphore(self.queue_depth), loop
        return self._sem

    async def _run_pieces(self, pieces: List[_Piece]) -> None:
        await asyncio.gather(*(self._one(p) for p in pieces))

    async def _one(self, piece: _Piece) -> None:
        async with self._semaphore():
            self._inflight += 1
            self._note_inflight(self._inflight)
            piece.t_issue = time.perf_counter_ns()
            try:
                err = await self._transfer(piece)
            except BaseException as exc:  # never leave a ticket hanging
                err = OSError(errno.EIO, f"aiofiles engine: unexpected {type(exc).__name__}: {exc}", piece.file.path)
            finally:
                self._inflight -= 1
            self._piece_done(piece, err)

    async def _transfer(self, piece: _Piece) -> Optional[OSError]:
        while piece.done < piece.nbytes:
            if piece.ticket.error is not None:
                return None
            off = piece.offset + piece.done
            try:
                fd = piece.fd()
                call = self._pwritev if piece.write else self._preadv
                # Released explicitly: the executor's worker drops its arguments only after
                # the result reaches the loop, which may be after the caller closed its pool.
                with piece.remaining as view:
                    n = await call(fd, [view], off, executor=self._executor)
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                return piece.error(exc.errno or errno.EIO)
            if n == 0:
                return piece.error(errno.EIO) if piece.write else None
            piece.done += n
            if piece.done < piece.nbytes:
                self._count_resubmit()
        return None

    def close(self) -> None:
        if not self._closed:
            super().close()
            if self._own_executor:
                self._executor.shutdown(wait=True)


class AsyncIO:
    """Awaitable reads and writes for asyncio code.

    ``await aio.read(f, offset, buf)`` / ``await aio.write(f, offset, buf)`` -> bytes moved;
    ``await aio.run([IORequest, ...])`` -> bytes per request. Same splitting, short-transfer
    handling and ``OSError(errno, msg, path)`` as the engines; at most ``queue_depth`` pieces
    run at once per event loop.
    """

    def __init__(self, *, queue_depth: int = 32, block_size: int = 1 << 20, direct: Optional[bool] = None) -> None:
        self._core = _Core(queue_depth=queue_depth, block_size=block_size, direct=direct)
        self.queue_depth = queue_depth
        self.block_size = block_size
        self.direct = direct

    async def run(self, requests: Sequence[IORequest]) -> List[int]:
        ticket, pieces = self._core._prepare(requests)
        if pieces:
            await self._core._run_pieces(pieces)
        return self._core.wait(ticket, 0)

    async def read(self, file: Any, offset: int, buf: Any) -> int:
        return (await self.run([IORequest("read", file, offset, buf)]))[0]

    async def write(self, file: Any, offset: int, buf: Any) -> int:
        return (await self.run([IORequest("write", file, offset, buf)]))[0]

    def stats(self):
        return self._core.stats()

    def close(self) -> None:
        self._core.close()

    async def __aenter__(self) -> "AsyncIO":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        loop.close()


class AiofilesEngine(_Core):
    """The asyncio face as a synchronous engine: a private event loop in a daemon thread."""

    name = "aiofiles"

    def __init__(self, *, queue_depth: int = 32, block_size: int = 1 << 20, direct: Optional[bool] = None) -> None:
        super().__init__(queue_depth=queue_depth, block_size=block_size, direct=direct)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run_loop, args=(self._loop,), name="offload-aiofiles-loop",
                                        daemon=True)
        # Dropped without close(): stop the loop so its thread ends (the thread holds only the loop).
        self._finalizer = weakref.finalize(self, self._loop.call_soon_threadsafe, self._loop.stop)
        self._thread.start()

    def _issue(self, pieces: List[_Piece]) -> None:
        asyncio.run_coroutine_threadsafe(self._run_pieces(pieces), self._loop)

    def close(self) -> None:
        if self._closed:
            return
        self._finalizer.detach()
        # Let scheduled work finish, then stop the loop and its thread.
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result()
        while True:
            fut = asyncio.run_coroutine_threadsafe(self._drained(), self._loop)
            if fut.result():
                break
            time.sleep(0.001)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        super().close()

    async def _drained(self) -> bool:
        return len(asyncio.all_tasks()) <= 1 and self._inflight == 0
