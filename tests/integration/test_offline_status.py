"""Offline ``status`` gives the old script's verdict: checked against the old script's own
``_host_health`` on the same run directory, and where they differ on purpose, as documented."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from supervisor import config as config_mod
from supervisor import view

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
