"""The daemon's process: its open-file limit, and an event loop whose exit a hung run root
cannot hold open (``run_process``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final

import structlog

from supervisor import logs

log = structlog.get_logger("supervisor.daemon")

#: What the exiting process waits for its I/O threads: on a hung mount (a dead NFS server, a
#: stopped FUSE server) they never return, and a stop must still end the process.
SHUTDOWN_IO_TIMEOUT_S: Final = 5.0
#: The names of the threads ``asyncio.to_thread`` runs file operations in (``run_process``).
IO_THREAD_PREFIX: Final = "rs-io"


#: Open files we raise our soft limit to when the hard limit allows: far past any fleet one
#: daemon serves, without asking the kernel for a table sized to a million descriptors.
OPEN_FILE_LIMIT_WANTED: Final = 65536


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files towards the hard one; the soft limit now.

    systemd starts services at a soft limit of 1024 (hard 524288) and expects a program
    that needs more to raise its own. We hold one SSH connection a host, so a fleet of ~800
    would run short; and a daemon out of descriptors fails its leadership check and deposes
    itself. Safe for us: asyncio and asyncssh wait with epoll, never select().
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:  # (-1 here) not on Linux, which caps at fs.nr_open
        return OPEN_FILE_LIMIT_WANTED
    target = OPEN_FILE_LIMIT_WANTED
    if hard != resource.RLIM_INFINITY:
        target = min(hard, target)
    if soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):  # a sandbox that refuses: run with what we have
        return soft
    return target


class _IoExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``) for ``run_process``: its shutdown
    waits for running jobs at most SHUTDOWN_IO_TIMEOUT_S, where asyncio's own waits for ever
    (3.11) or five minutes (3.12+)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Cancel what has not started; with ``wait``, give what runs a bounded time."""
        super().shutdown(wait=False, cancel_futures=True)
        if wait:
            deadline = time.monotonic() + SHUTDOWN_IO_TIMEOUT_S
            for thread in _io_threads():
                thread.join(max(0.0, deadline - time.monotonic()))


def _io_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name.startswith(IO_THREAD_PREFIX) and t.is_alive()
    ]


def run_process(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``main`` (the daemon) to its end in a new event loop; its exit code.

    A thread still inside a file operation after that (a hung run root) would hold the
    process open for as long as the mount hangs: the interpreter joins such threads at exit.
    Then the process ends at once, with the same code, after saying so.
    """
    with asyncio.Runner() as runner:
        runner.get_loop().set_default_executor(_IoExecutor(thread_name_prefix=IO_THREAD_PREFIX))
        code = runner.run(main())
    stuck = _io_threads()
    if stuck:
        log.error(
            "daemon.exit_forced",
            exit_code=code,
            stuck_threads=len(stuck),
            reason="file operations that never returned (the run root hangs)",
        )
        logs.flush()  # os._exit skips the atexit handler that would
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
    return code
