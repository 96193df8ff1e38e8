"""Worker clocks hours off: a healthy worker is never restarted, a hung one is never kept."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from tests.faults.harness import HEALTH, READY_S, FaultRun, events, hold_for, host_row, kill, pid_of
from tests.faults.test_worker_faults import wait_ready_pid

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

HOURS_3 = 3 * 3600.0


async def skewed_run(fault_run: FaultRun, offset_s: float) -> None:
    """One run whose worker's clock is ``offset_s`` off: healthy for twice the stale
    threshold without a restart, then SIGSTOPped and replaced within the threshold's reach."""
    tag = "ahead" if offset_s > 0 else "behind"
    root = fault_run.tmp_path / f"run-{tag}"
    raw = fault_run.raw(
        1,
        root=root,
        socket=fault_run.tmp_path / f"control-{tag}.sock",
        env={"REWARD_WORKER_CLOCK_OFFSET_S": repr(offset_s)},
    )
    daemon = await fault_run.start(fault_run.write(raw, fault_run.tmp_path / f"rs-{tag}.toml"))
    status = await daemon.wait_status(
        lambda s: host_row(s, "worker-0")["state"] == "ready", READY_S, f"{tag}: ready"
    )
    pid = pid_of(status, "worker-0")
    beat = json.loads((root / "status" / "worker-0.json").read_text())
    assert abs(beat["heartbeat_at"] - offset_s - time.time()) < 600, beat  # the skew is real

    def untouched() -> None:
        """No state change and no other worker since the first ready."""
        assert events(daemon, "host.state")[1:] == [], f"{tag}: {events(daemon, 'host.state')}"
        assert fault_run.monitor.pids_seen(0, root) == [pid]

    # The monitor's latest sample (every 20 ms, later under load) can predate the worker:
    # check from a scan that began after ``ready``.
    taken = fault_run.monitor.samples
    await daemon.wait_until(
        lambda: fault_run.monitor.samples >= taken + 2, READY_S, f"{tag}: two fresh samples"
    )
    stale_s = float(HEALTH["heartbeat_stale_s"])
    await hold_for(2 * stale_s, untouched)
    stopped_at = time.monotonic()
    kill(pid, signal.SIGSTOP)
    stale = await daemon.wait_log("host.state", host="worker-0", to="stale")
    fault_run.recovered(f"clock 3 h {tag}, SIGSTOP: stale", stopped_at)
    assert stale["reason"].startswith("heartbeat stale"), f"{tag}: {stale}"
    replacement = await wait_ready_pid(daemon, "worker-0", other_than=pid)
    fault_run.recovered(f"clock 3 h {tag}, SIGSTOP: replacement ready", stopped_at)
    assert fault_run.monitor.pids_seen(0, root) == [pid, replacement]


async def test_skewed_worker_clocks_change_no_decision(fault_run: FaultRun) -> None:
    """Two runs side by side, one worker 3 h ahead and one 3 h behind: neither is restarted
    while it heartbeats, and each is declared stale and replaced once it stops."""
    async with asyncio.TaskGroup() as tg:
        tg.create_task(skewed_run(fault_run, +HOURS_3))
        tg.create_task(skewed_run(fault_run, -HOURS_3))
