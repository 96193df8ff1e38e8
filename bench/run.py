"""Every benchmark of the supervisor, side by side with the old way, in one run; one report.

    .venv/bin/python bench/run.py --quick     # ~17 minutes
    .venv/bin/python bench/run.py --full      # ~32 minutes
    .venv/bin/python bench/run.py --only ops,scale,simstart,idle --out FILE

Sections (each module's docstring says exactly what it measures):

- ``ops``: crash, hang, restart-host, start/stop/kill 50 hosts; our daemon, the old way
  (``oldway.py``) and the floor, against one real OpenSSH sshd on loopback
  (``ops.py``); first with sessions that run no rc files, then with root's own rc files;
- ``scale``: one daemon supervising 100 to 1000 simulated hosts (``scale.py``,
  ``fleetsim.py``), inotify and poll mode, and the floor of each on the same fleet
  (``floor.py``: watching, reading each heartbeat, holding the SSH connections);
- ``simstart``: start 50 (and 100) on simulated hosts whose remote side is in-process
  (``simstart.py``): the daemon's own part of "start 50", which ``ops`` cannot isolate on
  this machine;
- ``idle``: the daemon's CPU over 60 s with a small fleet of real workers.

Writes ``bench/results/report-quick.md`` or ``report-full.md`` (or ``--out``) and prints it.
Measurements only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python bench/run.py` from a checkout

# After the path tweak that makes the checkout importable:
from bench import scale, simstart  # noqa: E402
from bench.common import (  # noqa: E402
    THREAD_KINDS,
    CpuWindow,
    fmt_range,
    fmt_s,
    load_average,
    machine_facts,
    median,
    percentile,
    raise_nofile,
    ratio,
)
from bench.ops import FLEET, STALE_S, OpsResults, bench_ops  # noqa: E402

RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Plan:
    """How much of everything to measure."""

    name: str
    runs: int
    fleet_runs: int
    rc_runs: int
    rc_fleet_runs: int
    scale_sizes: tuple[int, ...]
    scale_modes: tuple[str, ...]
    window_s: float
    exit_samples: int
    stale_samples: int
    idle_s: float
    simstart_sizes: tuple[int, ...]
    simstart_runs: int


QUICK = Plan(
    name="quick",
    runs=5,
    fleet_runs=1,
    rc_runs=3,
    rc_fleet_runs=0,
    scale_sizes=(100, 500, 1000),
    scale_modes=("inotify", "poll"),
    window_s=20.0,
    exit_samples=20,
    stale_samples=3,
    idle_s=60.0,
    simstart_sizes=(FLEET, 2 * FLEET),
    simstart_runs=3,
)
FULL = Plan(
    name="full",
    runs=10,
    fleet_runs=3,
    rc_runs=5,
    rc_fleet_runs=1,
    scale_sizes=(100, 500, 1000),
    scale_modes=("inotify", "poll"),
    window_s=60.0,
    exit_samples=40,
    stale_samples=5,
    idle_s=60.0,
    simstart_sizes=(FLEET, 2 * FLEET),
    simstart_runs=5,
)


@dataclass
class Report:
    """Everything measured in one run."""

    plan: Plan
    started: str
    facts: dict[str, str]
    load_start: str
    load_end: str = ""
    ops: OpsResults | None = None
    ops_rc: OpsResults | None = None
    scales: list[scale.ScaleResult] = field(default_factory=list)
    simstarts: list[simstart.SimStartResult] = field(default_factory=list)
    idle: scale.IdleResult | None = None
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    profile_dir: Path | None = None
    command: str = ""


# --- running ------------------------------------------------------------------------------


async def measure(plan: Plan, only: set[str], report: Report) -> None:
    """Run the selected sections into ``report``; a section that fails is reported, and
    the others still run."""
    with tempfile.TemporaryDirectory(prefix="bench-sshd-") as tmp:
        if "ops" in only:
            print("== ops (sessions without rc files)", flush=True)
            with _section(report, "ops"):
                report.ops = await bench_ops(Path(tmp) / "clean", plan.runs, plan.fleet_runs)
            if plan.rc_runs:
                print("== ops (root's rc files)", flush=True)
                with _section(report, "ops with rc files"):
                    report.ops_rc = await bench_ops(
                        Path(tmp) / "rc", plan.rc_runs, plan.rc_fleet_runs, rc_files=True
                    )
        if "scale" in only:
            for hosts in plan.scale_sizes:
                for mode in plan.scale_modes:
                    print(f"== scale: {hosts} hosts, {mode}", flush=True)
                    first_mode = mode == plan.scale_modes[0]
                    report.scales.append(
                        await scale.run_scale(
                            hosts,
                            mode,
                            # The SSH part of the floor is the same in every mode: once.
                            floor_parts=("watch", "read", "core", "ssh")
                            if first_mode
                            else ("watch", "read", "core"),
                            window_s=plan.window_s,
                            exit_samples=min(plan.exit_samples, hosts // 3),
                            stale_samples=plan.stale_samples,
                            profile_dir=report.profile_dir,
                        )
                    )
        if "simstart" in only:
            for hosts in plan.simstart_sizes:
                print(f"== start {hosts} on simulated hosts", flush=True)
                with _section(report, f"start {hosts} on simulated hosts"):
                    report.simstarts.append(await simstart.run_simstart(hosts, plan.simstart_runs))
        if "idle" in only:
            print("== idle", flush=True)
            with _section(report, "idle"):
                report.idle = await scale.run_idle(Path(tmp) / "idle", 5, plan.idle_s)


@contextlib.contextmanager
def _section(report: Report, name: str) -> Iterator[None]:
    """Record an exception of one section in the report instead of ending the run."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
        report.errors.append(f"{name}: {type(exc).__name__}: {str(exc)[:1000]}")
        traceback.print_exc()


# --- the report -----------------------------------------------------------------------------


OPS_ROWS = (
    ("crash", "kill -9 of the worker -> replacement's ready heartbeat on disk"),
    ("hang - stale time", f"SIGSTOP -> replacement ready, minus last beat + {STALE_S:g} s"),
    ("restart-host", "operator command -> new pid's ready heartbeat"),
    (f"start {FLEET}", f"start command -> all {FLEET} ready"),
    (f"stop {FLEET}", f"stop command -> all {FLEET} workers gone"),
    (f"kill {FLEET}", f"all {FLEET} workers SIGKILLed at once -> {FLEET} new pids ready"),
)


def floor_parts(ops: OpsResults, row: str) -> tuple[float, str]:
    """The floor of an operation: one conn.run round trip plus what the workers take."""
    f = ops.floor
    run = median(f.get("conn.run('true')", []))
    start, stop = median(f.get("worker start", [])), median(f.get("worker stop", []))
    fleet_start = median(f.get(f"{FLEET} workers start", []))
    fleet_stop = median(f.get(f"{FLEET} workers stop", []))
    parts = {
        "crash": (run + start, "run + start"),
        "hang - stale time": (run + stop + start, "run + stop + start"),
        "restart-host": (run + stop + start, "run + stop + start"),
        f"start {FLEET}": (run + fleet_start, f"run + {FLEET} start"),
        f"stop {FLEET}": (run + fleet_stop, f"run + {FLEET} stop"),
        f"kill {FLEET}": (run + fleet_start, f"run + {FLEET} start"),
    }
    return parts[row]


def ops_table(ops: OpsResults) -> list[str]:
    """The side-by-side table."""
    lines = [
        "| operation | ours: median (range) | old way: median (range) | old / ours |"
        " floor | ours / floor |",
        "|---|---|---|---:|---|---:|",
    ]
    for row, _what in OPS_ROWS:
        ours, old = ops.ours.get(row, []), ops.old.get(row, [])
        floor, how = floor_parts(ops, row)
        over = f"{median(ours) / floor:.1f}x" if ours and floor > 0 else "-"
        lines.append(
            f"| {row} | {fmt_range(ours)} | {fmt_range(old)} | {ratio(old, ours)} |"
            f" {fmt_s(floor)} ({how}) | {over} |"
        )
    lines += ["", "Floor parts (measured in the same run):", ""]
    lines += ["| part | median (range) | samples |", "|---|---|---:|"]
    for name, samples in ops.floor.items():
        lines.append(f"| {name} | {fmt_range(samples)} | {len(samples)} |")
    extra = [k for k in ops.ours if k not in dict(OPS_ROWS)]
    if extra:
        lines += ["", "Our daemon, in detail (from its own log timestamps):", ""]
        lines += ["| step | median (range) | samples |", "|---|---|---:|"]
        for name in extra:
            lines.append(f"| {name} | {fmt_range(ops.ours[name])} | {len(ops.ours[name])} |")
    return lines


def scale_table(results: list[scale.ScaleResult]) -> list[str]:
    """One row per fleet size and watch mode."""
    lines = [
        "| hosts | watch | connect + adopt | daemon CPU (% of a core) | CPU per heartbeat |"
        " RSS | RSS per host | threads | beats/s | sim lag p99 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cpu = r.cpu
        percent = f"{cpu.percent:.1f}" if cpu else "-"
        rss = f"{cpu.rss_end / 2**20:.0f} MB" if cpu else "-"
        per_host = f"{cpu.rss_end / r.hosts / 1024:.0f} KB" if cpu else "-"
        lines.append(
            f"| {r.hosts} | {r.mode} | {fmt_s(r.adopt_s)} | {percent} |"
            f" {r.cpu_us_per_write:.0f} µs | {rss} | {per_host} | {r.threads} |"
            f" {r.writes_per_s:.0f} | {r.writer_late_p99_ms:.0f} ms |"
        )
    lines += [
        "",
        "Where the daemon's CPU goes, % of one core by thread (the event loop runs health.step,"
        " SSH and the watch loop; the status-file reader stats and reads the files; the"
        " inotify reader is watchfiles' Rust thread; the other threads are chiefly"
        " watchfiles' waiting thread):",
        "",
        "| hosts | watch | " + " | ".join(THREAD_KINDS) + " |",
        "|---:|---|" + "---:|" * len(THREAD_KINDS),
    ]
    for r in results:
        if r.cpu is not None:
            shares = " | ".join(f"{r.cpu.thread_percent(kind):.1f}" for kind in THREAD_KINDS)
            lines.append(f"| {r.hosts} | {r.mode} | {shares} |")
    lines += ["", *floor_table(results)]
    lines += [
        "",
        "Status write -> state change (ms): p50 / p99 / max (samples)",
        "",
        "| hosts | watch | exit record -> `host.state` | exit record -> launch sent |"
        " first heartbeat -> `ready` | stale detected after last beat + stale_s |",
        "|---:|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.hosts} | {r.mode} | {_pcts(r.exit_to_state)} | {_pcts(r.exit_to_launch)} |"
            f" {_pcts(r.beat_to_ready)} | {_pcts(r.stale_error)} |"
        )
    lines += ["", *marginal_memory(results)]
    errors = [f"{r.hosts}/{r.mode}: {e}" for r in results for e in r.errors]
    if errors:
        lines += ["", "Errors:", "", *(f"- {e}" for e in errors)]
    return lines


def ssh_floor(results: list[scale.ScaleResult], hosts: int) -> CpuWindow | None:
    """The floor's SSH part for a fleet size: measured once, in whichever mode's run had it."""
    return next((r.floor["ssh"] for r in results if r.hosts == hosts and "ssh" in r.floor), None)


def floor_cpu(results: list[scale.ScaleResult], r: scale.ScaleResult) -> float:
    """The floor of ``r`` in % of one core: watching + reading in its mode, plus the fleet's
    SSH connections."""
    read, ssh = r.floor.get("read"), ssh_floor(results, r.hosts)
    if read is None or ssh is None:
        return math.nan
    return read.percent + ssh.percent


def floor_table(results: list[scale.ScaleResult]) -> list[str]:
    """The daemon's CPU beside the floor's (``bench/floor.py``) on the same fleet."""
    rows = [r for r in results if r.cpu is not None and "read" in r.floor]
    if not rows:
        return []
    lines = [
        "The floor (`bench/floor.py`, each part a process of its own on the same fleet, run"
        " after the daemon has stopped, its simulated workers still beating but for the few"
        " the stale samples silenced): the least the design's parts cost, % of one core."
        " Watching: in inotify mode watchfiles' `awatch` on `status/` (our debounce and"
        " step, no filter), its Rust threads included; in poll mode one listing a second."
        " Reading: each changed heartbeat also opened, read and parsed, as the contract"
        " requires (a beat counts when `heartbeat_at` or `seq` changed). SSH: one idle"
        " asyncssh connection per host with the daemon's keepalive and ciphers, over one"
        " keepalive interval. No state machine, no logging. Floor = watching + reading + SSH."
        " With the core: reading, and each heartbeat also stepped through its host's state"
        " machine (`health.step`), + SSH: the least a supervisor with our core could cost.",
        "",
        "| hosts | watch | daemon | watching | watching + reading | SSH connections |"
        " floor | daemon / floor | floor with the core | daemon / that |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        assert r.cpu is not None
        watch, read = r.floor.get("watch"), r.floor["read"]
        ssh = ssh_floor(results, r.hosts)
        floor = floor_cpu(results, r)
        core = r.floor.get("core")
        with_core = core.percent + ssh.percent if core and ssh else math.nan
        lines.append(
            f"| {r.hosts} | {r.mode} | {r.cpu.percent:.1f} |"
            f" {watch.percent if watch else math.nan:.1f} | {read.percent:.1f} |"
            f" {ssh.percent if ssh else math.nan:.1f} | {floor:.1f} |"
            f" {r.cpu.percent / floor if floor > 0 else math.nan:.1f}x | {with_core:.1f} |"
            f" {r.cpu.percent / with_core if with_core > 0 else math.nan:.1f}x |"
        )
    return lines


def marginal_memory(results: list[scale.ScaleResult]) -> list[str]:
    """Memory per host as the fleet grows: the RSS difference between the smallest and the
    largest fleet of each watch mode, over the hosts added (the fixed cost left out)."""
    lines = []
    for mode in dict.fromkeys(r.mode for r in results):
        sized = sorted((r for r in results if r.mode == mode and r.cpu), key=lambda r: r.hosts)
        if len(sized) < 2:
            continue
        small, big = sized[0], sized[-1]
        assert small.cpu is not None
        assert big.cpu is not None
        per_host = (big.cpu.rss_end - small.cpu.rss_end) / (big.hosts - small.hosts)
        lines.append(
            f"Memory per added host ({mode}, {small.hosts} -> {big.hosts} hosts):"
            f" {per_host / 1024:.0f} KB."
        )
    return lines


def simstart_table(results: list[simstart.SimStartResult]) -> list[str]:
    """One row per fleet size: the start and where it went, all from the daemon's spawn."""
    lines = [
        "| hosts | all ready | daemon's first log line | all SSH connections up |"
        " last launch answered | READY=1 | daemon CPU | simulator CPU |"
        " machine CPU, all processes | samples |",
        "|---:|---|---|---|---|---|---|---|---|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.hosts} | {fmt_range(r.all_ready)} | {fmt_range(r.first_line)} |"
            f" {fmt_range(r.connected)} |"
            f" {fmt_range(r.launched)} | {fmt_range(r.daemon_ready)} |"
            f" {_cpu_range(r.daemon_cpu)} | {_cpu_range(r.sim_cpu)} |"
            f" {_cpu_range(r.machine_cpu)} | {len(r.all_ready)} |"
        )
    lines.append("")
    for r in results:
        spawn = r.first_beat_after_spawn
        if spawn:
            order = ", ".join(fmt_s(t) for t in r.all_ready)
            lines.append(
                f"{r.hosts} hosts: all ready per sample, in the order run: {order}. Simulated"
                f" worker start-up (spawn -> first ready heartbeat written; set to"
                f" {fmt_s(r.startup_delay_s)}): p50 {fmt_s(median(spawn))},"
                f" max {fmt_s(max(spawn))} ({len(spawn)} workers)."
            )
    errors = [f"{r.hosts}: {e}" for r in results for e in r.errors]
    if errors:
        lines += ["", "Errors:", "", *(f"- {e}" for e in errors)]
    return lines


def _cpu_range(samples: list[float]) -> str:
    """CPU seconds, ``median (min-max)``."""
    if not samples:
        return "-"
    return f"{median(samples):.2f} s ({min(samples):.2f}-{max(samples):.2f})"


def _pcts(samples: list[float]) -> str:
    """``p50 / p99 / max (n)`` in ms."""
    if not samples:
        return "-"
    p50, p99 = percentile(samples, 50) * 1000, percentile(samples, 99) * 1000
    return f"{p50:.0f} / {p99:.0f} / {max(samples) * 1000:.0f} ({len(samples)})"


def targets(report: Report) -> list[str]:
    """Each target beside its measured value."""
    lines = ["| target | measured | met |", "|---|---|---|"]

    def row(target: str, measured: str, met: bool | None) -> None:
        verdict = "-" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {target} | {measured} | {verdict} |")

    sessions = (("no rc files", report.ops), ("root's rc files", report.ops_rc))
    for label, side in sessions:
        if side is None:
            continue
        launch = side.ours.get("crash -> launch issued", [])
        if launch:
            row(
                f"crash -> launch command issued within 50 ms of the exit ({label})",
                f"median {fmt_s(median(launch))}, max {fmt_s(max(launch))}",
                max(launch) <= 0.05,
            )
        run = median(side.floor.get("conn.run('true')", []))
        restart = median(side.ours.get("restart-host", []))
        worker = median(side.floor.get("worker stop", [])) + median(
            side.floor.get("worker start", [])
        )
        if not math.isnan(restart):
            overhead = restart - worker
            row(
                f"restart-host overhead within 3x one conn.run round trip ({label})",
                f"{fmt_s(overhead)} (restart {fmt_s(restart)} - worker stop+start"
                f" {fmt_s(worker)}) vs 3 x {fmt_s(run)} = {fmt_s(3 * run)}",
                overhead <= 3 * run,
            )
    ops = report.ops
    if ops is not None:
        start50 = median(ops.ours.get(f"start {FLEET}", []))
        budget = 2.0 + median(ops.floor.get("worker start", []))
        local50 = median(ops.floor.get(f"{FLEET} workers start", []))
        if not math.isnan(start50):
            row(
                f"start of {FLEET} hosts within 2 s plus one worker start-up",
                f"{fmt_s(start50)} vs {fmt_s(budget)} (on this machine {FLEET} workers"
                f" started at once without SSH take {fmt_s(local50)} alone)",
                start50 <= budget,
            )
    for r in report.simstarts:
        if r.hosts == FLEET and r.all_ready:
            took = median(r.all_ready)
            row(
                f"start of {FLEET} hosts within 2 s plus one worker start-up:"
                " simulated hosts (remote side in-process)",
                f"{fmt_range(r.all_ready)} vs {fmt_s(r.target_s)} (2 s + simulated start-up"
                f" {fmt_s(r.startup_delay_s)}); SSH up {fmt_s(median(r.connected))}, last launch"
                f" answered {fmt_s(median(r.launched))}, daemon CPU"
                f" {median(r.daemon_cpu):.2f} s",
                took <= r.target_s,
            )
    for r in report.scales:
        if r.hosts == max(s.hosts for s in report.scales) and r.cpu is not None:
            floor = floor_cpu(report.scales, r)
            floor_note = "" if math.isnan(floor) else f" (floor {floor:.1f} %)"
            row(
                f"{r.hosts} hosts ({r.mode}) steady state under 2% of one core",
                f"{r.cpu.percent:.1f} %{floor_note}",
                r.cpu.percent < 2.0,
            )
            row(
                f"{r.hosts} hosts ({r.mode}) under 200 MB RSS",
                f"{r.cpu.rss_end / 2**20:.0f} MB",
                r.cpu.rss_end < 200 * 2**20,
            )
    for r in report.scales:
        samples = r.exit_to_state + r.beat_to_ready
        if not samples:
            continue
        limit = 0.3 if r.mode == "inotify" else 1.0 + 0.05
        row(
            f"p99 status write -> state change, {r.hosts} hosts, {r.mode} (< {fmt_s(limit)})",
            f"{percentile(samples, 99) * 1000:.0f} ms",
            percentile(samples, 99) <= limit,
        )
    return lines


def render(report: Report) -> str:
    """The whole markdown report."""
    plan = report.plan
    lines = [
        f"# reward-supervisor benchmarks ({plan.name})",
        "",
        f"Command: `{report.command}`; started {report.started},"
        f" took {report.wall_s / 60:.1f} min.",
        "",
        "| machine | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in report.facts.items()),
        f"| load average (1/5/15 min) at start | {report.load_start} |",
        f"| load average at end | {report.load_end} |",
        "",
    ]
    if report.ops is not None:
        lines += [
            "## Operations: ours vs the old way vs the floor",
            "",
            "Real OpenSSH sshd on 127.0.0.1-3; SSH sessions run no rc files (an empty"
            " `$HOME`, as a service account has). Times from the bench's action to the"
            " outcome on disk.",
            "",
            *ops_table(report.ops),
            "",
        ]
    if report.ops_rc is not None:
        lines += [
            "## Operations with root's rc files (`~/.bashrc` runs `pyenv init`)",
            "",
            "Every new SSH session pays the rc files: the old way once per command, our"
            " daemon once per connection (the agent channel stays open).",
            "",
            *ops_table(report.ops_rc),
            "",
        ]
    if report.scales:
        lines += [
            "## Scale: one daemon, simulated hosts heartbeating once a second",
            "",
            *scale_table(report.scales),
            "",
        ]
    if report.simstarts:
        lines += [
            "## Start N on simulated hosts (remote side in-process)",
            "",
            "`reward-supervisor run` spawned against a fresh simulated fleet (`fleetsim.py"
            " --fresh`): nothing runs, so the daemon connects, probes and launches every host"
            " (the real agent functions and shepherd, in the simulator's process; `sleep` as"
            " the worker, its first ready heartbeat written a fixed start-up delay after its"
            " spawn). Times from the spawn to the daemon's own log lines; CPU in seconds"
            " until all ready, median (range).",
            "",
            *simstart_table(report.simstarts),
            "",
        ]
    if report.idle is not None:
        idle = report.idle
        lines += [
            "## Idle: a small fleet, nothing happening",
            "",
            f"{idle.hosts} reference workers heartbeating every second on the OpenSSH sshd"
            f" (product defaults: keepalive 15 s, debounce 50 ms): the daemon used"
            f" {idle.cpu.percent:.2f} % of one core over {idle.cpu.seconds:.0f} s"
            f" ({idle.cpu.cpu_s * 1000:.0f} ms of CPU), RSS {idle.cpu.rss_end / 2**20:.0f} MB.",
            "",
        ]
    lines += ["## Targets", "", *targets(report), ""]
    if report.errors:
        lines += ["## Sections that failed", "", *(f"- {e}" for e in report.errors), ""]
    return "\n".join(lines)


def main() -> None:
    """Parse arguments, measure, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer samples (default)")
    size.add_argument("--full", action="store_true", help="more samples and fleet sizes")
    parser.add_argument(
        "--only", default="ops,scale,simstart,idle", help="sections, comma-separated"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--profile", type=Path, default=None, help="py-spy profiles of the scale runs here"
    )
    args = parser.parse_args()
    plan = FULL if args.full else QUICK
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    raise_nofile()
    report = Report(
        plan=plan,
        started=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        facts=machine_facts(),
        load_start=load_average(),
        profile_dir=args.profile,
        command=" ".join([".venv/bin/python bench/run.py", *sys.argv[1:]]),
    )
    t0 = time.monotonic()
    asyncio.run(measure(plan, only, report))
    report.wall_s = time.monotonic() - t0
    report.load_end = load_average()
    text = render(report)
    out = args.out or RESULTS / f"report-{plan.name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(text)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
