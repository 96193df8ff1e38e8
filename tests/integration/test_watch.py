"""The status watcher on real files: real inotify, real polling, real mounts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import Literal

import pytest
from structlog.testing import capture_logs

from supervisor import runfiles, watch
from supervisor.mounts import filesystem_type
from supervisor.statusfiles import (
    ExitObserved,
    ExitRecord,
    Observation,
    SentinelObserved,
    StatusObserved,
    StatusProblem,
    StatusRecord,
)
from supervisor.watch import FILE_THREAD_NAME, Watcher
from tests.conftest import mounted

Mode = Literal["inotify", "poll"]
#: Generous: the machines are shared and noisy; a pass takes well under a second.
WAIT_S = 20.0
POLL_INTERVAL_S = 0.1


def write_json_atomic(path: Path, data: object) -> None:
    """Replace ``path`` with ``data`` as JSON, whole, as a worker writes its status."""
    runfiles.write_json_atomic(path, data, root=None)


class Seen:
    """Collects what the watcher delivers; lets a test wait for a matching observation."""

    def __init__(self) -> None:
        """Nothing seen yet."""
        self.batches: list[list[Observation]] = []
        self._changed = asyncio.Event()

    def sink(self, batch: list[Observation]) -> None:
        """The watcher's sink: keep the batch, wake waiters."""
        self.batches.append(list(batch))
        self._changed.set()

    @property
    def all(self) -> list[Observation]:
        """Every observation so far, in delivery order."""
        return [o for batch in self.batches for o in batch]

    def mark(self) -> int:
        """A position: wait_for(after=mark) only looks at later observations."""
        return len(self.all)

    async def wait_for(self, wanted: Observation, *, after: int = 0) -> int:
        """Wait until ``wanted`` is delivered after position ``after``; its position."""
        async with asyncio.timeout(WAIT_S):
            while True:
                seen = self.all
                for i in range(after, len(seen)):
                    if seen[i] == wanted:
                        return i
                self._changed.clear()
                await self._changed.wait()


async def until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds (polled: it reads state the loop updates)."""
    async with asyncio.timeout(WAIT_S):
        # The watcher exposes state (watching, counters), not events: poll it.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # wait-ok: polling interval of a condition loop


def at_least(count: Callable[[], int], n: int) -> Callable[[], bool]:
    """A condition: ``count()`` has reached ``n``."""
    return lambda: count() >= n


@pytest.fixture(params=["inotify", "poll"])
def mode(request: pytest.FixtureRequest) -> Mode:
    """Every behaviour holds with inotify and with polling."""
    value: Mode = request.param
    return value


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A run directory with status/, ctl/, inbox/0 and outbox/."""
    run = tmp_path / "run"
    for sub in ("status", "ctl", "inbox/0", "outbox"):
        (run / sub).mkdir(parents=True)
    return run


def beat(root: Path, host: str, seq: int, *, pid: int = 4242, ready: bool = True) -> StatusRecord:
    """Write a heartbeat the way workers do (temp file + rename); the record it should give."""
    write_json_atomic(
        root / "status" / f"{host}.json",
        {"pid": pid, "ready": ready, "heartbeat_at": 1000.0 + seq, "seq": seq},
    )
    return StatusRecord(pid=pid, ready=ready, heartbeat_at=1000.0 + seq, seq=seq)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` at once (a dot-named temp file, then a rename), so no
    reader ever sees it truncated and not yet written."""
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


def write_json_in_place(path: Path, data: object) -> None:
    """Truncate ``path`` and write ``data`` into it: the inode stays, unlike an atomic write."""
    with path.open("r+") as f:
        f.truncate()
        f.write(json.dumps(data))


@contextlib.asynccontextmanager
async def watching(
    run: Path,
    hosts: Collection[str],
    mode: Mode,
    *,
    rescan_interval_s: float = 3600.0,
    initial: bool = True,
    watcher: Watcher | None = None,
) -> AsyncIterator[tuple[Watcher, Seen]]:
    """Run a watcher until the block ends; by default wait until it watches and has reported
    every host once."""
    if watcher is None:
        watcher = Watcher(
            run,
            hosts,
            mode=mode,
            poll_interval_s=POLL_INTERVAL_S,
            debounce_ms=20,
            rescan_interval_s=rescan_interval_s,
        )
    seen = Seen()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(watcher.run(seen.sink))
        await until(lambda: watcher.watching)
        if initial:
            await until(
                lambda: {o.host for o in seen.all if isinstance(o, StatusObserved)} >= set(hosts)
            )
        yield watcher, seen
        task.cancel()


async def test_atomic_rewrite_is_observed(root: Path, mode: Mode) -> None:
    """A heartbeat rewritten by temp file and rename is reported with its fields."""
    async with watching(root, ["h1"], mode) as (watcher, seen):
        assert watcher.mode == mode
        mark = seen.mark()
        record = beat(root, "h1", 1)
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        record = beat(root, "h1", 2)
        await seen.wait_for(StatusObserved("h1", record), after=mark)


async def test_the_file_reader_thread_is_named_for_top(root: Path, mode: Mode) -> None:
    """Operators (``top -H``) and the benchmark's CPU split find the reader by its name."""

    def names() -> set[str]:
        """The names of this process's threads."""
        found = set()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                found.add(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        return found

    async with watching(root, ["h1"], mode):
        assert FILE_THREAD_NAME in names()


async def test_rewrites_in_quick_succession_are_each_seen(root: Path, mode: Mode) -> None:
    """Heartbeats rewritten within the same second are all reported, polling included."""
    async with watching(root, ["h1"], mode) as (_, seen):
        mark = seen.mark()
        for seq in range(1, 6):
            record = beat(root, "h1", seq)
            mark = await seen.wait_for(StatusObserved("h1", record), after=mark)


async def test_a_run_root_created_after_start_is_watched(tmp_path: Path, mode: Mode) -> None:
    """Started before the run root exists, the watcher reports "missing", stays healthy, and
    watches the root once it appears."""
    run = tmp_path / "later"
    watcher = Watcher(
        run,
        ["h1"],
        mode=mode,
        poll_interval_s=POLL_INTERVAL_S,
        debounce_ms=20,
        rescan_interval_s=3600,
    )
    seen = Seen()
    clock = asyncio.get_running_loop().time
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(watcher.run(seen.sink))
        await seen.wait_for(StatusObserved("h1", StatusProblem("missing")))
        start = clock()
        await until(lambda: watcher.healthy(start + 5.5))  # ticking while it waits
        assert not watcher.watching
        (run / "status").mkdir(parents=True)
        (run / "ctl").mkdir()
        await until(lambda: watcher.watching)
        record = beat(run, "h1", 1)
        await seen.wait_for(StatusObserved("h1", record))
        (run / "ctl" / "h1.stop").touch()
        await seen.wait_for(SentinelObserved("h1", True))
        task.cancel()


async def test_broken_status_files_are_problems_and_watching_goes_on(
    root: Path, mode: Mode
) -> None:
    """Partial, empty, binary and huge status files are problems; a later beat still counts."""
    path = root / "status" / "h1.json"
    async with watching(root, ["h1"], mode) as (watcher, seen):
        errors_before = watcher.parse_errors
        mark = seen.mark()
        with path.open("wb") as f:  # a writer that is not atomic, caught mid-write
            f.write(b'{"pid": 7, "ready": tr')
            f.flush()
            await seen.wait_for(StatusObserved("h1", StatusProblem("not JSON")), after=mark)
            f.truncate(0)
            f.flush()
            await seen.wait_for(StatusObserved("h1", StatusProblem("empty")), after=mark)
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
        await seen.wait_for(StatusObserved("h1", StatusProblem("not UTF-8")), after=mark)
        path.write_bytes(b"{" + b" " * (10 * 1024 * 1024) + b"}")
        await seen.wait_for(StatusObserved("h1", StatusProblem("too big")), after=mark)
        record = beat(root, "h1", 5)
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        assert watcher.parse_errors - errors_before >= 4


async def test_a_missing_status_file_is_no_parse_error_but_one_that_exists_and_is_none_is(
    root: Path, mode: Mode
) -> None:
    """A host with no status file yet (no worker launched), or whose file was removed, adds
    nothing to parse_errors however often it is read; a file there that is no heartbeat
    adds one per read."""
    watcher = Watcher(
        root,
        ["h1", "h2"],
        mode=mode,
        poll_interval_s=POLL_INTERVAL_S,
        debounce_ms=20,
        rescan_interval_s=3600,
    )
    async with watching(root, [], mode, watcher=watcher, initial=False):
        await watcher.scan_all()  # a fresh fleet: neither host has written a heartbeat
        await watcher.scan(["h1", "h2"])
        assert watcher.parse_errors == 0
        beat(root, "h1", 1)
        write_bytes_atomic(root / "status" / "h2.json", b"{")
        await watcher.scan(["h1", "h2"])
        assert watcher.parse_errors == 1
        (root / "status" / "h1.json").unlink()
        (root / "status" / "h2.json").unlink()
        await watcher.scan(["h1", "h2"])
        assert watcher.parse_errors == 1


async def test_deleted_status_file_is_reported_missing(root: Path, mode: Mode) -> None:
    """Removing a heartbeat file reports StatusProblem("missing")."""
    beat(root, "h1", 1)
    async with watching(root, ["h1"], mode) as (_, seen):
        mark = seen.mark()
        (root / "status" / "h1.json").unlink()
        await seen.wait_for(StatusObserved("h1", StatusProblem("missing")), after=mark)


async def test_status_directory_removed_and_recreated_is_still_watched(
    root: Path, mode: Mode
) -> None:
    """After status/ is deleted and made again, new heartbeats in it are still reported."""
    beat(root, "h1", 1)
    async with watching(root, ["h1"], mode) as (_, seen):
        mark = seen.mark()
        shutil.rmtree(root / "status")
        await seen.wait_for(StatusObserved("h1", StatusProblem("missing")), after=mark)
        (root / "status").mkdir()
        record = beat(root, "h1", 2)
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        record = beat(root, "h1", 3)
        await seen.wait_for(StatusObserved("h1", record), after=mark)


async def test_run_root_removed_and_recreated_is_watched_again(root: Path, mode: Mode) -> None:
    """A vanished run root is retried without crashing, staying healthy; it is watched once back."""
    beat(root, "h1", 1)
    async with watching(root, ["h1"], mode) as (watcher, seen):
        mark = seen.mark()
        shutil.rmtree(root)
        await seen.wait_for(StatusObserved("h1", StatusProblem("missing")), after=mark)
        await until(lambda: not watcher.watching)
        assert watcher.healthy(asyncio.get_running_loop().time())
        (root / "status").mkdir(parents=True)
        (root / "ctl").mkdir()
        await until(lambda: watcher.watching)
        record = beat(root, "h1", 2)
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        (root / "ctl" / "h1.stop").touch()
        await seen.wait_for(SentinelObserved("h1", True), after=mark)


async def test_a_run_root_moved_away_says_nothing_about_stop_sentinels(
    root: Path, mode: Mode
) -> None:
    """With ctl/ gone (as on a lost mount) a stop sentinel is not reported removed."""
    (root / "ctl" / "h1.stop").touch()
    beat(root, "h1", 1)
    away = root.with_name("run.away")
    async with watching(root, ["h1"], mode) as (watcher, seen):
        assert SentinelObserved("h1", True) in seen.all
        mark = seen.mark()
        os.rename(root, away)
        await seen.wait_for(StatusObserved("h1", StatusProblem("missing")), after=mark)
        assert SentinelObserved("h1", False) not in seen.all[mark:]
        os.rename(away, root)
        await until(lambda: watcher.watching)
        record = beat(root, "h1", 2)
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        assert SentinelObserved("h1", False) not in seen.all[mark:]


async def test_exit_record_is_observed_and_its_removal_too(root: Path, mode: Mode) -> None:
    """The shepherd's exit record is reported, and None once it is removed."""
    path = root / "ctl" / "h1.exit.json"
    async with watching(root, ["h1"], mode) as (_, seen):
        assert ExitObserved("h1", None) in seen.all
        mark = seen.mark()
        write_json_atomic(
            path, {"pid": 42, "exit_code": None, "signal": 9, "exited_at": 5.5, "start_time": 1}
        )
        record = ExitRecord(pid=42, exit_code=None, signal=9, exited_at=5.5)
        await seen.wait_for(ExitObserved("h1", record), after=mark)
        path.unlink()
        await seen.wait_for(ExitObserved("h1", None), after=mark)


async def test_stop_sentinel_creation_and_removal_are_observed(root: Path, mode: Mode) -> None:
    """ctl/<host>.stop appearing and disappearing reports present True, then False."""
    sentinel = root / "ctl" / "h1.stop"
    async with watching(root, ["h1"], mode) as (_, seen):
        assert SentinelObserved("h1", False) in seen.all
        mark = seen.mark()
        sentinel.touch()
        mark = await seen.wait_for(SentinelObserved("h1", True), after=mark)
        sentinel.unlink()
        await seen.wait_for(SentinelObserved("h1", False), after=mark)


async def test_files_of_unknown_hosts_are_ignored(root: Path, mode: Mode) -> None:
    """Status, exit and stop files of hosts not configured produce no observation."""
    async with watching(root, ["h1"], mode) as (_, seen):
        mark = seen.mark()
        beat(root, "stranger", 1)
        write_json_atomic(root / "ctl" / "stranger.exit.json", {"pid": 3, "exit_code": 0})
        (root / "ctl" / "stranger.stop").touch()
        record = beat(root, "h1", 1)  # written last: reported with or after the others
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        assert {o.host for o in seen.all} == {"h1"}


async def test_task_churn_in_inbox_and_outbox_produces_no_observations(
    root: Path, mode: Mode
) -> None:
    """Hundreds of task files written, renamed and removed under inbox/ and outbox/ are unseen."""
    async with watching(root, ["h1"], mode) as (_, seen):
        mark = seen.mark()
        for i in range(300):
            task = root / "inbox" / "0" / f"task-{i}.json"
            write_json_atomic(task, {"id": str(i), "answer": "4", "reference": "4"})
            if i % 2:
                task.rename(root / "outbox" / task.name)
            if i % 3 == 0:
                (root / "outbox" / f"task-{i}.json").unlink(missing_ok=True)
        record = beat(root, "h1", 1)
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        assert seen.all[mark:] == [StatusObserved("h1", record)]


async def test_hosts_added_by_a_reload_are_reported_and_removed_ones_forgotten(
    root: Path, mode: Mode
) -> None:
    """A host added by set_hosts() is read without any file change; a removed one stops
    reporting."""
    h2 = beat(root, "h2", 1)
    async with watching(root, ["h1"], mode) as (watcher, seen):
        mark = seen.mark()
        watcher.set_hosts(["h1", "h2"])
        await seen.wait_for(StatusObserved("h2", h2), after=mark)
        watcher.set_hosts(["h1"])
        mark = seen.mark()
        beat(root, "h2", 2)
        record = beat(root, "h1", 1)
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        assert all(o.host == "h1" for o in seen.all[mark:])
        h2 = beat(root, "h2", 3)
        watcher.set_hosts(["h1", "h2"])  # back again: its current files are reported afresh
        await seen.wait_for(StatusObserved("h2", h2), after=mark)
        await seen.wait_for(SentinelObserved("h2", False), after=mark)


async def test_rescan_catches_a_change_inotify_never_reports(tmp_path: Path, root: Path) -> None:
    """A write through a hard link outside status/ fires no event there; the rescan reads it."""
    first = beat(root, "h1", 1)
    side = tmp_path / "side"
    side.mkdir()
    os.link(root / "status" / "h1.json", side / "h1.json")
    async with watching(root, ["h1"], "inotify", rescan_interval_s=0.3) as (watcher, seen):
        assert StatusObserved("h1", first) in seen.all
        mark = seen.mark()
        changes_before = watcher.changes_seen
        with (side / "h1.json").open("r+b") as f:
            f.truncate(0)
            f.write(b'{"pid": 4242, "ready": false, "heartbeat_at": 1002.0, "seq": 2}')
        record = StatusRecord(pid=4242, ready=False, heartbeat_at=1002.0, seq=2)
        await seen.wait_for(StatusObserved("h1", record), after=mark)
        assert watcher.changes_seen == changes_before, "no watch event reported this write"


async def test_broken_file_is_logged_once_per_reason_and_counted_per_read(
    root: Path, mode: Mode
) -> None:
    """A host rewriting garbage logs one status.problem per reason, while every read is counted."""
    path = root / "status" / "h1.json"
    beat(root, "h1", 1)
    with capture_logs() as captured:
        async with watching(root, ["h1"], mode) as (watcher, seen):
            mark = seen.mark()
            before = watcher.parse_errors
            for i in range(1, 4):
                # Atomic: a poll between a truncate and its write would see "empty".
                write_bytes_atomic(path, b"garbage " * i)
                await until(at_least(lambda: watcher.parse_errors, before + i))
            write_bytes_atomic(path, b"")
            await seen.wait_for(StatusObserved("h1", StatusProblem("empty")), after=mark)
            record = beat(root, "h1", 2)
            await seen.wait_for(StatusObserved("h1", record), after=mark)
    problems = [
        (e["reason"], e["log_level"])
        for e in captured
        if e["event"] == "status.problem" and e["host"] == "h1"
    ]
    assert problems == [("not JSON", "warning"), ("empty", "warning")]
    assert [e["event"] for e in captured if e["event"] == "status.recovered"] == [
        "status.recovered"
    ]


async def test_a_status_file_missing_from_the_start_is_not_logged_but_a_vanished_one_is(
    root: Path, mode: Mode
) -> None:
    """No worker launched yet is normal (silent); a heartbeat file that disappears is logged."""
    beat(root, "h1", 1)
    with capture_logs() as captured:
        async with watching(root, ["h1", "h2"], mode) as (_, seen):
            mark = seen.mark()
            record = beat(root, "h2", 1)  # h2's first heartbeat: no "recovered" either
            await seen.wait_for(StatusObserved("h2", record), after=mark)
            (root / "status" / "h1.json").unlink()
            await seen.wait_for(StatusObserved("h1", StatusProblem("missing")), after=mark)
    status_events = [
        (e["event"], e["host"], e["log_level"])
        for e in captured
        if e["event"].startswith("status.")
    ]
    assert status_events == [("status.problem", "h1", "info")]


async def test_healthy_only_while_running(root: Path, mode: Mode) -> None:
    """healthy() is false before run(), kept true by an idle loop, false after cancellation."""
    watcher = Watcher(
        root,
        ["h1"],
        mode=mode,
        poll_interval_s=POLL_INTERVAL_S,
        debounce_ms=20,
        rescan_interval_s=3600,
    )
    clock = asyncio.get_running_loop().time
    assert not watcher.healthy(clock())
    async with watching(root, ["h1"], mode, watcher=watcher):
        start = clock()
        assert watcher.healthy(start)
        # True 5.5 s on only if the loop ticked again at least 0.5 s after `start`, with
        # nothing changing on disk.
        await until(lambda: watcher.healthy(start + 5.5))
        assert not watcher.healthy(clock() + 60)
    assert not watcher.healthy(clock())


async def test_scan_all_reports_every_host_file_now(root: Path) -> None:
    """scan_all() returns each host's status, exit record and sentinel, read at once."""
    h1 = beat(root, "h1", 1)
    write_json_atomic(root / "ctl" / "h2.exit.json", {"pid": 8, "exit_code": 3})
    (root / "ctl" / "h3.stop").touch()
    (root / "status" / "h3.json").write_bytes(b"{")
    watcher = Watcher(
        root,
        ["h1", "h2", "h3"],
        mode="auto",
        poll_interval_s=1,
        debounce_ms=50,
        rescan_interval_s=30,
    )
    assert await watcher.scan_all() == [
        StatusObserved("h1", h1),
        ExitObserved("h1", None),
        SentinelObserved("h1", False),
        StatusObserved("h2", StatusProblem("missing")),
        ExitObserved("h2", ExitRecord(pid=8, exit_code=3, signal=None, exited_at=None)),
        SentinelObserved("h2", False),
        StatusObserved("h3", StatusProblem("not JSON")),
        ExitObserved("h3", None),
        SentinelObserved("h3", True),
    ]


async def test_run_after_scan_all_reports_only_changes(root: Path, mode: Mode) -> None:
    """What scan_all() returned is not delivered again by run(); only later changes are."""
    beat(root, "h1", 1)
    watcher = Watcher(
        root,
        ["h1", "h2"],
        mode=mode,
        poll_interval_s=POLL_INTERVAL_S,
        debounce_ms=20,
        rescan_interval_s=0.2,  # rescans re-read everything; unchanged files stay quiet
    )
    write_bytes_atomic(root / "status" / "h2.json", b"{")
    assert len(await watcher.scan_all()) == 6
    async with watching(root, [], mode, watcher=watcher, initial=False) as (_, seen):
        # h2's status file is no heartbeat: each rescan counts one more parse error. Let
        # two go by.
        await until(at_least(lambda: watcher.parse_errors, 3))
        record = beat(root, "h2", 1)
        await seen.wait_for(StatusObserved("h2", record))
        assert seen.all == [StatusObserved("h2", record)]


async def test_hosts_scanned_then_added_are_reported_only_when_they_change(
    root: Path, mode: Mode
) -> None:
    """scan(hosts) returns those hosts' files now; added by set_hosts() afterwards, they are
    not reported again by run(), only their later changes (as the daemon joins a host)."""
    first = beat(root, "h1", 1)
    watcher = Watcher(
        root,
        (),
        mode=mode,
        poll_interval_s=POLL_INTERVAL_S,
        debounce_ms=20,
        rescan_interval_s=3600,
    )
    assert await watcher.scan(["h1"]) == [
        StatusObserved("h1", first),
        ExitObserved("h1", None),
        SentinelObserved("h1", False),
    ]
    watcher.set_hosts(["h1"])
    async with watching(root, [], mode, watcher=watcher, initial=False) as (_, seen):
        record = beat(root, "h1", 2)
        await seen.wait_for(StatusObserved("h1", record))
        # The batch that reads a newly added host's files comes first: had the scan not
        # seeded the watcher's memory, the unchanged exit record and sentinel came too.
        assert seen.all == [StatusObserved("h1", record)]


async def test_poll_mode_watches_a_real_tmpfs_mount(tmp_path: Path) -> None:
    """On a tmpfs mounted for the test (path with a space) the type is read and polling works."""
    with mounted(tmp_path / "mnt point", ["mount", "-t", "tmpfs", "tmpfs"]) as mnt:
        assert filesystem_type(mnt / "run") == "tmpfs"
        run = mnt / "run"
        (run / "status").mkdir(parents=True)
        (run / "ctl").mkdir()
        async with watching(run, ["h1"], "poll") as (watcher, seen):
            assert watcher.mode == "poll"
            mark = seen.mark()
            record = beat(run, "h1", 1)
            await seen.wait_for(StatusObserved("h1", record), after=mark)


async def test_auto_mode_polls_a_fuse_mount_and_sees_writes_made_behind_it(
    tmp_path: Path,
) -> None:
    """On a FUSE mount auto picks polling, which sees writes made to the backing directory.

    Those writes bypass the mount, as another NFS client's do: inotify never reports them.
    """
    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed (apt-get install bindfs): FUSE mount test not run")
    backing = tmp_path / "backing"
    (backing / "status").mkdir(parents=True)
    (backing / "ctl").mkdir()
    with mounted(tmp_path / "fuse", ["bindfs", "--no-allow-other", str(backing)]) as run:
        watcher = Watcher(
            run,
            ["h1"],
            mode="auto",
            poll_interval_s=POLL_INTERVAL_S,
            debounce_ms=20,
            rescan_interval_s=3600,
        )
        # Not looked yet: the look at the mount happens in the file thread, at the first read.
        assert (watcher.fstype, watcher.mode) == ("", None)
        async with watching(run, ["h1"], "poll", watcher=watcher) as (_, seen):
            assert (watcher.fstype, watcher.mode) == ("fuse", "poll")
            mark = seen.mark()
            record = beat(backing, "h1", 1)
            await seen.wait_for(StatusObserved("h1", record), after=mark)
            (backing / "ctl" / "h1.stop").touch()
            await seen.wait_for(SentinelObserved("h1", True), after=mark)


async def test_a_poll_in_chunks_sees_every_change_and_forgets_removed_hosts(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep stat'ed and read chunk by chunk (4 paths here, hosts split across chunks)
    still reports every host's change, and the last chunk forgets hosts no longer watched."""
    monkeypatch.setattr(watch, "_POLL_CHUNK_KEYS", 4)
    hosts = {f"h{i}" for i in range(10)}
    async with watching(root, hosts, "poll") as (watcher, seen):
        mark = seen.mark()
        records = {host: beat(root, host, 2) for host in sorted(hosts)}
        for host, record in records.items():
            await seen.wait_for(StatusObserved(host, record), after=mark)
        hosts.discard("h3")
        watcher.set_hosts(hosts)
        # Two changes seen one after the other: a whole sweep began after the removal.
        for seq in (3, 4):
            await seen.wait_for(StatusObserved("h0", beat(root, "h0", seq)), after=mark)
        # h0 is in the sweep's first chunk; the last one forgets h3, maybe a moment later.
        # The poll's memory belongs to the file thread: ask it there.
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while True:
            polled = await watcher._files.call(lambda disk: {host for host, _ in disk.signatures})
            if polled == hosts or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.02)  # wait-ok: polling interval of a deadline loop
        assert polled == hosts


async def test_a_poll_delivers_exits_and_news_before_routine_heartbeats(root: Path) -> None:
    """When one poll finds every heartbeat rewritten, the exit record and the new worker's
    first heartbeat (sorted last) are delivered before the routine heartbeats, so news is
    not queued behind a whole fleet's worth of them."""
    hosts = [f"h{i:02d}" for i in range(30)]
    for host in hosts:
        beat(root, host, 1)
    watcher = Watcher(
        root,
        hosts,
        mode="poll",
        poll_interval_s=2.0,  # room to write everything between two polls, even when loaded
        debounce_ms=20,
        rescan_interval_s=3600,
    )
    async with watching(root, hosts, "poll", watcher=watcher) as (_, seen):
        # A poll delivers only changes: make one, and write the rest as soon as it is seen.
        await seen.wait_for(StatusObserved("h27", beat(root, "h27", 9)), after=seen.mark())
        mark = seen.mark()
        for host in hosts[:-2]:
            beat(root, host, 2)
        news = beat(root, "h28", 1, pid=777)
        write_json_atomic(
            root / "ctl" / "h29.exit.json",
            {"pid": 4242, "exit_code": 3, "signal": None, "exited_at": 5.5, "start_time": 1},
        )
        exited = ExitObserved("h29", ExitRecord(pid=4242, exit_code=3, signal=None, exited_at=5.5))
        first_routine = await seen.wait_for(StatusObserved("h00", beat(root, "h00", 2)), after=mark)
        exit_at = await seen.wait_for(exited, after=mark)
        news_at = await seen.wait_for(StatusObserved("h28", news), after=mark)
    assert exit_at < news_at < first_routine, (exit_at, news_at, first_routine)


async def test_a_poll_lists_directories_instead_of_stating_each_path(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Poll mode learns what changed from one listing of status/ and ctl/ per sweep: a path
    that is not there or that the listing settles (a stop sentinel) is never stat'ed, and
    renamed-in exit records, a sentinel's coming and going are all still reported."""
    stated: list[str] = []
    real_signature = watch._signature

    def recording_signature(path: str) -> watch._Signature:
        """The real stat signature, noting the path."""
        stated.append(path)
        return real_signature(path)

    monkeypatch.setattr(watch, "_signature", recording_signature)
    beat(root, "h1", 1)
    beat(root, "h2", 1)
    exit_path = root / "ctl" / "h1.exit.json"
    async with watching(root, ["h1", "h2"], "poll") as (_, seen):
        mark = seen.mark()
        for pid in (41, 42):  # a second record replaces the first (a new inode each time)
            write_json_atomic(exit_path, {"pid": pid, "exit_code": 1, "signal": None})
            record = ExitRecord(pid=pid, exit_code=1, signal=None, exited_at=None)
            mark = await seen.wait_for(ExitObserved("h1", record), after=mark)
        (root / "ctl" / "h2.stop").touch()
        mark = await seen.wait_for(SentinelObserved("h2", True), after=mark)
        (root / "ctl" / "h2.stop").unlink()
        await seen.wait_for(SentinelObserved("h2", False), after=mark)
    assert stated, "a file whose inode stayed is stat'ed"
    assert {Path(path).name for path in stated} <= {"h1.json", "h2.json", "h1.exit.json"}


async def test_an_exit_record_rewritten_in_place_is_seen(root: Path, mode: Mode) -> None:
    """An exit record rewritten in place (same inode) is seen, polling included: the inode
    number a listing gives is not trusted to change (nor, on some FUSE mounts, to be real)."""
    path = root / "ctl" / "h1.exit.json"
    write_json_atomic(path, {"pid": 40, "signal": 9})
    inode = path.stat().st_ino
    async with watching(root, ["h1"], mode) as (_, seen):
        mark = seen.mark()
        for pid in (41, 42):
            write_json_in_place(path, {"pid": pid, "signal": 9})
            record = ExitRecord(pid=pid, exit_code=None, signal=9, exited_at=None)
            mark = await seen.wait_for(ExitObserved("h1", record), after=mark)
    assert path.stat().st_ino == inode


async def test_a_status_file_rewritten_in_place_is_seen(root: Path, mode: Mode) -> None:
    """A worker that rewrites its heartbeat in place (same inode) is seen, polling included."""
    path = root / "status" / "h1.json"
    beat(root, "h1", 1)
    inode = path.stat().st_ino
    async with watching(root, ["h1"], mode) as (_, seen):
        mark = seen.mark()
        for seq in (2, 3):
            write_json_in_place(
                path, {"pid": 4242, "ready": True, "heartbeat_at": 1000.0 + seq, "seq": seq}
            )
            record = StatusRecord(pid=4242, ready=True, heartbeat_at=1000.0 + seq, seq=seq)
            mark = await seen.wait_for(StatusObserved("h1", record), after=mark)
    assert path.stat().st_ino == inode


async def test_a_poll_stats_each_path_when_a_directory_cannot_be_listed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If a directory cannot be listed (EACCES, EIO...), each path is stat'ed as before, and
    heartbeats and exit records are still seen."""
    real_scandir = os.scandir

    def refusing_scandir(path: str | int) -> object:
        """os.scandir, except for the run's status/ and ctl/ (by path or descriptor)."""
        name = os.readlink(f"/proc/self/fd/{path}") if isinstance(path, int) else str(path)
        if name.endswith(("/ctl", "/status")):
            raise PermissionError(13, "Permission denied", name)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refusing_scandir)
    async with watching(root, ["h1"], "poll") as (watcher, seen):
        mark = seen.mark()
        write_json_atomic(root / "ctl" / "h1.exit.json", {"pid": 7, "signal": 9})
        record = ExitRecord(pid=7, exit_code=None, signal=9, exited_at=None)
        await seen.wait_for(ExitObserved("h1", record), after=mark)
        await seen.wait_for(StatusObserved("h1", beat(root, "h1", 5)), after=mark)
        listings = await watcher._files.call(lambda disk: (disk.ctl_listing, disk.status_listing))
        assert listings == (None, None)


async def test_names_that_are_not_utf_8_never_stop_the_watch(root: Path, mode: Mode) -> None:
    """Whoever can write the run root can make a name of any bytes in status/ or ctl/. The
    inotify engine cannot even decode such a name (watchfiles raises): the watch is started
    again and re-reads everything, and every host's changes are still seen."""
    async with watching(root, ["h1"], mode) as (watcher, seen):
        task = next(
            t
            for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "") == "Watcher.run"
        )
        for seq, name in enumerate((b"status/\xff.json", b"ctl/\xfe.stop", b"ctl/h\xff.exit.json")):
            fd = os.open(os.fsencode(root) + b"/" + name, os.O_CREAT | os.O_WRONLY, 0o644)
            os.close(fd)
            mark = seen.mark()
            await seen.wait_for(StatusObserved("h1", beat(root, "h1", 10 + seq)), after=mark)
        assert not task.done()
        mark = seen.mark()
        write_json_atomic(root / "ctl" / "h1.exit.json", {"pid": 7})
        record = ExitRecord(pid=7, exit_code=None, signal=None, exited_at=None)
        await seen.wait_for(ExitObserved("h1", record), after=mark)
        assert not task.done() and watcher.watching


async def test_a_poll_reads_no_more_of_a_directory_than_its_hosts_need(root: Path) -> None:
    """Anyone who can write the run root can fill status/ with names: a poll lists at most a
    bounded number of entries (then stats each host's path instead), so neither its memory
    nor its time grows with what was planted, and heartbeats are still seen."""
    for i in range(5000):
        (root / "status" / f"planted-{i}.json").touch()
    async with watching(root, ["h1"], "poll") as (watcher, seen):
        mark = seen.mark()
        await seen.wait_for(StatusObserved("h1", beat(root, "h1", 5)), after=mark)
        listing = await watcher._files.call(lambda disk: disk.status_listing)
        assert listing is None or len(listing) <= 1024, len(listing)
