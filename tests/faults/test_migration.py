"""Taking a fleet over from the old script itself (reward_workers_ctl.py, ``tests/seed.py``),
running or stopped, exactly as docs/MIGRATING.md says, under the invariant
monitor: no worker restarted, never two workers on a shard, every task answered once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import SSH, FaultRun, Workload, events, hold_for, write_config_atomic
from tests.seed import SeedWorld, describe
from tests.sshd import OpenSsh
from tests.system.daemonproc import pid_alive, poll_until

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

#: The old script's respawn loop sleeps 2 s after its worker exits, then starts another:
#: a replaced worker is watched for longer than that for a second one on its shard.
RESPAWN_WINDOW_S = 4.0
#: The old script runs every step over a fresh ssh with fixed sleeps (~3 s a host at best).
SEED_S = 300


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``reward-supervisor ARGS`` as a separate process."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=SEED_S,
        check=False,
        env=env,
    )


async def acli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``cli`` off the event loop."""
    return await asyncio.to_thread(cli, *args, env=env)


async def import_config(world: SeedWorld, tmp_path: Path) -> Path:
    """The migration's step 1: ``import-seed`` in the old script's environment, then only
    the edits an operator makes for this site (where each host is, the control socket, and
    the SSH timings the fault suite uses), then ``check-config``."""
    server = world.openssh
    out = tmp_path / "imported.toml"
    imported = await acli(
        *("import-seed", "--root", str(world.root), "-o", str(out)),
        *("--known-hosts", str(server.known_hosts), "--client-key", str(server.client_key)),
        *("--username", server.username),
        env=world.env,
    )
    assert imported.returncode == 0, imported.stderr
    raw: dict[str, Any] = tomllib.loads(out.read_text())
    # From the wrapper the old script wrote: the interpreter its workers really run.
    assert raw["worker"]["python"] == f"{world.venv}/bin/python"
    assert f"{world.ws}/repo/AReaL" in raw["worker"]["env"]["PYTHONPATH"]
    for host in raw["hosts"]:
        host["address"], host["port"] = server.addresses[0], server.port
    raw["control"] = {"socket": str(tmp_path / "control.sock")}
    raw["ssh"].update(SSH)
    config = write_config_atomic(tmp_path / "run.toml", raw)
    checked = await acli("check-config", str(config))
    assert checked.returncode == 0, checked.stderr
    return config


def known(pid: int | None) -> int:
    """A pid the old script must have written."""
    assert pid is not None, "the old script wrote no pid"
    return pid


async def disarm(config: Path, *extra: str) -> dict[str, Any]:
    """The migration's step 2: ``disarm-seed --json``; its report (exit code checked)."""
    result = await acli("disarm-seed", "-c", str(config), "--json", *extra)
    report: dict[str, Any] = json.loads(result.stdout)
    assert result.returncode == (0 if report["ok"] else 1), result.stderr
    return report


@pytest.mark.timeout(2 * SEED_S)
async def test_a_running_old_fleet_is_taken_over_without_stopping_a_worker(
    openssh: OpenSsh, tmp_path: Path, seed_script: Path, fault_run: FaultRun
) -> None:
    """The old script's start (respawn wrappers) and watch are running and a trainer feeds
    tasks: disarm-seed ends the watch and the wrappers and no worker; the daemon adopts every
    worker with zero restarts; a worker it replaces is not respawned behind its back; every
    task gets exactly one result."""
    world = SeedWorld.create(tmp_path / "seed", openssh, seed_script, hosts=2)
    try:
        started = await asyncio.to_thread(world.start)
        assert started.returncode == 0, describe(started)
        assert {"ok": True, "phase": "ready", "root": str(world.root)} in [
            json.loads(line) for line in started.stdout.splitlines() if line.startswith("{")
        ]
        watch = world.start_watch()
        await poll_until((world.root / "ctl" / "watch.pid").exists, 60, "the old watch loop")
        workers = {h: known(world.pid(h)) for h in world.hosts}
        wrappers = {h: known(world.pid(h, "wrap.pid")) for h in world.hosts}
        assert sorted(world.wrappers()) == sorted(wrappers.values())
        workload = Workload(world.root, shards=2, total=300, duration_s=20.0).start()

        config = await import_config(world, tmp_path)
        began = time.monotonic()
        report = await disarm(config)
        fault_run.recovered("disarm-seed (watch + 2 hosts)", began)
        assert report["ok"], report
        assert report["watch"]["outcome"] == "stopped"
        for i, host in enumerate(world.hosts):
            row = report["hosts"][host]
            assert row["wrappers_killed"] == [wrappers[host]], row
            assert row["workers"] == [workers[host]], row
            assert row["sentinel"] == "none", row
            assert fault_run.monitor.live_on(i, world.root) == [workers[host]]
        await asyncio.to_thread(watch.wait, 30)
        assert world.wrappers() == []
        assert all(pid_alive(pid) for pid in workers.values())

        began = time.monotonic()
        daemon = await fault_run.start(config, ready=2)
        fault_run.recovered("every old worker adopted (daemon start to 2 ready)", began)
        status = await daemon.status()
        assert {h: r["pid"] for h, r in status["hosts"].items()} == workers
        assert all(r["restarts"] == 0 for r in status["hosts"].values())
        assert events(daemon, "host.launch") == []
        await daemon.wait_status(
            lambda s: bool(s["daemon"]["pointer"]["written"]), 30, "the pointer file written"
        )
        assert (world.ws / "tmp" / "sao-reward-current.json").exists()

        # The first restart of an adopted worker: the respawn loop, were it alive, would
        # start the old worker again 2 s after it exits, beside the daemon's new one.
        host = world.hosts[0]
        replaced = await acli("restart-host", "-c", str(config), host)
        assert replaced.returncode == 0, replaced.stderr
        await daemon.wait_status(
            lambda s: (
                s["hosts"][host]["state"] == "ready" and s["hosts"][host]["pid"] != workers[host]
            ),
            60,
            "the replaced host ready again",
        )

        def one_worker_per_shard() -> None:
            """Each shard has exactly one live worker."""
            for shard in range(2):
                assert len(fault_run.monitor.live_on(shard, world.root)) == 1

        # The monitor's latest sample (every 20 ms, later under load) can predate the new
        # worker: check from scans that began after it was ready.
        taken = fault_run.monitor.samples
        await daemon.wait_until(
            lambda: fault_run.monitor.samples >= taken + 2, 60, "two fresh monitor samples"
        )
        await hold_for(RESPAWN_WINDOW_S, one_worker_per_shard)
        assert not pid_alive(workers[host])
        await workload.wait_done()
        workload.assert_all_done_once()
        assert await fault_run.stop(daemon) == 0
    finally:
        world.close()


@pytest.mark.timeout(2 * SEED_S)
async def test_a_stopped_old_fleet_starts_and_an_operators_stop_file_is_kept(
    openssh: OpenSsh, tmp_path: Path, seed_script: Path, fault_run: FaultRun
) -> None:
    """The old script's stop wrote ctl/<host>.stop for every host: disarm-seed removes those
    (a dry run first only reports), keeps one an operator wrote, and the daemon then starts
    the fleet; a stop-host sentinel survives a second disarm-seed."""
    world = SeedWorld.create(tmp_path / "seed", openssh, seed_script, hosts=2)
    try:
        started = await asyncio.to_thread(world.start)
        assert started.returncode == 0, describe(started)
        old = [world.pid(h) for h in world.hosts]
        stopped = await asyncio.to_thread(world.stop)
        assert stopped.returncode == 0, describe(stopped)
        sentinels = [world.root / "ctl" / f"{h}.stop" for h in world.hosts]
        assert [s.read_bytes() for s in sentinels] == [b"stop\n", b"stop\n"]
        assert not any(pid_alive(pid or 0) for pid in old)
        assert world.wrappers() == []
        # An operator's own stop file, written by hand: the old script never wrote this.
        sentinels[1].write_text("down for maintenance\n")

        config = await import_config(world, tmp_path)
        dry = await disarm(config, "--dry-run")
        assert [dry["hosts"][h]["sentinel"] for h in world.hosts] == ["would_clear", "kept"]
        assert sentinels[0].exists()

        report = await disarm(config)
        assert report["ok"], report
        assert [report["hosts"][h]["sentinel"] for h in world.hosts] == ["cleared", "kept"]
        assert report["hosts"][world.hosts[1]]["sentinel_detail"].startswith(
            f"kept ctl/{world.hosts[1]}.stop"
        )
        assert all(report["hosts"][h]["workers"] == [] for h in world.hosts)
        assert not sentinels[0].exists() and sentinels[1].exists()

        began = time.monotonic()
        daemon = await fault_run.start(config)
        first, second = world.hosts
        await daemon.wait_status(
            lambda s: (
                s["hosts"][first]["state"] == "ready" and s["hosts"][second]["state"] == "stopped"
            ),
            120,
            "the old script's stop undone, the operator's kept",
        )
        fault_run.recovered("stopped fleet launched (daemon start to ready)", began)
        started_again = await acli("start-host", "-c", str(config), second)
        assert started_again.returncode == 0, started_again.stderr
        await daemon.wait_status(
            lambda s: all(r["state"] == "ready" for r in s["hosts"].values()), 60, "both ready"
        )

        # An operator's stop-host later is told apart from the old script's stop.
        held = await acli("stop-host", "-c", str(config), first)
        assert held.returncode == 0, held.stderr
        await daemon.wait_status(
            lambda s: s["hosts"][first]["state"] == "stopped", 60, "the host stopped"
        )
        again = await disarm(config)
        assert again["ok"] and again["hosts"][first]["sentinel"] == "kept", again
        assert sentinels[0].exists()
        assert (await daemon.status())["hosts"][first]["state"] == "stopped"
        assert await fault_run.stop(daemon) == 0
    finally:
        world.close()
