"""Watching the run directory's ``status/`` and ``ctl/`` change: by inotify, or by polling.

The only importer of watchfiles. A change only ever means "re-read that file"; every stat,
listing and read happens in the watcher's file thread, never on the event loop, and nothing
here writes, renames or deletes anything in the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, Protocol

import structlog
from watchfiles import Change, awatch

from supervisor import runfiles
from supervisor.config import WatchMode
from supervisor.filethread import FileThread
from supervisor.layout import RunLayout
from supervisor.mounts import ResolvedMode, choose_mode, filesystem_type
from supervisor.statusfiles import (
    ExitObserved,
    Observation,
    SentinelObserved,
    StatusObserved,
    StatusProblem,
    StatusRecord,
    problem_of,
    read_exit,
    read_status,
)

Kind = Literal["status", "exit", "stop"]

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


class WatcherProtocol(Protocol):
    """What the daemon needs from a status watcher (a fake implements this in tests)."""

    @property
    def mode(self) -> ResolvedMode | None: ...

    @property
    def changes_seen(self) -> int: ...

    @property
    def parse_errors(self) -> int: ...

    async def run(self, sink: Callable[[list[Observation]], None]) -> None: ...

    async def scan_all(self) -> list[Observation]: ...

    async def scan(self, hosts: Collection[str]) -> list[Observation]: ...

    def set_hosts(self, hosts: Iterable[str]) -> None: ...

    def healthy(self, now: float) -> bool: ...


_Key = tuple[str, Kind]
_Signature = tuple[object, ...] | None


@dataclass(frozen=True, slots=True)
class _DirIds:
    """(st_dev, st_ino) of the watched directories, ``None`` where missing."""

    root: tuple[int, int] | None
    status: tuple[int, int] | None
    ctl: tuple[int, int] | None


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
    startup, before ``run()``, and seeds what ``run()`` compares with. ``set_hosts()`` says
    which hosts to watch: a new one's files are read at the next batch, a removed one's are
    forgotten (and reported afresh if it comes back).

    inotify mode runs watchfiles (non-recursive, on the root, ``status/`` and ``ctl/``).
    Poll mode does not use watchfiles' poller: it compares modification times in whole
    seconds, so a file rewritten twice within one second (even to a new inode and size)
    looks unchanged and the last write can go unseen for good. Every ``poll_interval_s`` we
    list ``status/`` and ``ctl/`` and compare each host's files' inode numbers (an atomic
    rewrite always brings a new one), and stat a file whose inode stayed to compare size and
    nanosecond times (a rewrite in place).
    Both modes re-read everything every ``rescan_interval_s``.

    Threads: this object belongs to the event loop. Every stat, listing and read is made by
    its ``FileThread``, which owns the ``_Disk`` (path caches, the poll's memory) that no
    other thread can reach; watchfiles' waiting thread sees only the ``_restart`` event.
    """

    #: The resolved mode, ``None`` until ``scan_all()`` or ``run()`` looked at the run
    #: root's filesystem; ``fstype`` is what that look saw ("" if unknown).
    mode: ResolvedMode | None
    fstype: str
    #: The run root is being watched (false while it is missing or the watch restarts).
    watching: bool
    #: Changes seen: inotify events that passed the filter (a status or ctl file, or a
    #: watched directory), or in poll mode paths whose stat changed between two polls.
    changes_seen: int
    #: Status files read that exist but are no heartbeat (partial, not JSON, malformed,
    #: unreadable). A file that is not there is no parse error: before a host's first
    #: launch none is, and a fresh fleet must not read as a broken one.
    parse_errors: int

    def __init__(
        self,
        root: Path,
        hosts: Iterable[str],
        *,
        mode: WatchMode,
        poll_interval_s: float,
        debounce_ms: int,
        rescan_interval_s: float,
    ) -> None:
        layout = RunLayout(Path(os.path.abspath(root)))
        self._run = _RunPaths(
            root=str(layout.root), status=str(layout.status_dir), ctl=str(layout.ctl)
        )
        self._configured_mode = mode
        self.mode = None
        self.fstype = ""
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
        # The last watch failed (watch.failed): the next one that runs says so.
        self._failed = False
        # inotify mode said watch.root_missing: watch.root_back is due when it is back.
        self._root_missing_logged = False
        self.changes_seen = 0
        self.parse_errors = 0

        # Membership: set_hosts() replaces the set and counts up the version; the reader and
        # the poll loop each remember the version they last built from, so a batch costs
        # O(1) until the fleet changes, and O(hosts) once when it does.
        self._hosts: frozenset[str] = frozenset(hosts)
        self._hosts_version = 0
        self._known_hosts: frozenset[str] = frozenset()
        self._known_version = -1
        self._poll_keys_cache: list[_Key] = []
        self._poll_keys_version = -1

        self._last: dict[_Key, Observation] = {}
        # host -> (reason of its current status problem, whether that was logged)
        self._logged_problem: dict[str, tuple[str, bool]] = {}
        self._pending: set[_Key] = set()
        self._all_requested = False
        self._check_dirs = False
        self._dirs_checked_at = -math.inf
        self._watched_ids: _DirIds | None = None
        self._tick_at: float | None = None
        self._wake: asyncio.Event | None = None
        # Set to end the current awatch (directories replaced) and, by awatch itself, when
        # run() is cancelled; the Rust loop polls it every step.
        self._restart = threading.Event()
        # No reference to the _Disk is kept here: only the file thread can touch it.
        self._files = FileThread(_Disk(layout, self._run), name=FILE_THREAD_NAME)

    # -- public ------------------------------------------------------------------------

    async def run(self, sink: Callable[[list[Observation]], None]) -> None:
        """Watch until cancelled, calling ``sink`` on the loop with each batch of changes.

        Once per watcher: its file thread ends with it.
        """
        try:
            mode = await self._settle_mode()
            wake = self._wake = asyncio.Event()
            self._tick()
            _log.info("watch.started", root=self._run.root, mode=mode, fstype=self.fstype or None)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read_loop(sink, wake))
                tg.create_task(self._rescan_loop())
                if mode == "poll":
                    await self._poll_loop()
                else:
                    await self._watch_loop()
        finally:
            self.watching = False
            self._wake = None
            self._tick_at = None
            self._watched_ids = None
            self._files.close()

    async def scan_all(self) -> list[Observation]:
        """Read every host's files now (in the file thread); returns all of them.

        Meant for start-up, before ``run()``: it settles ``mode`` and seeds what ``run()``
        compares with.
        """
        await self._settle_mode()
        hosts, _ = self._current_hosts()
        batch = await self._read_off_loop(_all_keys(hosts), check=False)
        return self._observe(batch.observations, every=True)

    async def scan(self, hosts: Collection[str]) -> list[Observation]:
        """Read ``hosts``' files now, off the event loop; returns all of them (and seeds what
        ``run()`` compares with, so it reports only what changes after)."""
        keys = _all_keys(hosts)
        batch = await self._read_off_loop(keys, False)
        return self._observe(batch.observations, every=True)

    def set_hosts(self, hosts: Iterable[str]) -> None:
        """Watch exactly these hosts from the next batch on.

        O(1) when given the frozenset it already holds (nothing can have changed in it), so
        a caller may hand over its current set after every step.
        """
        given = frozenset(hosts)  # ``hosts`` itself when it is a frozenset
        if given is self._hosts:
            return
        self._hosts = given
        self._hosts_version += 1

    def healthy(self, now: float) -> bool:
        """Whether the watch loop ticked recently (``now`` is ``time.monotonic()``)."""
        return self._tick_at is not None and now - self._tick_at <= self._health_window_s

    async def _settle_mode(self) -> ResolvedMode:
        """The mode to watch in; for "auto" the run root's filesystem decides, looked up once
        in the file thread (resolving the path may hang on a dead mount)."""
        if self.mode is not None:
            return self.mode
        configured = self._configured_mode
        fstype, mode = await self._files.call(lambda disk: disk.detect(configured))
        self.fstype, self.mode = fstype, mode
        return mode

    # -- poll engine ---------------------------------------------------------------------

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
                    _log.warning("watch.root_missing", root=self._run.root)
                else:
                    _log.info("watch.root_back", root=self._run.root)
            self.watching = root_exists
            next_at = max(next_at + self._poll_interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    def _poll_keys(self) -> list[_Key]:
        """Every path a poll looks at, sorted; built again only when the fleet changes."""
        if self._poll_keys_version != self._hosts_version:
            self._poll_keys_cache = _all_keys(self._hosts)
            self._poll_keys_version = self._hosts_version
        return self._poll_keys_cache

    async def _poll_in_chunks(self, keys: list[_Key]) -> bool:
        """One poll of ``keys``; whether the run root exists.

        In chunks, each handed to the reader as soon as it is stat'ed: a whole sweep of 1000
        hosts (3000 stats) before the first read put a change found early behind the rest
        of the sweep and every other read, ~70 ms at worst (docs/BENCHMARKS.md).
        """
        for start in range(0, max(len(keys), 1), _POLL_CHUNK_KEYS):
            chunk = keys[start : start + _POLL_CHUNK_KEYS]
            whole = keys if start + _POLL_CHUNK_KEYS >= len(keys) else None
            poll = functools.partial(
                _Disk.poll, keys=chunk, whole=whole, listing=len(keys) if start == 0 else None
            )
            changed, root_exists = await self._files.call(poll)
            self._tick()
            if changed:
                self.changes_seen += len(changed)
                self._pending.update(changed)
                self._wake_reader()
        return root_exists

    # -- inotify engine ------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        """inotify mode: (re)start the watch whenever the watched directories change."""
        delay = _RETRY_MIN_S
        while True:
            self.watching = False
            self._watched_ids = None
            ids, fds = await self._files.call(_Disk.open_watched_dirs)
            self._tick()
            try:
                error = await self._watch_once(ids, fds)
            finally:
                for fd in fds.values():
                    os.close(fd)
            if error == _ROOT_MISSING:
                if not self._root_missing_logged:
                    _log.warning("watch.root_missing", root=self._run.root)
                    self._root_missing_logged = True
                    self._request_all()  # the hosts' files are gone too: report that once
                delay = await self._pause(delay)
                continue
            if error is not None:
                _log.warning("watch.failed", root=self._run.root, error=error)
                self._failed = True
                delay = await self._pause(delay)
                continue
            delay = _RETRY_MIN_S
            _log.info("watch.restarted", root=self._run.root, reason="directories replaced")

    async def _watch_once(self, ids: _DirIds, fds: dict[str, int]) -> str | None:
        """One watch of the root and of the directories open in ``fds`` (by kind), until
        they are replaced; why it failed (``_ROOT_MISSING``), or None."""
        if ids.root is None:
            return _ROOT_MISSING
        if self._root_missing_logged:
            _log.info("watch.root_back", root=self._run.root)
            self._root_missing_logged = False
        # status/ and ctl/ are watched through their descriptors (/proc/self/fd/N), never by
        # path: watchfiles adds its watches on the loop holding the GIL, and a path through a
        # symlink swapped in meanwhile (into a hung mount) would freeze the whole process.
        run = dataclasses.replace(
            self._run,
            status_watched=_fd_path(fds.get("status"), self._run.status),
            ctl_watched=_fd_path(fds.get("ctl"), self._run.ctl),
        )
        paths = [self._run.root]
        if "status" in fds:
            paths.append(run.status_watched)
        if "ctl" in fds:
            paths.append(run.ctl_watched)
        self._watched_ids = ids
        self._restart.clear()
        return await self._watch_until_replaced(paths, run)

    async def _watch_until_replaced(self, paths: list[str], run: _RunPaths) -> str | None:
        """``_watch``; why it failed, or None when it ended because the directories changed.

        OSError: a directory vanished before the watch began, the inotify watch limit;
        RuntimeError: watchfiles' internal errors, such as a name in a watched directory that
        is not UTF-8 (anyone who can write the run root can make one). An error while
        watching comes wrapped in an exception group (watchfiles waits in an anyio task
        group): unwrapped here, or it would end the watcher, and with it the daemon.
        """
        try:
            await self._watch(paths, run)
        except (OSError, RuntimeError) as exc:
            return str(exc)
        except BaseExceptionGroup as group:
            matched, rest = group.split((OSError, RuntimeError))
            if rest is not None or matched is None:
                raise
            return "; ".join(str(exc) for exc in matched.exceptions)
        return None

    async def _watch(self, paths: list[str], run: _RunPaths) -> None:
        """One awatch over ``paths`` (named as ``run`` names them), until ``_restart`` is set."""
        # Not recursive: the root (to see status/ and ctl/ come and go), status/ and ctl/;
        # task churn in inbox/ and outbox/ never reaches us, in either mode.
        # watchfiles adds its inotify watches (a path lookup each) on the loop, holding the
        # GIL, so no thread of ours could keep a hang there off the loop: the directories'
        # stat in the file thread just before is what vouches that they answer.
        changes_stream = awatch(
            *paths,
            watch_filter=run.wanted,
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
                    if self._failed:
                        self._failed = False
                        _log.info("watch.resumed", root=self._run.root)
                self._note(changes, run)

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

    def _note(self, changes: Iterable[tuple[Change, str]], run: _RunPaths) -> None:
        for _change, path in changes:  # the event type is never trusted: re-read
            self.changes_seen += 1
            key = run.key_of(path)
            if key is None:
                self._check_dirs = True
                if run.is_watched_dir(path):
                    # A watched directory was removed, made or replaced. Its (dev, inode) can
                    # come back unchanged (ext4 reuses a freed inode at once), so comparing
                    # ids would keep the dead watch: start a fresh one, which re-reads all.
                    self._restart.set()
            else:
                self._pending.add(key)
        if self._pending or self._check_dirs:
            self._wake_reader()

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
        future = self._files.submit(lambda disk: disk.read(keys, check_dirs=check))
        try:
            done, _ = await asyncio.wait({future}, timeout=_SLOW_READ_S)
            if not done:
                _log.warning("watch.read_slow", root=self._run.root, waited_s=_SLOW_READ_S)
            return await future
        finally:
            future.cancel()  # only matters when we are cancelled: abandon the result

    def _current_hosts(self) -> tuple[frozenset[str], frozenset[str]]:
        """The hosts to watch now, and which of them are new since the last batch."""
        hosts = self._hosts
        if self._known_version == self._hosts_version:
            return hosts, frozenset()
        new_hosts = hosts - self._known_hosts
        self._forget_hosts_except(hosts)
        self._known_hosts = hosts
        self._known_version = self._hosts_version
        return hosts, new_hosts

    def _forget_hosts_except(self, hosts: frozenset[str]) -> None:
        # A host removed by a reload and added back later is reported afresh.
        for key in [k for k in self._last if k[0] not in hosts]:
            del self._last[key]
        for host in [h for h in self._logged_problem if h not in hosts]:
            del self._logged_problem[host]

    # -- de-duplication and logging ------------------------------------------------------

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
        if not record.missing:
            self.parse_errors += 1
        if previous is not None and previous[0] == record.reason:
            return
        if record.missing:
            if not first:
                _log.info("status.problem", host=host, reason=record.reason)
            self._logged_problem[host] = (record.reason, not first)
        else:
            _log.warning("status.problem", host=host, reason=record.reason)
            self._logged_problem[host] = (record.reason, True)


@dataclass(frozen=True, slots=True)
class _RunPaths:
    """The watched directories' paths, and which host file a path names.

    Immutable, so the loop (watchfiles' filter included) and the file thread may share it.
    """

    root: str
    status: str
    ctl: str
    #: The names the watch knows ``status/`` and ``ctl/`` by (``/proc/self/fd/N``).
    status_watched: str = ""
    ctl_watched: str = ""

    def is_watched_dir(self, path: str) -> bool:
        """``path`` is the run root, ``status/`` or ``ctl/`` (by either name)."""
        return path in (self.root, self.status, self.ctl, self.status_watched, self.ctl_watched)

    def wanted(self, change: Change, path: str) -> bool:
        """watchfiles filter: a status or ctl file of any host, or a watched directory."""
        # Called for every raw event on the loop: the directory test inline, not a call.
        return self.key_of(path) is not None or path in (
            self.root,
            self.status,
            self.ctl,
            self.status_watched,
            self.ctl_watched,
        )

    def key_of(self, path: str) -> _Key | None:
        """The host and kind of file ``path`` is, or None (a temp file, anything else)."""
        parent, _, name = path.rpartition("/")
        if name.startswith("."):  # temp files of atomic writers
            return None
        if parent == self.status or parent == self.status_watched:
            if name.endswith(".json") and len(name) > len(".json"):
                return name.removesuffix(".json"), "status"
        elif parent == self.ctl or parent == self.ctl_watched:
            if name.endswith(".exit.json") and len(name) > len(".exit.json"):
                return name.removesuffix(".exit.json"), "exit"
            if name.endswith(".stop") and len(name) > len(".stop"):
                return name.removesuffix(".stop"), "stop"
        return None


class _Disk:
    """The watcher's file-thread side: every stat, listing and read, and what they remember.

    Owned by the watcher's ``FileThread``, which passes it to each job; nothing else holds a
    reference, so its caches and the poll's signatures and listings need no lock.
    """

    def __init__(self, layout: RunLayout, run: _RunPaths) -> None:
        self._layout = layout
        self._run = run
        # Built once per host and kind: joining Paths for every read of every heartbeat
        # cost a third of the read itself at 1000 hosts (bench/bench_core.py).
        self._paths: dict[_Key, str] = {}
        self._names: dict[_Key, str] = {}
        #: Poll mode's last signature of each path.
        self.signatures: dict[_Key, _Signature] = {}
        #: status/'s and ctl/'s names -> inode numbers at the current poll (None: stat each
        #: path instead).
        self.status_listing: dict[str, int] | None = None
        self.ctl_listing: dict[str, int] | None = None

    def detect(self, configured: WatchMode) -> tuple[str, ResolvedMode]:
        """The run root's filesystem type ("" if unknown) and the mode to watch it in."""
        root = self._layout.root
        return filesystem_type(root), choose_mode(root, configured)

    def dir_ids(self) -> _DirIds:
        """The watched directories' identities now (the configured root followed, as the
        operator gave it; ``status/`` and ``ctl/`` only if they are real directories)."""
        return _DirIds(
            root=_dir_id(self._run.root),
            status=_dir_id(self._run.status, follow=False),
            ctl=_dir_id(self._run.ctl, follow=False),
        )

    def open_watched_dirs(self) -> tuple[_DirIds, dict[str, int]]:
        """The watched directories' identities, and ``status/`` and ``ctl/`` opened (by
        kind; absent where not a directory) for the watch to be added through: the
        identities are those of the directories open."""
        fds: dict[str, int] = {}
        ids: dict[str, tuple[int, int] | None] = {}
        try:
            for kind, path in (("status", self._run.status), ("ctl", self._run.ctl)):
                fd = _open_run_dir(path)
                ids[kind] = None
                if isinstance(fd, int):
                    fds[kind] = fd
                    st = os.fstat(fd)
                    ids[kind] = (st.st_dev, st.st_ino)
            root = _dir_id(self._run.root)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        if root is None:  # nothing to watch below a missing root
            for fd in fds.values():
                os.close(fd)
            fds = {}
        return _DirIds(root=root, status=ids["status"], ctl=ids["ctl"]), fds

    def read(self, keys: Iterable[_Key], *, check_dirs: bool) -> _Batch:
        """Read ``keys``' files (and with ``check_dirs`` the directories' identities).

        ``status/`` and ``ctl/`` are opened once per batch without following a symlink, and
        each file by its name in them: a directory swapped for a symlink (into a hung mount,
        say) is never gone through.
        """
        status_dir: int | OSError | None = None
        ctl_dir: int | OSError | None = None
        found: list[tuple[_Key, Observation]] = []
        try:
            for key in keys:
                host, kind = key
                path = self._path_of(key)
                if kind == "status":
                    if status_dir is None:
                        status_dir = _open_run_dir(self._run.status)
                    if isinstance(status_dir, OSError):
                        found.append((key, StatusObserved(host, problem_of(status_dir))))
                    else:
                        found.append(
                            (key, StatusObserved(host, read_status(path, dir_fd=status_dir)))
                        )
                    continue
                if ctl_dir is None:
                    ctl_dir = _open_run_dir(self._run.ctl)
                if isinstance(ctl_dir, OSError):
                    # No ctl/ (run root gone, mount lost, a symlink) says nothing about a stop
                    # sentinel: reporting "removed" would start hosts an operator stopped.
                    continue
                if kind == "exit":
                    found.append((key, ExitObserved(host, read_exit(path, dir_fd=ctl_dir))))
                else:
                    present = _exists(self._name_of(key), ctl_dir)
                    if present is not None:
                        found.append((key, SentinelObserved(host, present)))
        finally:
            for fd in (status_dir, ctl_dir):
                if isinstance(fd, int):
                    os.close(fd)
        return _Batch(observations=found, dir_ids=self.dir_ids() if check_dirs else None)

    def poll(
        self, keys: list[_Key], whole: list[_Key] | None, *, listing: int | None = None
    ) -> tuple[list[_Key], bool]:
        """The keys whose signature changed (or were never seen), and whether the root
        exists (checked only with ``whole``, the sweep's last chunk, which also forgets the
        paths of hosts that are no longer configured). ``listing``: list ``status/`` and
        ``ctl/`` first, as the sweep's first chunk does (it says how many paths the sweep
        polls, which bounds how much of a directory is listed)."""
        if listing is not None:
            limit = _LIST_MIN_ENTRIES + 2 * listing
            self.status_listing = _list_dir(self._run.status, (".json",), limit)
            self.ctl_listing = _list_dir(self._run.ctl, (".exit.json", ".stop"), limit)
        changed: list[_Key] = []
        signatures = self.signatures
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
        return changed, _dir_id(self._run.root) is not None

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
        listing = self.status_listing if kind == "status" else self.ctl_listing
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

    def _path_of(self, key: _Key) -> str:
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

    def _name_of(self, key: _Key) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = self._path_of(key).rpartition("/")[2]
        return name


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


#: A poll lists at most this many entries of a directory, plus two per path it polls: the
#: run's own files (a pidfile, a log and its backups, a launch record per host) fit, and
#: names planted by the thousand cost a poll no more than stat'ing each path would.
_LIST_MIN_ENTRIES: Final = 1000


def _list_dir(path: str, suffixes: tuple[str, ...], limit: int) -> dict[str, int] | None:
    """The names in ``path`` ending with one of ``suffixes``, with their inode numbers;
    ``{}`` when the directory is missing, None when it cannot be listed or holds more than
    ``limit`` entries (then poll mode stats each path, as without listings)."""
    found: dict[str, int] = {}
    try:
        # Not through a symlink (ENOTDIR, as for a file): that directory is not there.
        fd = os.open(path, _LIST_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError:
        return None
    try:
        with os.scandir(fd) as entries:
            for count, entry in enumerate(entries):
                if count >= limit:
                    return None
                name = entry.name
                if name.endswith(suffixes):
                    found[name] = entry.inode()
    except OSError:
        return None
    finally:
        os.close(fd)
    return found


_LIST_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


#: What ``_watch_once`` returns when there is no run root to watch.
_ROOT_MISSING: Final = "the run root is missing"


def _fd_path(fd: int | None, path: str) -> str:
    """The name a watch reaches the directory open as ``fd`` by without looking up any name
    under the run root (``path``'s when there is no descriptor)."""
    return path if fd is None else f"/proc/self/fd/{fd}"


def _open_run_dir(path: str) -> int | OSError:
    """A descriptor of ``status/`` or ``ctl/`` (the root above it as configured, the directory
    itself never through a symlink), or why there is none."""
    try:
        return runfiles.open_dir_path(path)
    except OSError as exc:
        return exc


def _signature(path: str) -> _Signature:
    """What poll mode compares: identity, size and nanosecond times; None when missing.

    An atomic rewrite always changes the inode, so it is seen whatever the timestamp
    granularity of the filesystem. A symlink is not followed: one planted into a hung mount
    would hang the file thread, and every host's reads behind it.
    """
    try:
        st = os.stat(path, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return (-1, exc.errno or 0)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _dir_id(path: str, *, follow: bool = True) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=follow)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _exists(name: str, dir_fd: int) -> bool | None:
    """Whether ``name`` exists in ``dir_fd`` (a symlink is one, wherever it points: it is
    never followed); ``None`` when the filesystem would not say."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return None
    return True
