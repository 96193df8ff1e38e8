"""Takeover by a warm standby vs a plain restart of the daemon, 50 hosts on a real sshd.

    .venv/bin/python -m bench.bench_takeover [--hosts 50] [--runs 3] [--rc-files] [--old DIR]

One OpenSSH sshd on 127.0.0.1-3 serves every "host"; 50 reference workers run under a leading
``reward-supervisor run`` (``[ha] standby = true``, the defaults otherwise: the standby tries
the lock every 0.5 s). Runs alternate:

- **takeover**: a second daemon waits as a standby until its status says every host is
  connected and probed; the leader is SIGKILLed; measured from the kill to the standby's
  ``ha.leading`` (lock taken, epoch bumped) and to its ``ha.in_charge`` (every host adopted:
  start-up settled, READY), from the log lines' timestamps against the wall clock read at
  the kill. The standby then leads, and the next run starts a new standby.
- **plain restart** (the baseline: no standby, systemd's ``Restart=always`` with
  ``RestartSec=0``): the leader is SIGKILLed and a new daemon started at once; measured from
  the kill to its ``daemon.ready``. Its SSH connect time (``daemon.starting`` to the last
  ``ssh.up``) is the "SSH connect time of its hosts" of the target.

With ``--old DIR`` (a checkout of older code, e.g. ``git archive``d), there is no plain
restart: takeovers by a standby running DIR's ``supervisor`` (first on its ``PYTHONPATH``)
alternate with takeovers by one running this checkout, and the report gives new / old.

Both count the launches the new leader began and the workers whose pid changed (the goal is
0). Every "host" is this machine: its sshd sessions and workers share the cores with both
daemons. Measurements only: nothing here asserts a time. Appends to
``bench/results/takeover.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import SCRATCH, fmt_range, load_average, machine_facts, median, raise_nofile
from bench.ops import clean_home
from supervisor.seedimport import render_toml
from tests.sshd import OpenSsh
from tests.system.daemonproc import FAST_WORKER_ARGV, DaemonProcess, all_ready, host_pids

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "takeover.md"
#: Generous: 50 workers starting on 2 shared cores.
READY_S = 300.0


@dataclass
class Sample:
    """One run of one side."""

    #: Kill -> lock taken (takeover only).
    lock_s: float | None
    #: Kill -> the new leader in charge (every host adopted, READY).
    charge_s: float
    #: The new daemon's SSH connect time (baseline: start -> last ssh.up; takeover: 0).
    connect_s: float
    launches: int
    pid_changes: int
    load: str


@dataclass
class Side:
    """Every sample of one side."""

    name: str
    samples: list[Sample] = field(default_factory=list)


def stamp(line: dict[str, Any]) -> float:
    """A log line's time, Unix seconds."""
    from bench.common import iso_to_epoch

    return iso_to_epoch(str(line["timestamp"]))


def first(daemon: DaemonProcess, event: str) -> dict[str, Any]:
    """The first log line of ``event``."""
    return next(line for line in daemon.lines if line.get("event") == event)


class Bench:
    """The server, the two configs, and the daemons of the run."""

    def __init__(self, work: Path, sshd: OpenSsh, hosts: int) -> None:
        self.work = work
        self.hosts = hosts
        raw = sshd.config_dict(
            work / "run",
            hosts,
            argv=FAST_WORKER_ARGV,
            health={"heartbeat_stale_s": 10.0, "ready_timeout_s": 120.0},
        )
        raw["ha"] = {"standby": True}
        self.configs: list[Path] = []
        for i in range(2):
            raw["control"]["socket"] = str(work / f"c{i}.sock")
            path = work / f"rs-{i}.toml"
            path.write_text(render_toml(raw), encoding="utf-8")
            self.configs.append(path)
        self.daemons: list[DaemonProcess] = []
        self.slot = 0  # which config the leader runs

    async def start(self, slot: int, code: Path | None = None) -> DaemonProcess:
        """A daemon on config ``slot``, running ``code``'s supervisor (None: this checkout)."""
        daemon = DaemonProcess(self.configs[slot], self.work)
        self.daemons.append(daemon)
        with pythonpath(code):
            await daemon.start()
        return daemon

    async def first_leader(self) -> DaemonProcess:
        """The first leader, once every worker is ready."""
        leader = await self.start(0)
        await leader.wait_status(lambda s: all_ready(s, self.hosts), READY_S, "all ready")
        return leader

    async def takeover(
        self, leader: DaemonProcess, code: Path | None = None
    ) -> tuple[DaemonProcess, Sample]:
        """Start a standby (running ``code``), wait until it is warm, SIGKILL the leader;
        the new leader."""
        other = 1 - self.slot
        standby = await self.start(other, code)
        n = self.hosts
        await standby.wait_status(
            lambda s: s["daemon"].get("warm") == {"hosts": n, "connected": n, "probed": n},
            READY_S,
            "a warm standby",
        )
        before = host_pids(await leader.status())
        load = load_average()
        killed_at = time.time()
        leader.send_signal(signal.SIGKILL)
        await leader.wait_exit()
        await standby.wait_log("ha.in_charge", READY_S)
        status = await standby.wait_status(lambda s: all_ready(s, n), READY_S, "all ready")
        self.slot = other
        sample = Sample(
            lock_s=stamp(first(standby, "ha.leading")) - killed_at,
            charge_s=stamp(first(standby, "ha.in_charge")) - killed_at,
            connect_s=0.0,
            launches=sum(1 for line in standby.lines if line.get("event") == "host.launch"),
            pid_changes=sum(1 for h, p in host_pids(status).items() if before.get(h) != p),
            load=load,
        )
        return standby, sample

    async def restart(self, leader: DaemonProcess) -> tuple[DaemonProcess, Sample]:
        """SIGKILL the leader and start a new daemon at once (no standby)."""
        n = self.hosts
        before = host_pids(await leader.status())
        load = load_average()
        killed_at = time.time()
        leader.send_signal(signal.SIGKILL)
        await leader.wait_exit()
        fresh = await self.start(self.slot)
        await fresh.wait_log("daemon.ready", READY_S)
        status = await fresh.wait_status(lambda s: all_ready(s, n), READY_S, "all ready")
        ups = [stamp(line) for line in fresh.lines if line.get("event") == "ssh.up"]
        sample = Sample(
            lock_s=None,
            charge_s=stamp(first(fresh, "daemon.ready")) - killed_at,
            connect_s=(max(ups) if ups else 0.0) - stamp(first(fresh, "daemon.starting")),
            launches=sum(1 for line in fresh.lines if line.get("event") == "host.launch"),
            pid_changes=sum(1 for h, p in host_pids(status).items() if before.get(h) != p),
            load=load,
        )
        return fresh, sample

    async def aclose(self, leader: DaemonProcess | None) -> None:
        """Stop the leader (it stops the workers), then forget every daemon."""
        if leader is not None and leader.process is not None and leader.process.returncode is None:
            leader.send_signal(signal.SIGTERM)
            await leader.wait_exit(READY_S)
        for daemon in self.daemons:
            await daemon.aclose()


@contextlib.contextmanager
def pythonpath(code: Path | None) -> Iterator[None]:
    """Processes started inside import ``code``'s ``supervisor`` first (None: unchanged)."""
    if code is None:
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), before]))
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def row(side: Side) -> str:
    """One markdown row."""
    s = side.samples
    lock = [x.lock_s for x in s if x.lock_s is not None]
    charge = fmt_range([x.charge_s for x in s])
    return (
        f"| {side.name} | {fmt_range(lock) if lock else '-'} | **{charge}**"
        f" | {fmt_range([x.connect_s for x in s])} | {sum(x.launches for x in s)}"
        f" | {sum(x.pid_changes for x in s)} | {', '.join(x.load.split(' / ')[0] for x in s)} |"
    )


async def main_async(hosts: int, runs: int, rc_files: bool, old: Path | None = None) -> str:
    """Start the server and the first leader, alternate the sides; the markdown report."""
    raise_nofile()
    with tempfile.TemporaryDirectory(prefix="bench-takeover-", dir=SCRATCH) as tmp:
        work = Path(tmp)
        sshd = OpenSsh.create(work / "sshd")
        bench = Bench(work, sshd, hosts)
        leader: DaemonProcess | None = None
        sides = (Side("takeover by a warm standby"), Side("plain restart (baseline)"))
        if old is not None:
            sides = (Side("takeover, this checkout"), Side(f"takeover, old code ({old})"))
        try:
            if not rc_files:
                clean_home(sshd)
            load_before = load_average()
            leader = await bench.first_leader()
            for run in range(runs):
                if old is None:
                    leader, sample = await bench.takeover(leader)
                    sides[0].samples.append(sample)
                    leader, sample = await bench.restart(leader)
                    sides[1].samples.append(sample)
                    continue
                # Old first in the first run, new first in the second, and so on: a machine
                # that gets busier or quieter weighs on both alike.
                for side, code in [(sides[0], None), (sides[1], old)][:: 1 if run % 2 else -1]:
                    leader, sample = await bench.takeover(leader, code)
                    side.samples.append(sample)
            load_after = load_average()
        finally:
            await bench.aclose(leader)
            sshd.stop()
    facts = machine_facts()
    if old is not None:
        return ab_report(sides, hosts, runs, facts, load_before, load_after)
    takeover = median([x.charge_s for x in sides[0].samples])
    baseline = median([x.charge_s for x in sides[1].samples])
    connect = median([x.connect_s for x in sides[1].samples])
    sessions = "root's rc files (`pyenv init`)" if rc_files else "no rc files (empty `$HOME`)"
    met = takeover < 2.0 + connect
    lines = [
        f"takeover, {hosts} hosts on one OpenSSH sshd (127.0.0.1-3), sessions with {sessions},"
        f" {runs} runs per side, alternating",
        "",
        f"machine: {facts['cpu']}, {facts['cores']} cores, Python {facts['python']},"
        f" asyncssh {facts['asyncssh']}, {facts['openssh']};"
        f" load average {load_before} before, {load_after} after",
        "",
        "| side | kill -> lock taken | kill -> in charge (every host adopted) | SSH connect of"
        " the new daemon | launches (all runs) | pid changes (all runs) | load (1 min) per run |",
        "|---|---|---|---|---|---|---|",
        *(row(side) for side in sides),
        "",
        f"in charge: takeover {takeover:.2f} s vs plain restart {baseline:.2f} s"
        f" ({baseline / takeover:.1f}x); target under 2 s + SSH connect ({connect:.2f} s)"
        f" = {2.0 + connect:.2f} s: {'met' if met else 'NOT met'}",
    ]
    return "\n".join(lines)


def ab_report(
    sides: tuple[Side, Side],
    hosts: int,
    runs: int,
    facts: dict[str, str],
    load_before: str,
    load_after: str,
) -> str:
    """The markdown report of ``--old``: both takeover sides and new / old."""
    new, old = sides
    lines = [
        f"takeover A/B, {hosts} hosts on one OpenSSH sshd (127.0.0.1-3), {runs} runs per side,"
        " alternating (old first in the first run)",
        "",
        f"machine: {facts['cpu']}, {facts['cores']} cores, Python {facts['python']};"
        f" load average {load_before} before, {load_after} after",
        "",
        "| side | kill -> lock taken | kill -> in charge (every host adopted) | SSH connect of"
        " the new daemon | launches (all runs) | pid changes (all runs) | load (1 min) per run |",
        "|---|---|---|---|---|---|---|",
        row(new),
        row(old),
        "",
    ]
    # Kill -> lock taken is mostly where the kill fell in the standby's poll interval
    # (uniform over 0.5 s): lock taken -> in charge is the takeover's own work.
    measures: dict[str, Callable[[Sample], float]] = {
        "kill -> lock taken": lambda x: x.lock_s or 0.0,
        "lock taken -> in charge": lambda x: x.charge_s - (x.lock_s or 0.0),
        "kill -> in charge": lambda x: x.charge_s,
    }
    for what, measure in measures.items():
        a = median([measure(x) for x in new.samples])
        b = median([measure(x) for x in old.samples])
        lines.append(f"{what}: new {a:.3f} s / old {b:.3f} s = {a / b:.2f}")
    return "\n".join(lines)


def main() -> None:
    """Parse arguments, measure, print and save the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=50, help="hosts in the config")
    parser.add_argument("--runs", type=int, default=3, help="runs per side")
    parser.add_argument("--rc-files", action="store_true", help="sessions run root's rc files")
    parser.add_argument("--old", type=Path, help="a checkout to compare takeovers with (A/B)")
    args = parser.parse_args()
    text = asyncio.run(main_async(args.hosts, args.runs, args.rc_files, args.old))
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a", encoding="utf-8") as f:
        f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{text}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
