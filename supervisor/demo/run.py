"""``reward-supervisor demo``: the real daemon against an in-process SSH server, with faults.

Starts ``LocalSshServer`` (127.0.0.1, generated keys) serving N fake hosts, runs the same
``Daemon`` that ``run`` runs with the reference worker, streams tasks into the inbox (the
real task record, as the trainer's ``FSRewardClient`` writes it), kills one worker (SIGKILL)
and hangs another (SIGSTOP), and shows the fleet as it recovers. Exits 0 only if every task
got an ok result with the right score and every fault was recovered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO, cast

from supervisor import config as config_mod
from supervisor import logs, render
from supervisor.daemon import Daemon
from supervisor.demo import worker
from supervisor.demo.sshserver import LocalSshServer
from supervisor.notify import Notifier

# Demo timings: short enough to watch, long enough that each phase is visible.
HEARTBEAT_INTERVAL_S: Final = 0.25
TASKS_PER_SECOND: Final = 40
#: What each task names as its reward fn: the reference worker's built-in one.
REWARD_FN: Final = "supervisor.demo.worker.exact_match"
DRAIN_TIMEOUT_S: Final = 60.0
RECOVERY_TIMEOUT_S: Final = 30.0
REFRESH_S: Final = 0.5


@dataclass
class Fault:
    """One injected fault and how the fleet answered it."""

    kind: str
    host: str
    pid: int
    injected_at: float
    recovered_at: float | None = None
    new_pid: int | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.injected_at


@dataclass
class Tally:
    """What happened during the demo."""

    submitted: int = 0
    #: The score each submitted task must get, by task id.
    expected: dict[str, float] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    restarts: Counter[str] = field(default_factory=Counter)
    transitions: int = 0


def main(*, hosts: int, duration_s: float, keep: bool, log_format: str, log_level: str) -> int:
    """Run the demo; returns the exit code."""
    if not 2 <= hosts <= 64:
        print("demo: --hosts must be between 2 and 64", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="rs-demo-"))
    log_file: TextIO | None = None
    try:
        if log_format == "off":
            log_file = (workdir / "daemon.log").open("w", encoding="utf-8")
            logs.configure("json", log_level, stream=log_file)
        else:
            logs.configure(cast(logs.LogFormat, log_format), log_level)
        live = log_format == "off"
        return asyncio.run(_demo(workdir, hosts, duration_s, live))
    finally:
        if log_file is not None:
            log_file.close()
        if keep:
            print(f"run directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


async def _demo(workdir: Path, count: int, duration_s: float, live: bool) -> int:
    names = [f"demo-{i}" for i in range(count)]
    print(f"reward-supervisor demo: {count} hosts on an in-process SSH server, {workdir}")
    async with LocalSshServer(workdir / "ssh", names) as server:
        cfg = _config(workdir, server)
        daemon = Daemon(cfg, notifier=Notifier({}))
        tally = Tally()
        async with asyncio.TaskGroup() as tg:
            running = tg.create_task(daemon.run(), name="daemon")
            watcher = tg.create_task(_follow(daemon, tally, live), name="follow")
            try:
                ok = await _script(daemon, cfg, tally, duration_s)
            finally:
                daemon.request_stop("demo finished")
                code = await running
                watcher.cancel()
        leftovers = _live_workers(cfg)
    good = _print_summary(cfg, tally, leftovers, ok and code == 0)
    return 0 if good else 1


def _config(workdir: Path, server: LocalSshServer) -> config_mod.Config:
    root = workdir / "run"
    doc: dict[str, Any] = {
        "run": {
            "root": str(root),
            "experiment": "demo",
            "trial": "demo",
            "reward_fn": REWARD_FN,
            "cleanup_prefix": str(workdir),
        },
        "worker": {
            "python": sys.executable,
            "argv": worker.argv_template(HEARTBEAT_INTERVAL_S),
            "env": {"PYTHONPATH": os.pathsep.join(sys.path[1:])},
        },
        "health": {
            "heartbeat_stale_s": 3.0,
            "ready_timeout_s": 15.0,
            "restart_cooldown_s": 1.0,
            "backoff_max_s": 5.0,
            "stop_grace_s": 5.0,
            "kill_after_grace": True,
        },
        "ssh": {
            "username": server.username,
            "client_keys": [str(server.client_key_path)],
            "known_hosts": str(server.known_hosts_path),
            "connect_timeout_s": 10.0,
            "keepalive_interval_s": 5.0,
        },
        "control": {"socket": str(workdir / "control.sock")},
        "watch": {"debounce_ms": 20},
        "hosts": [
            {"name": name, "address": addr, "port": port, "shard": i, "concurrency": 4}
            for i, (name, (addr, port)) in enumerate(server.endpoints.items())
        ],
    }
    return config_mod.parse(doc, workdir / "demo.toml")


async def _script(daemon: Daemon, cfg: config_mod.Config, tally: Tally, duration_s: float) -> bool:
    """Wait for ready, stream tasks, inject two faults, drain; True if all went well."""
    if not await _until(lambda: _all_ready(daemon), 60.0):
        print("demo: the fleet never became ready", file=sys.stderr)
        return False
    start = time.monotonic()
    producer = asyncio.create_task(_produce(cfg, tally, duration_s))
    try:
        await asyncio.sleep(duration_s * 0.25)
        await _inject(daemon, tally, "kill -9", cfg.hosts[1].name, signal.SIGKILL)
        await asyncio.sleep(max(0.0, start + duration_s * 0.5 - time.monotonic()))
        await _inject(daemon, tally, "hang (SIGSTOP)", cfg.hosts[-1].name, signal.SIGSTOP)
        await producer
    finally:
        producer.cancel()
    recovered = await _until(lambda: all(f.recovered_at for f in tally.faults), RECOVERY_TIMEOUT_S)
    drained = await _until(lambda: _done(cfg, tally), DRAIN_TIMEOUT_S)
    return recovered and drained


async def _produce(cfg: config_mod.Config, tally: Tally, duration_s: float) -> None:
    inbox = cfg.run.root / "inbox"
    shards = cfg.run.shard_count
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        for _ in range(max(1, TASKS_PER_SECOND // 10)):
            n = tally.submitted
            task_id = f"t{n:06d}"
            answer, completion = str(n % 7), f"The answer is {n % 5}."
            task = {
                "schema_version": 1,
                "task_id": task_id,
                "reward_fn": REWARD_FN,
                "args": ["What is the answer?", completion, [], []],
                "kwargs": {"answer": answer},
                "created_at": time.time(),
            }
            _write_atomic(inbox / str(n % shards) / f"{task_id}.json", task)
            tally.expected[task_id] = 1.0 if answer in completion else 0.0
            tally.submitted += 1
        await asyncio.sleep(0.1)


async def _inject(daemon: Daemon, tally: Tally, kind: str, host: str, signum: int) -> None:
    pid = daemon.commands.status()["hosts"][host]["pid"]
    if pid is None:
        print(f"demo: {host} has no worker to {kind}", file=sys.stderr)
        return
    os.kill(pid, signum)
    fault = Fault(kind=kind, host=host, pid=pid, injected_at=time.monotonic())
    tally.faults.append(fault)
    print(f"*** fault: {kind} on {host} (pid {pid})", flush=True)


async def _follow(daemon: Daemon, tally: Tally, live: bool) -> None:
    """Print the fleet as it changes; note restarts and recoveries."""
    events = daemon.commands.subscribe()
    tty = live and sys.stdout.isatty()
    last_table = 0.0
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_count_events(events, tally, live and not tty))
            while True:
                status = daemon.commands.status()
                _note_recoveries(status, tally)
                if tty and time.monotonic() - last_table >= REFRESH_S:
                    last_table = time.monotonic()
                    done = _results_count(daemon)
                    print("\x1b[H\x1b[2J" + render.render_table(status), flush=True)
                    print(f"\ntasks: {tally.submitted} submitted, {done} done", flush=True)
                await asyncio.sleep(0.05)
    finally:
        events.close()


async def _count_events(events: Any, tally: Tally, echo: bool) -> None:
    async for event in events:
        tally.transitions += 1
        reason = str(event.get("reason", ""))
        if event.get("to") == "starting" and reason.startswith("restarting after: "):
            tally.restarts[reason.removeprefix("restarting after: ").split(";")[0]] += 1
        if echo:
            print(
                f"  {event.get('host')}: {event.get('from')} -> {event.get('to')} ({reason})",
                flush=True,
            )


def _note_recoveries(status: dict[str, Any], tally: Tally) -> None:
    for fault in tally.faults:
        row = status["hosts"].get(fault.host, {})
        if (
            fault.recovered_at is None
            and row.get("state") == "ready"
            and row.get("pid")
            not in (
                None,
                fault.pid,
            )
        ):
            fault.recovered_at = time.monotonic()
            fault.new_pid = row.get("pid")
            print(
                f"*** recovered: {fault.host} after {fault.kind} in {fault.recovery_s:.2f}s"
                f" (new pid {fault.new_pid})",
                flush=True,
            )


def _all_ready(daemon: Daemon) -> bool:
    return daemon.commands.status()["daemon"].get("all_ready") is True


def _results_count(daemon: Daemon) -> int:
    outbox = Path(daemon.commands.status()["daemon"]["root"]) / "outbox"
    try:
        return sum(1 for n in os.listdir(outbox) if n.endswith(".json") and not n.startswith("."))
    except OSError:
        return 0


def _done(cfg: config_mod.Config, tally: Tally) -> bool:
    outbox = cfg.run.root / "outbox"
    results = {n for n in os.listdir(outbox) if n.endswith(".json") and not n.startswith(".")}
    return len(results) >= tally.submitted


async def _until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return bool(predicate())


def _live_workers(cfg: config_mod.Config) -> list[int]:
    """Pids from the pidfiles that are still alive (not zombies) after the daemon stopped."""
    alive = []
    for host in cfg.hosts:
        with contextlib.suppress(OSError, ValueError):
            pid = int((cfg.run.root / "ctl" / f"{host.name}.pid").read_text().strip())
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.append(pid)
    return alive


def _read_results(outbox: Path) -> dict[str, dict[str, Any]]:
    """Every result in ``outbox`` by task id (the file stem); an unreadable one as {}."""
    results: dict[str, dict[str, Any]] = {}
    for name in os.listdir(outbox):
        if name.endswith(".json") and not name.startswith("."):
            try:
                data = json.loads((outbox / name).read_bytes())
            except (OSError, ValueError):
                data = {}
            results[name.removesuffix(".json")] = data if isinstance(data, dict) else {}
    return results


def _print_summary(cfg: config_mod.Config, tally: Tally, leftovers: list[int], ok: bool) -> bool:
    """Print what the demo did; True if it all went well: ``ok``, every task answered ok
    with its expected score, no worker left."""
    results = _read_results(cfg.run.root / "outbox")
    inbox_left = sum(
        1 for p in (cfg.run.root / "inbox").rglob("*.json") if not p.name.startswith(".")
    )
    lost = len(set(tally.expected) - set(results))
    answered = [(results[t], score) for t, score in tally.expected.items() if t in results]
    errors = sum(1 for r, _ in answered if r.get("status") != "ok")
    wrong = sum(1 for r, score in answered if r.get("status") == "ok" and r.get("score") != score)
    ones = sum(1 for r, _ in answered if r.get("status") == "ok" and r.get("score") == 1.0)
    print()
    print("=== demo summary ===")
    print(f"tasks submitted: {tally.submitted}")
    print(f"tasks completed: {len(results)} (lost: {lost}, left in inbox: {inbox_left})")
    print(
        f"results: {len(answered) - errors} ok ({ones} scored 1.0), {errors} errors, {wrong} wrong"
    )
    print(f"state transitions seen: {tally.transitions}")
    print("restarts by reason:")
    for reason, n in sorted(tally.restarts.items()):
        print(f"  {n} x {reason}")
    for fault in tally.faults:
        took = f"{fault.recovery_s:.2f}s" if fault.recovery_s is not None else "NOT RECOVERED"
        print(f"fault {fault.kind} on {fault.host}: recovered in {took}")
    if leftovers:
        print(f"workers still alive after stop: {leftovers}")
    good = ok and not lost and not errors and not wrong and not leftovers
    print("result: OK" if good else "result: FAILED")
    return good


def _write_atomic(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)
