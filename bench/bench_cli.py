"""A/B of the command line's start: ``reward-supervisor status`` of another checkout against
this one's, alternated in one run, and what each imports.

    .venv/bin/python bench/bench_cli.py --old /work/wt-cd67813 [--samples 30] [--out FILE]

``--old`` is a checkout (a ``git worktree`` of the old commit, nothing installed into it)
whose ``supervisor`` package the old arm imports: it goes first on ``PYTHONPATH``, and the
commands run from a directory holding no ``supervisor`` (``bench/ab.py``). Both arms run
on this venv's interpreter and libraries, each through its own console script's entry
point (``reward_supervisor:main``, or ``supervisor.cli:main`` in a checkout older than
``reward_supervisor.py``), with bytecode written and reused, as an install has it. Each
sample runs both arms, old first in even samples and new first in odd ones:

- ``status -c MISSING``: a config that does not exist (exit 2): the start alone;
- ``status -c CONFIG``, ``status --json`` and ``restart-host worker-0`` against a control
  socket that answers at once with a 50-host status (``tests/canned.py``, served by this
  process: the daemon's side is the same for both arms and is not what is measured).

Per case and arm: the wall time from spawn to exit and the child's CPU (user + system), as
medians (min-max) with new / old ratios. Then, per arm, the import time of the modules a
command may load (``python -X importtime``, median of the samples), and the share of the
three cores' import spent making their dataclasses. Writes the report to ``--out``
(default ``bench/results/cli-start-DATE.md``). Measurements only: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python bench/bench_cli.py` from a checkout

from bench.ab import Arm, imported_from, neutral_directory, on_pythonpath  # noqa: E402
from bench.common import load_average, machine_facts, median, with_bytecode  # noqa: E402
from tests.canned import CannedDaemon  # noqa: E402

#: Hosts in the config and in the canned status: a mid-sized fleet's table to render.
HOSTS = 50
#: The modules whose import time is reported, in the order a command meets them.
MODULES = (
    "supervisor.cli",
    "supervisor.config",
    "supervisor.policies",
    "supervisor.refusals",
    "supervisor.health",
    "supervisor.leadership",
    "supervisor.fleet",
)
# In the child: time the making of every dataclass while the three cores are imported.
DATACLASS_SHARE = """
import dataclasses, time
made = dataclasses._process_class
spent = [0.0]
def timed(*args, **kwargs):
    t = time.perf_counter()
    try:
        return made(*args, **kwargs)
    finally:
        spent[0] += time.perf_counter() - t
dataclasses._process_class = timed
t = time.perf_counter()
import supervisor.health, supervisor.leadership, supervisor.fleet
print(time.perf_counter() - t, spent[0])
"""


def entry_point(checkout: Path) -> str:
    """The module whose ``main`` the checkout's console script runs."""
    return "reward_supervisor" if (checkout / "reward_supervisor.py").exists() else "supervisor.cli"


def command(entry: str, *args: str) -> list[str]:
    """``reward-supervisor ARGS`` as the console script runs it: import ``main``, call it."""
    script = f"import sys\nfrom {entry} import main\nsys.exit(main())"
    return [sys.executable, "-c", script, *args]


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every child this process has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(argv: list[str], expect: int) -> tuple[float, float]:
    """Run ``argv`` to its end: wall seconds and CPU seconds; its exit status must be
    ``expect`` (else the sample measures a failure and the run stops)."""
    cpu0, wall0 = children_cpu_s(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    wall, cpu = time.perf_counter() - wall0, children_cpu_s() - cpu0
    if done.returncode != expect:
        raise RuntimeError(f"{argv[3:]} exited {done.returncode}: {done.stderr[-500:]}")
    return wall, cpu


def canned_status() -> dict[str, Any]:
    """A daemon's reply to ``status`` for ``HOSTS`` ready hosts, as this checkout's gives it."""
    hosts = {
        f"worker-{i}": {
            "state": "ready",
            "shard": i,
            "pid": 40000 + i,
            "ssh": "connected",
            "heartbeat_age_s": 0.8,
            "restarts": 0,
            "restarts_in_window": 0,
            "failures": 0,
            "last_reason": "heartbeat fresh",
            "next_restart_in_s": None,
            "machine": f"worker-{i}",
            "processed": 1200 + i,
            "in_flight": 3,
            "work": {"completed": 1200 + i, "errors": 1, "queue_depth": 4, "concurrency": 48},
        }
        for i in range(HOSTS)
    }
    daemon = {
        "running": True,
        "pid": os.getpid(),
        "uptime_s": 3600.0,
        "summary": f"{HOSTS}/{HOSTS} ready",
        "watch_mode": "inotify",
        "epoch": 3,
        "all_ready": True,
    }
    return {"ok": True, "daemon": daemon, "hosts": hosts}


def fleet_config(directory: Path, socket: Path) -> Path:
    """A config of ``HOSTS`` hosts, its socket at ``socket``, in the keys every checkout
    since cd67813 takes (a newer example's ``[trainer]`` is unknown to older ones)."""
    quoted = {k: json.dumps(str(v)) for k, v in {"dir": directory, "socket": socket}.items()}
    argv = ["{python}", "-m", "areal.reward.fs_worker", "--root", "{root}", "--shard", "{shard}"]
    argv += ["--host", "{host}", "--concurrency", "{concurrency}"]
    text = f"""
[run]
root = {json.dumps(str(directory / "run"))}
experiment = "bench"
trial = "cli"
reward_fn = "areal.reward.gsm8k.gsm8k_reward_fn"
cleanup_prefix = {quoted["dir"]}

[worker]
argv = {json.dumps(argv)}
python = "/usr/bin/python3"

[ssh]
username = "reward"
client_keys = [{json.dumps(str(directory / "id_ed25519"))}]
known_hosts = {json.dumps(str(directory / "known_hosts"))}

[control]
socket = {quoted["socket"]}
"""
    text += "".join(
        f'\n[[hosts]]\nname = "worker-{i}"\naddress = "10.0.1.{i}"\nshard = {i}\n'
        for i in range(HOSTS)
    )
    path = directory / "rs.toml"
    path.write_text(text, encoding="utf-8")
    return path


def sample_cases(entry: str, config: Path, missing: Path) -> list[tuple[str, list[str], int]]:
    """The cases: a name, the command line and the exit status it must end with."""
    return [
        ("status -c MISSING (exit 2)", command(entry, "status", "-c", str(missing)), 2),
        (f"status, {HOSTS} hosts", command(entry, "status", "-c", str(config)), 0),
        (
            f"status --json, {HOSTS} hosts",
            command(entry, "status", "-c", str(config), "--json"),
            0,
        ),
        ("restart-host", command(entry, "restart-host", "-c", str(config), "worker-0"), 0),
    ]


def import_times(arm: Arm) -> dict[str, tuple[float, float]]:
    """Self and cumulative microseconds of each module of ``MODULES`` the arm has, from one
    fresh ``python -X importtime``."""
    with on_pythonpath(arm.pythonpath):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import " + ", ".join(_present(arm))],
            capture_output=True,
            text=True,
            check=True,
        )
    found: dict[str, tuple[float, float]] = {}
    for line in done.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] in MODULES:
            found[parts[2]] = (float(parts[0]), float(parts[1]))
    return found


def _present(arm: Arm) -> list[str]:
    """The modules of ``MODULES`` the arm's checkout has."""
    base = Path(arm.pythonpath)
    return [m for m in MODULES if (base / (m.replace(".", "/") + ".py")).exists()]


def dataclass_share(arm: Arm) -> tuple[float, float]:
    """Seconds to import the three cores in a fresh interpreter, and of them, making
    dataclasses."""
    with on_pythonpath(arm.pythonpath):
        done = subprocess.run(
            [sys.executable, "-c", DATACLASS_SHARE], capture_output=True, text=True, check=True
        )
    total, spent = done.stdout.split()
    return float(total), float(spent)


def fmt_ms(samples: list[float]) -> str:
    """``median (min-max)`` in milliseconds."""
    if not samples:
        return "-"
    return f"{1000 * median(samples):.1f} ({1000 * min(samples):.1f}-{1000 * max(samples):.1f})"


def ratio(old: list[float], new: list[float]) -> str:
    """new / old of the medians."""
    return f"{median(new) / median(old):.2f}" if old and new and median(old) else "-"


def run(old: Arm, new: Arm, samples: int, work: Path) -> dict[str, Any]:
    """Every sample of every case, alternated; then the import measurements."""
    missing = work / "missing.toml"
    entries = {arm.name: entry_point(Path(arm.pythonpath)) for arm in (old, new)}
    extra: dict[str, Any] = {"entries": entries}
    with CannedDaemon({"status": canned_status(), "restart-host": _restarted}) as daemon:
        config = fleet_config(work, daemon.path)
        cases = {arm.name: sample_cases(entries[arm.name], config, missing) for arm in (old, new)}
        for arm in (old, new):  # warm up: compile each arm's bytecode, fill the page cache
            with on_pythonpath(arm.pythonpath):
                for _, argv, expect in cases[arm.name]:
                    timed_run(argv, expect)
        for i in range(samples):
            for arm in (old, new) if i % 2 == 0 else (new, old):
                with on_pythonpath(arm.pythonpath):
                    for name, argv, expect in cases[arm.name]:
                        wall, cpu = timed_run(argv, expect)
                        arm.add(f"{name}: wall, ms", wall)
                        arm.add(f"{name}: CPU, ms", cpu)
    imports: dict[str, dict[str, list[tuple[float, float]]]] = {"old": {}, "new": {}}
    shares: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for i in range(samples):
        for arm in (old, new) if i % 2 == 0 else (new, old):
            for module, times in import_times(arm).items():
                imports[arm.name].setdefault(module, []).append(times)
            shares[arm.name].append(dataclass_share(arm))
    extra |= {"imports": imports, "shares": shares}
    return extra


def _restarted(request: Any) -> dict[str, Any]:
    """The daemon's answer to ``restart-host``: the host's new row."""
    return {"ok": True, "host": request.get("host"), "state": "stale", "last_reason": "operator"}


def commit_of(checkout: str) -> str:
    """The checkout's commit, and whether its files differ from it."""
    git = ["git", "-C", checkout]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    if head.returncode != 0:
        return "not a git checkout"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def report(old: Arm, new: Arm, extra: dict[str, Any], args: argparse.Namespace) -> str:
    """The markdown report."""
    lines = [
        f"# CLI start A/B: {args.old} (old) against {ROOT} (new)",
        "",
        f"Commits: old {commit_of(old.pythonpath)}, new {commit_of(new.pythonpath)}.",
        "",
        f"The old arm imports `{old.imported}` (entry `{extra['entries']['old']}:main`), the"
        f" new arm `{new.imported}` (entry `{extra['entries']['new']}:main`).",
        f"Started {args.started}; {args.samples} samples per case and arm, alternated (old"
        f" first in even samples); load average at the start {args.load_before}, at the end"
        f" {load_average()}.",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()) + ".",
        "",
        "| case | old | new | new / old |",
        "|---|---:|---:|---:|",
    ]
    for metric in old.samples:
        a, b = old.samples[metric], new.samples.get(metric, [])
        lines.append(f"| {metric} | {fmt_ms(a)} | {fmt_ms(b)} | {ratio(a, b)} |")
    lines += [
        "",
        "Import time, ms, median of one fresh `python -X importtime` per sample (self:"
        " the module's own code; cumulative: with what it imports first):",
        "",
        "| module | old self | old cumulative | new self | new cumulative |",
        "|---|---:|---:|---:|---:|",
    ]
    imports = extra["imports"]
    for module in MODULES:
        cells = []
        for name in ("old", "new"):
            times = imports[name].get(module)
            if not times:
                cells += ["-", "-"]
                continue
            cells += [f"{median([t[0] for t in times]) / 1000:.1f}"]
            cells += [f"{median([t[1] for t in times]) / 1000:.1f}"]
        lines.append(f"| `{module}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The three cores (health, leadership, fleet) imported in a fresh interpreter:",
        "",
    ]
    for name in ("old", "new"):
        shares = extra["shares"][name]
        total = median([s[0] for s in shares])
        spent = median([s[1] for s in shares])
        lines.append(
            f"- {name}: {1000 * total:.1f} ms, of which making dataclasses {1000 * spent:.1f} ms"
            f" ({100 * spent / total:.0f} %)"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Parse the arguments, run the samples, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="checkout of the old code (its root)")
    parser.add_argument("--samples", type=int, default=30, help="samples per case and arm")
    parser.add_argument("--out", type=Path, help="write the report here")
    args = parser.parse_args()
    with_bytecode()
    old = Arm("old", os.path.realpath(args.old))
    new = Arm("new", str(ROOT))
    scratch = neutral_directory()
    os.chdir(scratch)  # `python -c` puts the working directory first on sys.path
    for arm in (old, new):
        arm.imported = imported_from(arm)
        print(f"{arm.name} arm imports {arm.imported}", file=sys.stderr, flush=True)
    if old.imported == new.imported:
        parser.error(f"both arms import {old.imported}: --old must be another checkout")
    args.started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    args.load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as work:
        extra = run(old, new, args.samples, Path(work))
    text = report(old, new, extra, args)
    print(text)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d-%H%M")
    out: Path = args.out or ROOT / "bench" / "results" / f"cli-start-{stamp}.md"
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
