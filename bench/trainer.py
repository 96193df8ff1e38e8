"""What the trainer sees: the real AReaL client against a fleet of real AReaL workers, under
reward-supervisor and under the old script, through the same faults, side by side.

    .venv/bin/python -m bench.trainer [--faults kill9,sigstop,...] [--window 60] [--fault-at 5]
                                      [--only ours|old] [--hosts 4] [--concurrency 4]
                                      [--loops 16] [--quick] [--trainer-table]
                                      [--restart-stop kill|drain] [--out FILE]
    .venv/bin/python -m bench.trainer --probes-ab [--faults none] [--rounds 3]
                                      [--probe-interval 1]

One OpenSSH sshd on loopback serves every "host". Each host runs the real worker
(``python -m areal.reward.fs_worker``, from ``../shared/areal-fs`` or
``$REWARD_SUPERVISOR_AREAL``) with ``--concurrency`` pool processes, scoring
``tests.rewardfns.hang_if_marker`` (20-50 ms per task; hangs while a per-host marker exists).

- **ours**: ``reward-supervisor run`` with its shipped defaults: the config names only the run
  root, ssh, hosts, ``worker.python``/``worker.env`` and the control socket (no ``[health]``;
  metrics off). ``--trainer-table`` adds ``[trainer] heartbeat_stale_s = 15, task_timeout_s =
  30`` (the client's tolerances) for a daemon that knows that table; ``--restart-stop drain``
  sets ``[health] restart_stop = "drain"`` (the other side of the planned-restart trade).
- **old**: ``reward_workers_ctl.py`` (``../shared/seed`` or ``$REWARD_SUPERVISOR_SEED``) with
  ``selfmatch-fix.patch``, in a workspace whose ``repo/AReaL`` is the real areal package: ``start``
  then ``watch`` with its defaults (heartbeat-stale 60 s, interval 10 s, restart-cooldown 30 s),
  its workers under its bash respawn loop.

- **ours+probes** (``--probes-ab``, which runs it beside ``ours`` instead of ``old``): ours with
  a ``[probe]`` table: the trainer's own call (``hang_if_marker``, answer 18, ``expect = 1``)
  through every shard's queue every ``--probe-interval`` seconds (1 s: thirty times the
  default rate, to make any disturbance show), ``timeout_s = 20``. ``--rounds N`` repeats the
  pair, alternating, so drift of the machine falls on both.

For each fault and supervisor a fresh fleet starts; the trainer load (``tests.areal.TrainerLoad``:
16 rollout loops on the real ``FSRewardClient`` with its defaults) warms up until every shard has
served calls, then the window starts; the fault comes ``--fault-at`` seconds in, on host 1 (shard
1) unless it is fleet-wide; at the end of the window the lingering processes are counted, then
the fleet is stopped and everything it left is killed. Faults:

- ``kill9``: SIGKILL of host 1's worker coordinator;
- ``sigstop``: SIGSTOP of it (a hung worker: no heartbeat, alive);
- ``stuck``: every pool slot of host 1 stuck in a reward call (its marker file is created and
  stays): only tasks routed to shard 1 hang, the heartbeat goes on;
- ``pool_death``: SIGKILL of one pool process of host 1 that is inside a reward call;
- ``restart_host``: ours ``reward-supervisor restart-host -c CFG HOST``; old ``restart-host``;
- ``stop_start``: ours ``stop-host`` then, once the host is stopped, ``start-host`` (a host
  taken out for maintenance and given back); the old script has no per-host stop (n/a);
- ``host_lost``: host 1's machine dies: its sshd stops answering and every process of its
  worker (shepherd, coordinator, pool; the old script's respawn loop) is SIGKILLed. Ours runs
  with one ``[[spares]]`` machine and host 1 on an sshd of its own (127.0.0.9), so only its
  connection goes; the old script's ssh to host 1 is pointed at a closed port;
- ``drain``: ours ``reward-supervisor drain -c CFG HOST`` with one ``[[spares]]`` machine:
  host 1's shard moves to the spare (maintenance); the old script has no such thing (n/a);
- ``zero_host``: host 1's machine scores every reward 0 (its verifier dependency gone: the
  calls "succeed" with 0.0; ``tests.rewardfns.zero_if_marker`` while a marker named after the
  machine's address, or the old script's host, exists); ours has one ``[[spares]]`` machine
  (on another address: it scores right) and its shipped ``[rewards]`` defaults; healthy calls
  all score 1, so every call that scores 0 is one the host lied on;
- ``none``: nothing is done (the healthy window, for ``--probes-ab``);
- ``reload_worker``: every host gets a new worker: ours changes ``worker.env`` in the config
  and runs ``reward-supervisor reload``; the old script has no reload, so its way is ``stop``
  then ``start`` (and ``watch`` again, which ``stop`` ended).

Reported per fault and supervisor (definitions in ``tests/areal.py``): OK calls, failed calls by
kind, stall (longest and total time with no OK completion for more than 1 s), p50/p99 latency of
OK calls, calls that scored 0, time to recovery (fault to the first OK call on the faulted
shard(s) that started after the fault and after the last failed call; for ``zero_host``, to the
end of the last call on the shard that scored 0, with 20 calls scored right after it), the time
until the faulted host(s) had a new worker ready (run directory), and the processes lingering at
the end of the window. Measurements only.
Writes ``bench/results/trainer-<UTC date-time>.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python bench/trainer.py` from a checkout

from bench.common import SCRATCH, fmt_s, load_average, machine_facts  # noqa: E402
from supervisor.seedimport import render_toml  # noqa: E402
from tests import areal as A  # noqa: E402
from tests.seed import SeedWorld, find_seed, seed_missing_reason  # noqa: E402
from tests.sshd import OpenSsh  # noqa: E402

FAULTS = (
    "kill9",
    "sigstop",
    "stuck",
    "pool_death",
    "restart_host",
    "stop_start",
    "reload_worker",
    "host_lost",
    "drain",
    "zero_host",
    "none",
)
#: Faults the old script has no way to do (it has no per-host stop).
OLD_CANNOT: Final = frozenset({"stop_start", "drain"})
SUPERVISORS = ("ours", "old")
#: ``--probes-ab``: ours without and with ``[probe]``, side by side.
PROBES_AB = ("ours", "ours+probes")
RESULTS = ROOT / "bench" / "results"
#: The fleet is started and ready well within this on 2 cores (4 workers, 16 interpreters).
READY_S = 180.0
#: Warm-up: every shard has served this many calls (its pool processes are spawned lazily,
#: which stalls the first calls for about a second).
WARM_CALLS_PER_SHARD = 20
#: Teardown bounds: the daemon's stop waits for every worker to drain (at most 30 s each).
STOP_S = 150.0
#: The faulted host (and shard) of a single-host fault.
TARGET = 1
#: Sampling periods: /proc for the fleet's processes, status files for new workers.
PROC_SAMPLE_S = 0.5
STATUS_SAMPLE_S = 0.1
#: How long ``pool_death`` looks for a pool process inside a reward call.
BUSY_SEARCH_S = 5.0
#: ``zero_host``: the shard has recovered once this many calls on it scored right after its
#: last zero.
RIGHT_AFTER = 20
#: Short names of the failed-call kinds for the table.
KIND_SHORT = {
    A.HEARTBEAT_STALE: "stale",
    A.NOT_READY: "not ready",
    A.TASK_FAILED: "task failed",
    A.TIMEOUT: "timeout",
    A.OTHER: "other",
}


def log(text: str) -> None:
    """Progress on stderr."""
    print(f"[{datetime.now(UTC):%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def cli_argv() -> list[str]:
    """The ``reward-supervisor`` command beside this interpreter (else ``-m supervisor.cli``)."""
    script = Path(sys.executable).with_name("reward-supervisor")
    return [str(script)] if script.exists() else [sys.executable, "-m", "supervisor.cli"]


async def run_cmd(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 300.0
) -> tuple[int, str]:
    """Run ``argv`` to completion without blocking the event loop; (exit code, output)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(env) if env is not None else None,
    )
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        return -1, out.decode(errors="replace") + f"\n(killed after {timeout_s:g}s)"
    return proc.returncode if proc.returncode is not None else -1, out.decode(errors="replace")


# --- fleets ------------------------------------------------------------------------------


class Fleet(Protocol):
    """One supervisor running one fleet of real workers."""

    name: str

    @property
    def root(self) -> Path:
        """The run directory."""

    @property
    def hosts(self) -> list[str]:
        """The host names, host i on shard i."""

    async def start(self) -> None:
        """Start the supervisor and its workers (returns before they are ready)."""

    async def restart_host(self, host: str) -> str:
        """The supervisor's restart of one host; what was done."""

    async def reload_worker(self) -> str:
        """Give every host a new worker (a deploy); what was done."""

    async def stop_start(self, host: str) -> str:
        """Stop one host, then start it again; what was done."""

    def lose(self, host: str) -> str:
        """``host``'s machine is gone from the network (``host_lost``); what was done."""

    async def drain(self, host: str) -> str:
        """Move ``host``'s shard to a spare (``drain``); what was done."""

    async def stop(self) -> None:
        """Stop the workers and the supervisor (or leave them to the caller's kill)."""

    def close(self) -> None:
        """Kill whatever of the supervisor is left (not the workers: the caller does)."""

    def actions_since(self, wall: float, hosts: Sequence[str]) -> list[str]:
        """What the supervisor said it did about ``hosts`` since Unix time ``wall``."""


@dataclass
class Ours:
    """``reward-supervisor run`` with the shipped defaults."""

    tmp: Path
    openssh: OpenSsh
    areal: Path
    hosts: list[str]
    concurrency: int
    trainer_table: bool
    restart_stop: str | None = None
    #: ``[probe]`` (None: no probes).
    probe: Mapping[str, Any] | None = None
    #: ``host_lost``: host TARGET's own sshd, and one spare on the shared one.
    doomed: OpenSsh | None = None
    #: One ``[[spares]]`` machine on the shared sshd (``drain``; implied by ``doomed``).
    spare: bool = False
    name: str = "ours"
    process: asyncio.subprocess.Process | None = None
    generation: int = 1

    @property
    def root(self) -> Path:
        """The run directory."""
        return self.tmp / "run"

    @property
    def config_path(self) -> Path:
        """The config file."""
        return self.tmp / "rs.toml"

    @property
    def log_path(self) -> Path:
        """The daemon's stdout (JSON lines)."""
        return self.tmp / "daemon.jsonl"

    def raw(self) -> dict[str, Any]:
        """The config: only what a fleet needs; every threshold is the shipped default."""
        raw = A.shipped_config(
            self.openssh,
            self.root,
            self.hosts,
            areal=self.areal,
            # A short path: sun_path is 108 bytes.
            socket=self.tmp / "c.sock",
            concurrency=self.concurrency,
            env={"TRAINER_BENCH_GENERATION": str(self.generation)},
            trainer_table=self.trainer_table,
            health=None if self.restart_stop is None else {"restart_stop": self.restart_stop},
        )
        if self.probe is not None:
            raw["probe"] = dict(self.probe)
        if self.doomed is not None or self.spare:
            spare = {"name": f"{self.hosts[0]}-spare", "concurrency": self.concurrency}
            raw["spares"] = [
                {**spare, "address": self.openssh.addresses[0], "port": self.openssh.port}
            ]
        if self.doomed is not None:
            known = self.tmp / "known_hosts"
            known.write_text(
                self.openssh.known_hosts.read_text() + self.doomed.known_hosts.read_text()
            )
            raw["ssh"]["known_hosts"] = str(known)
            raw["ssh"]["client_keys"] = [str(self.openssh.client_key), str(self.doomed.client_key)]
            raw["hosts"][TARGET].update(address=self.doomed.addresses[0], port=self.doomed.port)
        return raw

    async def drain(self, host: str) -> str:
        """``reward-supervisor drain -c CFG HOST``."""
        code, out = await run_cmd([*cli_argv(), "drain", "-c", str(self.config_path), host])
        return f"`drain` exit {code}: {out.strip()[-200:]}"

    def lose(self, host: str) -> str:
        """``host``'s machine dies: its sshd and sessions gone (the worker is killed apart)."""
        assert self.doomed is not None, "host_lost needs the doomed host's own sshd"
        assert host == self.hosts[TARGET], host
        self.doomed.stop()
        return f"{host}'s sshd stopped"

    def write_config(self) -> None:
        """Write the config atomically (a reload must read the old file or the new one)."""
        tmp = self.config_path.with_name(f".{self.config_path.name}.tmp")
        tmp.write_text(render_toml(self.raw()), encoding="utf-8")
        os.replace(tmp, self.config_path)

    async def start(self) -> None:
        """Write the config and start the daemon, its stdout to ``daemon.jsonl``."""
        self.write_config()
        with self.log_path.open("ab") as out:
            self.process = await asyncio.create_subprocess_exec(
                *cli_argv(),
                *("run", "-c", str(self.config_path), "--log-format", "json"),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
            )

    async def restart_host(self, host: str) -> str:
        """``reward-supervisor restart-host -c CFG HOST``."""
        code, out = await run_cmd([*cli_argv(), "restart-host", "-c", str(self.config_path), host])
        return f"`restart-host` exit {code}" + (f": {out.strip()[-200:]}" if code else "")

    async def stop_start(self, host: str) -> str:
        """``stop-host``, wait until the host is stopped, then ``start-host``."""
        cfg = str(self.config_path)
        t0 = time.monotonic()
        code, out = await run_cmd([*cli_argv(), "stop-host", "-c", cfg, host])
        if code:
            return f"`stop-host` exit {code}: {out.strip()[-200:]}"
        stopped = time.monotonic() - t0
        code, out = await run_cmd([*cli_argv(), "start-host", "-c", cfg, host])
        return f"`stop-host` ({stopped:.1f} s), then `start-host` exit {code}" + (
            f": {out.strip()[-200:]}" if code else ""
        )

    async def reload_worker(self) -> str:
        """A new ``worker.env`` in the config, then ``reward-supervisor reload``."""
        self.generation += 1
        self.write_config()
        code, out = await run_cmd([*cli_argv(), "reload", "-c", str(self.config_path)])
        return f"`worker.env` changed, `reload` exit {code}" + (
            f": {out.strip()[-200:]}" if code else ""
        )

    async def stop(self) -> None:
        """SIGTERM the daemon, which stops every worker, and wait for it."""
        if self.doomed is not None:
            self.doomed.stop()
        if self.process is None or self.process.returncode is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_S):
                await self.process.wait()

    def close(self) -> None:
        """SIGKILL the daemon if it is still running."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    def actions_since(self, wall: float, hosts: Sequence[str]) -> list[str]:
        """The daemon's ``host.state`` changes of ``hosts`` since ``wall``, and what it said
        of their rewards and shards (``rewards.*``, ``shard.failover``)."""
        out = []
        for line in _json_lines(self.log_path):
            event = str(line.get("event"))
            said = event.startswith("rewards.") or event == "shard.failover"
            if (event != "host.state" and not said) or line.get("host") not in hosts:
                continue
            with contextlib.suppress(KeyError, ValueError, TypeError):
                at = datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))
                if at.timestamp() < wall:
                    continue
                if said:
                    out.append(
                        f"+{at.timestamp() - wall:.1f}s {line['host']} {event}"
                        f" ({line.get('reason')})"
                    )
                else:
                    out.append(
                        f"+{at.timestamp() - wall:.1f}s {line['host']} {line.get('from')}→"
                        f"{line.get('to')} ({line.get('reason')})"
                    )
        return out


@dataclass
class Old:
    """``reward_workers_ctl.py`` (patched) ``start`` + ``watch``, with their defaults."""

    tmp: Path
    openssh: OpenSsh
    areal: Path
    seed: Path
    n_hosts: int
    concurrency: int
    name: str = "old"
    world: SeedWorld = field(init=False)
    watch: asyncio.subprocess.Process | None = None

    def __post_init__(self) -> None:
        self.world = SeedWorld.create(
            self.tmp / "seed",
            self.openssh,
            self.seed,
            self.n_hosts,
            areal=self.areal,
            concurrency=self.concurrency,
        )

    @property
    def root(self) -> Path:
        """The run directory."""
        return self.world.root

    @property
    def hosts(self) -> list[str]:
        """The world's host names (unique: the script's sweeps match them machine-wide)."""
        return self.world.hosts

    def _paths(self) -> list[str]:
        """``--ws`` and ``--venv``: the workspace and the venv whose python runs the workers."""
        return ["--ws", str(self.world.ws), "--venv", str(self.world.venv)]

    async def _start_fleet(self) -> str:
        """``start`` with its defaults (but the run root, hosts and reward fn)."""
        code, out = await run_cmd(
            self.world.command(
                "start",
                *("--root", str(self.root), "--workers-json", self.world.workers_json()),
                *("--reward-fn", A.HANG_IF_MARKER),
                *self._paths(),
            ),
            env=self.world.env,
        )
        if code != 0:
            raise RuntimeError(f"old start failed, exit {code}:\n{out[-3000:]}")
        return out

    async def _start_watch(self) -> None:
        """``watch`` in the background with its defaults, as a team runs it."""
        with (self.tmp / "watch.out").open("ab") as out:
            self.watch = await asyncio.create_subprocess_exec(
                *self.world.command("watch", "--root", str(self.root), *self._paths()),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=self.world.env,
            )

    async def start(self) -> None:
        """``start`` (which waits for ready itself), then ``watch``."""
        await self._start_fleet()
        await self._start_watch()

    async def restart_host(self, host: str) -> str:
        """``restart-host --root R --host H``."""
        code, out = await run_cmd(
            self.world.command("restart-host", "--root", str(self.root), "--host", host)
            + self._paths(),
            env=self.world.env,
        )
        return f"`restart-host` exit {code}" + (f": {out.strip()[-200:]}" if code else "")

    async def drain(self, host: str) -> str:
        """The old script cannot move a shard."""
        raise NotImplementedError(f"the old script cannot drain a host ({host})")

    def lose(self, host: str) -> str:
        """``host``'s machine dies: ssh to it now meets a closed port (127.0.0.9:1)."""
        config = self.world.workdir / "ssh_config"
        text = config.read_text()
        config.write_text(f"Host {host}\n  HostName 127.0.0.9\n  Port 1\n\n{text}")
        return f"ssh to {host} refused from now on"

    async def stop_start(self, host: str) -> str:
        """The old script has no per-host stop."""
        raise NotImplementedError(f"the old script cannot stop one host ({host})")

    async def reload_worker(self) -> str:
        """No reload: ``stop``, ``start`` again, and ``watch`` again (``stop`` ended it)."""
        t0 = time.monotonic()
        code, _ = await run_cmd(
            self.world.command("stop", "--root", str(self.root)), env=self.world.env
        )
        stopped = time.monotonic() - t0
        if self.watch is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(30):
                    await self.watch.wait()
        await self._start_fleet()
        started = time.monotonic() - t0
        await self._start_watch()
        return (
            f"no reload: `stop` (exit {code}, {stopped:.1f} s) then `start` (done at"
            f" {started:.1f} s) and `watch` again"
        )

    async def stop(self) -> None:
        """Nothing: the caller kills the workers after ``close``. The script's own ``stop``
        polls each host's pids once a second, one host after another (15-20 s here), and the
        teardown is not what is measured."""

    def close(self) -> None:
        """Kill ``watch`` and every respawn wrapper (so no worker is started again)."""
        if self.watch is not None and self.watch.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.watch.kill()
        self.world.close()

    def actions_since(self, wall: float, hosts: Sequence[str]) -> list[str]:
        """``watch``'s log lines since ``wall`` (it restarts by host)."""
        out = []
        path = self.root / "ctl" / "watch.log"
        with contextlib.suppress(OSError):
            for text in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, IndexError):
                    stamp = datetime.strptime(text[1:21], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
                    # The log's stamps are whole seconds: keep the second of the fault.
                    if stamp.timestamp() >= math.floor(wall) and "watch start" not in text:
                        out.append(f"+{stamp.timestamp() - wall:.0f}s {text[23:]}")
        return out


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """Every JSON object line of ``path``."""
    out = []
    with contextlib.suppress(OSError):
        for text in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                line = json.loads(text)
                if isinstance(line, dict):
                    out.append(line)
    return out


# --- observing ---------------------------------------------------------------------------


@dataclass
class StatusLog:
    """Every host's status file as sampled: ``(monotonic, pid, ready)`` at each change."""

    root: Path
    hosts: list[str]
    seen: dict[str, list[tuple[float, int | None, bool]]] = field(default_factory=dict)
    #: The longest time between two samples (monotonic, since ``mark``): a sampler asleep for
    #: 100 ms that wakes seconds later means the whole machine stalled (swap, an OOM kill,
    #: a stolen CPU), which no supervisor causes or cures.
    longest_pause_s: float = 0.0
    _last_at: float | None = None

    def mark(self) -> None:
        """Start counting ``longest_pause_s`` afresh."""
        self.longest_pause_s, self._last_at = 0.0, None

    def sample(self) -> None:
        """Read every status file once; record the changes."""
        now = time.monotonic()
        if self._last_at is not None:
            self.longest_pause_s = max(self.longest_pause_s, now - self._last_at)
        self._last_at = now
        for host in self.hosts:
            status = A.read_status(self.root, host) or {}
            pid = status.get("pid") if isinstance(status.get("pid"), int) else None
            entry = (now, pid, status.get("ready") is True)
            history = self.seen.setdefault(host, [])
            if not history or history[-1][1:] != entry[1:]:
                history.append(entry)

    def pid(self, host: str) -> int | None:
        """The pid the host's status file named last."""
        history = self.seen.get(host)
        return history[-1][1] if history else None

    def ready(self) -> bool:
        """Every host's status says ready, with a heartbeat the client accepts (< 15 s old)."""
        for host in self.hosts:
            status = A.read_status(self.root, host)
            if status is None or status.get("ready") is not True:
                return False
            beat = status.get("heartbeat_at")
            if not isinstance(beat, int | float) or time.time() - beat > 15:
                return False
        return True

    def replaced_s(
        self, hosts: Sequence[str], fault_at: float, before: Mapping[str, int | None]
    ) -> float | None:
        """Seconds from the fault until every one of ``hosts`` showed a ready worker with
        another pid than before it (None: some host never did)."""
        latest = 0.0
        for host in hosts:
            times = [
                t
                for t, pid, ready in self.seen.get(host, [])
                if t >= fault_at and ready and pid is not None and pid != before.get(host)
            ]
            if not times:
                return None
            latest = max(latest, min(times) - fault_at)
        return latest


async def sample_forever(processes: A.FleetProcesses, status: StatusLog) -> None:
    """Sample status files every ``STATUS_SAMPLE_S`` and /proc every ``PROC_SAMPLE_S``."""
    next_proc = 0.0
    while True:
        status.sample()
        if time.monotonic() >= next_proc:
            await asyncio.to_thread(processes.sample)
            next_proc = time.monotonic() + PROC_SAMPLE_S
        await asyncio.sleep(STATUS_SAMPLE_S)  # wait-ok: the sampling period


async def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    """Re-check ``predicate()`` every 100 ms until it holds; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.1)  # wait-ok: polling period of a deadline loop


# --- one run -----------------------------------------------------------------------------


@dataclass
class Outcome:
    """One fault under one supervisor."""

    supervisor: str
    fault: str
    how: str = ""
    summary: A.LoadSummary | None = None
    recovery_s: float | None = None
    replaced_s: float | None = None
    lingering: list[A.Lingering] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    setup_s: float = math.nan
    total_s: float = math.nan
    #: The bench's own longest pause in the window (see ``StatusLog.longest_pause_s``).
    pause_s: float = math.nan
    #: The 1-minute load average at the end of the window.
    load_1m: float = math.nan
    error: str | None = None


@dataclass
class Settings:
    """The options of one bench run."""

    hosts: int
    concurrency: int
    loops: int
    window_s: float
    fault_at_s: float
    trainer_table: bool
    restart_stop: str | None = None
    probe_interval_s: float = 1.0


def kill_machine_of(pid: int) -> int:
    """SIGKILL what a dead machine would have lost with worker ``pid``: its parent (the
    shepherd, or the old script's respawn loop) and every process of its session or group."""

    def ids(p: int) -> tuple[int, int, int] | None:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return int(fields[1]), int(fields[2]), int(fields[3])  # ppid, pgrp, session

    own = ids(pid)
    if own is None or own[2] == os.getsid(0):
        return 0  # gone, or in our own session: nothing of a remote machine
    victims = {pid, own[0]} if own[0] > 1 else {pid}
    for name in os.listdir("/proc"):
        if name.isdigit():
            other = ids(int(name))
            if other is not None and (other[1] == own[1] or other[2] == own[2]):
                victims.add(int(name))
    victims.discard(os.getpid())
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    return len(victims)


async def inject(
    fault: str, fleet: Fleet, processes: A.FleetProcesses, status: StatusLog, marker: Path
) -> str:
    """Do ``fault`` to host ``TARGET`` (or the whole fleet); what was done."""
    host = fleet.hosts[TARGET]
    pid = status.pid(host)
    if fault in ("kill9", "sigstop"):
        if pid is None:
            return "no worker pid in the status file: nothing done"
        os.kill(pid, signal.SIGKILL if fault == "kill9" else signal.SIGSTOP)
        return f"{'SIGKILL' if fault == 'kill9' else 'SIGSTOP'} coordinator {pid}"
    if fault == "stuck":
        await asyncio.to_thread(marker.write_text, "stuck\n")
        return f"marker {marker.name} created: host {TARGET}'s reward calls hang"
    if fault == "zero_host":
        await asyncio.to_thread(marker.write_text, "zero\n")
        return f"marker {marker.name} created: host {TARGET}'s machine scores every call 0"
    if fault == "pool_death":
        deadline = time.monotonic() + BUSY_SEARCH_S
        while time.monotonic() < deadline:
            await asyncio.to_thread(processes.sample)
            children = processes.children_of(pid) if pid is not None else []
            busy = await asyncio.to_thread(A.busy_pool_process, children)
            if busy is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(busy.pid, signal.SIGKILL)
                    return f"SIGKILL busy pool process {busy.pid} of coordinator {pid}"
            await asyncio.sleep(0.01)  # wait-ok: look again for a process inside a call
        return "no busy pool process found: nothing done"
    if fault == "restart_host":
        return await fleet.restart_host(host)
    if fault == "stop_start":
        return await fleet.stop_start(host)
    if fault == "reload_worker":
        return await fleet.reload_worker()
    if fault == "host_lost":
        if pid is None:
            return "no worker pid in the status file: nothing done"
        done = fleet.lose(host)
        killed = kill_machine_of(pid)
        return f"{done}; SIGKILL of {killed} processes of its worker (the machine's)"
    if fault == "drain":
        return await fleet.drain(host)
    if fault == "none":
        return "nothing done"
    raise ValueError(f"unknown fault {fault!r}")


async def run_one(
    supervisor: str,
    fault: str,
    settings: Settings,
    openssh: OpenSsh,
    areal: Path,
    seed: Path | None,
) -> Outcome:
    """A fresh fleet, the load, the fault, the window; then everything is stopped and killed."""
    outcome = Outcome(supervisor, fault)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f"tb-{supervisor}-{fault}-", dir=SCRATCH))
    tag = uuid.uuid4().hex[:6]
    fleet: Fleet
    if supervisor in PROBES_AB:
        names = [f"tb{tag}-{i}" for i in range(settings.hosts)]
        probe = None
        if supervisor == "ours+probes":
            probe = {
                "interval_s": settings.probe_interval_s,
                "timeout_s": 20.0,
                "reward_fn": A.HANG_IF_MARKER,
                "args": [A.PROMPT, A.COMPLETIONS],
                "kwargs": {"answer": A.ANSWER},
                "expect": 1.0,
            }
        doomed = None
        if fault == "host_lost":
            doomed = OpenSsh.create(tmp / "doomed-sshd", addresses=("127.0.0.9",))
        fleet = Ours(
            tmp,
            openssh,
            areal,
            names,
            settings.concurrency,
            settings.trainer_table,
            settings.restart_stop,
            probe,
            doomed,
            spare=fault in ("drain", "zero_host"),
        )
    else:
        assert seed is not None
        fleet = Old(tmp, openssh, areal, seed, settings.hosts, settings.concurrency)
    processes = A.FleetProcesses(fleet.root)
    status = StatusLog(fleet.root, fleet.hosts)
    target = fleet.hosts[TARGET]
    # {host} is filled in by the worker running the call: only host TARGET's calls hang.
    marker = tmp / f"hang-{target}"
    reward_fn, call_kwargs = A.HANG_IF_MARKER, {"hang_marker": str(tmp / "hang-{host}")}
    if fault == "zero_host":
        # The machine scores 0, not the label: ours moves the label to a spare reached at
        # another address ({addr}); the old script reaches every host at one address, and
        # never moves a shard, so its marker names the host.
        reward_fn = A.ZERO_IF_MARKER
        if isinstance(fleet, Ours):
            address = fleet.raw()["hosts"][TARGET]["address"]
            marker = tmp / f"zero-{address}"
            call_kwargs["zero_marker"] = str(tmp / "zero-{addr}")
        else:
            marker = tmp / f"zero-{target}"
            call_kwargs["zero_marker"] = str(tmp / "zero-{host}")
    load: A.TrainerLoad | None = None
    sampler: asyncio.Task[None] | None = None
    action: asyncio.Task[str] | None = None
    try:
        await fleet.start()
        await wait_for(status.ready, READY_S, "every host ready")
        outcome.setup_s = time.monotonic() - began
        sampler = asyncio.create_task(sample_forever(processes, status))
        load = A.TrainerLoad(
            fleet.root,
            fleet.hosts,
            settings.hosts,
            areal=areal,
            reward_fn=reward_fn,
            loops=settings.loops,
            call_kwargs=call_kwargs,
        )
        load.start()
        for shard in range(settings.hosts):
            await load.wait_ok(WARM_CALLS_PER_SHARD, READY_S, shards=[shard])
        t0 = time.monotonic()
        status.mark()
        await asyncio.sleep(settings.fault_at_s)  # wait-ok: the window's lead before the fault
        status.sample()
        faulted = list(fleet.hosts) if fault == "reload_worker" else [target]
        before = {host: status.pid(host) for host in fleet.hosts}
        fault_at, fault_wall = time.monotonic(), time.time()
        log(f"{supervisor} {fault}: fault")
        action = asyncio.create_task(inject(fault, fleet, processes, status, marker))
        await asyncio.sleep(max(0.0, t0 + settings.window_s - time.monotonic()))  # wait-ok
        t1 = time.monotonic()
        outcome.pause_s, outcome.load_1m = status.longest_pause_s, os.getloadavg()[0]
        outcome.lingering = await asyncio.to_thread(processes.lingering)
        outcome.summary = load.summary(t0, t1)
        shards = None if fault == "reload_worker" else [TARGET]
        outcome.recovery_s = load.recovery_s(fault_at, shards, t1)
        if fault == "zero_host":
            outcome.recovery_s = scored_right_after(load, fault_at, t1)
        outcome.replaced_s = status.replaced_s(faulted, fault_at, before)
        if not action.done():
            outcome.how = "(still running at the end of the window) "
        outcome.how += await action
        outcome.actions = fleet.actions_since(fault_wall, fleet.hosts)
    except Exception as exc:  # noqa: BLE001 (one run failing must not lose the others)
        outcome.error = f"{type(exc).__name__}: {exc}"
        log(f"{supervisor} {fault}: {outcome.error}")
    finally:
        if load is not None:
            await load.stop()
        if action is not None and not action.done():
            action.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await action
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        marker.unlink(missing_ok=True)
        try:
            await fleet.stop()
        finally:
            fleet.close()
            left = await asyncio.to_thread(processes.everything_alive)
            A.kill_procs(left)
            shutil.rmtree(tmp, ignore_errors=True)
    outcome.total_s = time.monotonic() - began
    return outcome


def scored_right_after(load: A.TrainerLoad, fault_at: float, until: float) -> float | None:
    """Seconds from the fault to the end of the last call on shard TARGET that scored 0,
    when RIGHT_AFTER calls on it scored right after that (None: not within the window)."""
    calls = [c for c in load.calls if c.ok and c.shard == TARGET and fault_at <= c.end <= until]
    zeros = [c.end for c in calls if c.score == 0.0]
    if not zeros:
        return 0.0
    right_after = [c for c in calls if c.start > zeros[-1] and c.score]
    return zeros[-1] - fault_at if len(right_after) >= RIGHT_AFTER else None


# --- report ------------------------------------------------------------------------------


def failed_text(summary: A.LoadSummary) -> str:
    """``1234 (stale 1200, not ready 34)``."""
    if not summary.failed_total:
        return "0"
    parts = ", ".join(f"{KIND_SHORT[k]} {n}" for k, n in summary.failed.items())
    return f"{summary.failed_total} ({parts})"


def lingering_text(items: Sequence[A.Lingering]) -> str:
    """``5 (4 pool, 1 resource tracker)``."""
    if not items:
        return "0"
    roles = Counter(item.proc.role for item in items)
    return f"{len(items)} (" + ", ".join(f"{n} {role}" for role, n in roles.items()) + ")"


def dur(value: float) -> str:
    """A duration for the table; ``0`` for none at all."""
    return "0" if value == 0 else fmt_s(value)


def opt_s(value: float | None) -> str:
    """A duration, or ``none`` when there was none in the window."""
    return "none" if value is None else fmt_s(value)


def report(outcomes: Sequence[Outcome], settings: Settings, started: str, took_s: float) -> str:
    """The markdown report: the table, the definitions, what each supervisor did."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    lines = [
        f"# What the trainer sees: {len(outcomes)} runs, started {started}",
        "",
        f"`python -m bench.trainer` on `{commit}`; {settings.hosts} hosts, worker concurrency"
        f" {settings.concurrency}, {settings.loops} rollout loops, window {settings.window_s:g} s"
        f" with the fault at {settings.fault_at_s:g} s, on host {TARGET} (shard {TARGET});"
        f" `[trainer]` table: {'yes' if settings.trainer_table else 'no'};"
        f" ours' `restart_stop`: {settings.restart_stop or 'the default (kill)'}. Whole run"
        f" {took_s / 60:.1f} min; load average at the end {load_average()}.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()) + ".",
        "",
        "| fault | supervisor | OK calls | scored 0 | failed calls (by kind) | longest stall"
        " | total stall | p50 | p99 | recovery | new worker ready | lingering at end |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        if o.summary is None:
            lines.append(f"| {o.fault} | {o.supervisor} | error: {o.error} |" + " |" * 9)
            continue
        s = o.summary
        lines.append(
            f"| {o.fault} | {o.supervisor} | {s.ok} | {s.zero_scored} | {failed_text(s)}"
            f" | {dur(s.longest_stall_s)}"
            f" | {dur(s.total_stall_s)} | {fmt_s(s.p50_s)} | {fmt_s(s.p99_s)}"
            f" | {opt_s(o.recovery_s)} | {opt_s(o.replaced_s)} | {lingering_text(o.lingering)} |"
        )
    lines += [
        "",
        "Definitions (`tests/areal.py`): a call is one `await FSRewardClient(...)(prompt,"
        " completions, answer=...)` with the client's defaults (heartbeat stale 15 s, timeout"
        " 30 s, raise); a failed call pauses its loop 50 ms (the client's poll interval), so"
        " failed calls count how long the trainer was blocked, about 20 per second per loop."
        " Calls counted are those that ended in the window. *Scored 0*: OK calls whose score"
        " was 0 (every healthy call scores 1: each is a reward the faulted host lied on)."
        " *Stall*: gaps longer than 1 s"
        " between consecutive OK completions (and from the window's start and to its end);"
        " longest and sum of whole gaps. *Recovery*: fault to the end of the first OK call on"
        " the faulted shard (every shard for reload_worker) that started after the fault and"
        " after the last failed call (`zero_host`: to the end of the last call on the shard that"
        " scored 0, with 20 scored right after it); `none`: not within the window. *New worker"
        " ready*: fault"
        " until the faulted host(s) status file showed `ready: true` from another pid (run"
        " directory, sampled every 100 ms); `none`: no new worker. *Lingering*: processes"
        " alive at the end of the window that no current worker accounts for: superseded"
        " coordinators still alive and the pool processes and resource tracker of dead or"
        " superseded coordinators (tracked from /proc while they were children, and by session"
        " and process group). *Bench's longest pause*: the longest gap between two of the"
        " bench's own 100 ms status samples in the window; seconds there mean the whole"
        " machine stalled (another process swapping, an OOM kill), which no supervisor causes.",
        "",
        "## What was done and what the supervisor did",
        "",
        "Ours: the daemon's `host.state` changes of every host after the fault (its log);"
        " old: `watch`'s log lines after the fault.",
        "",
    ]
    for o in outcomes:
        lines.append(
            f"- **{o.fault} / {o.supervisor}** ({o.total_s:.0f} s, fleet ready after"
            f" {o.setup_s:.0f} s; bench's longest pause {fmt_s(o.pause_s)}, load"
            f" {o.load_1m:.1f}): {o.how or '-'}"
        )
        if o.error:
            lines.append(f"  - error: {o.error}")
        if o.summary is not None:
            for kind, text in o.summary.examples.items():
                lines.append(f"  - first {kind}: `{text[:160]}`")
            if o.summary.failed_by_shard:
                by = ", ".join(f"{s}: {n}" for s, n in o.summary.failed_by_shard.items())
                lines.append(f"  - failed calls by shard (those that chose one): {by}")
        for text in o.actions[:12]:
            lines.append(f"  - {text}")
        if len(o.actions) > 12:
            lines.append(f"  - ... {len(o.actions) - 12} more")
        for item in o.lingering[:3]:
            lines.append(f"  - lingering: {item}")
    return "\n".join(lines) + "\n"


# --- main --------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> str:
    """Every fault under every supervisor asked for, one after another; the report."""
    areal = A.areal_dir()
    if areal is None:
        raise SystemExit(A.areal_missing_reason())
    seed = find_seed()
    supervisors = [args.only] if args.only else list(SUPERVISORS)
    if args.probes_ab:
        supervisors = list(PROBES_AB)
    if "old" in supervisors and seed is None:
        raise SystemExit(seed_missing_reason())
    settings = Settings(
        hosts=args.hosts,
        concurrency=args.concurrency,
        loops=args.loops,
        window_s=args.window,
        fault_at_s=args.fault_at,
        trainer_table=args.trainer_table,
        restart_stop=args.restart_stop,
        probe_interval_s=args.probe_interval,
    )
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="tb-sshd-") as name:
        openssh = OpenSsh.create(Path(name) / "sshd")
        try:
            rounds = [supervisors if r % 2 == 0 else supervisors[::-1] for r in range(args.rounds)]
            for fault, order in ((f, o) for o in rounds for f in args.faults):
                for supervisor in order:
                    if supervisor == "old" and fault in OLD_CANNOT:
                        continue
                    log(f"{supervisor} {fault}: start")
                    outcome = await run_one(supervisor, fault, settings, openssh, areal, seed)
                    outcomes.append(outcome)
                    s = outcome.summary
                    log(
                        f"{supervisor} {fault}: done in {outcome.total_s:.0f} s"
                        + (f"; failed {failed_text(s)}, ok {s.ok}" if s is not None else "")
                    )
        finally:
            openssh.stop()
    return report(outcomes, settings, started, time.monotonic() - t0)


def main() -> None:
    """Parse the options, run, print the report and write it to ``bench/results``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated")
    parser.add_argument("--window", type=float, default=None, help="seconds (default 60)")
    parser.add_argument("--fault-at", type=float, default=None, help="seconds into the window")
    parser.add_argument("--only", choices=SUPERVISORS)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="pool processes per worker")
    parser.add_argument("--loops", type=int, default=16, help="concurrent rollout loops")
    parser.add_argument("--quick", action="store_true", help="window 20 s, fault at 3 s")
    parser.add_argument("--trainer-table", action="store_true", help="add a [trainer] table")
    parser.add_argument(
        "--restart-stop", choices=("kill", "drain"), help="ours: [health] restart_stop"
    )
    parser.add_argument("--out", type=Path, help="the report file (default bench/results/...)")
    parser.add_argument(
        "--probes-ab", action="store_true", help="ours without and with [probe], side by side"
    )
    parser.add_argument("--probe-interval", type=float, default=1.0, help="[probe] interval_s")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, alternating the order")
    args = parser.parse_args()
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    if args.hosts < 4:
        parser.error("--hosts must be at least 4")
    if args.window is None:
        args.window = 20.0 if args.quick else 60.0
    if args.fault_at is None:
        args.fault_at = 3.0 if args.quick else 5.0
    text = asyncio.run(main_async(args))
    print(text)
    out = args.out or RESULTS / f"trainer-{datetime.now(UTC):%Y-%m-%d-%H%M}.md"
    out.write_text(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
