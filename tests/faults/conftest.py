"""Fixtures of the fault-injection suite.

``monitor`` (autouse): the invariant monitor (``monitor.py``) samples every process from before
the test starts until after it ends, and fails the test when two live workers ever served one
shard, or when a worker of the test's runs is still alive after its daemons were stopped.
``fault_run``: the test's run directory and daemons (``harness.FaultRun``); at the end every
daemon still running is stopped with SIGTERM, which stops its workers. What the tests measured
(``FaultRun.record``) is printed in a "fault timings" section at the end of the session.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.faults.harness import FaultRun
from tests.faults.monitor import InvariantMonitor
from tests.sshd import OpenSsh

#: After the daemons have been stopped, their workers must be gone within this long (the
#: daemon's stop waits for each worker already; this covers reaping and stragglers).
LEFTOVER_DEADLINE_S = 10.0

#: (test, what, seconds) measured by the tests, for the summary at the end of the session.
TIMINGS: list[tuple[str, str, float]] = []


@pytest.fixture(autouse=True)
def monitor(tmp_path: Path) -> Iterator[InvariantMonitor]:
    """Watch every worker whose run lies under this test's directory, for the whole test."""
    watcher = InvariantMonitor(tmp_path)
    watcher.start()
    yield watcher
    problems = watcher.finish(LEFTOVER_DEADLINE_S)
    if watcher.max_gap_s > 1.0:
        # Not a failure of the product; a blind spot of the check, worth knowing about.
        print(
            f"\nnote: invariant monitor samples up to {watcher.max_gap_s:.2f}s apart"
            f" (longest scan {watcher.max_scan_s:.2f}s)",
            file=sys.stderr,
        )
    if problems:
        pytest.fail("invariant monitor:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture
async def fault_run(
    openssh: OpenSsh, tmp_path: Path, monitor: InvariantMonitor, request: pytest.FixtureRequest
) -> AsyncIterator[FaultRun]:
    """A run on the session's OpenSSH server; its daemons are stopped gracefully at the end."""
    run = FaultRun(openssh, tmp_path, monitor)
    try:
        yield run
    finally:
        await run.aclose()
        TIMINGS.extend((request.node.name, what, seconds) for what, seconds in run.timings)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print what the fault tests measured (detection and recovery times; never asserted)."""
    if not TIMINGS:
        return
    terminalreporter.section("fault timings (measured, not asserted)")
    for test, what, seconds in TIMINGS:
        terminalreporter.write_line(f"{seconds:8.2f} s  {what}  [{test}]")
