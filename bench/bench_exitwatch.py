"""What the agent's exit watch costs on a worker host, and how soon it tells.

    .venv/bin/python bench/bench_exitwatch.py [--workers 1 100] [--window 10] [--kills 20]

``agent.ExitWatch`` in this process, watching ``sleep`` workers, once with pidfds (Linux >=
5.3) and once without (``os.pidfd_open`` hidden: /proc polled every ``WATCH_POLL_S``):

- idle: this process's CPU (utime+stime) over ``--window`` seconds while N workers live;
- kill -> push: SIGKILL a watched worker -> the pushed line handed to ``send``, p50 / p99.

Measurements only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import percentile  # noqa: E402
from supervisor import agent  # noqa: E402


def cpu_s() -> float:
    """This process's CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(workers: int, window_s: float, kills: int, pidfd: bool) -> tuple[float, list[float]]:
    """(CPU % of a core while idle, kill -> push latencies in seconds)."""
    hidden = None
    if not pidfd:
        hidden = os.pidfd_open
        del os.pidfd_open
    try:
        watch = agent.ExitWatch(limit=max(workers, agent.WATCH_MAX))
        pushed: dict[int, float] = {}
        arrived = threading.Condition()

        def send(line: str) -> None:
            """Note when each pid's exit was pushed."""
            news = agent.read_push(json.loads(line))
            assert news is not None
            with arrived:
                pushed[news.pid] = time.perf_counter()
                arrived.notify_all()

        with tempfile.TemporaryDirectory() as tmp:
            spec = {"exit_record": str(Path(tmp) / "none.json"), "root": tmp}
            procs = [subprocess.Popen(["sleep", "1000"]) for _ in range(workers)]
            try:
                for proc in procs:
                    assert watch.watch(spec, proc.pid, None, send)
                time.sleep(0.5)  # wait-ok: the watch thread settles into its wait
                before = cpu_s()
                time.sleep(window_s)  # wait-ok: the idle window measured
                idle_pct = 100 * (cpu_s() - before) / window_s
                latencies: list[float] = []
                for proc in procs[:kills]:
                    killed = time.perf_counter()
                    proc.send_signal(signal.SIGKILL)
                    with arrived:
                        arrived.wait_for(lambda p=proc.pid: p in pushed, timeout=10)
                    latencies.append(pushed[proc.pid] - killed)
                    proc.wait()
                return idle_pct, latencies
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
    finally:
        if hidden is not None:
            os.pidfd_open = hidden


def main() -> None:
    """Each worker count, with and without pidfds; one markdown row each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--kills", type=int, default=20)
    args = parser.parse_args()
    print("| watch | workers | idle CPU, % of a core | kill -> push p50 ms | p99 ms | kills |")
    print("|---|---:|---:|---:|---:|---:|")
    for pidfd in (True, False):
        for n in args.workers:
            idle, lat = run(n, args.window, min(args.kills, n), pidfd)
            ms = [1000 * x for x in lat]
            print(
                f"| {'pidfd' if pidfd else '/proc poll'} | {n} | {idle:.3f} |"
                f" {percentile(ms, 50):.2f} | {percentile(ms, 99):.2f} | {len(ms)} |"
            )


if __name__ == "__main__":
    main()
