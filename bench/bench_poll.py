"""Poll mode: what the watcher adds to the poll interval, from a file's stat to its delivery.

    .venv/bin/python bench/bench_poll.py [--hosts 1000] [--seconds 20]

A writer process rewrites N status files once a second each (temp file + rename, staggered
over the second) on /dev/shm; a ``Watcher`` in poll mode (1 s) watches them in this process.
For every heartbeat delivered to the sink, the time since the watcher looked at that file
(its signature taken: ``_poll_signature`` of the watcher's file-thread side, or
``_signature`` in versions that stat every path) is its wait for the rest of the work
between that look and the sink: the remaining paths and the reads before delivery. A change
waits up to one interval for its look by design; this is what comes on top. Also reported:
the CPU this process used over the window (the watcher's loop and file thread; the writer is
another process), in % of one core. To compare two versions, run the script with each on
``PYTHONPATH``. Measurements only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: another checkout's supervisor can be measured

from bench.common import SCRATCH, percentile  # noqa: E402
from supervisor.statusfiles import Observation, StatusObserved  # noqa: E402


def _watcher_module() -> ModuleType:
    """The module holding ``Watcher`` in the code on the path: ``supervisor.statusfiles`` in
    versions before the watcher had a module of its own, else ``supervisor.watch``.

    Asked in that order: with an older checkout on ``PYTHONPATH``, the venv's editable
    install still supplies any module that checkout lacks, so ``supervisor.watch`` would
    import (from the newer tree) even there."""
    statusfiles = importlib.import_module("supervisor.statusfiles")
    if hasattr(statusfiles, "Watcher"):
        return statusfiles
    return importlib.import_module("supervisor.watch")


def _new_watcher(root: Path, hosts: list[str], **settings: Any) -> Any:
    """A ``Watcher`` of ``hosts`` from the code on the path: versions without ``set_hosts``
    ask a callable for the hosts instead of being given them."""
    cls = _watcher_module().Watcher
    return cls(root, hosts if hasattr(cls, "set_hosts") else (lambda: hosts), **settings)


#: Where the watcher's stats are made, in the code on the path (before or after the split).
WATCHING = _watcher_module()
#: The class whose ``_poll_signature`` looks at one path: the file-thread side, or in older
#: versions the watcher itself (or none: those stat every path with ``_signature``).
LOOKER = getattr(WATCHING, "_Disk", WATCHING.Watcher)

WRITER = """
import json, os, sys, time
root, n = sys.argv[1], int(sys.argv[2])
start, seq = time.monotonic(), 0
while True:
    seq += 1
    for i in range(n):
        delay = start + seq - 1 + i / n - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        tmp = f"{root}/status/.h{i:04d}.json.tmp"
        beat = {"pid": 100, "ready": True, "heartbeat_at": time.time(), "seq": seq}
        with open(tmp, "w") as f:
            f.write(json.dumps(beat))
        os.rename(tmp, f"{root}/status/h{i:04d}.json")
"""


async def measure(root: Path, hosts: list[str], seconds: float) -> tuple[list[float], float]:
    """Look -> delivery, in seconds, of every heartbeat delivered during ``seconds``; and this
    process's CPU over that window, in % of one core."""
    stat_at: dict[str, float] = {}
    signature = WATCHING._signature
    poll_signature = getattr(LOOKER, "_poll_signature", None)

    def timed_signature(path: str) -> object:
        """The watcher's stat, with the instant it ran."""
        stat_at[path] = time.monotonic()
        return signature(path)

    def timed_poll_signature(self: object, key: tuple[str, str], previous: object) -> object:
        """The watcher's look at one path, with the instant it ran."""
        if key[1] == "status":
            stat_at[f"{root}/status/{key[0]}.json"] = time.monotonic()
        assert poll_signature is not None
        return poll_signature(self, key, previous)

    if poll_signature is None:
        WATCHING._signature = timed_signature
    else:
        LOOKER._poll_signature = timed_poll_signature
    lags: list[float] = []

    def sink(batch: list[Observation]) -> None:
        """Note each heartbeat's wait since its stat."""
        now = time.monotonic()
        for obs in batch:
            at = stat_at.get(f"{root}/status/{obs.host}.json")
            if isinstance(obs, StatusObserved) and at is not None:
                lags.append(now - at)

    watcher = _new_watcher(
        root,
        hosts,
        mode="poll",
        poll_interval_s=1.0,
        debounce_ms=50,
        rescan_interval_s=3600.0,
    )
    task = asyncio.create_task(watcher.run(sink))
    try:
        await asyncio.sleep(5.0)  # wait-ok: the first sweeps read everything; not measured
        lags.clear()
        cpu_before, wall_before = time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)  # wait-ok: the measurement window itself
        cpu_pct = 100 * (time.process_time() - cpu_before) / (time.monotonic() - wall_before)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        WATCHING._signature = signature
        if poll_signature is not None:
            LOOKER._poll_signature = poll_signature
    return lags, cpu_pct


def main() -> None:
    """Run the writer and the watcher; print the distribution as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-poll-", dir=SCRATCH))
    for sub in ("status", "ctl"):
        (root / sub).mkdir()
    hosts = [f"h{i:04d}" for i in range(args.hosts)]
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(args.hosts)])
    try:
        lags, cpu_pct = asyncio.run(measure(root, hosts, args.seconds))
    finally:
        writer.kill()
        writer.wait()
        subprocess.run(["rm", "-rf", "--", str(root)], check=False)
    ms = [1000 * lag for lag in lags]
    summary = {
        "hosts": args.hosts,
        "delivered": len(ms),
        "p50_ms": round(percentile(ms, 50), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "max_ms": round(max(ms), 1) if ms else None,
        "cpu_pct": round(cpu_pct, 2),
        "code": WATCHING.__file__,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
