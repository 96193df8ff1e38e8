"""What every fault test shares: a run under a real daemon, a task producer with an end-to-end
data check, log helpers, a silent TCP listener, and network namespaces.

The daemon itself is ``tests/system/daemonproc.DaemonProcess`` (a real ``reward-supervisor
run`` subprocess); the SSH side is the session's real OpenSSH (``tests/sshd.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from supervisor.seedimport import render_toml
from tests.faults.monitor import InvariantMonitor
from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    FAST_HEALTH,
    FAST_WORKER_ARGV,
    DaemonProcess,
    all_ready,
    poll_until,
)

#: Timings for fault tests: stale after 3 s (the config's minimum), quick cooldowns, and a
#: lost connection noticed within about 3 s (keepalive 1 s x (2 + 1)).
HEALTH: Mapping[str, Any] = {**FAST_HEALTH, "stop_grace_s": 2.0}
SSH: Mapping[str, Any] = {
    "connect_timeout_s": 3.0,
    "keepalive_interval_s": 1.0,
    "keepalive_count_max": 2,
    "reconnect_min_s": 0.05,
    "reconnect_max_s": 0.5,
}
#: Generous deadlines: a loaded 2-core CI box can be ten times slower than a quiet one.
READY_S = 60.0
STOP_S = 60.0


def write_config_atomic(path: Path, raw: Mapping[str, Any] | str) -> Path:
    """Write a config (a raw dict, or TOML text) so a reader sees the old file or the new one."""
    text = raw if isinstance(raw, str) else render_toml(raw)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


class FaultRun:
    """One test's run directory, config and daemons, on the session's OpenSSH server."""

    def __init__(self, openssh: OpenSsh, tmp_path: Path, monitor: InvariantMonitor) -> None:
        """See the class docstring."""
        self.openssh = openssh
        self.tmp_path = tmp_path
        self.monitor = monitor
        self.root = tmp_path / "run"
        self.config_path = tmp_path / "rs.toml"
        self.daemons: list[DaemonProcess] = []
        #: ``(what, seconds)`` measured by the test: reported at the end, never asserted.
        self.timings: list[tuple[str, float]] = []

    def record(self, what: str, seconds: float) -> None:
        """Note a measured duration (detection, recovery) for the run's summary."""
        self.timings.append((what, seconds))

    def recovered(self, what: str, since: float) -> None:
        """Note the time from monotonic ``since`` (the fault) until now."""
        self.record(what, time.monotonic() - since)

    def raw(
        self,
        hosts: int = 1,
        *,
        root: Path | None = None,
        health: Mapping[str, Any] | None = None,
        ssh: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        socket: Path | None = None,
        openssh: OpenSsh | None = None,
        **sections: Mapping[str, Any],
    ) -> dict[str, Any]:
        """A fast-timing config for ``hosts`` reference workers; sections override by key."""
        server = openssh or self.openssh
        raw = server.config_dict(
            root or self.root,
            hosts,
            argv=FAST_WORKER_ARGV,
            env=env,
            health={**HEALTH, **(health or {})},
            ssh={**SSH, **(ssh or {})},
        )
        raw["control"]["socket"] = str(socket or self.tmp_path / "control.sock")
        for name, value in sections.items():
            raw.setdefault(name, {}).update(value)
        return raw

    def write(self, raw: Mapping[str, Any] | str, path: Path | None = None) -> Path:
        """Write the config (atomically) to ``path`` or the run's config path."""
        return write_config_atomic(path or self.config_path, raw)

    async def start(
        self,
        config: Path | None = None,
        *,
        ready: int | None = None,
        args: Sequence[str] = (),
        socket: Path | None = None,
        watchdog_usec: int | None = None,
    ) -> DaemonProcess:
        """Start ``reward-supervisor run`` (with ``args``, answering on ``socket`` if given);
        with ``ready=N``, return once N hosts are ready."""
        daemon = DaemonProcess(
            config or self.config_path, self.tmp_path, args=args, control_socket=socket
        )
        self.daemons.append(daemon)
        await daemon.start(watchdog_usec=watchdog_usec)
        if ready is not None:
            await daemon.wait_status(lambda s: all_ready(s, ready), READY_S, f"{ready} ready")
        return daemon

    async def stop(self, daemon: DaemonProcess) -> int:
        """SIGTERM the daemon (which stops every worker) and return its exit code."""
        if daemon.process is not None and daemon.process.returncode is None:
            daemon.send_signal(signal.SIGTERM)
        return await daemon.wait_exit(STOP_S)

    async def aclose(self) -> None:
        """Stop every daemon still running gracefully (killing it if it will not stop)."""
        try:
            for daemon in self.daemons:
                if daemon.process is not None and daemon.process.returncode is None:
                    with contextlib.suppress(AssertionError):
                        # A SIGTERM leaves the workers of hosts it cannot reach running (for
                        # the next daemon to adopt): let a reconnect in progress finish first.
                        await daemon.wait_status(_reachable, 10.0, "workers' hosts reachable")
                    with contextlib.suppress(AssertionError):
                        await self.stop(daemon)
        finally:
            for i, daemon in enumerate(self.daemons):
                await daemon.aclose()
                # Kept beside the run for post-mortems (pytest keeps the last few tmp dirs).
                with (self.tmp_path / f"daemon-{i}.jsonl").open("w") as out:
                    out.writelines(json.dumps(line) + "\n" for line in daemon.lines)
                    out.writelines(f"UNPARSED {line}\n" for line in daemon.bad_lines)


def _reachable(status: Mapping[str, Any]) -> bool:
    """Every host that has a worker is connected."""
    return all(
        row.get("ssh") == "connected" or row.get("pid") is None
        for row in status.get("hosts", {}).values()
    )


# --- reading the daemon's log ------------------------------------------------------------


def events(daemon: DaemonProcess, event: str, **fields: Any) -> list[dict[str, Any]]:
    """Every log line of ``event`` whose fields equal ``fields``."""
    return [
        line
        for line in daemon.lines
        if line.get("event") == event and all(line.get(k) == v for k, v in fields.items())
    ]


async def wait_event(
    daemon: DaemonProcess,
    event: str,
    *,
    after: int = 0,
    count: int = 1,
    timeout_s: float = READY_S,
    **fields: Any,
) -> dict[str, Any]:
    """The ``count``-th log line of ``event`` with ``fields``, from line index ``after`` on."""
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        """Enough matching lines have been logged."""
        hits = [
            line
            for line in daemon.lines[after:]
            if line.get("event") == event and all(line.get(k) == v for k, v in fields.items())
        ]
        if len(hits) < count:
            return False
        found.append(hits[count - 1])
        return True

    await daemon.wait_until(seen, timeout_s, f"{event} {fields} x{count} after line {after}")
    return found[0]


def wall(line: Mapping[str, Any]) -> float:
    """A log line's timestamp as Unix seconds."""
    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00")).timestamp()


def host_row(status: Mapping[str, Any], host: str) -> dict[str, Any]:
    """One host's row of a status reply."""
    row: dict[str, Any] = status["hosts"][host]
    return row


def pid_of(status: Mapping[str, Any], host: str) -> int:
    """The host's current worker pid (the test fails if there is none)."""
    pid = host_row(status, host).get("pid")
    assert isinstance(pid, int), f"{host} has no pid: {status['hosts'][host]}"
    return pid


def worker_args(pid: int) -> list[str]:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        data = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [os.fsdecode(a) for a in data.split(b"\0")[:-1]]


def kill(pid: int, signum: int = signal.SIGKILL) -> None:
    """Send ``signum`` to ``pid`` if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


async def kill_storm(fault_run: FaultRun, rng: random.Random, stop: asyncio.Event) -> int:
    """kill -9 a random live worker every 0.2-0.7 s until ``stop``; the number killed."""
    killed = 0
    while not stop.is_set():
        live = fault_run.monitor.live()
        if live:
            kill(rng.choice(live).pid)
            killed += 1
        try:
            async with asyncio.timeout(rng.uniform(0.2, 0.7)):
                await stop.wait()
        except TimeoutError:
            pass
    return killed


async def hold_for(seconds: float, check: Callable[[], None], every_s: float = 0.25) -> None:
    """Keep calling ``check`` (which asserts) for ``seconds``: for faults that last a while
    by definition, where the point is what does *not* happen meanwhile."""
    end = time.monotonic() + seconds
    while True:
        check()
        left = end - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(every_s, left))  # wait-ok: the fault's duration is the test


# --- tasks: a producer and the end-to-end check ------------------------------------------


#: The reward fn the produced tasks name: the reference worker's built-in one.
REWARD_FN = "supervisor.demo.worker.exact_match"


@dataclass(frozen=True, slots=True)
class _Task:
    """One produced task and the score its result must carry."""

    id: str
    shard: int
    score: float


class Workload:
    """Feeds ``total`` tasks into ``inbox/<shard>/`` over ``duration_s`` from a thread, as
    ``FSRewardClient`` writes them (the real task record; temp file + rename), then checks
    every task got exactly one ok result with the right score."""

    def __init__(
        self, root: Path, shards: int, total: int, *, duration_s: float = 2.0, seed: int = 0
    ) -> None:
        """See the class docstring."""
        rng = random.Random(seed)
        self.root = root
        self.shards = shards
        self.duration_s = duration_s
        self.tasks: list[_Task] = []
        self._bodies: list[dict[str, Any]] = []
        for i in range(total):
            answer = str(rng.randrange(10))
            completion = f"The answer is {rng.randrange(10)}."
            task_id = f"t{seed}-{i:06d}"
            score = 1.0 if answer in completion else 0.0
            self.tasks.append(_Task(task_id, i % shards, score))
            body = {
                "schema_version": 1,
                "task_id": task_id,
                "reward_fn": REWARD_FN,
                "args": ["What is the answer?", completion, [], []],
                "kwargs": {"answer": answer},
            }
            self._bodies.append(body)
        self._names = frozenset(f"{t.id}.json" for t in self.tasks)
        self.written = 0
        #: The producer met a full filesystem at least once (and retried).
        self.full = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> Workload:
        """Begin producing; returns self."""
        for shard in range(self.shards):
            (self.root / "inbox" / str(shard)).mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._produce, name="producer", daemon=True)
        self._thread.start()
        return self

    def _produce(self) -> None:
        """The producer thread: write every task, paced over ``duration_s``."""
        try:
            started = time.monotonic()
            total = len(self.tasks)
            for i, (task, body) in enumerate(zip(self.tasks, self._bodies, strict=True)):
                if self._stop.is_set():
                    return
                inbox = self.root / "inbox" / str(task.shard)
                tmp = inbox / f".{task.id}.json.tmp"
                # Stamped when written, as the client stamps it: the worker's queue wait.
                data = json.dumps({**body, "created_at": time.time()}).encode()
                while not self._write(tmp, data):
                    self.full = True
                    if self._stop.wait(0.05):  # wait-ok: a trainer retries a full disk
                        return
                os.replace(tmp, inbox / f"{task.id}.json")
                self.written = i + 1
                # Spread the tasks evenly over duration_s, in bursts of ~10 ms.
                due = started + self.duration_s * (i + 1) / total
                delay = due - time.monotonic()
                if delay > 0.01:
                    self._stop.wait(delay)  # wait-ok: the producer's pace, not a test wait
        except BaseException as exc:  # noqa: BLE001 - thread root: the check reports it
            self._error = exc

    @staticmethod
    def _write(tmp: Path, body: bytes) -> bool:
        """Write one task file; False when the filesystem is full (nothing left behind)."""
        try:
            tmp.write_bytes(body)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return False
            raise
        return True

    def join(self) -> None:
        """Wait until every task has been written."""
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Stop producing (if not done) and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def inbox_left(self) -> list[Path]:
        """This producer's task files still waiting in an inbox."""
        left: list[Path] = []
        for shard in range(self.shards):
            inbox = self.root / "inbox" / str(shard)
            with contextlib.suppress(FileNotFoundError):
                left += [inbox / n for n in os.listdir(inbox) if n in self._names]
        return left

    def results(self) -> list[str]:
        """Names of result files in ``outbox/`` (temp files excluded)."""
        try:
            names = os.listdir(self.root / "outbox")
        except FileNotFoundError:
            return []
        return [n for n in names if n.endswith(".json") and not n.startswith(".")]

    def done(self) -> bool:
        """Everything was written, no inbox holds one of our tasks, every result is there."""
        return (
            self.written == len(self.tasks)
            and not self.inbox_left()
            and len(self._names.intersection(self.results())) == len(self.tasks)
        )

    async def wait_done(self, timeout_s: float = 120.0) -> None:
        """Wait until every task has been produced and consumed."""
        try:
            await poll_until(self.done, timeout_s, "every task consumed")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: written {self.written}/{len(self.tasks)},"
                f" {len(self.inbox_left())} still in inboxes,"
                f" {len(self._names.intersection(self.results()))} results"
            ) from None

    def problems(self, others: Iterable[str] = ()) -> list[str]:
        """Every way the run's data breaks "each task exactly one correct result"; ``others``
        are ids of other producers' tasks, whose results are not strays."""
        problems: list[str] = []
        if self._error is not None:
            problems.append(f"the producer failed: {self._error!r}")
        wanted = {t.id: t for t in self.tasks}
        legit = set(wanted) | set(others)
        names = set(self.results())
        for task in self.tasks:
            name = f"{task.id}.json"
            if name not in names:
                problems.append(f"task {task.id}: no result")
                continue
            try:
                result = json.loads((self.root / "outbox" / name).read_bytes())
            except (OSError, ValueError) as exc:
                problems.append(f"task {task.id}: unreadable result: {exc}")
                continue
            if result.get("task_id") != task.id:
                problems.append(f"task {task.id}: result names id {result.get('task_id')!r}")
            elif result.get("status") != "ok":
                status, error = result.get("status"), result.get("error")
                problems.append(f"task {task.id}: status {status!r}: {error}")
            elif result.get("score") != task.score:
                problems.append(f"task {task.id}: score {result.get('score')} != {task.score}")
            elif result.get("shard") != task.shard:
                problems.append(f"task {task.id}: served by shard {result.get('shard')}")
        extra = sorted(n for n in names if n.removesuffix(".json") not in legit)
        if extra:
            problems.append(f"{len(extra)} results without a task, e.g. {extra[:3]}")
        left = self.inbox_left()
        if left:
            problems.append(f"{len(left)} tasks left in the inbox, e.g. {left[:3]}")
        return problems[:20]

    def assert_all_done_once(self) -> None:
        """Fail with the first problems found, if any."""
        problems = self.problems()
        assert not problems, "\n".join(problems)


# --- a host whose address never answers ----------------------------------------------------


class SilentListener:
    """A TCP listener on loopback that accepts connections and never says a word."""

    def __init__(self, address: str) -> None:
        """See the class docstring."""
        self.address = address
        self.port = 0
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> SilentListener:
        """Listen on an ephemeral port; returns self."""
        self._server = await asyncio.start_server(self._hold, self.address, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Keep one accepted connection open, silently, until the client leaves; then close
        it (``aclose`` may have run before this handler did: the server's ``wait_closed``
        waits for every connection)."""
        self.accepted += 1
        self._writers.append(writer)
        try:
            await reader.read()  # until the client gives up; we never write
        finally:
            writer.close()

    async def aclose(self) -> None:
        """Close the listener and every held connection."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if self._server is not None:
            await self._server.wait_closed()


# --- network namespaces --------------------------------------------------------------------

_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run this thread in network namespace ``name``: processes it starts meanwhile stay there.

    ``ip netns exec`` for code that starts processes itself (the daemon harness, the sshd
    fixture); only the calling thread moves, and it always moves back.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raises with its stderr on failure."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@dataclass
class Partition:
    """Two namespaces, ``supervisor`` and ``host``, joined only by one veth pair."""

    supervisor: str
    host: str
    supervisor_address: str = "10.213.0.1"
    host_address: str = "10.213.0.2"
    link: str = "rsf-host"

    @classmethod
    def create(cls, tag: str) -> Partition:
        """Make both namespaces and the link between them (nothing in the root namespace)."""
        part = cls(supervisor=f"rsf-{tag}-sup", host=f"rsf-{tag}-host")
        ip("netns", "add", part.supervisor)
        try:
            ip("netns", "add", part.host)
            ip("-n", part.supervisor, "link", "add", "rsf-sup", "type", "veth",
               "peer", "name", part.link, "netns", part.host)  # fmt: skip
            ip("-n", part.supervisor, "addr", "add", f"{part.supervisor_address}/24",
               "dev", "rsf-sup")  # fmt: skip
            ip("-n", part.host, "addr", "add", f"{part.host_address}/24", "dev", part.link)
            for ns, dev in ((part.supervisor, "rsf-sup"), (part.host, part.link)):
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            part.delete()
            raise
        return part

    def cut(self) -> None:
        """Take the host's end of the link down: nothing passes either way."""
        ip("-n", self.host, "link", "set", self.link, "down")

    def heal(self) -> None:
        """Bring the link back up."""
        ip("-n", self.host, "link", "set", self.link, "up")

    def delete(self) -> None:
        """Remove both namespaces (and the link with them)."""
        for ns in (self.host, self.supervisor):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
