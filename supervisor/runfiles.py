"""Files under the shared run root, opened as hostile: anyone who can write the root may put a
symlink, a FIFO, a hard link or a device under any name there, or swap a directory mid-way.

The daemon and the CLI touch run-root files only through this module. It never follows a
symlink below the root, never blocks opening a FIFO, reads at most a cap, creates files only
exclusively under random names, and deletes by descriptor. The root path itself comes from
the operator's config and is trusted; ``root=None`` means a file whose directory is trusted
(the pointer file), which is still never followed itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, ParamSpec, TypeGuard, TypeVar

import structlog

from supervisor import health, safefiles, vocabulary
from supervisor.errors import RunLocked, UnsafeFileError

log = structlog.get_logger("supervisor.runfiles")

# Our own state file for a thousand hosts with an hour of restart times is a few MB.
STATE_MAX_BYTES: Final = 8 * 1024 * 1024
#: Bounds on the seats a state file may hold (machines; a host name's length).
MAX_SEATS: Final = 100_000
MAX_NAME: Final = 255
#: A manifest, launch meta or pointer file is a few KiB even for a thousand hosts.
META_MAX_BYTES: Final = 1024 * 1024
# Clocks of the nodes that may run the daemon (one after another) are NTP-synced to well under
# this; a restart time further in the future was not written by a daemon.
HISTORY_SKEW_S: Final = 60.0
# Far beyond any real count, small enough that nothing derived from it overflows.
HISTORY_MAX_COUNT: Final = 10**9
# A reason is a sentence quoting at most a few KiB of a remote error.
HISTORY_MAX_TEXT: Final = 10_000


# --------------------------------------------------------------------------------------
# Opening, without following: safefiles, raising the daemon's own error.

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _raising_ours(open_: Callable[_P, _R]) -> Callable[_P, _R]:
    """``open_`` (of ``safefiles``, shared with the agent) raising UnsafeFileError, what the
    daemon's callers catch, for a refused file."""

    @functools.wraps(open_)
    def opened(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return open_(*args, **kwargs)
        except safefiles.UnsafeFile as exc:
            raise UnsafeFileError(exc.path, exc.reason, exc.detail) from None

    return opened


_open_subdir = _raising_ours(safefiles.open_subdir)
_open_parent = _raising_ours(safefiles.open_parent)
_open_at = _raising_ours(safefiles.open_at)
_open_file = _raising_ours(safefiles.open_file)
_open_dir = _raising_ours(safefiles.open_dir)


def open_dir(root: Path, parts: Sequence[str] = (), *, create: bool = False) -> int:
    """A descriptor of ``root/parts...``: ``root`` as configured, each part below it opened
    without following a symlink (and made first, when ``create``). Raises UnsafeFileError
    naming a part that is not a directory, FileNotFoundError for a missing one."""
    return _open_dir(root, parts, create=create)


#: A directory to open files by name in (``dir_fd``): O_PATH needs no read permission on it.
_DIR_PATH_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_path(path: str | os.PathLike[str]) -> int:
    """An ``O_PATH`` descriptor of the directory ``path``, its last component never through
    a symlink (one planted in place of ``status/`` or ``ctl/``, into a hung mount say), for
    opening the files in it by name. Raises OSError (ELOOP, ENOTDIR for a symlink or file)."""
    return os.open(path, _DIR_PATH_FLAGS)


# --------------------------------------------------------------------------------------
# Reading and writing.


def read_capped(path: str | os.PathLike[str], max_bytes: int, *, root: Path | None = None) -> bytes:
    """At most ``max_bytes + 1`` bytes of the regular file ``path`` (one past the cap, so the
    caller can tell a file too big), never through a symlink, never blocking on a FIFO.

    Without ``root`` only the file itself is checked (one open, as cheap as a plain read: the
    status files' hot path); with it every directory below ``root`` is too. Raises
    FileNotFoundError, UnsafeFileError or OSError.
    """
    return safefiles.read_fd(_open_file(path, os.O_RDONLY, root), max_bytes)


def read_capped_at(
    dir_fd: int, name: str, max_bytes: int, *, path: str | os.PathLike[str]
) -> bytes:
    """``read_capped`` of ``name`` in the directory ``dir_fd`` (which may be an ``O_PATH``
    descriptor); errors name ``path``."""
    return safefiles.read_fd(_open_at(dir_fd, name, os.O_RDONLY, path=path), max_bytes)


def read_tail(path: Path, max_bytes: int, *, root: Path) -> bytes:
    """The last ``max_bytes`` bytes of the regular file ``path`` under ``root``, opened as
    ``read_capped`` opens (never through a symlink, never blocking on a FIFO). Raises
    FileNotFoundError, UnsafeFileError or OSError."""
    fd = _open_file(path, os.O_RDONLY, root)
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, max_bytes, max(0, size - max_bytes))
    finally:
        os.close(fd)


def read_json(path: Path, *, root: Path | None, max_bytes: int) -> Any:
    """Parse a JSON file of at most ``max_bytes``, read as ``read_capped`` does; raises
    OSError or ValueError (too big, not UTF-8, not JSON, nested too deep), each naming it."""
    return safefiles.parse_json(read_capped(path, max_bytes, root=root), max_bytes, path)


def write_atomic(path: Path, data: bytes, *, root: Path | None, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so readers see the old file or the new one, whole
    (``safefiles.write_atomic_at``: a random temp name, made exclusively and renamed within
    the directory descriptor, its mode set on the descriptor whatever the umask). Whatever
    was at ``path`` (a symlink, a FIFO) is replaced, never followed."""
    dir_fd, name = _open_parent(path, root)
    try:
        safefiles.write_atomic_at(dir_fd, name, data, path=path, mode=mode)
    finally:
        os.close(dir_fd)


def write_json_atomic(path: Path, data: object, *, root: Path | None, mode: int = 0o644) -> None:
    """``write_atomic`` of ``data`` as indented, sorted JSON and a newline."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text.encode("utf-8"), root=root, mode=mode)


def remove(path: Path, *, root: Path) -> None:
    """Remove the name ``path`` (whatever it is, never what a symlink points to); a missing
    one is fine."""
    with contextlib.suppress(FileNotFoundError):
        remove_existing(path, root=root)


def remove_existing(path: Path, *, root: Path) -> None:
    """``remove``, but a missing name raises FileNotFoundError."""
    dir_fd, name = _open_parent(path, root)
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise safefiles.named(exc, path) from None
    finally:
        os.close(dir_fd)


def ensure_dirs(root: Path, dirs: Iterable[Path]) -> None:
    """Make ``root`` and each of ``dirs`` (paths under it) that is missing; an existing one
    must be a real directory, not a symlink to one."""
    root.mkdir(parents=True, exist_ok=True)
    for path in dirs:
        os.close(open_dir(root, path.relative_to(root).parts, create=True))


def write_stop_sentinel(path: Path, *, root: Path) -> None:
    """Write the operator's stop sentinel ``ctl/<host>.stop`` (replacing, never following,
    whatever is there)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ensure_dirs(root, [path.parent])
    write_atomic(path, f"stopped by reward-supervisor stop-host at {stamp}\n".encode(), root=root)


def read_pid(path: Path, *, root: Path) -> int | None:
    """The pid in a pidfile; None when it is missing, unsafe, unreadable, too big or not a
    number from 1 to 2**31 - 1."""
    return safefiles.read_pid(path, root)


# --------------------------------------------------------------------------------------
# The run lock.


def lock_run(path: Path, *, root: Path) -> int:
    """Hold ``ctl/supervisor.lock`` for our lifetime: one supervisor per run, even across
    nodes (lockf on NFS is a server-side lock). Returns the descriptor to keep open.

    Raises RunLocked when another daemon holds it, UnsafeFileError when the name is a
    symlink, FIFO or hard link (it is truncated and written in place, so it must be ours).
    """
    dir_fd, name = _open_parent(path, root)
    try:
        fd = _open_at(dir_fd, name, os.O_RDWR | os.O_CREAT, path=path, single_link=True)
    finally:
        os.close(dir_fd)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise RunLocked(
            f"another reward-supervisor already runs this run ({path} is locked by"
            f" {holder or 'unknown'})",
            holder=holder,
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_epoch(path: Path, *, root: Path) -> int | None:
    """The leadership epoch in ``ctl/supervisor.epoch``: 0 when there is none yet, None when
    the file is there but unreadable or not a number (never followed, never more than a
    few bytes read)."""
    return safefiles.read_epoch(path, root)


def bump_epoch(path: Path, *, root: Path) -> int:
    """Write the next epoch (the one on disk plus one; 1 when there is none or it cannot be
    read) and return it. Call it only holding the run lock: the lock orders the bumps."""
    current = read_epoch(path, root=root)
    epoch = (current or 0) + 1
    write_atomic(path, f"{epoch}\n".encode(), root=root)
    return epoch


def lock_holder(path: Path, *, root: Path) -> str:
    """Who holds (or last held) the run lock, as its holder wrote it; "" when it cannot be
    read. Never call it in the process holding the lock: closing any descriptor of the
    file releases a process's lockf locks."""
    try:
        dir_fd, name = _open_parent(path, root)
    except OSError:
        return ""
    try:
        fd = _open_at(dir_fd, name, os.O_RDONLY, path=path)
    except OSError:
        return ""
    finally:
        os.close(dir_fd)
    try:
        return _holder(fd)
    finally:
        os.close(fd)


def check_lock(fd: int, path: Path, *, root: Path) -> str | None:
    """Whether we still hold the run lock on ``fd``; None if we do, else why not.

    The name must still be the file we locked (one removed or replaced under us means the
    next daemon locks another file: two leaders), and the lock must still answer: taking
    it again on the same descriptor is a no-op for a holder, and the I/O that tells an NFS
    client its lease lapsed and its lock is gone (EIO). Nothing here opens the lock file:
    closing another descriptor of it would release the lock.
    """
    try:
        ours = os.fstat(fd)
    except OSError as exc:
        return f"the lock descriptor failed: {exc}"
    try:
        dir_fd, name = _open_parent(path, root)
    except OSError as exc:
        return f"{path.parent} cannot be opened: {exc}"
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return f"{path} was removed"
    except OSError as exc:
        return f"{path} cannot be looked at: {exc}"
    finally:
        os.close(dir_fd)
    if (now.st_dev, now.st_ino) != (ours.st_dev, ours.st_ino):
        return f"{path} was replaced by another file"
    if ours.st_nlink == 0:
        return f"{path} was removed"
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return f"the lock on {path} failed: {exc}"
    return None


def lock_is_held(path: Path, *, root: Path) -> bool:
    """Whether a live process holds ``ctl/supervisor.lock``. A name that is missing, or no
    regular file (no daemon holds such a thing), is not held; raises OSError when it cannot
    tell (a lock file it may not read)."""
    try:
        dir_fd, name = _open_parent(path, root)
    except (FileNotFoundError, UnsafeFileError):
        return False
    try:
        fd = _open_at(dir_fd, name, os.O_RDONLY, path=path)
    except (FileNotFoundError, UnsafeFileError):
        return False
    finally:
        os.close(dir_fd)
    try:
        # A shared lock needs only read access, and conflicts with the daemon's exclusive one.
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return True
        raise safefiles.named(exc, path) from None
    finally:
        os.close(fd)  # closing releases a lock we took
    return False


def current_holder(path: Path, *, root: Path) -> str:
    """Who holds ``ctl/supervisor.lock`` now, as its holder wrote it: "" when nobody does,
    or when it cannot be told (a lock file we may not read, a name not written yet). Never
    call it in the process holding the lock (``lock_holder``)."""
    try:
        held = lock_is_held(path, root=root)
    except OSError:
        return ""
    return lock_holder(path, root=root) if held else ""


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it: at most one short printable line."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return "".join(c if c.isprintable() else "?" for c in text)


# --------------------------------------------------------------------------------------
# Restart history: ctl/supervisor-state.json.

#: One thing wrong with one host's entry of the state file: ``(host, problem)``.
HistoryProblem = tuple[str, str]


def history_entry(hist: health.History, wall_minus_mono: float) -> dict[str, Any]:
    """One host's entry of the state file, its instants converted to wall-clock time."""
    nxt = hist.next_restart_at
    return {
        "failures": hist.failures,
        "restarts": hist.restarts,
        "restart_times": [t + wall_minus_mono for t in hist.restart_times_at],
        "next_restart_at": None if nxt is None else nxt + wall_minus_mono,
        "cause": hist.cause,
        "cause_code": None if hist.cause_code is None else hist.cause_code.value,
        "failed": hist.failed,
    }


class HistoryEncoder:
    """Encodes the state file, one host to a line, encoding again only what changed.

    The daemon saves the history within half a second of any host's change; at a thousand
    hosts, building and indenting the whole document each time held the event loop (and,
    from the writing thread, the GIL) for about 10 ms, and a worker's exit that arrived
    meanwhile waited for it (docs/BENCHMARKS.md). A host's entry is kept while the core
    hands over the same ``History`` object (``Fleet.histories``) and, if it holds instants,
    the same wall-clock offset: rounded to the millisecond, so that it stays the same until
    the wall clock is stepped.
    """

    def __init__(self) -> None:
        #: host -> (its history, the offset its instants were converted with, its line).
        self._lines: dict[str, tuple[health.History, float | None, str]] = {}

    def encode(
        self,
        histories: dict[str, health.History],
        *,
        wall_minus_mono: float,
        saved_at: float,
        hostname: str,
        version: int,
        seats: vocabulary.SavedSeats | None = None,
    ) -> bytes:
        """The whole file: ``{"hostname", "hosts", "saved_at", "seats", "version"}``, keys
        sorted; ``seats`` only when a shard was ever moved to a spare (failover)."""
        offset = round(wall_minus_mono, 3)
        lines: dict[str, tuple[health.History, float | None, str]] = {}
        for name in sorted(histories):
            hist = histories[name]
            timed = bool(hist.restart_times_at) or hist.next_restart_at is not None
            key = offset if timed else None
            kept = self._lines.get(name)
            if kept is None or kept[0] is not hist or kept[1] != key:
                entry = json.dumps(history_entry(hist, offset), sort_keys=True)
                kept = (hist, key, f"{json.dumps(name)}: {entry}")
            lines[name] = kept
        self._lines = lines
        hosts = ",\n".join(line for _, _, line in lines.values())
        head = f'{{"hostname": {json.dumps(hostname)}, "hosts": {{'
        saved = f', "seats": {json.dumps(seats_record(seats), sort_keys=True)}' if seats else ""
        tail = (
            f'}}, "saved_at": {json.dumps(saved_at)}{saved}, "version": {json.dumps(version)}}}\n'
        )
        return (head + ("\n" + hosts + "\n" if hosts else "") + tail).encode("utf-8")


def seats_record(seats: vocabulary.SavedSeats | None) -> dict[str, Any]:
    """``SavedSeats`` as the state file's ``seats`` object."""
    seats = seats or vocabulary.SavedSeats()
    return {
        "serving": dict(seats.serving),
        "fenced": sorted(seats.fenced),
        "drained": sorted(seats.drained),
        "held": sorted(seats.held),
        "left": {
            m: {"host": label, "shard": shard, "pid": pid}
            for m, (label, shard, pid) in seats.left.items()
        },
    }


def _name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def _names(value: object) -> frozenset[str] | None:
    if not isinstance(value, list) or len(value) > MAX_SEATS:
        return None
    if not all(_name(v) for v in value):
        return None
    return frozenset(value)


def seats_from_json(raw: object) -> vocabulary.SavedSeats | None:
    """The state file's ``seats``, or None when it has none or any part of it is malformed
    (then the config's seats: every host on its own machine). Never raises."""
    seats = raw.get("seats") if isinstance(raw, dict) else None
    if not isinstance(seats, dict):
        return None
    serving, left = seats.get("serving"), seats.get("left")
    if not isinstance(serving, dict) or not isinstance(left, dict):
        return None
    if len(serving) > MAX_SEATS or len(left) > MAX_SEATS:
        return None
    pairs = list(serving.items())
    if not all(_name(k) and _name(v) for k, v in pairs):
        return None
    lists = [_names(seats.get(key)) for key in ("fenced", "drained", "held")]
    fenced, drained, held = lists
    if fenced is None or drained is None or held is None:
        return None
    leftovers: dict[str, tuple[str, int, int | None]] = {}
    for machine, entry in left.items():
        if not isinstance(entry, dict) or not _name(machine):
            return None
        label, shard, pid = entry.get("host"), entry.get("shard"), entry.get("pid")
        if not isinstance(label, str) or not _name(label) or type(shard) is not int:
            return None
        if pid is not None and (type(pid) is not int or pid <= 0):
            return None
        leftovers[machine] = (label, shard, pid)
    return vocabulary.SavedSeats(
        serving=dict(pairs), fenced=fenced, drained=drained, held=held, left=leftovers
    )


def load_state(
    path: Path, *, root: Path, policy: health.Policy
) -> tuple[dict[str, health.History], vocabulary.SavedSeats | None]:
    """The restart history and the seats a previous daemon left, read once; an unreadable
    file is logged and is neither, a bad entry or seats object is logged and skipped. Never
    raises."""
    try:
        raw = read_json(path, root=root, max_bytes=STATE_MAX_BYTES)
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as exc:
        log.warning("history.unreadable", path=str(path), reason=str(exc))
        return {}, None
    now_wall = time.time()
    offset = time.monotonic() - now_wall  # wall clock + offset = monotonic
    history, problems = history_from_json(raw, now_wall=now_wall, offset=offset, policy=policy)
    for host, problem in problems:
        log.warning("history.bad_entry", path=str(path), host=host, problem=problem)
    seats = seats_from_json(raw)
    if seats is None and isinstance(raw, dict) and "seats" in raw:
        log.warning("history.bad_seats", path=str(path))
    return history, seats


def load_history(path: Path, *, root: Path, policy: health.Policy) -> dict[str, health.History]:
    """The restart history a previous daemon left, by host (``load_state``)."""
    return load_state(path, root=root, policy=policy)[0]


def history_from_json(
    raw: object, *, now_wall: float, offset: float, policy: health.Policy
) -> tuple[dict[str, health.History], list[HistoryProblem]]:
    """Parse ``ctl/supervisor-state.json``: each host's history whose every value is valid
    (wall-clock instants + ``offset`` = monotonic), and one problem per host skipped.

    Instants must be finite and not in the future beyond ``HISTORY_SKEW_S`` (the next restart
    no further ahead than ``backoff_max_s``): a crafted far-future time would hold a host
    back forever. Never raises, whatever ``raw`` is.
    """
    hosts = raw.get("hosts") if isinstance(raw, dict) else None
    if not isinstance(hosts, dict):
        return {}, [("*", "no 'hosts' object")]
    out: dict[str, health.History] = {}
    problems: list[HistoryProblem] = []
    for name, entry in hosts.items():
        parsed = _history_entry(entry, now_wall, offset, policy)
        if isinstance(parsed, str):
            problems.append((str(name)[:200], parsed))
        else:
            out[str(name)] = parsed
    return out, problems


def _history_entry(
    entry: object, now_wall: float, offset: float, policy: health.Policy
) -> health.History | str:
    """One host's history, or what is wrong with it."""
    if not isinstance(entry, dict):
        return "not an object"
    counts: dict[str, int] = {}
    for key in ("failures", "restarts"):
        value = entry.get(key, 0)
        if not _is_int(value) or not 0 <= value <= HISTORY_MAX_COUNT:
            return f"{key} must be an integer from 0 to {HISTORY_MAX_COUNT}, not {_show(value)}"
        counts[key] = value
    times = entry.get("restart_times") or []
    if not isinstance(times, list):
        return f"restart_times must be a list, not {_show(times)}"
    latest = now_wall + HISTORY_SKEW_S
    for t in times:
        if not _is_finite(t) or t > latest:
            return f"restart_times holds {_show(t)}: not a finite time in the past"
    nxt = entry.get("next_restart_at")
    if nxt is not None and (not _is_finite(nxt) or nxt > latest + policy.backoff_max_s):
        return (
            f"next_restart_at {_show(nxt)} is not a finite time within backoff_max_s"
            f" ({policy.backoff_max_s:g}s) from now"
        )
    code = entry.get("cause_code")
    if code is not None and (not isinstance(code, str) or code not in _CAUSES):
        return f"cause_code must be null or one of {', '.join(sorted(_CAUSES))}, not {_show(code)}"
    texts: dict[str, str | None] = {}
    for key in ("cause", "failed"):
        value = entry.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > HISTORY_MAX_TEXT):
            return f"{key} must be null or a string of at most {HISTORY_MAX_TEXT} characters"
        texts[key] = value
    return health.History(
        failures=counts["failures"],
        restarts=counts["restarts"],
        restart_times_at=tuple(float(t) + offset for t in times),
        next_restart_at=None if nxt is None else float(nxt) + offset,
        cause=texts["cause"],
        cause_code=None if code is None else health.Cause(code),
        failed=texts["failed"],
    )


_CAUSES: Final = frozenset(c.value for c in health.Cause)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> TypeGuard[int | float]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer of hundreds of digits is valid JSON
        return False


def _show(value: object) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int past the interpreter's digit limit for str()
        return "an int too big to show"
    except RecursionError:
        return "a value nested too deeply to show"
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------------------
# A clean stop: ctl/supervisor-stopped.json.

#: Host states a stop record may name (the contract's), so that the file cannot put any
#: other text into a status.
_STATES: Final = frozenset(s.value for s in health.HostState)


@dataclass(frozen=True, slots=True)
class StopRecord:
    """What a leading daemon wrote once its stop had run to its end: when (the wall clock of
    the node it ran on), under which epoch, by whom, and each host's last state and pid."""

    stopped_at: float
    epoch: int
    by: str
    hosts: dict[str, tuple[str, int | None]]


def stop_record_json(record: StopRecord) -> bytes:
    """The stop record's file: ``{"stopped_at", "epoch", "by", "hosts": {NAME: {"state",
    "pid"}}}``."""
    hosts = {name: {"state": st, "pid": pid} for name, (st, pid) in record.hosts.items()}
    body = {"stopped_at": record.stopped_at, "epoch": record.epoch, "by": record.by}
    return (json.dumps({**body, "hosts": hosts}, sort_keys=True) + "\n").encode()


def read_stop_record(path: Path, *, root: Path) -> StopRecord | None:
    """The stop record at ``path``; None when there is none, or it is not one (hostile: a
    bad field makes the whole record nothing). Never raises."""
    try:
        raw = read_json(path, root=root, max_bytes=STATE_MAX_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("hosts"), dict):
        return None
    stopped_at, epoch, by = raw.get("stopped_at"), raw.get("epoch"), raw.get("by")
    if not (_is_finite(stopped_at) and _is_int(epoch) and epoch > 0 and _name(by)):
        return None
    hosts: dict[str, tuple[str, int | None]] = {}
    for name, entry in raw["hosts"].items():
        if not _name(name) or not isinstance(entry, dict):
            return None
        state, pid = entry.get("state"), entry.get("pid")
        if state not in _STATES or not (pid is None or (_is_int(pid) and pid > 0)):
            return None
        hosts[name] = (state, pid)
    return StopRecord(stopped_at=float(stopped_at), epoch=epoch, by=str(by), hosts=hosts)


# --------------------------------------------------------------------------------------
# Deleting a tree by descriptor.


def identity(path: Path) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of ``path`` itself (a symlink is not followed)."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def open_real_dir(path: Path) -> int:
    """A descriptor of the absolute, symlink-free ``path`` (a ``realpath``), opened one
    component at a time from ``/`` without following any: a component swapped for a symlink
    since the path was resolved is refused (UnsafeFileError)."""
    if not path.is_absolute():
        raise ValueError(f"{path} is not absolute")
    return open_dir(Path("/"), path.parts[1:])


def delete_tree(root: Path, expected: tuple[int, int], progress: Callable[[int], None]) -> int:
    """Delete the directory ``root`` (a resolved path) and everything in it; the entries
    removed. ``progress(count)`` is called after each directory.

    ``root`` is re-opened from ``/`` without following a symlink and must still be the
    directory ``expected`` (device, inode) that was checked. The walk holds one directory
    descriptor at a time, opens each subdirectory relative to it without following, goes back
    up through ``..`` only after checking that it is the directory it came from, and removes
    entries by name relative to the descriptor: a directory swapped for a symlink during the
    delete is removed as a link, and nothing outside the tree is ever opened or removed.
    """
    parent_fd = open_real_dir(root.parent)
    try:
        root_fd = _open_subdir(parent_fd, root.name, root)
        try:
            _check_identity(root_fd, expected, root)
            removed = _walk(root_fd, root, _delete_entry, _delete_dir, progress)
        finally:
            os.close(root_fd)
        st = os.stat(root.name, dir_fd=parent_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != expected:
            raise UnsafeFileError(root, "replaced during the delete", "not removed")
        os.rmdir(root.name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    return removed + 1


def measure_tree(root: Path, expected: tuple[int, int]) -> tuple[int, int]:
    """``(files, bytes)`` under the directory ``root``, walked as ``delete_tree`` walks."""
    totals = [0, 0]

    def count(dir_fd: int, name: str, path: Path) -> None:
        with contextlib.suppress(OSError):
            totals[1] += os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
        totals[0] += 1

    root_fd = open_real_dir(root)
    try:
        _check_identity(root_fd, expected, root)
        _walk(root_fd, root, count, None, lambda _n: None)
    finally:
        os.close(root_fd)
    return totals[0], totals[1]


def _check_identity(fd: int, expected: tuple[int, int], path: Path) -> None:
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != expected:
        raise UnsafeFileError(path, "not the directory that was checked", "replaced since")


#: ``(dir_fd, name, path)`` for one entry: a non-directory, or a directory just emptied.
_EntryFn = Callable[[int, str, Path], None]


def _walk(
    top_fd: int,
    top: Path,
    on_entry: _EntryFn,
    on_dir_done: _EntryFn | None,
    progress: Callable[[int], None],
) -> int:
    """Depth-first below ``top_fd``: ``on_entry`` for every non-directory, ``on_dir_done``
    (when given) for every directory after its contents; the count of both.

    Only the current directory is held open (a tree of any depth needs one descriptor), and
    each step up re-opens ``..`` and checks it is the directory the step down came from: a
    directory moved out of the tree meanwhile stops the walk instead of leading it outside.
    """
    count = 0
    cur = os.dup(top_fd)
    cur_path = top
    # One frame per level entered: (name, identity of the directory holding it, the rest of
    # that directory's subdirectories).
    stack: list[tuple[str, tuple[int, int], list[str]]] = []
    try:
        pending = _scan(cur, cur_path, on_entry)
        count += pending.count
        while True:
            if pending.dirs:
                name = pending.dirs.pop()
                try:
                    sub = _open_subdir(cur, name, cur_path / name)
                except UnsafeFileError:
                    # Swapped for a symlink (or a file) since the listing: an entry like any.
                    on_entry(cur, name, cur_path / name)
                    count += 1
                    continue
                except FileNotFoundError:
                    continue
                here = os.fstat(cur)
                stack.append((name, (here.st_dev, here.st_ino), pending.dirs))
                os.close(cur)
                cur, cur_path = sub, cur_path / name
                pending = _scan(cur, cur_path, on_entry)
                count += pending.count
                continue
            if not stack:
                return count
            name, parent_id, rest = stack.pop()
            parent = _open_subdir(cur, "..", cur_path.parent)
            os.close(cur)
            cur, cur_path = parent, cur_path.parent
            _check_identity(cur, parent_id, cur_path)
            if on_dir_done is not None:
                on_dir_done(cur, name, cur_path / name)
            count += 1
            progress(count)
            pending = _Listing(rest, 0)
    finally:
        os.close(cur)


class _Listing:
    """What a scan left to do in one directory: its subdirectories, and entries it handled."""

    __slots__ = ("count", "dirs")

    def __init__(self, dirs: list[str], count: int) -> None:
        self.dirs = dirs
        self.count = count


def _scan(dir_fd: int, path: Path, on_entry: _EntryFn) -> _Listing:
    """``on_entry`` for every non-directory in ``dir_fd``; its subdirectories' names."""
    dirs: list[str] = []
    count = 0
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                dirs.append(entry.name)
            else:
                on_entry(dir_fd, entry.name, path / entry.name)
                count += 1
    return _Listing(dirs, count)


def _delete_entry(dir_fd: int, name: str, path: Path) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise safefiles.named(exc, path) from None


def _delete_dir(dir_fd: int, name: str, path: Path) -> None:
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except NotADirectoryError:
        _delete_entry(dir_fd, name, path)  # swapped for a symlink after we emptied it
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise safefiles.named(exc, path) from None
