"""The shipped Grafana dashboard: printed by ``reward-supervisor dashboard``, every query valid
PromQL (promtool), and every series and label it reads one a live metrics endpoint serves."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from supervisor import cli, health, view
from supervisor.config import HostConfig
from supervisor.metrics import Metrics
from tests.promql import (
    PROMETHEUS_SERIES,
    SCRAPE_LABELS,
    dashboard_queries,
    promql,
    served,
    used,
    without_variables,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "supervisor" / "dashboard.json"
#: The values a dashboard may match each label against (the endpoint's own vocabulary).
VALUES: dict[str, set[str]] = {
    "state": {s.value for s in health.HostState},
    "reason": {c.value for c in health.Cause},
    "role": {"leader", "standby"},
    "result": {"ok", "error"},
}


def load() -> dict[str, Any]:
    """The dashboard as shipped."""
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return dashboard


def full_status() -> dict[str, Any]:
    """A leader's status with every kind of row: a host reporting all its work, a stuck one,
    a crash signature."""
    stats = health.WorkerStats(completed=10, errors=1, queue_depth=4, concurrency=2, rss_gib=1.0)
    ready = health.Host(
        name="w-0",
        state=health.HostState.READY,
        reason="r",
        since_at=0.0,
        pid=5,
        ssh_up=True,
        alive_at=0.5,
        processed=11,
        in_flight=1,
        stats=stats,
    )
    stuck = health.Host(
        name="w-1",
        state=health.HostState.STALE,
        reason="stuck",
        since_at=0.0,
        cause_code=health.Cause.STUCK,
    )
    rows = {
        h.name: view.host_row(
            h, HostConfig(name=h.name, shard=i, address="a"), 1.0, health.Policy()
        )
        for i, h in enumerate((ready, stuck))
    }
    rows["w-0"]["rewards"] = {"verdict": "lying", "zero_rate": 1.0, "error_rate": 0.0}
    signature = {"signature": "exit 2", "hosts": ["w-1"], "canary": "w-1", "held": []}
    rewards = {"fleet_zero_rate": 0.3, "fleet_error_rate": 0.0, "lying": ["w-0"], "held": []}
    daemon = {
        "role": "leader",
        "epoch": 3,
        "crash_signatures": [signature],
        "rewards": {**rewards, "signature": None},
    }
    return {"hosts": rows, "daemon": daemon}


def scrape_live() -> dict[str, set[str]]:
    """Every sample name and its labels, as a live endpoint serves them over HTTP after a
    restart, a reload, a launch and a terminate."""
    status = full_status()
    metrics = Metrics(lambda: status)
    metrics.restarts.labels(host="w-1", reason="stuck").inc()
    metrics.reloads.labels(result="ok").inc()
    metrics.launch_seconds.observe(0.1)
    metrics.terminate_seconds.observe(0.1)
    metrics.start("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return served(reply.read().decode())
    finally:
        metrics.stop()


def test_the_dashboard_command_prints_the_packaged_file() -> None:
    """``reward-supervisor dashboard`` prints the dashboard the package carries, which is a
    Grafana dashboard reading its Prometheus from a variable, with unique panel ids."""
    assert cli.dashboard_text() == DASHBOARD.read_text(encoding="utf-8")
    dashboard = load()
    assert dashboard["uid"] == "reward-supervisor"
    [source] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]


def test_every_series_and_label_the_dashboard_reads_is_one_the_endpoint_serves() -> None:
    """Each metric a query reads is served by a live endpoint (or is Prometheus' ``up``); each
    label a selector matches on is one that metric has (or a scrape's job and instance); the
    labels it groups by and its legends name are on the metrics it reads; the values it
    matches states, reasons, roles and results against are real ones."""
    live = scrape_live()
    queries = dashboard_queries(load())
    assert len(queries) >= 25
    metrics_read: set[str] = set()
    for query in queries:
        reads = used(without_variables(query.expr))
        assert reads.metrics, query
        metrics_read |= reads.metrics
        unknown = reads.metrics - live.keys() - PROMETHEUS_SERIES
        assert unknown == set(), (query.where, unknown)
        available = set(SCRAPE_LABELS)
        for name in reads.metrics:
            available |= live.get(name, set())
        for name, labels in reads.selector_labels.items():
            assert labels <= live.get(name, set()) | SCRAPE_LABELS, (query.where, name, labels)
        assert reads.other_labels <= available, (query.where, reads.other_labels - available)
        assert query.legend_labels <= available, (query.where, query.legend_labels - available)
        for label, values in reads.values.items():
            if label in VALUES:
                assert values <= VALUES[label], (query.where, label, values)
    # The reward flow and the host states are what the dashboard is for.
    assert {
        "reward_worker_tasks_finished_total",
        "reward_worker_task_errors_total",
        "reward_shard_backlog",
        "reward_worker_queue_depth",
        "reward_supervisor_hosts",
        "reward_supervisor_host_state",
        "reward_supervisor_restarts_total",
    } <= metrics_read


def test_every_query_is_valid_promql(promtool: str, tmp_path: Path) -> None:
    """promtool accepts each query (variables replaced as Grafana would, a variable's
    ``label_values(SELECTOR, LABEL)`` as the SELECTOR it reads) as a recording rule."""
    queries = dashboard_queries(load())
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, query in enumerate(queries):
        expr = json.dumps(promql(without_variables(query.expr)))
        lines += [f"      - record: dashboard:query_{i}", f"        expr: {expr}"]
    rules = tmp_path / "dashboard-rules.yml"
    rules.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = subprocess.run(
        [promtool, "check", "rules", str(rules)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_the_checks_see_what_a_query_reads() -> None:
    """The query reader finds metric names, selector and grouping labels and matched values
    (so a dashboard reading an unserved name or label would fail the check above)."""
    reads = used(
        without_variables(
            'sum by (state) (rate(reward_x_total{host=~"$host", state!="ready"}[$__rate_interval]))'
            " * on (instance) group_left max by (instance) (reward_y) or vector(0)"
        )
    )
    assert reads.metrics == {"reward_x_total", "reward_y"}
    assert reads.selector_labels == {"reward_x_total": {"host", "state"}}
    assert reads.other_labels == {"state", "instance"}
    assert reads.values == {"host": {".*"}, "state": {"ready"}}
    assert used('label_values(reward_z{job=~"x"}, host)').other_labels == {"host"}
