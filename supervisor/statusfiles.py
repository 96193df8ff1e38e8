"""The run directory's ``status/`` and ``ctl/`` files: what they say.

Records, their parsers (bytes in, never raising) and one bounded read of a file. Watching
the files change is ``watch.py``'s job; nothing here writes, renames or deletes anything.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass
from typing import Final

from supervisor import runfiles
from supervisor.errors import UnsafeFileError
from supervisor.health import WorkerStats

#: A heartbeat is a few hundred bytes; anything this big is not one, and reading it must not
#: cost memory or time (a 10 MB file is a problem, not a crash).
MAX_FILE_BYTES: Final = 64 * 1024


# --------------------------------------------------------------------------------------
# Records: what a file says, and what the watcher reports of it.


@dataclass(frozen=True, slots=True)
class StatusRecord:
    """A parsed heartbeat."""

    pid: int
    ready: bool
    heartbeat_at: float  # worker's clock: never compared with ours
    seq: int | None
    #: Progress, when the worker reports it: tasks finished, and tasks in flight.
    processed: int | None = None
    in_flight: int | None = None
    #: The rest of what it says of its work (shown and exported, never judged).
    stats: WorkerStats | None = None


#: The reason of a status file that is not there (no worker wrote one yet, or it was removed).
MISSING: Final = "missing"


@dataclass(frozen=True, slots=True)
class StatusProblem:
    """No heartbeat: the file is missing, empty, partial, not JSON, too big or malformed."""

    reason: str

    @property
    def missing(self) -> bool:
        """There is no file at all: no heartbeat yet, not a file that fails to parse."""
        return self.reason == MISSING


@dataclass(frozen=True, slots=True)
class ExitRecord:
    """The shepherd's record of a worker's end."""

    pid: int
    exit_code: int | None
    signal: int | None
    exited_at: float | None  # worker host's clock
    #: The last lines of the worker's log at its exit, as the shepherd read them.
    log_tail: str | None = None
    #: Processes of its session the shepherd killed after it (None: not said).
    reaped: int | None = None


@dataclass(frozen=True, slots=True)
class StatusObserved:
    """``status/<host>.json`` read (after a change, a rescan or at startup)."""

    host: str
    record: StatusRecord | StatusProblem


@dataclass(frozen=True, slots=True)
class ExitObserved:
    """``ctl/<host>.exit.json`` read; ``None``: the file is gone or unreadable."""

    host: str
    record: ExitRecord | None


@dataclass(frozen=True, slots=True)
class SentinelObserved:
    """``ctl/<host>.stop`` appeared (``present``) or went away."""

    host: str
    present: bool


Observation = StatusObserved | ExitObserved | SentinelObserved


# --------------------------------------------------------------------------------------
# Parsing: bytes in, a record or a reason out; no I/O.


def parse_status(data: bytes) -> StatusRecord | StatusProblem:
    """The heartbeat in ``data``, or why there is none; never raises.

    ``pid`` (a positive integer) and ``heartbeat_at`` (a finite number) are required;
    ``ready`` defaults to false and ``seq`` to ``None``, as the seed's readers did; a field
    of the wrong type is a problem, never guessed at. Progress comes from the AReaL worker's
    fields (``completed`` + ``errors`` finished, ``inflight``) or the older ``processed`` and
    ``in_flight``; a count that is not one is "not reported", never a problem.
    """
    obj = _json_object(data)
    if isinstance(obj, StatusProblem):
        return obj
    if "pid" not in obj:
        return StatusProblem("missing pid")
    pid = _int(obj["pid"])
    if pid is None or pid <= 0:
        return StatusProblem("bad pid")
    if "heartbeat_at" not in obj:
        return StatusProblem("missing heartbeat_at")
    heartbeat_at = _finite(obj["heartbeat_at"])
    if heartbeat_at is None:
        return StatusProblem("bad heartbeat_at")
    ready = obj.get("ready", False)
    if not isinstance(ready, bool):
        return StatusProblem("bad ready")
    seq = _int(obj.get("seq"))
    if seq is None and obj.get("seq") is not None:
        return StatusProblem("bad seq")
    completed = _count(obj.get("completed"))
    errors = _count(obj.get("errors"))
    stats = _stats(obj, completed, errors)
    return StatusRecord(
        pid=pid,
        ready=ready,
        heartbeat_at=heartbeat_at,
        seq=seq,
        processed=_finished(completed, errors, obj),
        in_flight=_count(obj["inflight"] if "inflight" in obj else obj.get("in_flight")),
        stats=stats,
    )


def _finished(completed: int | None, errors: int | None, obj: dict[str, object]) -> int | None:
    """Tasks finished either way: the AReaL worker counts its ok results (``completed``) and
    its error results (``errors``) apart; a stuck worker advances neither."""
    if completed is None and errors is None:
        return _count(obj.get("processed"))
    return min(MAX_COUNT, (completed or 0) + (errors or 0))


def _stats(obj: dict[str, object], completed: int | None, errors: int | None) -> WorkerStats | None:
    """The worker's own figures of its work, each kept only when it is a number of its kind."""
    stats = WorkerStats(
        completed=completed,
        errors=errors,
        queue_depth=_count(obj.get("queue_depth")),
        qps=_measure(obj.get("qps")),
        concurrency=_count(obj.get("concurrency")),
        rss_gib=_measure(obj.get("rss_gib")),
        verify_ms_p95=_measure(obj.get("verify_ms_p95")),
        semantic_zero=_count(obj.get("semantic_zero")),
    )
    return None if stats == _NO_STATS else stats


_NO_STATS: Final = WorkerStats()


#: An exit record's log tail is kept to this many characters (its end), whatever it says.
MAX_LOG_TAIL_CHARS: Final = 4096


def parse_exit(data: bytes) -> ExitRecord | None:
    """The exit record in ``data``, or ``None`` without a positive ``pid``; never raises.

    The pid is what matters (it confirms that worker dead); an optional field of the wrong
    type becomes ``None`` rather than hiding the exit.
    """
    obj = _json_object(data)
    if isinstance(obj, StatusProblem):
        return None
    pid = _int(obj.get("pid"))
    if pid is None or pid <= 0:
        return None
    return ExitRecord(
        pid=pid,
        exit_code=_int(obj.get("exit_code")),
        signal=_int(obj.get("signal")),
        exited_at=_finite(obj.get("exited_at")),
        log_tail=_text(obj.get("log_tail"), MAX_LOG_TAIL_CHARS),
        reaped=_bounded(obj.get("reaped"), MAX_REAPED),
    )


def _json_object(data: bytes) -> dict[str, object] | StatusProblem:
    if len(data) > MAX_FILE_BYTES:
        return StatusProblem("too big")
    if not data.strip():
        return StatusProblem("empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return StatusProblem("not UTF-8")
    try:
        obj = json.loads(text)
    # Deeply nested arrays exhaust the parser's recursion before they exhaust 64 KiB.
    except (ValueError, RecursionError):
        return StatusProblem("not JSON")
    if not isinstance(obj, dict):
        return StatusProblem("not an object")
    return obj


def _int(value: object) -> int | None:
    # bool is an int subclass, and `true` is not a pid.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: Far beyond any worker's count of tasks; a count past it (JSON holds 4000-digit integers)
#: would overflow the float of a rate in every status and scrape.
MAX_COUNT: Final = 2**63 - 1


#: No more processes can have been reaped than there are pids (PID_MAX_LIMIT on 64-bit).
MAX_REAPED: Final = 4 * 1024 * 1024


def _bounded(value: object, limit: int) -> int | None:
    number = _int(value)
    return number if number is not None and 0 <= number <= limit else None


def _count(value: object) -> int | None:
    # Progress is optional: a count that is not an int from 0 to MAX_COUNT is not reported,
    # rather than a problem that would hide a live worker's heartbeat.
    return _bounded(value, MAX_COUNT)


#: A rate, a size or a latency past this is not a measurement (JSON allows 1e308).
MAX_MEASURE: Final = 1e12


def _measure(value: object) -> float | None:
    # Like counts: shown when it is a finite number from 0 to MAX_MEASURE, else not reported.
    number = _finite(value)
    return number if number is not None and 0 <= number <= MAX_MEASURE else None


def _text(value: object, limit: int) -> str | None:
    return value[-limit:] if isinstance(value, str) else None


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # a 400-digit integer is valid JSON
        return None
    return number if math.isfinite(number) else None


# --------------------------------------------------------------------------------------
# Reading: the one bounded read of a file, kept apart from the parsers above. It blocks
# while the filesystem does: the watcher calls it only in its file thread.


def read_status(
    path: str | os.PathLike[str], *, dir_fd: int | None = None
) -> StatusRecord | StatusProblem:
    """Read and parse one status file; a missing file is ``StatusProblem(MISSING)``.

    With ``dir_fd`` (its directory, opened without following) the file is opened by its name
    there: nothing above it is looked up again."""
    data = _read_capped(path, dir_fd)
    return data if isinstance(data, StatusProblem) else parse_status(data)


def read_exit(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> ExitRecord | None:
    """Read and parse one exit record (opened as ``read_status`` opens a status file);
    ``None`` when missing or unreadable."""
    data = _read_capped(path, dir_fd)
    return None if isinstance(data, StatusProblem) else parse_exit(data)


def problem_of(exc: OSError) -> StatusProblem:
    """The status problem an error opening or reading a status file (or its directory) is."""
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return StatusProblem(MISSING)
    if isinstance(exc, UnsafeFileError):
        return StatusProblem(exc.reason)
    return StatusProblem(f"unreadable: {_errno_name(exc)}")


def _read_capped(path: str | os.PathLike[str], dir_fd: int | None) -> bytes | StatusProblem:
    # runfiles.read_capped: no symlink followed, O_NONBLOCK (a FIFO planted under a status
    # name must not block the reader forever), regular files only, one byte past the cap.
    try:
        if dir_fd is None:
            return runfiles.read_capped(path, MAX_FILE_BYTES)
        name = os.path.basename(os.fspath(path))
        return runfiles.read_capped_at(dir_fd, name, MAX_FILE_BYTES, path=path)
    except OSError as exc:
        return problem_of(exc)


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)
