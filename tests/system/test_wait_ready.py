"""``wait-ready``: the seed's ``start`` waiting for heartbeats, its JSON phase lines, its exit
codes, and ``--stop-on-timeout`` for scripts that relied on a failed start leaving nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.sshd import OpenSsh
from tests.system.daemonproc import Daemons, all_ready, fast_config, pid_alive, write_config

pytestmark = [pytest.mark.system, pytest.mark.openssh]


async def wait_ready(*args: str) -> subprocess.CompletedProcess[str]:
    """``reward-supervisor wait-ready ARGS`` as a separate process, off the event loop."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "supervisor.cli", "wait-ready", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def phases(stdout: str) -> list[dict[str, Any]]:
    """The JSON lines ``--json`` printed."""
    return [json.loads(line) for line in stdout.splitlines()]


async def test_json_prints_the_seeds_manifest_and_ready_lines(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """--json: the seed's manifest line (the launch meta) once the daemon answers, saying
    truly that workers are restarted (``respawn``), then {"ok": true, "phase": "ready",
    "root": ROOT}; exit 0."""
    root = tmp_path / "runs" / "run-1"
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, root, 2, tmp_path))
    await daemons.start(config)
    result = await wait_ready("-c", str(config), "--json", "--timeout", "120")
    assert result.returncode == 0, result.stderr
    manifest, ready = phases(result.stdout)
    assert manifest["ok"] is True and manifest["phase"] == "manifest"
    meta = json.loads((root / "ctl" / "launch_meta.json").read_text())
    assert {k: manifest[k] for k in meta} == meta
    assert manifest["respawn"] is True and manifest["auto_restart"] is True
    assert ready == {"ok": True, "phase": "ready", "root": str(root)}


async def test_timeout_exit_codes_and_stop_on_timeout(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """Never ready: exit 1 with a timeout line naming each host; the daemon keeps trying.
    With --stop-on-timeout the daemon stops every worker and exits, as the seed's failed
    start left nothing running."""
    root = tmp_path / "runs" / "run-1"
    raw = fast_config(openssh, root, 2, tmp_path)
    raw["worker"]["env"] = {"REWARD_WORKER_FAULT": "never_ready"}
    config = write_config(tmp_path / "rs.toml", raw)
    daemon = await daemons.start(config)
    await daemon.wait_status(
        lambda s: len(s.get("hosts", {})) == 2 and all(r.get("pid") for r in s["hosts"].values()),
        60,
        "both workers launched",
    )
    late = await wait_ready("-c", str(config), "--json", "--timeout", "2")
    assert late.returncode == 1
    timeout = phases(late.stdout)[-1]
    assert (timeout["ok"], timeout["phase"], timeout["code"]) == (False, "timeout", "not_ready")
    assert set(timeout["not_ready"]) == {"worker-0", "worker-1"}
    status = await daemon.status()
    assert not all_ready(status)
    pids = [int(r["pid"]) for r in status["hosts"].values() if r.get("pid")]

    stopped = await wait_ready("-c", str(config), "--json", "--timeout", "2", "--stop-on-timeout")
    assert stopped.returncode == 1
    said = phases(stopped.stdout)
    assert [(p["phase"], p.get("code")) for p in said][-2:] == [
        ("timeout", "not_ready"),
        ("stopped", "not_ready"),
    ]
    assert await daemon.wait_exit(60) == 0
    assert pids and not any(pid_alive(pid) for pid in pids)


async def test_no_daemon_is_exit_3_and_a_bad_timeout_is_a_usage_error(
    openssh: OpenSsh, tmp_path: Path
) -> None:
    """Nobody answers within the timeout: exit 3 and one no_daemon line, coded so; --timeout
    0 or a word is refused by the parser (exit 2)."""
    config = write_config(
        tmp_path / "rs.toml", fast_config(openssh, tmp_path / "runs" / "run-1", 1, tmp_path)
    )
    absent = await wait_ready("-c", str(config), "--json", "--timeout", "0.5")
    assert absent.returncode == 3
    [line] = phases(absent.stdout)
    assert (line["ok"], line["phase"], line["code"]) == (False, "no_daemon", "no_daemon")
    assert line["socket"] == str(tmp_path / "control.sock")
    for bad in ("0", "-1", "soon", "inf"):
        refused = await wait_ready("-c", str(config), "--timeout", bad)
        assert refused.returncode == 2, bad
        assert "--timeout" in refused.stderr
