"""The agent measures a watched worker's whole session (the worker and every process it
started) and pushes it: real processes, their memory read from /proc."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from supervisor import agent as agent_module

DEADLINE_S = 30.0
MIB = 2**20
#: Each process of the test's session touches this much memory of its own.
HELD_MIB = 48
#: A process that holds HELD_MIB of memory of its own, then forks a child that holds as
#: much of its own again (each page written, so it is resident and not shared), both then
#: waiting to be killed.
SESSION = f"""
import os, time
mine = bytearray({HELD_MIB} * {MIB})
if os.fork() == 0:
    theirs = bytearray({HELD_MIB} * {MIB})
print("ready", flush=True)
time.sleep(600)
"""


class Pushes:
    """What a watch pushed, read back as the daemon reads it."""

    def __init__(self) -> None:
        self.usages: list[agent_module.WorkerUsage] = []
        self._lock = threading.Lock()

    def send(self, line: str) -> None:
        """The ``send`` handed to the watch (called from its thread)."""
        news = agent_module.read_push(json.loads(line))
        assert isinstance(news, agent_module.WorkerUsage), line
        with self._lock:
            self.usages.append(news)

    def of(self, pid: int) -> list[agent_module.WorkerUsage]:
        """The usages pushed for ``pid`` so far."""
        with self._lock:
            return [u for u in self.usages if u.pid == pid]


def wait_until(predicate: Callable[[], object], what: str) -> None:
    """Poll ``predicate`` until true, failing after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def session() -> Iterator[subprocess.Popen[str]]:
    """A worker leading its own session with one child, each holding HELD_MIB; killed after."""
    worker = subprocess.Popen(
        [sys.executable, "-c", SESSION],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline() == "ready\n"
        assert worker.stdout.readline() == "ready\n"
        yield worker
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        if worker.stdout is not None:
            worker.stdout.close()


def test_the_whole_session_is_measured_and_pushed(session: subprocess.Popen[str]) -> None:
    """Every round pushes the memory the worker and its child hold: both processes counted,
    each one's own memory once (Pss), with the worker's start time."""
    pushes = Pushes()
    watch = agent_module.UsageWatch(interval_s=0.05)
    watch.watch(session.pid, None, pushes.send)
    wait_until(lambda: len(pushes.of(session.pid)) >= 2, "two usages pushed")
    usage = pushes.of(session.pid)[-1]
    assert usage.processes == 2
    assert usage.via == "pss"
    # Both processes' own pages, and not the interpreter's shared pages counted twice.
    assert 2 * HELD_MIB * MIB <= usage.rss_bytes < 2 * (HELD_MIB + 40) * MIB
    stat = agent_module.proc_stat(session.pid)
    assert stat is not None and usage.start_time == stat[2]


def test_a_dead_worker_is_forgotten_and_pushes_stop(session: subprocess.Popen[str]) -> None:
    """Once the worker is dead nothing more is pushed for it, and it is no longer watched."""
    pushes = Pushes()
    watch = agent_module.UsageWatch(interval_s=0.05)
    watch.watch(session.pid, None, pushes.send)
    wait_until(lambda: pushes.of(session.pid), "a usage pushed")
    os.killpg(session.pid, signal.SIGKILL)
    session.wait()
    wait_until(lambda: session.pid not in watch.watched(), "the dead worker forgotten")
    pushed = len(pushes.of(session.pid))
    time.sleep(0.3)  # wait-ok: six rounds, in which nothing more may be pushed
    assert len(pushes.of(session.pid)) == pushed


def test_a_pid_now_another_process_s_is_not_measured(session: subprocess.Popen[str]) -> None:
    """Watched with a start time that is not the live process's (the worker died and its
    number was reused), nothing is pushed and the pid is forgotten."""
    stat = agent_module.proc_stat(session.pid)
    assert stat is not None
    pushes = Pushes()
    watch = agent_module.UsageWatch(interval_s=0.05)
    watch.watch(session.pid, stat[2] + 1, pushes.send)
    wait_until(lambda: session.pid not in watch.watched(), "the other process forgotten")
    assert pushes.of(session.pid) == []


def test_a_process_whose_smaps_cannot_be_read_is_counted_by_its_resident_set(
    session: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where smaps_rollup cannot be read (a kernel before 4.14, a process it may not look
    into) a process counts by its VmRSS, shared pages in full, and the push says so (``via``
    "rss"); a process that is gone counts as nothing."""
    real = agent_module._proc_text

    def no_smaps(pid: int, name: str) -> bytes | None:
        """/proc as such a host has it: no smaps_rollup."""
        return None if name == "smaps_rollup" else real(pid, name)

    monkeypatch.setattr(agent_module, "_proc_text", no_smaps)
    usage = agent_module.session_usage(session.pid, None)
    assert usage is not None and (usage.processes, usage.via) == (2, "rss")
    # The interpreter's pages the child shares with the worker now count in each.
    assert usage.rss_bytes >= 2 * HELD_MIB * MIB
    assert agent_module._kib_field(b"VmRSS:\tlots kB\n", b"VmRSS") is None
    gone = 2**22 + 1  # past PID_MAX: no such process
    assert agent_module.process_memory(gone) is None
    assert agent_module.session_usage(gone, None) is None
