"""``status HOST`` from its parts: the detail of a host as the core knows it, its text for a
terminal, the log's last lines read from a hostile run root, and the files-only fallback."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor import config as config_mod
from supervisor import health as h
from supervisor import page, render, view

POLICY = h.Policy(progress_stale_s=300.0, restart_window_s=3600.0)


def a_config(tmp_path: Path) -> config_mod.Config:
    """One host, worker-0, at ``tmp_path/run`` (its ctl/ and status/ made)."""
    raw = {
        "run": {"root": str(tmp_path / "run")},
        "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
        "hosts": [{"name": "worker-0", "shard": 0}],
    }
    cfg = config_mod.parse(raw, tmp_path / "rs.toml")
    for sub in ("ctl", "status"):
        (cfg.run.root / sub).mkdir(parents=True, exist_ok=True)
    return cfg


def ready_host(processed: int | None, in_flight: int | None) -> h.Host:
    """worker-0 ready with pid 7 at t=10, its progress as given, seen at t=10."""
    return h.Host(
        name="worker-0",
        state=h.HostState.READY,
        reason="heartbeat ready",
        since_at=10.0,
        pid=7,
        last_pid=7,
        needs_probe=False,
        ssh_up=True,
        alive_at=10.0,
        processed=processed,
        in_flight=in_flight,
        progress_at=None if processed is None and in_flight is None else 10.0,
    )


def test_a_worker_reporting_no_progress_is_said_to_be_judged_by_its_heartbeat(
    tmp_path: Path,
) -> None:
    """Neither processed nor in_flight: the row and the detail say "heartbeat only"."""
    cfg = a_config(tmp_path)
    host = ready_host(None, None)
    row = view.host_row(host, cfg.hosts[0], 12.0, POLICY)
    assert row["progress"] == "heartbeat only"
    detail = view.host_detail(host, cfg.hosts[0], 12.0, POLICY)
    assert detail["progress"] == {"reported": False, "judged_by": "heartbeat only"}
    assert "progress: not reported: judged by heartbeat only" in render.render_host(
        {"host": "worker-0", "daemon": {"running": True}, **detail}
    )


def test_reported_progress_shows_its_rate_and_when_it_would_be_stuck(tmp_path: Path) -> None:
    """Processed, in flight, tasks per minute over a minute of marks, time since the last
    change and, its heartbeats coming without a finished task, the time left before the
    worker would be judged stuck."""
    cfg = a_config(tmp_path)
    host = replace(ready_host(500, 4), rate_base=(10.0, 380), rate_mark=(70.0, 500), alive_at=39.0)
    detail = view.host_detail(host, cfg.hosts[0], 40.0, POLICY)
    assert detail["progress"] == {
        "reported": True,
        "judged_by": "heartbeat and progress",
        "processed": 500,
        "in_flight": 4,
        "tasks_per_min": 120.0,
        "last_progress_age_s": 30.0,
        "stuck_in_s": 270.0,
        "progress_stale_s": 300.0,
    }
    text = render.render_host({"host": "worker-0", "daemon": {}, **detail})
    assert "progress: 500 processed, 4 in flight, 120 tasks/min" in text
    assert "(stuck in 4m30s without one)" in text


def test_a_busy_worker_finishing_tasks_shows_no_stuck_countdown(tmp_path: Path) -> None:
    """Its last heartbeat came with a finished task: nothing is counting towards "stuck", so
    nothing says it will be (the countdown read "stuck in 9.7s" for a healthy worker)."""
    cfg = a_config(tmp_path)
    host = replace(ready_host(500, 4), alive_at=30.0, progress_at=30.0)
    detail = view.host_detail(host, cfg.hosts[0], 30.3, POLICY)
    assert detail["progress"]["stuck_in_s"] is None
    assert "stuck in" not in render.render_host({"host": "worker-0", "daemon": {}, **detail})
    assert "stuck in" not in page.host_page({"host": "worker-0", **detail}, None)


def test_the_last_exit_and_evidence_are_shown_in_full_and_escaped(tmp_path: Path) -> None:
    """The exit (pid, code, when) and the evidence (stacks line by line, notes) appear; a
    control character a host put in the stacks is shown escaped, never sent raw."""
    cfg = a_config(tmp_path)
    evidence = h.Evidence(
        pid=6,
        stacks='Thread 0x1 (most recent call first):\n  File "w.py", line 3 in hung\x1b[2J\n',
        stacks_via="faulthandler",
        log_tail="worker.ready\n",
        notes=("py-spy: not found beside the worker's python or on PATH",),
        elapsed_s=0.3,
    )
    host = replace(
        ready_host(0, 0),
        last_exit="exited with code 3",
        last_exit_at=5.0,
        last_exit_pid=6,
        last_exit_code=3,
        evidence=evidence,
        evidence_at=4.0,
        evidence_cause="stuck: no task finished in 300 s with 1 in flight",
        restarts=2,
        restart_times_at=(4.5,),
        failures=1,
    )
    detail = view.host_detail(host, cfg.hosts[0], 20.0, POLICY, wall_now=1000.0)
    assert detail["last_exit"] == {
        "at": 985.0,
        "pid": 6,
        "what": "exited with code 3",
        "exit_code": 3,
        "signal": None,
        "reaped": None,
        "age_s": 15.0,
        "log_tail": None,
    }
    assert (detail["evidence"]["age_s"], detail["evidence"]["at"]) == (16.0, 984.0)
    assert detail["restart"]["next_restart_at"] is None
    assert detail["restart"]["in_window"] == 1 and detail["restart"]["total"] == 2
    detail["log"] = {"path": "/r/ctl/worker-0.log", "lines": ["one", "two\x07"], "error": None}
    text = render.render_host({"host": "worker-0", "daemon": {"running": True}, **detail})
    assert "last exit: pid 6 exited with code 3, 15.0s ago\n" in text  # nothing said reaped
    assert "      Thread 0x1 (most recent call first):" in text
    assert "in hung\\x1b[2J" in text and "\x1b" not in text and "\x07" not in text
    assert "note: py-spy: not found" in text
    assert "log /r/ctl/worker-0.log (last 2 lines):" in text


def test_log_lines_are_the_last_ones_whole_and_never_read_through_a_symlink(
    tmp_path: Path,
) -> None:
    """The last N lines; a first line the bounded read cut is dropped; bad UTF-8 is
    replaced; a symlink planted as the log is refused with a reason; no log is said so."""
    cfg = a_config(tmp_path)
    log = cfg.run.root / "ctl" / "worker-0.log"
    assert view.log_lines(cfg, "worker-0", 5)["error"] == "no log yet"
    big = b"x" * view.LOG_TAIL_READ_BYTES + b"\n" + b"".join(b"line %d\n" % i for i in range(10))
    log.write_bytes(big + b"bad \xff byte\n")
    out = view.log_lines(cfg, "worker-0", 3)
    assert out["lines"] == ["line 8", "line 9", "bad \ufffd byte"] and out["error"] is None
    assert view.log_lines(cfg, "worker-0", 0)["lines"] == []
    whole = view.log_lines(cfg, "worker-0", 1000)["lines"]
    assert whole[0] == "line 0" and not whole[0].startswith("x")
    log.unlink()
    secret = tmp_path / "secret"
    secret.write_text("not for the operator\n")
    log.symlink_to(secret)
    refused = view.log_lines(cfg, "worker-0", 5)
    assert refused["lines"] == [] and "symbolic link" in str(refused["error"])


def test_without_a_daemon_status_host_reads_progress_and_the_exit_record(
    tmp_path: Path,
) -> None:
    """No daemon: the status file's progress, the exit record's code and age, the verdict."""
    cfg = a_config(tmp_path)
    root = cfg.run.root
    now = 1_000_000.0
    status = {"ready": True, "pid": 9, "heartbeat_at": now - 1, "processed": 12, "in_flight": 2}
    (root / "status" / "worker-0.json").write_text(json.dumps(status))
    os.utime(root / "status" / "worker-0.json", (now - 1, now - 1))
    record = {"pid": 8, "exit_code": None, "signal": 9, "exited_at": now - 30, "reaped": 1}
    (root / "ctl" / "worker-0.exit.json").write_text(json.dumps(record))
    detail = view.offline_host_detail(cfg, "worker-0", now_wall=now)
    assert detail["daemon"]["running"] is False and detail["verdict"] == "ok"
    assert detail["progress"]["processed"] == 12 and detail["progress"]["in_flight"] == 2
    assert detail["last_exit"]["what"] == "killed by signal 9 (SIGKILL)"
    assert detail["last_exit"]["age_s"] == 30.0 and detail["evidence"] is None
    text = render.render_host(detail)
    assert "verdict ok" in text and "last exit: pid 8 killed by signal 9 (SIGKILL)" in text
    assert "30.0s ago; 1 process of its session reaped" in text
    with pytest.raises(KeyError):
        view.offline_host_detail(cfg, "worker-9")


@pytest.mark.parametrize(
    ("reaped", "said"),
    [
        (49, "; 49 processes of its session reaped"),
        (1, "; 1 process of its session reaped"),
        (0, "; 0 processes of its session reaped"),
    ],
)
def test_the_last_exit_says_how_many_processes_of_its_session_were_reaped(
    tmp_path: Path, reaped: int, said: str
) -> None:
    """The count the sweeps reported rides the last exit, in the JSON and in the text."""
    cfg = a_config(tmp_path)
    host = replace(
        ready_host(0, 0),
        last_exit="killed by signal 9 (SIGKILL)",
        last_exit_at=16.9,
        last_exit_pid=4711,
        last_exit_signal=9,
        last_exit_reaped=reaped,
    )
    detail = view.host_detail(host, cfg.hosts[0], 20.0, POLICY)
    assert detail["last_exit"]["reaped"] == reaped
    text = render.render_host({"host": "worker-0", "daemon": {"running": True}, **detail})
    assert f"last exit: pid 4711 killed by signal 9 (SIGKILL), 3.1s ago{said}\n" in text
