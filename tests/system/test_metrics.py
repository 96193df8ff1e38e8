"""The Prometheus endpoint, scraped for real and checked against ``status --json``."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from supervisor import control
from tests import ports
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
    assert metrics["reward_supervisor_launch_seconds_count"] == 3  # 2 starts + 1 restart
    assert metrics["reward_supervisor_fleet_frozen"] == 0
    assert metrics["reward_supervisor_up"] == 1
