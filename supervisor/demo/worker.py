"""The reference file-sharded reward worker: one shard of a run directory, stdlib only.

It stands in for ``areal.reward.fs_worker`` (same required flags) in the demo, the tests and the
benchmarks, and runs on worker hosts, so it imports nothing outside the standard library.

Run directory (DESIGN §5): tasks are ``<root>/inbox/<shard>/*.json`` (names starting with ``.``
and names not ending in ``.json`` are someone's temp files and are skipped), results go to
``<root>/outbox/<id>.json``, the heartbeat is ``<root>/status/<host>.json``. Every file is
written atomically (temp file in the same directory, fsync, rename).

Task policy:

- A task is ``{"id": str, ...}`` (``id`` defaults to the file stem) and is handed whole to
  ``reward_fn(task) -> float``. Its result ``{"id", "reward", "host", "shard", "pid",
  "finished_at"}`` is written before the inbox file is removed, so a crash in between repeats
  the task (at least once); a result that already exists only removes the inbox file.
- A reward fn that raises, or returns something that is not a finite number, yields a result
  with ``"reward": 0.0`` and ``"error": "<type>: <message>"``: the trainer waiting for that id
  is unblocked, it can tell the failure from a real zero, and the worker carries on.
- A task file that is not a JSON object with a usable id, and still is not after
  ``MALFORMED_GRACE_S`` (a writer that does not rename atomically gets that long to finish),
  is moved to ``inbox/<shard>/.bad/`` and gets an error result under its file stem.
- The reward fn gets the task object exactly as read (no ``id`` is added to it).

Heartbeat ``status/<host>.json``: ``{"ready", "heartbeat_at", "pid", "seq", "host", "shard",
"started_at", "processed", "in_flight", "failed", "concurrency", "reward_fn"}``; ``seq`` starts
at 0 and grows by one per write; ``processed`` counts finished inbox files (error results and
already-done duplicates included), ``failed`` the error results among them. Heartbeats come from
their own thread, so a busy reward fn does not delay them.

Reward fn: ``--reward-fn`` (``pkg.mod.func`` or ``pkg.mod:func``), else ``reward_fn`` in
``<root>/manifest.json``, else the built-in :func:`exact_match` (also named ``exact_match``).
One that cannot be imported is fatal: exit 2, never ready.

Stacks on demand: SIGUSR1 makes the worker write every thread's stack to stderr (``ctl/<host>.log``
under the supervisor) with ``faulthandler``; the supervisor sends it before it terminates a
stuck worker, where the host has no py-spy, to tell why it was stuck.

Exit codes: 0 after SIGTERM/SIGINT (stop taking tasks, finish in-flight ones, final heartbeat
with ``ready: false``); 2 for bad arguments, a bad environment or a bad reward fn; 3 for the
``abort_on_start`` fault; the fault's code for ``crash``.

Fault injection for tests, environment ``REWARD_WORKER_FAULT=kind[:key=value]...``:

- ``crash:after=S:code=N``  ``os._exit(N)`` (default 1) S seconds after becoming ready;
- ``exit0:after=S``         ``os._exit(0)`` S seconds after becoming ready, no final heartbeat;
- ``hang:after=S``          S seconds after becoming ready, stop heartbeating and taking tasks
  but stay alive; SIGTERM/SIGINT then kill it at once (default action), status left as it was;
- ``hang_ignore_term:after=S``  the same, but SIGTERM and SIGINT are ignored (SIGKILL only);
- ``slow_start:ready_after=S``  ready S seconds after the process started, not before;
- ``never_ready``           heartbeats with ``ready: false`` forever, takes no tasks;
- ``abort_on_start``        exit 3 before writing anything;
- ``hang_call:task=ID:marker=PATH``  the reward call of task ``ID`` (default: the first task)
  never returns, in :func:`hung_reward_call`, while the heartbeat thread keeps writing and the
  other task threads go on: a stuck worker. At most one call hangs per process; with
  ``marker``, only a worker that creates the file ``PATH`` (exclusively) hangs, so the worker
  that replaces it computes the task.

``after`` and ``ready_after`` default to 0; ``after`` counts from the moment the first ready
heartbeat is on disk, so a supervisor always gets to see the worker ready before the fault.
``REWARD_WORKER_CLOCK_OFFSET_S=X`` adds X seconds to every wall-clock stamp the worker writes
(``heartbeat_at``, ``started_at``, ``finished_at``) to fake clock skew;
``REWARD_WORKER_TASK_DELAY_S=X`` makes every task take X seconds longer, so there is work in
flight when a test kills the worker.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import json
import math
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Any, Final, SupportsFloat

FAULT_ENV: Final = "REWARD_WORKER_FAULT"
CLOCK_OFFSET_ENV: Final = "REWARD_WORKER_CLOCK_OFFSET_S"
TASK_DELAY_ENV: Final = "REWARD_WORKER_TASK_DELAY_S"

EXIT_OK: Final = 0
EXIT_FATAL: Final = 2
EXIT_ABORT: Final = 3

#: The name under which the built-in reward fn can be given explicitly.
BUILTIN_REWARD_FN: Final = "exact_match"

# New tasks are found by listing the inbox: 50 ms keeps pickup prompt while costing one
# directory read per 50 ms per worker (a READDIR on NFS, usually served from the cache).
IDLE_POLL_S: Final = 0.05
# A writer that creates the task file in place (no rename) may be read mid-write; give it this
# long before a task that does not parse is declared malformed.
MALFORMED_GRACE_S: Final = 1.0
# A task whose result could not be written (disk full, NFS error) is retried after this long,
# not on every scan, so a persistent error does not flood the log.
WRITE_RETRY_S: Final = 1.0
# Error texts go into result files and log lines; a reward fn may raise with a huge message.
MAX_ERROR_CHARS: Final = 2000

RewardFn = Callable[[Mapping[str, Any]], object]


# --------------------------------------------------------------------------------------------
# Pure parts: arguments, fault specs, tasks and results.


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerArgs:
    """The command line of one worker."""

    root: Path
    shard: int
    host: str
    concurrency: int
    heartbeat_interval_s: float = 1.0
    reward_fn: str | None = None


def _host_name(text: str) -> str:
    # The host name becomes the file name status/<host>.json.
    if not text or "/" in text or "\0" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"not usable as a file name: {text!r}")
    return text


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m supervisor.demo.worker``."""
    parser = argparse.ArgumentParser(
        prog="python -m supervisor.demo.worker",
        description="Reference file-sharded reward worker (stands in for areal.reward.fs_worker).",
    )
    parser.add_argument("--root", required=True, type=Path, help="run directory")
    parser.add_argument("--shard", required=True, type=_non_negative_int, help="inbox shard")
    parser.add_argument("--host", required=True, type=_host_name, help="names status/<host>.json")
    parser.add_argument(
        "--concurrency", required=True, type=_positive_int, help="tasks computed at once"
    )
    parser.add_argument(
        "--heartbeat-interval",
        dest="heartbeat_interval_s",
        type=_positive_seconds,
        default=1.0,
        help="seconds between heartbeats (default 1.0)",
    )
    parser.add_argument(
        "--reward-fn",
        default=None,
        help="pkg.mod.func or pkg.mod:func (default: manifest.json, then exact_match)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> WorkerArgs:
    """Parse the command line; raises ``SystemExit(2)`` with a usage message on bad input."""
    ns = build_parser().parse_args(argv)
    return WorkerArgs(
        root=ns.root,
        shard=ns.shard,
        host=ns.host,
        concurrency=ns.concurrency,
        heartbeat_interval_s=ns.heartbeat_interval_s,
        reward_fn=ns.reward_fn,
    )


class FaultKind(StrEnum):
    """The injectable faults; values are the names used in ``REWARD_WORKER_FAULT``."""

    CRASH = "crash"
    EXIT0 = "exit0"
    HANG = "hang"
    HANG_IGNORE_TERM = "hang_ignore_term"
    SLOW_START = "slow_start"
    NEVER_READY = "never_ready"
    ABORT_ON_START = "abort_on_start"
    HANG_CALL = "hang_call"


_FAULT_KEYS: Final[Mapping[FaultKind, frozenset[str]]] = {
    FaultKind.CRASH: frozenset({"after", "code"}),
    FaultKind.EXIT0: frozenset({"after"}),
    FaultKind.HANG: frozenset({"after"}),
    FaultKind.HANG_IGNORE_TERM: frozenset({"after"}),
    FaultKind.SLOW_START: frozenset({"ready_after"}),
    FaultKind.NEVER_READY: frozenset(),
    FaultKind.ABORT_ON_START: frozenset(),
    FaultKind.HANG_CALL: frozenset({"task", "marker"}),
}

#: Faults that fire ``after`` seconds past readiness.
TIMED_FAULTS: Final = frozenset(
    {FaultKind.CRASH, FaultKind.EXIT0, FaultKind.HANG, FaultKind.HANG_IGNORE_TERM}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """One injected fault, parsed from ``REWARD_WORKER_FAULT``."""

    kind: FaultKind
    after_s: float = 0.0
    code: int = 1
    ready_after_s: float = 0.0
    #: ``hang_call``: the task whose reward call hangs (None: the first), and the marker file
    #: that only one worker may create.
    task: str | None = None
    marker: str | None = None


def _fault_seconds(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{key}={text!r} must be a finite number of seconds >= 0")
    return value


def parse_fault(text: str | None) -> Fault | None:
    """Parse ``kind[:key=value]...``; None or blank means no fault; raises ValueError."""
    if text is None or not text.strip():
        return None
    head, *pairs = text.strip().split(":")
    try:
        kind = FaultKind(head.strip())
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise ValueError(f"unknown fault {head!r} (known: {known})") from None
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{kind}: expected key=value, got {pair!r}")
        if key not in _FAULT_KEYS[kind]:
            allowed = ", ".join(sorted(_FAULT_KEYS[kind])) or "none"
            raise ValueError(f"{kind}: unknown key {key!r} (allowed: {allowed})")
        if key in values:
            raise ValueError(f"{kind}: {key} given twice")
        values[key] = value.strip()
    code = 1
    if "code" in values:
        try:
            code = int(values["code"])
        except ValueError:
            raise ValueError(f"{kind}: code={values['code']!r} is not an integer") from None
        if not 0 <= code <= 255:
            raise ValueError(f"{kind}: code={code} is not an exit status (0-255)")
    return Fault(
        kind=kind,
        after_s=_fault_seconds("after", values["after"]) if "after" in values else 0.0,
        code=code,
        ready_after_s=(
            _fault_seconds("ready_after", values["ready_after"]) if "ready_after" in values else 0.0
        ),
        task=values.get("task") or None,
        marker=values.get("marker") or None,
    )


def parse_env_seconds(name: str, text: str | None, *, allow_negative: bool) -> float:
    """A seconds value from environment variable ``name``; unset or blank is 0; ValueError."""
    if text is None or not text.strip():
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if not math.isfinite(value) or (value < 0 and not allow_negative):
        bound = "finite" if allow_negative else "finite and >= 0"
        raise ValueError(f"{name}={text!r} must be {bound}")
    return value


def argv_template(heartbeat_interval_s: float | None = None) -> list[str]:
    """A ``worker.argv`` config value that runs this reference worker."""
    argv = ["{python}", "-m", "supervisor.demo.worker", "--root", "{root}", "--shard", "{shard}"]
    argv += ["--host", "{host}", "--concurrency", "{concurrency}"]
    if heartbeat_interval_s is not None:
        argv += ["--heartbeat-interval", str(heartbeat_interval_s)]
    return argv


def exact_match(task: Mapping[str, Any]) -> float:
    """1.0 when the task's answer equals its reference after stripping whitespace, else 0.0."""
    return 1.0 if str(task.get("answer")).strip() == str(task.get("reference")).strip() else 0.0


class RewardFnError(Exception):
    """The configured reward fn cannot be found, imported or called."""


def load_reward_fn(spec: str | None) -> RewardFn:
    """The callable named by ``pkg.mod.func`` or ``pkg.mod:attr.path``; None means exact_match.

    Raises RewardFnError naming the spec and the cause (including exceptions the imported
    module raises while it is imported).
    """
    if spec is None or spec.strip() in ("", BUILTIN_REWARD_FN):
        return exact_match
    spec = spec.strip()
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path or any(not part for part in attr_path.split(".")):
        raise RewardFnError(f"reward fn {spec!r}: expected pkg.mod.func or pkg.mod:func")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:  # an import may raise anything; each one is fatal here
        raise RewardFnError(
            f"reward fn {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise RewardFnError(
                f"reward fn {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(target):
        raise RewardFnError(f"reward fn {spec!r} is a {type(target).__name__}, not callable")
    fn: RewardFn = target
    return fn


def reward_fn_spec(cli_value: str | None, root: Path) -> str | None:
    """The reward fn to use: the flag, else ``reward_fn`` from the manifest, else None.

    Raises RewardFnError when the manifest exists but cannot be read or is not a JSON
    object: guessing the reward fn would silently produce wrong rewards.
    """
    if cli_value is not None:
        return cli_value
    manifest = root / "manifest.json"
    try:
        data = json.loads(manifest.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RewardFnError(f"{manifest}: unreadable: {exc}") from exc
    if not isinstance(data, dict):
        raise RewardFnError(f"{manifest}: not a JSON object")
    value = data.get("reward_fn")
    if value is None:
        return None
    if not isinstance(value, str):
        raise RewardFnError(f"{manifest}: reward_fn is {type(value).__name__}, not a string")
    return value


class MalformedTask(ValueError):
    """A task file that is not a JSON object with a usable id."""


def _usable_id(task_id: str) -> bool:
    # The id names outbox/<id>.json: it must stay one visible file name inside outbox/.
    return bool(task_id) and "/" not in task_id and "\0" not in task_id and task_id[0] != "."


def parse_task(data: bytes, stem: str) -> tuple[str, dict[str, Any]]:
    """``(task_id, task)`` from a task file's bytes; the id defaults to ``stem``.

    Raises MalformedTask when the bytes are not a JSON object or the id is unusable.
    """
    try:
        task = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise MalformedTask(f"not JSON: {exc}") from None
    if not isinstance(task, dict):
        raise MalformedTask(f"a JSON {type(task).__name__}, not an object")
    raw_id = task.get("id", stem)
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int):
        raise MalformedTask(f"id is {type(raw_id).__name__}, not a string")
    task_id = str(raw_id)
    if not _usable_id(task_id):
        raise MalformedTask(f"id {task_id!r} cannot name a result file")
    return task_id, task


def hung_reward_call() -> None:
    """The ``hang_call`` fault: a reward call that never returns (its thread waits forever,
    as on a lock nobody releases), while the heartbeat thread keeps writing. Named so that
    the stacks the supervisor captures show it."""
    threading.Event().wait()


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


def evaluate(task: Mapping[str, Any], reward_fn: RewardFn) -> tuple[float, str | None]:
    """``(reward, None)``, or ``(0.0, error)`` when the fn raises or returns a non-number."""
    try:
        value = reward_fn(task)
        # bool, int, float and numpy scalars all have __float__; str and None do not.
        if not isinstance(value, SupportsFloat):
            return 0.0, f"reward fn returned {type(value).__name__}, not a number"
        reward = float(value)
    except Exception as exc:  # noqa: BLE001 - a reward fn may raise anything; it becomes a result
        return 0.0, _error_text(exc)
    if not math.isfinite(reward):
        return 0.0, f"reward fn returned {reward}, not a finite number"
    return reward, None


def make_result(
    *,
    task_id: str,
    reward: float,
    error: str | None,
    host: str,
    shard: int,
    pid: int,
    finished_at: float,
) -> dict[str, Any]:
    """The JSON object written to ``outbox/<id>.json``; ``error`` only when there was one."""
    result: dict[str, Any] = {
        "id": task_id,
        "reward": reward,
        "host": host,
        "shard": shard,
        "pid": pid,
        "finished_at": finished_at,
    }
    if error is not None:
        result["error"] = error
    return result


def is_task_name(name: str) -> bool:
    """True for inbox names the worker takes: ``*.json`` not starting with a dot."""
    return name.endswith(".json") and not name.startswith(".") and len(name) > len(".json")


# --------------------------------------------------------------------------------------------
# I/O: files, log lines, threads, signals.


def write_json_atomic(path: Path, data: object) -> None:
    """Replace ``path`` with ``data`` as JSON; readers see the old file or the new one, whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
            f.write("\n")
            f.flush()
            # mkstemp creates 0600; the supervisor may read these files as another user. On
            # the descriptor: by path, a name swapped since would be changed instead.
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_log_lock = threading.Lock()


def _log(event: str, level: str = "info", **fields: object) -> None:
    """One JSON line on stderr (appended to ``ctl/<host>.log`` by the launcher)."""
    record = {
        "timestamp": datetime.now(UTC).isoformat(),
        "level": level,
        "event": event,
        "pid": os.getpid(),
        **fields,
    }
    line = json.dumps(record, default=str) + "\n"
    with _log_lock, contextlib.suppress(OSError, ValueError):  # a closed stderr is not fatal
        sys.stderr.write(line)
        sys.stderr.flush()


class _Worker:
    """One worker process: a scanner (main thread), task threads and a heartbeat thread."""

    def __init__(
        self, args: WorkerArgs, fault: Fault | None, clock_offset_s: float, task_delay_s: float
    ) -> None:
        self.args = args
        self.fault = fault
        self.clock_offset_s = clock_offset_s
        self.task_delay_s = task_delay_s
        self.pid = os.getpid()
        self.inbox = args.root / "inbox" / str(args.shard)
        self.bad_dir = self.inbox / ".bad"
        self.outbox = args.root / "outbox"
        self.status_path = args.root / "status" / f"{args.host}.json"
        self.started_mono = time.monotonic()
        self.started_at = self.now()
        self.reward_fn: RewardFn = exact_match
        self.reward_fn_name = BUILTIN_REWARD_FN
        self.scan_failing = False  # main thread only

        self.write_lock = threading.Lock()  # one heartbeat write at a time
        self.lock = threading.Lock()  # guards every field below
        self.ready = False
        self.seq = 0
        self.processed = 0
        self.failed = 0
        self.in_flight = 0
        self.claimed: set[str] = set()
        self.malformed_since: dict[str, float] = {}
        self.retry_at: dict[str, float] = {}

        self.tasks: queue.Queue[str] = queue.Queue()
        self.stopping = threading.Event()  # task threads: take no new task
        self.hung = threading.Event()  # hang fault: heartbeats and tasks stop
        self.beat_cond = threading.Condition()  # wakes the heartbeat thread to stop it
        self.beats_done = False
        # Set by signal handlers, which must not take locks (a handler runs between two
        # bytecodes of the main thread, possibly while it holds one).
        self.stop_signal: int | None = None

    def now(self) -> float:
        """The worker's wall clock, skewed by REWARD_WORKER_CLOCK_OFFSET_S."""
        return time.time() + self.clock_offset_s

    # -- heartbeats ------------------------------------------------------------------------

    def _status(self) -> dict[str, Any]:
        with self.lock:
            seq = self.seq
            self.seq += 1
            return {
                "ready": self.ready,
                "heartbeat_at": self.now(),
                "pid": self.pid,
                "seq": seq,
                "host": self.args.host,
                "shard": self.args.shard,
                "started_at": self.started_at,
                "processed": self.processed,
                "in_flight": self.in_flight,
                "failed": self.failed,
                "concurrency": self.args.concurrency,
                "reward_fn": self.reward_fn_name,
            }

    def write_heartbeat(self) -> None:
        """Write one heartbeat; a failed write is logged and the next one tried as usual."""
        # One writer at a time, seq taken inside: the file on disk never goes back in seq.
        with self.write_lock:
            try:
                write_json_atomic(self.status_path, self._status())
            except OSError as exc:
                _log("heartbeat.write_failed", level="warning", error=_error_text(exc))

    def _heartbeat_loop(self) -> None:
        while True:
            with self.beat_cond:
                if self.beats_done or self.hung.is_set():
                    return
            self.write_heartbeat()
            with self.beat_cond:
                self.beat_cond.wait_for(
                    lambda: self.beats_done or self.hung.is_set(),
                    timeout=self.args.heartbeat_interval_s,
                )

    def stop_heartbeats(self, thread: threading.Thread) -> None:
        """Stop the heartbeat thread and wait for it, so the final beat is the last one."""
        with self.beat_cond:
            self.beats_done = True
            self.beat_cond.notify_all()
        thread.join()

    # -- tasks -----------------------------------------------------------------------------

    def scan(self) -> int:
        """Queue inbox files not already claimed; the number queued."""
        try:
            names = sorted(
                entry.name for entry in os.scandir(self.inbox) if is_task_name(entry.name)
            )
        except OSError as exc:
            if not self.scan_failing:  # once per outage, not every IDLE_POLL_S
                _log("inbox.scan_failed", level="warning", error=_error_text(exc))
            self.scan_failing = True
            return 0
        if self.scan_failing:
            _log("inbox.scan_recovered")
            self.scan_failing = False
        now = time.monotonic()
        fresh: list[str] = []
        with self.lock:
            for name in names:
                if name in self.claimed or self.retry_at.get(name, 0.0) > now:
                    continue
                self.retry_at.pop(name, None)
                self.claimed.add(name)
                fresh.append(name)
        for name in fresh:
            self.tasks.put(name)
        return len(fresh)

    def _task_loop(self) -> None:
        while not self.stopping.is_set():
            if self.hung.is_set():
                self.stopping.wait()
                return
            try:
                name = self.tasks.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                continue
            if self.stopping.is_set() or self.hung.is_set():
                self._release(name)
                continue
            with self.lock:
                self.in_flight += 1
            try:
                self._process(name)
            except Exception as exc:  # noqa: BLE001 - task thread root: log, keep serving
                with self.lock:
                    self.retry_at[name] = time.monotonic() + WRITE_RETRY_S
                _log(
                    "task.io_failed",
                    level="error",
                    file=name,
                    error=_error_text(exc),
                    traceback=traceback.format_exc(),
                )
            finally:
                with self.lock:
                    self.in_flight -= 1
                self._release(name)

    def _release(self, name: str) -> None:
        with self.lock:
            self.claimed.discard(name)

    def _count(self, *, failed: bool) -> None:
        with self.lock:
            self.processed += 1
            if failed:
                self.failed += 1

    def _process(self, name: str) -> None:
        path = self.inbox / name
        stem = name[: -len(".json")]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return  # taken by an earlier incarnation of this worker, or withdrawn
        try:
            task_id, task = parse_task(data, stem)
        except MalformedTask as exc:
            self._malformed(path, stem, str(exc))
            return
        with self.lock:
            self.malformed_since.pop(name, None)
        result_path = self.outbox / f"{task_id}.json"
        if result_path.exists():
            # At least once: an earlier worker wrote the result and died before this unlink.
            path.unlink(missing_ok=True)
            self._count(failed=False)
            _log("task.duplicate", task=task_id)
            return
        if self.task_delay_s > 0:
            time.sleep(self.task_delay_s)
        reward, error = evaluate(task, self.reward_fn)
        result = make_result(
            task_id=task_id,
            reward=reward,
            error=error,
            host=self.args.host,
            shard=self.args.shard,
            pid=self.pid,
            finished_at=self.now(),
        )
        write_json_atomic(result_path, result)
        path.unlink(missing_ok=True)
        self._count(failed=error is not None)
        if error is not None:
            _log("task.failed", level="warning", task=task_id, error=error)

    def _hanging(self, reward_fn: RewardFn, fault: Fault) -> RewardFn:
        """``reward_fn``, but the call for ``fault.task`` (or the first) never returns."""
        hung = threading.Lock()  # taken by the one call that hangs

        def reward(task: Mapping[str, Any]) -> object:
            task_id = str(task.get("id"))
            wanted = fault.task is None or task_id == fault.task
            if wanted and hung.acquire(blocking=False) and self._claim_marker(fault.marker):
                _log("worker.fault", level="warning", kind=fault.kind.value, task=task_id)
                hung_reward_call()
            return reward_fn(task)

        return reward

    @staticmethod
    def _claim_marker(marker: str | None) -> bool:
        """Whether this worker may hang: it creates ``marker`` first (or there is none)."""
        if marker is None:
            return True
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return False
        return True

    def _malformed(self, path: Path, stem: str, reason: str) -> None:
        now = time.monotonic()
        with self.lock:
            first = self.malformed_since.setdefault(path.name, now)
        if now - first < MALFORMED_GRACE_S:
            with self.lock:
                self.retry_at[path.name] = now + IDLE_POLL_S
            return
        result_path = self.outbox / f"{stem}.json"
        if not result_path.exists():
            result = make_result(
                task_id=stem,
                reward=0.0,
                error=f"malformed task: {reason}"[:MAX_ERROR_CHARS],
                host=self.args.host,
                shard=self.args.shard,
                pid=self.pid,
                finished_at=self.now(),
            )
            write_json_atomic(result_path, result)
        self.bad_dir.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, self.bad_dir / path.name)
        with self.lock:
            self.malformed_since.pop(path.name, None)
        self._count(failed=True)
        _log("task.malformed", level="warning", file=path.name, reason=reason)

    # -- lifecycle -------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signum

    def _wait_until(self, deadline: float | None) -> bool:
        """Sleep until monotonic ``deadline`` (None: forever); False if a stop signal came."""
        while self.stop_signal is None:
            if deadline is not None and time.monotonic() >= deadline:
                return True
            time.sleep(IDLE_POLL_S)
        return False

    def _apply_fault(self, fault: Fault, beats: threading.Thread) -> None:
        if fault.kind in (FaultKind.CRASH, FaultKind.EXIT0):
            code = fault.code if fault.kind is FaultKind.CRASH else EXIT_OK
            _log("worker.fault", level="warning", kind=fault.kind.value, code=code)
            os._exit(code)
        # A hung worker is stuck, not stopping: no final heartbeat, in-flight tasks abandoned.
        action = signal.SIG_IGN if fault.kind is FaultKind.HANG_IGNORE_TERM else signal.SIG_DFL
        signal.signal(signal.SIGTERM, action)
        signal.signal(signal.SIGINT, action)
        self.hung.set()
        with self.beat_cond:
            self.beat_cond.notify_all()
        beats.join()  # once the event below is logged, no heartbeat follows
        _log("worker.fault", level="warning", kind=fault.kind.value)

    def run(self) -> int:
        """Serve the shard until a stop signal; the process exit code."""
        for directory in (self.inbox, self.outbox, self.status_path.parent):
            directory.mkdir(parents=True, exist_ok=True)
        beats = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beats.start()
        _log(
            "worker.starting",
            host=self.args.host,
            shard=self.args.shard,
            root=str(self.args.root),
            concurrency=self.args.concurrency,
            fault=self.fault.kind.value if self.fault else None,
        )
        try:
            spec = reward_fn_spec(self.args.reward_fn, self.args.root)
            self.reward_fn = load_reward_fn(spec)
        except RewardFnError as exc:
            _log("worker.reward_fn_failed", level="error", error=str(exc))
            self._finish(beats)
            return EXIT_FATAL
        self.reward_fn_name = spec or BUILTIN_REWARD_FN
        if self.fault is not None and self.fault.kind is FaultKind.HANG_CALL:
            self.reward_fn = self._hanging(self.reward_fn, self.fault)

        ready_at: float | None = self.started_mono
        if self.fault is not None and self.fault.kind is FaultKind.SLOW_START:
            ready_at = self.started_mono + self.fault.ready_after_s
        elif self.fault is not None and self.fault.kind is FaultKind.NEVER_READY:
            ready_at = None
        if not self._wait_until(ready_at):
            return self._stop(beats, [])

        with self.lock:
            self.ready = True
        # Written now, not at the heartbeat thread's next tick: the fault clock below starts
        # once a ready heartbeat is on disk.
        self.write_heartbeat()
        threads = [
            threading.Thread(target=self._task_loop, name=f"task-{i}", daemon=True)
            for i in range(self.args.concurrency)
        ]
        for thread in threads:
            thread.start()
        _log("worker.ready", reward_fn=self.reward_fn_name)

        fault_at: float | None = None
        if self.fault is not None and self.fault.kind in TIMED_FAULTS:
            # Counted from the first ready heartbeat on disk, so it is always seen.
            fault_at = time.monotonic() + self.fault.after_s
        while self.stop_signal is None:
            if fault_at is not None and self.fault is not None and time.monotonic() >= fault_at:
                fault_at = None
                self._apply_fault(self.fault, beats)
            if self.hung.is_set():
                time.sleep(IDLE_POLL_S)
                continue
            if self.tasks.qsize() < self.args.concurrency:
                self.scan()
            time.sleep(IDLE_POLL_S)
        return self._stop(beats, threads)

    def _stop(self, beats: threading.Thread, threads: list[threading.Thread]) -> int:
        signame = signal.Signals(self.stop_signal).name if self.stop_signal else None
        with self.lock:
            in_flight = self.in_flight
        _log("worker.stopping", signal=signame, in_flight=in_flight)
        self.stopping.set()
        for thread in threads:
            thread.join()  # in-flight tasks finish and write their results
        self._finish(beats)
        _log("worker.stopped", processed=self.processed, failed=self.failed)
        return EXIT_OK

    def _finish(self, beats: threading.Thread) -> None:
        self.stop_heartbeats(beats)
        with self.lock:
            self.ready = False
        self.write_heartbeat()


def main(argv: Sequence[str] | None = None) -> int:
    """Run a worker with ``argv`` (default ``sys.argv[1:]``); the process exit code."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad arguments
        return exc.code if isinstance(exc.code, int) else EXIT_FATAL
    try:
        fault = parse_fault(os.environ.get(FAULT_ENV))
        offset_s = parse_env_seconds(
            CLOCK_OFFSET_ENV, os.environ.get(CLOCK_OFFSET_ENV), allow_negative=True
        )
        delay_s = parse_env_seconds(
            TASK_DELAY_ENV, os.environ.get(TASK_DELAY_ENV), allow_negative=False
        )
    except ValueError as exc:
        _log("worker.bad_environment", level="error", error=str(exc))
        return EXIT_FATAL
    if fault is not None and fault.kind is FaultKind.ABORT_ON_START:
        _log("worker.fault", level="warning", kind=fault.kind.value, code=EXIT_ABORT)
        return EXIT_ABORT
    worker = _Worker(args, fault, offset_s, delay_s)
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, worker._on_signal) for signum in handled}
    stacks = _register_stacks_signal()
    try:
        return worker.run()
    finally:
        if stacks:
            faulthandler.unregister(STACKS_SIGNAL)
        for signum, handler in previous.items():
            # None: the old handler was not installed from Python; the default is closest.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


#: Answered with every thread's stack on stderr (the supervisor's agent sends it).
STACKS_SIGNAL: Final = signal.SIGUSR1


def _register_stacks_signal() -> bool:
    """Have ``faulthandler`` write all threads' stacks to stderr on STACKS_SIGNAL; False where
    stderr is no real file (a test's captured stream), which leaves the signal alone."""
    try:
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no fileno, or a closed stderr
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
