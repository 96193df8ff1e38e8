"""A bad deploy: every worker of 20 hosts exits 1 at start (its module is not installed). One
crash signature holds the fleet's restarts but for one canary; a reload with a working config
brings every host up; kill -9 is no signature and keeps its ordinary restart."""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time
from typing import Any

import pytest

from supervisor import render
from tests.faults.harness import (
    READY_S,
    FaultRun,
    Workload,
    events,
    hold_for,
    host_row,
    kill,
    pid_of,
    wait_event,
    wall,
)
from tests.system.daemonproc import FAST_WORKER_ARGV, all_ready
from tests.system.test_metrics import free_port, scrape

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

HOSTS = 20
#: fleet.crash_signature_hosts: this many hosts crashing alike make a signature.
THRESHOLD = 3
#: Longer than the backoff cap (2 s): a held host that were restarted would show in it.
HOLD_S = 6.0
#: The harness's restart_cooldown_s, and how much later a log stamp may be than the core's clock.
COOLDOWN_S = 0.5
STAMP_SLACK_S = 0.05
#: A worker module that is not installed (a deploy that left it out of the venv): python
#: exits 1 at once with "No module named ...". A reward fn that cannot be imported is no bad
#: deploy of this kind: the worker (the real one as the reference one) answers every task
#: with an error result and stays up.
BAD_WORKER_MODULE = "supervisor.demo.worker_v2"


def restarts_of(daemon: Any, *, after: int = 0) -> list[dict[str, Any]]:
    """Automatic restarts asked for (``host.launch`` with ``restart``), from line ``after``."""
    return [
        line
        for line in daemon.lines[after:]
        if line.get("event") == "host.launch" and line.get("restart") is True
    ]


def signatures(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The crash signatures a status reply shows."""
    found: list[dict[str, Any]] = status["daemon"]["crash_signatures"]
    return found


async def test_bad_deploy_holds_restarts_on_one_signature_until_a_fixed_reload(
    fault_run: FaultRun,
) -> None:
    """20 hosts whose workers all exit 1 at start: one ``fleet.crash_signature`` (exit 1 and
    the worker's last log line), restarts only up to the threshold and then on the canary
    alone, the signature shown in ``status``, ``STATUS=`` and the metrics; a reload with the
    working worker argv releases it and every host becomes ready; then kill -9 of THRESHOLD
    workers forms no signature, each is restarted once, and every task is done exactly once."""
    port = free_port()
    fleet = {"crash_signature_hosts": THRESHOLD, "crash_signature_window_s": 300.0}
    good = fault_run.raw(HOSTS, fleet=fleet, metrics={"listen": f"127.0.0.1:{port}"})
    bad_argv = [BAD_WORKER_MODULE if a == "supervisor.demo.worker" else a for a in FAST_WORKER_ARGV]
    assert bad_argv != FAST_WORKER_ARGV
    bad = {**good, "worker": {**good["worker"], "argv": bad_argv}}
    fault_run.write(bad)
    daemon = await fault_run.start()

    found = await wait_event(daemon, "fleet.crash_signature", timeout_s=READY_S)
    signature, canary = found["signature"], found["canary"]
    assert signature.startswith("exit 1: "), found
    assert "No module named" in signature, found  # the worker's own last words
    assert BAD_WORKER_MODULE in found["log_tail"], found
    assert len(found["hosts"]) == THRESHOLD
    assert canary in found["hosts"]
    mark = daemon.lines.index(found)

    # Every other host crashes once more at most and is then held: none restarts again.
    status = await daemon.wait_status(
        lambda s: len(signatures(s)) == 1 and len(signatures(s)[0]["held"]) == HOSTS - 1,
        READY_S,
        f"{HOSTS - 1} hosts held",
    )
    assert canary not in signatures(status)[0]["held"]
    canary_launches_before = len(events(daemon, "host.launch", host=canary))

    def only_the_canary_restarts() -> None:
        """After the signature, restarts are asked for the canary alone."""
        assert {r["host"] for r in restarts_of(daemon, after=mark)} <= {canary}

    await hold_for(HOLD_S, only_the_canary_restarts)
    # Before it formed, only the hosts whose crashes formed it restarted (each under its own
    # backoff: on a loaded machine the first may crash again before the others' first launch).
    before = [r for r in restarts_of(daemon) if daemon.lines.index(r) < mark]
    assert {r["host"] for r in before} <= set(found["hosts"]), before
    # The canary keeps trying, under its own backoff (cooldown 0.5 s doubling to 2 s): after
    # its first restart (at once), never two launches closer than the cooldown.
    canary_times = [wall(x) for x in events(daemon, "host.launch", host=canary)]
    assert len(canary_times) > canary_launches_before
    gaps = [b - a for a, b in itertools.pairwise(canary_times)]
    assert all(gap >= COOLDOWN_S - STAMP_SLACK_S for gap in gaps[1:]), gaps
    assert len(events(daemon, "fleet.crash_signature")) == 1

    # Shown where an operator looks: status (JSON and table), STATUS= and the metrics.
    status = await daemon.status()
    [shown] = signatures(status)
    assert shown["signature"] == signature
    assert shown["canary"] == canary
    for name in shown["held"]:
        row = host_row(status, name)
        assert row["state"] == "cooling_down", (name, row)
        assert row["restart_held"] is True, (name, row)
        assert row["next_restart_in_s"] is None, (name, row)  # no time: it waits for a release
    table = render.render_table(status)
    assert f"restarts held on {HOSTS - 1}, canary {canary}" in table
    assert any(f"CRASH SIGNATURE ({signature})" in n for n in daemon.notifications)
    metrics = await asyncio.to_thread(scrape, port)
    assert metrics["reward_supervisor_crash_signatures"] == 1
    assert metrics["reward_supervisor_restarts_held"] == HOSTS - 1

    # The fix: a reload with the working argv releases every held host; all become ready.
    fault_run.write(good)
    assert daemon.process is not None
    daemon.send_signal(signal.SIGHUP)
    cleared = await wait_event(daemon, "fleet.crash_signature_cleared", timeout_s=READY_S)
    assert cleared["signature"] == signature
    assert cleared["reason"] == "a reload changed what the workers run"
    assert sorted(cleared["released"]) == sorted(shown["held"])
    status = await daemon.wait_status(lambda s: all_ready(s, HOSTS), 3 * READY_S, "all ready")
    assert signatures(status) == []
    metrics = await asyncio.to_thread(scrape, port)
    assert metrics["reward_supervisor_crash_signatures"] == 0
    assert metrics["reward_supervisor_restarts_held"] == 0

    # kill -9 is a signal someone sent: never a signature, however many hosts get it.
    work = Workload(fault_run.root, shards=HOSTS, total=400, duration_s=3.0).start()
    try:
        victims = random.Random(17).sample(sorted(status["hosts"]), THRESHOLD)
        old = {name: pid_of(status, name) for name in victims}
        restarts = {name: host_row(status, name)["restarts"] for name in victims}
        killed_at = time.monotonic()
        for name in victims:
            kill(old[name], signal.SIGKILL)
        status = await daemon.wait_status(
            lambda s: all_ready(s, HOSTS) and all(host_row(s, n)["pid"] != old[n] for n in victims),
            READY_S,
            "every killed worker replaced",
        )
        fault_run.recovered(f"kill -9 of {THRESHOLD} workers: all ready again", killed_at)
        await work.wait_done()
    finally:
        work.close()
    work.assert_all_done_once()
    for name in victims:
        assert host_row(status, name)["restarts"] == restarts[name] + 1, name
        assert any(
            e["reason"] == "killed by signal 9 (SIGKILL)"
            for e in events(daemon, "host.state", host=name, to="stale")
        ), name
    assert len(events(daemon, "fleet.crash_signature")) == 1
    assert signatures(await daemon.status()) == []
