"""What one heartbeat costs the daemon, piece by piece, in one process (no I/O but the read).

    .venv/bin/python -m bench.bench_core [--hosts 1000]

Per heartbeat the daemon reads and parses a status file (``statusfiles``), feeds one
``HeartbeatSeen`` to ``health.step`` and re-arms that host's timer; when a state change
could freeze the fleet it looks at every host (``fleet.survey`` and ``fleet.assess``,
O(hosts)). This
times each piece in a loop on a READY host (median of 5 repetitions) so the scale
benchmark's CPU figure can be split into its parts. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bench.common import SCRATCH
from supervisor import freeze as freezes
from supervisor import health, render, rewards, vocabulary
from supervisor.statusfiles import parse_status, read_status

POLICY = health.Policy(heartbeat_stale_s=60.0)


def ready_host(name: str, now: float, *, pid: int = 5) -> health.Host:
    """A host adopted and ready (its worker ``pid``), as at steady state."""
    host = health.new_host(name, now)
    for event in (
        health.SshRestored(),
        health.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=1.0, remote_seq=1),
        health.ProbeResult(pid=pid),
        health.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=2.0, remote_seq=2),
    ):
        host, _ = health.step(host, event, now, POLICY)
        now += 0.5
    assert host.state is health.HostState.READY
    return host


def per_call(fn: Callable[[int], object], n: int) -> float:
    """Median seconds per call of ``fn(i)`` over 5 runs of ``n`` calls."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        runs.append((time.perf_counter() - start) / n)
    return statistics.median(runs)


def measure(hosts: int) -> list[tuple[str, float, str]]:
    """(piece, seconds per call, how often it runs)."""
    now = 1000.0
    host = ready_host("h0", now)
    state = {"host": host}

    def beat(i: int) -> None:
        event = health.HeartbeatSeen(
            pid=5, ready=True, remote_heartbeat_at=10.0 + i, remote_seq=10 + i
        )
        state["host"], _ = health.step(state["host"], event, now + 2 + i * 1e-3, POLICY)

    fleet_hosts = [replace(host, name=f"h{i}") for i in range(hosts)]
    policy = vocabulary.FleetPolicy()
    silent_after_s = POLICY.heartbeat_stale_s / 2
    freeze = freezes.Freeze()

    def assess(_i: int) -> None:
        surveyed = freezes.survey(freeze, fleet_hosts, now + 3, silent_after_s)
        freezes.assess(freeze, fleet_hosts, now + 3, policy, silent_after_s, surveyed=surveyed)

    def summary(_i: int) -> None:
        render.summary(h.state.value for h in fleet_hosts)

    # Rewards: every host's worker reports its counts; each look samples and judges them all.
    machines = {h.name: h.name for h in fleet_hosts}
    looked = {"state": rewards.NONE, "at": now}
    reward_policy = vocabulary.FleetPolicy().rewards

    def counted(i: int) -> dict[str, health.Host]:
        stats = health.WorkerStats(completed=150 * i, errors=0, semantic_zero=50 * i)
        return {h.name: replace(h, stats=stats) for h in fleet_hosts}

    reporting = [counted(i) for i in range(40)]

    def look(i: int) -> None:
        looked["at"] += rewards.LOOK_S
        looked["state"], _ = rewards.look(
            looked["state"],
            reporting[i % 40] if i % 40 else reporting[1],
            machines,
            now=looked["at"],
            policy=reward_policy,
        )

    for i in range(1, 40):
        look(i)  # a full window of samples, as at steady state

    def history(_i: int) -> None:
        _ = health.history_of(host) != health.history_of(host)

    loop = asyncio.new_event_loop()
    handles = [loop.call_at(1e9, lambda: None)]

    def rearm(i: int) -> None:
        handles[0].cancel()
        handles[0] = loop.call_at(1e9 + i, lambda: None)

    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        path = Path(tmp) / "h0.json"
        data = json.dumps(
            {"ready": True, "heartbeat_at": time.time(), "pid": 5, "seq": 3, "host": "h0"}
        ).encode()
        path.write_bytes(data)
        read = per_call(lambda _i: read_status(path), 20_000)
    rows = [
        ("statusfiles.read_status (open, fstat, read, close, parse)", read, "per heartbeat"),
        (
            "statusfiles.parse_status (of that: JSON and checks)",
            per_call(lambda _i: parse_status(data), 20_000),
            "per heartbeat",
        ),
        ("health.step(HeartbeatSeen) on a ready host", per_call(beat, 20_000), "per heartbeat"),
        ("health.history_of x2 and compare (Fleet._feed)", per_call(history, 20_000), "per event"),
        (
            "dataclasses.replace(Host, one field)",
            per_call(lambda i: replace(host, alive_at=float(i)), 20_000),
            "inside step",
        ),
        (
            "loop timer cancel + call_at (one re-arm)",
            per_call(rearm, 20_000),
            "per heartbeat",
        ),
        (
            f"fleet.survey + assess, {hosts} hosts",
            per_call(assess, 200),
            "per look (a state change that could freeze)",
        ),
        (f"render.summary, {hosts} hosts", per_call(summary, 200), "per state change"),
        (
            f"rewards.look, {hosts} hosts reporting their counts",
            per_call(look, 40),
            f"every {rewards.LOOK_S:g} s",
        ),
    ]
    loop.close()
    return rows


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    args = parser.parse_args()
    print("| piece | cost | runs |")
    print("|---|---:|---|")
    for name, seconds, when in measure(args.hosts):
        print(f"| {name} | {seconds * 1e6:.1f} µs | {when} |")


if __name__ == "__main__":
    main()
