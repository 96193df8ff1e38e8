"""The real AReaL files (``../shared/areal-fs``) for tests and benchmarks: where they are, the
trainer's load on a fleet (the real ``FSRewardClient``, or ``ContractClient`` where areal-fs is
absent), and what a fleet's processes left.

Nothing of AReaL is copied here: the client is imported from the areal-fs directory, the
workers run ``python -m areal.reward.fs_worker`` from it (``worker_env``), and their reward
functions are ``tests/rewardfns.py``. Without areal-fs the same fleet runs the reference worker
(``python -m supervisor.demo.worker``) and the trainer calls ``ContractClient``, written here
from the client's contract as areal-fs's README states it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import importlib
import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from tests import shared

if TYPE_CHECKING:
    from tests.sshd import OpenSsh

#: Names another areal-fs directory (the one holding ``areal/``) than ``../shared/areal-fs``.
AREAL_ENV: Final = shared.AREAL.env
REPO: Final = Path(__file__).resolve().parent.parent
#: The worker module our config's default ``worker.argv`` runs, and the old script too.
WORKER_MODULE: Final = "areal.reward.fs_worker"
#: The reference worker, which stands in for it where areal-fs is absent (same flags).
REFERENCE_WORKER_MODULE: Final = "supervisor.demo.worker"
#: A coordinator of a fleet runs one of these modules.
COORDINATOR_MODULES: Final = (WORKER_MODULE, REFERENCE_WORKER_MODULE)

#: Reward functions of ``tests/rewardfns.py`` as the client names them (the workers import them
#: with the repository root on their ``PYTHONPATH``).
EXACT: Final = "tests.rewardfns.exact"
SLOWISH: Final = "tests.rewardfns.slowish"
HANG_IF_MARKER: Final = "tests.rewardfns.hang_if_marker"
ZERO_IF_MARKER: Final = "tests.rewardfns.zero_if_marker"
BROKEN_IMPORT: Final = "tests.rewardfns_missing.reward_fn"
#: The worker environment variable ``hang_if_marker`` reads (``{host}`` filled in per host).
HANG_MARKER_ENV: Final = "TRAINER_HANG_MARKER"

#: A call and the completion the reward fns score 1.0 (GSM8K style).
PROMPT: Final = "What is 3 * 6?"
COMPLETIONS: Final = "3 * 6 = 18\n#### 18"
ANSWER: Final = "18"

#: After a failed call each rollout loop waits the client's own poll interval before the next
#: call. The same loop runs for every supervisor, so failed-call counts are proportional to how
#: long the trainer is blocked (about 20 failed calls per second per loop), never to how fast a
#: loop can spin on an error that returns at once.
FAILURE_PAUSE_S: Final = 0.05
#: A gap longer than this between two successful completions is a stall. With 16 loops a
#: healthy fleet completes a call every few ms, so a second without one is the trainer waiting.
STALL_GAP_S: Final = 1.0

#: Kinds of failed calls, from the client's ``RewardInfraError`` messages.
HEARTBEAT_STALE: Final = "heartbeat stale"
NOT_READY: Final = "not ready"
TASK_FAILED: Final = "task failed"
TIMEOUT: Final = "timeout"
OTHER: Final = "other"
KINDS: Final = (HEARTBEAT_STALE, NOT_READY, TASK_FAILED, TIMEOUT, OTHER)


# --- where AReaL is ----------------------------------------------------------------------


def areal_dir() -> Path | None:
    """The areal-fs directory (``$REWARD_SUPERVISOR_AREAL``, else ``../shared/areal-fs`` beside
    the repository), or None where it is absent or broken (``tests/shared.py``; a test takes
    it from ``shared.require``, which tells the two apart)."""
    found = shared.AREAL.locate()
    return found.path if isinstance(found, shared.Found) else None


def areal_missing_reason() -> str:
    """Why the AReaL files cannot be used here (empty where they can)."""
    found = shared.AREAL.locate()
    return "" if isinstance(found, shared.Found) else found.reason


#: The two stacks a scenario with the real AReaL worker runs on: areal-fs's worker (and client),
#: or the reference worker (and ``ContractClient``) in its place.
REAL: Final = "real"
REFERENCE: Final = "reference"
#: ``both``: every such scenario runs on the reference stack too, beside the real one.
STACKS_ENV: Final = "REWARD_SUPERVISOR_TRAINER_STACKS"


def stacks() -> list[str]:
    """The stacks a scenario of the real worker is parametrized with, at collection.

    Where areal-fs is found (CI), ``[real]`` alone: the reference stack beside it is time the
    CI budget has not got (``REWARD_SUPERVISOR_TRAINER_STACKS=both`` adds it). Anywhere else,
    ``[real, reference]``: ``real`` skips, named, where areal-fs is truly absent (fails where
    it is broken: take it with ``shared.require(shared.AREAL)``), and the same scenario runs
    on the reference worker."""
    if os.environ.get(STACKS_ENV) == "both":
        return [REAL, REFERENCE]
    found = isinstance(shared.AREAL.locate(), shared.Found)
    return [REAL] if found else [REAL, REFERENCE]


def worker_env(areal: Path | None, **extra: str) -> dict[str, str]:
    """``worker.env`` for the real worker: areal-fs, then the repository root (for
    ``tests.rewardfns``) on ``PYTHONPATH``; areal-fs first, so its ``areal`` package is the
    one imported whatever the rest of the path holds. ``areal`` None: the reference worker,
    the repository root alone."""
    path = str(REPO) if areal is None else f"{areal}{os.pathsep}{REPO}"
    return {"PYTHONPATH": path, **extra}


def reference_worker_argv() -> list[str]:
    """``worker.argv`` running the reference worker with the real worker's flags (and its
    defaults: the heartbeat every second, 30 s of drain)."""
    from supervisor.demo.worker import argv_template

    return argv_template()


def shipped_config(
    openssh: OpenSsh,
    root: Path,
    names: Sequence[str],
    *,
    areal: Path | None,
    socket: Path,
    concurrency: int = 4,
    env: Mapping[str, str] | None = None,
    trainer_table: bool = False,
    health: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A raw config (as TOML would parse it) for real workers on the OpenSSH fixture, with
    the shipped defaults: only the run root, ssh, hosts (``names[i]`` on shard i),
    ``worker.python``/``worker.env`` and the control socket; no ``[health]``, no metrics, and
    the default ``worker.argv`` (``python -m areal.reward.fs_worker``; ``areal`` None: the
    reference worker's, ``reference_worker_argv``, its one departure). ``trainer_table`` adds
    ``[trainer]`` with the client's own tolerances, for a daemon that knows that table;
    ``health`` a ``[health]`` table (for a bench of a setting, not the defaults)."""
    raw: dict[str, Any] = {
        "run": {"root": str(root), "reward_fn": HANG_IF_MARKER},
        "worker": {"python": sys.executable, "env": worker_env(areal, **dict(env or {}))},
        "ssh": {
            "username": openssh.username,
            "known_hosts": str(openssh.known_hosts),
            "client_keys": [str(openssh.client_key)],
        },
        "control": {"socket": str(socket)},
        "hosts": [
            {
                "name": name,
                "address": openssh.addresses[i % len(openssh.addresses)],
                "port": openssh.port,
                "shard": i,
                "concurrency": concurrency,
            }
            for i, name in enumerate(names)
        ],
    }
    if areal is None:
        raw["worker"]["argv"] = reference_worker_argv()
    if trainer_table:
        raw["trainer"] = {"heartbeat_stale_s": 15, "task_timeout_s": 30}
    if health:
        raw["health"] = dict(health)
    return raw


def client_module(areal: Path) -> ModuleType:
    """``areal.reward.fs_client`` imported from ``areal`` (put first on ``sys.path``).

    Raises ImportError when another ``areal`` package was imported already: the client under
    test must be the real one.
    """
    if str(areal) not in sys.path:
        sys.path.insert(0, str(areal))
    module = importlib.import_module("areal.reward.fs_client")
    origin = Path(str(module.__file__)).resolve()
    if not origin.is_relative_to(areal):
        raise ImportError(f"areal.reward.fs_client comes from {origin}, not from {areal}")
    _hook_task_ids(module)
    return module


def stable_shard(areal: Path, task_id: str, shard_count: int) -> int:
    """The shard the client sends ``task_id`` to (AReaL's own ``stable_shard``)."""
    client_module(areal)
    protocol = importlib.import_module("areal.reward.fs_protocol")
    return int(protocol.stable_shard(task_id, shard_count))


# The task id of the call in progress, per asyncio task. The client draws it with
# ``new_task_id()`` before its first await; wrapping that name in the client's module lets a
# rollout loop learn which shard its call went to without changing what the client does.
_TASK_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("task_id", default=None)


def _hook_task_ids(module: ModuleType) -> None:
    """Record every task id the client draws in ``_TASK_ID`` (once per module)."""
    original = module.new_task_id
    if getattr(original, "records_task_id", False):
        return

    def new_task_id() -> str:
        """The client's own id, remembered for the calling task."""
        task_id = str(original())
        _TASK_ID.set(task_id)
        return task_id

    new_task_id.records_task_id = True  # type: ignore[attr-defined]
    setattr(module, "new_task_id", new_task_id)  # noqa: B010 (a module attribute mypy cannot see)


def classify(message: str) -> str:
    """The kind of a ``RewardInfraError`` message (one of ``KINDS``)."""
    if "heartbeat stale" in message:
        return HEARTBEAT_STALE
    if "not ready" in message:
        return NOT_READY
    if message.startswith("task ") and " failed: " in message:
        return TASK_FAILED
    if message.startswith("timeout waiting outbox"):
        return TIMEOUT
    return OTHER


# --- our client, from the contract -------------------------------------------------------

#: The contract's numbers (areal-fs README): a heartbeat older than this fails every call, a
#: task without a result this long after the call began fails, results are looked for this often.
CONTRACT_HEARTBEAT_STALE_S: Final = 15.0
CONTRACT_TIMEOUT_S: Final = 30.0
CONTRACT_POLL_S: Final = 0.05
#: The task and result records' protocol version.
CONTRACT_SCHEMA_VERSION: Final = 1
# Run-directory files are read with a bound: a status or result file is a few hundred bytes.
_MAX_FILE_BYTES: Final = 1 << 20


class ContractCallFailed(RuntimeError):
    """A failed call of :class:`ContractClient`; ``kind`` is one of ``KINDS``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def contract_shard(task_id: str, shard_count: int) -> int:
    """The shard a task goes to: blake2b of its id (8-byte digest, big-endian) modulo
    ``shard_count``."""
    digest = hashlib.blake2b(task_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shard_count


def _read_json_file(path: Path) -> object:
    """``path`` as JSON, read without following a symlink and bounded; raises OSError or
    ValueError (not JSON, or too big to be a record)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"more than {_MAX_FILE_BYTES} bytes")
    return json.loads(data)


def _write_json_atomic(path: Path, record: Mapping[str, Any]) -> None:
    """Write ``record`` to ``path`` whole or not at all: a dot-named temp file beside it (which
    workers skip), fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(json.dumps(record).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _unlink(path: Path) -> None:
    """Remove ``path`` if it is there (a worker or another reader may race us)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


class ContractClient:
    """The trainer's reward client as areal-fs's README states its contract, for a fleet
    without areal-fs (the real one is ``areal.reward.fs_client.FSRewardClient``).

    ``await client(*args, **kwargs)`` scores one completion: before every call it checks every
    host's ``status/<host>.json`` (missing or unreadable, a ``heartbeat_at`` more than
    ``heartbeat_stale_s`` old by the wall clock, ``ready: false``: the call fails), writes the
    task record atomically into ``inbox/<contract_shard(task_id)>/<task_id>.json`` and polls
    ``outbox/<task_id>.json`` every ``poll_s``: a result whose ``status`` is not ``ok`` fails
    the call, one that is ``ok`` is the score; no result within ``timeout_s`` of the call's
    start fails it and deletes its inbox file. A result read is deleted. A failure raises
    :class:`ContractCallFailed` with its kind (``on_error="raise"``, the default). Like the real
    client it also refuses to call while ``manifest.json`` is missing or names another shard
    count (checked until it once passes).
    """

    def __init__(
        self,
        reward_fn: str,
        *,
        root: Path,
        shard_count: int,
        worker_hosts: Sequence[str],
        heartbeat_stale_s: float = CONTRACT_HEARTBEAT_STALE_S,
        timeout_s: float = CONTRACT_TIMEOUT_S,
        poll_s: float = CONTRACT_POLL_S,
    ) -> None:
        self.reward_fn = reward_fn
        self.root = Path(root)
        self.shard_count = shard_count
        self.worker_hosts = list(worker_hosts)
        self.heartbeat_stale_s = heartbeat_stale_s
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._manifest_ok = False

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        """The score of one task; raises ContractCallFailed (see the class docstring)."""
        started = time.monotonic()
        self._check_manifest()
        self._check_hosts()
        task_id = _draw_task_id()
        inbox = self.root / "inbox" / str(contract_shard(task_id, self.shard_count))
        task_path = inbox / f"{task_id}.json"
        result_path = self.root / "outbox" / f"{task_id}.json"
        record = {
            "schema_version": CONTRACT_SCHEMA_VERSION,
            "task_id": task_id,
            "reward_fn": self.reward_fn,
            "args": list(args),
            "kwargs": dict(kwargs),
            "created_at": time.time(),
        }
        try:
            _write_json_atomic(task_path, record)
        except (OSError, TypeError, ValueError) as exc:
            raise ContractCallFailed(OTHER, f"cannot submit task {task_id}: {exc}") from exc
        while True:
            if result_path.exists():
                return self._take_result(task_id, result_path)
            if time.monotonic() - started >= self.timeout_s:
                _unlink(task_path)
                _unlink(result_path)
                raise ContractCallFailed(
                    TIMEOUT, f"timeout: no result for task {task_id} in {self.timeout_s:g} s"
                )
            await asyncio.sleep(self.poll_s)  # wait-ok: the contract's poll interval

    def _check_manifest(self) -> None:
        """Fail unless ``manifest.json`` names this client's shard count (once it did, it is
        not read again)."""
        if self._manifest_ok:
            return
        try:
            manifest = _read_json_file(self.root / "manifest.json")
        except (OSError, ValueError) as exc:
            raise ContractCallFailed(OTHER, f"no usable manifest.json: {exc}") from exc
        count = manifest.get("shard_count") if isinstance(manifest, dict) else None
        if count != self.shard_count:
            raise ContractCallFailed(
                OTHER, f"manifest.json says shard_count {count!r}, the client {self.shard_count}"
            )
        self._manifest_ok = True

    def _check_hosts(self) -> None:
        """Fail unless every host's status file is readable, fresh and not ``ready: false``."""
        now = time.time()
        for host in self.worker_hosts:
            try:
                status = _read_json_file(self.root / "status" / f"{host}.json")
            except (OSError, ValueError) as exc:
                raise ContractCallFailed(OTHER, f"status of {host} unreadable: {exc}") from exc
            if not isinstance(status, dict):
                raise ContractCallFailed(OTHER, f"status of {host} is not a JSON object")
            beat = status.get("heartbeat_at", 0)
            if isinstance(beat, bool) or not isinstance(beat, int | float):
                raise ContractCallFailed(OTHER, f"status of {host}: heartbeat_at {beat!r}")
            if now - beat > self.heartbeat_stale_s:
                raise ContractCallFailed(
                    HEARTBEAT_STALE,
                    f"heartbeat stale: {host} is {now - beat:.1f} s old"
                    f" (> {self.heartbeat_stale_s:g} s)",
                )
            if status.get("ready") is False:
                raise ContractCallFailed(NOT_READY, f"not ready: {host}")

    def _take_result(self, task_id: str, path: Path) -> float:
        """Read and delete the result of ``task_id``: its score, or the failure it says."""
        try:
            result = _read_json_file(path)
        except (OSError, ValueError) as exc:
            raise ContractCallFailed(OTHER, f"result of {task_id} unreadable: {exc}") from exc
        finally:
            _unlink(path)
        if not isinstance(result, dict):
            raise ContractCallFailed(OTHER, f"result of {task_id} is not a JSON object")
        status = result.get("status")
        if status != "ok":
            raise ContractCallFailed(
                TASK_FAILED, f"task {task_id} failed: {result.get('error') or status}"
            )
        try:
            return float(result.get("score", 0.0))
        except (TypeError, ValueError) as exc:
            raise ContractCallFailed(OTHER, f"result of {task_id}: score {exc}") from exc


def _draw_task_id() -> str:
    """A new task id, remembered for the calling task (as ``_hook_task_ids`` does for the
    real client), so a rollout loop learns which shard its call went to."""
    task_id = uuid.uuid4().hex
    _TASK_ID.set(task_id)
    return task_id


# --- the trainer's load ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One ``await client(...)`` of a rollout loop (monotonic seconds)."""

    start: float
    end: float
    ok: bool
    #: The shard the client sent the task to (None: it failed before choosing one).
    shard: int | None
    #: One of ``KINDS`` for a failed call, None for an OK one.
    kind: str | None = None
    message: str | None = None
    #: An OK call's score.
    score: float | None = None

    @property
    def latency_s(self) -> float:
        """How long the call took."""
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """What the trainer saw in one window; see :meth:`TrainerLoad.summary`."""

    window_s: float
    ok: int
    failed: Mapping[str, int]
    #: The first message of each failed kind, for reports.
    examples: Mapping[str, str]
    #: Failed calls per shard (a call that failed before choosing a shard is not counted).
    failed_by_shard: Mapping[int, int]
    longest_stall_s: float
    total_stall_s: float
    p50_s: float
    p99_s: float
    #: Calls still running when the load stopped (cancelled; neither OK nor failed).
    unfinished: int
    #: OK calls that scored 0 (a wrong answer, or a reward that lies).
    zero_scored: int = 0

    @property
    def failed_total(self) -> int:
        """Failed calls of every kind."""
        return sum(self.failed.values())


class TrainerLoad:
    """``loops`` concurrent rollout loops calling the real ``FSRewardClient`` with its defaults
    (``heartbeat_stale_seconds=15``, ``timeout_seconds=30``, ``on_error="raise"``), every host
    in ``worker_hosts``, as a trainer does; every call is recorded. ``areal`` None: they call
    :class:`ContractClient` (the same contract, the same defaults) instead.

    Each loop: ``await client(PROMPT, COMPLETIONS, answer=ANSWER, **call_kwargs)``; a
    ``RewardInfraError`` is a failed call, after which the loop pauses ``FAILURE_PAUSE_S`` (see
    there) and goes on. Use ``async with`` (or ``start``/``stop``) in an event loop; the
    client's error log is silenced while it runs (a blocked trainer logs hundreds of errors a
    second).
    """

    def __init__(
        self,
        root: Path,
        hosts: Sequence[str],
        shard_count: int,
        *,
        areal: Path | None,
        reward_fn: str = SLOWISH,
        loops: int = 16,
        client_options: Mapping[str, Any] | None = None,
        call_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.hosts = list(hosts)
        self.shard_count = shard_count
        self.areal = areal
        self.reward_fn = reward_fn
        self.loops = loops
        #: More keyword arguments of every call, passed on to the reward fn (``hang_marker``).
        self.call_kwargs = dict(call_kwargs or {})
        self._error: type[BaseException]
        self.client: Any
        self._shard_of: Callable[[str], int]
        if areal is None:
            self._error = ContractCallFailed
            self.client = ContractClient(
                reward_fn,
                root=root,
                shard_count=shard_count,
                worker_hosts=list(hosts),
                **dict(client_options or {}),
            )
            self._shard_of = lambda task_id: contract_shard(task_id, shard_count)
        else:
            module = client_module(areal)
            self._error = module.RewardInfraError
            self.client = module.FSRewardClient(
                reward_fn,
                root=str(root),
                shard_count=shard_count,
                worker_hosts=list(hosts),
                **dict(client_options or {}),
            )
            self._shard_of = lambda task_id: int(
                importlib.import_module("areal.reward.fs_protocol").stable_shard(
                    task_id, shard_count
                )
            )
        self.calls: list[Call] = []
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        self.unfinished = 0
        #: Loop index -> when its call in progress started.
        self._in_progress: dict[int, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self._log_level: int | None = None

    async def __aenter__(self) -> TrainerLoad:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        """Start the loops (in the running event loop)."""
        logger = logging.getLogger("FSRewardClient")
        self._log_level = logger.level
        logger.setLevel(logging.CRITICAL)
        self.started_at = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._loop(i), name=f"rollout-{i}") for i in range(self.loops)
        ]

    async def stop(self) -> None:
        """Cancel the loops; a call in progress is counted in ``unfinished``, not recorded."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        if self._log_level is not None:
            logging.getLogger("FSRewardClient").setLevel(self._log_level)
            self._log_level = None

    async def _loop(self, index: int) -> None:
        """One rollout loop: call, record, pause after a failure, repeat until cancelled."""
        while True:
            _TASK_ID.set(None)
            start = self._in_progress[index] = time.monotonic()
            try:
                score = await self.client(PROMPT, COMPLETIONS, answer=ANSWER, **self.call_kwargs)
            except asyncio.CancelledError:
                self._in_progress.pop(index, None)
                self.unfinished += 1
                raise
            except self._error as exc:
                del self._in_progress[index]
                message = str(exc)
                kind = exc.kind if isinstance(exc, ContractCallFailed) else classify(message)
                self._record(start, ok=False, kind=kind, message=message)
                await asyncio.sleep(FAILURE_PAUSE_S)  # wait-ok: the trainer's pause, see above
            else:
                del self._in_progress[index]
                self._record(start, ok=True, score=float(score))

    def _record(
        self,
        start: float,
        *,
        ok: bool,
        kind: str | None = None,
        message: str | None = None,
        score: float | None = None,
    ) -> None:
        """Append one finished call (its shard from the task id the client drew)."""
        task_id = _TASK_ID.get()
        shard = self._shard_of(task_id) if task_id is not None else None
        self.calls.append(Call(start, time.monotonic(), ok, shard, kind, message, score))
        self._changed.set()

    # --- waiting ---------------------------------------------------------------------------

    def ok_calls(self, *, since: float = -math.inf, shards: Iterable[int] | None = None) -> int:
        """OK calls that ended after ``since`` (on ``shards``, if given)."""
        wanted = None if shards is None else set(shards)
        return sum(
            1
            for c in self.calls
            if c.ok and c.end >= since and (wanted is None or c.shard in wanted)
        )

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Wait until ``predicate()`` holds (re-checked at every call and every 50 ms)."""
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    self._changed.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await self._changed.wait()
        except TimeoutError:
            summary = self.summary()
            raise AssertionError(
                f"timed out after {timeout_s:g}s waiting for {what}; load so far: {summary}"
            ) from None

    def scores(
        self, *, since: float = -math.inf, shards: Iterable[int] | None = None
    ) -> tuple[int, int]:
        """``(zero, ok)``: OK calls that ended after ``since`` (on ``shards``, if given), and
        how many of them scored 0 (the trainer's own zero rate)."""
        wanted = None if shards is None else set(shards)
        ok = [
            c
            for c in self.calls
            if c.ok and c.end >= since and (wanted is None or c.shard in wanted)
        ]
        return sum(1 for c in ok if c.score == 0.0), len(ok)

    def oldest_in_progress(self) -> float | None:
        """When the oldest call still in progress started (None: none is)."""
        return min(self._in_progress.values(), default=None)

    async def wait_settled(self, since: float, timeout_s: float) -> None:
        """Wait until every call that was in progress at ``since`` has ended (OK or failed)."""

        def settled() -> bool:
            """No call started before ``since`` is still in progress."""
            oldest = self.oldest_in_progress()
            return oldest is None or oldest >= since

        await self.wait_until(settled, timeout_s, "the calls in progress to end")

    async def wait_ok(
        self,
        count: int,
        timeout_s: float,
        *,
        since: float = -math.inf,
        shards: Iterable[int] | None = None,
    ) -> None:
        """Wait for ``count`` OK calls ending after ``since`` (on ``shards``, if given)."""
        wanted = None if shards is None else sorted(set(shards))
        await self.wait_until(
            lambda: self.ok_calls(since=since, shards=wanted) >= count,
            timeout_s,
            f"{count} OK calls" + (f" on shards {wanted}" if wanted is not None else ""),
        )

    # --- what it saw -----------------------------------------------------------------------

    def window(self, since: float | None = None, until: float | None = None) -> tuple[float, float]:
        """``(since, until)`` with the load's own start and stop (or now) as defaults."""
        start = since if since is not None else (self.started_at or time.monotonic())
        end = until if until is not None else (self.stopped_at or time.monotonic())
        return start, end

    def summary(self, since: float | None = None, until: float | None = None) -> LoadSummary:
        """What the trainer saw between ``since`` and ``until`` (monotonic; default: the whole
        run). Counts the calls that ended in the window.

        Stall: the OK completions in the window, with the window's start and end, cut it into
        gaps; every gap longer than ``STALL_GAP_S`` is the trainer blocked (no call finished
        OK for that long). ``longest_stall_s`` is the longest such gap (0 when there is none),
        ``total_stall_s`` the sum of all of them, whole (a 5 s gap counts 5 s, not 4 s).
        Latency percentiles are of OK calls (nearest rank; NaN without any).
        """
        start, end = self.window(since, until)
        calls = [c for c in self.calls if start <= c.end <= end]
        ok_ends = sorted(c.end for c in calls if c.ok)
        points = [start, *ok_ends, end]
        stalls = [b - a for a, b in itertools.pairwise(points) if b - a > STALL_GAP_S]
        failed = Counter(c.kind or OTHER for c in calls if not c.ok)
        examples: dict[str, str] = {}
        for c in calls:
            if not c.ok and c.kind is not None and c.kind not in examples:
                examples[c.kind] = c.message or ""
        latencies = [c.latency_s for c in calls if c.ok]
        by_shard = Counter(c.shard for c in calls if not c.ok and c.shard is not None)
        return LoadSummary(
            window_s=end - start,
            ok=len(ok_ends),
            failed={k: failed[k] for k in KINDS if failed[k]},
            examples=examples,
            failed_by_shard={int(s): n for s, n in sorted(by_shard.items()) if s is not None},
            longest_stall_s=max(stalls, default=0.0),
            total_stall_s=sum(stalls),
            p50_s=_percentile(latencies, 50),
            p99_s=_percentile(latencies, 99),
            unfinished=self.unfinished,
            zero_scored=sum(1 for c in calls if c.ok and c.score == 0.0),
        )

    def recovery_s(
        self, fault_at: float, shards: Iterable[int] | None = None, until: float | None = None
    ) -> float | None:
        """Seconds from ``fault_at`` to the end of the first OK call on one of ``shards`` (all,
        if None) that started after the fault and after the last failed call (of any kind)
        that ended in the window: from then on the trainer is served by that shard again and
        nothing fails. None when no such call ended by ``until`` (no recovery in the window).
        """
        _, end = self.window(fault_at, until)
        wanted = None if shards is None else set(shards)
        failures = [c.end for c in self.calls if not c.ok and fault_at <= c.end <= end]
        after = max([fault_at, *failures])
        ends = [
            c.end
            for c in self.calls
            if c.ok and c.start >= after and c.end <= end and (wanted is None or c.shard in wanted)
        ]
        return min(ends) - fault_at if ends else None


def _percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), nearest rank; NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# --- the fleet's processes ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proc:
    """One process as /proc showed it."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start_ticks: int
    argv: tuple[str, ...]

    @property
    def key(self) -> tuple[int, int]:
        """``(pid, start time)``: one process, never a later one that reused the pid."""
        return (self.pid, self.start_ticks)

    @property
    def alive(self) -> bool:
        """Not a zombie (PID 1 here reaps orphans only every ~1.7 s)."""
        return self.state not in ("Z", "X")

    @property
    def role(self) -> str:
        """``coordinator``, ``pool`` (a spawned pool process), ``resource tracker``, ``other``."""
        text = " ".join(self.argv)
        if any(module in self.argv for module in COORDINATOR_MODULES):
            return "coordinator"
        if "resource_tracker" in text:
            return "resource tracker"
        if "multiprocessing" in text and "spawn_main" in text:
            return "pool"
        return "other"


@dataclass(frozen=True, slots=True)
class Lingering:
    """A process a fleet left behind: see :meth:`FleetProcesses.lingering`."""

    proc: Proc
    #: The coordinator it belongs to (itself, for a superseded coordinator).
    coordinator: int
    why: str

    def __str__(self) -> str:
        return (
            f"pid {self.proc.pid} ({self.proc.role}, state {self.proc.state}) of coordinator"
            f" {self.coordinator}: {self.why}"
        )


def read_proc(pid: int) -> Proc | None:
    """``pid`` from /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    argv = tuple(os.fsdecode(a) for a in raw.split(b"\0")[:-1])
    return Proc(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        state=fields[0].decode(),
        start_ticks=int(fields[19]),
        argv=argv,
    )


def all_procs() -> dict[int, Proc]:
    """Every process on the machine now."""
    out: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (proc := read_proc(int(name))) is not None:
            out[proc.pid] = proc
    return out


@dataclass
class FleetProcesses:
    """The AReaL worker processes of one run directory, sampled from /proc over a run.

    A coordinator is ``python -m areal.reward.fs_worker ... --root ROOT`` (or the reference
    worker's ``-m supervisor.demo.worker``, which has the same shape: a spawned pool). Its
    pool processes and resource tracker are its children while it lives; sampling
    (``sample()``, a few times a second) remembers them, so they are still known once a dead
    coordinator's children have been re-parented. Supervisors start the worker in a session
    of its own (ours) or inside the session of an ssh command (the old script), so a session
    id alone cannot find them.
    """

    root: Path
    coordinators: dict[tuple[int, int], Proc] = field(default_factory=dict)
    #: child (pid, start) -> (its process, the coordinator's (pid, start))
    children: dict[tuple[int, int], tuple[Proc, tuple[int, int]]] = field(default_factory=dict)
    # A sampler thread and the caller may both sample: one at a time.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def _is_coordinator(self, proc: Proc) -> bool:
        """``proc`` is a coordinator of this run."""
        argv = proc.argv
        if not any(module in argv for module in COORDINATOR_MODULES) or "--root" not in argv:
            return False
        i = argv.index("--root")
        return i + 1 < len(argv) and Path(argv[i + 1]) == self.root

    def sample(self) -> dict[int, Proc]:
        """One look at /proc: learn new coordinators and their children; the processes seen."""
        with self._lock:
            return self._sample()

    def _sample(self) -> dict[int, Proc]:
        """``sample`` under the lock."""
        procs = all_procs()
        found = {p.pid: p for p in procs.values() if self._is_coordinator(p) and p.alive}
        known = {key[0] for key in self.coordinators}
        for proc in found.values():
            # A coordinator's child between fork and exec (a pool process being spawned)
            # still shows the coordinator's command line; its parent is the coordinator.
            if proc.ppid not in found and proc.ppid not in known:
                self.coordinators.setdefault(proc.key, proc)
        for key in list(self.coordinators):
            now = procs.get(key[0])
            if now is not None and now.start_ticks == key[1] and not self._is_coordinator(now):
                del self.coordinators[key]  # such a child, seen before its parent was known
        by_pid = {key[0]: key for key in self.coordinators}
        for proc in procs.values():
            parent = by_pid.get(proc.ppid)
            if parent is not None and proc.start_ticks >= parent[1] and proc.key != parent:
                self.children.setdefault(proc.key, (proc, parent))
        return procs

    def live_coordinators(self, procs: Mapping[int, Proc]) -> list[Proc]:
        """The coordinators of this run still alive in ``procs``."""
        return [p for key, p in self.coordinators.items() if _alive_in(procs, key)]

    def current(self, procs: Mapping[int, Proc]) -> dict[int, int]:
        """Shard -> the pid serving it: the pid its host's status file names, if alive, else
        the youngest live coordinator of that shard."""
        by_shard: dict[int, list[Proc]] = {}
        for proc in self.live_coordinators(procs):
            text = _arg(proc.argv, "--shard")
            if text is not None and text.isdigit():
                by_shard.setdefault(int(text), []).append(proc)
        chosen: dict[int, Proc] = {}
        for shard, candidates in by_shard.items():
            host = _arg(candidates[0].argv, "--host")
            named = _status_pid(self.root, host) if host is not None else None
            named_procs = [p for p in candidates if p.pid == named]
            chosen[shard] = (named_procs or sorted(candidates, key=lambda p: p.start_ticks))[-1]
        return {shard: proc.pid for shard, proc in chosen.items()}

    def lingering(self) -> list[Lingering]:
        """Processes of this run alive now that no current worker accounts for: coordinators
        superseded by another on their shard, and every child (pool process, resource
        tracker) of a coordinator that is dead or superseded, or in its session or process
        group (a child born between two samples)."""
        with self._lock:
            return self._lingering()

    def _lingering(self) -> list[Lingering]:
        """``lingering`` under the lock."""
        procs = self._sample()
        current = set(self.current(procs).values())
        gone = {key for key in self.coordinators if key[0] not in current}
        out: list[Lingering] = []
        for key in gone:
            if _alive_in(procs, key):
                out.append(Lingering(procs[key[0]], key[0], "superseded coordinator, alive"))
        seen = {item.proc.key for item in out}
        for child_key, (_, parent) in self.children.items():
            if parent in gone and child_key not in seen and _alive_in(procs, child_key):
                why = "child of a " + ("dead" if not _alive_in(procs, parent) else "superseded")
                out.append(Lingering(procs[child_key[0]], parent[0], why + " coordinator"))
                seen.add(child_key)
        gone_pids = {key[0]: key for key in gone}
        for proc in procs.values():
            owner = gone_pids.get(proc.sid) or gone_pids.get(proc.pgid)
            if owner is None or proc.key in seen or not proc.alive or proc.key == owner:
                continue
            if proc.start_ticks >= owner[1]:
                out.append(Lingering(proc, owner[0], "in a gone coordinator's session or group"))
                seen.add(proc.key)
        return sorted(out, key=lambda item: item.proc.pid)

    def everything_alive(self) -> list[Proc]:
        """Every coordinator of this run and every known child still alive (for cleanup)."""
        with self._lock:
            procs = self._sample()
            keys = [*self.coordinators, *self.children]
            return [procs[k[0]] for k in keys if _alive_in(procs, k)]

    def children_of(self, pid: int) -> list[Proc]:
        """The known children of coordinator ``pid`` (as last sampled)."""
        with self._lock:
            return [proc for proc, parent in self.children.values() if parent[0] == pid]


def kill_procs(procs: Iterable[Proc]) -> int:
    """SIGKILL each process that is still the same one (pid and start time); how many."""
    killed = 0
    for proc in procs:
        now = read_proc(proc.pid)
        if now is None or now.start_ticks != proc.start_ticks or not now.alive:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
            killed += 1
    return killed


def _alive_in(procs: Mapping[int, Proc], key: tuple[int, int]) -> bool:
    """The process ``key`` is in ``procs`` (same start time) and not a zombie."""
    proc = procs.get(key[0])
    return proc is not None and proc.start_ticks == key[1] and proc.alive


def _arg(argv: Sequence[str], flag: str) -> str | None:
    """The value after ``flag`` in ``argv``."""
    if flag in argv:
        i = argv.index(flag)
        if i + 1 < len(argv):
            return argv[i + 1]
    return None


def _status_pid(root: Path, host: str) -> int | None:
    """The pid ``status/<host>.json`` names (None: missing, partial, not one)."""
    import json

    try:
        data = json.loads((root / "status" / f"{host}.json").read_bytes()[:65536])
    except (OSError, ValueError):
        return None
    pid = data.get("pid") if isinstance(data, dict) else None
    return pid if isinstance(pid, int) else None


def read_status(root: Path, host: str) -> dict[str, Any] | None:
    """``status/<host>.json`` as a dict (None: missing, partial, not an object)."""
    import json

    try:
        data = json.loads((root / "status" / f"{host}.json").read_bytes()[: 1 << 20])
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def busy_pool_process(children: Iterable[Proc]) -> Proc | None:
    """A pool process that is inside a reward call right now: one sleeping in the kernel's
    nanosleep (``slowish``'s sleep), where an idle one waits on its call queue (a pipe read or
    a futex). None when none is busy at this instant."""
    busy = busy_pool_processes(children)
    return busy[0] if busy else None


def busy_pool_processes(children: Iterable[Proc]) -> list[Proc]:
    """Every pool process inside a reward call at this instant (``busy_pool_process``)."""
    found = []
    for proc in children:
        if proc.role != "pool":
            continue
        try:
            wchan = Path(f"/proc/{proc.pid}/wchan").read_text()
        except OSError:
            continue
        # Python >= 3.11 sleeps in clock_nanosleep, older ones in select.
        if "nanosleep" in wchan or "select" in wchan:
            found.append(proc)
    return found
