"""The daemon's process: its open-file limit, and an event loop whose exit a hung run root
cannot hold open (``run_process``)."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final, NoReturn

import structlog

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


def run_process(
    main: Callable[[], Coroutine[Any, Any, int]], *, stopped: Callable[[], Mapping[str, Any]]
) -> NoReturn:
    """Run ``main`` (the daemon) to its end in a new event loop, then end the process with
    its exit code, ``daemon.stopped`` (with ``stopped()``'s fields) its last log line.

    Nothing is left to do then: the loop is closed, its I/O threads are done (or abandoned,
    ``SHUTDOWN_IO_TIMEOUT_S``) and the log is written. A thread still inside a file
    operation (a hung run root) would hold the process open for as long as the mount
    hangs, and the interpreter's teardown of every module and object took 0.1-0.4 s of CPU
    on an idle machine and seconds on a loaded one (docs/BENCHMARKS.md), after the daemon
    had said it stopped: both are skipped (``exit_now``).
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
    log.info("daemon.stopped", exit_code=code, **stopped())
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once the atexit handlers have run (the log writer's
    last lines; coverage's data, under the tests) and stdout and stderr are flushed,
    without the interpreter's teardown and its join of threads that may never end."""
    atexit._run_exitfuncs()  # os._exit skips them; they are ours to run
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
