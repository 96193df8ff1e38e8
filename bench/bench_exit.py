"""A/B: from SIGTERM to the daemon's exit, another checkout's supervisor against this one.

    .venv/bin/python bench/bench_exit.py --old /tmp/old [--rounds 6] [--hosts 50] [--out FILE]

``--old`` is a checkout whose ``supervisor`` package the old arm imports (first on
``PYTHONPATH`` of its daemon, as in ``bench/ab.py``); the new arm runs this checkout. Each
sample is a fresh fleet of ``--hosts`` simulated hosts (``bench/fleetsim.py --fresh``, the
simulator serving every host in one process), a new ``reward-supervisor run`` that launches
every worker, and once all are ready a SIGTERM; the arms alternate, old first in odd rounds.
Per sample, on this machine's wall clock:

- SIGTERM -> ``daemon.stopped`` logged (its timestamp): the stop itself (every worker
  terminated, the history saved, connections closed, the lock let go);
- ``daemon.stopped`` -> the process gone (its exit seen by the asyncio child watcher, the
  same in both arms): what the process does after it said it stopped;
- SIGTERM -> the process gone;
- whether ``daemon.stopped`` was the last line.

Prints a markdown table of medians (min-max) with new / old ratios, and writes it to
``--out`` if given. Measurements only; nothing here asserts a time.
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
    sys.path.insert(0, str(ROOT))  # `python bench/bench_exit.py` from a checkout

from bench import procs, simstart  # noqa: E402
from bench.ab import Arm, imported_from, neutral_directory, on_pythonpath  # noqa: E402
from bench.common import SCRATCH, iso_to_epoch, load_average, machine_facts, median  # noqa: E402
from bench.procs import LogIndex, SimProcess  # noqa: E402
from tests.system.daemonproc import DaemonProcess  # noqa: E402

#: The simulator's heartbeat_stale_s (nothing goes stale here).
STALE_S = 5.0
WAIT_S = 300.0

STOP = "SIGTERM -> daemon.stopped logged, ms"
AFTER = "daemon.stopped logged -> process gone, ms"
TOTAL = "SIGTERM -> process gone, ms"
LAST = "daemon.stopped the last line, samples"


async def one_sample(arm: Arm, hosts: int) -> None:
    """A fresh fleet, a daemon of ``arm`` launching every worker, then its stop timed."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-exit-{hosts}-", dir=SCRATCH))
    sim = SimProcess(workdir, hosts, agents="inproc", watch="inotify", stale_s=STALE_S, fresh=True)
    daemon: DaemonProcess | None = None
    try:
        ready = await sim.start()
        daemon = DaemonProcess(Path(ready["config"]), workdir)
        logs = LogIndex(daemon)
        with on_pythonpath(arm.pythonpath):
            await daemon.start()
        names = [f"sim-{i:04d}" for i in range(hosts)]
        await simstart._wait_all_launched_ready(daemon, logs, names, WAIT_S)
        term_at, stopped_at, gone_at = await _timed_stop(daemon)
        arm.add(STOP, 1000 * (stopped_at - term_at))
        arm.add(AFTER, 1000 * (gone_at - stopped_at))
        arm.add(TOTAL, 1000 * (gone_at - term_at))
        arm.add(LAST, 1.0 if daemon.lines[-1].get("event") == "daemon.stopped" else 0.0)
    except (TimeoutError, AssertionError, RuntimeError) as exc:
        arm.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        if daemon is not None:
            await daemon.aclose()
        await sim.aclose()
        shutil.rmtree(workdir, ignore_errors=True)


async def _timed_stop(daemon: DaemonProcess) -> tuple[float, float, float]:
    """SIGTERM the daemon; when it was sent, when ``daemon.stopped`` says it stopped, and
    when the process was seen gone (wall clock). RuntimeError if it did not stop cleanly."""
    term_at = time.time()
    daemon.send_signal(signal.SIGTERM)
    code = await daemon.wait_exit(WAIT_S)
    gone_at = time.time()
    stopped = [line for line in daemon.lines if line.get("event") == "daemon.stopped"]
    if code != 0 or not stopped:
        raise RuntimeError(f"the daemon exited {code}, {len(stopped)} daemon.stopped lines")
    return term_at, iso_to_epoch(stopped[-1]["timestamp"]), gone_at


def report(old: Arm, new: Arm, args: argparse.Namespace, started: str) -> str:
    """The markdown table: medians (min-max) per arm and the ratio new / old."""
    lines = [
        f"# Exit after SIGTERM: {args.old} (old) against {ROOT} (new)",
        "",
        f"The old arm imports `{old.imported}`, the new arm `{new.imported}`.",
        "",
        f"Started {started}; {args.rounds} rounds, alternated; {args.hosts} simulated hosts,"
        f" a fresh fleet per sample; load average at the start {args.load_before}, at the end"
        f" {load_average()}.",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()) + ".",
        "",
        "| measurement | old | new | new / old |",
        "|---|---:|---:|---:|",
    ]
    for metric in (STOP, AFTER, TOTAL):
        a, b = old.samples.get(metric, []), new.samples.get(metric, [])
        ratio = f"{median(b) / median(a):.2f}" if a and b and median(a) else "-"
        lines.append(f"| {metric} | {_fmt(a)} | {_fmt(b)} | {ratio} |")
    a, b = old.samples.get(LAST, []), new.samples.get(LAST, [])
    lines.append(f"| {LAST} | {sum(a):.0f} of {len(a)} | {sum(b):.0f} of {len(b)} | |")
    for arm in (old, new):
        if arm.errors:
            lines += ["", f"Errors ({arm.name}):", *(f"- {e}" for e in arm.errors)]
    return "\n".join(lines) + "\n"


def _fmt(samples: list[float]) -> str:
    return f"{median(samples):.0f} ({min(samples):.0f}-{max(samples):.0f})" if samples else "-"


def main() -> None:
    """Parse the arguments, run the rounds and print the report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--old", required=True, help="checkout of the old code (its root)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of both arms")
    parser.add_argument("--hosts", type=int, default=50, help="simulated hosts per fleet")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    old = Arm("old", os.path.realpath(args.old))
    new = Arm("new", str(ROOT))
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
    asyncio.run(run(old, new, args))
    text = report(old, new, args, started)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


async def run(old: Arm, new: Arm, args: argparse.Namespace) -> None:
    """Both arms, ``args.rounds`` times, alternating which goes first."""
    for round_ in range(args.rounds):
        for arm in (old, new) if round_ % 2 == 0 else (new, old):
            print(f"round {round_ + 1}: {arm.name}", file=sys.stderr, flush=True)
            await one_sample(arm, args.hosts)


if __name__ == "__main__":
    main()
