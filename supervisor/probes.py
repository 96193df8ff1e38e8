"""The reward-probe adapter: a probe task written into a shard's inbox, its result awaited in
``outbox/`` and read as hostile, both files taken away, the answer queued as an event.

It decides nothing (docs/ARCHITECTURE.md): when to probe and what an answer means are
``health.py``'s. Its files are the only ones under ``inbox/`` and ``outbox/`` the daemon
ever writes or deletes, and they are recognisable by name (``rsprobe-``): the trainer's
task ids are 32 hex digits (``uuid4().hex``), so no probe id can be one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Final

import structlog

from supervisor import health, runfiles, vocabulary
from supervisor.shell import Shell

log = structlog.get_logger("supervisor.daemon")

#: Every probe file's name starts with this (its temp file with a dot before it): never a
#: trainer's task id (hex digits only), and what the sweep at start-up looks for.
PROBE_PREFIX: Final = "rsprobe-"
#: A result record is a few hundred bytes; a reward function's error text may be long.
RESULT_MAX_BYTES: Final = 64 * 1024
#: The worker's error text kept in an answer (a reason quotes a line of it).
ERROR_MAX_CHARS: Final = 2000
#: The result is looked for after this long, then twice as long each time up to the cap:
#: the worker scans its inbox every 50 ms, so a healthy probe is read within a few polls,
#: and a thousand hosts probing every 30 s cost a few reads a second.
FIRST_POLL_S: Final = 0.02
MAX_POLL_S: Final = 0.5
#: Removing a probe's two files after the answer: on a hung mount the answer still goes out.
CLEANUP_TIMEOUT_S: Final = 5.0
#: Results still owed by probes that timed out, per shard, looked for (and removed) at each of
#: its next probes; beyond this many the oldest are left to the next start's sweep.
MAX_OWED: Final = 64


def probe_id(shard: int) -> str:
    """A new probe task id: the prefix, the shard, 64 random bits."""
    return f"{PROBE_PREFIX}{shard}-{os.urandom(8).hex()}"


def is_probe_file(name: str) -> bool:
    """A probe's task or result file, or the temp file of one being written."""
    return name.startswith((PROBE_PREFIX, "." + PROBE_PREFIX))


def inbox_file(root: Path, shard: int, task_id: str) -> Path:
    """Where the probe task goes: the shard's inbox (``fs_protocol.inbox_path``)."""
    return root / "inbox" / str(shard) / f"{task_id}.json"


def outbox_file(root: Path, task_id: str) -> Path:
    """Where the worker writes its result (``fs_protocol.outbox_path``)."""
    return root / "outbox" / f"{task_id}.json"


def write_task(root: Path, shard: int, task_id: str, task: str) -> None:
    """Write the probe task record (``task`` with its id and creation time) atomically."""
    record = json.loads(task)
    record["task_id"] = task_id
    record["created_at"] = time.time()
    data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    runfiles.write_atomic(inbox_file(root, shard, task_id), data, root=root)


def read_result(root: Path, task_id: str) -> dict[str, Any] | None:
    """The probe's result record, or None while there is none; raises OSError or ValueError
    for a file that is not one (a symlink, too big, not JSON, not an object)."""
    try:
        record = runfiles.read_json(
            outbox_file(root, task_id), root=root, max_bytes=RESULT_MAX_BYTES
        )
    except FileNotFoundError:
        return None
    if not isinstance(record, dict):
        raise ValueError(f"result of {task_id} is not a JSON object")  # noqa: TRY004 (a file's content)
    return record


def remove_results(root: Path, task_ids: list[str]) -> list[str]:
    """Remove the results of probes that timed out, where their workers wrote them at last;
    the ids removed."""
    removed = []
    for task_id in task_ids:
        try:
            runfiles.remove_existing(outbox_file(root, task_id), root=root)
        except FileNotFoundError:
            continue
        removed.append(task_id)
    return removed


def remove_probe(root: Path, shard: int, task_id: str) -> None:
    """Take the probe's task and result away (missing ones are fine)."""
    for path in (inbox_file(root, shard, task_id), outbox_file(root, task_id)):
        with contextlib.suppress(FileNotFoundError):
            runfiles.remove(path, root=root)


def sweep(root: Path) -> tuple[int, dict[int, list[str]]]:
    """Remove every probe file left under ``inbox/*/`` and ``outbox/`` (a daemon killed
    mid-probe, a result written after its probe timed out): how many were removed, and the
    ids of the probe tasks taken from each shard's inbox (a worker may be scoring one, and
    write its result later)."""
    removed = 0
    taken: dict[int, list[str]] = {}
    dirs: list[tuple[str, ...]] = [("outbox",)]
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        inbox = runfiles.open_dir(root, ("inbox",))
        try:
            dirs += [("inbox", name) for name in os.listdir(inbox) if name.isdigit()]
        finally:
            os.close(inbox)
    for parts in dirs:
        try:
            fd = runfiles.open_dir(root, parts)
        except OSError:
            continue  # not a directory we may enter (a symlink planted): not ours to clean
        try:
            for name in os.listdir(fd):
                if is_probe_file(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=fd)
                        removed += 1
                    if parts[0] == "inbox" and name.endswith(".json"):
                        taken.setdefault(int(parts[1]), []).append(name.removesuffix(".json"))
        finally:
            os.close(fd)
    return removed, taken


def answer_of(
    pid: int, record: dict[str, Any] | None, error: str | None, round_trip_s: float
) -> health.RewardProbeAnswered:
    """The event for a result record as the worker wrote it, checked field by field (a
    field of the wrong type reads as absent); None: no result (``error`` says why)."""
    if record is None:
        return health.RewardProbeAnswered(
            pid=pid, status=None, error=error, round_trip_s=round_trip_s
        )
    status = record.get("status")
    score = record.get("score")
    text = record.get("error")
    number = score if isinstance(score, int | float) and not isinstance(score, bool) else None
    return health.RewardProbeAnswered(
        pid=pid,
        status=status[:40] if isinstance(status, str) else "error",
        score=float(number) if number is not None and math.isfinite(number) else None,
        error=text[:ERROR_MAX_CHARS] if isinstance(text, str) else None,
        round_trip_s=round_trip_s,
    )


class Prober:
    """Sends the probes the core asks for and reports their answers."""

    def __init__(self, shell: Shell) -> None:
        self._shell = shell
        #: Per shard, probes that timed out or were taken away by the sweep: their workers
        #: may still write a result.
        self._owed: dict[int, list[str]] = {}

    def send(self, action: vocabulary.SendRewardProbe) -> None:
        """Perform ``SendRewardProbe``; the core hears ``RewardProbeAnswered``."""
        self._shell.spawn(self._probe(action), f"probe:{action.host}")

    async def sweep(self) -> None:
        """Remove the probe files a previous daemon left (before the first probe)."""
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                removed, taken = await asyncio.to_thread(sweep, self._shell.config.run.root)
        except (OSError, TimeoutError) as exc:
            log.warning("probe.sweep_failed", reason=str(exc) or "no answer in time")
        except Exception:  # task root: a failed sweep must not stop the daemon
            log.exception("probe.sweep_failed")
        else:
            for shard, ids in taken.items():
                self._owed[shard] = [*self._owed.get(shard, ()), *ids][-MAX_OWED:]
            if removed:
                log.info("probe.swept", removed=removed)

    async def _probe(self, action: vocabulary.SendRewardProbe) -> None:
        root = self._shell.config.run.root
        owed = self._owed.get(action.shard)
        if owed:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                    done = await asyncio.to_thread(remove_results, root, list(owed))
                    self._owed[action.shard] = [t for t in owed if t not in done]
        task_id = probe_id(action.shard)
        started = time.monotonic()
        record: dict[str, Any] | None = None
        error: str | None = None
        try:
            async with asyncio.timeout(action.timeout_s):
                await asyncio.to_thread(write_task, root, action.shard, task_id, action.task)
                poll_s = FIRST_POLL_S
                while record is None:
                    await asyncio.sleep(poll_s)
                    poll_s = min(poll_s * 2, MAX_POLL_S)
                    record = await asyncio.to_thread(read_result, root, task_id)
        except TimeoutError:
            error = f"no result within {action.timeout_s:g}s"
            self._owed[action.shard] = [*self._owed.get(action.shard, ()), task_id][-MAX_OWED:]
        except (OSError, ValueError) as exc:
            error = f"probe file error: {exc}"
        except Exception as exc:  # task root: the core must hear an answer whatever happens
            log.exception("probe.failed", host=action.host)
            error = f"probe error: {type(exc).__name__}"
        finally:
            # Also when cancelled (the daemon stops): no probe file is left behind.
            await self._remove(root, action.shard, task_id)
        answer = answer_of(action.pid, record, error, time.monotonic() - started)
        self._shell.emit(vocabulary.HostObserved(action.host, answer))

    async def _remove(self, root: Path, shard: int, task_id: str) -> None:
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                await asyncio.to_thread(remove_probe, root, shard, task_id)
        except (OSError, TimeoutError) as exc:
            # The next start's sweep takes it.
            log.warning("probe.not_removed", task_id=task_id, reason=str(exc) or "timeout")
