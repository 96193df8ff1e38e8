"""The fleet page at N hosts: its size, the endpoint's time to render it, and headless
Chromium's time to load and paint it, each beside its baseline.

    .venv/bin/python -m bench.bench_page [--hosts 1000] [--rounds 7]
    .venv/bin/python -m bench.bench_page --live [--hosts 1000] [--window 20] [--rounds 2]

The snapshot is a leader's status of N ready hosts whose workers report all their figures
(as the AReaL worker does: the biggest tiles), built with ``view.host_row``; names are
``gpu-node-NNNN.cluster.example.com`` (longer than most). Baselines: the ``/metrics``
exposition of the same snapshot (what a scrape already costs the endpoint's thread), and the
page of 5 hosts (Chromium's own start, load and paint, which every run pays). The endpoint
renders the page once per snapshot (a second) however many look; Chromium runs headless as
the system tests run it (tests/browser.py), a fresh profile each run, rounds alternated.
Prints a markdown table of medians.

With ``--live``: what people looking cost the daemon. ``reward-supervisor run`` supervises a
simulated fleet (bench/fleetsim.py ``--work``) with its metrics listener on; in windows of
``--window`` seconds, alternated ``--rounds`` times, nobody looks, one viewer loads ``/`` every
second (a new snapshot and a new page each time: five times the script's pace), or one
scraper loads ``/metrics`` every second (the baseline: what Prometheus at 1 s would cost).
For each: the daemon's CPU (its event loop's thread and the others, the endpoint's among
them), and the round trip of a control socket ``ping`` every 100 ms (p50 / p99: how long the
loop takes to answer while the page is rendered beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import statistics
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import SCRATCH, CpuWindow, measure_cpu, percentile, raise_nofile
from bench.procs import SimProcess, stop_daemon
from supervisor import control, health, page, view
from supervisor.config import HostConfig
from supervisor.metrics import Metrics
from supervisor.seedimport import render_toml
from tests import ports
from tests.browser import dump_dom, find_chromium, screenshot
from tests.system.daemonproc import DaemonProcess, all_ready

#: After every host is ready, start-up's rescans and first keepalives settle this long.
SETTLE_S = 10.0

POLICY = health.Policy()


def fleet_status(hosts: int) -> dict[str, Any]:
    """A leader's status of ``hosts`` ready hosts reporting all their work."""
    stats = health.WorkerStats(
        completed=123000, errors=45, queue_depth=31, concurrency=8, qps=3.3, rss_gib=2.5
    )
    rows = {}
    for i in range(hosts):
        name = f"gpu-node-{i:04d}.cluster.example.com"
        host = health.Host(
            name=name,
            state=health.HostState.READY,
            reason="ready",
            since_at=0.0,
            pid=10_000 + i,
            ssh_up=True,
            alive_at=99.5,
            processed=123045,
            in_flight=7,
            restarts=i % 3,
            stats=stats,
        )
        cfg = HostConfig(name=name, shard=i, address=f"10.0.{i // 250}.{i % 250}")
        rows[name] = view.host_row(host, cfg, 100.0, POLICY)
        rows[name]["tasks_per_min"] = 20.0 + i % 17
    daemon = {"pid": 1, "role": "leader", "epoch": 1, "summary": f"{hosts}/{hosts} ready"}
    return {
        "daemon": {**daemon, "uptime_s": 3600.0, "started_at": time.time() - 3600},
        "hosts": rows,
    }


def per_call(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of one call over ``rounds`` calls."""
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


async def browser_times(
    chromium: str, urls: dict[str, str], rounds: int, scratch: Path
) -> dict[str, dict[str, float]]:
    """Median wall seconds of Chromium's ``--dump-dom`` (load, run scripts, serialize) and
    ``--screenshot`` (load, lay out, paint, encode) per URL, rounds alternated."""
    times: dict[str, dict[str, list[float]]] = {k: {"dom": [], "shot": []} for k in urls}
    for r in range(rounds):
        for key, url in urls.items():
            start = time.perf_counter()
            await dump_dom(chromium, url)
            times[key]["dom"].append(time.perf_counter() - start)
            start = time.perf_counter()
            await screenshot(chromium, url, scratch / f"{key}-{r}.png", 1280, 4400)
            times[key]["shot"].append(time.perf_counter() - start)
    return {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}


async def live(hosts: int, window_s: float, rounds: int) -> None:
    """The daemon's CPU and ping round trips with nobody, a page viewer and a scraper."""
    with tempfile.TemporaryDirectory(prefix="bench-page-", dir=SCRATCH) as scratch:
        sim = SimProcess(
            Path(scratch), hosts, agents="inproc", watch="inotify", stale_s=15.0, work=True
        )
        daemon: DaemonProcess | None = None
        try:
            config = Path((await sim.start())["config"])
            port = ports.reserve("127.0.0.1")
            _with_metrics(config, port)
            daemon = DaemonProcess(config, config.parent)
            await daemon.start()
            await daemon.wait_status(lambda s: all_ready(s, hosts), 300, f"{hosts} ready")
            await asyncio.sleep(SETTLE_S)  # wait-ok: start-up's burst settles first
            assert daemon.process is not None
            results: dict[str, list[tuple[CpuWindow, list[float]]]] = {}
            for _ in range(rounds):
                for arm, path in (
                    ("nobody", None),
                    ("page / every 1 s", "/"),
                    ("/metrics every 1 s", "/metrics"),
                ):
                    results.setdefault(arm, []).append(await _window(daemon, port, path, window_s))
        finally:
            if daemon is not None:
                await stop_daemon(daemon)
            await sim.aclose()
    print(
        f"| {hosts} hosts, {rounds} x {window_s:g} s | daemon CPU (% of a core) | event loop"
        " | other threads | ping p50 / p99 (ms) |"
    )
    print("|---|---|---|---|---|")
    for arm, runs in results.items():
        cpu = " / ".join(f"{w.percent:.1f}" for w, _ in runs)
        loop_ = " / ".join(f"{w.thread_percent('event loop'):.1f}" for w, _ in runs)
        other = " / ".join(f"{w.thread_percent('other threads'):.1f}" for w, _ in runs)
        pings = [p for _, ps in runs for p in ps]
        print(
            f"| {arm} | {cpu} | {loop_} | {other} |"
            f" {1000 * percentile(pings, 50):.1f} / {1000 * percentile(pings, 99):.1f} |"
        )


def _with_metrics(config: Path, port: int) -> None:
    """Turn the simulator's daemon config's metrics listener on, at ``port``."""
    raw = tomllib.loads(config.read_text(encoding="utf-8"))
    raw["metrics"] = {"listen": f"127.0.0.1:{port}"}
    config.write_text(render_toml(raw), encoding="utf-8")


def _load(url: str) -> bytes:
    """GET ``url``: its body."""
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - our http://127.0.0.1 URL
        body: bytes = reply.read()
    return body


async def _window(
    daemon: DaemonProcess, port: int, path: str | None, seconds: float
) -> tuple[CpuWindow, list[float]]:
    """One window: the daemon's CPU while ``path`` is loaded every second (nothing when
    None), and the control pings' round trips."""
    assert daemon.process is not None
    pings: list[float] = []
    stop = asyncio.Event()

    async def viewer() -> None:
        """Load the page once a second."""
        while not stop.is_set():
            if path is not None:
                await asyncio.to_thread(_load, f"http://127.0.0.1:{port}{path}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def pinger() -> None:
        """Ping the control socket every 100 ms."""
        while not stop.is_set():
            start = time.perf_counter()
            await control.request(daemon.socket, "ping")
            pings.append(time.perf_counter() - start)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    tasks = [asyncio.create_task(viewer()), asyncio.create_task(pinger())]
    try:
        window = await measure_cpu(daemon.process.pid, seconds)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return window, pings


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--live", action="store_true", help="the daemon's cost, live")
    parser.add_argument("--window", type=float, default=20.0, help="--live: seconds a window")
    args = parser.parse_args()
    if args.live:
        raise_nofile()
        asyncio.run(live(args.hosts, args.window, args.rounds))
        return
    big, small = fleet_status(args.hosts), fleet_status(5)
    metrics = Metrics(lambda: big)
    html = page.fleet_page(big).encode()
    exposition, _ = metrics.render("text/plain", "")
    render_page = per_call(lambda: page.fleet_page(big).encode(), args.rounds)
    render_metrics = per_call(lambda: metrics.render("text/plain", ""), args.rounds)
    gzip_page = per_call(lambda: gzip.compress(html, compresslevel=6), args.rounds)

    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("chromium not found: ./dev setup installs it")
    servers = {"big": Metrics(lambda: big), "small": Metrics(lambda: small)}
    for server in servers.values():
        server.start("127.0.0.1", 0)
    try:
        urls = {k: f"http://127.0.0.1:{s.port}/" for k, s in servers.items()}
        with tempfile.TemporaryDirectory(prefix="bench-page-") as scratch:
            browser = asyncio.run(browser_times(chromium, urls, args.rounds, Path(scratch)))
    finally:
        for server in servers.values():
            server.stop()

    n = args.hosts
    print(f"| {n} hosts | page | baseline | ratio |")
    print("|---|---|---|---|")
    print(
        f"| bytes (gzip) | {len(html):,} ({len(gzip.compress(html)):,}) |"
        f" /metrics {len(exposition):,} ({len(gzip.compress(exposition)):,}) |"
        f" {len(html) / len(exposition):.2f}x |"
    )
    print(
        f"| endpoint render, ms | {1000 * render_page:.1f} (+ gzip {1000 * gzip_page:.1f}) |"
        f" /metrics {1000 * render_metrics:.1f} | {render_page / render_metrics:.2f}x |"
    )
    for metric, label in (("dom", "Chromium --dump-dom, s"), ("shot", "Chromium --screenshot, s")):
        b, s = browser["big"][metric], browser["small"][metric]
        print(f"| {label} | {b:.2f} | 5 hosts {s:.2f} | +{b - s:.2f} s ({b / s:.2f}x) |")
    print(f"\nmedians of {args.rounds} rounds; Chromium {chromium}")


if __name__ == "__main__":
    main()
