"""``disarm-seed`` over real SSH when something is wrong: a host it cannot reach is left
untouched and named, two workers on one shard are named, and the exit code is 1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.sshd import OpenSsh
from tests.system.daemonproc import fast_config, pid_alive, write_config

pytestmark = [pytest.mark.system, pytest.mark.openssh]


def disarm_seed(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``reward-supervisor disarm-seed -c CONFIG ARGS``."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "disarm-seed", "-c", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_host_is_left_alone_and_named(openssh: OpenSsh, tmp_path: Path) -> None:
    """One host answers, one refuses connections: the first's stop file from the old stop
    is removed; the second's is kept, the report says NOT DONE for it, exit 1."""
    root = tmp_path / "runs" / "run-1"
    raw = fast_config(openssh, root, 2, tmp_path)
    raw["hosts"][1]["port"] = closed_port()
    raw["ssh"]["connect_timeout_s"] = 1.0
    config = write_config(tmp_path / "rs.toml", raw)
    (root / "ctl").mkdir(parents=True)
    for host in ("worker-0", "worker-1"):
        (root / "ctl" / f"{host}.stop").write_bytes(b"stop\n")
    result = disarm_seed(config)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("watch: no ctl/watch.pid")
    assert lines[1].startswith("worker-0: no respawn wrapper; no worker running")
    assert "removed ctl/worker-0.stop" in lines[1]
    assert lines[2].startswith("worker-1: NOT DONE:")
    assert "respawn wrapper may still run" in lines[2]
    assert lines[-1].startswith("NOT DONE")
    assert not (root / "ctl" / "worker-0.stop").exists()
    assert (root / "ctl" / "worker-1.stop").read_bytes() == b"stop\n"


def test_two_workers_on_one_shard_are_named_and_left_running(
    openssh: OpenSsh, tmp_path: Path
) -> None:
    """Two live processes match a host's worker command line: both are reported, neither is
    touched, the pidfile is not rewritten, and the exit code is 1."""
    token = f"{uuid.uuid4().hex}"
    argv = ["{python}", "-c", "import sys, time; time.sleep(3600)", token, "--host", "{host}"]
    root = tmp_path / "runs" / "run-1"
    raw = fast_config(openssh, root, 1, tmp_path)
    raw["worker"]["argv"] = argv
    config = write_config(tmp_path / "rs.toml", raw)
    (root / "ctl").mkdir(parents=True)
    code = "import sys, time; time.sleep(3600)"
    workers = [
        subprocess.Popen([sys.executable, "-c", code, token, "--host", "worker-0"])
        for _ in range(2)
    ]
    try:
        # Popen returns once the child has exec'd: both command lines are in place.
        pids = sorted(w.pid for w in workers)
        (root / "ctl" / "worker-0.pid").write_text(f"{pids[0]}\n")
        result = disarm_seed(config, "--json")
        assert result.returncode == 1, result.stderr
        row = json.loads(result.stdout)["hosts"]["worker-0"]
        assert row["workers"] == pids and row["ok"] is False
        assert row["pidfile_now"] == pids[0]
        text = disarm_seed(config)
        assert f"2 workers on one shard: pids {pids[0]}, {pids[1]}" in text.stdout
        assert all(pid_alive(p) for p in pids)
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
