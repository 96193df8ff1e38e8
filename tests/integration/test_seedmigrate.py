"""disarm-seed's local steps: whose stop file is whose (read like any hostile file), and
the old watch loop asked to exit through its own stop file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor import seedmigrate
from supervisor.layout import RunLayout


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        (b"stop\n", "seed"),
        (b"stop", "other"),  # not what `echo stop >` writes
        (b"", "other"),
        (b"stopped by reward-supervisor stop-host at 2026-01-01T00:00:00Z\n", "other"),
        (b"stop\n" * 1000, "other"),
    ],
)
def test_only_the_old_stops_exact_text_counts_as_its_stop_file(
    tmp_path: Path, content: bytes, kind: str
) -> None:
    """The old stop writes exactly "stop\\n"; anything else is someone else's."""
    path = tmp_path / "h.stop"
    path.write_bytes(content)
    assert seedmigrate.sentinel_kind(path)[0] == kind


def test_hostile_stop_files_are_kept_and_never_followed_or_blocked_on(tmp_path: Path) -> None:
    """A symlink (even to the seed's text), a FIFO and a directory are "other"; a missing
    file is "none"; none of them hangs the read."""
    target = tmp_path / "target"
    target.write_bytes(b"stop\n")
    link = tmp_path / "link.stop"
    link.symlink_to(target)
    fifo = tmp_path / "fifo.stop"
    os.mkfifo(fifo)
    directory = tmp_path / "dir.stop"
    directory.mkdir()
    assert seedmigrate.sentinel_kind(link)[0] == "other"
    assert seedmigrate.sentinel_kind(fifo) == ("other", "unreadable: not a regular file")
    assert seedmigrate.sentinel_kind(directory)[0] == "other"
    assert seedmigrate.sentinel_kind(tmp_path / "missing.stop") == ("none", "")


def test_clearing_removes_only_the_seeds_stop_file(tmp_path: Path) -> None:
    """The seed's file is removed (or, in a dry run, reported); another is kept."""
    run = RunLayout(tmp_path)
    (tmp_path / "ctl").mkdir()
    run.stop_sentinel("a").write_bytes(b"stop\n")
    run.stop_sentinel("b").write_bytes(b"maintenance\n")
    dry = seedmigrate.HostOutcome(name="a")
    seedmigrate.clear_seed_sentinel(run, dry, dry_run=True)
    assert dry.sentinel == "would_clear" and run.stop_sentinel("a").exists()
    outcomes = [seedmigrate.HostOutcome(name=n) for n in ("a", "b", "c")]
    for outcome in outcomes:
        seedmigrate.clear_seed_sentinel(run, outcome, dry_run=False)
    assert [o.sentinel for o in outcomes] == ["cleared", "kept", "none"]
    assert not run.stop_sentinel("a").exists() and run.stop_sentinel("b").exists()
    assert "maintenance" in outcomes[1].sentinel_detail


# The old watch's loop, reduced to what disarm-seed relies on: its pidfile, its stop file
# checked every round, and the pidfile removed on the way out.
WATCH = """
import os, sys, time
ctl = sys.argv[1]
stop = os.path.join(ctl, "watch.stop")
open(os.path.join(ctl, "watch.pid"), "w").write(str(os.getpid()))
while not os.path.exists(stop):
    time.sleep(0.1)  # wait-ok: the old watch's own round, as the seed script sleeps
os.unlink(os.path.join(ctl, "watch.pid"))
"""


def test_the_old_watch_is_asked_to_exit_through_its_own_stop_file(tmp_path: Path) -> None:
    """With a watch running, ctl/watch.stop is written and disarm waits for its pidfile to
    go; with none, nothing is written."""
    run = RunLayout(tmp_path)
    run.ctl.mkdir()
    assert seedmigrate.stop_watch(run, timeout_s=1, dry_run=False).outcome == "none"
    assert not (run.ctl / "watch.stop").exists()
    watch = subprocess.Popen([sys.executable, "-c", WATCH, str(run.ctl)])
    try:
        pidfile = run.ctl / "watch.pid"
        # The watch creates its pidfile, then writes its pid: wait for the pid, not the file.
        while watch.poll() is None and not (pidfile.exists() and pidfile.read_text().strip()):
            time.sleep(0.02)  # wait-ok: polling for a file another process writes
        dry = seedmigrate.stop_watch(run, timeout_s=1, dry_run=True)
        assert dry.outcome == "would_stop" and watch.poll() is None
        outcome = seedmigrate.stop_watch(run, timeout_s=60, dry_run=False)
        assert (outcome.outcome, outcome.pid) == ("stopped", watch.pid)
        assert watch.wait(30) == 0
    finally:
        watch.kill()
        watch.wait()


def test_a_watch_pidfile_nobody_removes_is_reported_not_ignored(tmp_path: Path) -> None:
    """A stale or remote watch (its pidfile stays): still_running after the timeout, with
    what to do, so the hosts are not touched while it may still restart one."""
    run = RunLayout(tmp_path)
    run.ctl.mkdir()
    (run.ctl / "watch.pid").write_text("999999999\n")
    outcome = seedmigrate.stop_watch(run, timeout_s=0.3, dry_run=False)
    assert outcome.outcome == "still_running" and not outcome.ok
    assert "delete ctl/watch.pid" in outcome.detail
    assert "not a process on this node" in outcome.detail


@pytest.mark.parametrize("plant", ["symlink", "hard link"])
def test_a_planted_watch_stop_is_not_written_through(tmp_path: Path, plant: str) -> None:
    """ctl/watch.stop left as a symlink or a hard link to a file: nothing is written through
    it (a new file replaces the name), and a watch that does not exit is reported as not
    stopped (the hosts are then left alone)."""
    run = RunLayout(tmp_path)
    run.ctl.mkdir()
    (run.ctl / "watch.pid").write_text("999999999\n")
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    if plant == "symlink":
        (run.ctl / "watch.stop").symlink_to(target)
    else:
        os.link(target, run.ctl / "watch.stop")
    outcome = seedmigrate.stop_watch(run, timeout_s=5, dry_run=False)
    assert outcome.outcome == "still_running"
    assert "did not exit" in outcome.detail
    assert target.read_text() == "keep me\n"
    assert not (run.ctl / "watch.stop").is_symlink()
    assert (run.ctl / "watch.stop").stat().st_nlink == 1
