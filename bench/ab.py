"""A/B: the supervisor of another checkout against this one, alternated in one run.

    .venv/bin/python bench/ab.py --old /work/wt/old [--rounds 2] [--hosts 100 1000]
                                 [--modes inotify,poll] [--exits 100] [--crashes 10] [--starts 3]
                                 [--out FILE]

``--old`` is a checkout (a ``git worktree`` of the old commit) whose ``supervisor`` package
the old arm imports (it goes first on ``PYTHONPATH`` of every process the arm spawns: the
daemon and the fleet simulator alike); the new arm runs this checkout. Each round runs both
arms, old first in odd rounds and new first in even ones, so a machine that gets busier or
quieter during the run weighs on both alike. Per arm and round:

- ``scale`` at each of ``--hosts`` simulated fleet sizes, in each of ``--modes``
  (``bench/scale.py``): the daemon's steady CPU, and crash (the simulator's SIGKILL) ->
  ``host.state`` / -> launch issued (``host.launch_begin``), first heartbeat -> ``ready``,
  p50 and p99 of ``--exits`` crashes (nearest rank: of 40 the p99 is the largest, of 100
  the second largest);
- with ``--crashes N``, ``bench/bench_crash.py`` on the real sshd, each watch mode: crash ->
  launch issued, -> replacement ready, and the worker's own start-up;
- with ``--starts N`` (0 skips it), ``simstart`` of 50 simulated hosts
  (``bench/simstart.py``): spawn -> every host ready.

Prints a markdown table of medians over the rounds with new / old ratios, and writes it to
``--out`` if given. Measurements only; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python bench/ab.py` from a checkout

from bench import bench_crash, procs, scale, simstart  # noqa: E402
from bench.common import load_average, machine_facts, median, percentile  # noqa: E402


@dataclass
class Arm:
    """One side of the comparison and every sample it gave."""

    name: str
    pythonpath: str
    samples: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    imported: str = "?"

    def add(self, metric: str, value: float) -> None:
        """Record one sample of ``metric``."""
        self.samples.setdefault(metric, []).append(value)


@contextmanager
def on_pythonpath(path: str) -> Iterator[None]:
    """Child processes started inside import ``supervisor`` from ``path``."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


async def one_round(
    arm: Arm,
    sizes: list[int],
    window_s: float,
    starts: int,
    modes: tuple[str, ...],
    crashes: int,
    exits: int,
) -> None:
    """Every measurement once for ``arm``."""
    with on_pythonpath(arm.pythonpath):
        for hosts in sizes:
            for mode in modes:
                result = await scale.run_scale(
                    hosts, mode, window_s=window_s, exit_samples=exits, floor_parts=()
                )
                arm.errors += [f"scale {hosts} {mode}: {e}" for e in result.errors]
                where = f"{hosts} hosts, {mode}"
                if result.cpu is not None:
                    cpu = 100 * result.cpu.cpu_s / result.cpu.seconds
                    arm.add(f"{where}: daemon CPU, % of a core", cpu)
                    arm.add(f"{where}: daemon RSS, MB", result.cpu.rss_end / 1e6)
                for label, samples in (
                    ("crash -> host.state", result.crash_to_state),
                    ("crash -> launch issued", result.crash_to_launch),
                    ("first heartbeat -> ready", result.beat_to_ready),
                ):
                    if samples:
                        arm.add(f"{where}: {label}, p50 ms", 1000 * percentile(samples, 50))
                        arm.add(f"{where}: {label}, p99 ms", 1000 * percentile(samples, 99))
        if crashes:
            for mode in modes:
                try:
                    found = await bench_crash.run_crash(mode, crashes)
                except (TimeoutError, AssertionError, RuntimeError, OSError) as exc:
                    arm.errors.append(f"crash {mode}: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                for label, samples in found.items():
                    if samples:
                        where = f"real sshd, {mode}: {label}"
                        arm.add(f"{where}, p50 ms", 1000 * percentile(samples, 50))
                        arm.add(f"{where}, p99 ms", 1000 * percentile(samples, 99))
        if starts > 0:
            start = await simstart.run_simstart(50, starts)
            arm.errors += [f"simstart: {e}" for e in start.errors]
            for value in start.all_ready:
                arm.add("start 50 simulated hosts: all ready, ms", 1000 * value)


def neutral_directory() -> Path:
    """A working directory for both arms with ``bench`` and ``tests`` but no ``supervisor``.

    ``python -m`` and ``python -c`` put the working directory first on ``sys.path``, before
    ``PYTHONPATH``: run from this checkout, the old arm's daemon would import the new package.
    """
    scratch = Path(tempfile.mkdtemp(prefix="ab-cwd-"))
    for name in ("bench", "tests"):
        (scratch / name).symlink_to(ROOT / name)
    return scratch


def imported_from(arm: Arm) -> str:
    """Where a child process of ``arm`` imports ``supervisor`` from (printed, and reported)."""
    with on_pythonpath(arm.pythonpath):
        out = subprocess.run(
            [sys.executable, "-c", "import supervisor; print(supervisor.__file__)"],
            capture_output=True,
            text=True,
            check=True,
        )
    return out.stdout.strip()


def report(old: Arm, new: Arm, args: argparse.Namespace, started: str) -> str:
    """The markdown table: medians per arm and the ratio new / old."""
    lines = [
        f"# A/B: {args.old} (old) against {ROOT} (new)",
        "",
        f"The old arm imports `{old.imported}`, the new arm `{new.imported}`.",
        "",
        f"Started {started}; {args.rounds} rounds, alternated; {args.hosts} simulated hosts,"
        f" {args.window:g} s CPU windows, watch modes {args.modes}, {args.exits} simulated"
        f" crashes per size and mode, {args.crashes} crashes per"
        f" mode on the real sshd; load average at the start {args.load_before}, at the end"
        f" {load_average()}.",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()) + ".",
        "",
        "| measurement | old | new | new / old |",
        "|---|---:|---:|---:|",
    ]
    metrics: list[str] = []
    for arm in (old, new):
        metrics += [m for m in arm.samples if m not in metrics]
    fmt: Callable[[list[float]], str] = lambda xs: (  # noqa: E731
        f"{median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"
    )
    for metric in metrics:
        a, b = old.samples.get(metric, []), new.samples.get(metric, [])
        ratio = f"{median(b) / median(a):.2f}" if a and b and median(a) else "-"
        lines.append(f"| {metric} | {fmt(a)} | {fmt(b)} | {ratio} |")
    for arm in (old, new):
        if arm.errors:
            lines += ["", f"Errors ({arm.name}):", *(f"- {e}" for e in arm.errors)]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Parse the arguments, run the rounds and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="checkout of the old code (its root)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both arms")
    parser.add_argument(
        "--hosts", type=int, nargs="+", default=[1000], help="simulated fleet sizes for scale"
    )
    parser.add_argument("--window", type=float, default=20.0, help="CPU window, seconds")
    parser.add_argument(
        "--crashes", type=int, default=0, help="crashes per watch mode on the real sshd"
    )
    parser.add_argument(
        "--exits", type=int, default=40, help="simulated crashes per fleet size and watch mode"
    )
    parser.add_argument(
        "--starts", type=int, default=3, help="simstart samples per round (0: none)"
    )
    parser.add_argument(
        "--modes",
        default="inotify,poll",
        help="watch modes of the scale runs, comma-separated (inotify, poll)",
    )
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - {"inotify", "poll"}
    if unknown:
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))} (inotify, poll)")
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
    modes = tuple(m for m in args.modes.split(",") if m)
    for round_ in range(args.rounds):
        for arm in (old, new) if round_ % 2 == 0 else (new, old):
            print(f"round {round_ + 1}: {arm.name}", file=sys.stderr, flush=True)
            await one_round(
                arm, args.hosts, args.window, args.starts, modes, args.crashes, args.exits
            )


if __name__ == "__main__":
    main()
