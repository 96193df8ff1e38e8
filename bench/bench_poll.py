"""Poll mode: what the watcher adds to the poll interval, from a file's stat to its delivery.

    .venv/bin/python bench/bench_poll.py [--hosts 1000] [--seconds 20]

A writer process rewrites N status files once a second each (temp file + rename, staggered
over the second) on /dev/shm; a ``Watcher`` in poll mode (1 s) watches them in this process.
For every heartbeat delivered to the sink, the time since the watcher looked at that file
(its signature taken: ``Watcher._poll_signature``, or ``statusfiles._signature`` in versions
that stat every path) is its wait for the rest of the work between that look and the sink:
the remaining paths and the reads before delivery. A change waits up to one interval for its
look by design; this is what comes on top. Also reported: the CPU this process used over the
window (the watcher's loop and file thread; the writer is another process), in % of one
core. To compare two versions, run the script with each on ``PYTHONPATH``. Measurements
only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: another checkout's supervisor can be measured

from bench.common import SCRATCH, percentile  # noqa: E402
from supervisor import statusfiles  # noqa: E402
from supervisor.statusfiles import Observation, StatusObserved, Watcher  # noqa: E402

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
    signature = statusfiles._signature
    poll_signature = getattr(Watcher, "_poll_signature", None)

    def timed_signature(path: str) -> statusfiles._Signature:
        """The watcher's stat, with the instant it ran."""
        stat_at[path] = time.monotonic()
        return signature(path)

    def timed_poll_signature(self: Watcher, key: tuple[str, str], previous: object) -> object:
        """The watcher's look at one path, with the instant it ran."""
        if key[1] == "status":
            stat_at[f"{root}/status/{key[0]}.json"] = time.monotonic()
        assert poll_signature is not None
        return poll_signature(self, key, previous)

    if poll_signature is None:
        statusfiles._signature = timed_signature
    else:
        Watcher._poll_signature = timed_poll_signature  # type: ignore[method-assign,assignment]
    lags: list[float] = []

    def sink(batch: list[Observation]) -> None:
        """Note each heartbeat's wait since its stat."""
        now = time.monotonic()
        for obs in batch:
            at = stat_at.get(f"{root}/status/{obs.host}.json")
            if isinstance(obs, StatusObserved) and at is not None:
                lags.append(now - at)

    watcher = Watcher(
        root,
        lambda: hosts,
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
        statusfiles._signature = signature
        if poll_signature is not None:
            Watcher._poll_signature = poll_signature  # type: ignore[method-assign]
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
        "code": str(Path(statusfiles.__file__).parent),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
