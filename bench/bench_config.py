"""A/B: how long reading a large fleet's config takes, another checkout against this one.

    .venv/bin/python -m bench.bench_config --old /tmp/old [--hosts 1000] [--rounds 7]
                                           [--loads 20]

``--old`` is a directory holding the ``supervisor`` package of the old commit (for example
``git archive <rev> supervisor | tar -x -C /tmp/old``). One config of ``--hosts`` hosts, with
every section set, is written once; each arm runs in a fresh interpreter whose ``supervisor``
comes from its checkout, and times ``config.load`` (read, TOML, validation) and
``config.parse`` (validation alone, of the already parsed document) ``--loads`` times each,
keeping the median. Arms alternate, old first in odd rounds, so a machine that gets busier
weighs on both alike. Prints the medians over the rounds and the new / old ratios.
Measurements only; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Run in each arm's interpreter: prints {"load": s, "parse": s}, medians of per-call seconds.
CHILD = """
import json, statistics, sys, time, tomllib
from pathlib import Path
from supervisor import config
path, loads = Path(sys.argv[1]), int(sys.argv[2])
raw = tomllib.loads(path.read_text())
config.load(path)  # warm: first-call imports and caches
def per_call(fn):
    runs = []
    for _ in range(loads):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)
print(json.dumps({
    "load": per_call(lambda: config.load(path)),
    "parse": per_call(lambda: config.parse(raw, path)),
    "module": config.__file__,
}))
"""


def write_config(path: Path, hosts: int) -> None:
    """A valid config of ``hosts`` hosts that sets keys of every section."""
    lines = [
        "[run]",
        'root = "/shared/reward/bench-run"',
        'cleanup_prefix = "/shared/reward"',
        'experiment = "bench"',
        'trial = "t1"',
        f"shard_count = {hosts}",
        'forbid_hosts = ["head", "login"]',
        "[worker]",
        'python = "/opt/venv/bin/python"',
        'env = { OMP_NUM_THREADS = "1", PYTHONUNBUFFERED = "1" }',
        "[health]",
        "ready_timeout_s = 90",
        "max_restarts = 5",
        "permanent_exit_codes = [3, 4]",
        'evidence_stacks = "signal"',
        "[trainer]",
        "heartbeat_stale_s = 15",
        "[ssh]",
        'username = "reward"',
        'known_hosts = "/etc/reward-supervisor/known_hosts"',
        'client_keys = ["/etc/reward-supervisor/id_ed25519"]',
        "connect_timeout_s = 30",
        "[watch]",
        'mode = "poll"',
        "poll_interval_s = 1.0",
        "[fleet]",
        "max_concurrent_launches = 32",
        "[metrics]",
        'listen = "9100"',
        "[ha]",
        "check_interval_s = 5",
    ]
    for i in range(hosts):
        lines += ["[[hosts]]", f'name = "worker-{i:04d}"', f"shard = {i}"]
        # Half the hosts are reached by their name (the default address), half by an IP.
        if i % 2:
            lines += [f'address = "10.{i // 65536}.{i // 256 % 256}.{i % 256}"', "concurrency = 48"]
    path.write_text("\n".join(lines) + "\n")


def run_arm(pythonpath: str, path: Path, loads: int) -> dict[str, float | str]:
    """One arm's medians, measured in a fresh interpreter importing from ``pythonpath``."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(loads)],
        env=env,
        # `-c` puts the working directory first on sys.path: not a checkout's.
        cwd=path.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, float | str] = json.loads(out)
    return result


def main() -> None:
    """Alternate the arms over the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="directory holding the old supervisor/")
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--loads", type=int, default=20)
    args = parser.parse_args()
    arms = {"old": str(Path(args.old).resolve()), "new": str(ROOT)}
    samples: dict[tuple[str, str], list[float]] = {}
    modules: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-config-") as tmp:
        path = Path(tmp) / "fleet.toml"
        write_config(path, args.hosts)
        for round_ in range(args.rounds):
            order = ["old", "new"] if round_ % 2 == 0 else ["new", "old"]
            for arm in order:
                result = run_arm(arms[arm], path, args.loads)
                modules[arm] = str(result["module"])
                for metric in ("load", "parse"):
                    samples.setdefault((arm, metric), []).append(float(result[metric]))
    print(f"config of {args.hosts} hosts, {args.rounds} rounds x {args.loads} loads per arm")
    for arm, module in modules.items():
        print(f"- {arm}: {module}")
    print()
    print("| metric | old | new | new / old |")
    print("|---|---|---|---|")
    for metric in ("load", "parse"):
        old = statistics.median(samples[("old", metric)])
        new = statistics.median(samples[("new", metric)])
        print(f"| {metric} | {old * 1000:.2f} ms | {new * 1000:.2f} ms | {new / old:.2f} |")


if __name__ == "__main__":
    main()
