"""The reference file-sharded reward worker: one shard of a run directory, stdlib only.

It speaks the protocol of ``areal.reward.fs_worker``, the worker our users run (its trainer
client is ``FSRewardClient``), and behaves like it wherever the supervisor or the trainer can
tell, so that the demo, the tests and the benchmarks exercise the real thing's shape: one
coordinator process and a pool of reward processes. It runs on worker hosts under Python 3.11+
and imports nothing outside the standard library. It is written from the protocol, not copied.

Run directory (DESIGN §5): tasks are ``<root>/inbox/<shard>/<task_id>.json`` (names starting
with ``.`` and names not ending in ``.json`` are writers' temp files and are skipped), results
go to ``<root>/outbox/<task_id>.json``, the heartbeat is ``<root>/status/<host>.json``. Every
file is written atomically (temp file in the same directory, fsync, rename).

Tasks and results:

- A task is the real record ``{"schema_version", "task_id", "reward_fn", "args", "kwargs",
  "created_at"}``. ``reward_fn`` names the reward function of that task by import path
  (``pkg.mod.func``; ``pkg.mod:func`` too); a pool process imports it (once per process) and
  calls ``fn(*args, **kwargs)``. ``task_id`` defaults to the file stem.
- Tasks are taken oldest first (by mtime), at most ``--concurrency`` at a time.
- The result is the real record ``{"schema_version", "task_id", "status", "score", "error",
  "queue_wait_ms", "verify_ms", "total_ms", "worker_host", "shard", "finished_at"}``, written
  before the inbox file is removed, so a task whose worker dies in between is scored again by
  its successor (at least once); a result that already exists only removes the inbox file.
- ``status`` is ``"error"`` (``score`` null, ``error`` says why) when the reward fn raises,
  cannot be imported (no such module or attribute, a syntax error in it) or returns no finite
  number; when the task is JSON but not a usable record (``bad_task: ...``); when the file is
  not JSON and still is not after ``MALFORMED_GRACE_S`` (``bad_inbox_json: ...``, as the real
  worker says; a writer that does not rename atomically gets that long to finish); and when a
  pool process died under it twice (below). None of these stops the worker or its readiness.

The pool is a ``ProcessPoolExecutor`` of ``--concurrency`` processes, started with **spawn**:
the real worker ends up with spawn too (its ``max_tasks_per_child`` requires it), so reward
fns are imported and run in fresh interpreters in the worker's process group and session, as
in production; fork would copy a process that already runs threads (the heartbeat, the
executor's manager), which can deadlock the child on a lock held at the fork and is
deprecated from Python 3.12; forkserver (3.14's default) would add a server process between
the worker and its pool. Processes start on demand. No ``max_tasks_per_child``: in CPython
3.11 to 3.13 it can deadlock the pool (gh-115634). Pool processes ignore SIGINT and SIGTERM:
the coordinator decides when they end, so a stop drains them whether the signal came to the
coordinator alone or to its whole group (as the supervisor sends it; the real worker's pool
processes die of it, and the task in flight gets an error result). They exit within
``PARENT_CHECK_S`` when the coordinator is gone, so a SIGKILLed worker leaves none behind.

A pool process that dies (a reward fn that segfaults or calls ``os._exit``, the OOM killer)
breaks the pool: every task in flight in it fails with ``BrokenProcessPool``. The worker kills
what is left of that pool, starts a new one and carries on, ready throughout. The tasks that
were in flight are suspects: their inbox files stay, and each runs again alone (nothing else in
flight meanwhile), so a second break is that task's own doing: it gets an error result
(``pool_broken: ...``); an innocent suspect gets its result as usual. (The real worker writes an
error result for the first broken task it drains, and never takes the others again in its
lifetime: its ``_seen`` set remembers them, so their trainers wait until their timeout.)

Heartbeat ``status/<host>.json``, with the real worker's fields: ``host shard ready
heartbeat_at started_at pid concurrency inflight queue_depth qps completed errors
semantic_zero verify_timeout_n queue_wait_ms_p50 queue_wait_ms_p95 verify_ms_p50 verify_ms_p95
rss_gib``, plus ``seq`` (0 at the first write, one more at each). ``completed`` counts ok
results and ``errors`` error results (so a stuck worker advances neither), ``semantic_zero``
the ok results scoring 0, ``inflight`` the tasks handed to the pool and not finished,
``queue_depth`` the task files in the shard's inbox (in flight included), ``qps`` ok results
per second over the last 5 s; the percentiles cover the last 512 tasks; ``verify_timeout_n``
stays 0 (no verify timeout, as in the real worker); ``rss_gib`` is the coordinator's peak RSS
in GiB (the real worker's figure is 1024 times too small). Heartbeats come from their own
thread (the real worker writes them from its main loop), so they go on while every pool
process is stuck in a reward call.

Stop: SIGTERM or SIGINT: no new task is taken and heartbeats say ``ready: false``; tasks in
flight get ``--drain-timeout`` (30 s, as in the real worker) to finish and have their results
written; those still running then are abandoned to the successor (their pool processes killed,
their inbox files left); a final heartbeat with ``ready: false``; no pool process outlives the
exit; exit 0.

Stacks on demand: SIGUSR1 makes the coordinator write every thread's stack to stderr
(``ctl/<host>.log`` under the supervisor) with ``faulthandler``, and pass the signal on to each
pool process that handles it, which writes its own: a reward call stuck in a pool process shows
in the log. The supervisor sends it before it terminates a stuck worker, where the host has no
py-spy, to tell why it was stuck.

Exit codes: 0 after SIGTERM/SIGINT; 2 for bad arguments or a bad environment (the variables
below); 3 for the ``abort_on_start`` fault; the fault's code for ``crash``.

Fault injection for tests, environment ``REWARD_WORKER_FAULT=kind[:key=value]...``:

- ``crash:after=S:code=N``  ``os._exit(N)`` (default 1) S seconds after becoming ready;
- ``exit0:after=S``         ``os._exit(0)`` S seconds after becoming ready, no final heartbeat;
- ``hang:after=S``          S seconds after becoming ready, stop heartbeating and taking tasks
  but stay alive; SIGTERM/SIGINT then kill it at once (default action), status left as it was;
- ``hang_ignore_term:after=S``  the same, but SIGTERM and SIGINT are ignored (SIGKILL only);
- ``slow_start:ready_after=S``  ready S seconds after the process started, not before;
- ``never_ready``           heartbeats with ``ready: false`` forever, takes no tasks;
- ``abort_on_start``        exit 3 before writing anything;
- ``hang_call:task=ID:marker=PATH``  the reward call of task ``ID`` (default: the first task
  this worker hands to its pool) never returns, in :func:`hung_reward_call` inside its pool
  process, while the coordinator keeps heartbeating and the other pool processes keep working:
  a stuck worker (``inflight`` > 0, ``completed`` + ``errors`` frozen once the rest is done).
  At most one call hangs per worker; with ``marker``, only a worker that creates the file
  ``PATH`` (exclusively) hangs, so the worker that replaces it computes the task.

``after`` and ``ready_after`` default to 0; ``after`` counts from the moment the first ready
heartbeat is on disk, so a supervisor always gets to see the worker ready before the fault.
``REWARD_WORKER_CLOCK_OFFSET_S=X`` adds X seconds to every wall-clock stamp the worker writes
(``heartbeat_at``, ``started_at``, ``finished_at``, and the clock it measures queue waits with)
to fake clock skew; ``REWARD_WORKER_TASK_DELAY_S=X`` makes every reward call take X seconds
longer, so there is work in flight when a test stops or kills the worker.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import json
import math
import multiprocessing
import multiprocessing.context
import os
import resource
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any, Final, NamedTuple, SupportsFloat

FAULT_ENV: Final = "REWARD_WORKER_FAULT"
CLOCK_OFFSET_ENV: Final = "REWARD_WORKER_CLOCK_OFFSET_S"
TASK_DELAY_ENV: Final = "REWARD_WORKER_TASK_DELAY_S"

EXIT_OK: Final = 0
EXIT_FATAL: Final = 2
EXIT_ABORT: Final = 3
#: A pool process whose coordinator is gone exits with this (nobody reads it: it is an orphan).
EXIT_ORPHANED: Final = 70

#: Answered with every thread's stack on stderr (the supervisor's agent sends it).
STACKS_SIGNAL: Final = signal.SIGUSR1
# Blocked while pool processes are spawned, so each starts with them blocked (the mask passes
# through fork and exec) and a SIGTERM to the group, or a SIGUSR1, that comes while it boots
# waits until its initializer has set them up instead of killing it (the resource tracker
# is started the same way).
_SPAWN_BLOCKED: Final = frozenset({signal.SIGTERM, signal.SIGINT, STACKS_SIGNAL})

#: The protocol version of task and result records (``areal.reward.fs_protocol``).
SCHEMA_VERSION: Final = 1
#: The built-in reward fn, by the import path a task names it with.
BUILTIN_REWARD_FN: Final = "supervisor.demo.worker.exact_match"

# New tasks are found by listing the inbox: 50 ms, as the real worker, keeps pickup prompt
# while costing one directory read per 50 ms per worker (a READDIR on NFS, usually cached).
IDLE_POLL_S: Final = 0.05
# A writer that creates the task file in place (no rename) may be read mid-write; give it this
# long before a task that does not parse is declared malformed.
MALFORMED_GRACE_S: Final = 1.0
# A task whose file could not be read or whose result could not be written (disk full, NFS
# error) is tried again after this long, not on every scan, so a lasting error does not flood
# the log.
WRITE_RETRY_S: Final = 1.0
# Error texts go into result files and log lines; a reward fn may raise with a huge message.
MAX_ERROR_CHARS: Final = 2000
#: How long tasks in flight get to finish after SIGTERM: the real worker's bound.
DRAIN_TIMEOUT_S: Final = 30.0
# qps and the percentiles: the real worker's windows (the last 5 s, the last 512 tasks).
QPS_WINDOW_S: Final = 5.0
SAMPLES: Final = 512
# A pool process checks this often whether its coordinator is still its parent: an orphan
# (the coordinator was SIGKILLed or crashed) exits instead of idling forever.
PARENT_CHECK_S: Final = 0.5
#: A task in flight at this many pool breaks (the last with it alone in flight) is answered
#: with an error: its reward fn kills its process.
MAX_POOL_BREAKS: Final = 2
# Joining a shut-down pool: idle processes take a sentinel and exit at once; this bounds the
# wait for one that does not before it is killed.
POOL_JOIN_S: Final = 5.0


# --------------------------------------------------------------------------------------------
# Pure parts: arguments, fault specs, tasks, reward calls and results.


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerArgs:
    """The command line of one worker."""

    root: Path
    shard: int
    host: str
    concurrency: int
    heartbeat_interval_s: float = 1.0
    drain_timeout_s: float = DRAIN_TIMEOUT_S


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


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
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
        "--concurrency", required=True, type=_positive_int, help="pool processes (tasks at once)"
    )
    parser.add_argument(
        "--heartbeat-interval",
        dest="heartbeat_interval_s",
        type=_positive_seconds,
        default=1.0,
        help="seconds between heartbeats (default 1.0)",
    )
    parser.add_argument(
        "--drain-timeout",
        dest="drain_timeout_s",
        type=_non_negative_seconds,
        default=DRAIN_TIMEOUT_S,
        help=f"seconds tasks in flight get to finish after SIGTERM (default {DRAIN_TIMEOUT_S:g})",
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
        drain_timeout_s=ns.drain_timeout_s,
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


def exact_match(
    prompt: object,
    completions: object,
    prompt_ids: object = None,
    completion_ids: object = None,
    answer: object = None,
    **kwargs: object,
) -> float:
    """1.0 when ``str(answer)`` occurs in ``str(completions)``, else 0.0 (0.0 without an
    answer): the signature of AReaL's reward fns, as the trainer's client calls them."""
    if answer is None:
        return 0.0
    return 1.0 if str(answer) in str(completions) else 0.0


class MalformedTask(ValueError):
    """Task bytes that are not JSON (perhaps still being written)."""


class BadTask(ValueError):
    """A task file that is JSON but not a usable task record; its result goes to ``task_id``."""

    def __init__(self, reason: str, task_id: str) -> None:
        super().__init__(reason)
        self.task_id = task_id


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One task record, as read from the inbox."""

    task_id: str
    reward_fn: str
    args: list[Any]
    kwargs: dict[str, Any]
    #: The writer's wall clock, for the queue wait; None when the record has none.
    created_at: float | None


def usable_id(task_id: str) -> bool:
    """Whether ``task_id`` can name ``outbox/<task_id>.json``: one visible file name there."""
    return bool(task_id) and "/" not in task_id and "\0" not in task_id and task_id[0] != "."


def parse_task(data: bytes, stem: str) -> Task:
    """The task in a task file's bytes; ``task_id`` defaults to the file ``stem``.

    Raises MalformedTask when the bytes are not JSON, BadTask when they are JSON but not a
    task record (no import path in ``reward_fn``, ``args`` not a list, ...).
    """
    try:
        obj = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise MalformedTask(str(exc)) from None
    if not isinstance(obj, dict):
        raise BadTask(f"a JSON {type(obj).__name__}, not an object", stem)
    raw_id = obj.get("task_id")
    if raw_id is None or raw_id == "":
        task_id = stem  # as the real worker: task.get("task_id") or path.stem
    elif isinstance(raw_id, str):
        task_id = raw_id
    else:
        raise BadTask(f"task_id is {type(raw_id).__name__}, not a string", stem)
    if not usable_id(task_id):
        raise BadTask(f"task_id {task_id!r} cannot name a result file", stem)
    reward_fn = obj.get("reward_fn")
    if not isinstance(reward_fn, str) or not reward_fn.strip():
        raise BadTask("reward_fn is not an import path (pkg.mod.func)", task_id)
    args = obj.get("args")
    args = [] if args is None else args
    if not isinstance(args, list):
        raise BadTask(f"args is {type(args).__name__}, not a list", task_id)
    kwargs = obj.get("kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise BadTask(f"kwargs is {type(kwargs).__name__}, not an object", task_id)
    created = obj.get("created_at")
    created_at = (
        float(created)
        if isinstance(created, int | float)
        and not isinstance(created, bool)
        and math.isfinite(created)
        else None
    )
    return Task(
        task_id=task_id,
        reward_fn=reward_fn.strip(),
        args=args,
        kwargs=kwargs,
        created_at=created_at,
    )


def is_task_name(name: str) -> bool:
    """True for inbox names the worker takes: ``*.json`` not starting with a dot."""
    return name.endswith(".json") and not name.startswith(".") and len(name) > len(".json")


class RewardFnError(Exception):
    """A task's reward fn cannot be found, imported or called."""


def load_reward_fn(spec: str) -> Callable[..., object]:
    """The callable named by ``pkg.mod.func`` or ``pkg.mod:attr.path``.

    Raises RewardFnError naming the spec and the cause (including whatever the imported
    module raises while it is imported, a SyntaxError for one).
    """
    spec = spec.strip()
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path or any(not part for part in attr_path.split(".")):
        raise RewardFnError(f"reward_fn {spec!r}: expected pkg.mod.func or pkg.mod:func")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:  # an import may raise anything: it is the task's error
        raise RewardFnError(
            f"reward_fn {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise RewardFnError(
                f"reward_fn {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(target):
        raise RewardFnError(f"reward_fn {spec!r} is a {type(target).__name__}, not callable")
    return target


def error_text(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, as the real worker writes it, cut to MAX_ERROR_CHARS."""
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


class Outcome(NamedTuple):
    """What a reward call came to: ``("ok", score, None)`` or ``("error", None, why)``."""

    status: str
    score: float | None
    error: str | None
    verify_ms: float | None = None


def call_reward(
    fn: Callable[..., object], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Outcome:
    """``fn(*args, **kwargs)`` as a score, or an error when it raises or returns no finite
    number (the real worker would take ``"1.0"`` and NaN; a trainer wants neither)."""
    try:
        value = fn(*args, **kwargs)
        # bool, int, float and numpy scalars all have __float__; str and None do not.
        if not isinstance(value, SupportsFloat):
            return Outcome(
                "error", None, f"reward fn returned {type(value).__name__}, not a number"
            )
        score = float(value)
    except Exception as exc:  # noqa: BLE001 - a reward fn may raise anything; it becomes a result
        return Outcome("error", None, error_text(exc))
    if not math.isfinite(score):
        return Outcome("error", None, f"reward fn returned {score}, not a finite number")
    return Outcome("ok", score, None)


def make_result(
    *,
    task_id: str,
    outcome: Outcome,
    queue_wait_ms: float | None,
    host: str,
    shard: int,
    finished_at: float,
) -> dict[str, Any]:
    """The JSON object written to ``outbox/<task_id>.json``: the real worker's result record."""
    verify_ms = outcome.verify_ms
    total_ms = None
    if queue_wait_ms is not None or verify_ms is not None:
        total_ms = (queue_wait_ms or 0.0) + (verify_ms or 0.0)
    return {
        "schema_version": SCHEMA_VERSION,
        "task_id": task_id,
        "status": outcome.status,
        "score": outcome.score,
        "error": None if outcome.error is None else outcome.error[:MAX_ERROR_CHARS],
        "queue_wait_ms": queue_wait_ms,
        "verify_ms": verify_ms,
        "total_ms": total_ms,
        "worker_host": host,
        "shard": shard,
        "finished_at": finished_at,
    }


def percentile(samples: Iterable[float], p: float) -> float | None:
    """The nearest-rank ``p``-th percentile of ``samples`` (None for none), as the real
    worker computes it."""
    ordered = sorted(samples)
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(p / 100.0 * (len(ordered) - 1))))
    return ordered[index]


def rss_gib() -> float:
    """The peak resident set size of this process, in GiB (``ru_maxrss`` is KiB on Linux,
    bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024**3 if sys.platform == "darwin" else 1024**2)


# --------------------------------------------------------------------------------------------
# The pool side: what runs in a pool process.


class Job(NamedTuple):
    """What a pool process is sent: one task's call, and the test faults that bend it."""

    task_id: str
    reward_fn: str
    args: list[Any]
    kwargs: dict[str, Any]
    hang: bool = False
    delay_s: float = 0.0


#: Reward fns imported in this (pool) process, by import path: each imported once.
_FN_CACHE: dict[str, Callable[..., object]] = {}


def cached_reward_fn(spec: str) -> Callable[..., object]:
    """``load_reward_fn(spec)``, imported once per process; a failure is not cached (the
    module may be fixed, or installed, while the worker runs)."""
    fn = _FN_CACHE.get(spec)
    if fn is None:
        fn = _FN_CACHE[spec] = load_reward_fn(spec)
    return fn


def run_job(job: Job) -> Outcome:
    """Score one task in a pool process; every failure of the task's own is an Outcome."""
    started = time.perf_counter()
    if job.delay_s > 0:
        time.sleep(job.delay_s)
    if job.hang:
        _log("worker.fault", level="warning", kind=FaultKind.HANG_CALL.value, task=job.task_id)
        hung_reward_call()
    try:
        fn = cached_reward_fn(job.reward_fn)
    except RewardFnError as exc:
        outcome = Outcome("error", None, str(exc)[:MAX_ERROR_CHARS])
    else:
        outcome = call_reward(fn, job.args, job.kwargs)
    return outcome._replace(verify_ms=(time.perf_counter() - started) * 1000.0)


def hung_reward_call() -> None:
    """The ``hang_call`` fault: a reward call that never returns (it waits forever, as on a
    lock nobody releases), in a pool process, while the coordinator keeps heartbeating. Named
    so that the stacks the supervisor captures show it."""
    threading.Event().wait()


def _pool_process_init(coordinator: int) -> None:
    """Run in each pool process before its first task: leave stopping to the coordinator,
    answer the stacks signal, and exit once the coordinator is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a pending one is discarded here
    _register_stacks_signal()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SPAWN_BLOCKED)
    watch = threading.Thread(
        target=_exit_when_orphaned, args=(coordinator,), name="coordinator-watch", daemon=True
    )
    watch.start()


def _exit_when_orphaned(coordinator: int) -> None:
    while os.getppid() == coordinator:
        time.sleep(PARENT_CHECK_S)
    os._exit(EXIT_ORPHANED)


# --------------------------------------------------------------------------------------------
# I/O: files, log lines, the pool, threads, signals.


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


def handles_signal(pid: int, sig: int) -> bool:
    """``pid`` has a handler for ``sig`` (its ``SigCgt`` mask in /proc says so)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class _PoolProcess(multiprocessing.context.SpawnProcess):
    """A pool process, whose ``terminate`` is a SIGKILL.

    The executor terminates the processes of a pool it finds broken, and only then. Ours
    ignore SIGTERM (the coordinator decides when they end), so a SIGTERM would leave them
    running, and from Python 3.12 the executor's manager thread then joins them holding the
    executor's ``_shutdown_lock``, which ``submit`` takes: a coordinator that submits while
    a pool breaks (a task file comes in, or a call ends and frees its slot, as a pool process
    dies) would wait for that lock forever, with nobody left to kill them. SIGKILL ends
    them, so the manager thread lets go and that submit raises BrokenProcessPool, which
    :meth:`_Worker._submit` handles.
    """

    def terminate(self) -> None:
        """SIGKILL the process: a SIGTERM is ignored by it."""
        self.kill()


class _PoolContext(multiprocessing.context.SpawnContext):
    """The spawn start method, with :class:`_PoolProcess` processes."""

    Process = _PoolProcess


class _Pool:
    """One ``ProcessPoolExecutor`` and its processes.

    The processes are reached through the executor's private ``_processes`` (pid to process,
    filled as they start; the executor and its manager thread share that one dict) and the
    manager thread through ``_executor_manager_thread``: before Python 3.14 nothing public
    kills a pool process stuck in a call, and shutting down a pool with one waits forever.
    """

    def __init__(self, workers: int) -> None:
        self.executor = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=_PoolContext(),
            initializer=_pool_process_init,
            initargs=(os.getpid(),),
        )
        self.processes: Mapping[int, BaseProcess] = self.executor._processes
        self.manager: threading.Thread | None = None
        self.closed = False
        #: Its break was seen through a task in flight (and logged): once per pool.
        self.broken = False

    def submit(self, job: Job) -> Future[Outcome]:
        """Hand ``job`` to a pool process (started now if none is idle)."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _SPAWN_BLOCKED)
        try:
            future = self.executor.submit(run_job, job)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        manager = getattr(self.executor, "_executor_manager_thread", None)
        if isinstance(manager, threading.Thread):
            self.manager = manager
        return future

    def members(self) -> list[BaseProcess]:
        """The pool's processes (started, not yet joined by its manager thread)."""
        with contextlib.suppress(RuntimeError):  # the manager thread changed it meanwhile
            return list(self.processes.values())
        return []

    def kill(self) -> None:
        """SIGKILL every process of the pool (one already reaped is skipped)."""
        for process in self.members():
            with contextlib.suppress(OSError, ValueError):
                process.kill()

    def close(self, *, kill: bool) -> None:
        """Shut the pool down without waiting (killing its processes first if ``kill``)."""
        if kill:
            self.kill()
        if not self.closed:
            self.closed = True
            self.executor.shutdown(wait=False, cancel_futures=True)

    def join(self, timeout_s: float) -> bool:
        """Wait for the pool's manager thread, which joins its processes; False on timeout."""
        if self.manager is None:
            return True
        self.manager.join(timeout_s)
        return not self.manager.is_alive()


@dataclass(slots=True, kw_only=True)
class _InFlight:
    """A task handed to the pool."""

    name: str  # its inbox file name
    task_id: str
    created_at: float | None
    submitted_at: float  # the worker's (offset) wall clock
    pool: _Pool
    #: Handed over alone after a pool broke under it: no other task goes with it.
    suspect: bool


class _Worker:
    """One worker process: the coordinator (main thread), its pool and a heartbeat thread."""

    def __init__(
        self, args: WorkerArgs, fault: Fault | None, clock_offset_s: float, task_delay_s: float
    ) -> None:
        self.args = args
        self.fault = fault
        self.clock_offset_s = clock_offset_s
        self.task_delay_s = task_delay_s
        self.pid = os.getpid()
        self.inbox = args.root / "inbox" / str(args.shard)
        self.outbox = args.root / "outbox"
        self.status_path = args.root / "status" / f"{args.host}.json"
        self.started_mono = time.monotonic()
        self.started_at = self.now()

        # The coordinator's own (main thread only).
        self.pool: _Pool | None = None
        self.retired: list[_Pool] = []  # broken pools, until they are joined at exit
        self.in_flight: dict[Future[Outcome], _InFlight] = {}
        self.claimed: set[str] = set()  # inbox names in flight
        # The last listing's waiting names, oldest first, taken from until it runs out or is
        # IDLE_POLL_S old: a big inbox is listed (and each file stat'ed) 20 times a second at
        # most, not again at every finished call.
        self.backlog: deque[str] = deque()
        self.listed_at = -math.inf
        self.malformed_since: dict[str, float] = {}
        self.retry_at: dict[str, float] = {}
        self.breaks: dict[str, int] = {}  # inbox name -> pool breaks it was in flight at
        self.hang_used = False
        self.scan_failing = False

        # Read by the heartbeat thread: guarded by ``lock``.
        self.write_lock = threading.Lock()  # one heartbeat write at a time
        self.lock = threading.Lock()
        self.ready = False
        self.seq = 0
        self.completed = 0
        self.errors = 0
        self.semantic_zero = 0
        self.inflight_n = 0
        self.ok_at: deque[float] = deque()  # monotonic times of ok results, for qps
        self.queue_wait_ms: deque[float] = deque(maxlen=SAMPLES)
        self.verify_ms: deque[float] = deque(maxlen=SAMPLES)

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

    def _queue_depth(self) -> int | None:
        try:
            with os.scandir(self.inbox) as entries:
                return sum(1 for entry in entries if is_task_name(entry.name))
        except OSError:
            return None

    def _status(self) -> dict[str, Any]:
        queue_depth = self._queue_depth()  # outside the lock: a directory read
        with self.lock:
            seq = self.seq
            self.seq += 1
            now_mono = time.monotonic()
            while self.ok_at and now_mono - self.ok_at[0] > QPS_WINDOW_S:
                self.ok_at.popleft()
            return {
                "host": self.args.host,
                "shard": self.args.shard,
                "ready": self.ready and self.stop_signal is None,
                "heartbeat_at": self.now(),
                "started_at": self.started_at,
                "pid": self.pid,
                "seq": seq,
                "concurrency": self.args.concurrency,
                "inflight": self.inflight_n,
                "queue_depth": queue_depth,
                "qps": len(self.ok_at) / QPS_WINDOW_S,
                "completed": self.completed,
                "errors": self.errors,
                "semantic_zero": self.semantic_zero,
                "verify_timeout_n": 0,
                "queue_wait_ms_p50": percentile(self.queue_wait_ms, 50),
                "queue_wait_ms_p95": percentile(self.queue_wait_ms, 95),
                "verify_ms_p50": percentile(self.verify_ms, 50),
                "verify_ms_p95": percentile(self.verify_ms, 95),
                "rss_gib": rss_gib(),
            }

    def write_heartbeat(self) -> None:
        """Write one heartbeat; a failed write is logged and the next one tried as usual."""
        # One writer at a time, seq taken inside: the file on disk never goes back in seq.
        with self.write_lock:
            try:
                write_json_atomic(self.status_path, self._status())
            except OSError as exc:
                _log("heartbeat.write_failed", level="warning", error=error_text(exc))

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

    # -- the inbox ---------------------------------------------------------------------------

    def _waiting(self) -> list[str] | None:
        """Task files not in flight and not waiting for a retry, oldest first (by mtime);
        None when the inbox cannot be listed."""
        now = time.monotonic()
        found: list[tuple[float, str]] = []
        present: set[str] = set()
        try:
            with os.scandir(self.inbox) as entries:
                for entry in entries:
                    name = entry.name
                    if not is_task_name(name):
                        continue
                    present.add(name)
                    if name in self.claimed or self.retry_at.get(name, 0.0) > now:
                        continue
                    try:
                        found.append((entry.stat(follow_symlinks=False).st_mtime, name))
                    except FileNotFoundError:
                        continue  # taken by the trainer meanwhile (a timeout)
        except OSError as exc:
            if not self.scan_failing:  # once per outage, not every IDLE_POLL_S
                _log("inbox.scan_failed", level="warning", error=error_text(exc))
            self.scan_failing = True
            return None
        if self.scan_failing:
            _log("inbox.scan_recovered")
            self.scan_failing = False
        found.sort()
        # Forget what concerned files that are gone (answered, or withdrawn by a trainer).
        for table in (self.retry_at, self.malformed_since, self.breaks):
            for name in [n for n in table if n not in present]:
                del table[name]
        return [name for _, name in found]

    def _fill(self) -> None:
        """Hand waiting tasks to the pool while it has free slots. A suspect (a task that was
        in flight when a pool broke) goes alone: nothing else is in flight with it."""
        if len(self.in_flight) >= self.args.concurrency:
            return
        if any(job.suspect for job in self.in_flight.values()):
            return
        now = time.monotonic()
        if not self.backlog or now - self.listed_at >= IDLE_POLL_S:
            names = self._waiting()
            if names is None:
                return
            self.backlog = deque(names)
            self.listed_at = now
        if self.breaks:
            suspects = [name for name in self.backlog if name in self.breaks]
            if suspects:
                if not self.in_flight:
                    self.backlog.remove(suspects[0])
                    self._take(suspects[0], suspect=True)
                return  # the ones in flight finish first, then the suspect runs alone
        while self.backlog and len(self.in_flight) < self.args.concurrency:
            if self.stop_signal is not None:
                return
            name = self.backlog.popleft()
            if name not in self.claimed:
                self._take(name, suspect=False)

    def _take(self, name: str, *, suspect: bool) -> None:
        """Read the task file ``name`` and hand it to the pool, or answer it at once."""
        path = self.inbox / name
        stem = name[: -len(".json")]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return  # taken back by its trainer (a timeout) or by an earlier worker
        except OSError as exc:
            self.retry_at[name] = time.monotonic() + WRITE_RETRY_S
            _log("task.read_failed", level="error", file=name, error=error_text(exc))
            return
        try:
            task = parse_task(data, stem)
        except MalformedTask as exc:
            self._malformed(name, stem, str(exc))
            return
        except BadTask as exc:
            self._answer(name, exc.task_id, Outcome("error", None, f"bad_task: {exc}"), None)
            _log("task.bad", level="warning", file=name, reason=str(exc))
            return
        self.malformed_since.pop(name, None)
        if (self.outbox / f"{task.task_id}.json").exists():
            # At least once: an earlier worker wrote the result and died before the unlink.
            path.unlink(missing_ok=True)
            _log("task.duplicate", task=task.task_id)
            return
        job = Job(
            task_id=task.task_id,
            reward_fn=task.reward_fn,
            args=task.args,
            kwargs=task.kwargs,
            hang=self._hangs(task.task_id),
            delay_s=self.task_delay_s,
        )
        submitted = self._submit(job)
        if submitted is None:
            self.retry_at[name] = time.monotonic() + WRITE_RETRY_S
            return
        future, pool = submitted
        self.in_flight[future] = _InFlight(
            name=name,
            task_id=task.task_id,
            created_at=task.created_at,
            submitted_at=self.now(),
            pool=pool,
            suspect=suspect,
        )
        self.claimed.add(name)
        with self.lock:
            self.inflight_n = len(self.in_flight)

    def _submit(self, job: Job) -> tuple[Future[Outcome], _Pool] | None:
        """Hand ``job`` to the pool, replacing a pool found broken once; None if it cannot."""
        for attempt in (1, 2):
            if self.pool is None:
                self.pool = _Pool(self.args.concurrency)
            pool = self.pool
            try:
                return pool.submit(job), pool
            except (BrokenProcessPool, RuntimeError, OSError) as exc:
                _log("pool.submit_failed", level="error", attempt=attempt, error=error_text(exc))
                self._retire(pool)
        return None

    def _hangs(self, task_id: str) -> bool:
        """Whether the ``hang_call`` fault makes this task's reward call hang."""
        fault = self.fault
        if fault is None or fault.kind is not FaultKind.HANG_CALL or self.hang_used:
            return False
        if fault.task is not None and task_id != fault.task:
            return False
        self.hang_used = True  # at most one per worker, marker or not
        if fault.marker is not None:
            try:
                os.close(os.open(fault.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                return False  # an earlier worker hung on it: this one computes the task
        return True

    def _malformed(self, name: str, stem: str, reason: str) -> None:
        now = time.monotonic()
        first = self.malformed_since.setdefault(name, now)
        if now - first < MALFORMED_GRACE_S:
            self.retry_at[name] = now + IDLE_POLL_S
            return
        self._answer(name, stem, Outcome("error", None, f"bad_inbox_json: {reason}"), None)
        _log("task.malformed", level="warning", file=name, reason=reason)

    # -- results -----------------------------------------------------------------------------

    def _answer(
        self, name: str, task_id: str, outcome: Outcome, queue_wait_ms: float | None
    ) -> None:
        """Write the result of the task in inbox file ``name``, then remove that file."""
        result = make_result(
            task_id=task_id,
            outcome=outcome,
            queue_wait_ms=queue_wait_ms,
            host=self.args.host,
            shard=self.args.shard,
            finished_at=self.now(),
        )
        try:
            write_json_atomic(self.outbox / f"{task_id}.json", result)
            (self.inbox / name).unlink(missing_ok=True)
        except OSError as exc:
            # The task stays in the inbox and is computed again later.
            self.retry_at[name] = time.monotonic() + WRITE_RETRY_S
            _log("task.io_failed", level="error", task=task_id, error=error_text(exc))
            return
        self.malformed_since.pop(name, None)
        self.breaks.pop(name, None)
        with self.lock:
            if outcome.status == "ok":
                self.completed += 1
                self.ok_at.append(time.monotonic())
                if outcome.score == 0.0:
                    self.semantic_zero += 1
            else:
                self.errors += 1
            if queue_wait_ms is not None:
                self.queue_wait_ms.append(queue_wait_ms)
            if outcome.verify_ms is not None:
                self.verify_ms.append(outcome.verify_ms)
        if outcome.status != "ok":
            _log("task.failed", level="warning", task=task_id, error=outcome.error)

    def _reap(self) -> None:
        """Answer every task whose call is over; a broken pool makes its tasks suspects."""
        done = [future for future in self.in_flight if future.done()]
        for future in done:
            job = self.in_flight.pop(future)
            self.claimed.discard(job.name)
            if future.cancelled():  # its pool was shut down before the call began
                continue  # its file stays in the inbox: taken again at a later listing
            exc = future.exception()
            if isinstance(exc, BrokenProcessPool):
                self._broken(job, exc)
                continue
            if exc is not None:  # not the reward fn's (it is caught in the pool): say so
                outcome = Outcome("error", None, f"pool: {error_text(exc)}")
            else:
                outcome = future.result()
            wait_ms = None
            if job.created_at is not None:
                wait_ms = max(0.0, (job.submitted_at - job.created_at) * 1000.0)
            self._answer(job.name, job.task_id, outcome, wait_ms)
        with self.lock:
            self.inflight_n = len(self.in_flight)

    def _broken(self, job: _InFlight, exc: BrokenProcessPool) -> None:
        """``job``'s pool broke under it: replace the pool; answer the task with an error if
        this is its MAX_POOL_BREAKS-th break (it ran alone), else leave it to run alone."""
        if not job.pool.broken:
            # Not ``job.pool is self.pool``: a submit may have found the pool broken and
            # replaced it first, and its break is still to be logged, once.
            job.pool.broken = True
            _log("pool.broken", level="error", error=error_text(exc), task=job.task_id)
            self._retire(job.pool)
        breaks = self.breaks.get(job.name, 0) + 1
        if breaks >= MAX_POOL_BREAKS:  # a suspect: it ran alone this time
            reason = f"pool_broken: its pool process died {breaks} times: {error_text(exc)}"
            self._answer(job.name, job.task_id, Outcome("error", None, reason), None)
        elif self.stop_signal is None:
            self.breaks[job.name] = breaks  # its inbox file stays: it runs again, alone
            self.backlog.clear()  # listed again at once, suspects and all

    def _retire(self, pool: _Pool) -> None:
        """Kill what is left of a broken pool; the next task starts a new one."""
        pool.close(kill=True)
        self.retired = [old for old in self.retired if old is not pool and not old.join(0)]
        self.retired.append(pool)
        if self.pool is pool:
            self.pool = None

    def _wait(self) -> None:
        """Until a call finishes or IDLE_POLL_S passes (signals cut it short)."""
        if self.in_flight:
            wait_futures(list(self.in_flight), timeout=IDLE_POLL_S, return_when=FIRST_COMPLETED)
        else:
            time.sleep(IDLE_POLL_S)

    # -- lifecycle -------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signum

    def forward_stacks(self) -> None:
        """Pass the stacks signal on to each pool process that handles it (run as a signal
        handler: takes no lock)."""
        pools = [*self.retired, *([self.pool] if self.pool is not None else [])]
        for pool in pools:
            for process in pool.members():
                pid = process.pid
                if pid is not None and handles_signal(pid, STACKS_SIGNAL):
                    with contextlib.suppress(OSError):
                        os.kill(pid, STACKS_SIGNAL)

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
        ready_at: float | None = self.started_mono
        if self.fault is not None and self.fault.kind is FaultKind.SLOW_START:
            ready_at = self.started_mono + self.fault.ready_after_s
        elif self.fault is not None and self.fault.kind is FaultKind.NEVER_READY:
            ready_at = None
        if not self._wait_until(ready_at):
            return self._stop(beats)

        with self.lock:
            self.ready = True
        # Written now, not at the heartbeat thread's next tick: the fault clock below starts
        # once a ready heartbeat is on disk.
        self.write_heartbeat()
        _log("worker.ready")

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
            self._reap()
            self._fill()
            self._wait()
        return self._stop(beats)

    def _stop(self, beats: threading.Thread) -> int:
        signame = signal.Signals(self.stop_signal).name if self.stop_signal else None
        _log("worker.stopping", signal=signame, in_flight=len(self.in_flight))
        deadline = time.monotonic() + self.args.drain_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            self._reap()
            if self.in_flight:
                left = max(0.0, deadline - time.monotonic())
                wait_futures(
                    list(self.in_flight),
                    timeout=min(IDLE_POLL_S, left),
                    return_when=FIRST_COMPLETED,
                )
        abandoned = sorted(job.task_id for job in self.in_flight.values())
        if abandoned:
            # Their inbox files stay: the worker that takes the shard next scores them.
            _log("worker.drain_timeout", level="warning", abandoned=abandoned[:100])
        self._close_pools(kill=bool(abandoned))
        self.in_flight.clear()
        self.claimed.clear()
        with self.lock:
            self.inflight_n = 0
        self._finish(beats)
        _log("worker.stopped", completed=self.completed, errors=self.errors)
        return EXIT_OK

    def _close_pools(self, *, kill: bool) -> None:
        """Shut every pool down and wait until no pool process is left."""
        pools = [*self.retired, *([self.pool] if self.pool is not None else [])]
        for pool in pools:
            pool.close(kill=kill)
        for pool in pools:
            if not pool.join(POOL_JOIN_S):
                _log("pool.join_timeout", level="warning", pids=[p.pid for p in pool.members()])
                pool.kill()
                pool.join(POOL_JOIN_S)
        self.pool = None
        self.retired.clear()

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
    handled = (signal.SIGTERM, signal.SIGINT, STACKS_SIGNAL)
    previous = {signum: signal.getsignal(signum) for signum in handled}
    signal.signal(signal.SIGTERM, worker._on_signal)
    signal.signal(signal.SIGINT, worker._on_signal)
    stacks = _register_stacks_signal(forward=worker.forward_stacks)
    try:
        return worker.run()
    finally:
        if stacks:
            faulthandler.unregister(STACKS_SIGNAL)
        for signum, handler in previous.items():
            # None: the old handler was not installed from Python; the default is closest.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _register_stacks_signal(forward: Callable[[], None] | None = None) -> bool:
    """Have ``faulthandler`` write all threads' stacks to stderr on STACKS_SIGNAL, then call
    ``forward`` (in the main thread, as a signal handler); False where stderr is no real
    file (a test's captured stream), which leaves the signal alone."""
    try:
        sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # no fileno, or a closed stderr
        return False
    if forward is not None:
        signal.signal(STACKS_SIGNAL, lambda signum, frame: forward())
    try:
        # chain: after the dump, the Python-level handler above runs too.
        faulthandler.register(
            STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=forward is not None
        )
    except (AttributeError, ValueError, OSError):
        if forward is not None:
            signal.signal(STACKS_SIGNAL, signal.SIG_DFL)
        return False
    return True


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy of it: the pool's spawned processes
    # find run_job and its initializer by the module's own name.
    from supervisor.demo.worker import main as _main

    sys.exit(_main())
