"""Soak: the fault suite's checks held for a long time under a random mix of faults.

Too long for CI (``tests/faults`` is the CI version of each fault). One real daemon supervises
``--hosts`` reference workers on a real OpenSSH sshd started for the run, tasks flow in all the
time, and every few seconds a seeded RNG injects one fault:

  kill9        kill -9 of a random worker
  sigstop      SIGSTOP of a random worker (hung: it must be terminated and replaced)
  drop_ssh     the sshd session of a random host killed
  sshd_down    sshd stopped for 5-30 s, then started
  daemon_kill  the daemon SIGKILLed, then started again (it must adopt)
  sighup       a reload of the unchanged config
  garbage      a status file overwritten with garbage
  status_dir   the status/ directory removed and made again

After each fault it waits until every host is ready again and records how long that took.
Throughout, the invariant monitor (tests/faults/monitor.py) checks that no shard ever has two
live workers; at the end every task must have exactly one correct result.

    .venv/bin/python bench/soak.py --minutes 30            # the soak
    .venv/bin/python bench/soak.py --minutes 2 --seed 7    # a quick look
    .venv/bin/python bench/soak.py --watch poll            # poll mode, as on NFS
    .venv/bin/python bench/soak.py --faults kill9,sigstop,drop_ssh,sshd_down,sighup,garbage
                                   # one daemon all along: its RSS over every recovery

Writes a markdown summary to bench/results/soak.md (or --out); exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import rss_bytes  # noqa: E402 - after the path tweak that makes the checkout importable
from supervisor import control  # noqa: E402
from supervisor.errors import ControlError  # noqa: E402
from tests.faults.harness import (  # noqa: E402
    FaultRun,
    Workload,
    events,
    kill,
)
from tests.faults.monitor import InvariantMonitor  # noqa: E402
from tests.sshd import OpenSsh  # noqa: E402
from tests.system.daemonproc import DaemonProcess, all_ready  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "soak.md"
#: How long a fault that must change nothing is watched: past the stale threshold (3 s).
QUIET_S = 4.0
#: A fault that is not recovered from within this long counts as a failure of the soak.
RECOVERY_LIMIT_S = 120.0
#: Tasks per second fed while the soak runs, in batches of this many.
TASK_RATE = 40
BATCH = 400

FAULTS = (
    "kill9",
    "sigstop",
    "drop_ssh",
    "sshd_down",
    "daemon_kill",
    "sighup",
    "garbage",
    "status_dir",
    "stop_start",
)


class Soak:
    """One soak run: a daemon, its workers, a producer, a monitor and the fault schedule."""

    def __init__(
        self,
        workdir: Path,
        hosts: int,
        rng: random.Random,
        watch: str = "auto",
        faults: tuple[str, ...] = FAULTS,
    ) -> None:
        """See the class docstring."""
        self.workdir = workdir
        self.hosts = hosts
        self.rng = rng
        #: The faults to choose from (all of them unless told).
        self.faults = faults
        #: watch.mode of the daemon's config ("poll" exercises the listings, as on NFS).
        self.watch = watch
        self.openssh = OpenSsh.create(workdir / "sshd")
        self.monitor = InvariantMonitor(workdir)
        self.run = FaultRun(self.openssh, workdir, self.monitor)
        self.daemon: DaemonProcess | None = None
        self.loads: list[Workload] = []
        #: Seconds from the fault's end (sshd back, daemon restarted...) to a whole fleet.
        self.recoveries: dict[str, list[float]] = defaultdict(list)
        #: Seconds from the fault's start to a whole fleet.
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.failures: list[str] = []
        # SIGINT or SIGTERM: end after the fault under way, then drain and report as usual.
        self.stopping = asyncio.Event()
        self._whole_at: float | None = None
        #: The daemon's RSS once the fleet is whole again after each fault, by daemon pid
        #: (daemon_kill starts a new one): memory that only grows would show here.
        self.rss: dict[int, list[int]] = defaultdict(list)

    async def start(self) -> None:
        """Write the config and start the daemon; returns once every host is ready."""
        self.monitor.start()
        self.run.write(self.run.raw(self.hosts, watch={"mode": self.watch}))
        self.daemon = await self.run.start(ready=self.hosts)

    def feed(self) -> None:
        """Start the next batch of tasks (each batch has its own ids)."""
        seed = len(self.loads) + 1
        load = Workload(
            self.run.root, self.hosts, BATCH, duration_s=BATCH / TASK_RATE, seed=seed
        ).start()
        self.loads.append(load)

    async def inject(self, fault: str) -> Callable[[dict[str, Any]], bool]:
        """Inject one fault (and undo it, where it has an end); returns the status predicate
        that says the fleet is whole again."""
        assert self.daemon is not None
        daemon = self.daemon
        status = await daemon.status()
        before = {h: row["pid"] for h, row in status["hosts"].items()}
        ups = len(events(daemon, "ssh.up"))
        reloads = len(events(daemon, "config.reloaded"))
        untouched = True  # the fault must cause no restart
        victim_host: str | None = None
        match fault:
            case "kill9" | "sigstop":
                victim_host = self.rng.choice(sorted(before))
                untouched = False
                kill(before[victim_host], signal.SIGKILL if fault == "kill9" else signal.SIGSTOP)
            case "drop_ssh":
                address = self.rng.choice(self.openssh.addresses[: self.hosts])
                self.openssh.kill_sessions(address)
            case "sshd_down":
                self.openssh.stop()
                await asyncio.sleep(self.rng.uniform(5, 30))  # the outage
                self.openssh.start()
            case "daemon_kill":
                daemon.send_signal(signal.SIGKILL)
                await daemon.wait_exit()
                self.daemon = await self.run.start()
            case "sighup":
                daemon.send_signal(signal.SIGHUP)
            case "garbage":
                host = self.rng.randrange(self.hosts)
                path = self.run.root / "status" / f"worker-{host}.json"
                path.write_bytes(self.rng.randbytes(self.rng.randrange(0, 4096)))
            case "status_dir":
                remove_busy_dir(self.run.root / "status")
                (self.run.root / "status").mkdir()
            case "stop_start":
                # The lost command's sequence: stop-host and start-host sent together, a
                # stop-host right before a daemon SIGKILL and restart, then start-host
                # answered. The fleet is whole only if the last start-host's host runs.
                victim_host = self.rng.choice(sorted(before))
                untouched = False
                await stop_start_storm(daemon, victim_host)
                stop = asyncio.create_task(host_command(daemon, "stop-host", victim_host))
                await asyncio.sleep(self.rng.uniform(0, 0.05))  # wait-ok: near the kill
                daemon.send_signal(signal.SIGKILL)
                await daemon.wait_exit()
                await stop
                self.daemon = daemon = await self.run.start()
                await stop_start_storm(daemon, victim_host)
            case _:
                raise ValueError(fault)
        injected_at = time.monotonic()

        def whole(s: dict[str, Any]) -> bool:
            """Every host ready and connected, and the fault's own end observed."""
            if not all_ready(s, self.hosts):
                return False
            if any(row["ssh"] != "connected" for row in s["hosts"].values()):
                return False
            if fault == "drop_ssh" and len(events(daemon, "ssh.up")) <= ups:
                return False
            if fault == "sighup" and len(events(daemon, "config.reloaded")) <= reloads:
                return False
            now = {h: row["pid"] for h, row in s["hosts"].items()}
            if victim_host is not None and now[victim_host] == before[victim_host]:
                return False
            if untouched and now != before:
                self.failures.append(f"{fault}: workers replaced: {before} -> {now}")
                return True
            if self._whole_at is None:
                self._whole_at = time.monotonic()
            # A fault that must change nothing is watched past the stale threshold: a watch
            # or a heartbeat lost to it would show as a restart by then.
            return not untouched or time.monotonic() - injected_at >= QUIET_S

        return whole

    async def recover(self, fault: str, whole: Callable[[dict[str, Any]], bool]) -> None:
        """Wait until ``whole``; record how long it took since the fault (or a failure)."""
        assert self.daemon is not None
        started = time.monotonic()
        self._whole_at = None
        try:
            await self.daemon.wait_status(whole, RECOVERY_LIMIT_S, f"recovery from {fault}")
        except AssertionError as exc:
            self.failures.append(f"{fault}: not recovered within {RECOVERY_LIMIT_S:g}s: {exc}")
            return
        self.recoveries[fault].append((self._whole_at or time.monotonic()) - started)
        process = self.daemon.process
        if process is not None and (rss := rss_bytes(process.pid)):
            self.rss[process.pid].append(rss)

    async def soak(self, minutes: float) -> None:
        """Inject faults until ``minutes`` have passed, feeding tasks all along."""
        started = time.monotonic()
        end = started + minutes * 60
        while time.monotonic() < end and not self.stopping.is_set():
            if not self.loads or self.loads[-1].written == BATCH:
                self.feed()
            fault = self.rng.choice(self.faults)
            began = time.monotonic()
            whole = await self.inject(fault)
            await self.recover(fault, whole)
            self.durations[fault].append(time.monotonic() - began)
            self.progress(fault, (time.monotonic() - started) / 60, minutes)
            if self.monitor.violations:
                return  # finish() reports them
            with contextlib.suppress(TimeoutError):  # the pause between two faults
                async with asyncio.timeout(self.rng.uniform(2, 8)):
                    await self.stopping.wait()

    def progress(self, fault: str, elapsed_min: float, minutes: float) -> None:
        """One line on stderr per fault: a soak runs for half an hour or more."""
        injected = sum(len(d) for d in self.durations.values())
        print(
            f"soak {elapsed_min:.1f}/{minutes:g} min: {injected} faults, last {fault}"
            f" ({self.durations[fault][-1]:.1f} s), {len(self.failures)} failures,"
            f" {len(self.monitor.violations)} violations",
            file=sys.stderr,
            flush=True,
        )

    async def finish(self) -> None:
        """Let the tasks drain, check them, stop everything."""
        try:
            every = [t.id for load in self.loads for t in load.tasks]
            for load in self.loads:
                load.join()
                await load.wait_done(600)
                self.failures += load.problems(others=every)
        except AssertionError as exc:
            self.failures.append(f"tasks: {exc}")
        finally:
            for load in self.loads:
                load.close()
            await self.run.aclose()
            self.failures += self.monitor.finish(30.0)
            self.openssh.stop()


async def host_command(daemon: DaemonProcess, cmd: str, host: str) -> bool:
    """``cmd`` for ``host`` on the daemon's socket; whether it was answered with success."""
    try:
        await control.request(daemon.socket, cmd, host=host)
    except ControlError:
        return False
    return True


async def stop_start_storm(daemon: DaemonProcess, host: str, pairs: int = 4) -> None:
    """``pairs`` stop-host/start-host sent at once, then start-host until it is answered
    (a daemon still starting refuses it)."""
    async with asyncio.TaskGroup() as tg:
        for _ in range(pairs):
            tg.create_task(host_command(daemon, "stop-host", host))
            tg.create_task(host_command(daemon, "start-host", host))
    deadline = time.monotonic() + RECOVERY_LIMIT_S
    answered = await host_command(daemon, "start-host", host)
    while not answered and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # wait-ok: a retry's pause
        answered = await host_command(daemon, "start-host", host)


def remove_busy_dir(path: Path, attempts: int = 100) -> None:
    """Remove ``path`` and its files while workers keep writing into it: a heartbeat's temp
    file can appear between emptying it and removing it (ENOTEMPTY), so empty it again."""
    for _ in range(attempts):
        for child in path.iterdir():
            child.unlink(missing_ok=True)
        try:
            path.rmdir()
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
        else:
            return
    raise RuntimeError(f"{path} kept filling up: not removed in {attempts} attempts")


def report(soak: Soak, args: argparse.Namespace, elapsed_s: float) -> str:
    """The markdown summary."""
    lines = [
        "# Soak",
        "",
        f"`bench/soak.py --minutes {args.minutes:g} --hosts {args.hosts} --seed {args.seed}"
        f" --watch {args.watch}"
        + (f" --faults {','.join(soak.faults)}" if soak.faults != FAULTS else "")
        + "`"
        f" on {platform.node()} ({os.cpu_count()} CPUs, {platform.platform()}),"
        f" {elapsed_s / 60:.1f} min, {sum(len(load.tasks) for load in soak.loads)} tasks,"
        f" {soak.monitor.samples} monitor samples (largest gap {soak.monitor.max_gap_s:.2f}s)"
        + (", stopped early by a signal." if soak.stopping.is_set() else "."),
        "",
        "Recovery: from the end of the fault (the kill, sshd back up, the new daemon started)"
        " until every host is ready and connected again, with a new worker where the old one"
        " was killed or hung; faults that must change nothing (drop_ssh, sshd_down,"
        f" daemon_kill, sighup, garbage, status_dir) are watched for at least {QUIET_S:g} s"
        " with the same pids. Total: from the start of the fault (sshd_down includes its"
        " 5-30 s outage).",
        "",
        "| fault | injected | recovery median (s) | recovery max (s) | total max (s) |",
        "|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        times = soak.recoveries.get(fault, [])
        total = soak.durations.get(fault, [])
        if times:
            lines.append(
                f"| {fault} | {len(times)} | {statistics.median(times):.2f}"
                f" | {max(times):.2f} | {max(total):.2f} |"
            )
        else:
            lines.append(f"| {fault} | 0 | - | - | - |")
    lines += [
        "",
        "The daemon's RSS after each recovery, one row per daemon process (a daemon_kill"
        " starts the next):",
        "",
        "| daemon | samples | first (MB) | last (MB) | max (MB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for n, samples in enumerate(soak.rss.values(), 1):
        first, last, peak = (x / 2**20 for x in (samples[0], samples[-1], max(samples)))
        lines.append(f"| {n} | {len(samples)} | {first:.1f} | {last:.1f} | {peak:.1f} |")
    lines += ["", "Failures: " + ("none" if not soak.failures else "")]
    lines += [f"- {failure}" for failure in soak.failures]
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    """Run the soak; the exit code."""
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="rs-soak-") as tmp:
        soak = Soak(Path(tmp), args.hosts, rng, args.watch, args.faults)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            # Killed outright, the soak left its daemon, sshd and workers running.
            loop.add_signal_handler(signum, stop_early, soak)
        started = time.monotonic()
        try:
            await soak.start()
            await soak.soak(args.minutes)
        finally:
            await soak.finish()
        text = report(soak, args, time.monotonic() - started)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 1 if soak.failures else 0


def stop_early(soak: Soak) -> None:
    """End the soak after the fault under way; say so, as a signal gets no other answer."""
    if not soak.stopping.is_set():
        print("soak: stopping after this fault, then draining the tasks", file=sys.stderr)
        soak.stopping.set()


def main() -> int:
    """Parse the arguments and soak."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--watch", choices=("auto", "inotify", "poll"), default="auto", help="watch.mode"
    )
    parser.add_argument(
        "--faults",
        type=fault_list,
        default=FAULTS,
        help="comma-separated faults to choose from (default: all); without daemon_kill one"
        " daemon lives through the whole soak, so its RSS shows a leak",
    )
    return asyncio.run(main_async(parser.parse_args()))


def fault_list(text: str) -> tuple[str, ...]:
    """``--faults``: known fault names, at least one."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown fault(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(FAULTS)}"
        )
    return names


if __name__ == "__main__":
    sys.exit(main())
