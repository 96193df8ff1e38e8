"""Where one start of N hosts goes, by the daemon's own log: the moment (after the spawn) the
first and last host reached each step (SSH connected, agent started, launch answered) and
the observer saw all ready; one ``--old`` checkout alternated with this one if given.

    .venv/bin/python bench/start_timeline.py [--hosts 50] [--runs 2] [--old DIR]

One real OpenSSH sshd on loopback, an empty ``$HOME``; prints one line per run. Measurements
only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import ops, procs  # noqa: E402
from bench.ab import neutral_directory, on_pythonpath  # noqa: E402
from bench.common import (  # noqa: E402
    SCRATCH,
    StatusWatch,
    cpu_seconds,
    iso_to_epoch,
    load_average,
    machine_busy_s,
    with_bytecode,
)
from bench.procs import LogIndex, stop_daemon  # noqa: E402
from supervisor import control  # noqa: E402
from tests.sshd import OpenSsh  # noqa: E402

STEPS = ("ssh.connected", "agent.started", "host.launch_begin", "host.launched")
STOP_STEPS = ("host.terminate", "host.terminated")


def spans(daemon: procs.DaemonProcess, steps: tuple[str, ...], since: float) -> list[str]:
    """For each step the daemon logged from ``since`` on: when the first and the last host
    reached it, in ms after ``since``."""
    logs = LogIndex(daemon)
    logs.update()
    parts = []
    for step in steps:
        stamps = sorted(
            t
            for t in (iso_to_epoch(x["timestamp"]) for x in logs.by_event.get(step, []))
            if t >= since
        )
        if stamps:
            parts.append(
                f"{step} {1000 * (stamps[0] - since):.0f}-{1000 * (stamps[-1] - since):.0f}"
            )
    return parts


async def one(
    sshd: OpenSsh, workdir: Path, hosts: int, label: str, profile: Path | None = None
) -> str:
    """One start of ``hosts``: each step's first and last time after the spawn, in ms, and
    the CPU the daemon and the machine spent until all were ready."""
    name = f"tl-{time.monotonic_ns()}"
    config = ops.ours_config(sshd, workdir, hosts, root_name=name)
    watch = StatusWatch(workdir / name / "status" / f"worker-{i}.json" for i in range(hosts))
    machine_before = machine_busy_s()
    spawned = time.time()
    daemon = await ops.start_daemon_process(config, workdir)
    spy = None
    if profile is not None:
        assert daemon.process is not None
        spy = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--nonblocking",
            "--rate",
            "500",
            "--format",
            "speedscope",
            "-o",
            str(profile),
            "-p",
            str(daemon.process.pid),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
    try:
        ready = await ops.wait_files(watch, ops.any_ready, "all ready", 0.01)
        machine = machine_busy_s() - machine_before
        assert daemon.process is not None
        own = cpu_seconds(daemon.process.pid)
        if spy is not None:
            spy.send_signal(2)
            await spy.wait()
        parts = [label, *spans(daemon, STEPS, spawned)]
        parts.append(f"all ready {1000 * (ready - spawned):.0f} ms")
        parts.append(f"CPU: daemon {own:.2f} s, machine {machine:.2f} s")
        parts.append(await stop_timeline(daemon, watch))
        return "; ".join(parts)
    finally:
        await stop_daemon(daemon)


async def stop_timeline(daemon: procs.DaemonProcess, watch: StatusWatch) -> str:
    """After a settle, a ``stop`` through the control socket: when the first and last
    terminate was issued and answered, when no worker was left (ms after the request), and
    the CPU the daemon and the machine spent until then."""
    await asyncio.sleep(ops.BACKOFF_RESET_S + 0.5)  # wait-ok: as ops.py's stop 50
    pids = [p for p in ops.ready_pids(watch).values() if p is not None]
    assert daemon.process is not None
    own0, machine0 = cpu_seconds(daemon.process.pid), machine_busy_s()
    asked = time.time()
    await control.request(daemon.socket, "stop")
    gone = await ops.wait_gone(pids, 0.005)
    machine = machine_busy_s() - machine0
    own = cpu_seconds(daemon.process.pid) - own0
    await daemon.wait_exit(120)
    parts = [f"stop {len(pids)}", *spans(daemon, STOP_STEPS, asked)]
    parts.append(f"none left {1000 * (gone - asked):.0f} ms")
    parts.append(f"CPU: daemon {own:.2f} s, machine {machine:.2f} s")
    return "; ".join(parts)


async def main_async(args: argparse.Namespace) -> None:
    """Every run, alternating the arms."""
    sshd = OpenSsh.create(Path(tempfile.mkdtemp(prefix="tl-sshd-", dir=SCRATCH)))
    home = ops.clean_home(sshd)
    workdir = Path(tempfile.mkdtemp(prefix="tl-", dir=SCRATCH))
    arms = [("new", str(ROOT))] + ([("old", args.old)] if args.old else [])
    try:
        for run in range(args.runs):
            for label, path in arms if run % 2 == 0 else arms[::-1]:
                with on_pythonpath(path):
                    profile = args.profile / f"{label}-{run}.json" if args.profile else None
                    if args.cold:  # the compiled code the agents keep on the "hosts"
                        shutil.rmtree(home / ".cache", ignore_errors=True)
                    print(await one(sshd, workdir, args.hosts, label, profile), flush=True)
    finally:
        sshd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    """Parse the arguments and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--old", help="a checkout to alternate with")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="empty the hosts' code cache before each run (the first start after an upgrade;"
        " the 50 hosts here share one home, where 50 machines would each compile once)",
    )
    parser.add_argument(
        "--profile", type=Path, help="a directory for py-spy profiles of each daemon (speedscope)"
    )
    args = parser.parse_args()
    with_bytecode()
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.old:
        args.old = os.path.realpath(args.old)
    scratch = neutral_directory()
    os.chdir(scratch)
    procs.CHILD_CWD = scratch
    print(f"load average {load_average()}", flush=True)
    asyncio.run(main_async(args))
    print(f"load average {load_average()}", flush=True)


if __name__ == "__main__":
    main()
