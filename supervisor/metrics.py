"""Prometheus metrics: the only importer of prometheus_client.

Counters and histograms are updated by the daemon as things happen; per-host gauges are
computed at scrape time from a snapshot taken on the event loop's thread, because the HTTP
server answers from its own thread and must not read the daemon's state under its feet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from supervisor.health import HostState

log = structlog.get_logger("supervisor.metrics")

# A scrape waits this long for the event loop to hand over a snapshot; a loop blocked for
# longer is itself worth a failed scrape.
SNAPSHOT_TIMEOUT_S: Final = 5.0
# Launches are dominated by the agent round trip and a fork; terminates by the grace period.
LAUNCH_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TERMINATE_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

Snapshot = Mapping[str, Any]


def restart_reason(cause: str) -> str:
    """A low-cardinality label for why a worker was restarted."""
    text = cause.lower()
    for needle, label in (
        ("signal", "killed"),
        ("exited", "exited"),
        ("heartbeat stale", "heartbeat_stale"),
        ("not ready", "not_ready"),
        ("launch", "launch_failed"),
        ("probe", "probe"),
        ("confirmed dead", "gone"),
    ):
        if needle in text:
            return label
    return "other"


class Metrics:
    """The daemon's metrics and, once started, the HTTP endpoint serving them."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.restarts = Counter(
            "reward_supervisor_restarts",
            "Automatic restarts, by host and reason.",
            ["host", "reason"],
            registry=self.registry,
        )
        self.reloads = Counter(
            "reward_supervisor_reloads",
            "Config reloads, by result.",
            ["result"],
            registry=self.registry,
        )
        self.launch_seconds = Histogram(
            "reward_supervisor_launch_seconds",
            "Time from issuing a launch to the worker's pid.",
            buckets=LAUNCH_BUCKETS,
            registry=self.registry,
        )
        self.terminate_seconds = Histogram(
            "reward_supervisor_terminate_seconds",
            "Time from issuing a terminate to the pid confirmed dead.",
            buckets=TERMINATE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(snapshot))
        self._server: Any = None
        self._thread: Any = None

    def start(self, host: str, port: int) -> None:
        """Serve ``/metrics`` on ``host:port`` from a background thread."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics.listening", address=f"{host}:{port}")

    def stop(self) -> None:
        """Stop the endpoint (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None


def snapshot_on_loop(
    loop: asyncio.AbstractEventLoop, build: Callable[[], Snapshot]
) -> Callable[[], Snapshot]:
    """A thread-safe snapshot function: ``build`` runs on ``loop``'s thread."""

    def take() -> Snapshot:
        future: concurrent.futures.Future[Snapshot] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(build())
            except Exception as exc:  # noqa: BLE001 - re-raised in the scraping thread
                future.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return future.result(timeout=SNAPSHOT_TIMEOUT_S)

    return take


class _SnapshotCollector(Collector):
    """Gauges from the daemon's current status (the same data as ``status --json``)."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        try:
            status = self._snapshot()
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            log.warning("metrics.snapshot_failed", reason=repr(exc))
            return
        hosts: Mapping[str, Mapping[str, Any]] = status.get("hosts", {})
        daemon: Mapping[str, Any] = status.get("daemon", {})
        by_state = GaugeMetricFamily(
            "reward_supervisor_hosts", "Hosts in each state.", labels=["state"]
        )
        counts = {s.value: 0 for s in HostState}
        for row in hosts.values():
            state = str(row.get("state"))
            counts[state] = counts.get(state, 0) + 1
        for state, n in sorted(counts.items()):
            by_state.add_metric([state], n)
        yield by_state
        yield from _per_host(hosts)
        yield _gauge(
            "reward_supervisor_fleet_frozen",
            "1 while restarts are frozen.",
            1 if daemon.get("frozen") else 0,
        )
        yield _gauge(
            "reward_supervisor_launches_waiting",
            "Launches waiting for the budget.",
            daemon.get("launches_waiting", 0),
        )
        yield _gauge(
            "reward_supervisor_status_parse_errors",
            "Status files read that were not a valid heartbeat (total).",
            daemon.get("status_parse_errors", 0),
        )
        yield _gauge("reward_supervisor_up", "1 while the daemon serves.", 1)


def _per_host(hosts: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "reward_supervisor_host_state", "1 for the host's current state.", labels=["host", "state"]
    )
    age = GaugeMetricFamily(
        "reward_supervisor_heartbeat_age_seconds",
        "Seconds since the host's heartbeat last changed (our clock).",
        labels=["host"],
    )
    ssh = GaugeMetricFamily(
        "reward_supervisor_ssh_connected", "1 while the SSH connection is up.", labels=["host"]
    )
    restarts = GaugeMetricFamily(
        "reward_supervisor_host_restarts",
        "Automatic restarts of the host, kept across daemon restarts.",
        labels=["host"],
    )
    for name, row in sorted(hosts.items()):
        state.add_metric([name, str(row.get("state"))], 1)
        if row.get("heartbeat_age_s") is not None:
            age.add_metric([name], float(row["heartbeat_age_s"]))
        ssh.add_metric([name], 1 if row.get("ssh") == "connected" else 0)
        restarts.add_metric([name], float(row.get("restarts") or 0))
    yield from (state, age, ssh, restarts)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation)
    gauge.add_metric([], float(value))
    return gauge
