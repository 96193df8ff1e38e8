"""Workers that are alive and heartbeating but do no work: a hung reward call is found by
its lack of progress, its stacks are captured before the kill, and the task it held is done
exactly once by the replacement; an idle worker and a slow one are left alone."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from typing import Any

import pytest

from supervisor import control
from tests.faults.harness import (
    READY_S,
    FaultRun,
    Workload,
    events,
    host_row,
    pid_of,
    wait_event,
    wall,
)

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

#: Short, so that the tests take seconds: the config's minimum (3 s) plus a margin.
PROGRESS_STALE_S = 4.0
#: The task whose reward call hangs (one of the Workload's ids).
HUNG_TASK = "t0-000007"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``reward-supervisor ARGS`` as a separate process."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("stacks", "via"),
    [("signal", "faulthandler"), ("auto", "py-spy")],
    ids=["faulthandler", "py-spy"],
)
async def test_a_hung_reward_call_is_found_its_stacks_taken_and_its_task_done_once(
    fault_run: FaultRun, stacks: str, via: str
) -> None:
    """One reward call hangs forever in a pool process while heartbeats go on: once the
    other tasks are done and nothing finishes for progress_stale_s, the host is stuck; the
    stacks and the log tail are captured before the kill and land in the host.state event
    and in status HOST (by the signal: the worker passes it to its pool, so the hung call
    shows; py-spy reads the pool's processes too); the
    replacement does the hung task (the quarantine off), exactly once. With the contract's
    kill_after_grace = false: a stuck worker is killed all the same (kill_stuck)."""
    marker = fault_run.tmp_path / "hang.marker"
    fault = f"hang_call:task={HUNG_TASK}:marker={marker}"
    raw = fault_run.raw(
        1,
        env={"REWARD_WORKER_FAULT": fault},
        health={
            "progress_stale_s": PROGRESS_STALE_S,
            "evidence_stacks": stacks,
            "kill_after_grace": False,
            "quarantine_stuck_tasks": False,
        },
    )
    fault_run.write(raw)
    daemon = await fault_run.start(ready=1)
    first = pid_of(await daemon.status(), "worker-0")
    work = Workload(fault_run.root, shards=1, total=40, duration_s=1.0).start()
    try:
        stale = await daemon.wait_log("host.state", host="worker-0", to="stale", cause="stuck")
        fields: dict[str, Any] = {"host": "worker-0", "from": "stale", "to": "starting"}
        restart = await wait_event(daemon, "host.state", **fields)
        await work.wait_done()
    finally:
        work.close()
    # Detected by the daemon's own clock within progress_stale_s plus the timer's lateness:
    # the reason says how long it saw no task finish (rounded to a second).
    idle = re.fullmatch(r"stuck: no task finished in (\d+) s with 1 in flight", stale["reason"])
    assert idle is not None, stale["reason"]
    assert PROGRESS_STALE_S <= int(idle.group(1)) <= PROGRESS_STALE_S + 1
    results = {
        name.removesuffix(".json"): json.loads((fault_run.root / "outbox" / name).read_text())
        for name in work.results()
    }
    # The first worker did every task but the hung one (that call never returned).
    last_before = max(r["finished_at"] for name, r in results.items() if name != HUNG_TASK)
    fault_run.record(f"hung call ({via}): last task done -> stuck", wall(stale) - last_before)
    fault_run.record(f"hung call ({via}): stuck -> restart", wall(restart) - wall(stale))

    evidence = restart.get("evidence")
    assert isinstance(evidence, dict), restart
    assert evidence["pid"] == first and evidence["via"] == via, evidence
    # The signal reaches the pool (the worker passes it on); py-spy reads the worker's
    # children too (--subprocesses): either way the hung call in the pool shows.
    assert "hung_reward_call" in evidence["stacks"], evidence["stacks"]
    assert (
        '"kind": "hang_call"' in evidence["log_tail"]
    )  # the worker's own line, from before the kill

    # The hung task: done once, by the replacement.
    work.assert_all_done_once()
    hung = json.loads((fault_run.root / "outbox" / f"{HUNG_TASK}.json").read_text())
    status = await daemon.status()
    replacement = pid_of(status, "worker-0")
    assert replacement != first
    assert (hung["status"], hung["worker_host"]) == ("ok", "worker-0")
    assert hung["finished_at"] >= wall(restart)  # by the replacement: after the restart began
    assert fault_run.monitor.pids_seen(0) == [first, replacement]

    # status HOST, from the daemon over the socket and from the CLI with the log's lines.
    detail = await control.request(daemon.socket, "status", host="worker-0")
    assert detail["evidence"]["stacks"] == evidence["stacks"]
    assert detail["evidence"]["cause"] == stale["reason"]
    assert detail["last_exit"]["pid"] == first and detail["restart"]["total"] == 1
    shown = await asyncio.to_thread(
        cli, "status", "-c", str(fault_run.config_path), "worker-0", "--lines", "5", "--json"
    )
    assert shown.returncode == 0, shown.stderr
    cli_detail: dict[str, Any] = json.loads(shown.stdout)
    assert cli_detail["evidence"]["via"] == via
    assert len(cli_detail["log"]["lines"]) == 5 and cli_detail["log"]["error"] is None
    text = await asyncio.to_thread(cli, "status", "-c", str(fault_run.config_path), "worker-0")
    assert text.returncode == 0, text.stderr
    assert "hung_reward_call" in text.stdout and f"stacks ({via}):" in text.stdout


async def test_neither_an_idle_nor_a_slow_but_advancing_worker_is_restarted(
    fault_run: FaultRun,
) -> None:
    """worker-0 takes 2 s per task, one at a time (each finishes within progress_stale_s of
    the one before); worker-1 has an empty inbox the whole time. Neither is ever judged
    stuck, and every task gets its result."""
    raw = fault_run.raw(
        2,
        env={"REWARD_WORKER_TASK_DELAY_S": "2.0"},
        health={"progress_stale_s": PROGRESS_STALE_S},
    )
    raw["hosts"][0]["concurrency"] = 1
    fault_run.write(raw)
    daemon = await fault_run.start(ready=2)
    before = await daemon.status()
    pids = (pid_of(before, "worker-0"), pid_of(before, "worker-1"))
    # Only shard 0 gets tasks: 8 x 2 s, four times progress_stale_s of slow progress.
    work = Workload(fault_run.root, shards=1, total=8, duration_s=0.5).start()
    try:
        await daemon.wait_status(
            lambda s: (host_row(s, "worker-0").get("in_flight") or 0) > 0, READY_S, "busy"
        )
        await work.wait_done(timeout_s=READY_S + 16)
    finally:
        work.close()
    work.assert_all_done_once()
    after = await daemon.wait_status(
        lambda s: host_row(s, "worker-0").get("processed") == 8, READY_S, "the last count seen"
    )
    assert (pid_of(after, "worker-0"), pid_of(after, "worker-1")) == pids
    assert [e["to"] for e in events(daemon, "host.state")] == ["ready", "ready"]
    assert len(events(daemon, "host.launch")) == 2
    idle = host_row(after, "worker-1")
    assert (idle["state"], idle["progress"], idle["in_flight"]) == ("ready", "reported", 0)
    assert host_row(after, "worker-0")["restarts"] == 0
