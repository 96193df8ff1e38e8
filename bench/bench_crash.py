"""Crash -> replacement on the real sshd, per watch mode: how soon the daemon acts on a
worker's death, and what it adds to the replacement's own start-up.

    .venv/bin/python -m bench.bench_crash [--runs N] [--modes inotify,poll]

One host, the reference worker (1 s heartbeats), product defaults but for short health
timings, against one real OpenSSH sshd on loopback with an empty ``$HOME`` (no rc files).
Per sample: a ready worker, up longer than ``backoff_reset_s`` (so each crash is a first
failure: an immediate restart), is SIGKILLed at ``t0``; then

- crash -> launch issued: ``t0`` -> the daemon's ``host.launch_begin`` line (its timestamp);
- crash -> replacement ready: ``t0`` -> the new pid's ready heartbeat on disk (status file
  sampled every 2 ms);
- worker's own start-up: the replacement's ``launched_at`` (stamped by its shepherd right
  after the spawn) -> that same ready heartbeat; and the difference of the two above, what
  the supervisor adds to a restart: crash -> the new worker spawned.

``bench/ab.py`` runs this in each arm. Measurements only: nothing here asserts a time.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import SCRATCH, StatusWatch, percentile  # noqa: E402
from bench.ops import (  # noqa: E402
    BACKOFF_RESET_S,
    clean_home,
    new_ready,
    ours_config,
    ready_pids,
    start_daemon_process,
    wait_files,
)
from bench.procs import LogIndex, stop_daemon  # noqa: E402
from tests.sshd import OpenSsh  # noqa: E402

#: The observer's sampling period of the status file (a ready heartbeat is seen this late).
SAMPLE_S = 0.002
#: Labels of the measurements, in the order reported.
LABELS = (
    "crash -> launch issued",
    "crash -> replacement ready",
    "worker's own start-up",
    "crash -> replacement ready minus start-up",
)


async def run_crash(mode: str, runs: int) -> dict[str, list[float]]:
    """``runs`` crash samples with the status files watched in ``mode``; seconds per label."""
    samples: dict[str, list[float]] = {label: [] for label in LABELS}
    sshd_dir = Path(tempfile.mkdtemp(prefix="bench-crash-sshd-", dir=SCRATCH))
    sshd = OpenSsh.create(sshd_dir)
    clean_home(sshd)
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-crash-{mode}-", dir=SCRATCH))
    config = ours_config(sshd, workdir, 1)
    text = config.read_text(encoding="utf-8")
    config.write_text(f'{text}\n[watch]\nmode = "{mode}"\n', encoding="utf-8")
    daemon = await start_daemon_process(config, workdir)
    logs = LogIndex(daemon)
    root = workdir / "run"
    status = StatusWatch([root / "status" / "worker-0.json"])
    try:
        await wait_files(status, lambda w: ready_pids(w)[w.paths[0]] is not None, "ready", 0.01)
        for _ in range(runs):
            pid = await _settle(status, logs)
            before = {status.paths[0]: pid}
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            ready = await wait_files(status, new_ready(before), "the replacement", SAMPLE_S)
            launch, _ = await logs.wait("host.launch_begin", 30, after=t0)
            record = json.loads((root / "ctl" / "worker-0.launch.json").read_text())
            startup = ready - float(record["launched_at"])
            samples[LABELS[0]].append(launch - t0)
            samples[LABELS[1]].append(ready - t0)
            samples[LABELS[2]].append(startup)
            samples[LABELS[3]].append(ready - t0 - startup)
    finally:
        await stop_daemon(daemon)
        sshd.stop()
    return samples


async def _settle(status: StatusWatch, logs: LogIndex) -> int:
    """The ready worker's pid, once the daemon too has it ready for longer than the backoff
    reset: every sample is a first failure, restarted at once."""
    pid = None
    while pid is None:
        pid = ready_pids(status)[status.paths[0]]
        await asyncio.sleep(0.01)  # wait-ok: the observer's sampling period
    await logs.wait("host.state", 60, to="ready", pid=pid)
    await asyncio.sleep(BACKOFF_RESET_S + 0.5)  # wait-ok: backoff must reset between samples
    return pid


def main() -> None:
    """Run each mode and print p50 / p99 / max per label, in ms."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--modes", default="inotify,poll")
    args = parser.parse_args()
    print("| watch | measurement | p50 ms | p99 ms | max ms | n |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        samples = asyncio.run(run_crash(mode, args.runs))
        for label, values in samples.items():
            ms = [1000 * v for v in values]
            print(
                f"| {mode} | {label} | {percentile(ms, 50):.1f} | {percentile(ms, 99):.1f}"
                f" | {max(ms):.1f} | {len(ms)} |"
            )


if __name__ == "__main__":
    main()
