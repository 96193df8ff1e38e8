"""The shipped Prometheus alert rules: valid, unit-tested with ``promtool test rules``, installed
with the package, and written against series named exactly as the metrics endpoint serves them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from supervisor import cli, health, view
from supervisor.config import HostConfig
from supervisor.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "supervisor" / "alerts.yml"
RULES_TEST = ROOT / "tests" / "alerts" / "rules_test.yml"
#: Labels a Prometheus scrape adds to every series (not the endpoint's own).
SCRAPE_LABELS = frozenset({"job", "instance"})
#: Series the rules read that Prometheus itself makes (not the endpoint).
PROMETHEUS_SERIES = frozenset({"up"})


def promtool_run(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``promtool ARGS`` from the checkout's root; its output is kept for the assertion."""
    return subprocess.run(
        [promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_shipped_rules_are_valid(promtool: str) -> None:
    """``promtool check rules`` accepts the file the package ships."""
    result = promtool_run(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


def test_the_rules_pass_their_promtool_unit_tests(promtool: str) -> None:
    """``promtool test rules``: each alert fires on the series that should fire it, at the time
    its ``for`` allows, with its labels and annotations, and stays quiet on the near misses."""
    result = promtool_run(promtool, "test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alert_rules_command_prints_the_packaged_file() -> None:
    """``reward-supervisor alert-rules`` prints the rules the package carries (this file)."""
    assert cli.alert_rules_text() == RULES.read_text(encoding="utf-8")


def exported() -> dict[str, set[str]]:
    """Every sample name the endpoint serves, with its label names, from a status that has
    every kind of row (a host, a crash signature)."""
    host = health.Host(name="w", state=health.HostState.READY, reason="r", since_at=0.0)
    row = view.host_row(host, HostConfig(name="w", shard=0, address="a"), 1.0, health.Policy())
    row["heartbeat_age_s"] = 0.5
    row["last_probe"] = {"what": "scored 1", "cause": None, "round_trip_s": 0.1, "age_s": 1.0}
    row["rewards"] = {"verdict": "lying", "zero_rate": 1.0, "error_rate": 0.0, "results": 300}
    signature = {"signature": "exit 2", "hosts": ["w"], "canary": "w", "held": []}
    spare = {"name": "s", "role": "free", "connected": True, "serves": None}
    daemon = {
        "crash_signatures": [signature],
        "trainer_task_timeout_s": 30.0,
        "spares": [spare],
        "failover_counts": {"host_lost": 1},
        "rewards": {
            "fleet_zero_rate": 0.3,
            "fleet_error_rate": 0.0,
            "lying": ["w"],
            "held": [],
            "signature": None,
        },
    }
    metrics = Metrics(lambda: {"hosts": {"w": row}, "daemon": daemon})
    metrics.restarts.labels(host="w", reason="stuck").inc()
    metrics.reloads.labels(result="ok").inc()
    metrics.launch_seconds.observe(0.1)
    metrics.terminate_seconds.observe(0.1)
    body, _ = metrics.render("text/plain", "")
    names: dict[str, set[str]] = {}
    for line in body.decode().splitlines():
        if line.startswith("#") or not line:
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        assert match, line
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', match[2] or ""))
        names.setdefault(match[1], set()).update(labels)
    return names


def test_every_series_the_rules_and_their_tests_name_is_one_the_endpoint_serves() -> None:
    """Metric names in the rules and in their tests' input series exist on the endpoint; each
    test series carries exactly the endpoint's labels (plus job and instance); label values
    the rules match on are real states and causes."""
    served = exported()
    rules = RULES.read_text(encoding="utf-8")
    tests = RULES_TEST.read_text(encoding="utf-8")
    used = set(re.findall(r"\breward_supervisor_[a-z_]+\b", rules + tests))
    assert used, "the rules name no metric"
    assert used <= served.keys(), used - served.keys()
    series = re.findall(r"series: '([a-z_]+)\{([^}]*)\}'", tests)
    assert len(series) >= 20, series
    for name, labels in series:
        if name in PROMETHEUS_SERIES:
            continue
        given = set(re.findall(r"([a-z_]+)=", labels)) - SCRAPE_LABELS
        assert given == served[name], (name, given, served[name])
    states = {s.value for s in health.HostState}
    causes = {c.value for c in health.Cause}
    for value in re.findall(r'state="([a-z_]+)"', rules + tests):
        assert value in states, value
    for value in re.findall(r'reason="([a-z_]+)"', rules + tests):
        assert value in causes, value
