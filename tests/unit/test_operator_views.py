"""What operators and alerts see of crash signatures and stuck workers: the gauges, the status
rows, the table and the STATUS= line, from the core's own objects."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from supervisor import health, page, render, view
from supervisor.config import HostConfig
from supervisor.health import Cause, HostState
from supervisor.metrics import Metrics
from supervisor.statusfiles import StatusRecord, parse_status
from tests.pageparse import parse_page

S = HostState


def scrape(status: dict[str, Any]) -> dict[str, float]:
    """Render ``status`` as the endpoint would and parse it: ``{'name{labels}': value}``."""
    body, _ = Metrics(lambda: status).render("text/plain", "")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def row(state: HostState, cause: Cause | None) -> dict[str, Any]:
    """A host's status row from a core host in ``state`` last found unhealthy for ``cause``."""
    host = health.Host(name="w", state=state, reason="r", since_at=0.0, cause_code=cause)
    cfg = HostConfig(name="w", shard=0, address="127.0.0.1")
    return view.host_row(host, cfg, 10.0, health.Policy())


@pytest.mark.parametrize(
    ("state", "cause", "stuck"),
    [
        (S.STALE, Cause.STUCK, 1),  # found stuck, being terminated
        (S.COOLING_DOWN, Cause.STUCK, 1),  # waiting out its backoff or a held restart
        (S.FAILED, Cause.STUCK, 1),  # given up on
        (S.STARTING, Cause.STUCK, 0),  # replaced: the new worker is not stuck
        (S.READY, Cause.STUCK, 0),  # recovered by finishing a task
        (S.STOPPED, Cause.STUCK, 0),
        (S.STALE, Cause.HEARTBEAT_STALE, 0),
        (S.COOLING_DOWN, Cause.EXITED, 0),
        (S.READY, None, 0),
    ],
)
def test_host_stuck_is_one_only_while_a_stuck_worker_is_not_replaced(
    state: HostState, cause: Cause | None, stuck: int
) -> None:
    """``reward_supervisor_host_stuck`` reads the cause code and the state, never the
    reason's words; the row carries the code as ``last_cause``."""
    r = row(state, cause)
    assert r["last_cause"] == (None if cause is None else cause.value)
    metrics = scrape({"hosts": {"w": r}, "daemon": {}})
    assert metrics['reward_supervisor_host_stuck{host="w"}'] == stuck


def test_crash_signature_gauges_count_signatures_and_held_hosts() -> None:
    """Two active signatures holding 3 and 1 hosts: 2 signatures, 4 held; none: both 0."""
    signatures = [
        {"signature": "exit 2: a", "hosts": ["a", "b", "c", "d"], "canary": "a",
         "held": ["b", "c", "d"], "since_s": 1.0},
        {"signature": "signal 11", "hosts": ["e", "f", "g"], "canary": "e", "held": ["f"],
         "since_s": 2.0},
    ]  # fmt: skip
    metrics = scrape({"hosts": {}, "daemon": {"crash_signatures": signatures}})
    assert metrics["reward_supervisor_crash_signatures"] == 2
    assert metrics["reward_supervisor_restarts_held"] == 4
    quiet = scrape({"hosts": {}, "daemon": {"crash_signatures": []}})
    assert quiet["reward_supervisor_crash_signatures"] == 0
    assert quiet["reward_supervisor_restarts_held"] == 0


def test_status_table_names_the_signature_escaped_with_what_releases_it() -> None:
    """``status`` shows each crash signature, its held hosts and canary, and the way out; the
    log line inside it cannot drive the terminal."""
    daemon = {
        "running": True,
        "pid": 1,
        "uptime_s": 5,
        "summary": "0/3 ready",
        "crash_signatures": [
            {"signature": "exit 2: boom\x1b[2J", "hosts": ["a", "b", "c"], "canary": "a",
             "held": ["b", "c"], "since_s": 75.0}
        ],
    }  # fmt: skip
    table = render.render_table({"daemon": daemon, "hosts": {}})
    line = next(x for x in table.splitlines() if x.startswith("CRASH SIGNATURE"))
    assert "3 hosts crashed the same way (exit 2: boom\\x1b[2J)" in line
    assert "restarts held on 2, canary a" in line
    assert "for 1m15s" in line and "unfreeze" in line
    assert "\x1b" not in table


def test_a_held_restart_shows_no_time_but_held() -> None:
    """A host whose restart a crash signature holds keeps its backoff time in the core (for
    after the release) but shows no next restart time: ``restart_held`` and "held" instead."""
    host = health.Host(
        name="w",
        state=S.COOLING_DOWN,
        reason="exited with code 2; restart held: 3 hosts crashed the same way (exit 2)",
        since_at=0.0,
        next_restart_at=5.0,
        held="3 hosts crashed the same way (exit 2)",
    )
    cfg = HostConfig(name="w", shard=0, address="127.0.0.1")
    r = view.host_row(host, cfg, 10.0, health.Policy())
    assert (r["restart_held"], r["next_restart_in_s"]) == (True, None)
    free = view.host_row(replace(host, held=None), cfg, 1.0, health.Policy())
    assert (free["restart_held"], free["next_restart_in_s"]) == (False, 4.0)
    table = render.render_table({"daemon": {"running": True}, "hosts": {"w": r}})
    assert table.splitlines()[-1].split()[7] == "held"


def test_status_line_leads_with_the_crash_signature_escaped() -> None:
    """``STATUS=`` (and ``summary``) name each crash signature, the hosts it holds and its
    canary before the states; a log line carrying an escape sequence is shown escaped, as
    systemctl would print it raw."""
    from tests.unit.test_fleet_core import bad_deploy, crash

    s = bad_deploy(5)
    assert view.status_line(s.core.view(s.now)) == "5/5 ready"
    for i in range(3):
        crash(s, f"w{i}", 100 + i, tail="boom \x1b[2J\n")
    [signature] = s.core.signature_state.active.values()
    held = sum(1 for sig in s.core.signature_state.held.values() if sig == signature.signature)
    line = view.status_line(s.core.view(s.now))
    assert line.startswith(
        f"CRASH SIGNATURE (exit 2: boom \\x1b[NJ): restarts held on {held} hosts,"
        f" canary {signature.canary}; "
    )
    assert "\x1b" not in line
    assert line.endswith(render.summary(h.state.value for h in s.core.hosts.values()))


def test_a_scrape_without_a_snapshot_has_no_up_gauge_for_the_absent_alert() -> None:
    """When the daemon's loop does not hand over a status (timeout), the scrape still answers
    with the counters but without ``reward_supervisor_up``: RewardSupervisorAbsent's second
    condition (a target that answers, without ``reward_supervisor_up``) depends on it."""
    import concurrent.futures

    def blocked() -> dict[str, Any]:
        """A snapshot the event loop never delivered."""
        raise concurrent.futures.TimeoutError

    metrics = Metrics(blocked)
    metrics.reloads.labels(result="ok").inc()
    body = metrics.render("text/plain", "")[0].decode()
    assert 'reward_supervisor_reloads_total{result="ok"} 1.0' in body
    assert "reward_supervisor_up" not in body
    assert "reward_supervisor_up 1.0" in Metrics(lambda: {}).render("text/plain", "")[0].decode()


@pytest.mark.parametrize("huge", [10**400, 2**63, 2**63 - 1])
def test_a_worker_reporting_a_huge_count_never_breaks_the_status_or_the_metrics(
    huge: int,
) -> None:
    """Whoever writes a host's status file can write any count JSON holds: the heartbeat
    stands, and the fleet's status rows and metrics still build (a rate over a count past a
    float's range raised OverflowError in every ``status`` and scrape)."""
    policy = health.Policy(heartbeat_stale_s=10, ready_timeout_s=20)
    host = health.new_host("w", 0.0)
    for event in (
        health.StatusMissing(reason="missing"),
        health.SshRestored(),
        health.ProbeResult(pid=None),
        health.Launched(pid=7),
    ):
        host, _ = health.step(host, event, 0.0, policy)
    for at, processed in ((1.0, 0), (62.0, huge)):
        record = parse_status(
            json.dumps(
                {"pid": 7, "ready": True, "heartbeat_at": at, "processed": processed}
            ).encode()
        )
        assert isinstance(record, StatusRecord) and record.pid == 7
        beat = health.HeartbeatSeen(
            pid=record.pid,
            ready=record.ready,
            remote_heartbeat_at=record.heartbeat_at,
            processed=record.processed,
            in_flight=record.in_flight,
        )
        host, _ = health.step(host, beat, at, policy)
    assert host.state is S.READY
    cfg = HostConfig(name="w", shard=0, address="127.0.0.1")
    r = view.host_row(host, cfg, 63.0, policy)
    view.host_detail(host, cfg, 63.0, policy, wall_now=1e9)
    metrics = scrape({"hosts": {"w": r}, "daemon": {}})
    assert metrics['reward_supervisor_host_state{host="w",state="ready"}'] == 1


def _areal_host() -> health.Host:
    """A ready host whose worker's last heartbeat is one the AReaL worker wrote."""
    record = parse_status(
        json.dumps(
            {
                "pid": 41,
                "heartbeat_at": 5.0,
                "ready": True,
                "completed": 120,
                "errors": 3,
                "inflight": 4,
                "queue_depth": 9,
                "qps": 2.5,
                "concurrency": 48,
                "rss_gib": 0.5,
                "verify_ms_p95": 812.0,
                "semantic_zero": 40,
            }
        ).encode()
    )
    assert isinstance(record, StatusRecord)
    return health.Host(
        name="w", state=S.READY, reason="r", since_at=0.0, pid=41,
        processed=record.processed, in_flight=record.in_flight, stats=record.stats,
    )  # fmt: skip


def test_the_worker_s_own_figures_reach_the_row_the_table_and_status_host() -> None:
    """completed, errors, queue depth, qps, concurrency, RSS, verify p95 and semantic zeros
    are shown as the worker reported them; finished = completed + errors."""
    cfg = HostConfig(name="w", shard=3, address="127.0.0.1")
    host = _areal_host()
    r = view.host_row(host, cfg, 10.0, health.Policy())
    assert (r["processed"], r["in_flight"]) == (123, 4)
    assert r["work"] == {
        "completed": 120, "errors": 3, "semantic_zero": 40, "queue_depth": 9, "qps": 2.5,
        "concurrency": 48, "rss_gib": 0.5, "verify_ms_p95": 812.0,
        "rss_bytes": 2**29, "rss_source": "worker",
    }  # fmt: skip
    table = render.render_table({"daemon": {"running": True}, "hosts": {"w": r}})
    assert "123 (3 err) q9" in table
    text = render.render_host({"daemon": {}, "host": "w", **view.host_detail(host, cfg, 10.0,
                            health.Policy())})  # fmt: skip
    assert "120 ok, 3 errors, 4 in flight of 48, queue 9, 40 scored 0" in text
    assert "verify p95 812 ms" in text
    assert "memory: rss 512 MiB (the worker's own figure)" in text


def test_work_metrics_are_counters_of_finished_tasks_and_errors_and_gauges_of_levels() -> None:
    """Per host: finished and errors as counters (rate() over them is the reward flow), in
    flight, queue depth and RSS in bytes as gauges, and the backlog per shard."""
    cfg = HostConfig(name="w", shard=3, address="127.0.0.1")
    r = view.host_row(_areal_host(), cfg, 10.0, health.Policy())
    silent = view.host_row(
        health.Host(name="x", state=S.READY, reason="r", since_at=0.0), cfg, 10.0, health.Policy()
    )
    metrics = scrape({"hosts": {"w": r, "x": silent}, "daemon": {}})
    assert metrics['reward_worker_tasks_finished_total{host="w"}'] == 123
    assert metrics['reward_worker_task_errors_total{host="w"}'] == 3
    assert metrics['reward_worker_tasks_in_flight{host="w"}'] == 4
    assert metrics['reward_worker_queue_depth{host="w",shard="3"}'] == 9
    assert metrics['reward_shard_backlog{shard="3"}'] == 9
    assert metrics['reward_worker_rss_bytes{host="w"}'] == 0.5 * 2**30
    # A worker that reports none of it has no samples, not zeros.
    assert not [k for k in metrics if k.startswith("reward_worker_") and 'host="x"' in k]


def test_the_table_says_which_machine_serves_a_moved_host_and_what_the_spares_do() -> None:
    """After a failover the host's row names the spare serving it, and a line lists each
    spare's role (escaped); a fleet without spares shows neither."""
    host = health.Host(
        name="w-0", state=S.READY, reason="heartbeat ready", since_at=0.0, ssh_up=True
    )
    cfg = HostConfig(name="w-0", shard=0, address="127.0.0.1")
    row = {**view.host_row(host, cfg, 1.0, health.Policy()), "machine": "spare-0"}
    spares = [
        {"name": "spare-0", "role": "serving", "connected": True, "serves": "w-0"},
        {"name": "w-0", "role": "fenced", "connected": False, "serves": None},
        {"name": "s\x1b[2J", "role": "free", "connected": True, "serves": None},
    ]
    daemon = {"running": True, "spares": spares, "free_spares": 1}
    table = render.render_table({"daemon": daemon, "hosts": {"w-0": row}})
    assert table.splitlines()[-2].startswith("w-0 on spare-0 ")
    assert table.splitlines()[-1] == (
        "spares (1 free): spare-0 serving w-0, w-0 fenced, s\\x1b[2J free"
    )
    plain = {**row, "machine": "w-0"}
    table = render.render_table({"daemon": {"running": True}, "hosts": {"w-0": plain}})
    assert table.splitlines()[-1].startswith("w-0 ")
    assert "spares" not in table


def test_the_terminal_knows_the_states_in_the_cores_order() -> None:
    """``render.STATE_ORDER`` (kept apart so that rendering imports no core) is the host
    core's states in its order, so a summary lists a new state where the core puts it."""
    assert tuple(s.value for s in HostState) == render.STATE_ORDER


def _with_rss(host: health.Host, rss_gib: float) -> health.Host:
    """``host`` whose worker reports ``rss_gib``."""
    assert host.stats is not None
    return replace(host, stats=replace(host.stats, rss_gib=rss_gib))


def test_the_real_workers_tiny_figure_is_converted_whole_not_rounded_to_zero() -> None:
    """The AReaL worker reports ru_maxrss (KiB) / 1024**3: 60 MiB reads 5.7e-05 "GiB".
    Rounded to three places before conversion it was 0 bytes everywhere; converted whole it
    is the 61440 bytes the worker said (and the page says whose figure that is)."""
    cfg = HostConfig(name="w", shard=3, address="127.0.0.1")
    said = 60 * 1024 / 2**30
    r = view.host_row(_with_rss(_areal_host(), said), cfg, 10.0, health.Policy())
    assert (r["work"]["rss_bytes"], r["work"]["rss_source"]) == (61440, "worker")
    assert r["work"]["rss_gib"] == said
    metrics = scrape({"hosts": {"w": r}, "daemon": {}})
    assert metrics['reward_worker_rss_bytes{host="w"}'] == 61440
    assert render.memory_text(r["work"]) == "rss 60 KiB (the worker's own figure)"


def test_the_agents_measure_of_the_current_worker_wins_and_says_so() -> None:
    """A recent measure of the current worker's session by its agent is the figure shown and
    exported, with its processes and how it was counted; one of an earlier pid, or one too
    old, is not, and the worker's own figure stands."""
    cfg = HostConfig(name="w", shard=3, address="127.0.0.1")
    host = _with_rss(_areal_host(), 60 * 1024 / 2**30)
    usage = health.UsageMeasured(pid=41, rss_bytes=3 * 2**30, processes=49, via="pss")
    measured = replace(host, usage=usage, usage_at=8.0)
    r = view.host_row(measured, cfg, 10.0, health.Policy())
    assert {k: v for k, v in r["work"].items() if k.startswith("rss")} == {
        "rss_gib": 60 * 1024 / 2**30,
        "rss_bytes": 3 * 2**30,
        "rss_source": "agent",
        "rss_processes": 49,
        "rss_via": "pss",
        "rss_age_s": 2.0,
    }
    assert scrape({"hosts": {"w": r}, "daemon": {}})['reward_worker_rss_bytes{host="w"}'] == (
        3 * 2**30
    )
    detail = view.host_detail(measured, cfg, 10.0, health.Policy())
    text = page.host_page({"host": "w", **detail}, None)
    assert "rss 3 GiB (its session, 49 processes, measured)" in parse_page(text).text
    earlier = replace(measured, usage=replace(usage, pid=40))
    old = replace(measured, usage_at=10.0 - view.MEASURE_FRESH_S - 1)
    for other in (earlier, old):
        row = view.host_row(other, cfg, 10.0, health.Policy())
        assert (row["work"]["rss_bytes"], row["work"]["rss_source"]) == (61440, "worker")


def test_a_worker_that_reports_nothing_still_has_its_measured_memory() -> None:
    """No figures of its own (the status has none): the row's work is the agent's measure
    alone; with neither, there is no work row at all."""
    cfg = HostConfig(name="x", shard=0, address="127.0.0.1")
    host = health.Host(name="x", state=S.READY, reason="r", since_at=0.0, pid=7)
    usage = health.UsageMeasured(pid=7, rss_bytes=5 * 2**20, processes=1, via="rss")
    row = view.host_row(replace(host, usage=usage, usage_at=9.0), cfg, 10.0, health.Policy())
    assert row["work"]["rss_bytes"] == 5 * 2**20 and row["work"]["completed"] is None
    assert render.memory_text(row["work"]) == "rss 5 MiB (its session, 1 process, measured)"
    assert view.host_row(host, cfg, 10.0, health.Policy())["work"] is None
    assert [render.bytes_text(n) for n in (512, 2048, 150 * 2**20, 2**40)] == [
        "512 B",
        "2 KiB",
        "150 MiB",
        "1024 GiB",
    ]
