"""Remote operations over a persistent connection + agent, beside the old way (a fresh ``ssh``
process and shell script per action, as ``reward_workers_ctl.py`` does), on a real OpenSSH
sshd on loopback started for the run.

    .venv/bin/python bench/bench_remote.py [--quick] [--runs N]

Prints a markdown table (median and range per operation, and old/new ratios) and writes it
to ``bench/results/remote.md``. Measurements only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from bench.common import old_ssh_argv, raw_connection  # noqa: E402
from supervisor.config import Config  # noqa: E402
from supervisor.layout import LaunchSpec, launch_spec, write_run_files  # noqa: E402
from supervisor.remote import RemoteHost  # noqa: E402
from tests.sshd import OpenSsh  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "remote.md"
#: How often the benchmark looks for a ready heartbeat or a vanished pid.
POLL_S = 0.002


def status_of(config: Config) -> dict[str, object] | None:
    """The worker's status file, or None while missing or partial."""
    try:
        value = json.loads((config.run.root / "status" / "worker-0.json").read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


async def wait_ready(config: Config, pid: int) -> None:
    """Until the status file shows ``pid`` ready."""
    async with asyncio.timeout(60):
        while True:
            status = status_of(config)
            if status is not None and status.get("pid") == pid and status.get("ready"):
                return
            await asyncio.sleep(POLL_S)


class OldWay:
    """The seed's approach: ``ssh HOST 'shell script'``, one process and handshake each."""

    def __init__(self, sshd: OpenSsh, config: Config, spec: LaunchSpec) -> None:
        self.sshd = sshd
        self.config = config
        self.spec = spec

    async def ssh(self, script: str) -> str:
        """Run ``script`` through a fresh ssh client; its stdout."""
        process = await asyncio.create_subprocess_exec(
            *old_ssh_argv(self.sshd, "127.0.0.1", script),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        out, _ = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"ssh exited {process.returncode}: {script[:80]}")
        return out.decode()

    async def launch(self) -> int:
        """The seed's non-respawn start (without its kill-and-sleep of an old pid)."""
        spec = self.spec
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
        script = (
            f"cd {shlex.quote(spec.root)} && {{ {env} nohup {shlex.join(spec.argv)}"
            f" >>{shlex.quote(spec.log)} 2>&1 </dev/null & }};"
            f" echo $! > {shlex.quote(spec.pidfile)}; cat {shlex.quote(spec.pidfile)}"
        )
        return int(await self.ssh(script))

    async def probe(self) -> int | None:
        """The seed's liveness check: the pidfile's pid has a /proc entry."""
        pidfile = shlex.quote(self.spec.pidfile)
        out = await self.ssh(f'pid=$(cat {pidfile}); [ -d /proc/"$pid" ] && echo "$pid" || true')
        return int(out) if out.strip() else None

    async def terminate(self, pid: int) -> None:
        """SIGTERM, then wait while /proc/PID exists (which a zombie still has)."""
        await self.ssh(f"kill -TERM {pid}; while [ -d /proc/{pid} ]; do sleep 0.02; done")


async def timed(action: Callable[[], Awaitable[object]]) -> float:
    """Seconds ``action`` took."""
    start = time.perf_counter()
    await action()
    return time.perf_counter() - start


async def bench(runs: int, workdir: Path) -> dict[str, tuple[list[float], list[float]]]:
    """Interleaved samples per operation: (ours, old way)."""
    sshd = OpenSsh.create(workdir / "sshd")
    try:
        config = sshd.config(workdir / "run root", 1)
        write_run_files(config)
        host = config.hosts[0]
        spec = launch_spec(config, host)
        old = OldWay(sshd, config, spec)
        results: dict[str, tuple[list[float], list[float]]] = {
            name: ([], [])
            for name in ("launch → ready", "terminate → confirmed dead", "probe round trip")
        }
        floor: list[float] = []
        connected = asyncio.Event()
        remote = RemoteHost(
            host,
            config.ssh,
            python=config.worker.python,
            handshakes=asyncio.Semaphore(1),
            on_connection=lambda up, _reason: connected.set() if up else None,
        )
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(remote.maintain())
            await connected.wait()
            await remote.probe(spec, None)  # start the agent: the daemon keeps it running
            conn = await raw_connection(sshd, host.address)
            async with conn:
                for _ in range(runs):
                    # ours
                    start = time.perf_counter()
                    started = await remote.launch(spec)
                    await wait_ready(config, started.pid)
                    results["launch → ready"][0].append(time.perf_counter() - start)
                    results["probe round trip"][0].append(
                        await timed(partial(remote.probe, spec, started.pid))
                    )
                    results["terminate → confirmed dead"][0].append(
                        await timed(
                            partial(remote.terminate, spec, started.pid, grace_s=30, kill=True)
                        )
                    )
                    # the old way
                    start = time.perf_counter()
                    pid = await old.launch()
                    await wait_ready(config, pid)
                    results["launch → ready"][1].append(time.perf_counter() - start)
                    results["probe round trip"][1].append(await timed(old.probe))
                    results["terminate → confirmed dead"][1].append(
                        await timed(partial(old.terminate, pid))
                    )
                    floor.append(await timed(lambda: conn.run("true")))
            await remote.aclose()
        results["floor: asyncssh conn.run('true') on an open connection"] = (floor, [])
        return results
    finally:
        sshd.stop()


def fmt(samples: list[float]) -> str:
    """``median (min-max)`` in milliseconds."""
    if not samples:
        return "-"
    return (
        f"{statistics.median(samples) * 1000:.1f} ms "
        f"({min(samples) * 1000:.1f}-{max(samples) * 1000:.1f})"
    )


def table(results: dict[str, tuple[list[float], list[float]]], runs: int) -> str:
    """The markdown report."""
    lines = [
        "# Remote operations: persistent connection + agent vs. a fresh ssh per action",
        "",
        f"{runs} interleaved runs on {platform.node()} ({platform.machine()},"
        f" Python {platform.python_version()}), OpenSSH sshd on 127.0.0.1, user"
        " rc files as they are (root's ~/.bashrc runs `pyenv init`).",
        "",
        "| operation | ours: median (range) | old way: median (range) | old / ours |",
        "|---|---|---|---|",
    ]
    for name, (ours, old) in results.items():
        ratio = f"{statistics.median(old) / statistics.median(ours):.1f}x" if ours and old else "-"
        lines.append(f"| {name} | {fmt(ours)} | {fmt(old)} | {ratio} |")
    lines += [
        "",
        "Ours: `RemoteHost.launch/probe/terminate` on one open connection with the agent"
        " already running. Old way: `ssh -o BatchMode=yes -i KEY -o UserKnownHostsFile=..."
        " -p PORT root@127.0.0.1 'script'`, one process per action, scripts as in"
        " `reward_workers_ctl.py` (`nohup ... &`, `[ -d /proc/$pid ]`). The old way's"
        " terminate counts a zombie as alive, so it also waits for init to reap the worker.",
        "The floor is a new exec channel on an open connection: what any per-action command"
        " costs before it does anything.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the benchmark and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 runs instead of 20")
    parser.add_argument("--runs", type=int, default=None, help="runs per operation")
    args = parser.parse_args()
    runs = args.runs or (5 if args.quick else 20)
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as workdir:
        results = asyncio.run(bench(runs, Path(workdir)))
    report = table(results, runs)
    print(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report)


if __name__ == "__main__":
    main()
