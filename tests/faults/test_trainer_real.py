"""What the trainer sees when a real AReaL worker fails, under the shipped defaults: the real
``FSRewardClient`` (rollout loops, its own defaults) against real ``areal.reward.fs_worker``
workers on the real sshd, through kill -9, SIGSTOP, stuck reward calls and a dead pool process.

The goal (issue 29): the trainer's calls do not fail because a worker crashed or hung (only a
task that is itself stuck may fail), and nothing of a replaced worker is left running.

Each scenario runs on the stacks of ``tests.areal.stacks`` (the ``stack`` parameter): ``real``,
the worker and client of areal-fs, where areal-fs is present (as in CI); where it is absent,
``real`` skips, named, and ``reference`` runs the same scenario: the reference worker
(``python -m supervisor.demo.worker``, same flags) called by ``tests.areal.ContractClient``.
Where the two workers differ by design (a broken pool) the assertions say which is which.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import areal as A
from tests import shared
from tests.faults.harness import FaultRun, events
from tests.system.daemonproc import DaemonProcess

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

HOSTS = 4
#: The faulted host, on shard TARGET.
TARGET = 1
#: Two pool processes per worker: a fleet of 4 workers and 8 rollout loops fits 2 shared cores.
CONCURRENCY = 2
LOOPS = 8
#: Every shard has served this many calls before the fault (its pool processes start lazily).
WARM_CALLS = 10
#: Generous bounds of the waits, not expectations: the shipped defaults act within seconds.
READY_S = 60.0
REPLACED_S = 60.0
#: A call's own deadline (the client's ``timeout_seconds``) plus a margin: by then every call
#: in progress at a moment has ended, one way or the other.
SETTLE_S = 40.0
#: How long every slot of the stuck host stays stuck: past the client's 30 s timeout, so the
#: stuck calls fail as they would in training.
STUCK_HOLD_S = 33.0


REAL = A.REAL
REFERENCE = A.REFERENCE


@dataclass(frozen=True, slots=True)
class Stack:
    """Which worker the fleet runs and which client the trainer calls."""

    name: str
    #: The areal-fs directory (the real worker and client); None: the reference worker and
    #: ``ContractClient``.
    areal: Path | None

    @property
    def real(self) -> bool:
        """The real worker and client, from areal-fs."""
        return self.areal is not None


@pytest.fixture(params=A.stacks())
def stack(request: pytest.FixtureRequest) -> Stack:
    """The stack of this run (``tests.areal.stacks``)."""
    if request.param == REAL:
        return Stack(REAL, shared.require(shared.AREAL))
    return Stack(REFERENCE, None)


@dataclass
class Scene:
    """A fleet of real workers under the daemon, with the trainer's load running on it."""

    daemon: DaemonProcess
    load: A.TrainerLoad
    processes: A.FleetProcesses
    root: Path
    names: list[str]
    marker: Path

    def pid(self, host: int) -> int:
        """The worker pid host ``host``'s status file names."""
        status = A.read_status(self.root, self.names[host]) or {}
        pid = status.get("pid")
        assert isinstance(pid, int), f"no worker pid in {self.names[host]}'s status: {status}"
        return pid

    async def wait_replaced(self, host: int, old_pid: int, since: float) -> int:
        """The pid of the worker that replaced ``old_pid``, once it is ready."""
        found: list[int] = []

        def replaced() -> bool:
            """The host's status shows another pid, ready."""
            status = A.read_status(self.root, self.names[host]) or {}
            pid = status.get("pid")
            if isinstance(pid, int) and pid != old_pid and status.get("ready") is True:
                found.append(pid)
                return True
            return False

        try:
            await self.load.wait_until(replaced, REPLACED_S, "a new worker ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.report(since)}") from None
        return found[0]

    async def lingering(self) -> list[A.Lingering]:
        """What no current worker accounts for, now (``FleetProcesses.lingering``)."""
        return await asyncio.to_thread(self.processes.lingering)

    def report(self, since: float, lingering: list[A.Lingering] | None = None) -> str:
        """The numbers, for an assertion message: the load since the fault, the daemon's
        state changes of the faulted host, what lingers."""
        summary = self.load.summary(since)
        lines = [
            f"since the fault: {summary.ok} OK calls, failed {dict(summary.failed)}"
            f" (by shard {dict(summary.failed_by_shard)}), longest stall"
            f" {summary.longest_stall_s:.1f} s, total stall {summary.total_stall_s:.1f} s,"
            f" p50 {summary.p50_s * 1000:.0f} ms, p99 {summary.p99_s * 1000:.0f} ms",
            *(f"  first {kind}: {text[:200]}" for kind, text in summary.examples.items()),
            "daemon:",
            *(
                f"  {e.get('from')} -> {e.get('to')} ({e.get('reason')})"
                for e in events(self.daemon, "host.state", host=self.names[TARGET])
            ),
        ]
        if lingering is not None:
            lines.append(f"lingering: {len(lingering)}")
            lines += [f"  {item}" for item in lingering]
        return "\n".join(lines)


async def _sample(processes: A.FleetProcesses) -> None:
    """Sample the fleet's processes every 200 ms, so each pool process is known while it is
    still a child of its coordinator."""
    while True:
        await asyncio.to_thread(processes.sample)
        await asyncio.sleep(0.2)  # wait-ok: the sampling period of a background sampler


@contextlib.asynccontextmanager
async def real_fleet(fault_run: FaultRun, stack: Stack) -> AsyncIterator[Scene]:
    """Four workers of ``stack`` under ``reward-supervisor run`` with the shipped defaults,
    every one ready and serving the trainer's load; at the end the load stops, the marker
    goes, and whatever lingers is killed (the daemon itself is stopped by the fixture)."""
    areal = stack.areal
    tag = uuid.uuid4().hex[:6]
    names = [f"tr{tag}-{i}" for i in range(HOSTS)]
    root = fault_run.root
    raw = A.shipped_config(
        fault_run.openssh,
        root,
        names,
        areal=areal,
        socket=fault_run.tmp_path / "control.sock",
        concurrency=CONCURRENCY,
    )
    fault_run.write(raw)
    daemon = await fault_run.start(ready=HOSTS)
    processes = A.FleetProcesses(root)
    marker = fault_run.tmp_path / f"hang-{names[TARGET]}"
    load = A.TrainerLoad(
        root,
        names,
        HOSTS,
        areal=areal,
        reward_fn=A.HANG_IF_MARKER,
        loops=LOOPS,
        call_kwargs={"hang_marker": str(fault_run.tmp_path / "hang-{host}")},
    )
    sampler = asyncio.create_task(_sample(processes))
    try:
        async with load:
            for shard in range(HOSTS):
                await load.wait_ok(WARM_CALLS, READY_S, shards=[shard])
            # The lingering check knows this stack's workers (else it could find nothing).
            procs = await asyncio.to_thread(processes.sample)
            assert len(processes.live_coordinators(procs)) == HOSTS, processes.coordinators
            yield Scene(daemon, load, processes, root, names, marker)
    finally:
        marker.unlink(missing_ok=True)
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        left = await asyncio.to_thread(processes.lingering)
        A.kill_procs(item.proc for item in left)
        # A worker the daemon never took back from SIGSTOP would hold up its stop.
        for proc in await asyncio.to_thread(processes.everything_alive):
            if proc.state == "T":
                A.kill_procs([proc])


async def test_kill9_of_a_real_worker_fails_no_trainer_call_and_leaves_nothing(
    fault_run: FaultRun, stack: Stack
) -> None:
    """kill -9 of one real worker's coordinator: the trainer's client sees no failed call, and
    once the replacement is ready nothing of the killed worker (pool, resource tracker) runs."""
    async with real_fleet(fault_run, stack) as scene:
        victim = scene.pid(TARGET)
        fault_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        await scene.wait_replaced(TARGET, victim, fault_at)
        await scene.load.wait_settled(time.monotonic(), SETTLE_S)
        await scene.load.wait_ok(WARM_CALLS, READY_S, since=time.monotonic(), shards=[TARGET])
        lingering = await scene.lingering()
        summary = scene.load.summary(fault_at)
        report = scene.report(fault_at, lingering)
    print(report)  # the numbers, for -rP and for the issue, pass or fail
    assert summary.failed_total == 0, report
    assert lingering == [], report


async def test_sigstop_of_a_real_worker_fails_no_trainer_call_and_leaves_nothing(
    fault_run: FaultRun, stack: Stack
) -> None:
    """SIGSTOP of one real worker's coordinator (hung: alive, no heartbeat): it is replaced
    before the trainer's client fails any call (its limit: a heartbeat 15 s old), and nothing
    of the hung worker is left once the replacement is ready."""
    async with real_fleet(fault_run, stack) as scene:
        victim = scene.pid(TARGET)
        fault_at = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        await scene.wait_replaced(TARGET, victim, fault_at)
        await scene.load.wait_settled(time.monotonic(), SETTLE_S)
        await scene.load.wait_ok(WARM_CALLS, READY_S, since=time.monotonic(), shards=[TARGET])
        lingering = await scene.lingering()
        summary = scene.load.summary(fault_at)
        report = scene.report(fault_at, lingering)
    print(report)  # the numbers, for -rP and for the issue, pass or fail
    assert summary.failed_total == 0, report
    assert lingering == [], report


async def test_stuck_slots_of_a_real_worker_fail_only_the_stuck_tasks(
    fault_run: FaultRun, stack: Stack
) -> None:
    """Every pool slot of one real worker stuck in a reward call for longer than the client's
    task timeout (heartbeat going on): only calls routed to that shard fail, by their own
    timeout (or an error result for the stuck task), never a call to a healthy shard nor a
    fleet-wide refusal; nothing of a replaced worker is left running at the end."""
    async with real_fleet(fault_run, stack) as scene:
        fault_at = time.monotonic()
        scene.marker.write_text("stuck\n")
        await scene.load.wait_until(
            lambda: time.monotonic() - fault_at >= STUCK_HOLD_S,
            STUCK_HOLD_S + 5,
            "the stuck period",
        )
        scene.marker.unlink()
        await scene.load.wait_settled(time.monotonic(), SETTLE_S)
        await scene.load.wait_ok(WARM_CALLS, READY_S, since=time.monotonic(), shards=[TARGET])
        lingering = await scene.lingering()
        summary = scene.load.summary(fault_at)
        wrong = [
            c
            for c in scene.load.calls
            if not c.ok
            and c.end >= fault_at
            and (c.shard != TARGET or c.kind not in (A.TIMEOUT, A.TASK_FAILED))
        ]
        report = scene.report(fault_at, lingering)
    print(report)  # the numbers, for -rP and for the issue, pass or fail
    assert summary.failed_total > 0, f"no call was stuck at all: the fault did not happen\n{report}"
    assert wrong == [], f"{len(wrong)} failed calls were not stuck tasks\n{report}"
    assert lingering == [], report


async def test_a_dead_pool_process_of_a_real_worker_fails_only_the_call_it_was_computing(
    fault_run: FaultRun, stack: Stack
) -> None:
    """kill -9 of one of two busy pool processes of a worker: its pool breaks. The real worker
    answers the call that process was computing with an error result itself (before anything
    outside it can act: the one failed call). A sibling call still running when the pool
    broke is abandoned and never taken again: the daemon sees tasks left waiting with slots
    free and replaces the worker (not taking), and the successor does that call: it does not
    time out (a sibling that finished first needs nothing). The reference worker, by design,
    runs each task of the broken pool again alone in a new pool itself: no call fails and it
    is not replaced. Nothing is left running that no current worker accounts for."""
    async with real_fleet(fault_run, stack) as scene:
        coordinator = scene.pid(TARGET)
        busy: list[A.Proc] = []

        def both_busy() -> bool:
            """Both pool processes of the target coordinator are inside a reward call now."""
            busy[:] = A.busy_pool_processes(scene.processes.children_of(coordinator))
            return len(busy) >= CONCURRENCY

        await scene.load.wait_until(both_busy, 30, "both pool processes busy")
        fault_at = time.monotonic()
        os.kill(busy[0].pid, signal.SIGKILL)
        await scene.load.wait_settled(time.monotonic(), SETTLE_S)
        await scene.load.wait_ok(WARM_CALLS, READY_S, since=time.monotonic(), shards=[TARGET])
        lingering = await scene.lingering()
        summary = scene.load.summary(fault_at)
        failed = [c for c in scene.load.calls if not c.ok and c.end >= fault_at]
        replaced = events(scene.daemon, "host.state", host=scene.names[TARGET], to="stale")
        serving = scene.pid(TARGET)
        breaks = worker_events(scene.root, scene.names[TARGET], "pool.broken")
        report = scene.report(fault_at, lingering)
    print(report)  # the numbers, for -rP and for the issue, pass or fail
    if stack.real:
        assert summary.failed_total <= 1, report
        assert all(c.kind == A.TASK_FAILED and c.shard == TARGET for c in failed), report
        assert A.TIMEOUT not in summary.failed, report
        # The other busy slot's call either finished before the pool broke, or was abandoned
        # with the pool: then the worker is replaced as not taking its tasks, and the
        # successor does that call (no timeout above). No other restart.
        assert [e.get("cause") for e in replaced] in ([], ["not_taking"]), report
    else:
        # By design the reference worker does not drop a broken pool's tasks: each runs again
        # alone in a new pool, and only one whose own process dies a second time gets an
        # error result (pool_broken). A pool process killed from outside dies once: every
        # call succeeds, and the worker is never replaced (no not_taking).
        assert len(breaks) == 1, f"the pool did not break once: {breaks}\n{report}"
        assert summary.failed_total == 0, report
        assert replaced == [], report
        assert serving == coordinator, report
    assert lingering == [], report


def worker_events(root: Path, host: str, event: str) -> list[dict[str, object]]:
    """The reference worker's JSON log lines named ``event`` in ``ctl/<host>.log`` (where
    the supervisor appends the worker's stderr), every worker of the host so far."""
    found = []
    for line in (root / "ctl" / f"{host}.log").read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                found.append(record)
    return found
