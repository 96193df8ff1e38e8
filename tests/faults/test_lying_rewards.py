"""Rewards that lie, with the real AReaL worker and client under the shipped defaults: one
host whose reward calls "succeed" with 0.0 (a verifier dependency gone from that machine)
is named within 60 s of the first zero, kept serving and not ready while no spare is free,
and moved to a spare once one is (the trainer's zero rate back to normal, no call failed, no
restart); every host scoring 0 at once is one fleet-wide signature that moves and restarts
nothing.

The fault is the reward function's (``tests.rewardfns.zero_if_marker``): while a marker file
named after the address a machine was reached at exists, that machine's worker scores every
call 0, so the spare, reached at another address, scores right again. A healthy call scores
0 too at random, ZERO_SHARE of the time, as a run's wrong answers do.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor import control
from tests import areal as A
from tests import shared
from tests.faults.harness import READY_S, FaultRun, events, hold_for, host_row, wait_event
from tests.system.daemonproc import DaemonProcess

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

#: Three hosts (one per loopback alias of the session's sshd), two pool processes each, and
#: eight rollout loops: what two shared cores carry.
HOSTS = 3
CONCURRENCY = 2
LOOPS = 8
#: The lying host, on shard LIAR, and another one, on shard OTHER.
LIAR = 1
OTHER = 2
#: The spare machine, on the first host's address (not the liar's).
SPARE = "spare-0"
#: A healthy call scores 0 this often (a run's wrong answers).
ZERO_SHARE = 0.3
#: The issue's goal: a zero-scoring host named within this long of its first zero.
NAMED_S = 60.0
#: Calls on the moved shard the trainer's zero rate is taken over.
AFTER_CALLS = 60
#: How long after a fleet-wide signature nothing may be named, moved or restarted: two
#: looks past the longest a name takes (rewards.sustain_s) once out of line.
HOLD_S = 25.0
#: What the daemon logs when it names, moves or changes a host.
ACTIONS = frozenset({"rewards.lying", "shard.failover", "host.state", "host.launch"})


@dataclass
class Scene:
    """A fleet of real workers under the daemon, the trainer's load on it."""

    fault_run: FaultRun
    daemon: DaemonProcess
    load: A.TrainerLoad
    raw: dict[str, Any]
    names: list[str]
    markers: Path

    def marker(self, address: str) -> Path:
        """The file that makes the machine reached at ``address`` score every call 0."""
        return self.markers / f"zero-{address}"

    def address(self, host: int) -> str:
        """The address host ``host``'s machine is reached at."""
        return str(self.raw["hosts"][host]["address"])


@contextlib.asynccontextmanager
async def lying_fleet(fault_run: FaultRun, *, spare: bool) -> AsyncIterator[Scene]:
    """HOSTS real workers with the shipped defaults (and a spare, SPARE, on the first host's
    address), every shard serving the trainer's load (``zero_if_marker``, ZERO_SHARE of
    zeros)."""
    areal = shared.require(shared.AREAL)
    tag = uuid.uuid4().hex[:6]
    names = [f"lr{tag}-{i}" for i in range(HOSTS)]
    raw = A.shipped_config(
        fault_run.openssh,
        fault_run.root,
        names,
        areal=areal,
        socket=fault_run.tmp_path / "control.sock",
        concurrency=CONCURRENCY,
    )
    raw["run"]["reward_fn"] = A.ZERO_IF_MARKER
    if spare:
        first = raw["hosts"][0]
        raw["spares"] = [{"name": SPARE, "address": first["address"], "port": first["port"]}]
    fault_run.write(raw)
    daemon = await fault_run.start(ready=HOSTS)
    markers = fault_run.tmp_path / "markers"
    markers.mkdir()
    load = A.TrainerLoad(
        fault_run.root,
        names,
        HOSTS,
        areal=areal,
        reward_fn=A.ZERO_IF_MARKER,
        loops=LOOPS,
        call_kwargs={"zero_marker": str(markers / "zero-{addr}"), "zero_share": ZERO_SHARE},
    )
    async with load:
        for shard in range(HOSTS):
            await load.wait_ok(10, READY_S, shards=[shard])
        yield Scene(fault_run, daemon, load, raw, names, markers)


def report(scene: Scene, since: float) -> str:
    """What the trainer saw since ``since`` and what the daemon said of rewards."""
    summary = scene.load.summary(since)
    zero, ok = scene.load.scores(since=since, shards=[LIAR])
    lines = [
        f"since the fault: {summary.ok} OK calls, failed {dict(summary.failed)},"
        f" shard {LIAR}: {zero} of {ok} scored 0",
        *(
            f"  {e.get('event')}: {e.get('host', '')} {e.get('reason', '')}"
            for e in scene.daemon.lines
            if str(e.get("event", "")).startswith(("rewards.", "fleet.reward", "shard.failover"))
        ),
    ]
    return "\n".join(lines)


async def test_a_host_that_scores_0_is_named_within_60_s_kept_then_moved_to_a_spare(
    fault_run: FaultRun,
) -> None:
    """One machine's reward calls all score 0 while the only spare is busy (host 2 drained
    onto it). It is named within 60 s of its first zero (its reason gives its zero rate
    beside the fleet's), kept serving, shown ``lying``, and the fleet is not all ready; once
    ``undrain`` frees host 2's machine, that machine takes the liar's shard at the next look
    (its worker killed, not restarted), and the trainer's zero rate on the shard is back to
    the run's. No trainer call fails from the fault on."""
    async with lying_fleet(fault_run, spare=True) as scene:
        liar, other = scene.names[LIAR], scene.names[OTHER]
        await control.request(scene.daemon.socket, "drain", host=other)
        await scene.daemon.wait_status(
            lambda s: (
                host_row(s, other)["state"] == "ready" and host_row(s, other)["machine"] == SPARE
            ),
            READY_S,
            f"{other} ready on the spare",
        )
        await scene.load.wait_ok(10, READY_S, since=time.monotonic(), shards=[OTHER])
        fault_at = time.monotonic()
        mark = len(scene.daemon.lines)
        scene.marker(scene.address(LIAR)).touch()
        named = await wait_event(
            scene.daemon, "rewards.lying", after=mark, host=liar, timeout_s=NAMED_S
        )
        fault_run.recovered("zero-scoring host named", fault_at)
        assert "zero rate 100%" in named["reason"] and "the fleet's" in named["reason"], named
        kept = await wait_event(scene.daemon, "rewards.not_moved", after=mark, host=liar)
        assert "no spare is free" in kept["reason"], kept
        status = await scene.daemon.status()
        row = host_row(status, liar)
        assert row["state"] == "lying" and row["rewards"]["verdict"] == "lying", row
        assert status["daemon"]["all_ready"] is False
        assert "1 lying" in status["daemon"]["summary"]
        assert status["daemon"]["rewards"]["lying"] == [liar]

        freed = len(scene.daemon.lines)
        assert await control.request(scene.daemon.socket, "undrain", host=other) == {"spare": other}
        move = await wait_event(
            scene.daemon, "shard.failover", after=freed, host=liar, timeout_s=READY_S
        )
        assert (move["reason"], move["to_machine"]) == ("lying", other), move
        status = await scene.daemon.wait_status(
            lambda s: (
                host_row(s, liar)["state"] == "ready" and host_row(s, liar)["machine"] == other
            ),
            READY_S,
            f"{liar} ready on {other}'s machine",
        )
        fault_run.recovered("zero-scoring host's shard served by a spare", fault_at)
        served = time.monotonic()
        await scene.load.wait_ok(AFTER_CALLS, READY_S, since=served, shards=[LIAR])
        zero, ok = scene.load.scores(since=served, shards=[LIAR])
        text = report(scene, fault_at)
        summary = scene.load.summary(fault_at)
        held = status["daemon"]["rewards"]["held"]
    print(text)  # the numbers, for -rP and for the issue, pass or fail
    assert zero / ok < 0.6, f"shard {LIAR} still scores 0 {zero} of {ok} times\n{text}"
    assert summary.failed_total == 0, text
    assert [h["machine"] for h in held] == [liar], held
    assert host_row(status, liar)["restarts"] == 0, host_row(status, liar)
    assert not events(scene.daemon, "host.state", host=liar, to="stale"), text
    assert status["daemon"]["all_ready"] is True


async def test_every_host_scoring_0_at_once_is_one_signature_with_no_move_and_no_restart(
    fault_run: FaultRun,
) -> None:
    """Every machine's calls score 0 at once after a healthy spell (a shared dependency
    gone): one fleet-wide signature within 60 s, and with a spare free nothing is moved,
    nobody named, nothing restarted; the fleet stays ready (the trainer can call)."""
    async with lying_fleet(fault_run, spare=True) as scene:
        # Each host's own past: a spell of healthy rollouts before the fault.
        await scene.load.wait_ok(600, READY_S, since=time.monotonic())
        fault_at = time.monotonic()
        mark = len(scene.daemon.lines)
        for host in range(HOSTS):
            scene.marker(scene.address(host)).touch()
        found = await wait_event(
            scene.daemon, "fleet.reward_signature", after=mark, timeout_s=NAMED_S
        )
        fault_run.recovered("fleet-wide reward signature", fault_at)

        def nothing_moves() -> None:
            """No host named, moved, or changing state (a restart) since the fault."""
            later = scene.daemon.lines[mark:]
            acted = [e for e in later if e.get("event") in ACTIONS]
            assert acted == [], report(scene, fault_at)

        await hold_for(HOLD_S, nothing_moves)
        status = await scene.daemon.status()
        text = report(scene, fault_at)
    print(text)  # the numbers, for -rP and for the issue, pass or fail
    assert sorted(found["hosts"]) == sorted(scene.names), found
    assert found["kinds"] == ["zero"], found
    assert status["daemon"]["rewards"]["signature"] is not None
    assert status["daemon"]["all_ready"] is True
    assert status["daemon"]["summary"].startswith("REWARD SIGNATURE (zero rate)")
