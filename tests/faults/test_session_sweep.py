"""No process of a dead worker outlives it: under a real daemon, a killed or terminated
worker's pool (and anything else in its session) is killed before its replacement starts,
whether the agent or the shepherd tells of the exit, and ``status HOST`` says how many.

Two workers: ``tests/family_worker.py`` (the reference worker after forking two children and
a grandchild in a group of its own; each replacement records which of its predecessors'
family it found alive when it started), and the REAL AReaL worker (``areal.reward.fs_worker``:
a coordinator, its spawned process pool and a multiprocessing resource tracker) from
``../shared/areal-fs`` (``REWARD_SUPERVISOR_AREAL`` overrides). The scenarios of the real
worker run on the stacks of ``tests.areal.stacks``: where areal-fs is absent, ``[real]`` skips,
named, and ``[reference]`` runs the same scenario with the family stand-in in its place.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import agent as agent_module
from supervisor import control
from tests import areal as A
from tests import shared
from tests.family_worker import alive, families
from tests.faults.harness import READY_S, FaultRun, host_row, kill, pid_of, wait_event
from tests.faults.test_worker_faults import wait_ready_pid
from tests.sshd import children
from tests.system.daemonproc import (
    FAST_WORKER_ARGV,
    DaemonProcess,
    all_ready,
    pid_alive,
    poll_until,
)

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

REPO = Path(__file__).resolve().parents[2]
FAMILY_WORKER = REPO / "tests" / "family_worker.py"
#: The family a stand-in leaves: two children and a grandchild.
FAMILY = 3
#: The AReaL worker's pool size here (it defaults to 48): its session then holds that many
#: pool processes and one resource tracker once every slot has a task.
AREAL_CONCURRENCY = 3
#: A reward call that outlives the test: the pool's processes stay busy until killed.
SLOW_CALL = {"reward_fn": "time.sleep", "args": [600], "kwargs": {}}


def agents_under(sessions: list[int]) -> list[int]:
    """The agents (``python ... -c PROGRAM agent``) descended from ``sessions``."""
    found: list[int] = []
    todo = list(sessions)
    while todo:
        pid = todo.pop()
        todo.extend(children(pid))
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if argv[-1:] == [b"agent"] and b"-c" in argv:
            found.append(pid)
    return found


def family_argv(record: Path) -> list[str]:
    """``worker.argv`` for the family stand-in recording to ``record``."""
    assert FAST_WORKER_ARGV[1] == "-m"
    return ["{python}", str(FAMILY_WORKER), str(record), "--then", *FAST_WORKER_ARGV[2:]]


@pytest.fixture
def leftovers() -> Iterator[list[list[int]]]:
    """``[pid, start]`` pairs a test saw in workers' sessions: any still alive at its end are
    killed (the test has failed by then)."""
    seen: list[list[int]] = []
    yield seen
    for member in seen:
        if alive(member):
            kill(member[0])


async def family_of(record: Path, pid: int, leftovers: list[list[int]]) -> list[list[int]]:
    """Worker ``pid``'s family as it recorded it (waited for)."""
    found: list[list[list[int]]] = []

    def recorded() -> bool:
        """Worker ``pid`` has written its line."""
        found[:] = [line["family"] for line in families(record) if line["worker"] == pid]
        return bool(found)

    await poll_until(recorded, READY_S, f"worker {pid} to record its family")
    leftovers.extend(found[0])
    return found[0]


def inherited(record: Path, pid: int) -> list[list[int]]:
    """What worker ``pid`` found alive of its predecessors' families when it started."""
    [line] = [line for line in families(record) if line["worker"] == pid]
    found: list[list[int]] = line["inherited"]
    return found


async def last_exit(daemon: DaemonProcess) -> dict[str, Any]:
    """``status worker-0``'s last exit."""
    detail = await control.request(daemon.socket, "status", host="worker-0")
    found: dict[str, Any] = detail["last_exit"]
    return found


async def test_a_killed_worker_s_session_is_reaped_before_its_replacement_starts(
    fault_run: FaultRun, tmp_path: Path, leftovers: list[list[int]]
) -> None:
    """kill -9 of a worker with two children and a grandchild in another group: the agent
    pushes the exit at once, the shepherd sweeps all three before its exit record (and before
    it hands the shard lock to the replacement), the replacement finds none of them alive
    when it starts, and status HOST shows three."""
    record = tmp_path / "families.jsonl"
    fault_run.write(fault_run.raw(1, worker={"argv": family_argv(record)}))
    daemon = await fault_run.start(ready=1)
    victim = pid_of(await daemon.status(), "worker-0")
    family = await family_of(record, victim, leftovers)
    kill(victim)
    pushed = await daemon.wait_log("worker.exit_reported", host="worker-0", pid=victim, via="agent")
    replacement = await wait_ready_pid(daemon, "worker-0", other_than=victim)
    leftovers.extend(await family_of(record, replacement, leftovers))
    assert inherited(record, replacement) == [], "the replacement started beside its family"
    assert [m for m in family if alive(m)] == []
    told = await daemon.wait_log("worker.exit_reported", host="worker-0", pid=victim, via="record")
    # The push counts them where the shepherd was done by then, else says nothing (None).
    assert (pushed["reaped"], told["reaped"]) in ((None, FAMILY), (FAMILY, FAMILY)), (pushed, told)
    shown = await last_exit(daemon)
    assert (shown["pid"], shown["reaped"]) == (victim, FAMILY)


async def test_with_the_channel_down_the_shepherd_reaps_before_its_record(
    fault_run: FaultRun, tmp_path: Path, leftovers: list[list[int]]
) -> None:
    """sshd down (no agent, no push) when the worker is killed: its shepherd kills the
    family before it writes the exit record, which counts all three; once sshd is back the
    replacement finds none of them alive."""
    record = tmp_path / "families.jsonl"
    fault_run.write(fault_run.raw(1, worker={"argv": family_argv(record)}))
    daemon = await fault_run.start(ready=1)
    victim = pid_of(await daemon.status(), "worker-0")
    family = await family_of(record, victim, leftovers)
    mark = len(daemon.lines)
    agents = agents_under(fault_run.openssh.session_pids())
    assert agents, "no agent found under the sshd's sessions"
    fault_run.openssh.stop()
    try:
        await wait_event(daemon, "ssh.down", after=mark, host="worker-0")
        # The agent outlives its session by a moment (it reads EOF): until it is gone its
        # exit watch would sweep the family first, and the record would count none.
        await poll_until(lambda: not any(map(pid_alive, agents)), READY_S, "the agent gone")
        kill(victim)
        told = await wait_event(daemon, "worker.exit_reported", after=mark, pid=victim)
        assert (told["via"], told["reaped"]) == ("record", FAMILY)
        assert [m for m in family if alive(m)] == []
    finally:
        fault_run.openssh.start()
    replacement = await wait_ready_pid(daemon, "worker-0", other_than=victim)
    await family_of(record, replacement, leftovers)
    assert inherited(record, replacement) == []
    assert (await last_exit(daemon))["reaped"] == FAMILY


async def test_a_stuck_worker_terminated_after_its_grace_leaves_no_session_member(
    fault_run: FaultRun, tmp_path: Path, leftovers: list[list[int]]
) -> None:
    """A hung worker ignoring SIGTERM is SIGKILLed after stop_grace_s with its group, its
    grandchild outside the group is swept: host.terminated counts all three, and the
    replacement finds none of them alive."""
    record = tmp_path / "families.jsonl"
    raw = fault_run.raw(
        1,
        env={"REWARD_WORKER_FAULT": "hang_ignore_term:after=0.5"},
        health={"kill_after_grace": True, "stop_grace_s": 1.0},
        worker={"argv": family_argv(record)},
    )
    fault_run.write(raw)
    daemon = await fault_run.start(ready=1)
    hung = pid_of(await daemon.status(), "worker-0")
    family = await family_of(record, hung, leftovers)
    terminated = await daemon.wait_log("host.terminated", host="worker-0", pid=hung)
    assert terminated["reaped"] == FAMILY
    assert [m for m in family if alive(m)] == []
    replacement = await wait_ready_pid(daemon, "worker-0", other_than=hung)
    await family_of(record, replacement, leftovers)
    assert inherited(record, replacement) == []


# --- the real AReaL worker -------------------------------------------------------------------


@pytest.fixture(params=A.stacks())
def areal(request: pytest.FixtureRequest) -> Path | None:
    """The areal-fs directory of the ``real`` stack; None: the ``reference`` stack, where the
    family stand-in takes the AReaL worker's place (``tests.areal.stacks``)."""
    if request.param == A.REAL:
        return shared.require(shared.AREAL)
    return None


def areal_raw(fault_run: FaultRun, record: Path, areal: Path | None) -> dict[str, Any]:
    """A config for one host running the AReaL worker from ``areal`` with a pool of
    AREAL_CONCURRENCY, or, for ``areal`` None, the family stand-in recording to ``record``."""
    if areal is None:
        return fault_run.raw(1, worker={"argv": family_argv(record)})
    argv = ["{python}", "-m", "areal.reward.fs_worker", "--root", "{root}", "--shard", "{shard}"]
    argv += ["--host", "{host}", "--concurrency", "{concurrency}"]
    raw = fault_run.raw(1, env={"PYTHONPATH": str(areal)}, worker={"argv": argv})
    raw["hosts"][0]["concurrency"] = AREAL_CONCURRENCY
    return raw


async def busy_session(
    fault_run: FaultRun, pid: int, record: Path, leftovers: list[list[int]]
) -> list[list[int]]:
    """Give worker ``pid`` a slow task for every pool slot and wait until its session holds
    the whole pool and the resource tracker (the AReaL worker), or its family (the stand-in);
    those members as ``[pid, start]`` pairs."""
    if record.exists():
        return await family_of(record, pid, leftovers)
    inbox = fault_run.root / "inbox" / "0"
    inbox.mkdir(parents=True, exist_ok=True)
    for i in range(AREAL_CONCURRENCY):
        task = {"task_id": f"slow-{pid}-{i}", "created_at": time.time(), **SLOW_CALL}
        (inbox / f".slow-{pid}-{i}.tmp").write_text(json.dumps(task))
        os.replace(inbox / f".slow-{pid}-{i}.tmp", inbox / f"slow-{pid}-{i}.json")
    wanted = AREAL_CONCURRENCY + 1  # the pool, and the resource tracker
    await poll_until(
        lambda: len(agent_module.session_members(pid)) >= wanted,
        READY_S,
        f"worker {pid}'s pool of {AREAL_CONCURRENCY} and its resource tracker",
    )
    members = [[p, t] for p, t in sorted(agent_module.session_members(pid).items())]
    assert len(members) == wanted, members
    leftovers.extend(members)
    return members


async def kill_and_replace(
    daemon: DaemonProcess, victim: int, members: list[list[int]]
) -> tuple[int, dict[str, Any]]:
    """kill -9 ``victim``; once its replacement is ready, none of ``members`` may live.
    The replacement's pid and the agent's report of the exit."""
    kill(victim)
    pushed = await daemon.wait_log("worker.exit_reported", host="worker-0", pid=victim, via="agent")
    replacement = await wait_ready_pid(daemon, "worker-0", other_than=victim)
    assert [m for m in members if alive(m)] == [], "the dead worker's pool outlived it"
    return replacement, pushed


async def test_the_real_worker_s_pool_dies_with_its_coordinator(
    fault_run: FaultRun, tmp_path: Path, leftovers: list[list[int]], areal: Path | None
) -> None:
    """The AReaL worker with every pool slot busy, killed with SIGKILL: once its replacement
    is ready, none of its pool processes or its resource tracker lives, and the exit's
    reports count them all."""
    record = tmp_path / "families.jsonl"
    fault_run.write(areal_raw(fault_run, record, areal))
    daemon = await fault_run.start(ready=1)
    victim = pid_of(await daemon.status(), "worker-0")
    members = await busy_session(fault_run, victim, record, leftovers)
    _, pushed = await kill_and_replace(daemon, victim, members)
    told = await daemon.wait_log("worker.exit_reported", host="worker-0", pid=victim, via="record")
    assert told["reaped"] == len(members)
    assert pushed["reaped"] in (None, len(members)), pushed
    assert (await last_exit(daemon))["reaped"] == len(members)


async def test_the_real_worker_s_pool_dies_with_it_after_a_daemon_restart(
    fault_run: FaultRun, tmp_path: Path, leftovers: list[list[int]], areal: Path | None
) -> None:
    """The daemon SIGKILLed and started again adopts the busy AReaL worker (its agent, new,
    only watches it); a kill -9 of it then leaves none of its pool or resource tracker alive
    once the replacement is ready."""
    record = tmp_path / "families.jsonl"
    fault_run.write(areal_raw(fault_run, record, areal))
    first = await fault_run.start(ready=1)
    victim = pid_of(await first.status(), "worker-0")
    members = await busy_session(fault_run, victim, record, leftovers)
    first.send_signal(signal.SIGKILL)
    assert await first.wait_exit() == -signal.SIGKILL
    daemon = await fault_run.start()
    await daemon.wait_status(
        lambda s: all_ready(s, 1) and host_row(s, "worker-0").get("pid") == victim,
        READY_S,
        "adoption",
    )
    # The new agent watches it once the probe has found it (the heartbeat may adopt it first).
    await daemon.wait_log("host.probe", host="worker-0", found_pid=victim)
    assert [m for m in members if not alive(m)] == [], "the adoption touched the pool"
    _, pushed = await kill_and_replace(daemon, victim, members)
    told = await daemon.wait_log("worker.exit_reported", host="worker-0", pid=victim, via="record")
    # The agent sets its watch up just after its probe's reply: a kill in between finds the
    # worker gone and leaves its session to the shepherd, so the push may count nothing
    # (None); the larger of the two counts is all of them either way.
    counts = [n for n in (pushed["reaped"], told["reaped"]) if n is not None]
    assert max(counts) == len(members), (pushed, told)
