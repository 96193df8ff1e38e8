"""The invariant monitor: a thread that watches every process on the machine during a test.

Every ``SAMPLE_S`` it reads ``/proc/*/cmdline`` and, for reference workers of this test's
runs (``-m supervisor.demo.worker ... --root R --shard N`` with ``R`` under the test's directory;
``-m areal.reward.fs_worker``, the module name the old script starts, counts as the same),
``/proc/*/stat``. Two live workers (state not ``Z``/``X``) serving one ``(root, shard)`` in
the same sample is a violation of the product's first promise, recorded with both command
lines. It also keeps, per shard, every worker pid it ever saw and when, so a test can ask
"was a second worker ever started while SSH was down?" of the record rather than of the
daemon's own story. A worker's child that has not exec'd yet (a pool process being spawned)
carries its command line and is not counted. It only reads ``/proc``; ``finish()`` kills
leftovers (the test fails).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

#: One look at /proc every 20 ms: a duplicate worker lives at least a Python start-up
#: (~100 ms) before it could be noticed and killed, so it cannot slip between two samples.
SAMPLE_S = 0.02

Shard = tuple[str, int]  # (root as the worker was given it, shard number)

#: Modules whose ``python -m`` runs count as workers: the reference worker, and the name
#: the old script (reward_workers_ctl.py) starts it under in the migration tests.
WORKER_MODULES = ("supervisor.demo.worker", "areal.reward.fs_worker")


@dataclass(frozen=True, slots=True)
class WorkerProcess:
    """A live reference worker of one of the watched runs."""

    pid: int
    root: str
    shard: int
    host: str | None
    state: str
    start_ticks: int
    ppid: int = 0


@dataclass(slots=True)
class Sighting:
    """One worker pid's life as the monitor saw it (monotonic seconds)."""

    pid: int
    shard: Shard
    host: str | None
    first_seen: float
    last_seen: float


@dataclass(frozen=True, slots=True)
class Violation:
    """Two (or more) live workers serving one shard in one sample."""

    at: float
    shard: Shard
    workers: tuple[WorkerProcess, ...]
    cmdlines: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"{len(self.workers)} live workers on shard {self.shard[1]} of {self.shard[0]}:"]
        lines += [
            f"  pid {w.pid} state {w.state} host {w.host}: {c}"
            for w, c in zip(self.workers, self.cmdlines, strict=True)
        ]
        return "\n".join(lines)


@dataclass(slots=True)
class _Record:
    """Everything the sampler has learnt so far (guarded by the monitor's lock)."""

    samples: int = 0
    max_gap_s: float = 0.0
    max_scan_s: float = 0.0
    violations: list[Violation] = field(default_factory=list)
    sightings: dict[tuple[int, int], Sighting] = field(default_factory=dict)
    current: list[WorkerProcess] = field(default_factory=list)


def parse_worker_argv(args: list[str]) -> tuple[str, int, str | None] | None:
    """``(root, shard, host)`` when ``args`` run ``-m`` a worker module; None otherwise."""
    try:
        m = args.index("-m")
    except ValueError:
        return None
    if m + 1 >= len(args) or args[m + 1] not in WORKER_MODULES:
        return None
    opts = args[m + 2 :]
    values: dict[str, str] = {}
    for i, arg in enumerate(opts[:-1]):
        if arg in ("--root", "--shard", "--host") and arg not in values:
            values[arg] = opts[i + 1]
    if "--root" not in values or "--shard" not in values:
        return None
    try:
        shard = int(values["--shard"])
    except ValueError:
        return None
    return values["--root"], shard, values.get("--host")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, start time in ticks, parent pid)`` of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0].decode("ascii"), int(fields[19]), int(fields[1])
    except (ValueError, IndexError):  # read as the process vanished: nothing usable
        return None


def _cmdline(pid: int) -> list[str]:
    """The argv of ``pid``; empty for a kernel thread, a zombie or a vanished process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            data = f.read()
    except OSError:
        return []
    return [os.fsdecode(arg) for arg in data.split(b"\0")[:-1]]


def is_dead_state(state: str) -> bool:
    """A zombie or a process being torn down: its code can no longer run."""
    return state in ("Z", "X", "x")


class Scanner:
    """Finds live reference workers whose ``--root`` lies under a directory.

    A shared machine may run a thousand processes; reading every command line 50 times a
    second would cost a core. So a process that cannot turn into a worker is remembered by
    pid and ``/proc/PID`` inode (a new process reusing the pid gets a new inode) and skipped.
    "Cannot turn into a worker" means: not a worker now, and neither a Python interpreter
    (a worker is started by a Python shepherd, fork then exec, so until the exec its command
    line is the shepherd's) nor a shell running a script under the watched directory (the
    old script's respawn loop forks and execs its worker). Every ``FULL_RESCAN_S`` the memory
    is dropped, so anything else that execs a worker directly is seen within that long.
    """

    #: Forget every remembered non-candidate this often.
    FULL_RESCAN_S = 1.0

    def __init__(self, under: Path) -> None:
        """See the class docstring."""
        self._prefix = os.path.realpath(under).rstrip("/") + "/"
        self._named = os.path.abspath(under).rstrip("/") + "/"
        self._skip: dict[int, int] = {}  # pid -> inode of /proc/PID known not to matter
        self._cleared_at = -math.inf

    def scan(self) -> tuple[list[WorkerProcess], dict[int, str]]:
        """Live workers of the watched runs, and their command lines."""
        now = time.monotonic()
        if now - self._cleared_at >= self.FULL_RESCAN_S:
            self._skip.clear()
            self._cleared_at = now
        found: list[WorkerProcess] = []
        cmdlines: dict[int, str] = {}
        present: set[int] = set()
        with os.scandir("/proc") as entries:
            for entry in entries:
                if not entry.name.isdigit():
                    continue
                pid = int(entry.name)
                present.add(pid)
                try:
                    inode = entry.inode()
                except OSError:
                    continue
                if self._skip.get(pid) == inode:
                    continue
                worker, args = self._look_at(pid)
                if worker is not None:
                    found.append(worker)
                    cmdlines[pid] = " ".join(args)
                elif not _may_become_worker(args, self._prefix):
                    self._skip[pid] = inode
        for pid in [p for p in self._skip if p not in present]:
            del self._skip[pid]
        return _without_unexeced_children(found), cmdlines

    def _look_at(self, pid: int) -> tuple[WorkerProcess | None, list[str]]:
        """``pid`` as a live worker of a watched run (or None), and its argv."""
        args = _cmdline(pid)
        if not any(module in args for module in WORKER_MODULES):
            return None, args
        parsed = parse_worker_argv(args)
        if parsed is None:
            return None, args
        root, shard, host = parsed
        named = os.path.normpath(root) + "/"
        if not (named.startswith(self._prefix) or named.startswith(self._named)):
            # Another test's worker. Resolving its root would touch its filesystem, which
            # that test may be hanging on purpose (a stopped FUSE server): this scan then
            # stood still for as long (32 s in a full run), blind to our own workers.
            return None, args
        real = os.path.realpath(root)
        if not (real + "/").startswith(self._prefix):
            return None, args
        stat = _stat(pid)
        if stat is None or is_dead_state(stat[0]):
            return None, args
        return WorkerProcess(pid, real, shard, host, stat[0], stat[1], stat[2]), args


def _without_unexeced_children(found: list[WorkerProcess]) -> list[WorkerProcess]:
    """``found`` less the children of a worker that carry its command line because they have
    not exec'd yet: a worker's pool processes (spawned: vfork, then exec; the worker waits in
    state D meanwhile) and the subprocesses its reward fns run. A worker never starts another
    worker of its own shard, so a "worker" whose parent is a worker of the same shard is one."""
    workers = {(w.pid, w.root, w.shard) for w in found}
    return [w for w in found if (w.ppid, w.root, w.shard) not in workers]


#: Shells that exec a worker after forking (the old script's respawn loop does).
_SHELLS = frozenset({"bash", "sh", "dash", "nohup"})


def _may_become_worker(args: list[str], prefix: str) -> bool:
    """A Python process, or a shell running a script under the watched directory (the old
    script's respawn loop, ``bash ROOT/ctl/HOST.wrap.sh``, forks and execs its workers):
    either may turn into a worker without a new pid. Other shells are many and never do."""
    if not args:
        return False
    name = os.path.basename(args[0])
    if "python" in name:
        return True
    return name in _SHELLS and any(arg.startswith(prefix) for arg in args[1:])


def scan_workers(under: Path) -> tuple[list[WorkerProcess], dict[int, str]]:
    """One full look: live reference workers whose ``--root`` lies under ``under``."""
    return Scanner(under).scan()


class InvariantMonitor:
    """Samples the machine's processes in a thread from ``start()`` to ``finish()``."""

    def __init__(self, under: Path, *, sample_s: float = SAMPLE_S) -> None:
        """See the class docstring."""
        self.under = under
        self.sample_s = sample_s
        self._scanner = Scanner(under)
        self._lock = threading.Lock()
        self._record = _Record()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # --- the thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Begin sampling (one sample is taken before this returns)."""
        self._sample()
        self._thread = threading.Thread(target=self._run, name="invariant-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """The sampler thread."""
        last = time.monotonic()
        try:
            while not self._stop.wait(self.sample_s):
                self._sample()
                now = time.monotonic()
                with self._lock:
                    self._record.max_gap_s = max(self._record.max_gap_s, now - last)
                last = now
        except BaseException as exc:  # noqa: BLE001 - thread root: the test reports it
            self._error = exc

    def _sample(self) -> None:
        """One look at /proc, recorded."""
        began = time.monotonic()
        workers, cmdlines = self._scanner.scan()
        now = time.monotonic()
        by_shard: dict[Shard, list[WorkerProcess]] = {}
        for w in workers:
            by_shard.setdefault((w.root, w.shard), []).append(w)
        with self._lock:
            rec = self._record
            rec.samples += 1
            rec.max_scan_s = max(rec.max_scan_s, now - began)
            rec.current = workers
            for w in workers:
                key = (w.pid, w.start_ticks)
                seen = rec.sightings.get(key)
                if seen is None:
                    rec.sightings[key] = Sighting(w.pid, (w.root, w.shard), w.host, now, now)
                else:
                    seen.last_seen = now
            for shard, live in by_shard.items():
                if len(live) > 1:
                    rec.violations.append(
                        Violation(now, shard, tuple(live), tuple(cmdlines[w.pid] for w in live))
                    )

    # --- questions ----------------------------------------------------------------------

    @property
    def samples(self) -> int:
        """Samples taken so far."""
        with self._lock:
            return self._record.samples

    @property
    def violations(self) -> list[Violation]:
        """Every sample that saw two live workers on one shard."""
        with self._lock:
            return list(self._record.violations)

    def live(self) -> list[WorkerProcess]:
        """The workers alive at the latest sample."""
        self._raise_if_crashed()
        return self._current()

    def _current(self) -> list[WorkerProcess]:
        """The latest sample's workers, even if the sampler has died."""
        with self._lock:
            return list(self._record.current)

    def _raise_if_crashed(self) -> None:
        """Refuse to answer from a record the dead sampler no longer updates."""
        if self._error is not None:
            raise AssertionError(f"the invariant monitor crashed: {self._error!r}")

    def live_on(self, shard: int, root: Path | None = None) -> list[int]:
        """Pids alive on ``shard`` (of ``root``, or any watched run) at the latest sample."""
        want = None if root is None else os.path.realpath(root)
        return [w.pid for w in self.live() if w.shard == shard and want in (None, w.root)]

    def pids_seen(
        self,
        shard: int,
        root: Path | None = None,
        *,
        since: float = 0.0,
        until: float = float("inf"),
    ) -> list[int]:
        """Worker pids of ``shard`` (of ``root``, or any watched run) seen alive at some sample
        within ``[since, until]`` (monotonic), in the order they first appeared."""
        self._raise_if_crashed()
        want = None if root is None else os.path.realpath(root)
        with self._lock:
            hits = [
                s
                for s in self._record.sightings.values()
                if s.shard[1] == shard
                and want in (None, s.shard[0])
                and s.last_seen >= since
                and s.first_seen <= until
            ]
        return [s.pid for s in sorted(hits, key=lambda s: s.first_seen)]

    def all_pids_seen(self) -> list[int]:
        """Every worker pid seen during the test, in order of appearance."""
        self._raise_if_crashed()
        with self._lock:
            hits = sorted(self._record.sightings.values(), key=lambda s: s.first_seen)
        return [s.pid for s in hits]

    def assert_clean(self) -> None:
        """Fail now if any sample so far saw two live workers on one shard."""
        self._raise_if_crashed()
        violations = self.violations
        if violations:
            raise AssertionError(_describe(violations))

    # --- the end ------------------------------------------------------------------------

    def finish(self, deadline_s: float) -> list[str]:
        """Stop sampling once no worker of the test is alive (or ``deadline_s`` passed);
        SIGKILL what is left. Returns every problem found, empty if none."""
        problems: list[str] = []
        end = time.monotonic() + deadline_s
        while self._current() and self._error is None and time.monotonic() < end:
            time.sleep(self.sample_s)  # wait-ok: polling the sampler's record under a deadline
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._sample()  # the verdict rests on a sample taken after the last wait
        except Exception as exc:  # noqa: BLE001 - reported below like a crash of the thread
            self._error = self._error or exc
        leftovers = self._current()
        if leftovers:
            problems.append(
                f"{len(leftovers)} worker(s) still running {deadline_s:g}s after the test"
                f" ended (killed now): "
                + ", ".join(f"pid {w.pid} shard {w.shard} host {w.host}" for w in leftovers)
            )
            for w in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGCONT)
                    os.kill(w.pid, signal.SIGKILL)
        if self._error is not None:
            problems.append(f"the invariant monitor crashed: {self._error!r}")
        violations = self.violations
        if violations:
            problems.append(_describe(violations))
        return problems

    @property
    def max_scan_s(self) -> float:
        """The longest one look at /proc took (a blocked read shows here, starvation not)."""
        with self._lock:
            return self._record.max_scan_s

    @property
    def max_gap_s(self) -> float:
        """The longest time between two samples: the blind spot of "never two workers"."""
        with self._lock:
            return self._record.max_gap_s


def _describe(violations: list[Violation]) -> str:
    """The first violation in full, and how many samples saw one."""
    first = violations[0]
    more = f" (and {len(violations) - 1} more samples)" if len(violations) > 1 else ""
    return f"one worker per shard violated{more}:\n{first}"
