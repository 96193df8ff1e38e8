"""Heartbeat latency of the status watcher: a file's atomic rewrite to its Observation in the sink.

A separate writer process rewrites N status files once a second each (temp file + rename,
staggered evenly over the second) and stamps each with CLOCK_MONOTONIC, which all processes
on a machine share; the sink subtracts that stamp from its own clock. Measured for N = 50,
500, 1000 with

  - inotify, our settings (debounce 50 ms),
  - our poll mode (stat every second),
  - inotify with watchfiles' defaults (debounce 1600 ms, step 50 ms): the baseline,
  - watchfiles' own polling (poll_delay_ms=1000), which our poll mode replaces,

all in the same run, on the same filesystem. "seen" is the share of writes that were
reported individually (a write overtaken by the next one before being read is not).
CPU is this process's CPU time over the window, in % of one core.

    .venv/bin/python bench/bench_watch.py --quick     # ~2 minutes
    .venv/bin/python bench/bench_watch.py             # ~5 minutes

Writes a markdown table to bench/results/watch.md (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from watchfiles import awatch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: another checkout's supervisor can be measured

from supervisor import logs  # noqa: E402
from supervisor.statusfiles import (  # noqa: E402
    Observation,
    StatusObserved,
    StatusRecord,
    read_status,
)

#: How the code on the path names a run root's filesystem (``_watcher_module``'s caveat).
filesystem_type = (
    getattr(
        importlib.import_module("supervisor.statusfiles"),
        "filesystem_type",
        None,
    )
    or importlib.import_module("supervisor.mounts").filesystem_type
)
ResolvedMode = Literal["inotify", "poll"]


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


RESULTS = Path(__file__).resolve().parent / "results" / "watch.md"
DEFAULT_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
# Deliveries still arriving after the writer stops: a poll interval plus slack.
TAIL_S = 3.0


@dataclass
class Tally:
    """What the sink saw during one configuration.

    Every write counts: one overtaken by the next before it was read was "delivered" when
    that newer one was, since the sink then had it or something newer. Its time is known
    from the schedule (each file is rewritten every second), so it is the newer stamp minus
    whole seconds.
    """

    window: tuple[float, float]
    latencies: list[float] = field(default_factory=list)
    individually: int = 0
    last_seq: dict[str, int] = field(default_factory=dict)

    def sink(self, batch: list[Observation]) -> None:
        """The watcher's sink: every status record in ``batch``, seen ``now``."""
        now = time.monotonic()
        for obs in batch:
            if isinstance(obs, StatusObserved) and isinstance(obs.record, StatusRecord):
                self.record(obs.host, obs.record, now)

    def record(self, host: str, record: StatusRecord, now: float) -> None:
        """Latencies of the heartbeats ``record`` proves written in the window (a skipped seq
        counts as delivered late)."""
        seq = record.seq if record.seq is not None else -1
        previous = self.last_seq.get(host, -1)
        if seq <= previous:
            return  # already counted (a rescan, a repeated event)
        self.last_seq[host] = seq
        start, end = self.window
        if start <= record.heartbeat_at < end:
            self.individually += 1
        for k in range(max(previous + 1, seq - 10), seq + 1):
            written_at = record.heartbeat_at - (seq - k) * 1.0
            if start <= written_at < end:
                self.latencies.append(now - written_at)


@dataclass(frozen=True)
class Result:
    """One row of the table."""

    config: str
    n: int
    written: int
    seen: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    cpu_pct: float
    writer_lag_ms: float


@dataclass(frozen=True)
class Config:
    """A watcher under test: its name and how to run it over a run root."""

    name: str
    run: Callable[[Path, list[str], Tally], contextlib.AbstractAsyncContextManager[None]]


@contextlib.asynccontextmanager
async def _ours(
    root: Path, hosts: list[str], tally: Tally, *, mode: ResolvedMode, debounce_ms: int
) -> AsyncIterator[None]:
    """Our ``Watcher`` over ``root`` feeding ``tally``, for the duration of the block."""
    watcher = _new_watcher(
        root,
        hosts,
        mode=mode,
        poll_interval_s=1.0,
        debounce_ms=debounce_ms,
        rescan_interval_s=30.0,
    )
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(watcher.run(tally.sink))
        while not watcher.watching:  # noqa: ASYNC110 (the watcher exposes state, not events)
            await asyncio.sleep(0.05)
        yield
        task.cancel()


@contextlib.asynccontextmanager
async def _watchfiles_polling(root: Path, hosts: list[str], tally: Tally) -> AsyncIterator[None]:
    """watchfiles' own poller on ``status/`` feeding ``tally``: the alternative we did not take."""
    status = root / "status"
    wanted = {str(status / f"{h}.json"): h for h in hosts}

    async def consume() -> None:
        """Read every status file watchfiles reports changed."""
        async for changes in awatch(
            status,
            force_polling=True,
            poll_delay_ms=1000,
            debounce=50,
            step=25,
            recursive=False,
            rust_timeout=500,
            yield_on_timeout=True,
        ):
            now = time.monotonic()
            for _change, path in changes:
                host = wanted.get(path)
                if host is not None:
                    record = read_status(Path(path))
                    if isinstance(record, StatusRecord):
                        tally.record(host, record, now)

    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(consume())
        await asyncio.sleep(1.0)  # the poller's first scan
        yield
        task.cancel()


def _ours_with(
    mode: ResolvedMode, debounce_ms: int
) -> Callable[[Path, list[str], Tally], contextlib.AbstractAsyncContextManager[None]]:
    """A ``Config.run`` for our watcher in ``mode`` with ``debounce_ms``."""
    return lambda root, hosts, tally: _ours(root, hosts, tally, mode=mode, debounce_ms=debounce_ms)


CONFIGS = [
    Config("inotify, ours (debounce 50 ms)", _ours_with("inotify", 50)),
    Config("poll, ours (1 s stat poll)", _ours_with("poll", 50)),
    Config("inotify, watchfiles defaults (debounce 1600 ms)", _ours_with("inotify", 1600)),
    Config("poll, watchfiles poller (1000 ms)", _watchfiles_polling),
]
BASELINE = CONFIGS[2].name


def _writer(
    root: Path, n: int, part: tuple[int, int], start: float, window: tuple[float, float]
) -> None:
    """A writer process: rewrite its part (k of m: files i with i % m == k) of n status files
    once a second each from ``start`` to the window's end; prints how many writes were
    stamped inside the window, and its lag."""
    status = root / "status"
    mine = range(part[0], n, part[1])
    written = 0
    lags: list[float] = []
    seq = 0
    while True:
        second = start + seq
        for i in mine:
            due = second + i / n
            if due >= window[1]:
                lags.sort()
                lag = lags[int(0.99 * len(lags))] if lags else 0.0
                print(json.dumps({"written": written, "lag_p99_ms": 1000 * lag}))
                return
            # Sleeping before each of 1000 writes a second costs more than the writes on a
            # small VM; write in bursts of up to 5 ms instead (stamps are taken at write time).
            delay = due - time.monotonic()
            if delay > 0.005:
                time.sleep(delay)
            stamp = write_status(status, i, seq)
            if window[0] <= stamp < window[1]:
                written += 1
                lags.append(stamp - due)
        seq += 1


def write_status(status: Path, i: int, seq: int) -> float:
    """Rewrite file i atomically, as workers do; the CLOCK_MONOTONIC stamp written into it.

    The temp name is new each time, as with runfiles.write_json_atomic: with fixed
    temp names watchfiles' debounce would see no new paths after a second and flush early.
    """
    stamp = time.monotonic()
    data = b'{"pid": %d, "ready": true, "heartbeat_at": %r, "seq": %d}' % (1000 + i, stamp, seq)
    tmp = f"{status}/.w{i:04d}.json.{seq}.tmp"
    # Plain os calls: at 1000 files a second the writer must stay cheap.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, f"{status}/w{i:04d}.json")
    return stamp


async def same_second(config: Config, rounds: int, where: Path) -> tuple[int, int]:
    """Rewrite 100 files twice within one wall-clock second, then leave them; how many of the
    last writes were delivered within 2.5 s, out of how many."""
    n = 100
    root = Path(tempfile.mkdtemp(prefix="bench-watch-", dir=where))
    try:
        for sub in ("status", "ctl"):
            (root / sub).mkdir()
        hosts = [f"w{i:04d}" for i in range(n)]
        tally = Tally(window=(-math.inf, math.inf))
        delivered = 0
        async with config.run(root, hosts, tally):
            for r in range(rounds):
                await asyncio.sleep(1.05 - time.time() % 1)  # just after a second begins
                for i in range(n):
                    write_status(root / "status", i, 2 * r)
                await asyncio.sleep(0.8)  # still the same second: the last write
                for i in range(n):
                    write_status(root / "status", i, 2 * r + 1)
                await asyncio.sleep(2.5)
                delivered += sum(tally.last_seq.get(h) == 2 * r + 1 for h in hosts)
        return delivered, n * rounds
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def measure(
    config: Config, n: int, warmup_s: float, duration_s: float, where: Path
) -> Result:
    """One watcher, ``n`` status files rewritten once a second: latency, delivery and CPU."""
    root = Path(tempfile.mkdtemp(prefix="bench-watch-", dir=where))
    try:
        for sub in ("status", "ctl", "inbox", "outbox"):
            (root / sub).mkdir()
        hosts = [f"w{i:04d}" for i in range(n)]
        start = time.monotonic() + 1.5  # the writer process needs a moment to start
        window = (start + warmup_s, start + warmup_s + duration_s)
        tally = Tally(window=window)
        async with config.run(root, hosts, tally):
            # One writer per 500 files a second: one Python process cannot keep that pace
            # on a small machine while the watcher reads beside it.
            parts = max(1, n // 500)
            writers = [
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    __file__,
                    "--writer",
                    str(root),
                    str(n),
                    f"{k}/{parts}",
                    repr(start),
                    repr(window[0]),
                    repr(window[1]),
                    stdout=subprocess.PIPE,
                )
                for k in range(parts)
            ]
            cpu0, wall0 = time.process_time(), time.monotonic()
            outs = [json.loads((await w.communicate())[0]) for w in writers]
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            await asyncio.sleep(TAIL_S)
        report = {
            "written": sum(o["written"] for o in outs),
            "lag_p99_ms": max(o["lag_p99_ms"] for o in outs),
        }
        lat = sorted(tally.latencies)
        nan = float("nan")
        return Result(
            config=config.name,
            n=n,
            written=report["written"],
            writer_lag_ms=report["lag_p99_ms"],
            seen=tally.individually,
            p50_ms=1000 * statistics.median(lat) if lat else nan,
            p99_ms=1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else nan,
            max_ms=1000 * lat[-1] if lat else nan,
            cpu_pct=100 * cpu / wall,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(results: list[Result], args: argparse.Namespace) -> str:
    """The markdown table of all results, with the ratio to the baseline watcher."""
    base = {r.n: r for r in results if r.config == BASELINE}
    lines = [
        "# Status watcher latency (write -> Observation in the sink)",
        "",
        f"`bench/bench_watch.py{' --quick' if args.quick else ''}`: {args.duration:g} s measured"
        f" per row after {args.warmup:g} s warm-up; each file rewritten atomically once a"
        " second, staggered. Machine: "
        f"{os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()},"
        f" run directories in {args.dir} ({filesystem_type(args.dir) or 'unknown'}).",
        "",
        "Latency counts every write: one overtaken by the next before it was read counts until"
        " that newer one reached the sink. Ratios are baseline / row (higher is better;"
        " baseline = inotify with watchfiles' defaults). seen = writes reported individually"
        " / writes made."
        " CPU = the watching process, % of one core. Writer lag = how late the writer process"
        " wrote against its schedule (a loaded machine shows here, not in the latencies).",
        "",
        "| files | watcher | p50 ms | p99 ms | max ms | seen | CPU % | p50 ratio | p99 ratio"
        " | writer lag p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        b = base.get(r.n)
        ratio50 = ratio99 = "-"
        if b is not None:
            ratio50 = f"{b.p50_ms / r.p50_ms:.1f}x"
            ratio99 = f"{b.p99_ms / r.p99_ms:.1f}x"
        seen = r.seen / max(1, r.written)
        lines.append(
            f"| {r.n} | {r.config} | {r.p50_ms:.0f} | {r.p99_ms:.0f} | {r.max_ms:.0f} |"
            f" {100 * seen:.1f} % | {r.cpu_pct:.1f} | {ratio50} | {ratio99} |"
            f" {r.writer_lag_ms:.0f} |"
        )
    return "\n".join(lines) + "\n"


def same_second_table(same: dict[str, tuple[int, int]]) -> str:
    """The markdown table of the same-second rewrite check."""
    lines = [
        "",
        "## A last write in the same second as the one before",
        "",
        "100 files, each rewritten twice 0.8 s apart within one wall-clock second and then"
        " left alone; last writes delivered within 2.5 s. watchfiles' poller compares"
        " modification times in whole seconds, so when it polls between the two writes the"
        " second one is never reported (until something else changes the file); this is why"
        " our poll mode compares inode, size and nanosecond times itself.",
        "",
        "| watcher | last writes delivered |",
        "|---|---:|",
    ]
    for name, (delivered, total) in same.items():
        lines.append(f"| {name} | {delivered} / {total} |")
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> None:
    # Per-host info lines at startup would cost CPU in the measured process; keep warnings.
    """Run every watcher at every size and write the report."""
    logs.configure("console", level="warning", stream=sys.stderr)
    rounds = 3 if args.quick else 6
    same: dict[str, tuple[int, int]] = {}
    for config in CONFIGS:
        same[config.name] = await same_second(config, rounds, args.dir)
        print(config.name, "same-second:", same[config.name], file=sys.stderr, flush=True)
    results = []
    for n in args.files:
        for config in CONFIGS:
            result = await measure(config, n, args.warmup, args.duration, args.dir)
            print(json.dumps(dataclasses.asdict(result)), file=sys.stderr, flush=True)
            results.append(result)
    text = table(results, args) + same_second_table(same)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)


def main() -> None:
    """Entry point: the benchmark, or (``--writer``) one heartbeat-writer child process."""
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        root, n, part, start, begin, end = sys.argv[2:8]
        k, m = part.split("/")
        _writer(Path(root), int(n), (int(k), int(m)), float(start), (float(begin), float(end)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short windows (about 2 minutes)")
    parser.add_argument("--files", type=int, nargs="+", default=[50, 500, 1000])
    parser.add_argument("--duration", type=float, help="measured seconds per row")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help="where the run directories go (default: /dev/shm if present: on ext4 a rename"
        " over an existing file starts writeback, and one writer cannot keep 1000 a second)",
    )
    args = parser.parse_args()
    if args.duration is None:
        args.duration = 5.0 if args.quick else 20.0
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
