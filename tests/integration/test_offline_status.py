"""Offline ``status`` gives the old script's verdict: checked against the old script's own
``_host_health`` on the same run directory, and where they differ on purpose, as documented."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from supervisor import config as config_mod
from supervisor import render, runfiles, view
from supervisor.layout import layout_of

STALE_S = 15.0  # the old status's default --heartbeat-stale


def load_seed(path: Path) -> ModuleType:
    """The old script as a module (importing it runs nothing but its definitions)."""
    spec = importlib.util.spec_from_file_location("reward_workers_ctl", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_dir(tmp_path: Path, hosts: list[str]) -> config_mod.Config:
    """A config for ``hosts`` at ``tmp_path/run`` with the old status's stale limit."""
    raw = {
        "run": {"root": str(tmp_path / "run")},
        "health": {"heartbeat_stale_s": STALE_S},
        "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
        "hosts": [{"name": h, "shard": i} for i, h in enumerate(hosts)],
    }
    cfg = config_mod.parse(raw, tmp_path / "rs.toml")
    for sub in ("ctl", "status"):
        (cfg.run.root / sub).mkdir(parents=True, exist_ok=True)
    return cfg


def write_status(root: Path, host: str, body: bytes | dict[str, Any], age_s: float) -> None:
    """A heartbeat file whose stamp and modification time both say ``age_s`` ago."""
    path = root / "status" / f"{host}.json"
    when = time.time() - age_s
    if isinstance(body, dict):
        body = json.dumps({"heartbeat_at": when, **body}).encode()
    path.write_bytes(body)
    os.utime(path, (when, when))


# host -> (status body, age in seconds); None: no status file.
CASES: dict[str, tuple[bytes | dict[str, Any], float] | None] = {
    "fresh": ({"ready": True, "pid": 101}, 1.0),
    "old": ({"ready": True, "pid": 102}, 100.0),
    "warming": ({"ready": False, "pid": 103}, 1.0),
    "old-and-warming": ({"ready": False, "pid": 104}, 100.0),
    "silent": None,
    "garbled": (b"{not json", 1.0),
}


def test_offline_verdicts_agree_with_the_old_scripts_status(
    tmp_path: Path, seed_script: Path
) -> None:
    """For well-formed, missing and unreadable status files, verdict, ok, heartbeat age,
    status pid and pidfile pid are what the old script's _host_health says."""
    seed = load_seed(seed_script)
    cfg = run_dir(tmp_path, list(CASES))
    root = cfg.run.root
    for i, (host, case) in enumerate(CASES.items()):
        (root / "ctl" / f"{host}.pid").write_text(f"{500 + i}\n")
        if case is not None:
            write_status(root, host, *case)
    ours = view.offline_status(cfg)["hosts"]
    for host in CASES:
        theirs = seed._host_health(root, host, stale_s=STALE_S)
        row = ours[host]
        assert row["verdict"] == theirs["reason"].split(":")[0], host
        assert row["ok"] is theirs["ok"], host
        assert row["pid"] == int(theirs["pidfile"]), host
        assert row["status_pid"] == theirs.get("status_pid"), host
        if "heartbeat_age_s" in theirs:
            assert row["heartbeat_age_s"] == pytest.approx(theirs["heartbeat_age_s"], abs=1.0)
        else:
            assert theirs["reason"].startswith(("status_missing", "status_bad"))
    assert [ours[h]["verdict"] for h in CASES] == [
        "ok",
        "heartbeat_stale",
        "not_ready",
        "heartbeat_stale",
        "status_missing",
        "status_bad",
    ]


def test_a_heartbeat_without_pid_or_stamp_is_bad_here_where_the_old_script_guessed(
    tmp_path: Path, seed_script: Path
) -> None:
    """The documented differences: no pid made the old script say ok (no pid to check), no
    heartbeat_at made it say heartbeat_stale (age from 1970); neither can be a worker's
    heartbeat, so offline status says status_bad."""
    seed = load_seed(seed_script)
    cfg = run_dir(tmp_path, ["nopid", "nostamp"])
    root = cfg.run.root
    write_status(root, "nopid", {"ready": True}, 1.0)
    (root / "status" / "nostamp.json").write_text(json.dumps({"ready": True, "pid": 7}))
    ours = view.offline_status(cfg)["hosts"]
    assert seed._host_health(root, "nopid", stale_s=STALE_S)["reason"] == "ok"
    assert seed._host_health(root, "nostamp", stale_s=STALE_S)["reason"] == "heartbeat_stale"
    assert ours["nopid"]["verdict"] == ours["nostamp"]["verdict"] == "status_bad"


def clean_stop(
    cfg: config_mod.Config, *, epoch: int, hosts: dict[str, tuple[str, int | None]]
) -> float:
    """Write what a leader of ``epoch`` writes when its stop ran to its end; its time."""
    run = layout_of(cfg)
    stopped_at = time.time() - 5.0
    record = runfiles.StopRecord(stopped_at=stopped_at, epoch=epoch, by="node pid 9", hosts=hosts)
    runfiles.write_atomic(run.stop_record, runfiles.stop_record_json(record), root=run.root)
    return stopped_at


def test_a_clean_stop_of_the_last_leader_shows_its_hosts_stopped(tmp_path: Path) -> None:
    """The stop record of the epoch on disk: each host it stopped is ``stopped``, said with
    the time of the stop, and the exit status is 3 (not running); a host whose status file
    is another pid's than the one stopped is news since, and keeps its verdict."""
    cfg = run_dir(tmp_path, ["a", "b", "c"])
    root = cfg.run.root
    run = layout_of(cfg)
    runfiles.bump_epoch(run.epoch_file, root=root)
    write_status(root, "a", {"ready": False, "pid": 11}, 60.0)
    write_status(root, "b", {"ready": True, "pid": 99}, 1.0)
    at = clean_stop(cfg, epoch=1, hosts={"a": ("stopped", 11), "b": ("stopped", 12)})
    status = view.offline_status(cfg)
    daemon = status["daemon"]
    assert daemon["stopped_cleanly_at"] == at and daemon["stopped_by"] == "node pid 9"
    assert f"stopped cleanly at {view.wall_text(at)}" in daemon["note"]
    assert view.offline_exit_status(daemon) == view.OFFLINE_NOT_RUNNING
    hosts = status["hosts"]
    assert hosts["a"]["state"] == "stopped"
    assert hosts["a"]["last_reason"] == f"stopped (daemon stopped cleanly at {view.wall_text(at)})"
    assert hosts["a"]["verdict"] == "heartbeat_stale"  # the seed's, kept for its readers
    assert hosts["b"]["state"] == "unknown" and hosts["b"]["verdict"] == "ok"
    assert hosts["b"]["last_reason"].startswith("ready (status pid 99); stopped when")
    assert hosts["c"]["state"] == "unknown"  # not in the record: not said to be stopped
    table = render.render_table(status).splitlines()
    assert table[2].split()[:3] == ["a", "0", "stopped"]
    assert table[3].split()[:3] == ["b", "1", "ok"]


def test_a_stop_record_of_an_earlier_leadership_is_no_clean_stop(tmp_path: Path) -> None:
    """A daemon led after the recorded stop (the epoch on disk is newer) and is gone without
    one of its own: not a clean stop, exit status 1, and the note says what to do."""
    cfg = run_dir(tmp_path, ["a"])
    run = layout_of(cfg)
    runfiles.bump_epoch(run.epoch_file, root=cfg.run.root)
    clean_stop(cfg, epoch=1, hosts={"a": ("stopped", 11)})
    runfiles.bump_epoch(run.epoch_file, root=cfg.run.root)
    write_status(cfg.run.root, "a", {"ready": True, "pid": 11}, 60.0)
    status = view.offline_status(cfg)
    daemon = status["daemon"]
    assert daemon["stopped_cleanly_at"] is None and daemon["last_epoch"] == 2
    assert "did not stop cleanly" in daemon["note"] and "start it again" in daemon["note"]
    assert view.offline_exit_status(daemon) == view.OFFLINE_DEAD
    assert status["hosts"]["a"]["state"] == "unknown"


def test_no_leader_ever_is_not_running(tmp_path: Path) -> None:
    """A run no daemon ever led (no epoch): not running (3), and no word of a stop."""
    cfg = run_dir(tmp_path, ["a"])
    daemon = view.offline_status(cfg)["daemon"]
    assert daemon["last_epoch"] is None
    assert "none has led this run yet" in daemon["note"]
    assert view.offline_exit_status(daemon) == view.OFFLINE_NOT_RUNNING


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"stopped_at": 1.0, "epoch": 1, "by": "x",'
        b' "hosts": {"a": {"state": "gone\\u001b[2J", "pid": 1}}}',
        b'{"stopped_at": 1.0, "epoch": 1, "by": "x",'
        b' "hosts": {"a": {"state": "stopped", "pid": -4}}}',
        b'{"stopped_at": "soon", "epoch": 1, "by": "x", "hosts": {}}',
        b'{"stopped_at": 1.0, "epoch": true, "by": "x", "hosts": {}}',
        b'{"stopped_at": 1.0, "epoch": 1, "by": "", "hosts": {}}',
    ],
)
def test_a_stop_record_that_is_not_one_is_nothing(tmp_path: Path, body: bytes) -> None:
    """The record is read as hostile: a malformed one makes no clean stop and puts none of
    its text into the status."""
    cfg = run_dir(tmp_path, ["a"])
    run = layout_of(cfg)
    runfiles.bump_epoch(run.epoch_file, root=cfg.run.root)
    run.stop_record.write_bytes(body)
    status = view.offline_status(cfg)
    assert status["daemon"]["stopped_cleanly_at"] is None
    assert status["hosts"]["a"]["state"] == "unknown"
    assert "\x1b" not in json.dumps(status)


def test_a_symlinked_stop_record_is_not_followed(tmp_path: Path) -> None:
    """A stop record planted as a symlink to a good record elsewhere is not read."""
    cfg = run_dir(tmp_path, ["a"])
    run = layout_of(cfg)
    runfiles.bump_epoch(run.epoch_file, root=cfg.run.root)
    record = runfiles.StopRecord(stopped_at=1.0, epoch=1, by="x", hosts={"a": ("stopped", 1)})
    elsewhere = tmp_path / "record.json"
    elsewhere.write_bytes(runfiles.stop_record_json(record))
    run.stop_record.symlink_to(elsewhere)
    assert view.offline_status(cfg)["daemon"]["stopped_cleanly_at"] is None


def test_a_daemon_holding_the_run_lock_elsewhere_is_running(tmp_path: Path) -> None:
    """No daemon answered here, but a process holds the run lock: a daemon leads (on another
    node, or with another socket): the note names it, exit status 0, and an old stop record
    is not taken for this one's."""
    cfg = run_dir(tmp_path, ["a"])
    run = layout_of(cfg)
    runfiles.bump_epoch(run.epoch_file, root=cfg.run.root)
    clean_stop(cfg, epoch=1, hosts={"a": ("stopped", 11)})
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from supervisor import runfiles;"
            f" runfiles.lock_run(Path({str(run.lock_file)!r}), root=Path({str(run.root)!r}));"
            " print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        daemon = view.offline_status(cfg)["daemon"]
        assert daemon["lock_holder"] == f"{socket.gethostname()} pid {holder.pid}"
        assert "holds the run lock" in daemon["note"]
        assert daemon["stopped_cleanly_at"] is None
        assert view.offline_exit_status(daemon) == view.OFFLINE_RUNNING
    finally:
        holder.kill()
        holder.communicate()  # waits, and closes its pipes
