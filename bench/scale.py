"""Scale: one daemon supervising a simulated fleet of 100 to 1000 hosts on this machine.

For each fleet size and watch mode (``bench/fleetsim.py`` says what is simulated):

- connect-and-adopt: ``reward-supervisor run`` spawned -> every host ``ready`` (adopted: the
  probe found the running worker, its heartbeat advanced);
- steady state: the daemon's CPU (utime+stime from /proc, % of one core) and RSS over a
  window while every host heartbeats once a second;
- status write -> state change:
  - exit records: the simulator SIGKILLs a worker and writes its exit record (as the
    shepherd does); measured from the rename to the ``host.state`` line (ready -> stale), and
    to ``host.launch_begin`` (the launch request leaves for the host);
  - first heartbeat: the replacement's first status write -> ``host.state`` starting -> ready;
  - stale detection: the simulator stops one host's heartbeats; measured from its last
    status write + ``heartbeat_stale_s`` to the ``host.state`` ready -> stale line.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    SCRATCH,
    CpuWindow,
    cpu_seconds,
    iso_to_epoch,
    measure_cpu,
    percentile,
    thread_count,
)
from bench.procs import LogIndex, SimProcess, spawn_module, stop_daemon
from supervisor import config as configuration
from supervisor.config import load as load_config
from tests.sshd import OpenSsh
from tests.system.daemonproc import DaemonProcess

#: heartbeat_stale_s of the simulated fleet's daemon.
STALE_S = 5.0
#: After adoption, rescans and the first keepalives settle before CPU is measured.
SETTLE_S = 10.0


@dataclass
class ScaleResult:
    """One fleet size in one watch mode."""

    hosts: int
    mode: str
    agents: str
    adopt_s: float = float("nan")
    daemon_ready_s: float = float("nan")
    adopt_cpu_s: float = float("nan")
    cpu: CpuWindow | None = None
    threads: int = 0
    exit_to_state: list[float] = field(default_factory=list)
    exit_to_launch: list[float] = field(default_factory=list)
    #: From the SIGKILL (the crash itself), as an agent's push can see it before any record.
    crash_to_state: list[float] = field(default_factory=list)
    crash_to_launch: list[float] = field(default_factory=list)
    beat_to_ready: list[float] = field(default_factory=list)
    stale_error: list[float] = field(default_factory=list)
    writer_late_p99_ms: float = float("nan")
    writes_per_s: float = float("nan")
    #: bench/floor.py's parts on the same fleet: "watch" (watching alone), "read" (and
    #: reading each changed heartbeat), "core" (and stepping each through the state
    #: machine), "ssh" (its connections, idle): the least they cost.
    floor: dict[str, CpuWindow] = field(default_factory=dict)
    sim_cpu_pct: float = float("nan")
    log_lines_in_window: int = 0
    errors: list[str] = field(default_factory=list)
    profile: str | None = None

    @property
    def cpu_us_per_write(self) -> float:
        """Daemon CPU per heartbeat written by the simulator, in microseconds."""
        if self.cpu is None or not self.writes_per_s:
            return float("nan")
        return 1e6 * self.cpu.cpu_s / self.cpu.seconds / self.writes_per_s

    def p(self, samples: list[float], q: float) -> float:
        """Percentile helper for the report."""
        return percentile(samples, q)


async def run_scale(
    hosts: int,
    mode: str,
    *,
    agents: str = "inproc",
    window_s: float = 30.0,
    exit_samples: int = 40,
    stale_samples: int = 5,
    profile_dir: Path | None = None,
    log_dir: Path | None = None,
    floor_parts: tuple[str, ...] = ("watch", "read"),
) -> ScaleResult:
    """Measure one fleet size in one watch mode, then the floor's ``floor_parts``
    (``bench/floor.py``) on the same fleet."""
    result = ScaleResult(hosts=hosts, mode=mode, agents=agents)
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-scale-{hosts}-{mode}-", dir=SCRATCH))
    sim = SimProcess(workdir, hosts, agents=agents, watch=mode, stale_s=STALE_S)
    daemon: DaemonProcess | None = None
    try:
        ready = await sim.start()
        daemon = DaemonProcess(Path(ready["config"]), workdir)
        logs = LogIndex(daemon)
        spawned = time.time()
        await daemon.start()
        assert daemon.process is not None
        pid = daemon.process.pid
        names = [f"sim-{i:04d}" for i in range(hosts)]
        result.adopt_s = await _wait_all_ready(daemon, logs, names, timeout_s=900) - spawned
        result.adopt_cpu_s = cpu_seconds(pid)
        hit = logs.find("daemon.ready")
        if hit is not None:
            result.daemon_ready_s = hit[0] - spawned
        await asyncio.sleep(SETTLE_S)  # wait-ok: let start-up work drain before measuring
        if profile_dir is not None:
            result.profile = await _profile(pid, profile_dir / f"daemon-{hosts}-{mode}.txt", 20)
        before = await _sim_stats(sim)
        sim_cpu0 = cpu_seconds(sim.pid)
        lines0 = len(daemon.lines)
        result.cpu = await measure_cpu(pid, window_s)
        result.log_lines_in_window = len(daemon.lines) - lines0
        result.sim_cpu_pct = 100 * (cpu_seconds(sim.pid) - sim_cpu0) / result.cpu.seconds
        after = await _sim_stats(sim)
        result.writes_per_s = (after["writes"] - before["writes"]) / result.cpu.seconds
        result.threads = thread_count(pid)
        result.writer_late_p99_ms = float(after["late_p99_ms"])
        # Exit records on distinct hosts, spread over the fleet; then silences on others.
        step = max(1, hosts // (exit_samples + stale_samples + 1))
        victims = names[::step][: exit_samples + stale_samples]
        await _exit_samples(sim, logs, victims[:exit_samples], result)
        await _stale_samples(sim, logs, victims[exit_samples:], result)
        # The daemon leaves its workers running when it stops (on_exit = "detach"), so the
        # same heartbeats go on for the floor, which then has the machine to itself.
        await stop_daemon(daemon)
        if log_dir is not None:
            _save_log(daemon, log_dir / f"daemon-{hosts}-{mode}.jsonl")
        daemon = None
        for part in floor_parts:
            if part == "ssh":
                # Each connection's keepalive comes once per interval: a whole interval, so
                # that connections made early and late weigh the same.
                cfg = load_config(ready["config"])
                spread = getattr(configuration, "fleet_ssh", None)
                ssh = cfg.ssh if spread is None else spread(cfg.ssh, len(cfg.hosts))
                keepalive_s = ssh.keepalive_interval_s
                seconds = max(window_s, keepalive_s)
                result.floor[part] = await run_floor(part, seconds, config=ready["config"])
            else:
                # As long as the daemon's window: the poll floor is under a second of CPU
                # in 20 s, and half the window left it counted in a few 10 ms clock ticks.
                root = workdir / "run"
                result.floor[part] = await run_floor(part, window_s, mode=mode, root=root)
    except (TimeoutError, AssertionError, RuntimeError) as exc:
        result.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        if daemon is not None:
            await stop_daemon(daemon)
            if log_dir is not None:
                _save_log(daemon, log_dir / f"daemon-{hosts}-{mode}.jsonl")
        await sim.aclose()
        _remove(workdir)
    return result


async def run_floor(
    part: str, window_s: float, *, mode: str = "", root: Path | None = None, config: str = ""
) -> CpuWindow:
    """``bench/floor.py`` doing ``part`` for ``window_s`` once it is ready: its CPU and RSS."""
    args = ["--part", part]
    args += ["--config", config] if part == "ssh" else ["--mode", mode, "--root", str(root)]
    proc = await spawn_module("bench.floor", args)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(600):  # a thousand handshakes on two cores
            line = await proc.stdout.readline()
        if b'"ready"' not in line:
            raise RuntimeError(f"bench.floor --part {part} did not start: {line[:200]!r}")
        # Settled: the first listing or batch read every file, the handshakes are over.
        await asyncio.sleep(2.0)  # wait-ok: let start-up work drain before measuring
        return await measure_cpu(proc.pid, window_s)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # its end of the run
        try:
            async with asyncio.timeout(60):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


def _save_log(daemon: DaemonProcess, path: Path) -> None:
    """Write the daemon's log lines to ``path``, one JSON object a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for line in daemon.lines:
            f.write(json.dumps(line) + "\n")


async def _sim_stats(sim: SimProcess) -> dict[str, Any]:
    """The simulator's counters now."""
    seen = len(sim.events)
    await sim.send(cmd="stats")
    return await sim.wait_event(
        lambda e: e["event"] == "stats" and sim.events.index(e) >= seen, 30, "stats"
    )


async def _wait_all_ready(
    daemon: DaemonProcess,
    logs: LogIndex,
    names: list[str],
    timeout_s: float,
    *,
    adopted: bool = True,
) -> float:
    """Until every host is ready and (``adopted``) its probe found the running worker; the
    wall time of the last of those log lines."""
    want = set(names)
    ready: set[str] = set()
    probed: set[str] = set()
    last = [0.0]

    def note(line: dict[str, Any], into: set[str]) -> None:
        """Count ``line``'s host into ``into`` and keep the latest stamp."""
        host = str(line.get("host"))
        if host in want and host not in into:
            into.add(host)
            last[0] = max(last[0], iso_to_epoch(line["timestamp"]))

    def done() -> bool:
        """Whether every host is ready (and adopted)."""
        logs.update()
        for line in logs.by_event.get("host.state", []):
            if line.get("to") == "ready":
                note(line, ready)
        for line in logs.by_event.get("host.probe", []):
            if line.get("found_pid") is not None:
                note(line, probed)
        return ready >= want and (probed >= want or not adopted)

    await daemon.wait_until(done, timeout_s, f"all {len(names)} hosts probed and ready")
    return last[0]


async def _exit_samples(
    sim: SimProcess, logs: LogIndex, victims: list[str], result: ScaleResult
) -> None:
    """Exit records on ``victims``, one at a time: exit -> state, exit -> launch, first beat ->
    ready."""
    written: dict[str, float] = {}
    for host in victims:
        await sim.send(cmd="exit", host=host)
        event = await sim.wait_host_event("exit_written", host, 30)
        written[host] = float(event["t"])
        killed = float(event.get("killed") or event["t"])
        t_state, _ = await logs.wait("host.state", 30, host=host, to="stale")
        result.exit_to_state.append(t_state - written[host])
        result.crash_to_state.append(t_state - killed)
        t_launch, _ = await logs.wait("host.launch_begin", 30, host=host)
        result.exit_to_launch.append(t_launch - written[host])
        result.crash_to_launch.append(t_launch - killed)
        # One at a time, apart by a random gap: each sample sees an otherwise steady daemon,
        # and no sample is phase-locked to the poller's period (which would fake a constant
        # latency in poll mode).
        await asyncio.sleep(random.uniform(0.2, 1.2))  # wait-ok: spacing between samples
    for host in victims:
        beat = await sim.wait_host_event("first_beat", host, 120)
        t_ready, _ = await logs.wait("host.state", 60, after=written[host], host=host, to="ready")
        result.beat_to_ready.append(t_ready - float(beat["t"]))


async def _stale_samples(
    sim: SimProcess, logs: LogIndex, victims: list[str], result: ScaleResult
) -> None:
    """Silence ``victims``' heartbeats: how long after last beat + stale time each went stale."""
    silenced: dict[str, float] = {}
    for host in victims:
        await sim.send(cmd="silence", host=host)
        event = await sim.wait_host_event("silenced", host, 30)
        silenced[host] = float(event["last_beat"])
        # Apart in time, so they never look like a fleet-wide silence.
        await asyncio.sleep(random.uniform(0.5, 1.5))  # wait-ok: spacing between samples
    for host, last_beat in silenced.items():
        t_state, _ = await logs.wait("host.state", 60, host=host, to="stale")
        result.stale_error.append(t_state - (last_beat + STALE_S))


async def _profile(pid: int, out: Path, seconds: int) -> str | None:
    """A py-spy profile of the daemon (if py-spy is installed), top functions by own time."""
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.exists():
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        str(exe),
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(seconds),
        "--format",
        "raw",
        "--output",
        str(out),
        "--gil",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await proc.wait()
    return str(out) if await asyncio.to_thread(out.exists) else None


@dataclass(frozen=True)
class IdleResult:
    """The daemon's CPU with a small, quiet fleet."""

    hosts: int
    cpu: CpuWindow


async def run_idle(openssh_dir: Path, hosts: int, window_s: float) -> IdleResult:
    """The daemon's CPU over ``window_s`` supervising ``hosts`` reference workers (1 s beats)
    on the real OpenSSH server: what an idle fleet costs."""
    from bench.ops import clean_home, ours_config, start_daemon_process  # import cycle

    sshd = OpenSsh.create(openssh_dir)
    clean_home(sshd)
    workdir = Path(tempfile.mkdtemp(prefix="bench-idle-", dir=SCRATCH))
    daemon: DaemonProcess | None = None
    try:
        config = ours_config(sshd, workdir, hosts, heartbeat_interval_s=1.0)
        daemon = await start_daemon_process(config, workdir)
        logs = LogIndex(daemon)
        names = [f"worker-{i}" for i in range(hosts)]
        await _wait_all_ready(daemon, logs, names, timeout_s=120, adopted=False)
        await asyncio.sleep(SETTLE_S)  # wait-ok: let start-up work drain before measuring
        assert daemon.process is not None
        return IdleResult(hosts=hosts, cpu=await measure_cpu(daemon.process.pid, window_s))
    finally:
        if daemon is not None:
            await stop_daemon(daemon)
        sshd.stop()
        _remove(workdir)


def _remove(path: Path) -> None:
    """Remove a work directory, whatever is left in it."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
