"""The trainer's task files (AReaL's file protocol): a shard's inbox and the outbox, as far as
the supervisor touches them, which is only to quarantine the tasks a stuck worker hung on.

A worker replaced for being stuck would leave the tasks it hung on in its shard's inbox (the
protocol deletes a task only once its result is written), and its successor would take them
first, hang on them again and be replaced again: one poison task could keep a shard
restarting. So before the successor starts, those tasks are moved to
``ctl/quarantine/<shard>/`` and answered with an error result, which the trainer's client
reads as a failed call at once instead of at its own timeout. Everything under the run root
is hostile input here too: names checked, nothing followed through a symlink, listings and
reads bounded, an existing result never overwritten.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor import runfiles

#: An inbox holding more entries than this is not listed further: the oldest tasks are what
#: matter, and a directory of a million planted names must not cost a million stats.
MAX_LISTED: Final = 20_000
#: A task record is a few KB (the prompt and the completion); one past this is not read.
MAX_TASK_BYTES: Final = 4 * 1024 * 1024
#: Task ids become file names in outbox/ and ctl/quarantine/: AReaL's are uuid4 hex.
_TASK_ID: Final = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
#: What AReaL's fs_protocol writes as ``schema_version``.
SCHEMA_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Quarantined:
    """What a quarantine did: the task ids moved out of the inbox and answered."""

    task_ids: tuple[str, ...]
    #: Why nothing (or less than asked) could be done, for the log.
    note: str | None = None
    #: Tasks moved whose error result could not be written (the trainer times them out).
    unanswered: int = 0


def quarantine_stuck(
    root: Path,
    shard: int,
    host: str,
    *,
    count: int,
    older_than_s: float,
    reason: str,
    now_wall: float | None = None,
) -> Quarantined:
    """Move the ``count`` oldest task files of ``shard``'s inbox that are at least
    ``older_than_s`` old (the tasks a worker stuck that long took, in the order it takes
    them) to ``ctl/quarantine/<shard>/``, and write an error result for each that has none.

    Age is measured against the status file of ``host`` (the worker rewrote it a moment
    ago, so its mtime is the shared filesystem's clock), or ``now_wall`` without one. Raises
    OSError only for the inbox itself; a file that cannot be moved is left in place.
    """
    if count <= 0:
        return Quarantined(())
    inbox = runfiles.open_dir(root, ("inbox", str(shard)))
    try:
        reference = _status_mtime(root, host)
        if reference is None:
            reference = time.time() if now_wall is None else now_wall
        oldest = sorted(
            (mtime, name) for mtime, name in _task_files(inbox) if mtime <= reference - older_than_s
        )[:count]
        if not oldest:
            return Quarantined((), note="no task file old enough in the inbox")
        pen = runfiles.open_dir(root, ("ctl", "quarantine", str(shard)), create=True)
        try:
            moved = [n for _, n in oldest if _move(inbox, pen, n)]
        finally:
            os.close(pen)
        ids = tuple(name[: -len(".json")] for name in moved)
        unanswered = sum(1 for task_id in ids if not _answer(root, task_id, shard, host, reason))
        return Quarantined(ids, unanswered=unanswered)
    finally:
        os.close(inbox)


def count_older(
    root: Path, shard: int, host: str, *, older_than_s: float, now_wall: float | None = None
) -> int:
    """How many task files of ``shard``'s inbox are at least ``older_than_s`` old, measured
    as ``quarantine_stuck`` measures (a bounded listing, nothing followed)."""
    inbox = runfiles.open_dir(root, ("inbox", str(shard)))
    try:
        reference = _status_mtime(root, host)
        if reference is None:
            reference = time.time() if now_wall is None else now_wall
        return sum(1 for mtime, _ in _task_files(inbox) if mtime <= reference - older_than_s)
    finally:
        os.close(inbox)


def _task_files(inbox: int) -> list[tuple[float, str]]:
    """``(mtime, name)`` of the regular task files in the inbox (a bounded listing)."""
    found: list[tuple[float, str]] = []
    with os.scandir(inbox) as entries:
        for seen, entry in enumerate(entries):
            if seen >= MAX_LISTED:
                break
            name = entry.name
            if not name.endswith(".json") or not _TASK_ID.match(name[: -len(".json")]):
                continue  # temp files (".x.json.tmp") and planted names
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, name))
    return found


def _status_mtime(root: Path, host: str) -> float | None:
    try:
        fd = runfiles.open_dir_path(root / "status")
    except OSError:
        return None
    try:
        st = os.stat(f"{host}.json", dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)
    return st.st_mtime if stat.S_ISREG(st.st_mode) else None


def _move(inbox: int, pen: int, name: str) -> bool:
    """Rename ``name`` from the inbox into the quarantine, never over a file already there;
    False when it is gone (the trainer gave up on it meanwhile) or cannot be moved."""
    target = name
    for attempt in range(1, 100):
        try:
            os.stat(target, dir_fd=pen, follow_symlinks=False)
        except FileNotFoundError:
            break
        except OSError:
            return False
        target = f"{name[: -len('.json')]}.{attempt}.json"
    try:
        os.rename(name, target, src_dir_fd=inbox, dst_dir_fd=pen)
    except OSError:
        return False
    return True


def _exists(directory: Path, name: str) -> bool:
    """Whether ``name`` is in ``directory`` (the name itself, whatever it is)."""
    fd = runfiles.open_dir_path(directory)
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)
    return True


def _answer(root: Path, task_id: str, shard: int, host: str, reason: str) -> bool:
    """Write the error result the trainer's client reads for ``task_id`` (AReaL's result
    record), unless a result is there already (the worker finished it after all); False
    when it could not be written."""
    path = root / "outbox" / f"{task_id}.json"
    try:
        if _exists(root / "outbox", path.name):
            return True
        record = {
            "schema_version": SCHEMA_VERSION,
            "task_id": task_id,
            "status": "error",
            "score": None,
            "error": reason,
            "queue_wait_ms": None,
            "verify_ms": None,
            "total_ms": None,
            "worker_host": host,
            "shard": shard,
            "finished_at": time.time(),
        }
        data = json.dumps(record, separators=(",", ":")).encode("utf-8")
        runfiles.write_atomic(path, data, root=root)
    except OSError:
        return False
    return True
