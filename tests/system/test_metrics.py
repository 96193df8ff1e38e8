"""The Prometheus endpoint, scraped for real and checked against ``status --json``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from supervisor import cli, control, render
from tests import areal as A
from tests import ports, promql
from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    FAST_HEALTH,
    DaemonProcess,
    Daemons,
    all_ready,
    fast_config,
    write_config,
)

pytestmark = [pytest.mark.system, pytest.mark.openssh]


def free_port() -> int:
    """A TCP port free on 127.0.0.1, reserved for this process (tests/ports.py)."""
    return ports.reserve("127.0.0.1")


def parse(text: str) -> dict[str, float]:
    """Prometheus text format → {'name{labels}': value} (comments dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def scrape(port: int) -> dict[str, float]:
    """GET /metrics from the daemon."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return parse(reply.read().decode())


@pytest.fixture
async def daemon(openssh: OpenSsh, tmp_path: Path, daemons: Daemons) -> tuple[DaemonProcess, int]:
    """A two-host daemon with metrics on a free loopback port."""
    port = free_port()
    raw = fast_config(
        openssh, tmp_path / "run", 2, tmp_path, metrics={"listen": f"127.0.0.1:{port}"}
    )
    return await daemons.start(write_config(tmp_path / "rs.toml", raw)), port


async def test_metrics_agree_with_status(daemon: tuple[DaemonProcess, int]) -> None:
    """Hosts by state, SSH, heartbeat ages, restarts and latency histograms match the
    daemon's own status, including after a crash and a reload."""
    proc, port = daemon
    status = await proc.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    pid = status["hosts"]["worker-1"]["pid"]
    os.kill(pid, signal.SIGKILL)
    status = await proc.wait_status(
        lambda s: all_ready(s, 2) and s["hosts"]["worker-1"]["restarts"] == 1, 60, "restarted"
    )
    await control.request(proc.socket, "reload")
    metrics = await asyncio.to_thread(scrape, port)
    status = await proc.status()

    assert metrics['reward_supervisor_hosts{state="ready"}'] == 2
    assert metrics['reward_supervisor_hosts{state="stale"}'] == 0
    for name, row in status["hosts"].items():
        assert metrics[f'reward_supervisor_host_state{{host="{name}",state="{row["state"]}"}}'] == 1
        assert metrics[f'reward_supervisor_ssh_connected{{host="{name}"}}'] == 1
        assert metrics[f'reward_supervisor_host_restarts{{host="{name}"}}'] == row["restarts"]
        age = metrics[f'reward_supervisor_heartbeat_age_seconds{{host="{name}"}}']
        assert 0 <= age < FAST_HEALTH["heartbeat_stale_s"]
    assert metrics['reward_supervisor_restarts_total{host="worker-1",reason="killed"}'] == 1
    assert metrics['reward_supervisor_reloads_total{result="ok"}'] == 1
    # A loaded machine can make worker-0 miss its 3 s heartbeat deadline too: every restart
    # status counts is a launch, and one per host and reason in the counter.
    restarts = sum(row["restarts"] for row in status["hosts"].values())
    counted = sum(
        v for k, v in metrics.items() if k.startswith("reward_supervisor_restarts_total{")
    )
    launched = [line for line in proc.lines if line.get("event") == "host.launched"]
    assert counted == restarts
    assert metrics["reward_supervisor_launch_seconds_count"] == 2 + restarts == len(launched)
    assert metrics["reward_supervisor_fleet_frozen"] == 0
    assert metrics["reward_supervisor_up"] == 1


#: The ``# TYPE`` lines the endpoint serves (prometheus_client's text format 0.0.4), besides
#: the ``_created`` gauge prometheus_client adds beside a counter or histogram that has a
#: sample: alert rules are written against these names.
METRIC_FAMILIES = {
    "reward_supervisor_restarts_total": "counter",
    "reward_supervisor_planned_restarts_total": "counter",
    "reward_supervisor_reloads_total": "counter",
    "reward_supervisor_launch_seconds": "histogram",
    "reward_supervisor_terminate_seconds": "histogram",
    "reward_supervisor_hosts": "gauge",
    "reward_supervisor_host_state": "gauge",
    "reward_supervisor_heartbeat_age_seconds": "gauge",
    "reward_supervisor_ssh_connected": "gauge",
    "reward_supervisor_host_restarts": "gauge",
    "reward_supervisor_host_stuck": "gauge",
    "reward_supervisor_fleet_frozen": "gauge",
    "reward_supervisor_crash_signatures": "gauge",
    "reward_supervisor_restarts_held": "gauge",
    "reward_supervisor_launches_waiting": "gauge",
    "reward_supervisor_status_parse_errors": "gauge",
    "reward_supervisor_up": "gauge",
    "reward_supervisor_role": "gauge",
    "reward_supervisor_probe_round_trip_seconds": "histogram",
    "reward_supervisor_probe_failures_total": "counter",
    "reward_supervisor_host_probe_ok": "gauge",
    "reward_supervisor_host_probe_round_trip_seconds": "gauge",
    "reward_supervisor_probe_signatures": "gauge",
    "reward_supervisor_trainer_task_timeout_seconds": "gauge",
    "reward_supervisor_epoch": "gauge",
    # Always served; reward_supervisor_spares{role} only with [[spares]] (tests/faults).
    "reward_supervisor_failovers_total": "counter",
    "reward_worker_tasks_finished_total": "counter",
    "reward_worker_task_errors_total": "counter",
    "reward_worker_tasks_in_flight": "gauge",
    "reward_worker_queue_depth": "gauge",
    "reward_shard_backlog": "gauge",
    "reward_worker_rss_bytes": "gauge",
    # Rewards that lie ([rewards]): served from the start (the rates sampled once judged).
    "reward_supervisor_host_zero_rate": "gauge",
    "reward_supervisor_host_error_rate": "gauge",
    "reward_supervisor_host_rewards_lying": "gauge",
    "reward_supervisor_fleet_zero_rate": "gauge",
    "reward_supervisor_fleet_error_rate": "gauge",
    "reward_supervisor_rewards_lying_hosts": "gauge",
    "reward_supervisor_rewards_held_machines": "gauge",
    "reward_supervisor_reward_signature": "gauge",
    "reward_worker_tasks_zero_total": "counter",
}


async def test_promtool_finds_nothing_wrong_with_the_live_exposition(
    daemon: tuple[DaemonProcess, int], promtool: str
) -> None:
    """``promtool check metrics`` on what the running daemon serves, after a restart and a
    reload gave every counter and histogram samples: valid, and no lint problem (names,
    units, suffixes, help texts)."""
    proc, port = daemon
    status = await proc.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    os.kill(status["hosts"]["worker-0"]["pid"], signal.SIGKILL)
    await proc.wait_status(
        lambda s: all_ready(s, 2) and s["hosts"]["worker-0"]["restarts"] == 1, 60, "restarted"
    )
    await control.request(proc.socket, "reload")

    def exposition() -> bytes:
        """One scrape's body, as Prometheus would get it."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            body: bytes = reply.read()
        return body

    body = await asyncio.to_thread(exposition)
    assert b"reward_supervisor_restarts_total{" in body
    assert b"reward_supervisor_host_stuck{" in body
    checked = await asyncio.to_thread(
        subprocess.run,
        [promtool, "check", "metrics"],
        input=body,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, b"", b"")


def threads_of(pid: int) -> int:
    """How many threads process ``pid`` has."""
    return len(os.listdir(f"/proc/{pid}/task"))


async def test_metric_names_and_types_are_the_published_ones(
    daemon: tuple[DaemonProcess, int],
) -> None:
    """The families served, with their types, are exactly the published set."""
    proc, port = daemon
    await proc.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")

    def types() -> dict[str, str]:
        """``# TYPE`` lines of one scrape."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return {
            line.split()[2]: line.split()[3]
            for line in text.splitlines()
            if line.startswith("# TYPE ")
        }

    served = await asyncio.to_thread(types)
    created = {name for name in served if name.endswith("_created")}
    assert {name: kind for name, kind in served.items() if name not in created} == METRIC_FAMILIES
    counted = {n.removesuffix("_total") for n, k in METRIC_FAMILIES.items() if k != "gauge"}
    assert {name.removesuffix("_created") for name in created} <= counted


async def test_200_half_open_connections_leave_scrapes_and_the_fleet_alone(
    daemon: tuple[DaemonProcess, int],
) -> None:
    """200 connections that never finish a request hold no thread each; a normal scrape made
    while they hang answers within a second, and every worker keeps its pid and state."""
    proc, port = daemon
    before = await proc.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    assert proc.process is not None
    daemon_pid = proc.process.pid
    threads_before = threads_of(daemon_pid)
    mark = len(proc.lines)
    writers: list[asyncio.StreamWriter] = []
    try:
        for i in range(200):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x" if i % 2 else b"")
            writers.append(writer)
        await asyncio.gather(*(w.drain() for w in writers), return_exceptions=True)

        def quick_scrape() -> dict[str, float]:
            """A scrape with a one-second deadline."""
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                return parse(reply.read().decode())

        metrics = await asyncio.to_thread(quick_scrape)
        assert metrics['reward_supervisor_hosts{state="ready"}'] == 2
        assert threads_of(daemon_pid) < threads_before + 10  # not one per connection
    finally:
        for writer in writers:
            writer.transport.abort()
    after = await proc.status()
    assert all_ready(after, 2)
    assert {h: r["pid"] for h, r in after["hosts"].items()} == {
        h: r["pid"] for h, r in before["hosts"].items()
    }
    assert [line for line in proc.lines[mark:] if line.get("event") == "host.state"] == []


async def test_the_dashboard_reads_only_what_the_live_daemon_serves(
    daemon: tuple[DaemonProcess, int],
) -> None:
    """After a restart and a reload, every metric the shipped Grafana dashboard reads is one
    the running daemon declares, and every label it matches on a metric with samples is one
    those samples carry (or a scrape's job and instance)."""
    proc, port = daemon
    status = await proc.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    os.kill(status["hosts"]["worker-0"]["pid"], signal.SIGKILL)
    await proc.wait_status(
        lambda s: all_ready(s, 2) and s["hosts"]["worker-0"]["restarts"] == 1, 60, "restarted"
    )
    await control.request(proc.socket, "reload")

    def exposition() -> str:
        """One scrape's text."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    text = await asyncio.to_thread(exposition)
    names, samples = promql.declared(text), promql.served(text)
    dashboard = json.loads(cli.dashboard_text())
    for query in promql.dashboard_queries(dashboard):
        reads = promql.used(promql.without_variables(query.expr))
        assert reads.metrics <= names | promql.PROMETHEUS_SERIES, (query.where, reads.metrics)
        for name, labels in reads.selector_labels.items():
            if name in samples:
                assert labels <= samples[name] | promql.SCRAPE_LABELS, (query.where, labels)


async def test_the_real_workers_memory_is_measured_by_its_agent_not_read_as_zero(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """The AReaL worker reports its memory 1024 times too small (ru_maxrss, KiB, over
    1024**3), which was rounded to 0 before conversion: ``rss 0 GiB``, a metric of 0.0.
    Its agent measures the worker's session instead: status and the metric give that
    figure, said to be the agent's, tens of MiB for an interpreter with its imports."""
    areal = A.areal_dir()
    if areal is None:
        pytest.skip(A.areal_missing_reason())
    port = free_port()
    raw = A.shipped_config(openssh, tmp_path / "run", ["w0"], areal=areal, socket=tmp_path / "c")
    raw["metrics"] = {"listen": f"127.0.0.1:{port}"}
    proc = await daemons.start(write_config(tmp_path / "rs.toml", raw))

    def measured(status: dict[str, Any]) -> bool:
        """The ready worker's memory is the agent's measure."""
        work = status["hosts"]["w0"].get("work") or {}
        return all_ready(status, 1) and work.get("rss_source") == "agent"

    status = await proc.wait_status(measured, 90, "the agent's measure of w0's worker")
    work = status["hosts"]["w0"]["work"]
    assert work["rss_bytes"] >= 10 * 2**20, work
    assert work["rss_processes"] >= 1 and work["rss_via"] in ("pss", "rss")
    assert work["rss_gib"] * 2**30 < 2**20  # the worker's own figure: still its bug
    metrics = await asyncio.to_thread(scrape, port)
    assert metrics['reward_worker_rss_bytes{host="w0"}'] >= 10 * 2**20
    detail = await control.request(proc.socket, "status", host="w0")
    text = render.render_host({**detail, "host": "w0"})
    assert "memory: rss " in text and "measured)" in text and "rss 0 GiB" not in text
