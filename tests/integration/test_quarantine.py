"""Quarantining the tasks a stuck worker hung on: the right files leave the inbox, each gets
the error result the trainer's client reads, and nothing planted in the run root is followed,
overwritten or trusted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor import tasks

NOW = 1_800_000_000.0


def run_root(tmp_path: Path) -> Path:
    """A run directory with shard 0's inbox, outbox, status and ctl."""
    root = tmp_path / "run"
    for d in ("inbox/0", "outbox", "status", "ctl"):
        (root / d).mkdir(parents=True)
    return root


def task(root: Path, task_id: str, age_s: float, shard: int = 0) -> Path:
    """A task file in the inbox as AReaL's client writes it, ``age_s`` old by its mtime."""
    path = root / "inbox" / str(shard) / f"{task_id}.json"
    record = {"schema_version": 1, "task_id": task_id, "reward_fn": "m.f", "args": [], "kwargs": {}}
    path.write_text(json.dumps(record))
    os.utime(path, (NOW - age_s, NOW - age_s))
    return path


def beat(root: Path, host: str = "w0") -> None:
    """The worker's status file, rewritten just now by the filesystem's clock."""
    path = root / "status" / f"{host}.json"
    path.write_text("{}")
    os.utime(path, (NOW, NOW))


def quarantine(root: Path, count: int, older_than_s: float = 10.0) -> tasks.Quarantined:
    """Quarantine shard 0's stuck tasks of host w0."""
    return tasks.quarantine_stuck(
        root, 0, "w0", count=count, older_than_s=older_than_s, reason="stuck", now_wall=NOW
    )


def test_the_oldest_in_flight_tasks_move_and_are_answered_with_an_error(tmp_path: Path) -> None:
    """Three tasks in flight of a stuck worker: the three oldest old enough leave the inbox
    for ctl/quarantine/0/ and get AReaL's error result; newer and younger ones stay."""
    root = run_root(tmp_path)
    beat(root)
    for i, age in enumerate((40, 35, 30, 25, 5)):
        task(root, f"t{i}", age)
    done = quarantine(root, 3)
    assert done.task_ids == ("t0", "t1", "t2") and done.unanswered == 0
    assert sorted(p.name for p in (root / "inbox/0").iterdir()) == ["t3.json", "t4.json"]
    assert sorted(p.name for p in (root / "ctl/quarantine/0").iterdir()) == [
        "t0.json",
        "t1.json",
        "t2.json",
    ]
    result = json.loads((root / "outbox/t1.json").read_text())
    assert (result["task_id"], result["status"], result["score"]) == ("t1", "error", None)
    assert result["error"] == "stuck" and (result["worker_host"], result["shard"]) == ("w0", 0)


def test_tasks_younger_than_the_stuck_limit_are_never_taken(tmp_path: Path) -> None:
    """A task that came after progress stopped was not taken by the worker: it stays for the
    successor, however many were in flight."""
    root = run_root(tmp_path)
    beat(root)
    task(root, "old", 12)
    task(root, "new", 3)
    assert quarantine(root, 5).task_ids == ("old",)
    assert (root / "inbox/0/new.json").exists()


def test_a_result_already_written_is_kept(tmp_path: Path) -> None:
    """The worker finished a task after all: its result stands, not overwritten."""
    root = run_root(tmp_path)
    beat(root)
    task(root, "done", 30)
    (root / "outbox/done.json").write_text('{"status": "ok", "score": 1.0}')
    done = quarantine(root, 2)
    assert done.task_ids == ("done",)
    assert json.loads((root / "outbox/done.json").read_text())["status"] == "ok"


def test_planted_names_links_and_temp_files_are_never_moved_or_followed(tmp_path: Path) -> None:
    """A symlink under a task name, a directory, a temp file and a name that is no task id
    stay where they are; the target of the symlink is untouched."""
    root = run_root(tmp_path)
    beat(root)
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    inbox = root / "inbox/0"
    (inbox / "link.json").symlink_to(secret)
    (inbox / "dir.json").mkdir()
    temp = inbox / ".t9.json.123.tmp"
    temp.write_text("{}")
    weird = inbox / "a b;rm.json"
    weird.write_text("{}")
    for path in (temp, weird):
        os.utime(path, (NOW - 60, NOW - 60))
    os.utime(inbox / "link.json", (NOW - 60, NOW - 60), follow_symlinks=False)
    task(root, "real", 60)
    assert quarantine(root, 10).task_ids == ("real",)
    assert {p.name for p in inbox.iterdir()} == {"link.json", "dir.json", temp.name, weird.name}
    assert secret.read_text() == "{}"


def test_a_quarantine_name_taken_gets_a_new_one_never_overwrites(tmp_path: Path) -> None:
    """The same task id quarantined twice keeps both files."""
    root = run_root(tmp_path)
    beat(root)
    pen = root / "ctl/quarantine/0"
    pen.mkdir(parents=True)
    (pen / "t.json").write_text("first")
    task(root, "t", 30)
    assert quarantine(root, 1).task_ids == ("t",)
    assert (pen / "t.json").read_text() == "first"
    assert json.loads((pen / "t.1.json").read_text())["task_id"] == "t"


def test_without_a_status_file_age_is_measured_against_the_given_clock(tmp_path: Path) -> None:
    """No status file to read the filesystem's clock from: ``now_wall`` stands in."""
    root = run_root(tmp_path)
    task(root, "t", 30)
    assert quarantine(root, 1).task_ids == ("t",)


def test_nothing_asked_or_nothing_old_enough_moves_nothing(tmp_path: Path) -> None:
    """count 0 touches nothing; no old task says so in its note."""
    root = run_root(tmp_path)
    beat(root)
    task(root, "t", 1)
    assert quarantine(root, 0) == tasks.Quarantined(())
    done = quarantine(root, 3)
    assert done.task_ids == () and done.note


def test_an_inbox_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """inbox/0 swapped for a symlink: an error naming it, nothing read through it."""
    root = run_root(tmp_path)
    (root / "inbox/0").rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "inbox/0").symlink_to(elsewhere)
    with pytest.raises(OSError, match="inbox/0"):
        quarantine(root, 1)


def test_old_task_files_are_counted_by_the_filesystem_s_clock(tmp_path: Path) -> None:
    """count_older counts the task files at least that old, as the quarantine would pick."""
    root = run_root(tmp_path)
    beat(root)
    for i, age in enumerate((40, 20, 11, 9, 1)):
        task(root, f"t{i}", age)
    assert tasks.count_older(root, 0, "w0", older_than_s=10.0) == 3
    assert tasks.count_older(root, 0, "w0", older_than_s=100.0) == 0
