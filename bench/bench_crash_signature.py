"""A bad deploy (every worker exits 1 at start) under the supervisor of another checkout and
under this one, side by side in one run: how many launches each makes.

    .venv/bin/python bench/bench_crash_signature.py --old /work/wt/alerts-old [--hosts 20]
                                                     [--minutes 5] [--out FILE]

``--old`` is a checkout (a ``git worktree`` of the code before the crash-signature rule) whose
``supervisor`` package the old arm's daemon imports; the new arm runs this checkout. Both
daemons run at the same time for ``--minutes``, each with its own run directory and
``--hosts`` hosts on one real OpenSSH sshd on loopback, with the production defaults of
``[health]`` and ``[fleet]`` (cooldown 30 s doubling to 300 s, signature at 3 hosts in 300 s).
Every worker's argv names a worker module the venv lacks, as a deploy that left it out would:
python exits 1 at once with "No module named ..." (a reward fn that cannot be imported no
longer stops a worker: the real worker and the reference one answer its tasks with errors).
Counted from each daemon's log: launches begun (``host.launch_begin``) per minute and
per host, ``fleet.crash_signature`` events; the daemon's CPU time. Measurements only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python bench/...` from a checkout

from bench.ab import neutral_directory, on_pythonpath  # noqa: E402
from bench.common import cpu_seconds, load_average, machine_facts  # noqa: E402
from tests.faults.harness import wall, write_config_atomic  # noqa: E402
from tests.sshd import OpenSsh  # noqa: E402
from tests.system.daemonproc import FAST_WORKER_ARGV, DaemonProcess  # noqa: E402

#: A worker module that is not installed: python exits 1 at once ("No module named ...").
BAD_WORKER_MODULE = "supervisor.demo.worker_v2"
#: The daemon is given this long to stop its (mostly held or cooling) hosts at the end.
STOP_S = 120.0


@dataclass
class Arm:
    """One side of the comparison and what it did."""

    name: str
    pythonpath: str
    daemon: DaemonProcess | None = None
    imported: str = "?"
    started_at: float = 0.0
    cpu_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def launches(self) -> list[dict[str, Any]]:
        """Every launch the daemon began, in order."""
        assert self.daemon is not None
        return [line for line in self.daemon.lines if line.get("event") == "host.launch_begin"]

    def events(self, event: str) -> list[dict[str, Any]]:
        """Every log line of ``event``."""
        assert self.daemon is not None
        return [line for line in self.daemon.lines if line.get("event") == event]


def bad_deploy_config(openssh: OpenSsh, workdir: Path, hosts: int) -> Path:
    """``hosts`` workers whose module is not installed; default policies."""
    raw = openssh.config_dict(workdir / "run", hosts, argv=FAST_WORKER_ARGV)
    raw["worker"]["argv"] = [
        BAD_WORKER_MODULE if arg == "supervisor.demo.worker" else arg for arg in FAST_WORKER_ARGV
    ]
    raw["control"]["socket"] = str(workdir / "control.sock")
    return write_config_atomic(workdir / "rs.toml", raw)


async def imported_by(arm: Arm) -> str:
    """Where a child process of ``arm`` imports ``supervisor`` from."""
    with on_pythonpath(arm.pythonpath):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import supervisor; print(supervisor.__file__)",
            stdout=asyncio.subprocess.PIPE,
        )
    out, _ = await proc.communicate()
    return out.decode().strip()


async def run_arms(
    arms: list[Arm], openssh: OpenSsh, tmp: Path, hosts: int, seconds: float, logs: Path | None
) -> None:
    """Start every arm's daemon at once, let them run ``seconds``, stop them."""
    for arm in arms:
        arm.imported = await imported_by(arm)
        print(f"{arm.name} arm imports {arm.imported}", file=sys.stderr, flush=True)
        workdir = tmp / arm.name
        workdir.mkdir()
        arm.daemon = DaemonProcess(bad_deploy_config(openssh, workdir, hosts), workdir)
    for arm in arms:
        assert arm.daemon is not None
        with on_pythonpath(arm.pythonpath):
            await arm.daemon.start()  # the child's environment is copied before the await
        arm.started_at = time.time()
    await asyncio.sleep(seconds)  # wait-ok: the measured window is the benchmark
    for arm in arms:
        assert arm.daemon is not None
        assert arm.daemon.process is not None
        if arm.daemon.process.returncode is not None:
            arm.notes.append(
                f"the daemon exited early, code {arm.daemon.process.returncode}:"
                f" {arm.daemon.tail()}"
            )
            continue
        arm.cpu_s = cpu_seconds(arm.daemon.process.pid)
        arm.daemon.send_signal(signal.SIGTERM)
    for arm in arms:
        assert arm.daemon is not None
        try:
            await arm.daemon.wait_exit(STOP_S)
        except AssertionError as exc:
            arm.notes.append(f"did not stop in {STOP_S:g} s: {exc}")
        await arm.daemon.aclose()
        if logs is not None:  # the daemon's every line, for a post-mortem
            with (logs / f"{arm.name}.jsonl").open("w") as out:
                out.writelines(json.dumps(line) + "\n" for line in arm.daemon.lines)


def report(arms: list[Arm], args: argparse.Namespace, started: str) -> str:
    """The markdown section: launches per minute, per host, signature events, CPU."""
    seconds = args.minutes * 60
    minutes = int(-(-seconds // 60))
    lines = [
        f"Bad deploy of {args.hosts} hosts (every worker exits 1 at start), {args.minutes:g} min,"
        f" both arms at once, started {started}; load average at the end {load_average()}.",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()) + ".",
        "",
        "| arm | launches | of them restarts | "
        + " | ".join(f"min {m + 1}" for m in range(minutes))
        + " | most by one host | fleet.crash_signature | daemon CPU s |",
        "|---|---:|---:|" + "---:|" * minutes + "---:|---:|---:|",
    ]
    totals: dict[str, int] = {}
    for arm in arms:
        launches = [x for x in arm.launches() if wall(x) - arm.started_at < seconds]
        totals[arm.name] = len(launches)
        per_minute = Counter(int((wall(x) - arm.started_at) // 60) for x in launches)
        per_host = Counter(str(x.get("host")) for x in launches)
        signatures = arm.events("fleet.crash_signature")
        lines.append(
            f"| {arm.name} (`{arm.imported}`) | {len(launches)} | {len(launches) - args.hosts} | "
            + " | ".join(str(per_minute.get(m, 0)) for m in range(minutes))
            + f" | {max(per_host.values(), default=0)} | {len(signatures)} | {arm.cpu_s:.1f} |"
        )
    old, new = totals.get("old", 0), totals.get("new", 0)
    if old:
        restarts_old, restarts_new = old - args.hosts, new - args.hosts
        lines += [
            "",
            f"new / old launches: {new / old:.2f}; restarts (launches after each host's first):"
            f" {restarts_new} against {restarts_old}"
            + (f" ({restarts_new / restarts_old:.2f})" if restarts_old > 0 else ""),
        ]
    for arm in arms:
        for line in arm.events("fleet.crash_signature"):
            lines.append(
                f"\n{arm.name}: `fleet.crash_signature` canary {line.get('canary')},"
                f" hosts {len(line.get('hosts') or [])}, signature `{line.get('signature')}`"
            )
        lines += [f"\n{arm.name}: {note}" for note in arm.notes]
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> str:
    """Run both arms in a temporary directory; the report."""
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    arms = [Arm("old", str(args.old)), Arm("new", str(ROOT))]
    with tempfile.TemporaryDirectory(prefix="rs-crashsig-") as name:
        tmp = Path(name)
        openssh = OpenSsh.create(tmp / "sshd")
        try:
            await run_arms(arms, openssh, tmp, args.hosts, args.minutes * 60, args.logs)
        finally:
            openssh.stop()
    if arms[0].imported == arms[1].imported:
        raise SystemExit(f"both arms import {arms[0].imported}: --old must be another checkout")
    return report(arms, args, started)


def main() -> None:
    """Parse the arguments, run both arms side by side, print (and write) the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="checkout of the old code (its root)")
    parser.add_argument("--hosts", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--logs", type=Path, help="write each daemon's log lines here")
    args = parser.parse_args()
    if args.logs is not None:
        args.logs = args.logs.resolve()
        args.logs.mkdir(parents=True, exist_ok=True)
    args.old = Path(args.old).resolve()  # before the chdir below
    os.chdir(neutral_directory())  # `python -m` puts the cwd first: no `supervisor` there
    text = asyncio.run(main_async(args))
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
