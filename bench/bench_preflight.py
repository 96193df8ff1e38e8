"""``reward-supervisor preflight`` on N hosts of a real OpenSSH sshd on loopback, beside the
floor: the same connections (the daemon's ``RemoteHost``, the same handshake budget) each
running ``true`` once, which is a login and one shell per host and nothing else.

    .venv/bin/python -m bench.bench_preflight [--hosts 50] [--runs 5] [--rc-files]

Runs alternate (floor, preflight, floor, ...) on one server started for the run. Without
``--rc-files`` the sessions get an empty ``$HOME`` (a service account's: no rc files);
with it, root's own (``~/.bashrc`` runs ``pyenv init``, ~150 ms of CPU per session). All
"hosts" are this machine: their shells and pythons share its cores with the supervisor,
where a real fleet runs each on its own machine. Reports wall time, this process's CPU,
the whole machine's busy CPU and per-host times; writes ``bench/results/preflight.md``.
Measurements only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    SCRATCH,
    fmt_range,
    fmt_s,
    load_average,
    machine_busy_s,
    machine_facts,
    median,
    percentile,
    raise_nofile,
)
from bench.ops import clean_home
from supervisor import logs, preflight
from supervisor.config import Config, HostConfig
from supervisor.remote import RemoteHost
from tests.sshd import OpenSsh

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "preflight.md"
#: The CLI's defaults but the free-space floor: scratch space here may be small.
OPTIONS = preflight.Options(min_free_bytes=1 << 20)


@dataclass
class Sample:
    """One run of one side: wall, CPU and every host's own time."""

    wall_s: float
    own_cpu_s: float
    machine_cpu_s: float
    host_s: list[float] = field(default_factory=list)
    #: ``check:code`` of every failing check (a loaded machine can push a host past its
    #: --host-timeout: ``python:hung``).
    failed: list[str] = field(default_factory=list)
    #: Each failure's sentence, for the report.
    details: list[str] = field(default_factory=list)


@dataclass
class Side:
    """Every sample of one side."""

    name: str
    samples: list[Sample] = field(default_factory=list)


def own_cpu_s() -> float:
    """This process's user + system CPU so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def floor_host(
    config: Config, host: HostConfig, gate: asyncio.Semaphore, failed: list[str]
) -> float:
    """Connect ``host`` as preflight does and run ``true`` once; seconds it took (a failure
    is appended to ``failed``, as preflight would report it)."""
    started = time.monotonic()
    up: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()

    def report(is_up: bool, reason: str) -> None:
        if not up.done():
            up.set_result((is_up, reason))

    remote = RemoteHost(
        host, config.ssh, python=config.worker.python, handshakes=gate, on_connection=report
    )
    keeper = asyncio.create_task(remote.maintain())
    try:
        is_up, reason = await up
        if not is_up:
            failed.append(f"{host.name}: ssh: {reason}")
        else:
            result = await remote.run(["true"], timeout_s=60)
            assert result.exit_status == 0, result
    finally:
        await remote.aclose()
        keeper.cancel()
    return time.monotonic() - started


async def floor(config: Config) -> Sample:
    """Every host's login and one shell, at once, within the handshake budget."""
    gate = asyncio.Semaphore(config.ssh.max_concurrent_handshakes)
    failed: list[str] = []
    cpu, busy, t0 = own_cpu_s(), machine_busy_s(), time.monotonic()
    times = await asyncio.gather(*(floor_host(config, h, gate, failed) for h in config.hosts))
    return Sample(
        wall_s=time.monotonic() - t0,
        own_cpu_s=own_cpu_s() - cpu,
        machine_cpu_s=machine_busy_s() - busy,
        host_s=list(times),
        failed=["ssh" for _ in failed],
        details=failed,
    )


async def ours(config: Config) -> Sample:
    """``preflight`` as the CLI runs it (defaults: module located, not imported)."""
    options = OPTIONS
    cpu, busy, t0 = own_cpu_s(), machine_busy_s(), time.monotonic()
    report = await preflight.check_fleet(config, options)
    return Sample(
        wall_s=time.monotonic() - t0,
        own_cpu_s=own_cpu_s() - cpu,
        machine_cpu_s=machine_busy_s() - busy,
        host_s=[h.elapsed_s for h in report.hosts],
        failed=[f"{c.name.value}:{c.code}" for h in report.hosts for c in h.failed],
        details=[f"{h.host}: {c.name.value}: {c.detail}" for h in report.hosts for c in h.failed],
    )


def child_cpu_ms(argv: list[str], stdin: str | None = None, runs: int = 20) -> float:
    """Mean CPU (user + system) of ``argv`` run ``runs`` times here, in ms."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(runs):
        subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return spent / runs * 1000


def parts(config: Config) -> str:
    """What one host's share costs, piece by piece, run locally (no SSH): a markdown line."""
    host = config.hosts[0]
    payload = preflight._payload(config, host, "bench.nonce", "token", "bench.probe", OPTIONS)
    python = config.worker.python
    hostcheck = [python, "-S", "-X", "utf8", "-c", preflight.hostcheck_source(), "hostcheck"]
    no_module = {**payload, "module": None, "reward_fn": ""}
    measured = {
        "`python -S -c pass`": child_cpu_ms([python, "-S", "-c", "pass"]),
        "`python -c pass` (with site)": child_cpu_ms([python, "-c", "pass"]),
        "hostcheck, no module lookup": child_cpu_ms(hostcheck, json.dumps(no_module)),
        "hostcheck": child_cpu_ms(hostcheck, json.dumps(payload)),
        "`bash -c true`": child_cpu_ms(["bash", "-c", "true"]),
        "`bash -c 'source ~/.bashrc'`": child_cpu_ms(["bash", "-c", "source ~/.bashrc"], runs=5),
    }
    return "CPU per run, here without SSH: " + ", ".join(
        f"{name} {ms:.0f} ms" for name, ms in measured.items()
    )


def row(side: Side) -> str:
    """One markdown row."""
    walls = [s.wall_s for s in side.samples]
    failed = Counter(f for s in side.samples for f in s.failed)
    hosts = [t for s in side.samples for t in s.host_s]
    return (
        f"| {side.name} | {fmt_range(walls)} | {fmt_s(percentile(hosts, 50))} /"
        f" {fmt_s(percentile(hosts, 90))} / {fmt_s(max(hosts))} |"
        f" {fmt_s(median([s.own_cpu_s for s in side.samples]))} |"
        f" {fmt_s(median([s.machine_cpu_s for s in side.samples]))} |"
        f" {', '.join(f'{k} x{n}' for k, n in failed.items()) or 0} |"
    )


async def main_async(hosts: int, runs: int, rc_files: bool) -> str:
    """Start the server, run both sides ``runs`` times, alternating; the markdown report."""
    raise_nofile()
    # As the CLI does: the report says what failed, connection log lines would repeat it.
    logs.configure("auto", "error", sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-preflight-", dir=SCRATCH) as tmp:
        work = Path(tmp)
        sshd = OpenSsh.create(work / "sshd")
        try:
            if not rc_files:
                clean_home(sshd)
            config = sshd.config(work / "run", hosts)
            sides = (Side("floor: login + `true`"), Side("preflight"))
            load_before = load_average()
            await ours(config)  # warm-up: page cache, the run directories, pyc files
            for _ in range(runs):
                sides[0].samples.append(await floor(config))
                sides[1].samples.append(await ours(config))
            load_after = load_average()
            pieces = parts(config)
        finally:
            sshd.stop()
    facts = machine_facts()
    ratio = median([s.wall_s for s in sides[1].samples]) / median(
        [s.wall_s for s in sides[0].samples]
    )
    sessions = "root's rc files (`pyenv init`)" if rc_files else "no rc files (empty `$HOME`)"
    lines = [
        f"preflight, {hosts} hosts on one OpenSSH sshd (127.0.0.1-3), sessions with"
        f" {sessions}, {runs} runs per side, alternating",
        "",
        f"machine: {facts['cpu']}, {facts['cores']} cores, Python {facts['python']},"
        f" asyncssh {facts['asyncssh']}, {facts['openssh']};"
        f" load average {load_before} before, {load_after} after",
        "",
        "| side | wall: median (range) | per host: p50 / p90 / max | own CPU (median)"
        " | machine CPU (median) | failed checks (all runs) |",
        "|---|---|---|---|---|---|",
        *(row(side) for side in sides),
        "",
        f"preflight / floor (median wall): {ratio:.2f}x",
        "",
        pieces,
        *(f"\nfailure: {d}" for side in sides for s in side.samples for d in s.details),
    ]
    return "\n".join(lines)


def main() -> None:
    """Parse arguments, measure, print and save the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=50, help="hosts in the config")
    parser.add_argument("--runs", type=int, default=5, help="runs per side")
    parser.add_argument("--rc-files", action="store_true", help="sessions run root's rc files")
    args = parser.parse_args()
    text = asyncio.run(main_async(args.hosts, args.runs, args.rc_files))
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a", encoding="utf-8") as f:
        f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{text}\n")


if __name__ == "__main__":
    main()
