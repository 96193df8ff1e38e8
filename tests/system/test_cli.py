"""The operator's commands against a running daemon (real OpenSSH), and without one."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    DaemonProcess,
    Daemons,
    all_ready,
    fast_config,
    kill_quietly,
    pid_alive,
    poll_until,
    write_config,
)

pytestmark = [pytest.mark.system, pytest.mark.openssh]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``reward-supervisor ARGS`` as a separate process."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


async def acli(*args: str) -> subprocess.CompletedProcess[str]:
    """``cli`` without blocking the event loop (the daemon harness runs on it)."""
    return await asyncio.to_thread(cli, *args)


def fleet_config(openssh: OpenSsh, tmp_path: Path, hosts: int = 2) -> Path:
    """A two-host config with a cleanup prefix, written to ``tmp_path/rs.toml``."""
    raw = fast_config(openssh, tmp_path / "runs" / "run-1", hosts, tmp_path)
    raw["run"]["cleanup_prefix"] = str(tmp_path / "runs")
    return write_config(tmp_path / "rs.toml", raw)


@pytest.fixture
async def running(openssh: OpenSsh, tmp_path: Path, daemons: Daemons) -> tuple[DaemonProcess, Path]:
    """A daemon with two ready hosts; killed (with its workers) afterwards."""
    config = fleet_config(openssh, tmp_path)
    daemon = await daemons.start(config)
    await daemon.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    return daemon, config


async def test_status_human_and_json(running: tuple[DaemonProcess, Path]) -> None:
    """``status`` prints a table with every host; ``--json`` the DESIGN §7 fields."""
    _daemon, config = running
    human = await acli("status", "-c", str(config))
    assert human.returncode == 0, human.stderr
    assert "HOST" in human.stdout and "worker-0" in human.stdout and "worker-1" in human.stdout
    assert "ready" in human.stdout
    as_json = await acli("status", "-c", str(config), "--json")
    status = json.loads(as_json.stdout)
    for row in status["hosts"].values():
        assert {
            "state",
            "shard",
            "pid",
            "ssh",
            "heartbeat_age_s",
            "restarts",
            "last_reason",
        } <= set(row)
        assert row["state"] == "ready" and row["ssh"] == "connected"
    assert status["daemon"]["running"] is True
    # Every line logged before the reply reaches the daemon's stdout (none dropped); among
    # them, both hosts' ready transitions.
    daemon, logged = _daemon, status["daemon"]["log_lines"]
    assert status["daemon"]["log_lines_dropped"] == 0
    await daemon.wait_until(lambda: len(daemon.lines) >= logged, 30, f"{logged} log lines")
    changed = {ln["host"] for ln in daemon.lines[:logged] if ln.get("event") == "host.state"}
    assert changed >= {"worker-0", "worker-1"}


async def test_config_may_come_from_the_environment(running: tuple[DaemonProcess, Path]) -> None:
    """``-c`` defaults to $REWARD_SUPERVISOR_CONFIG."""
    _daemon, config = running
    env = {**os.environ, "REWARD_SUPERVISOR_CONFIG": str(config)}
    result = await asyncio.to_thread(cli, "status", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["hosts"]) == {"worker-0", "worker-1"}


async def test_restart_stop_and_start_host(running: tuple[DaemonProcess, Path]) -> None:
    """restart-host replaces the pid; stop-host stops and writes the sentinel; start-host
    removes it and the host comes back."""
    daemon, config = running
    before = (await daemon.status())["hosts"]["worker-1"]["pid"]
    mark = len(daemon.lines)
    restarted = await acli("restart-host", "-c", str(config), "worker-1", "--json")
    assert restarted.returncode == 0, restarted.stderr
    answer = json.loads(restarted.stdout)
    assert answer["host"] == "worker-1" and answer["planned"] == "operator"
    status = await daemon.wait_status(
        lambda s: all_ready(s, 2) and s["hosts"]["worker-1"]["pid"] != before, 60, "restarted"
    )
    assert not pid_alive(before)
    # An operator's restart is no failure: counted apart, by who asked, and said as info.
    row = status["hosts"]["worker-1"]
    assert (row["restarts"], row["planned_restarts"], row["planned"]) == (0, {"operator": 1}, None)
    changes = [
        line
        for line in daemon.lines[mark:]
        if line.get("event") == "host.state" and line.get("host") == "worker-1"
    ]
    assert changes and all(line["level"] == "info" for line in changes), changes
    again = await acli("restart-host", "-c", str(config), "worker-1")
    assert again.returncode == 0 and again.stdout.startswith("worker-1: replacing its worker (")
    await daemon.wait_status(
        lambda s: all_ready(s, 2) and s["hosts"]["worker-1"]["planned_restarts"] == {"operator": 2},
        60,
        "restarted again",
    )

    stopped = await acli("stop-host", "-c", str(config), "worker-1")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith("worker-1: ")
    status = await daemon.wait_status(
        lambda s: s["hosts"]["worker-1"]["state"] == "stopped", 60, "worker-1 stopped"
    )
    sentinel = Path(status["daemon"]["root"]) / "ctl" / "worker-1.stop"
    assert sentinel.exists()
    refused = await acli("restart-host", "-c", str(config), "worker-1", "--json")
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["code"] == "sentinel_held"

    started = await acli("start-host", "-c", str(config), "worker-1")
    assert started.returncode == 0, started.stderr
    await daemon.wait_status(lambda s: all_ready(s, 2), 60, "worker-1 back")
    assert not sentinel.exists()


async def test_reload_and_stop_commands(running: tuple[DaemonProcess, Path]) -> None:
    """``reload`` reports its outcome (refusal included); ``stop`` ends workers and daemon."""
    daemon, config = running
    pids = [row["pid"] for row in (await daemon.status())["hosts"].values()]
    ok = await acli("reload", "-c", str(config))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("reloaded")
    good = config.read_text()
    config.write_text(good + "\n[bogus]\n")
    refused = await acli("reload", "-c", str(config), "--json")
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["reloaded"] is False
    config.write_text(good)

    stop = await acli("stop", "-c", str(config))
    assert stop.returncode == 0, stop.stderr
    assert await daemon.wait_exit() == 0
    assert not [pid for pid in pids if pid_alive(pid)]


async def test_events_follows_state_changes(running: tuple[DaemonProcess, Path]) -> None:
    """``events --json`` prints host.state lines as a host restarts."""
    daemon, config = running
    follower = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "supervisor.cli",
        "events",
        "-c",
        str(config),
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert follower.stdout is not None and follower.stderr is not None
        async with asyncio.timeout(30):
            announced = await follower.stderr.readline()
        assert announced.startswith(b"following events from ")
        pid = (await daemon.status())["hosts"]["worker-0"]["pid"]
        os.kill(pid, signal.SIGKILL)
        seen: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while not any(e.get("to") == "ready" for e in seen):
                seen.append(json.loads(await follower.stdout.readline()))
    finally:
        follower.terminate()
        await follower.wait()
    hosts = {e["host"] for e in seen}
    assert hosts == {"worker-0"}
    assert seen[0]["from"] == "ready" and "signal 9" in seen[0]["reason"]


async def test_status_watch_prints_only_changes_when_not_a_tty(
    running: tuple[DaemonProcess, Path],
) -> None:
    """``status --watch --json`` on a pipe prints each host once, then a line per change: a
    killed worker shows up as its way back to ready under a new pid (one line or more), the
    other host stays silent."""
    daemon, config = running
    old = (await daemon.status())["hosts"]["worker-0"]["pid"]
    watcher = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "supervisor.cli", "status", "-c", str(config)],
        *["--watch", "--json", "--interval", "0.1"],
        stdout=asyncio.subprocess.PIPE,
    )
    lines: list[dict[str, Any]] = []
    try:
        assert watcher.stdout is not None
        async with asyncio.timeout(30):
            while {line["host"] for line in lines} != {"worker-0", "worker-1"}:
                lines.append(json.loads(await watcher.stdout.readline()))
        assert all(line["state"] == "ready" for line in lines), lines
        os.kill(old, signal.SIGKILL)
        async with asyncio.timeout(60):
            while not any(
                line["host"] == "worker-0" and line["state"] == "ready" and line["pid"] != old
                for line in lines[2:]
            ):
                lines.append(json.loads(await watcher.stdout.readline()))
    finally:
        watcher.send_signal(signal.SIGINT)
        assert await watcher.wait() == 0  # Ctrl-C ends a watch quietly
    changes = lines[2:]
    assert {line["host"] for line in changes} == {"worker-0"}, changes
    # The way back may be one line (ready under the new pid) when the restart completes
    # between two polls (a launch takes ~10 ms); each line differs from the one before.
    assert changes[-1]["state"] == "ready" and changes[-1]["pid"] != old, changes
    assert all(a != b for a, b in itertools.pairwise(changes))


async def test_status_watch_redraws_the_table_on_a_tty(running: tuple[DaemonProcess, Path]) -> None:
    """On a terminal, ``status --watch`` clears the screen and redraws the whole table."""
    _daemon, config = running
    leader, follower = os.openpty()
    watcher = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "supervisor.cli", "status", "-c", str(config)],
        *["--watch", "--interval", "0.1"],
        stdout=follower,
    )
    os.close(follower)
    screen = b""
    try:
        async with asyncio.timeout(30):
            while screen.count(b"\x1b[H\x1b[2J") < 2:
                screen += await asyncio.to_thread(os.read, leader, 65536)
    finally:
        watcher.send_signal(signal.SIGINT)
        await watcher.wait()
        os.close(leader)
    frame = screen.split(b"\x1b[H\x1b[2J")[1].decode()
    assert "HOST" in frame and "worker-0" in frame and "worker-1" in frame
    assert "refreshing every 0.1s" in frame


async def test_wait_ready_returns_once_the_fleet_is_ready(
    running: tuple[DaemonProcess, Path],
) -> None:
    """``wait-ready`` is the seed's ``start`` waiting for heartbeats."""
    _daemon, config = running
    result = await acli("wait-ready", "-c", str(config), "--timeout", "30")
    assert result.returncode == 0, result.stderr
    assert "all 2 hosts ready" in result.stdout


def test_commands_without_a_daemon(openssh: OpenSsh, tmp_path: Path) -> None:
    """No daemon: status works from files and says so, exiting 3 (not running: none has led
    this run); commands that need one exit 3; an unknown host is a usage error (2)."""
    config = fleet_config(openssh, tmp_path)
    status = cli("status", "-c", str(config))
    assert status.returncode == 3
    assert "daemon not running (none has led this run yet)" in status.stdout
    as_json = json.loads(cli("status", "-c", str(config), "--json").stdout)
    assert as_json["daemon"]["running"] is False
    assert set(as_json["hosts"]) == {"worker-0", "worker-1"}
    for command in (["restart-host", "worker-0"], ["stop"], ["reload"]):
        result = cli(command[0], "-c", str(config), *command[1:], "--json")
        assert result.returncode == 3, (command, result.stderr)
        assert json.loads(result.stdout)["code"] == "no_daemon", command
    unknown = cli("restart-host", "-c", str(config), "worker-7", "--json")
    assert unknown.returncode == 2
    assert json.loads(unknown.stdout)["code"] == "unknown_host"
    missing = cli("status", "--json")
    assert missing.returncode == 2
    assert json.loads(missing.stdout)["code"] == "usage"
    assert "REWARD_SUPERVISOR_CONFIG" in missing.stderr  # it says how to give one


def test_status_of_one_host_without_a_daemon(openssh: OpenSsh, tmp_path: Path) -> None:
    """No daemon: ``status HOST`` says so and shows what the files say, with the log's last
    lines (escaped on a terminal, whole in JSON); an unknown host or ``--watch`` with a host
    is a usage error (2)."""
    config = fleet_config(openssh, tmp_path)
    root = tmp_path / "runs" / "run-1"
    (root / "ctl").mkdir(parents=True)
    (root / "ctl" / "worker-1.log").write_text(
        "".join(f"line {i}\n" for i in range(30)) + "\x1b[2J\n"
    )
    text = cli("status", "-c", str(config), "worker-1", "--lines", "3")
    assert text.returncode == 3, text.stderr
    assert "daemon not running" in text.stdout and "judged by heartbeat only" in text.stdout
    assert "(last 3 lines):" in text.stdout and "    line 29" in text.stdout
    assert "\\x1b[2J" in text.stdout and "\x1b" not in text.stdout
    detail = json.loads(cli("status", "-c", str(config), "worker-1", "--json").stdout)
    assert detail["host"] == "worker-1" and detail["daemon"]["running"] is False
    assert detail["log"]["lines"][-2:] == ["line 29", "\x1b[2J"]
    assert len(detail["log"]["lines"]) == 20
    unknown = cli("status", "-c", str(config), "worker-7", "--json")
    assert unknown.returncode == 2 and json.loads(unknown.stdout)["code"] == "unknown_host"
    watching = cli("status", "-c", str(config), "worker-1", "--watch", "--json")
    assert watching.returncode == 2 and json.loads(watching.stdout)["code"] == "usage"


def test_check_config_exit_codes() -> None:
    """check-config: 0 and a summary for a good file; 2 and every problem for a bad one."""
    repo = Path(__file__).parent.parent.parent
    good = cli("check-config", str(repo / "systemd" / "example.toml"))
    assert good.returncode == 0
    assert "ok: 2 hosts" in good.stdout
    for path in sorted((repo / "tests" / "configs").glob("*.toml")):
        if path.name.startswith("valid"):
            continue
        bad = cli("check-config", str(path))
        assert bad.returncode == 2, path.name
        expected = [
            line.removeprefix("# expect:").strip()
            for line in path.read_text().splitlines()
            if line.startswith("# expect:")
        ]
        for line in expected:
            assert line.split(":")[0] in bad.stderr, (path.name, line, bad.stderr)


def test_every_shipped_example_passes_its_own_check() -> None:
    """``check-config`` on each example config the project ships (``systemd/*.toml``) is ok
    and warns of nothing but the SSH files it names that this machine lacks: an example
    that cannot beat the trainer would teach its reader the wrong numbers."""
    repo = Path(__file__).parent.parent.parent
    examples = sorted((repo / "systemd").glob("*.toml"))
    assert examples
    for example in examples:
        checked = cli("check-config", str(example), "--json")
        assert checked.returncode == 0, checked.stderr
        warnings = json.loads(checked.stdout)["warnings"]
        assert {w["key"] for w in warnings} <= {"ssh.known_hosts", "ssh.client_keys[0]"}, warnings
        assert all(" does not exist: " in w["reason"] for w in warnings), warnings


def test_check_config_looks_for_the_reward_fn_with_the_workers_python_here(
    openssh: OpenSsh, tmp_path: Path
) -> None:
    """Where ``worker.python`` is on this machine, check-config locates ``run.reward_fn``'s
    module with it and ``worker.env``: found, it says where; missing, it warns (exit 0: the
    hosts may differ) with the error; where that python is not here, it says it did not
    check, and that preflight checks every host."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "rs_reward_probe.py").write_text("def score(*args, **kwargs):\n    return 1.0\n")
    raw = openssh.config_dict(tmp_path / "run", 1, env={"PYTHONPATH": str(lib)})
    raw["run"]["reward_fn"] = "rs_reward_probe.score"
    found = cli("check-config", str(write_config(tmp_path / "found.toml", raw)))
    assert found.returncode == 0, found.stderr
    assert f"run.reward_fn rs_reward_probe.score: module located, {lib}" in found.stdout
    assert found.stderr == ""
    raw["run"]["reward_fn"] = "rs_reward_missing.score"
    missing = cli("check-config", str(write_config(tmp_path / "missing.toml", raw)), "--json")
    assert missing.returncode == 0, missing.stderr
    report = json.loads(missing.stdout)
    [warning] = report["warnings"]
    assert warning["key"] == "run.reward_fn"
    assert "No module named 'rs_reward_missing'" in warning["reason"]
    assert (report["reward_fn"]["checked"], report["reward_fn"]["code"]) == (True, "not_found")
    raw["worker"]["python"] = str(tmp_path / "no-such-python")
    raw["worker"]["argv"] = ["{python}", "-m", "supervisor.demo.worker"]
    elsewhere = cli("check-config", str(write_config(tmp_path / "elsewhere.toml", raw)))
    assert elsewhere.returncode == 0
    assert elsewhere.stderr.splitlines() == [
        f"note: run.reward_fn not checked here: worker.python {tmp_path}/no-such-python is not"
        " on this machine; preflight checks every host"
    ]


def test_check_config_json_lists_every_problem_with_its_key() -> None:
    """check-config --json: ok with the counts for a good file; for a bad one exit 2 and
    one object per problem, the same problems the text form prints."""
    repo = Path(__file__).parent.parent.parent
    good = json.loads(cli("check-config", str(repo / "systemd" / "example.toml"), "--json").stdout)
    assert (good["ok"], good["hosts"]) == (True, 2)
    bad_file = repo / "tests" / "configs" / "durations.toml"
    text = cli("check-config", str(bad_file))
    as_json = cli("check-config", str(bad_file), "--json")
    assert as_json.returncode == 2
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and report["problems"]
    lines = [f"{p['file']}: {p['key']}: {p['reason']}" for p in report["problems"]]
    printed = [line for line in text.stderr.splitlines() if not line.startswith("warning: ")]
    assert lines == printed[:-1]  # the last line is the count


async def test_cleanup_refusals_and_success(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """cleanup refuses outside the prefix (also through a symlink), while a daemon runs
    and while a worker lives; then, with --yes, deletes exactly the run root."""
    config = fleet_config(openssh, tmp_path)
    root = tmp_path / "runs" / "run-1"
    daemon = await daemons.start(config)
    await daemon.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    running = await acli("cleanup", "-c", str(config), "--yes")
    assert running.returncode == 1
    assert "daemon" in running.stderr
    text = config.read_text().replace('on_exit = "stop"', "")
    config.write_text(text.replace("[run]", '[run]\non_exit = "detach"', 1))
    await acli("reload", "-c", str(config))
    await acli("stop", "-c", str(config))
    assert await daemon.wait_exit() == 0
    pids = [int(p.read_text()) for p in (root / "ctl").glob("*.pid")]
    assert pids and all(pid_alive(pid) for pid in pids)  # detached: workers live on
    alive = await acli("cleanup", "-c", str(config), "--yes")
    assert alive.returncode == 1
    assert "may be alive" in alive.stderr
    for pid in pids:
        kill_quietly(pid)

    await poll_until(lambda: not [pid for pid in pids if pid_alive(pid)], 30, "workers dead")
    # Status files must look old before cleanup believes nobody writes them.
    for status in (root / "status").glob("*.json"):
        os.utime(status, (0, 0))
    no_yes = await acli("cleanup", "-c", str(config))
    assert no_yes.returncode == 1
    assert "--yes" in no_yes.stderr
    assert root.exists()
    no_yes_json = await acli("cleanup", "-c", str(config), "--json")
    assert no_yes_json.returncode == 1
    assert "--yes" in json.loads(no_yes_json.stdout)["refused"]

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    link = tmp_path / "runs" / "link"
    link.symlink_to(outside)
    escaped = config.read_text().replace(f'root = "{root}"', f'root = "{link}"')
    escaped_config = tmp_path / "escaped.toml"
    escaped_config.write_text(escaped)
    refused = await acli("cleanup", "-c", str(escaped_config), "--yes")
    assert refused.returncode == 1
    assert "not inside run.cleanup_prefix" in refused.stderr
    assert outside.exists()

    done = await acli("cleanup", "-c", str(config), "--yes", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert report["messages"][-1].startswith(f"removed {root}")
    assert not root.exists()
    assert (tmp_path / "runs").exists() and outside.exists()


def test_import_seed_writes_a_valid_config(tmp_path: Path) -> None:
    """A seed run's launch_meta.json and environment become a config that validates."""
    root = tmp_path / "reward" / "gsm8k" / "t1" / "run-7"
    (root / "ctl").mkdir(parents=True)
    meta = {
        "root": str(root),
        "run_id": "run-7",
        "workers": [
            {"host": "worker-0", "shard": 0, "concurrency": 48},
            {"host": "worker-1", "shard": 1, "concurrency": 32},
        ],
        "shard_count": 2,
        "reward_fn": "areal.reward.gsm8k.gsm8k_reward_fn",
        "respawn": True,
    }
    (root / "ctl" / "launch_meta.json").write_text(json.dumps(meta))
    (root / "manifest.json").write_text(
        json.dumps({"experiment_name": "gsm8k", "trial_name": "t1"})
    )
    env = {
        **os.environ,
        "SAO_REWARD_WORKER_HOSTS": "worker-0 worker-1",
        "SAO_WS": "/ws",
        "REWARD_ROOT": str(tmp_path / "reward"),
    }
    out = tmp_path / "imported.toml"
    result = cli("import-seed", "--root", str(root), "-o", str(out), env=env)
    assert result.returncode == 0, result.stderr
    check = cli("check-config", str(out))
    assert check.returncode == 0, check.stderr
    from supervisor.config import load

    cfg = load(out)
    assert [(h.name, h.shard, h.concurrency) for h in cfg.hosts] == [
        ("worker-0", 0, 48),
        ("worker-1", 1, 32),
    ]
    assert cfg.run.allow_hosts == ("worker-0", "worker-1")
    assert cfg.run.experiment == "gsm8k"
    assert cfg.worker.python == "/ws/tmp/runtime-venv/bin/python"
    assert cfg.run.pointer_file == Path("/ws/tmp/sao-reward-current.json")
    assert cfg.health.auto_restart is True


def test_preflight_exit_codes_json_and_table(openssh: OpenSsh, tmp_path: Path) -> None:
    """preflight: a host that refuses our user makes it exit 1, naming that host and check on
    stderr and in the JSON; with the host fixed it prints the table and exits 0."""
    raw = openssh.config_dict(tmp_path / "run", 2)
    raw["hosts"][1]["username"] = "rs-no-such-user"
    bad = cli("preflight", "-c", str(write_config(tmp_path / "bad.toml", raw)), "--json")
    assert bad.returncode == 1, bad.stderr
    assert bad.stderr.strip().endswith("preflight failed: worker-1: ssh")
    report = json.loads(bad.stdout)
    assert [(f["host"], f["check"], f["code"]) for f in report["failures"]] == [
        ("worker-1", "ssh", "login")
    ]
    assert report["hosts"]["worker-0"]["ok"] is True
    del raw["hosts"][1]["username"]
    good = cli("preflight", "-c", str(write_config(tmp_path / "good.toml", raw)))
    assert good.returncode == 0, good.stdout + good.stderr
    lines = good.stdout.splitlines()
    assert lines[0].split()[:4] == ["HOST", "ADDRESS", "SSH", "PYTHON"]
    assert lines[-1].startswith("preflight: all 2 hosts ok")
    assert good.stderr == ""


def test_check_config_takes_c_and_warns_about_missing_ssh_files(tmp_path: Path) -> None:
    """check-config -c FILE (and $REWARD_SUPERVISOR_CONFIG) work like the positional form; a
    known_hosts that does not exist is a warning on stderr, and the config is still ok."""
    repo = Path(__file__).parent.parent.parent
    example = repo / "systemd" / "example.toml"
    by_option = cli("check-config", "-c", str(example))
    by_env = cli("check-config", env={**os.environ, "REWARD_SUPERVISOR_CONFIG": str(example)})
    positional = cli("check-config", str(example))
    assert by_option.returncode == by_env.returncode == positional.returncode == 0
    assert by_option.stdout == by_env.stdout == positional.stdout
    assert "warning: " in by_option.stderr and "ssh.known_hosts" in by_option.stderr
    as_json = json.loads(cli("check-config", "-c", str(example), "--json").stdout)
    assert as_json["ok"] is True
    assert "ssh.known_hosts" in [w["key"] for w in as_json["warnings"]]
    assert "Traceback" not in cli("run", "-c", str(example), "--log-level", "bogus").stderr
