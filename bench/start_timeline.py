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
from bench.common import SCRATCH, StatusWatch, iso_to_epoch, load_average  # noqa: E402
from bench.procs import LogIndex, stop_daemon  # noqa: E402
from tests.sshd import OpenSsh  # noqa: E402

STEPS = ("ssh.connected", "agent.started", "host.launch_begin", "host.launched")


async def one(sshd: OpenSsh, workdir: Path, hosts: int, label: str) -> str:
    """One start of ``hosts``: each step's first and last time after the spawn, in ms."""
    name = f"tl-{time.monotonic_ns()}"
    config = ops.ours_config(sshd, workdir, hosts, root_name=name)
    watch = StatusWatch(workdir / name / "status" / f"worker-{i}.json" for i in range(hosts))
    spawned = time.time()
    daemon = await ops.start_daemon_process(config, workdir)
    try:
        ready = await ops.wait_files(watch, ops.any_ready, "all ready", 0.01)
        logs = LogIndex(daemon)
        logs.update()
        parts = [label]
        for step in STEPS:
            stamps = sorted(iso_to_epoch(x["timestamp"]) for x in logs.by_event.get(step, []))
            if stamps:
                parts.append(
                    f"{step} {1000 * (stamps[0] - spawned):.0f}-{1000 * (stamps[-1] - spawned):.0f}"
                )
        parts.append(f"all ready {1000 * (ready - spawned):.0f} ms")
        return "; ".join(parts)
    finally:
        await stop_daemon(daemon)


async def main_async(args: argparse.Namespace) -> None:
    """Every run, alternating the arms."""
    sshd = OpenSsh.create(Path(tempfile.mkdtemp(prefix="tl-sshd-", dir=SCRATCH)))
    ops.clean_home(sshd)
    workdir = Path(tempfile.mkdtemp(prefix="tl-", dir=SCRATCH))
    arms = [("new", str(ROOT))] + ([("old", args.old)] if args.old else [])
    try:
        for run in range(args.runs):
            for label, path in arms if run % 2 == 0 else arms[::-1]:
                with on_pythonpath(path):
                    print(await one(sshd, workdir, args.hosts, label), flush=True)
    finally:
        sshd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    """Parse the arguments and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--old", help="a checkout to alternate with")
    args = parser.parse_args()
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
