"""A thread of our own for filesystem calls that may hang, so a hung mount never stops the loop.

It owns the state its jobs work on; it never decides what to read or what a file means.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

_S = TypeVar("_S")
_T = TypeVar("_T")

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[Any], Any]]


class FileThread(Generic[_S]):
    """One daemon thread that runs every job it is given on the ``state`` it owns.

    The caller hands ``state`` over here and keeps no reference to it: a job receives it as
    its argument, so whatever it holds is only ever touched by this one thread and needs no
    lock. A hung mount blocks this thread, never the event loop; and unlike the default
    executor, whose threads are joined at interpreter exit, it cannot hang the shutdown.
    The thread starts at the first job and ends at ``close()``; it is never started twice,
    so a job still hung in an old thread cannot race a new one over ``state``.
    """

    def __init__(self, state: _S, *, name: str) -> None:
        self._state = state
        self._name = name  # at most 15 bytes: what ``top -H`` and /proc/PID/task/TID/comm show
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[[_S], _T]) -> asyncio.Future[_T]:
        """A future for ``fn(state)`` run in the thread; cancelling it abandons the result.

        Raises RuntimeError once ``close()`` was called.
        """
        if self._closed:
            raise RuntimeError(f"file thread {self._name} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((loop, future, fn))
        return future

    async def call(self, fn: Callable[[_S], _T]) -> _T:
        """``fn(state)`` run in the thread."""
        return await self.submit(fn)

    def close(self) -> None:
        """Let the thread end once its current job (if any) returns; idempotent."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def _serve(self) -> None:
        _name_this_thread(self._name)
        state = self._state
        while (job := self._jobs.get()) is not None:
            loop, future, fn = job
            if future.cancelled():  # abandoned before it started (a benign racy read)
                continue
            try:
                result = fn(state)
            # The thread's root: every outcome goes back to the awaiting task, which raises it.
            except BaseException as exc:  # noqa: BLE001
                _resolve_threadsafe(loop, future, None, exc)
            else:
                _resolve_threadsafe(loop, future, result, None)


def _name_this_thread(name: str) -> None:
    """Name the calling thread for ``top -H``, ``ps -L`` and /proc (at most 15 bytes)."""
    path = f"/proc/self/task/{threading.get_native_id()}/comm"
    with contextlib.suppress(OSError), open(path, "w", encoding="ascii") as f:
        f.write(name)


def _resolve_threadsafe(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: object,
    exc: BaseException | None,
) -> None:
    def resolve() -> None:
        if future.done():  # the awaiting task was cancelled meanwhile
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    # The loop closed while a read hung: nobody is waiting for the result any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(resolve)
