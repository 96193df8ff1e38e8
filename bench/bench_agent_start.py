"""The agent's start on a host, for the program another checkout sends and the one this
checkout sends, alternated in one run.

    .venv/bin/python bench/bench_agent_start.py --old CHECKOUT [--runs N] [--python PY ...]

Each run is ``PY -X utf8 -c PROGRAM no-such-mode`` from an empty directory with a bare
environment, as sshd starts it: decompress, compile, run the agent's imports and module body,
print the usage line. ``CHECKOUT`` is a tree holding the old ``supervisor`` package (``git
archive REV supervisor | tar -x -C DIR``); its program is what its ``remote`` module builds.
Runs alternate old/new, then new/old, so a machine that gets busier weighs on both alike.
Prints, per interpreter, the program sizes and the medians of wall time and of CPU time
(user + system, of the child), with new / old ratios. Measurements only.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Prints the program a checkout's ``remote`` sends (``agent_program``, or before it
#: existed, ``packed_program`` of the agent's source; before that, the source itself).
_PROGRAM_OF = """
import sys
sys.path.insert(0, sys.argv[1])
from supervisor import remote
if hasattr(remote, "agent_program"):
    program = remote.agent_program()
elif hasattr(remote, "packed_program"):
    program = remote.packed_program(remote.agent_source())
else:
    program = remote.agent_source()
sys.stdout.write(program)
"""


def program_of(checkout: Path) -> str:
    """The agent program ``checkout``'s supervisor sends (never the measured wrapper)."""
    env = {k: v for k, v in os.environ.items() if k != "REWARD_SUPERVISOR_MEASURE_REMOTE"}
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM_OF, str(checkout)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd="/",
    )
    return done.stdout


def one_start(python: str, program: str, cwd: str, home: str) -> tuple[float, float]:
    """Wall and CPU seconds of one start that ends with the usage line, as user whose home
    is ``home`` (where a program that keeps its compiled code on the host keeps it)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [python, "-X", "utf8", "-c", program, "no-such-mode"],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": home},
        cwd=cwd,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if (done.returncode, done.stderr) != (2, "usage: agent | launcher | shepherd\n"):
        raise SystemExit(f"{python}: not the agent's usage line: {done.stderr[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    """Alternate the two programs ``--runs`` times each on every interpreter."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--python", action="append", default=[])
    parser.add_argument(
        "--cold",
        action="store_true",
        help="every start as on a host that keeps no compiled code (HOME=/): what a host pays"
        " once per version; by default a home directory of the run's own, warmed by the"
        " uncounted first start",
    )
    args = parser.parse_args()
    programs = {"old": program_of(args.old), "new": program_of(ROOT)}
    for name, program in programs.items():
        print(f"{name}: {len(program.encode())} bytes")
    with (
        tempfile.TemporaryDirectory(prefix="bench-agent-start-") as cwd,
        tempfile.TemporaryDirectory(prefix="bench-agent-home-") as warm,
    ):
        home = "/" if args.cold else warm
        for python in args.python or ["/usr/bin/python3"]:
            samples: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
            for name in programs:  # warm the page cache (and the code cache), not counted
                one_start(python, programs[name], cwd, home)
            for i in range(args.runs):
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                for name in order:
                    samples[name].append(one_start(python, programs[name], cwd, home))
            how = "no code cache (HOME=/)" if args.cold else "code cache warm"
            print(f"\n{python} ({args.runs} runs each, {how})")
            print("| | old | new | new / old |")
            print("|---|---|---|---|")
            for label, index in (("wall ms", 0), ("cpu ms", 1)):
                old = statistics.median(s[index] for s in samples["old"]) * 1000
                new = statistics.median(s[index] for s in samples["new"]) * 1000
                print(f"| {label} (median) | {old:.1f} | {new:.1f} | {new / old:.3f} |")


if __name__ == "__main__":
    main()
