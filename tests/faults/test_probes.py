"""Reward probes through the real queue: a worker that heartbeats but cannot score (its reward
function cannot be imported, scores wrong, or hangs) is found by the answer to a known task,
per host and fleet-wide; a healthy fleet and the trainer's calls are not disturbed, and no
probe file outlives the daemon, even a SIGKILLed one.

Each scenario runs on two stacks (``stack``): ``real``, areal-fs's worker and client
(skipped, named, where areal-fs is absent: ``tests/shared.py``), and ``reference``, the
reference worker (``python -m supervisor.demo.worker``) and ``tests.areal.ContractClient``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor import config as config_mod
from supervisor import control, render
from supervisor.probes import is_probe_file
from tests import areal as A
from tests import shared
from tests.faults.harness import READY_S, FaultRun, events, host_row, wait_event
from tests.system.daemonproc import all_ready

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

INTERVAL_S = 2.0
TIMEOUT_S = 3.0
#: Hosts failing a probe alike that make a probe signature.
THRESHOLD = 3
#: The call every probe makes: AReaL's reward signature, scored 1.0 by ``tests.rewardfns``.
GOOD_PROBE: Mapping[str, Any] = {
    "interval_s": INTERVAL_S,
    "timeout_s": TIMEOUT_S,
    "reward_fn": A.EXACT,
    "args": [A.PROMPT, A.COMPLETIONS],
    "kwargs": {"answer": A.ANSWER},
    "expect": 1.0,
}


@dataclass(frozen=True, slots=True)
class Stack:
    """Which worker the fleet runs (``areal`` None: the reference worker)."""

    name: str
    areal: Path | None


@pytest.fixture(params=["real", "reference"])
def stack(request: pytest.FixtureRequest) -> Stack:
    """The stack of this run: ``real`` skips, named, where areal-fs is absent."""
    if request.param == "real":
        return Stack("real", shared.require(shared.AREAL))
    return Stack("reference", None)


def probe_config(
    fault_run: FaultRun, stack: Stack, hosts: int, probe: Mapping[str, Any]
) -> dict[str, Any]:
    """A fast config for ``hosts`` workers of ``stack`` with ``[probe]`` = ``probe``."""
    raw = fault_run.raw(
        hosts,
        env=A.worker_env(stack.areal),
        health={"heartbeat_stale_s": 5.0},
        fleet={"crash_signature_hosts": THRESHOLD, "crash_signature_window_s": 300.0},
        probe=dict(probe),
    )
    if stack.areal is not None:
        raw["worker"]["argv"] = list(config_mod.DEFAULT_ARGV)
    return raw


def probe_files(root: Path) -> list[str]:
    """Every probe file under ``inbox/*/`` and ``outbox/``."""
    found = [p.name for p in (root / "outbox").iterdir() if is_probe_file(p.name)]
    for shard in (root / "inbox").iterdir():
        found += [f"{shard.name}/{p.name}" for p in shard.iterdir() if is_probe_file(p.name)]
    return found


def probe_signatures(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The probe signatures a status reply shows."""
    found: list[dict[str, Any]] = status["daemon"]["probe_signatures"]
    return found


async def test_a_reward_fn_missing_on_every_host_is_held_with_the_error_shown(
    fault_run: FaultRun, stack: Stack
) -> None:
    """Three workers heartbeat ready but cannot import the probe's reward fn: within one
    interval plus the timeout of the first probe, a probe signature holds all but the canary,
    each host's status names the worker's ModuleNotFoundError, no host is ready; a reload
    that fixes the probe's reward fn releases them and all become ready."""
    broken = {**GOOD_PROBE, "reward_fn": A.BROKEN_IMPORT}
    fault_run.write(probe_config(fault_run, stack, THRESHOLD, broken))
    daemon = await fault_run.start()

    found = await wait_event(daemon, "fleet.probe_signature", timeout_s=READY_S)
    # Within one probe round, so within interval_s + timeout_s of the workers' first
    # heartbeats: the signature comes with the first answer of the last host to answer (a
    # host up sooner may have answered twice by then, on a loaded machine), stated by the
    # log's order, not by a clock on a shared machine.
    lines = daemon.lines
    at = lines.index(found)
    answers = [i for i, line in enumerate(lines) if line.get("event") == "host.reward_probe"]
    before = [lines[i]["host"] for i in answers if i < at]
    assert len(set(before)) == THRESHOLD, (before, found)
    assert before.index(before[-1]) == len(before) - 1, (before, found)
    assert "No module named" in found["signature"], found
    status = await daemon.wait_status(
        lambda s: (
            len(probe_signatures(s)) == 1 and len(probe_signatures(s)[0]["held"]) == THRESHOLD - 1
        ),
        READY_S,
        "all but the canary held",
    )
    assert status["daemon"]["crash_signatures"] == []  # nothing crashed
    for name in status["hosts"]:
        row = host_row(status, name)
        assert row["state"] != "ready", (name, row)
        assert row["last_cause"] == "probe_failed", (name, row)
        assert "No module named" in row["last_probe"]["what"], (name, row)
    assert not [e for e in events(daemon, "host.state") if e.get("to") == "ready"]
    assert "PROBE SIGNATURE" in render.render_table(status)
    detail = await control.request(daemon.socket, "status", host="worker-0")
    assert "last reward probe: reward probe failed:" in render.render_host(detail)
    assert "No module named" in render.render_host(detail)

    fixed = probe_config(fault_run, stack, THRESHOLD, GOOD_PROBE)
    fault_run.write(fixed)
    daemon.send_signal(signal.SIGHUP)
    cleared = await wait_event(daemon, "fleet.probe_signature_cleared", timeout_s=READY_S)
    assert cleared["reason"] == "a reload changed the reward probe", cleared
    await daemon.wait_status(lambda s: all_ready(s, THRESHOLD), READY_S, "all ready")
    assert await fault_run.stop(daemon) == 0
    assert probe_files(fault_run.root) == []


async def test_a_wrong_score_is_alive_but_wrong_not_a_crash(
    fault_run: FaultRun, stack: Stack
) -> None:
    """A probe whose answer scores 0.0 where 1.0 is expected makes the host unhealthy with
    cause ``probe_wrong`` ("alive but wrong"); it is never ready and never a crash."""
    wrong = {**GOOD_PROBE, "kwargs": {"answer": "19"}}
    fault_run.write(probe_config(fault_run, stack, 1, wrong))
    daemon = await fault_run.start()
    change = await wait_event(daemon, "host.state", cause="probe_wrong", timeout_s=READY_S)
    assert "alive but wrong" in change["reason"], change
    status = await daemon.status()
    row = host_row(status, "worker-0")
    assert row["last_probe"]["cause"] == "probe_wrong", row
    assert not [e for e in events(daemon, "host.state") if e.get("to") == "ready"]
    assert status["daemon"]["crash_signatures"] == []
    assert await fault_run.stop(daemon) == 0
    assert probe_files(fault_run.root) == []


async def test_a_probe_slower_than_its_timeout_fails_and_recovers_when_fast_again(
    fault_run: FaultRun, stack: Stack
) -> None:
    """A probe whose reward call hangs is unanswered within ``timeout_s``: the host is
    unhealthy with cause ``probe_timeout``; once the call is fast again the host is ready,
    and the timed-out probe's files are gone."""
    marker = fault_run.tmp_path / "hang-worker-0"
    marker.touch()
    slow = {
        **GOOD_PROBE,
        "reward_fn": A.HANG_IF_MARKER,
        "kwargs": {"answer": A.ANSWER, "hang_marker": str(fault_run.tmp_path / "hang-{host}")},
    }
    fault_run.write(probe_config(fault_run, stack, 1, slow))
    daemon = await fault_run.start()
    change = await wait_event(daemon, "host.state", cause="probe_timeout", timeout_s=READY_S)
    assert "unanswered" in change["reason"], change
    marker.unlink()
    await daemon.wait_status(lambda s: all_ready(s, 1), READY_S, "ready once fast")
    assert await fault_run.stop(daemon) == 0
    assert probe_files(fault_run.root) == []


async def test_a_healthy_fleet_stays_ready_and_the_trainer_is_undisturbed(
    fault_run: FaultRun, stack: Stack
) -> None:
    """Two healthy workers probed every second under the trainer's load: every probe
    scores, no host leaves ``ready``, no trainer call fails, and no probe file is left."""
    hosts = 2
    every_second = {**GOOD_PROBE, "interval_s": 1.0}
    fault_run.write(probe_config(fault_run, stack, hosts, every_second))
    daemon = await fault_run.start(ready=hosts)
    names = [f"worker-{i}" for i in range(hosts)]
    mark = len(daemon.lines)
    load = A.TrainerLoad(
        fault_run.root, names, hosts, areal=stack.areal, reward_fn=A.EXACT, loops=4
    )
    async with load:
        since = time.monotonic()
        await load.wait_ok(200, READY_S)
        await wait_event(
            daemon, "host.reward_probe", after=mark, count=5 * hosts, timeout_s=READY_S
        )
        summary = load.summary(since)
    assert summary.failed_total == 0, summary
    probes = [e for e in daemon.lines[mark:] if e.get("event") == "host.reward_probe"]
    assert all(e["status"] == "ok" and e["score"] == 1.0 for e in probes), probes
    assert [e for e in daemon.lines[mark:] if e.get("event") == "host.state"] == []
    assert await fault_run.stop(daemon) == 0
    assert probe_files(fault_run.root) == []


async def test_a_daemon_killed_mid_probe_leaves_no_probe_file(
    fault_run: FaultRun, stack: Stack
) -> None:
    """SIGKILL while a probe hangs in the worker leaves its task (and, once the call ends,
    its result); the next daemon sweeps them, and after its graceful stop no probe file is
    left in ``inbox/`` or ``outbox/``."""
    marker = fault_run.tmp_path / "hang-worker-0"
    slow = {
        **GOOD_PROBE,
        "reward_fn": A.HANG_IF_MARKER,
        "timeout_s": 60.0,
        "kwargs": {"answer": A.ANSWER, "hang_marker": str(fault_run.tmp_path / "hang-{host}")},
    }
    fault_run.write(probe_config(fault_run, stack, 1, slow))
    daemon = await fault_run.start()
    await daemon.wait_until(
        lambda: bool(A.read_status(fault_run.root, "worker-0")), READY_S, "a beat"
    )
    marker.touch()
    # The next probe hangs in the worker: its task file stays in the inbox.
    await daemon.wait_until(
        lambda: any("/" in f for f in probe_files(fault_run.root)), READY_S, "a probe in flight"
    )
    # The worker has taken it (its call hangs): its result will come after the kill.
    await daemon.wait_until(
        lambda: (A.read_status(fault_run.root, "worker-0") or {}).get("inflight", 0) >= 1,
        READY_S,
        "the probe in the worker's hands",
    )
    daemon.send_signal(signal.SIGKILL)
    await daemon.wait_exit(READY_S)
    assert probe_files(fault_run.root) != []  # the killed daemon could not clean up
    marker.unlink()  # the call ends: the worker writes the probe's result

    again = await fault_run.start(ready=1)
    await wait_event(again, "host.reward_probe", count=2, timeout_s=READY_S)
    assert await fault_run.stop(again) == 0
    assert probe_files(fault_run.root) == []
