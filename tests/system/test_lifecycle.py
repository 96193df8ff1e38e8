"""The daemon as systemd runs it: READY, WATCHDOG, reload, stop, adoption, logs, poll mode."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import mounted_tmpfs
from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    Daemons,
    all_ready,
    fast_config,
    host_pids,
    kill_quietly,
    pid_alive,
    write_config,
)

pytestmark = [pytest.mark.system, pytest.mark.openssh]

#: Once it has logged ``daemon.stopped`` the daemon has nothing left to do but exit: a
#: generous bound on a shared machine, not a measure (bench/bench_exit.py measures it).
EXIT_AFTER_STOPPED_S = 10.0


async def test_ready_watchdog_reload_and_stop(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """READY only once every host has a worker; the start-up heap frozen; WATCHDOG pings;
    RELOADING/READY around SIGHUP; STOPPING then exit 0 on SIGTERM with no worker left, the
    process gone soon after its last line, ``daemon.stopped``; every line is JSON."""
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, tmp_path / "run", 2, tmp_path))
    daemon = await daemons.start(config, watchdog_usec=400_000)
    ready_at = await daemon.wait_notify("READY=1")
    status = await daemon.status()
    assert all(row["pid"] is not None for row in status["hosts"].values()), status
    # Start-up's heap is frozen out of the collector once ready (daemon._collect_loop).
    collected = await daemon.wait_log("daemon.gc")
    assert collected["frozen"] > 10_000, collected
    assert collected["pause_ms"] >= 0, collected
    launched = {line["host"] for line in daemon.lines if line.get("event") == "host.launched"}
    assert launched == {"worker-0", "worker-1"}
    await daemon.wait_until(
        lambda: sum(m.splitlines() == ["WATCHDOG=1"] for m in daemon.notifications[ready_at:]) >= 4,
        30,
        "4 watchdog pings",
    )
    status = await daemon.wait_status(all_ready, 30, "all ready")
    pids = host_pids(status)
    # STATUS= keeps systemctl status current: the fleet's summary once both are ready.
    await daemon.wait_notify("STATUS=2/2 ready", timeout_s=30)

    before = len(daemon.notifications)
    daemon.send_signal(signal.SIGHUP)
    reloading = await daemon.wait_notify("RELOADING=1", after=before)
    assert any(f.startswith("MONOTONIC_USEC=") for f in daemon.notifications[reloading].split())
    await daemon.wait_notify("READY=1", after=reloading)
    assert host_pids(await daemon.status()) == pids  # nothing changed, nothing restarted

    daemon.send_signal(signal.SIGTERM)
    await daemon.wait_notify("STOPPING=1", after=reloading)
    stopped = await daemon.wait_log("daemon.stopped")
    assert await daemon.wait_exit(EXIT_AFTER_STOPPED_S) == 0
    assert daemon.lines[-1] == stopped  # nothing is done, so nothing logged, after it
    assert stopped["exit_code"] == 0 and stopped["role"] == "leader"
    assert not [pid for pid in pids.values() if pid and pid_alive(pid)]
    assert daemon.bad_lines == []
    for line in daemon.lines:
        assert {"timestamp", "level", "event"} <= line.keys(), line
        assert line["timestamp"].endswith("Z"), line
    changes = [line for line in daemon.lines if line["event"] == "host.state"]
    assert changes
    assert all({"host", "from", "to", "reason"} <= line.keys() for line in changes)


async def test_reload_touches_only_added_removed_and_changed_hosts(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """SIGHUP: an unchanged host keeps its pid, a changed one is replaced, a removed one is
    stopped, an added one (taking the removed host's shard) starts after it is gone."""
    raw = fast_config(openssh, tmp_path / "run", 3, tmp_path)
    config = write_config(tmp_path / "rs.toml", raw)
    daemon = await daemons.start(config)
    status = await daemon.wait_status(lambda s: all_ready(s, 3), 60, "3 ready")
    before = host_pids(status)

    raw["hosts"][1]["concurrency"] = 3  # a launch parameter: worker-1 must be replaced
    removed = raw["hosts"].pop(2)
    raw["hosts"].append({**removed, "name": "worker-9"})  # same shard, new host
    write_config(config, raw)
    daemon.send_signal(signal.SIGHUP)
    await daemon.wait_log("config.reloaded")

    status = await daemon.wait_status(
        lambda s: (
            all_ready(s, 3)
            and "worker-9" in s["hosts"]
            and s["hosts"]["worker-1"]["pid"] != before["worker-1"]
        ),
        60,
        "worker-1 replaced and worker-9 ready",
    )
    after = host_pids(status)
    assert after["worker-0"] == before["worker-0"]
    assert set(after) == {"worker-0", "worker-1", "worker-9"}
    assert not pid_alive(before["worker-2"] or -1)
    assert not pid_alive(before["worker-1"] or -1)
    stopped = await daemon.wait_log("host.state", host="worker-2", to="stopped")
    started = await daemon.wait_log("host.launch", host="worker-9")
    assert daemon.lines.index(stopped) < daemon.lines.index(started)  # one worker per shard


async def test_broken_config_on_sighup_keeps_every_worker(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """A reload with an invalid file logs every error and changes nothing."""
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, tmp_path / "run", 2, tmp_path))
    daemon = await daemons.start(config)
    status = await daemon.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    pids = host_pids(status)
    good = config.read_text()
    config.write_text(good.replace("heartbeat_stale_s = 3.0", "heartbeat_stale_s = -1") + "[x]\n")
    daemon.send_signal(signal.SIGHUP)
    failed = await daemon.wait_log("config.reload_failed")
    assert any("health.heartbeat_stale_s" in e for e in failed["errors"])
    assert any(e.endswith("x: unknown key") for e in failed["errors"])
    status = await daemon.status()
    assert host_pids(status) == pids
    assert all_ready(status, 2)
    assert status["daemon"]["last_reload_errors"] == failed["errors"]


async def test_sigkilled_daemon_is_replaced_by_one_that_adopts_every_worker(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """After SIGKILL, a new daemon adopts the same pids with no launch, and keeps the
    restart history (a crash-looping daemon cannot reset backoff)."""
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, tmp_path / "run", 2, tmp_path))
    first = await daemons.start(config)
    status = await first.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    crashed = status["hosts"]["worker-1"]["pid"]
    os.kill(crashed, signal.SIGKILL)
    status = await first.wait_status(
        lambda s: all_ready(s, 2) and s["hosts"]["worker-1"]["pid"] != crashed, 60, "restart"
    )
    assert status["hosts"]["worker-1"]["restarts"] == 1
    pids = host_pids(status)
    await first.wait_until(
        lambda: (
            (tmp_path / "run" / "ctl" / "supervisor-state.json").exists()
            and '"restarts": 1' in (tmp_path / "run" / "ctl" / "supervisor-state.json").read_text()
        ),
        10,
        "restart history saved",
    )
    first.send_signal(signal.SIGKILL)
    assert await first.wait_exit() == -signal.SIGKILL
    assert all(pid and pid_alive(pid) for pid in pids.values())

    second = await daemons.start(config)
    await second.wait_notify("READY=1")
    status = await second.wait_status(lambda s: all_ready(s, 2), 60, "adopted and ready")
    assert host_pids(status) == pids
    assert status["hosts"]["worker-1"]["restarts"] == 1
    assert not [line for line in second.lines if line.get("event") == "host.launch"]
    adopted = [line for line in second.lines if line.get("event") == "host.state"]
    assert {line["reason"] for line in adopted if line["to"] == "ready"} == {
        "adopted running worker"
    }


async def offline_status(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``reward-supervisor status -c CONFIG ARGS`` in a process of its own (no daemon runs)."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "supervisor.cli", "status", "-c", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_offline_status_tells_a_clean_stop_from_a_killed_daemon(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """After SIGTERM's clean stop, ``status`` without a daemon says every host is stopped and
    when the daemon stopped, and exits 3 (not running); after a SIGKILL it says the daemon
    did not stop cleanly and its workers may run on, and exits 1 (dead)."""
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, tmp_path / "run", 2, tmp_path))
    first = await daemons.start(config)
    await first.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    first.send_signal(signal.SIGTERM)
    assert await first.wait_exit() == 0

    text = await offline_status(config)
    assert text.returncode == 3, text.stdout + text.stderr
    head, _header, *rows = text.stdout.splitlines()
    assert "daemon not running: it stopped cleanly at" in head
    assert [row.split()[2] for row in rows] == ["stopped", "stopped"]
    assert all("stopped (daemon stopped cleanly at" in row for row in rows)
    as_json = json.loads((await offline_status(config, "--json")).stdout)
    assert as_json["daemon"]["stopped_cleanly_at"] is not None
    for row in as_json["hosts"].values():
        assert row["state"] == "stopped"
        assert row["last_reason"].startswith("stopped (daemon stopped cleanly at")
    one = await offline_status(config, "worker-0")
    assert one.returncode == 3
    assert "worker-0: stopped (daemon stopped cleanly at" in one.stdout

    second = await daemons.start(config)
    status = await second.wait_status(lambda s: all_ready(s, 2), 60, "2 ready again")
    second.send_signal(signal.SIGKILL)
    assert await second.wait_exit() == -signal.SIGKILL
    try:
        text = await offline_status(config)
        assert text.returncode == 1, text.stdout + text.stderr
        assert "did not stop cleanly" in text.stdout
        assert "stopped cleanly at" not in text.stdout
        as_json = json.loads((await offline_status(config, "--json")).stdout)
        assert {row["state"] for row in as_json["hosts"].values()} == {"unknown"}
    finally:
        for pid in host_pids(status).values():
            kill_quietly(pid)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted tmpfs (root only), unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "tmpfs", "64m") as mount_point:
        yield mount_point


async def test_poll_mode_drives_the_state_machine_on_its_own_mount(
    openssh: OpenSsh, tmp_path: Path, tmpfs: Path, daemons: Daemons
) -> None:
    """With watch.mode = "poll" on a separate mount, heartbeats and exit records still
    arrive: a killed worker is replaced."""
    raw = fast_config(
        openssh, tmpfs / "run", 1, tmp_path, watch={"mode": "poll", "poll_interval_s": 0.2}
    )
    config = write_config(tmp_path / "rs.toml", raw)
    daemon = await daemons.start(config)
    status = await daemon.wait_status(lambda s: all_ready(s, 1), 60, "ready in poll mode")
    assert status["daemon"]["watch_mode"] == "poll"
    pid = status["hosts"]["worker-0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    exited = await daemon.wait_log("host.state", host="worker-0", to="stale")
    assert "signal 9" in exited["reason"]  # the exit record, not a heartbeat timeout
    await daemon.wait_status(
        lambda s: all_ready(s, 1) and s["hosts"]["worker-0"]["pid"] != pid, 60, "replaced"
    )
    daemon.send_signal(signal.SIGTERM)
    assert await daemon.wait_exit() == 0
