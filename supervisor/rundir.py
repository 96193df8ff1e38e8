"""The run-directory adapter: everything the daemon reads or writes under the run root, and
what the file watcher sees there, turned into events.

The run lock and the epoch (for the leadership core), stop sentinels, the pointer file, the
restart history, the stuck-task quarantine, fresh reads of a host's files, the diagnosis of
a frozen fleet. Every file operation runs in a thread (``asyncio.to_thread``), bounded in
time where a hung mount could hold it for ever, and answers with an event. It decides
nothing (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final, assert_never

import structlog

from supervisor import health, layout, leadership, runfiles, tasks, view, vocabulary
from supervisor.errors import RunLocked
from supervisor.mounts import check_filesystem
from supervisor.shell import Shell
from supervisor.statusfiles import (
    ExitObserved,
    ExitRecord,
    Observation,
    SentinelObserved,
    StatusObserved,
    StatusProblem,
)
from supervisor.watch import WatcherProtocol

log = structlog.get_logger("supervisor.daemon")

# How often dirty restart history is written to ctl/: often enough that a SIGKILL loses at
# most this much backoff state, rarely enough to cost nothing on NFS.
PERSIST_INTERVAL_S: Final = 0.5
# A statvfs of a healthy mount answers in milliseconds; one this slow is a hung mount.
FS_CHECK_TIMEOUT_S: Final = 5.0
#: A failed read of a joining host's files is tried again after this pause: the host must
#: not join before its stop sentinel is known.
SCAN_RETRY_S: Final = 1.0
#: What the stopping daemon waits for one file operation on the run root (its history, its
#: lock), and the exiting process for its I/O threads: on a hung mount (a dead NFS server,
#: a stopped FUSE server) they never return, and a stop must still end the process.
SHUTDOWN_IO_TIMEOUT_S: Final = 5.0


class RunDirectory:
    """The run root as the daemon acts on it."""

    def __init__(
        self,
        shell: Shell,
        watcher: WatcherProtocol,
        *,
        histories: Callable[[], dict[str, health.History]],
        seats: Callable[[], vocabulary.SavedSeats | None],
    ) -> None:
        self._shell = shell
        self.watcher = watcher
        self._histories = histories
        self._seats = seats
        # The leadership core's I/O: not in the daemon's task group, since the first try of
        # the lock comes before the group and a handover's looks after it.
        self._lock_ops: set[asyncio.Task[None]] = set()
        self._history_encoder = runfiles.HistoryEncoder()
        self._history_dirty = asyncio.Event()
        self._run_lock: int | None = None
        self._diagnosis: asyncio.Task[None] | None = None
        #: When the pointer file was last written (wall clock), for ``status``.
        self.pointer_written_wall: float | None = None
        #: A standby's view of the fleet from the files (``view.offline_status``).
        self.standby_view: dict[str, Any] = {}

    # --- the run lock and the epoch (the leadership core's I/O) -------------------------

    def prepare(self) -> leadership.LockTaken | leadership.LockBusy | leadership.LockFailed:
        """Create the run directory, then try the run lock (in a thread)."""
        layout.ensure_run_dirs(self._shell.config)
        return self.try_lock()

    def try_lock(self) -> leadership.LockTaken | leadership.LockBusy | leadership.LockFailed:
        """Take the run lock if it is free, then write the next epoch and the run files
        under it (in a thread)."""
        config = self._shell.config
        run = layout.layout_of(config)
        try:
            fd = runfiles.lock_run(run.lock_file, root=run.root)
        except RunLocked as exc:
            return leadership.LockBusy(holder=exc.holder, lock_file=str(run.lock_file))
        except OSError as exc:
            return leadership.LockFailed(reason=str(exc))
        locked_at = time.monotonic()
        try:
            # Under the lock: the lock orders the bumps, so every leadership's epoch is new.
            epoch = runfiles.bump_epoch(run.epoch_file, root=run.root)
            layout.write_run_files(config)
        except OSError as exc:
            os.close(fd)
            return leadership.LockFailed(reason=str(exc))
        except BaseException:
            os.close(fd)
            raise
        self._run_lock = fd
        return leadership.LockTaken(epoch=epoch, leader=identity(), locked_at=locked_at)

    def check_lock(self) -> leadership.LockChecked:
        """Whether we still hold the run lock (why not), and the epoch on disk (in a thread)."""
        run = layout.layout_of(self._shell.config)
        fd = self._run_lock
        reason = "the run lock was released" if fd is None else None
        if fd is not None:
            reason = runfiles.check_lock(fd, run.lock_file, root=run.root)
        epoch = runfiles.read_epoch(run.epoch_file, root=run.root)
        return leadership.LockChecked(held=reason is None, epoch_on_disk=epoch, reason=reason or "")

    def look_at_lock(self) -> leadership.LockLooked:
        """Who holds the run lock now (in a thread)."""
        run = layout.layout_of(self._shell.config)
        return leadership.LockLooked(holder=runfiles.current_holder(run.lock_file, root=run.root))

    def read_view(self) -> leadership.ViewRead:
        """The fleet as the run directory shows it, for a standby's status, and the epoch
        there (in a thread)."""
        config = self._shell.config
        run = layout.layout_of(config)
        epoch = runfiles.read_epoch(run.epoch_file, root=run.root)
        self.standby_view = view.offline_status(config, look_at_lock=False)
        return leadership.ViewRead(epoch_on_disk=epoch)

    def lock_io(self, action: leadership.TryLock | leadership.CheckLock) -> None:
        """Perform the leadership core's ``TryLock`` or ``CheckLock``."""
        match action:
            case leadership.TryLock():
                self._lead_io(self.try_lock, lambda why: leadership.LockFailed(reason=why))
            case leadership.CheckLock():
                self._lead_io(self.check_lock, _lock_unknown)
            case _:
                assert_never(action)

    def look_io(self, action: leadership.ReadView | leadership.LookAtLock) -> None:
        """Perform the leadership core's ``ReadView`` or ``LookAtLock``."""
        match action:
            case leadership.ReadView():
                self._lead_io(self.read_view, lambda why: leadership.ViewRead(epoch_on_disk=None))
            case leadership.LookAtLock():
                self._lead_io(self.look_at_lock, lambda why: leadership.LockLooked(holder=""))
            case _:
                assert_never(action)

    def _lead_io(
        self,
        work: Callable[[], leadership.Event],
        failed: Callable[[str], leadership.Event],
    ) -> None:
        """Run one of the leadership core's I/O actions in a thread and feed it the answer
        (``failed(why)`` if ``work`` raised: a bug, logged). Abandoned by
        ``abandon_lock_io`` as the process exits."""

        async def answer() -> None:
            try:
                event = await asyncio.to_thread(work)
            except Exception as exc:  # task root: the core must hear an answer
                log.exception("ha.io_failed", op=getattr(work, "__name__", "?"))
                event = failed(f"internal error: {exc!r}")
            self._shell.lead(event)

        task = asyncio.get_running_loop().create_task(answer(), name="leadership-io")
        self._lock_ops.add(task)
        task.add_done_callback(self._lock_ops.discard)

    def abandon_lock_io(self) -> None:
        """Cancel the leadership core's I/O in flight (the process exits)."""
        for task in self._lock_ops:
            task.cancel()

    async def let_go_of_run_lock(self) -> None:
        """Close the run lock off the loop, waiting a bounded time: on NFS or FUSE a close asks
        the server (to flush, to drop the lock), and a hung one never answers. Abandoned,
        the lock goes with the process."""
        fd, self._run_lock = self._run_lock, None
        if fd is None:
            return
        try:
            async with asyncio.timeout(SHUTDOWN_IO_TIMEOUT_S):
                await asyncio.to_thread(os.close, fd)
        except TimeoutError:
            log.warning("run.lock_release_slow", waited_s=SHUTDOWN_IO_TIMEOUT_S)

    # --- what the watcher sees ---------------------------------------------------------------

    def on_observations(self, observations: list[Observation]) -> None:
        """The watcher's callback: every observation becomes an event for its host."""
        for obs in observations:
            if isinstance(obs, ExitObserved) and obs.record is not None:
                # Rare (one per exit) and the fact behind a restart: worth a line, like the
                # agent's report of the same exit.
                record = obs.record
                log.info(
                    "worker.exit_reported",
                    host=obs.host,
                    pid=record.pid,
                    exit_code=record.exit_code,
                    signal=record.signal,
                    reaped=record.reaped,
                    via="record",
                )
        self._shell.emit_all(events_of(observations))

    def scan(self, action: vocabulary.ScanFiles) -> None:
        """Read joining hosts' files; the core hears the sentinels first, then the rest."""
        self._shell.spawn(self._scan(action.hosts), "scan")

    async def _scan(self, hosts: tuple[str, ...]) -> None:
        while True:
            try:
                observations = await self.watcher.scan(hosts)
            except Exception:  # task root: a host must not join before its sentinel is known
                log.exception("watch.scan_failed", hosts=len(hosts), retry_in_s=SCAN_RETRY_S)
                await asyncio.sleep(SCAN_RETRY_S)
            else:
                break
        sentinels = frozenset(
            o.host for o in observations if isinstance(o, SentinelObserved) and o.present
        )
        scanned = vocabulary.FilesScanned(hosts=frozenset(hosts), sentinels=sentinels)
        self._shell.emit_all([scanned, *events_of(observations)])

    def recheck(self, action: vocabulary.RecheckStatus) -> None:
        """Read a host's files afresh before a verdict from silence."""
        self._shell.spawn(self._recheck(action), f"recheck:{action.host}")

    async def _recheck(self, action: vocabulary.RecheckStatus) -> None:
        """The core hears the status as ``StatusRechecked`` (None when the read failed or
        took too long), with the count of its shard's old task files when that was asked."""
        name = action.host
        beat: health.HeartbeatSeen | health.StatusMissing | None = None
        others: list[Observation] = []
        try:
            async with asyncio.timeout(health.RECHECK_TIMEOUT_S):
                observations = await self.watcher.scan((name,))
        except TimeoutError:
            log.warning("host.recheck_failed", host=name, reason="no answer in time")
        except Exception:  # task root: the verdict must not wait on a broken read
            log.exception("host.recheck_failed", host=name)
        else:
            for obs in observations:
                event = event_of(obs) if isinstance(obs, StatusObserved) else None
                if isinstance(event, health.HeartbeatSeen | health.StatusMissing):
                    beat = event
                else:
                    others.append(obs)
        old_tasks = None
        if action.tasks_older_than_s is not None:
            old_tasks = await self._count_old_tasks(action.shard, name, action.tasks_older_than_s)
        recheck = health.StatusRechecked(beat=beat, old_tasks=old_tasks)
        self._shell.emit_all([*events_of(others), vocabulary.HostObserved(name, recheck)])

    async def _count_old_tasks(self, shard: int, name: str, older_than_s: float) -> int | None:
        """Task files of ``name``'s shard at least ``older_than_s`` old (None: not known)."""
        try:
            async with asyncio.timeout(health.RECHECK_TIMEOUT_S):
                return await asyncio.to_thread(
                    tasks.count_older,
                    self._shell.config.run.root,
                    shard,
                    name,
                    older_than_s=older_than_s,
                )
        except (OSError, TimeoutError) as exc:
            reason = str(exc) or "no answer in time"
            log.warning("host.tasks_not_counted", host=name, shard=shard, reason=reason)
        except Exception:  # task root: the verdict must not wait on a broken listing
            log.exception("host.tasks_not_counted", host=name, shard=shard)
        return None

    # --- files written for the fleet ---------------------------------------------------------

    def write_sentinel(self, action: vocabulary.WriteStopSentinel) -> None:
        """Write ``ctl/<host>.stop``; the core hears ``StopSentinelWritten``."""
        self._shell.spawn(self._write_sentinel(action), f"stop-host:{action.host}")

    async def _write_sentinel(self, action: vocabulary.WriteStopSentinel) -> None:
        run = layout.layout_of(self._shell.config)
        error: str | None = None
        try:
            await asyncio.to_thread(
                runfiles.write_stop_sentinel, run.stop_sentinel(action.host), root=run.root
            )
        except OSError as exc:
            error = str(exc)
        self._shell.emit(
            vocabulary.StopSentinelWritten(host=action.host, token=action.token, error=error)
        )

    def delete_sentinel(self, action: vocabulary.DeleteStopSentinel) -> None:
        """Remove ``ctl/<host>.stop``; the core hears ``StopSentinelDeleted``."""
        self._shell.spawn(self._delete_sentinel(action), f"start-host:{action.host}")

    async def _delete_sentinel(self, action: vocabulary.DeleteStopSentinel) -> None:
        run = layout.layout_of(self._shell.config)
        error: str | None = None
        try:
            await asyncio.to_thread(runfiles.remove, run.stop_sentinel(action.host), root=run.root)
        except OSError as exc:
            error = str(exc)
        self._shell.emit(
            vocabulary.StopSentinelDeleted(host=action.host, token=action.token, error=error)
        )

    def write_pointer(self, action: vocabulary.WritePointer) -> None:
        """Write the pointer file; the core hears ``PointerWritten``."""
        self._shell.spawn(self._write_pointer(action.path), "pointer")

    async def _write_pointer(self, path: str) -> None:
        config = self._shell.config
        error: str | None = None
        try:
            await asyncio.to_thread(
                layout.write_pointer, Path(path), layout.launch_meta(config), root=config.run.root
            )
        except Exception as exc:  # task root: a pointer must never end the daemon
            error = str(exc) or type(exc).__name__
            if not isinstance(exc, OSError):
                log.exception("pointer.write_failed", path=path)
        else:
            self.pointer_written_wall = time.time()
            log.info("pointer.written", path=path)
        self._shell.emit(vocabulary.PointerWritten(path=path, error=error))

    def quarantine(self, action: vocabulary.Quarantine) -> None:
        """Take the tasks a stuck worker hung on out of its shard's inbox, each answered with
        an error result (``tasks.quarantine_stuck``); the core hears how many, always."""
        self._shell.spawn(self._quarantine(action), f"quarantine:{action.host}")

    async def _quarantine(self, action: vocabulary.Quarantine) -> None:
        config = self._shell.config
        stale_s = config.health.progress_stale_s
        reason = (
            f"reward call stuck: {action.host} (shard {action.shard}) finished no task in"
            f" {stale_s:g}s with {action.count} in flight and was replaced; this task"
            f" was quarantined by reward-supervisor in ctl/quarantine/{action.shard}/"
        )
        count = 0
        try:
            async with asyncio.timeout(SHUTDOWN_IO_TIMEOUT_S):
                done = await asyncio.to_thread(
                    tasks.quarantine_stuck,
                    config.run.root,
                    action.shard,
                    action.host,
                    count=action.count,
                    older_than_s=stale_s,
                    reason=reason,
                )
        except (OSError, TimeoutError) as exc:
            why = str(exc) or "the run root did not answer in time"
            log.error("tasks.quarantine_failed", host=action.host, shard=action.shard, reason=why)
        except Exception:  # task root of the quarantine: the restart must go on
            log.exception("tasks.quarantine_failed", host=action.host, shard=action.shard)
        else:
            count = len(done.task_ids)
            log.warning(
                "tasks.quarantined",
                host=action.host,
                shard=action.shard,
                asked=action.count,
                task_ids=list(done.task_ids[:50]),
                count=count,
                unanswered=done.unanswered,
                note=done.note,
            )
        self._shell.emit(vocabulary.HostObserved(action.host, health.Quarantined(count=count)))

    # --- a frozen fleet's diagnosis -----------------------------------------------------------

    def diagnose(self, action: vocabulary.DiagnoseFilesystem) -> None:
        """Tell the operator whether the run root itself is hung or full, the two causes this
        node can check, instead of only "suspect the shared filesystem"."""
        self.end_diagnosis()
        self._diagnosis = self._shell.spawn(self._diagnose(), "freeze-diagnosis")

    def end_diagnosis(self) -> None:
        """Abandon a diagnosis in flight (the freeze is over, or a new one begins)."""
        if self._diagnosis is not None:
            self._diagnosis.cancel()

    async def _diagnose(self) -> None:
        check = await check_filesystem(self._shell.config.run.root, FS_CHECK_TIMEOUT_S)
        self._shell.emit(
            vocabulary.FilesystemDiagnosed(finding=check.finding, free_bytes=check.free_bytes)
        )

    # --- the restart history -----------------------------------------------------------------

    def history_changed(self, action: vocabulary.HistoryChanged) -> None:
        """Some host's restart history changed: saved within PERSIST_INTERVAL_S."""
        self._history_dirty.set()

    def load_state(self) -> tuple[dict[str, health.History], vocabulary.SavedSeats | None]:
        """The restart history and the seats a previous daemon left (in a thread)."""
        config = self._shell.config
        run = layout.layout_of(config)
        return runfiles.load_state(run.state_file, root=run.root, policy=config.health)

    async def persist_loop(self) -> None:
        """Asleep until history changes (no wake-ups in a quiet fleet), then at most one
        write per PERSIST_INTERVAL_S however many hosts change meanwhile."""
        while True:
            await self._history_dirty.wait()
            await asyncio.sleep(PERSIST_INTERVAL_S)
            self._history_dirty.clear()
            try:
                saved = await asyncio.to_thread(
                    self._write_history, self._history_file(), self._shell.epoch
                )
            except OSError as exc:
                self._history_dirty.set()
                self._shell.lead(leadership.CheckAsked())  # an I/O error: still ours?
                log.error("history.not_saved", reason=str(exc))
            else:
                if not saved:
                    self._shell.lead(leadership.CheckAsked())  # another epoch on disk

    async def save_history(self) -> None:
        """The last save, as the daemon stops: within SHUTDOWN_IO_TIMEOUT_S, never raises."""
        try:
            async with asyncio.timeout(SHUTDOWN_IO_TIMEOUT_S):
                await asyncio.to_thread(
                    self._write_history, self._history_file(), self._shell.epoch
                )
        except OSError as exc:
            log.error("history.not_saved", reason=str(exc))
        except TimeoutError:
            log.error(
                "history.not_saved",
                reason=f"the run root did not answer within {SHUTDOWN_IO_TIMEOUT_S:g}s",
            )

    async def record_stop(self, hosts: Mapping[str, tuple[str, int | None]]) -> None:
        """Say in ``ctl/`` that this leadership's stop ran to its end, with each host's last
        state (what offline ``status`` tells a clean stop by): within SHUTDOWN_IO_TIMEOUT_S,
        never raises, and not when another leadership's epoch is on disk."""
        record = runfiles.StopRecord(
            stopped_at=time.time(),
            epoch=self._shell.epoch,
            by=identity(),
            hosts=dict(hosts),
        )
        try:
            async with asyncio.timeout(SHUTDOWN_IO_TIMEOUT_S):
                await asyncio.to_thread(self._write_stop_record, record)
        except OSError as exc:
            log.error("daemon.stop_not_recorded", reason=str(exc))
        except TimeoutError:
            log.error(
                "daemon.stop_not_recorded",
                reason=f"the run root did not answer within {SHUTDOWN_IO_TIMEOUT_S:g}s",
            )

    def _write_stop_record(self, record: runfiles.StopRecord) -> None:
        run = layout.layout_of(self._shell.config)
        why = leadership.not_ours(record.epoch, runfiles.read_epoch(run.epoch_file, root=run.root))
        if why is not None:
            log.error("daemon.stop_not_recorded", reason=f"{why}: another supervisor leads")
            return
        runfiles.write_atomic(run.stop_record, runfiles.stop_record_json(record), root=run.root)

    def _history_file(self) -> bytes:
        """Every host's restart history as the state file's bytes (``HistoryEncoder``)."""
        wall = time.time()
        return self._history_encoder.encode(
            self._histories(),
            wall_minus_mono=wall - asyncio.get_running_loop().time(),
            saved_at=wall,
            hostname=socket.gethostname(),
            version=layout.STATE_VERSION,
            seats=self._seats(),
        )

    def _write_history(self, data: bytes, epoch: int) -> bool:
        """Save the restart history, unless another leadership's epoch is on disk (then it
        owns the file: False). In a thread."""
        run = layout.layout_of(self._shell.config)
        why = leadership.not_ours(epoch, runfiles.read_epoch(run.epoch_file, root=run.root))
        if why is not None:
            log.error("history.not_saved", reason=f"{why}: another supervisor leads")
            return False
        runfiles.write_atomic(run.state_file, data, root=run.root)
        return True


def events_of(observations: Iterable[Observation]) -> list[vocabulary.Event]:
    """The events that observations stand for, each about its host."""
    out: list[vocabulary.Event] = []
    for obs in observations:
        event = event_of(obs)
        if event is not None:
            out.append(vocabulary.HostObserved(obs.host, event))
    return out


def event_of(obs: Observation) -> health.Event | None:
    """The state-machine event an observation stands for (None: nothing to tell)."""
    match obs:
        case StatusObserved(record=record):
            if isinstance(record, StatusProblem):
                return health.StatusMissing(reason=record.reason)
            return health.HeartbeatSeen(
                pid=record.pid,
                ready=record.ready,
                remote_heartbeat_at=record.heartbeat_at,
                remote_seq=record.seq,
                processed=record.processed,
                in_flight=record.in_flight,
                stats=record.stats,
            )
        case ExitObserved(record=ExitRecord() as r):
            return health.WorkerExited(
                pid=r.pid,
                exit_code=r.exit_code,
                signal=r.signal,
                log_tail=r.log_tail,
                reaped=r.reaped,
            )
        case ExitObserved():
            return None  # the record went away: nothing died
        case SentinelObserved(present=present):
            return health.StopSentinelAppeared() if present else health.StopSentinelRemoved()
        case _:
            assert_never(obs)


def identity() -> str:
    """How this daemon names itself in the run lock (``runfiles.lock_run`` writes it)."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def _lock_unknown(why: str) -> leadership.LockChecked:
    """A check that could not be made: the lock is not known to be ours."""
    return leadership.LockChecked(held=False, epoch_on_disk=None, reason=why)
