"""A/B of the contract operations: the daemon of another checkout against this one's,
alternated in one run, on one real OpenSSH sshd on loopback (``tests/sshd.py``, stock
limits, an empty ``$HOME`` as a service account has).

    .venv/bin/python bench/ops_ab.py --old /work/wt-old [--rounds 3] [--samples 5]
                                     [--fleet 50] [--out FILE]

``--old`` is a checkout (a ``git worktree`` of the old commit, nothing installed into it)
whose ``supervisor`` package the old arm's daemon imports: it goes first on the daemon's
``PYTHONPATH``, and the daemon runs from a directory holding no ``supervisor``
(``bench/ab.py``). Both arms run the same worker, this checkout's reference worker
(``supervisor.demo.worker``, the seed's file contract), so only the supervisor differs.
Each round runs both arms, old first in odd rounds and new first in even ones. Per arm and
round, timed by one observer (``bench.common.StatusWatch``) from the moment the bench acts:

- ``kill -9 -> new pid ready``: SIGKILL the ready worker of a 1-host daemon, until a new
  pid's ready heartbeat is on disk (``--samples`` times, each a first failure);
- ``restart-host -> new pid ready``: the operator's command on the control socket, until a
  new pid's ready heartbeat (``--samples`` times);
- ``start N -> all ready``: ``reward-supervisor run`` spawned, until every host shows a
  ready heartbeat;
- ``stop N -> none left``: ``stop`` on the control socket, until no worker pid is alive.

And, once per round and arm-independent, the floors the targets are stated against: the
worker's own start (spawn -> ready heartbeat) and stop (SIGTERM -> gone), one and N at once,
locally without SSH, and one ``conn.run('true')`` on an open connection.

Prints a markdown table of medians (min-max) with new / old ratios, the load average at the
start and the end; ``--out`` writes it to a file too. Measurements only: nothing asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python bench/ops_ab.py` from a checkout

from bench import ops, procs  # noqa: E402
from bench.ab import Arm, imported_from, neutral_directory, on_pythonpath  # noqa: E402
from bench.common import (  # noqa: E402
    SCRATCH,
    StatusWatch,
    cpu_seconds,
    load_average,
    machine_busy_s,
    machine_facts,
    median,
    raw_connection,
    with_bytecode,
)
from bench.procs import LogIndex, stop_daemon  # noqa: E402
from supervisor import control  # noqa: E402
from tests.sshd import OpenSsh  # noqa: E402

CRASH = "kill -9 -> new pid ready, ms"
RESTART = "restart-host -> new pid ready, ms"


async def single_host(arm: Arm, sshd: OpenSsh, workdir: Path, samples: int) -> None:
    """``samples`` crashes and ``samples`` restart-hosts of one host, alternated."""
    work = workdir / f"{arm.name}-single-{time.monotonic_ns()}"
    work.mkdir()
    daemon = await ops.start_daemon_process(ops.ours_config(sshd, work, 1), work)
    logs = LogIndex(daemon)
    status = StatusWatch([work / "run" / "status" / "worker-0.json"])
    try:
        await ops.wait_files(status, ops.any_ready, "the worker ready", 0.01)
        for _ in range(samples):
            await ops._settle(status)
            before = ops.ready_pids(status)
            pid = next(iter(before.values()))
            assert pid is not None
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            t1 = await ops.wait_files(status, ops.new_ready(before), "crash replaced", 0.002)
            arm.add(CRASH, 1000 * (t1 - t0))
            await ops._settle(status)
            before = ops.ready_pids(status)
            t0 = time.time()
            await control.request(daemon.socket, "restart-host", host="worker-0")
            t1 = await ops.wait_files(status, ops.new_ready(before), "restart replaced", 0.002)
            arm.add(RESTART, 1000 * (t1 - t0))
            # The daemon's own view of the two remote calls, where it logs them.
            for event, name in (
                ("host.terminated", "restart: terminate call (daemon's clock), ms"),
                ("host.launched", "restart: launch call (daemon's clock), ms"),
            ):
                logs.update()
                hits = [
                    line
                    for line in logs.by_event.get(event, [])
                    if isinstance(line.get("elapsed_ms"), int | float)
                ]
                if hits:
                    arm.add(name, float(hits[-1]["elapsed_ms"]))
    finally:
        await stop_daemon(daemon)


async def fleet(arm: Arm, sshd: OpenSsh, workdir: Path, hosts: int) -> None:
    """Start ``hosts`` hosts until all are ready, then stop them until none is left."""
    name = f"{arm.name}-fleet-{time.monotonic_ns()}"
    config = ops.ours_config(sshd, workdir, hosts, root_name=name)
    watch = StatusWatch(workdir / name / "status" / f"worker-{i}.json" for i in range(hosts))
    busy0 = machine_busy_s()
    spawned = time.time()
    daemon = await ops.start_daemon_process(config, workdir)
    try:
        t1 = await ops.wait_files(watch, ops.any_ready, f"{hosts} ready", 0.01)
        arm.add(f"start {hosts} -> all ready, ms", 1000 * (t1 - spawned))
        arm.add(f"start {hosts}: machine CPU (every process), s", machine_busy_s() - busy0)
        assert daemon.process is not None
        arm.add(f"start {hosts}: the daemon's CPU, s", cpu_seconds(daemon.process.pid))
        pids = [p for p in ops.ready_pids(watch).values() if p is not None]
        busy0 = machine_busy_s()
        t0 = time.time()
        await control.request(daemon.socket, "stop")
        t1 = await ops.wait_gone(pids, 0.005)
        arm.add(f"stop {hosts} -> none left, ms", 1000 * (t1 - t0))
        arm.add(f"stop {hosts}: machine CPU (every process), s", machine_busy_s() - busy0)
        await daemon.wait_exit(120)
    finally:
        await stop_daemon(daemon)


async def floors(floor: Arm, sshd: OpenSsh, workdir: Path, hosts: int) -> None:
    """The worker's own start and stop, one and ``hosts`` at once, and one round trip."""
    root = workdir / "floor"
    (root / "status").mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        start_s, stop_s, _busy = await ops._local_workers(root, 1)
        floor.add("worker's own start (spawn -> ready), ms", 1000 * start_s)
        floor.add("worker's own stop (SIGTERM -> gone), ms", 1000 * stop_s)
    start_s, stop_s, busy = await ops._local_workers(root, hosts)
    floor.add(f"{hosts} workers' own start, at once, locally, ms", 1000 * start_s)
    floor.add(f"{hosts} workers' own start: machine CPU (every process), s", busy)
    floor.add(f"{hosts} workers' own stop, at once, locally, ms", 1000 * stop_s)
    conn = await raw_connection(sshd)
    async with conn:
        for _ in range(10):
            t0 = time.perf_counter()
            await conn.run("true", check=True)
            floor.add(
                "conn.run('true') on an open connection, ms", 1000 * (time.perf_counter() - t0)
            )


async def run(old: Arm, new: Arm, floor: Arm, args: argparse.Namespace) -> None:
    """Both arms, ``args.rounds`` times, alternating which goes first."""
    sshd = OpenSsh.create(Path(tempfile.mkdtemp(prefix="ops-ab-sshd-", dir=SCRATCH)))
    ops.clean_home(sshd)
    workdir = Path(tempfile.mkdtemp(prefix="ops-ab-", dir=SCRATCH))
    try:
        for round_ in range(args.rounds):
            await floors(floor, sshd, workdir, args.fleet)
            for arm in (old, new) if round_ % 2 == 0 else (new, old):
                print(f"round {round_ + 1}: {arm.name}", file=sys.stderr, flush=True)
                with on_pythonpath(arm.pythonpath):
                    try:
                        await single_host(arm, sshd, workdir, args.samples)
                        await fleet(arm, sshd, workdir, args.fleet)
                    except (TimeoutError, AssertionError, OSError) as exc:
                        arm.errors.append(f"round {round_ + 1}: {type(exc).__name__}: {exc}")
    finally:
        sshd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def report(old: Arm, new: Arm, floor: Arm, args: argparse.Namespace, started: str) -> str:
    """Markdown: medians (min-max) per arm, new / old, and the floors."""

    def fmt(xs: list[float]) -> str:
        """Median (min-max) of ``xs``."""
        return f"{median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"

    lines = [
        f"# Contract operations A/B: {args.old} (old) against {ROOT} (new)",
        "",
        f"The old arm imports `{old.imported}`, the new arm `{new.imported}`.",
        f"Started {started}; {args.rounds} rounds alternated (old first in odd rounds),"
        f" {args.samples} crashes and restart-hosts per arm and round, a fleet of"
        f" {args.fleet}; load average at the start {args.load_before}, at the end"
        f" {load_average()}.",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()) + ".",
        "",
        "| operation | old | new | new / old |",
        "|---|---:|---:|---:|",
    ]
    metrics: list[str] = []
    for arm in (old, new):
        metrics += [m for m in arm.samples if m not in metrics]
    for metric in metrics:
        a, b = old.samples.get(metric, []), new.samples.get(metric, [])
        ratio = f"{median(b) / median(a):.2f}" if a and b and median(a) else "-"
        lines.append(f"| {metric} | {fmt(a)} | {fmt(b)} | {ratio} |")
    lines += ["", "| floor (no supervisor) | median (min-max) |", "|---|---:|"]
    lines += [f"| {metric} | {fmt(xs)} |" for metric, xs in floor.samples.items()]
    for arm in (old, new):
        if arm.errors:
            lines += ["", f"Errors ({arm.name}):", *(f"- {e}" for e in arm.errors)]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Parse the arguments, run the rounds and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="checkout of the old code (its root)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both arms")
    parser.add_argument(
        "--samples", type=int, default=5, help="crashes and restart-hosts per arm and round"
    )
    parser.add_argument("--fleet", type=int, default=50, help="hosts of start and stop")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    with_bytecode()
    old = Arm("old", os.path.realpath(args.old))
    new = Arm("new", str(ROOT))
    floor = Arm("floor", str(ROOT))
    scratch = neutral_directory()
    os.chdir(scratch)  # the daemons inherit it
    procs.CHILD_CWD = scratch
    for arm in (old, new):
        arm.imported = imported_from(arm)
        print(f"{arm.name} arm imports {arm.imported}", file=sys.stderr, flush=True)
    if old.imported == new.imported:
        parser.error(f"both arms import {old.imported}: --old must be another checkout")
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    args.load_before = load_average()
    asyncio.run(run(old, new, floor, args))
    text = report(old, new, floor, args, started)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
