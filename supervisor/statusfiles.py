"""The run directory's ``status/`` and ``ctl/`` files: parsing them and watching them change.

The only importer of watchfiles. A change event only ever means "re-read that file"; this
module never writes, renames or deletes anything in the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import math
import os
import queue
import re
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, Protocol, TypeVar

import structlog
from watchfiles import Change, awatch

from supervisor.config import WatchMode
from supervisor.layout import RunLayout

ResolvedMode = Literal["inotify", "poll"]
Kind = Literal["status", "exit", "stop"]

#: A heartbeat is a few hundred bytes; anything this big is not one, and reading it must not
#: cost memory or time (a 10 MB file is a problem, not a crash).
MAX_FILE_BYTES: Final = 64 * 1024

#: Filesystems whose files other machines (or another kernel) write: inotify only reports
#: writes made through this kernel's VFS, so it never sees the workers' heartbeats there.
POLL_FSTYPES: Final = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "ceph",
        "beegfs",
        "fuse",
        "9p",
        "virtiofs",
        "afs",
        "gfs2",
        "ocfs2",
    }
)

# The Rust loop returns at least this often even when nothing changes, so the watch loop
# provably runs (healthy()) and notices a replaced directory within about half a second.
_RUST_TIMEOUT_MS: Final = 500
# The loop counts as alive if it ticked within this many seconds (or 3 poll intervals).
_HEALTH_WINDOW_S: Final = 5.0
# Re-checking the watched directories' identity costs three stat() calls; under a steady
# stream of batches once per half second is plenty.
_DIR_CHECK_INTERVAL_S: Final = 0.5
# Retrying a watch that cannot start (run root missing, watch limit reached): quick at
# first, then once a second; the loop keeps ticking meanwhile, so the daemon stays healthy.
_RETRY_MIN_S: Final = 0.05
_RETRY_MAX_S: Final = 1.0
#: The file reader thread's name in ``top -H`` and /proc/PID/task/TID/comm.
FILE_THREAD_NAME: Final = "rs-statusfiles"
# Poll mode stats this many paths (status, exit record, stop sentinel per host) before it
# hands the changes to the reader: small enough that a change waits ~1 ms, not a whole sweep.
_POLL_CHUNK_KEYS: Final = 300
# A read that takes this long means the filesystem is hanging: say so once per read.
_SLOW_READ_S: Final = 10.0

_log = structlog.get_logger()
_T = TypeVar("_T")


# --------------------------------------------------------------------------------------
# Records and parsing.


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


@dataclass(frozen=True, slots=True)
class StatusProblem:
    """No heartbeat: the file is missing, empty, partial, not JSON, too big or malformed."""

    reason: str


@dataclass(frozen=True, slots=True)
class ExitRecord:
    """The shepherd's record of a worker's end."""

    pid: int
    exit_code: int | None
    signal: int | None
    exited_at: float | None  # worker host's clock
    #: The last lines of the worker's log at its exit, as the shepherd read them.
    log_tail: str | None = None


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


def parse_status(data: bytes) -> StatusRecord | StatusProblem:
    """The heartbeat in ``data``, or why there is none; never raises.

    ``pid`` (a positive integer) and ``heartbeat_at`` (a finite number) are required;
    ``ready`` defaults to false and ``seq`` to ``None``, as the seed's readers did; a field
    of the wrong type is a problem, never guessed at.
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
    return StatusRecord(
        pid=pid,
        ready=ready,
        heartbeat_at=heartbeat_at,
        seq=seq,
        processed=_count(obj.get("processed")),
        in_flight=_count(obj.get("in_flight")),
    )


def read_status(path: str | os.PathLike[str]) -> StatusRecord | StatusProblem:
    """Read and parse one status file; a missing file is ``StatusProblem("missing")``."""
    data = _read_capped(path)
    return data if isinstance(data, StatusProblem) else parse_status(data)


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
    )


def read_exit(path: str | os.PathLike[str]) -> ExitRecord | None:
    """Read and parse one exit record; ``None`` when missing or unreadable."""
    data = _read_capped(path)
    return None if isinstance(data, StatusProblem) else parse_exit(data)


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


def _count(value: object) -> int | None:
    # Progress is optional: a count that is not a non-negative int is not reported, rather
    # than a problem that would hide a live worker's heartbeat.
    number = _int(value)
    return number if number is not None and number >= 0 else None


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


def _read_capped(path: str | os.PathLike[str]) -> bytes | StatusProblem:
    # O_NONBLOCK: a FIFO planted under a status name must not block the reader forever.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return StatusProblem("missing")
    except OSError as exc:
        return StatusProblem(f"unreadable: {_errno_name(exc)}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return StatusProblem("not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        return StatusProblem(f"unreadable: {_errno_name(exc)}")
    finally:
        os.close(fd)


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


# --------------------------------------------------------------------------------------
# Filesystem type and watch mode.


def filesystem_type(path: Path, mountinfo: str | None = None) -> str:
    """The type of the filesystem holding ``path`` (``"nfs4"``, ``"ext4"``...); ``""`` if unknown.

    The mount is the longest mount point of ``/proc/self/mountinfo`` (or ``mountinfo``)
    that contains the real path; of equal mount points the last one listed is on top.
    """
    if mountinfo is None:
        try:
            mountinfo = os.fsdecode(Path("/proc/self/mountinfo").read_bytes())
        except OSError:
            return ""
    target = os.path.realpath(path)
    best_len = -1
    best = ""
    for line in mountinfo.splitlines():
        # "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw": the optional
        # fields end at a lone "-", then come fstype, source and super options.
        fields = line.split(" ")
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if sep + 1 >= len(fields):
            continue
        mount_point = _unescape(fields[4])
        if _contains(mount_point, target) and len(mount_point) >= best_len:
            best_len = len(mount_point)
            best = _unescape(fields[sep + 1])
    return best


def choose_mode(path: Path, configured: WatchMode, mountinfo: str | None = None) -> ResolvedMode:
    """``configured``, or for ``"auto"``: poll where inotify cannot see other writers."""
    if configured != "auto":
        return configured
    return "poll" if needs_polling(filesystem_type(path, mountinfo)) else "inotify"


def needs_polling(fstype: str) -> bool:
    """Whether inotify misses other writers on ``fstype``; an unknown type plays safe."""
    return not fstype or fstype in POLL_FSTYPES or fstype.startswith("fuse.")


_OCTAL_ESCAPE: Final = re.compile(rb"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as \040, \011, \012, \134;
    # undo it on bytes so non-ASCII names survive.
    raw = _OCTAL_ESCAPE.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), os.fsencode(field))
    return os.fsdecode(raw)


def _contains(mount_point: str, path: str) -> bool:
    if mount_point == "/":
        return path.startswith("/")
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


# --------------------------------------------------------------------------------------
# The watcher.


class WatcherProtocol(Protocol):
    """What the daemon needs from a status watcher (a fake implements this in tests)."""

    mode: ResolvedMode
    changes_seen: int
    parse_errors: int

    async def run(self, sink: Callable[[list[Observation]], None]) -> None: ...

    def scan_all(self) -> list[Observation]: ...

    async def scan(self, hosts: Collection[str]) -> list[Observation]: ...

    def healthy(self, now: float) -> bool: ...


@dataclass(frozen=True, slots=True)
class _DirIds:
    """(st_dev, st_ino) of the watched directories, ``None`` where missing."""

    root: tuple[int, int] | None
    status: tuple[int, int] | None
    ctl: tuple[int, int] | None


_Key = tuple[str, Kind]


@dataclass(frozen=True, slots=True)
class _Batch:
    """What one trip to the file thread found."""

    observations: list[tuple[_Key, Observation]]
    dir_ids: _DirIds | None


class Watcher:
    """Watches ``status/`` and ``ctl/`` of one run and reports what changed, per host.

    ``run()`` delivers an observation when a file's parsed content differs from the last
    one delivered for that host and kind (a host's first read always delivers), in batches,
    in order per host. ``scan_all()`` returns every host's current files; it is meant for
    startup, before ``run()``, and seeds what ``run()`` compares with.

    inotify mode runs watchfiles (non-recursive, on the root, ``status/`` and ``ctl/``).
    Poll mode does not use watchfiles' poller: it compares modification times in whole
    seconds, so a file rewritten twice within one second (even to a new inode and size)
    looks unchanged and the last write can go unseen for good. Every ``poll_interval_s`` we
    list ``status/`` and ``ctl/`` and compare each host's files' inode numbers (an atomic
    rewrite always brings a new one), and stat a file whose inode stayed to compare size and
    nanosecond times (a rewrite in place).
    Both modes re-read everything every ``rescan_interval_s``.
    """

    #: The resolved mode; ``fstype`` is what ``"auto"`` saw ("" if unknown).
    mode: ResolvedMode
    fstype: str
    #: The run root is being watched (false while it is missing or the watch restarts).
    watching: bool
    #: Changes seen: inotify events that passed the filter (a status or ctl file, or a
    #: watched directory), or in poll mode paths whose stat changed between two polls.
    changes_seen: int
    #: Status reads that gave a ``StatusProblem`` (including "missing").
    parse_errors: int

    def __init__(
        self,
        root: Path,
        hosts: Callable[[], Collection[str]],
        *,
        mode: WatchMode,
        poll_interval_s: float,
        debounce_ms: int,
        rescan_interval_s: float,
    ) -> None:
        self._layout = RunLayout(Path(os.path.abspath(root)))
        self._hosts = hosts
        self.fstype = filesystem_type(self._layout.root)
        self.mode = choose_mode(self._layout.root, mode)
        self._poll_interval_s = poll_interval_s
        self._debounce_ms = max(1, debounce_ms)
        # The Rust loop sleeps `step` between looks at its event set and takes the GIL each
        # time. A lone change (an exit record) is delivered after one to two steps, a stream
        # after `debounce`: a fifth of the debounce (10..50 ms) delivers an exit in ~20 ms
        # instead of ~40 ms for ~0.3% of a core more when idle (docs/BENCHMARKS.md).
        self._step_ms = max(10, min(50, self._debounce_ms // 5))
        self._rescan_interval_s = rescan_interval_s
        self._health_window_s = max(_HEALTH_WINDOW_S, 3 * poll_interval_s)
        self.watching = False
        self.changes_seen = 0
        self.parse_errors = 0

        self._root_str = str(self._layout.root)
        self._paths: dict[_Key, str] = {}
        self._status_str = str(self._layout.status_dir)
        self._ctl_str = str(self._layout.ctl)
        self._last: dict[_Key, Observation] = {}
        # host -> (reason of its current status problem, whether that was logged)
        self._logged_problem: dict[str, tuple[str, bool]] = {}
        self._known_hosts: frozenset[str] = frozenset()
        self._hosts_given: Collection[str] | None = None
        self._pending: set[_Key] = set()
        self._all_requested = False
        self._check_dirs = False
        self._dirs_checked_at = -math.inf
        self._watched_ids: _DirIds | None = None
        # Poll mode's last signature of each path; only the file thread touches it.
        self._signatures: dict[_Key, _Signature] = {}
        # status/'s and ctl/'s names -> inode numbers at the current poll (None: stat each
        # path), and the base names of the paths. Only the file thread touches them.
        self._status_listing: dict[str, int] | None = None
        self._ctl_listing: dict[str, int] | None = None
        self._names: dict[_Key, str] = {}
        # The poll loop's key list and the host collection it was built from.
        self._poll_keys_cache: list[_Key] = []
        self._poll_hosts_given: Collection[str] | None = None
        self._tick_at: float | None = None
        self._wake: asyncio.Event | None = None
        # Set to end the current awatch (directories replaced) and, by awatch itself, when
        # run() is cancelled; the Rust loop polls it every step.
        self._restart = threading.Event()
        self._files = _FileThread()

    # -- public ------------------------------------------------------------------------

    async def run(self, sink: Callable[[list[Observation]], None]) -> None:
        """Watch until cancelled, calling ``sink`` on the loop with each batch of changes."""
        wake = self._wake = asyncio.Event()
        self._tick()
        _log.info("watch.started", root=self._root_str, mode=self.mode, fstype=self.fstype or None)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read_loop(sink, wake))
                tg.create_task(self._rescan_loop())
                if self.mode == "poll":
                    await self._poll_loop()
                else:
                    await self._watch_loop()
        finally:
            self.watching = False
            self._wake = None
            self._tick_at = None
            self._watched_ids = None
            self._files.close()

    def scan_all(self) -> list[Observation]:
        """Read every host's files now, in the calling thread; returns all of them."""
        hosts, _ = self._current_hosts()
        batch = self._read_batch(_all_keys(hosts), check_dirs=False)
        return self._observe(batch.observations, every=True)

    async def scan(self, hosts: Collection[str]) -> list[Observation]:
        """Read ``hosts``' files now, off the event loop; returns all of them (and seeds what
        ``run()`` compares with, so it reports only what changes after)."""
        keys = _all_keys(hosts)
        batch = await self._read_off_loop(keys, False)
        return self._observe(batch.observations, every=True)

    def healthy(self, now: float) -> bool:
        """Whether the watch loop ticked recently (``now`` is ``time.monotonic()``)."""
        return self._tick_at is not None and now - self._tick_at <= self._health_window_s

    # -- poll loop -----------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        """Poll mode: stat every host's paths each interval; queue the changed ones."""
        loop = asyncio.get_running_loop()
        root_missing = False
        # Fixed rate, not a pause after each poll: a poll of 1000 hosts takes a while, and a
        # slower beat than the workers' would let two heartbeats fall between polls.
        next_at = loop.time()
        while True:
            root_exists = await self._poll_in_chunks(self._poll_keys())
            if root_exists == root_missing:
                root_missing = not root_exists
                if root_missing:
                    _log.warning("watch.root_missing", root=self._root_str)
                else:
                    _log.info("watch.root_back", root=self._root_str)
            self.watching = root_exists
            next_at = max(next_at + self._poll_interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    def _poll_keys(self) -> list[_Key]:
        """Every path a poll looks at, sorted; built again only when the fleet changes."""
        names = self._hosts()
        if names is not self._poll_hosts_given:
            self._poll_keys_cache = _all_keys(frozenset(names))
            self._poll_hosts_given = names
        return self._poll_keys_cache

    async def _poll_in_chunks(self, keys: list[_Key]) -> bool:
        """One poll of ``keys``; whether the run root exists.

        In chunks, each handed to the reader as soon as it is stat'ed: a whole sweep of 1000
        hosts (3000 stats) before the first read put a change found early behind the rest
        of the sweep and every other read, ~70 ms at worst (docs/BENCHMARKS.md).
        """
        for start in range(0, max(len(keys), 1), _POLL_CHUNK_KEYS):
            chunk = keys[start : start + _POLL_CHUNK_KEYS]
            last = start + _POLL_CHUNK_KEYS >= len(keys)
            poll = functools.partial(
                self._poll, chunk, whole=keys if last else None, listing=start == 0
            )
            changed, root_exists = await self._files.call(poll)
            self._tick()
            if changed:
                self.changes_seen += len(changed)
                self._pending.update(changed)
                self._wake_reader()
        return root_exists

    def _poll(
        self, keys: list[_Key], whole: list[_Key] | None, *, listing: bool = False
    ) -> tuple[list[_Key], bool]:
        """In the file thread: the keys whose signature changed (or were never seen), and whether
        the root exists (checked only with ``whole``, the sweep's last chunk, which also
        forgets the paths of hosts that are no longer configured). ``listing``: list
        ``status/`` and ``ctl/`` first, as the sweep's first chunk does."""
        if listing:
            self._status_listing = _list_dir(self._status_str, (".json",))
            self._ctl_listing = _list_dir(self._ctl_str, (".exit.json", ".stop"))
        changed: list[_Key] = []
        signatures = self._signatures
        for key in keys:
            signature = self._poll_signature(key, signatures.get(key))
            if key not in signatures or signatures[key] != signature:
                changed.append(key)
            signatures[key] = signature
        if whole is None:
            return changed, True
        if len(signatures) > len(whole):
            kept = set(whole)
            for key in [k for k in signatures if k not in kept]:
                del signatures[key]
        return changed, _dir_id(self._root_str) is not None

    # -- watch loop ----------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        """inotify mode: (re)start the watch whenever the watched directories change."""
        delay = _RETRY_MIN_S
        root_missing = False
        while True:
            self.watching = False
            self._watched_ids = None
            ids = await self._files.call(self._dir_ids)
            self._tick()
            if ids.root is None:
                if not root_missing:
                    _log.warning("watch.root_missing", root=self._root_str)
                    root_missing = True
                    self._request_all()  # the hosts' files are gone too: report that once
                delay = await self._pause(delay)
                continue
            if root_missing:
                _log.info("watch.root_back", root=self._root_str)
                root_missing = False
            paths = [self._root_str]
            if ids.status is not None:
                paths.append(self._status_str)
            if ids.ctl is not None:
                paths.append(self._ctl_str)
            self._watched_ids = ids
            self._restart.clear()
            try:
                await self._watch(paths)
            # OSError: a directory vanished before the watch began, the inotify watch limit;
            # RuntimeError: watchfiles' internal errors.
            except (OSError, RuntimeError) as exc:
                _log.warning("watch.failed", root=self._root_str, error=str(exc))
                delay = await self._pause(delay)
                continue
            delay = _RETRY_MIN_S
            _log.info("watch.restarted", root=self._root_str, reason="directories replaced")

    async def _watch(self, paths: list[str]) -> None:
        """One awatch over ``paths``, until ``_restart`` is set."""
        # Not recursive: the root (to see status/ and ctl/ come and go), status/ and ctl/;
        # task churn in inbox/ and outbox/ never reaches us, in either mode.
        changes_stream = awatch(
            *paths,
            watch_filter=self._wanted,
            debounce=self._debounce_ms,
            step=self._step_ms,
            stop_event=self._restart,
            rust_timeout=_RUST_TIMEOUT_MS,
            yield_on_timeout=True,
            force_polling=False,  # not even if WATCHFILES_FORCE_POLLING is set: see the class
            recursive=False,
        )
        first = True
        async with contextlib.aclosing(changes_stream):
            async for changes in changes_stream:
                self._tick()
                if first:
                    # What was written before the watch existed is only seen by reading.
                    self._request_all()
                    self.watching = True
                    first = False
                self._note(changes)

    async def _pause(self, delay: float) -> float:
        """Sleep ``delay`` (at most a second, so the loop keeps ticking); the next delay."""
        await asyncio.sleep(delay)
        self._tick()
        return min(delay * 2, _RETRY_MAX_S)

    def _tick(self) -> None:
        now = time.monotonic()
        self._tick_at = now
        if self.mode == "inotify" and now - self._dirs_checked_at >= _DIR_CHECK_INTERVAL_S:
            self._dirs_checked_at = now
            self._check_dirs = True
            self._wake_reader()

    def _wanted(self, change: Change, path: str) -> bool:
        """watchfiles filter: a status or ctl file of any host, or a watched directory."""
        return self._key_of(path) is not None or path in (
            self._root_str,
            self._status_str,
            self._ctl_str,
        )

    def _note(self, changes: Iterable[tuple[Change, str]]) -> None:
        for _change, path in changes:  # the event type is never trusted: re-read
            self.changes_seen += 1
            key = self._key_of(path)
            if key is None:
                self._check_dirs = True
                if path in (self._root_str, self._status_str, self._ctl_str):
                    # A watched directory was removed, made or replaced. Its (dev, inode) can
                    # come back unchanged (ext4 reuses a freed inode at once), so comparing
                    # ids would keep the dead watch: start a fresh one, which re-reads all.
                    self._restart.set()
            else:
                self._pending.add(key)
        if self._pending or self._check_dirs:
            self._wake_reader()

    def _key_of(self, path: str) -> _Key | None:
        parent, _, name = path.rpartition("/")
        if name.startswith("."):  # temp files of atomic writers
            return None
        if parent == self._status_str:
            if name.endswith(".json") and len(name) > len(".json"):
                return name.removesuffix(".json"), "status"
        elif parent == self._ctl_str:
            if name.endswith(".exit.json") and len(name) > len(".exit.json"):
                return name.removesuffix(".exit.json"), "exit"
            if name.endswith(".stop") and len(name) > len(".stop"):
                return name.removesuffix(".stop"), "stop"
        return None

    # -- reader --------------------------------------------------------------------------

    def _request_all(self) -> None:
        self._all_requested = True
        self._wake_reader()

    def _wake_reader(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _rescan_loop(self) -> None:
        # The safety net in every mode: an overflowed inotify queue, a stale NFS cache.
        while True:
            await asyncio.sleep(self._rescan_interval_s)
            self._request_all()

    async def _read_loop(
        self, sink: Callable[[list[Observation]], None], wake: asyncio.Event
    ) -> None:
        """The only reader: one batch at a time, so each host's observations stay in order."""
        while True:
            await wake.wait()
            wake.clear()
            hosts, new_hosts = self._current_hosts()
            keys = {k for k in self._pending if k[0] in hosts}
            self._pending.clear()
            if self._all_requested:
                keys = set(_all_keys(hosts))
                self._all_requested = False
            elif new_hosts:
                keys.update(_all_keys(new_hosts))
            check = self._check_dirs
            self._check_dirs = False
            if not keys and not check:
                continue
            # Exit records and stop sentinels first, in a batch of their own: a poll (or a
            # rescan) of 1000 hosts finds every heartbeat changed, and an exit record queued
            # behind them waited ~0.1 s for their reads and steps (docs/BENCHMARKS.md). A
            # host's exit record still comes before its heartbeat, as in sorted order.
            ctl_keys = sorted(k for k in keys if k[1] != "status")
            status_keys = sorted(k for k in keys if k[1] == "status")
            parts = [part for part in (ctl_keys, status_keys) if part] or [[]]
            for i, part in enumerate(parts):
                batch = await self._read_off_loop(part, check and i == len(parts) - 1)
                watched = self._watched_ids
                if batch.dir_ids is not None and watched is not None and batch.dir_ids != watched:
                    self._restart.set()
                news_first = part is status_keys
                observations = self._observe(batch.observations, every=False, news_first=news_first)
                if observations:
                    sink(observations)

    async def _read_off_loop(self, keys: list[_Key], check: bool) -> _Batch:
        future = self._files.submit(lambda: self._read_batch(keys, check_dirs=check))
        try:
            done, _ = await asyncio.wait({future}, timeout=_SLOW_READ_S)
            if not done:
                _log.warning("watch.read_slow", root=self._root_str, waited_s=_SLOW_READ_S)
            return await future
        finally:
            future.cancel()  # only matters when we are cancelled: abandon the result

    def _current_hosts(self) -> tuple[frozenset[str], frozenset[str]]:
        """The hosts to watch now, and which of them are new since the last batch."""
        names = self._hosts()
        if names is self._hosts_given:
            # The daemon hands out one frozenset until its fleet changes: comparing and
            # pruning N hosts on every batch cost ~0.5% of a core at 1000 hosts.
            return self._known_hosts, frozenset()
        hosts = frozenset(names)
        new_hosts = hosts - self._known_hosts
        self._forget_hosts_except(hosts)
        self._known_hosts = hosts
        self._hosts_given = names
        return hosts, new_hosts

    def _forget_hosts_except(self, hosts: frozenset[str]) -> None:
        # A host removed by a reload and added back later is reported afresh.
        for key in [k for k in self._last if k[0] not in hosts]:
            del self._last[key]
        for host in [h for h in self._logged_problem if h not in hosts]:
            del self._logged_problem[host]

    # -- runs in the file thread: touches the filesystem, nothing else ------------------

    def _dir_ids(self) -> _DirIds:
        return _DirIds(
            root=_dir_id(self._root_str),
            status=_dir_id(self._status_str),
            ctl=_dir_id(self._ctl_str),
        )

    def _path_of(self, key: _Key) -> str:
        # Built once per host and kind: joining Paths for every read of every heartbeat
        # cost a third of the read itself at 1000 hosts (bench/bench_core.py).
        path = self._paths.get(key)
        if path is None:
            host, kind = key
            if kind == "status":
                built = self._layout.status(host)
            elif kind == "exit":
                built = self._layout.exit_record(host)
            else:
                built = self._layout.stop_sentinel(host)
            path = self._paths[key] = str(built)
        return path

    def _poll_signature(self, key: _Key, previous: _Signature) -> _Signature:
        """What this poll compares for ``key``: from the directory listings where they could
        be read (their inode numbers come with the names, no stat per path), else a stat.

        One listing of each directory replaces most stats of a poll (an atomic rewrite, the
        workers' and the shepherd's way, always brings a new inode), and on NFS a few
        READDIR calls replace a lookup per path (docs/BENCHMARKS.md). A file whose listed
        inode stayed is stat'ed: it may have been rewritten in place, and some filesystems
        (FUSE without ``use_ino``) list one made-up inode number for every entry. A stop
        sentinel only says whether it is there, which the listing tells.
        """
        kind = key[1]
        listing = self._status_listing if kind == "status" else self._ctl_listing
        if listing is None:
            return _signature(self._path_of(key))
        inode = listing.get(self._name_of(key))
        if inode is None:
            return None
        if kind == "stop":
            return ("listed", inode)
        if previous is not None and previous[:2] == ("listed", inode):
            # The file of the last poll: only a stat can tell an in-place rewrite.
            return ("listed", inode, _signature(self._path_of(key)))
        # A new file, read anyway: its stat waits for a poll that finds the inode unchanged
        # (that poll, having no stat to compare with, reports one change that reads the same).
        return ("listed", inode, None)

    def _name_of(self, key: _Key) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = self._path_of(key).rpartition("/")[2]
        return name

    def _read_batch(self, keys: Iterable[_Key], *, check_dirs: bool) -> _Batch:
        ctl_exists: bool | None = None
        found: list[tuple[_Key, Observation]] = []
        for key in keys:
            host, kind = key
            path = self._path_of(key)
            if kind == "status":
                found.append((key, StatusObserved(host, read_status(path))))
                continue
            if ctl_exists is None:
                ctl_exists = os.path.isdir(self._layout.ctl)
            if not ctl_exists:
                # No ctl/ (run root gone, mount lost) says nothing about a stop sentinel:
                # reporting "removed" would start hosts an operator stopped.
                continue
            if kind == "exit":
                found.append((key, ExitObserved(host, read_exit(path))))
            else:
                present = _exists(path)
                if present is not None:
                    found.append((key, SentinelObserved(host, present)))
        return _Batch(observations=found, dir_ids=self._dir_ids() if check_dirs else None)

    # -- back on the loop ----------------------------------------------------------------

    def _observe(
        self, found: list[tuple[_Key, Observation]], *, every: bool, news_first: bool = False
    ) -> list[Observation]:
        out: list[Observation] = []
        # With ``news_first``, a status that is more than the next heartbeat of the same pid
        # (a new worker's first one, a change of ready, a problem) goes before the routine
        # ones: a poll of 1000 hosts delivers every heartbeat at once, and a first heartbeat
        # sorted behind them waited ~0.1 s for their steps (docs/BENCHMARKS.md). Each host
        # appears once in a status batch, so no host's own order changes.
        routine: list[Observation] = []
        for key, observation in found:
            previous = self._last.get(key)
            if isinstance(observation, StatusObserved):
                first = key not in self._last
                self._log_status(observation.host, observation.record, first=first)
            if every or previous != observation:
                if news_first and _same_worker_beat(previous, observation):
                    routine.append(observation)
                else:
                    out.append(observation)
            self._last[key] = observation
        return out + routine

    def _log_status(self, host: str, record: StatusRecord | StatusProblem, *, first: bool) -> None:
        # One line per change of reason, not one per heartbeat of a broken host. A file that
        # is missing at a host's first read is normal (no worker launched yet): not logged,
        # and neither is its arrival.
        previous = self._logged_problem.get(host)
        if isinstance(record, StatusRecord):
            if previous is not None:
                del self._logged_problem[host]
                if previous[1]:
                    _log.info("status.recovered", host=host, previous=previous[0])
            return
        self.parse_errors += 1
        if previous is not None and previous[0] == record.reason:
            return
        if record.reason == "missing":
            if not first:
                _log.info("status.problem", host=host, reason=record.reason)
            self._logged_problem[host] = (record.reason, not first)
        else:
            _log.warning("status.problem", host=host, reason=record.reason)
            self._logged_problem[host] = (record.reason, True)


def _same_worker_beat(previous: Observation | None, current: Observation) -> bool:
    """Both are readable status records of the same pid with the same ``ready``."""
    if not (isinstance(previous, StatusObserved) and isinstance(current, StatusObserved)):
        return False
    before, now = previous.record, current.record
    if not (isinstance(before, StatusRecord) and isinstance(now, StatusRecord)):
        return False
    return before.pid == now.pid and before.ready == now.ready


def _all_keys(hosts: Iterable[str]) -> list[_Key]:
    kinds: tuple[Kind, ...] = ("status", "exit", "stop")
    return [(host, kind) for host in sorted(hosts) for kind in kinds]


_Signature = tuple[object, ...] | None


def _list_dir(path: str, suffixes: tuple[str, ...]) -> dict[str, int] | None:
    """The names in ``path`` ending with one of ``suffixes``, with their inode numbers;
    ``{}`` when the directory is missing, None when it cannot be listed (then poll mode
    stats each path, as without listings)."""
    found: dict[str, int] = {}
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(suffixes):
                    found[name] = entry.inode()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError:
        return None
    return found


def _signature(path: str) -> _Signature:
    """What poll mode compares: identity, size and nanosecond times; None when missing.

    An atomic rewrite always changes the inode, so it is seen whatever the timestamp
    granularity of the filesystem.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return (-1, exc.errno or 0)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _dir_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _exists(path: str) -> bool | None:
    """Whether ``path`` exists; ``None`` when the filesystem would not say."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return None
    return True


# Below this much free space a worker cannot rewrite even its heartbeat reliably.
_NEARLY_FULL_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class FilesystemCheck:
    """What the run root's filesystem said when asked, to explain a fleet-wide silence."""

    answered: bool
    free_bytes: int | None = None
    free_inodes: int | None = None
    error: str | None = None

    @property
    def finding(self) -> str:
        """One line for the operator: the likely cause, or what was ruled out."""
        if not self.answered:
            return "the run root did not answer statvfs: this node's mount looks hung"
        if self.error is not None:
            return f"the run root cannot be examined: {self.error}"
        if self.free_bytes is not None and self.free_bytes < _NEARLY_FULL_BYTES:
            return f"the run filesystem is full ({self.free_bytes} bytes free)"
        if self.free_inodes == 0:
            return "the run filesystem has no free inodes"
        return (
            f"the run root answers and has {self.free_bytes} bytes free: suspect the workers'"
            " side (their mounts, the network)"
        )


async def check_filesystem(path: Path, timeout_s: float) -> FilesystemCheck:
    """statvfs of ``path`` in a thread of its own, abandoned after ``timeout_s``: the question
    is asked when the filesystem may be hung, and the answer must never hang us."""
    thread = _FileThread()
    try:
        async with asyncio.timeout(timeout_s):
            st = await thread.call(functools.partial(os.statvfs, path))
    except TimeoutError:
        return FilesystemCheck(answered=False)
    except OSError as exc:
        return FilesystemCheck(answered=True, error=exc.strerror or str(exc))
    finally:
        thread.close()
    return FilesystemCheck(
        answered=True, free_bytes=st.f_bavail * st.f_frsize, free_inodes=st.f_favail
    )


_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]


class _FileThread:
    """One daemon thread that does every file read of a watcher.

    A hung mount then blocks this thread, never the event loop; and unlike the default
    executor, whose threads are joined at interpreter exit, it cannot hang the shutdown.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        """A future for ``fn()`` run in the file thread; cancelling it abandons the result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="statusfiles", daemon=True)
            self._thread.start()
        self._jobs.put((loop, future, fn))
        return future

    async def call(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` run in the file thread."""
        return await self.submit(fn)

    def close(self) -> None:
        """Let the thread end once its current job (if any) returns."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _serve(self) -> None:
        _name_this_thread(FILE_THREAD_NAME)
        while (job := self._jobs.get()) is not None:
            loop, future, fn = job
            if future.cancelled():  # abandoned before it started (a benign racy read)
                continue
            try:
                result = fn()
            # The thread's root: every outcome goes back to the awaiting task, which raises it.
            except BaseException as exc:  # noqa: BLE001
                _resolve_threadsafe(loop, future, None, exc)
            else:
                _resolve_threadsafe(loop, future, result, None)


def _name_this_thread(name: str) -> None:
    """Name the calling thread for ``top -H``, ``ps -L`` and /proc (at most 15 bytes)."""
    path = f"/proc/self/task/{threading.get_native_id()}/comm"
    with contextlib.suppress(OSError), open(path, "w", encoding="ascii") as f:
        f.write(name)


def _resolve_threadsafe(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: object,
    exc: BaseException | None,
) -> None:
    def resolve() -> None:
        if future.done():  # the awaiting task was cancelled meanwhile
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    # The loop closed while a read hung: nobody is waiting for the result any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(resolve)
