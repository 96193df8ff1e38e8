"""Operations side by side: our daemon, the old way and the physical floor, in one run,
against one real OpenSSH sshd on loopback (``tests/sshd.py``).

Every time is measured by the same observer (``common.StatusWatch``: a stat of each status
file every 5 ms, 10 ms for 50 hosts, read on change), from the moment the bench acts (a
signal sent, a command issued) to the moment the files show the outcome:

- crash: SIGKILL the worker -> a new pid's ready heartbeat on disk;
- hang: SIGSTOP the worker -> a new pid's ready heartbeat, minus (the hung worker's last
  heartbeat + heartbeat_stale_s): what remains after the configured stale time;
- restart-host: the operator's command -> a new pid's ready heartbeat;
- start 50: the command (ours: ``reward-supervisor run`` spawned) -> all 50 ready;
- stop 50: the command (ours: ``stop`` on the control socket) -> all 50 pids gone;
- kill 50: SIGKILL all 50 workers at once -> 50 new pids ready.

Floors: one ``conn.run('true')`` on an open asyncssh connection (what any remote action
costs before it does anything) plus what the workers themselves take, started and stopped
locally without SSH (one, and 50 at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    SCRATCH,
    StatusWatch,
    cpu_seconds,
    iso_to_epoch,
    machine_busy_s,
    pid_alive,
    raw_connection,
)
from bench.oldway import OldHost, OldWay
from bench.procs import LogIndex, stop_daemon
from supervisor import control
from supervisor.demo.worker import argv_template
from tests.sshd import OpenSsh
from tests.system.daemonproc import DaemonProcess, write_config

#: heartbeat_stale_s for both sides of the hang measurement (the smallest the config takes).
STALE_S = 3.0
#: Our daemon forgets past failures after this long ready, so every crash sample is a
#: "first failure" (immediate restart), as for the old way's wrapper.
BACKOFF_RESET_S = 1.0
FLEET = 50
WAIT_S = 300.0


def _poll_s(hosts: int) -> float:
    """The observer's sampling period for ``hosts`` status files."""
    return 0.005 if hosts == 1 else 0.01


@dataclass
class OpsResults:
    """Samples (seconds) per row, for ours, the old way and the floor's parts."""

    ours: dict[str, list[float]] = field(default_factory=dict)
    old: dict[str, list[float]] = field(default_factory=dict)
    floor: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, side: dict[str, list[float]], name: str, value: float) -> None:
        """Append one sample of ``name`` to ``side``."""
        side.setdefault(name, []).append(value)


# --- our daemon ---------------------------------------------------------------------------


def ours_config(
    sshd: OpenSsh,
    workdir: Path,
    hosts: int,
    *,
    heartbeat_interval_s: float = 1.0,
    root_name: str = "run",
) -> Path:
    """A config for ``hosts`` reference workers (beating every ``heartbeat_interval_s``) on
    the sshd: product defaults except the timings a benchmark needs short."""
    raw = sshd.config_dict(
        workdir / root_name,
        hosts,
        argv=argv_template(heartbeat_interval_s=heartbeat_interval_s),
        health={
            "heartbeat_stale_s": STALE_S,
            "ready_timeout_s": 60.0,
            "restart_cooldown_s": 0.5,
            "backoff_max_s": 2.0,
            "backoff_reset_s": BACKOFF_RESET_S,
            "stop_grace_s": 10.0,
            "kill_after_grace": True,
        },
        ssh={"keepalive_interval_s": 15.0, "connect_timeout_s": 20.0},
    )
    raw["control"]["socket"] = str(workdir / f"{root_name}.sock")
    return write_config(workdir / f"{root_name}.toml", raw)


async def start_daemon_process(config: Path, workdir: Path) -> DaemonProcess:
    """``reward-supervisor run -c config`` as a child process."""
    daemon = DaemonProcess(config, workdir)
    await daemon.start()
    return daemon


# --- observing ----------------------------------------------------------------------------


async def wait_files(
    watch: StatusWatch, done: Callable[[StatusWatch], bool], what: str, every_s: float
) -> float:
    """Refresh ``watch`` every ``every_s`` until ``done``; the wall time it first held."""
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                watch.refresh()
                if done(watch):
                    return time.time()
                await asyncio.sleep(every_s)  # wait-ok: the observer's sampling period
    except TimeoutError:
        raise TimeoutError(f"timed out after {WAIT_S:g}s waiting for {what}") from None


def new_ready(old: dict[Path, int | None]) -> Callable[[StatusWatch], bool]:
    """Every file shows a ready pid other than the one it had."""
    return lambda w: all(
        (pid := w.ready_pid(path)) is not None and pid != before for path, before in old.items()
    )


def any_ready(w: StatusWatch) -> bool:
    """Every file shows some ready pid."""
    return all(w.ready_pid(path) is not None for path in w.paths)


def ready_pids(w: StatusWatch) -> dict[Path, int | None]:
    """Each file's ready pid now."""
    w.refresh()
    return {path: w.ready_pid(path) for path in w.paths}


async def wait_gone(pids: list[int], every_s: float) -> float:
    """Until no pid of ``pids`` is alive (zombies count as gone); the wall time."""
    try:
        async with asyncio.timeout(WAIT_S):
            # A pid's death has no event to wait on: the observer samples /proc (ASYNC110).
            while any(pid_alive(p) for p in pids):  # noqa: ASYNC110
                await asyncio.sleep(every_s)  # wait-ok: the observer's sampling period
    except TimeoutError:
        raise TimeoutError(f"pids {pids} still alive after {WAIT_S:g}s") from None
    return time.time()


# --- floors -------------------------------------------------------------------------------


async def floors(sshd: OpenSsh, workdir: Path, runs: int, fleet_runs: int) -> OpsResults:
    """conn.run('true') round trips, and the reference worker started and stopped locally."""
    result = OpsResults()
    conn = await raw_connection(sshd)
    async with conn:
        for _ in range(max(runs, 10)):
            start = time.perf_counter()
            await conn.run("true", check=True)
            result.add(result.floor, "conn.run('true')", time.perf_counter() - start)
    root = workdir / "floor"
    (root / "status").mkdir(parents=True, exist_ok=True)
    for _ in range(runs):
        start_s, stop_s, _busy = await _local_workers(root, 1)
        result.add(result.floor, "worker start", start_s)
        result.add(result.floor, "worker stop", stop_s)
    for _ in range(fleet_runs):
        start_s, stop_s, busy = await _local_workers(root, FLEET)
        result.add(result.floor, f"{FLEET} workers start", start_s)
        result.add(result.floor, f"{FLEET} workers start: machine CPU, all processes", busy)
        result.add(result.floor, f"{FLEET} workers stop", stop_s)
    return result


async def _local_workers(root: Path, n: int) -> tuple[float, float, float]:
    """Start ``n`` reference workers at once, no SSH: (until all ready, until all gone
    after SIGTERM, CPU seconds the machine spent until all were ready)."""
    names = [f"floor-{i}" for i in range(n)]
    for name in names:
        (root / "status" / f"{name}.json").unlink(missing_ok=True)
        (root / "inbox" / str(names.index(name))).mkdir(parents=True, exist_ok=True)
    watch = StatusWatch(root / "status" / f"{name}.json" for name in names)
    busy0 = machine_busy_s()
    t0 = time.time()
    procs = [
        await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "supervisor.demo.worker", "--root", str(root)),
            *("--shard", str(i), "--host", name, "--concurrency", "2"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, name in enumerate(names)
    ]
    try:
        ready = await wait_files(watch, any_ready, "local workers ready", _poll_s(n))
        busy = machine_busy_s() - busy0
        t1 = time.time()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        gone = await wait_gone([p.pid for p in procs], 0.002 if n == 1 else 0.01)
        return ready - t0, gone - t1, busy
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


# --- one host: crash, hang, restart-host --------------------------------------------------


async def single_host(sshd: OpenSsh, workdir: Path, runs: int) -> OpsResults:
    """Interleaved samples of crash, hang and restart-host: ours, then the old way."""
    result = OpsResults()
    daemon = await start_daemon_process(ours_config(sshd, workdir, 1), workdir)
    logs = LogIndex(daemon)
    ours_status = StatusWatch([workdir / "run" / "status" / "worker-0.json"])
    old = OldWay(
        sshd, workdir / "old", [OldHost("old-0", 0, sshd.addresses[1])], python=sys.executable
    )
    old.prepare()
    old_status = StatusWatch([old.status("old-0")])
    try:
        await wait_files(ours_status, any_ready, "our worker ready", 0.01)
        await old.start(respawn=True, stale_s=STALE_S)
        for _ in range(runs):
            await _settle(ours_status)
            await _crash(result, result.ours, ours_status, logs)
            await _settle(old_status)
            await _crash(result, result.old, old_status, None)
            await _settle(ours_status)
            await _hang(result.ours, ours_status, lambda: asyncio.sleep(0))
            await _settle(old_status)
            watch = asyncio.create_task(old.watch(stale_s=STALE_S, interval_s=1.0, cooldown_s=0.0))
            try:
                await _hang(result.old, old_status, lambda: asyncio.sleep(0))
            finally:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            _kill_stopped(workdir / "old")
            await _settle(ours_status)
            await _restart(
                result.ours,
                ours_status,
                lambda: control.request(daemon.socket, "restart-host", host="worker-0"),
                logs,
            )
            await _settle(old_status)
            await _restart(result.old, old_status, lambda: old.restart_host(old.hosts[0]))
    finally:
        await stop_daemon(daemon)
        old.kill_everything()
    return result


async def _settle(watch: StatusWatch) -> None:
    """A ready worker, up longer than the backoff reset (every sample is a first failure)."""
    await wait_files(watch, any_ready, "ready before a sample", 0.01)
    await asyncio.sleep(BACKOFF_RESET_S + 0.5)  # wait-ok: backoff must reset between samples


async def _crash(
    result: OpsResults, side: dict[str, list[float]], watch: StatusWatch, logs: LogIndex | None
) -> None:
    """One crash sample: SIGKILL the ready worker, time its ready replacement."""
    before = ready_pids(watch)
    pid = next(iter(before.values()))
    assert pid is not None
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    t1 = await wait_files(watch, new_ready(before), "replacement after a crash", 0.005)
    side.setdefault("crash", []).append(t1 - t0)
    if logs is not None:
        hit = await logs.wait("host.launch_begin", 30, after=t0)
        result.add(result.ours, "crash -> launch issued", hit[0] - t0)
        exit_record = watch.paths[0].parent.parent / "ctl" / "worker-0.exit.json"
        with contextlib.suppress(OSError):
            written = exit_record.stat().st_mtime
            if written >= t0:
                result.add(result.ours, "crash -> exit record", written - t0)
                result.add(result.ours, "exit record -> launch issued", hit[0] - written)


async def _hang(
    side: dict[str, list[float]], watch: StatusWatch, during: Callable[[], Any]
) -> None:
    """One hang sample: SIGSTOP the ready worker, time its ready replacement past the stale time."""
    before = ready_pids(watch)
    pid = next(iter(before.values()))
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    status = json.loads(watch.paths[0].read_bytes())  # the worker is stopped: this is final
    last_beat = float(status["heartbeat_at"])
    await during()
    t1 = await wait_files(watch, new_ready(before), "replacement after a hang", 0.005)
    side.setdefault("hang - stale time", []).append(t1 - (last_beat + STALE_S))


async def _restart(
    side: dict[str, list[float]],
    watch: StatusWatch,
    command: Callable[[], Any],
    logs: LogIndex | None = None,
) -> None:
    """One restart-host sample: run ``command``, time the new pid's ready heartbeat."""
    before = ready_pids(watch)
    t0 = time.time()
    await command()
    t1 = await wait_files(watch, new_ready(before), "replacement after restart-host", 0.005)
    side.setdefault("restart-host", []).append(t1 - t0)
    if logs is not None:
        # Where the time went, by the daemon's own clock: each remote call as it saw it.
        for event, name in (
            ("host.terminated", "restart: terminate call (TERM -> confirmed dead)"),
            ("host.launched", "restart: launch call (shepherd + worker forked)"),
        ):
            hit = await logs.wait(event, 30, after=t0)
            side.setdefault(name, []).append(float(hit[1]["elapsed_ms"]) / 1000)


def _kill_stopped(root: Path) -> None:
    """The old way leaves a SIGSTOPped worker behind (its TERM stays pending): kill it."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(root).encode() in args and state == "T":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)


# --- 50 hosts: start, kill all, stop --------------------------------------------------------


async def fleet_ours(sshd: OpenSsh, workdir: Path, run: int, result: OpsResults) -> None:
    """Start 50 hosts, kill all 50 workers, stop all 50: our daemon."""
    name = f"fleet{run}"
    config = ours_config(sshd, workdir, FLEET, root_name=name)
    watch = StatusWatch(workdir / name / "status" / f"worker-{i}.json" for i in range(FLEET))
    busy0 = machine_busy_s()
    spawned = time.time()
    daemon = await start_daemon_process(config, workdir)
    try:
        t1 = await wait_files(watch, any_ready, "50 ready", _poll_s(FLEET))
        result.add(result.ours, f"start {FLEET}", t1 - spawned)
        assert daemon.process is not None
        result.add(result.ours, f"start {FLEET}: daemon CPU", cpu_seconds(daemon.process.pid))
        result.add(
            result.ours, f"start {FLEET}: machine CPU, all processes", machine_busy_s() - busy0
        )
        await asyncio.sleep(BACKOFF_RESET_S + 0.5)  # wait-ok: backoff must reset first
        before = ready_pids(watch)
        t0 = time.time()
        for pid in before.values():
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        t1 = await wait_files(watch, new_ready(before), "50 replaced", _poll_s(FLEET))
        result.add(result.ours, f"kill {FLEET}", t1 - t0)
        pids = [p for p in ready_pids(watch).values() if p is not None]
        t0 = time.time()
        await control.request(daemon.socket, "stop")
        t1 = await wait_gone(pids, _poll_s(FLEET))
        result.add(result.ours, f"stop {FLEET}", t1 - t0)
        await daemon.wait_exit(120)
        _start_phases(LogIndex(daemon), spawned, result)
    finally:
        await stop_daemon(daemon)


def _start_phases(logs: LogIndex, spawned: float, result: OpsResults) -> None:
    """Where the start of the fleet went, by the daemon's own log: the last host's SSH
    connection, the last launch answered, READY=1 (all hosts settled)."""
    logs.update()
    for event, name in (
        ("ssh.connected", "all SSH connections up"),
        ("host.launched", "all launches answered"),
    ):
        stamps = [iso_to_epoch(line["timestamp"]) for line in logs.by_event.get(event, [])]
        first_round = sorted(stamps)[:FLEET]  # kill 50 launches again later: only the start's
        if len(first_round) == FLEET:
            result.add(result.ours, f"start {FLEET}: {name}", max(first_round) - spawned)
    hit = logs.find("daemon.ready")
    if hit is not None:
        result.add(result.ours, f"start {FLEET}: READY=1", hit[0] - spawned)


async def fleet_old(sshd: OpenSsh, workdir: Path, run: int, result: OpsResults) -> None:
    """The same three with the seed's mechanisms."""
    hosts = [OldHost(f"old-{i}", i, sshd.addresses[i % len(sshd.addresses)]) for i in range(FLEET)]
    old = OldWay(sshd, workdir / f"oldfleet{run}", hosts, python=sys.executable)
    old.prepare()
    watch = StatusWatch(old.status(h.name) for h in hosts)
    try:
        t0 = time.time()
        await old.start(respawn=False, stale_s=STALE_S)
        result.add(result.old, f"start {FLEET}", time.time() - t0)
        pids = [p for p in ready_pids(watch).values() if p is not None]
        t0 = time.time()
        await old.stop()
        t1 = await wait_gone(pids, _poll_s(FLEET))
        result.add(result.old, f"stop {FLEET}", max(time.time(), t1) - t0)
        # kill 50 needs the respawn wrappers: set them up (unmeasured, 8 at a time).
        for h in hosts:
            old.stop_sentinel(h.name).unlink(missing_ok=True)
        gate = asyncio.Semaphore(8)

        async def wrap(host: OldHost) -> None:
            """The seed's respawn start script on ``host``, 8 hosts at a time."""
            async with gate:
                await old.ssh(host, old.start_script(host, respawn=True))

        await asyncio.gather(*(wrap(h) for h in hosts))
        await wait_files(watch, any_ready, "50 wrapped workers ready", _poll_s(FLEET))
        await asyncio.sleep(3.0)  # wait-ok: let the seed's start scripts' pid kills settle
        await wait_files(watch, any_ready, "50 wrapped workers ready", _poll_s(FLEET))
        before = ready_pids(watch)
        t0 = time.time()
        for path, pid in before.items():
            assert pid is not None, path
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        t1 = await wait_files(watch, new_ready(before), "50 respawned", _poll_s(FLEET))
        result.add(result.old, f"kill {FLEET}", t1 - t0)
    finally:
        old.kill_everything()


def clean_home(sshd: OpenSsh) -> Path:
    """Give every session an empty ``$HOME`` (sshd's ``SetEnv`` overrides it), as a service
    account with no rc files has; restarts the server. The empty home, for the report."""
    home = sshd.workdir / "clean-home"
    home.mkdir(exist_ok=True)
    sshd.stop()
    with sshd.config_path.open("a", encoding="utf-8") as f:
        f.write(f"SetEnv HOME={home}\n")
    sshd.start()
    return home


async def bench_ops(
    sshd_dir: Path, runs: int, fleet_runs: int, *, rc_files: bool = False
) -> OpsResults:
    """Everything in this module, against one sshd started for the run; with ``rc_files``
    sessions run the login user's own rc files (here root's, which run ``pyenv init``),
    else an empty home's (none)."""
    sshd = OpenSsh.create(sshd_dir)
    if not rc_files:
        clean_home(sshd)
    workdir = Path(tempfile.mkdtemp(prefix="bench-ops-", dir=SCRATCH))
    result = OpsResults()
    try:
        floor = await floors(sshd, workdir, runs, fleet_runs)
        result.floor = floor.floor
        single = await single_host(sshd, workdir, runs)
        result.ours.update(single.ours)
        result.old.update(single.old)
        for run in range(fleet_runs):
            await fleet_ours(sshd, workdir, run, result)
            await fleet_old(sshd, workdir, run, result)
    finally:
        sshd.stop()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return result
