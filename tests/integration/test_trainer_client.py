"""``tests.areal.ContractClient``, the trainer client the fault tests use where areal-fs is
absent, against the contract: the same outcome as the real ``FSRewardClient`` in the same run
directory, for each situation a trainer can meet (a worker's answer played by the test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import areal as A
from tests import shared

HOSTS = ("h0", "h1")
SHARDS = 2
#: What a call scores with (the worker is played by the test: no reward fn runs).
REWARD_FN = "tests.rewardfns.exact"
#: A task's timeout where the situation is "no result": short, so the test is.
SHORT_TIMEOUT_S = 0.5
# Generous: the machine is shared and noisy; a passing call never waits this long.
CALL_DEADLINE_S = 30.0
#: The fields of a task record (areal-fs README: the real task record).
TASK_FIELDS = frozenset({"schema_version", "task_id", "reward_fn", "args", "kwargs", "created_at"})

#: An answer of the played worker to a task record: the result record, or None for none.
Answer = Callable[[Mapping[str, Any]], dict[str, Any] | None]


def result(status: str, score: float | None = None, error: str | None = None) -> Answer:
    """An answer with this status, score and error (the real result record's other fields)."""

    def answer(task: Mapping[str, Any]) -> dict[str, Any]:
        """The result record of ``task``."""
        return {
            "schema_version": 1,
            "task_id": task["task_id"],
            "status": status,
            "score": score,
            "error": error,
            "queue_wait_ms": 1.0,
            "verify_ms": 1.0,
            "total_ms": 2.0,
            "worker_host": HOSTS[0],
            "shard": 0,
            "finished_at": time.time(),
        }

    return answer


def no_answer(task: Mapping[str, Any]) -> None:
    """No result at all: a stuck worker."""
    return None


@dataclass(frozen=True, slots=True)
class Beat:
    """A status file whose heartbeat is ``age_s`` old when it is written (``ready`` None: no
    such field)."""

    age_s: float = 0.0
    ready: bool | None = True

    def render(self) -> bytes:
        """The file's bytes, stamped now."""
        record: dict[str, Any] = {"heartbeat_at": time.time() - self.age_s, "pid": 1}
        if self.ready is not None:
            record["ready"] = self.ready
        return json.dumps(record).encode()


@dataclass(frozen=True, slots=True)
class Situation:
    """A run directory as a trainer may find it, and a played worker's answer."""

    #: Status file per host (bytes as they are, None: no file); hosts not named get a fresh,
    #: ready one.
    statuses: Mapping[str, Beat | bytes | None] = field(default_factory=dict)
    #: manifest.json bytes (None: no manifest).
    manifest: bytes | None = json.dumps({"shard_count": SHARDS}).encode()
    answer: Answer = field(default_factory=lambda: result("ok", 1.0))
    timeout_s: float = A.CONTRACT_TIMEOUT_S


#: name -> (situation, expected outcome: ("ok", score) or ("failed", kind)).
SITUATIONS: dict[str, tuple[Situation, tuple[str, object]]] = {
    "scored": (Situation(), ("ok", 1.0)),
    "scored_zero": (Situation(answer=result("ok", 0.0)), ("ok", 0.0)),
    "error_result": (
        Situation(answer=result("error", None, "ValueError: boom")),
        ("failed", A.TASK_FAILED),
    ),
    "timeout_result": (Situation(answer=result("timeout")), ("failed", A.TASK_FAILED)),
    "no_result": (Situation(answer=no_answer, timeout_s=SHORT_TIMEOUT_S), ("failed", A.TIMEOUT)),
    "status_missing": (Situation(statuses={"h1": None}), ("failed", A.OTHER)),
    "status_not_json": (Situation(statuses={"h1": b"{not json"}), ("failed", A.OTHER)),
    "not_ready": (Situation(statuses={"h1": Beat(ready=False)}), ("failed", A.NOT_READY)),
    "stale": (Situation(statuses={"h0": Beat(age_s=20)}), ("failed", A.HEARTBEAT_STALE)),
    "stale_and_not_ready": (
        Situation(statuses={"h0": Beat(age_s=20, ready=False)}),
        ("failed", A.HEARTBEAT_STALE),
    ),
    "old_but_fresh": (Situation(statuses={"h0": Beat(age_s=10)}), ("ok", 1.0)),
    "from_the_future": (Situation(statuses={"h0": Beat(age_s=-60)}), ("ok", 1.0)),
    "no_ready_field": (Situation(statuses={"h1": Beat(ready=None)}), ("ok", 1.0)),
    "no_heartbeat_at": (
        Situation(statuses={"h1": json.dumps({"ready": True}).encode()}),
        ("failed", A.HEARTBEAT_STALE),
    ),
    "manifest_missing": (Situation(manifest=None), ("failed", A.OTHER)),
    "manifest_other_shards": (
        Situation(manifest=json.dumps({"shard_count": 3}).encode()),
        ("failed", A.OTHER),
    ),
}


def prepare(root: Path, situation: Situation) -> None:
    """Lay out ``root`` as ``situation`` says (from scratch: a previous client's files go)."""
    for sub in ("inbox", "outbox", "status"):
        for path in sorted((root / sub).rglob("*"), reverse=True):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
    for shard in range(SHARDS):
        (root / "inbox" / str(shard)).mkdir(parents=True, exist_ok=True)
    (root / "outbox").mkdir(exist_ok=True)
    (root / "status").mkdir(exist_ok=True)
    manifest = root / "manifest.json"
    manifest.unlink(missing_ok=True)
    if situation.manifest is not None:
        manifest.write_bytes(situation.manifest)
    for host in HOSTS:
        data = situation.statuses.get(host, Beat())
        if isinstance(data, Beat):
            data = data.render()
        if data is not None:
            (root / "status" / f"{host}.json").write_bytes(data)


@dataclass
class PlayedWorker:
    """Answers every task file that appears in ``root``'s inbox with ``answer``, as a worker
    does (result first, then the inbox file goes); remembers each task's path and record."""

    root: Path
    answer: Answer
    tasks: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)

    async def run(self) -> None:
        """Poll the inbox every 10 ms until cancelled."""
        seen: set[Path] = set()
        while True:
            present = set((self.root / "inbox").glob("*/*.json"))
            for path in sorted(present - seen):
                seen.add(path)
                record = json.loads(path.read_bytes())
                self.tasks.append((path, record))
                answer = self.answer(record)
                if answer is not None:
                    out = self.root / "outbox" / f"{record['task_id']}.json"
                    tmp = out.with_name(f".{out.name}.tmp")
                    tmp.write_text(json.dumps(answer))
                    tmp.rename(out)
                    path.unlink()
            await asyncio.sleep(0.01)  # wait-ok: the played worker's poll interval


@contextlib.asynccontextmanager
async def played_worker(root: Path, answer: Answer) -> AsyncIterator[PlayedWorker]:
    """A :class:`PlayedWorker` running while in the block."""
    worker = PlayedWorker(root, answer)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(frozen=True, slots=True)
class Seen:
    """What one call came to, and what it left in the run directory."""

    outcome: tuple[str, object]
    message: str
    tasks: list[tuple[Path, dict[str, Any]]]
    inbox_left: list[Path]
    outbox_left: list[Path]


def make_client(kind: str, root: Path, timeout_s: float) -> tuple[Any, type[BaseException]]:
    """The client ``kind`` ("contract" or "real") with the contract's defaults but the
    timeout, and the exception its failed calls raise."""
    if kind == "contract":
        return (
            A.ContractClient(
                REWARD_FN, root=root, shard_count=SHARDS, worker_hosts=HOSTS, timeout_s=timeout_s
            ),
            A.ContractCallFailed,
        )
    module = A.client_module(shared.require(shared.AREAL))
    client = module.FSRewardClient(
        REWARD_FN,
        root=str(root),
        shard_count=SHARDS,
        worker_hosts=list(HOSTS),
        timeout_seconds=timeout_s,
    )
    return client, module.RewardInfraError


async def call_in(root: Path, situation: Situation, kind: str) -> Seen:
    """One call of client ``kind`` in ``root`` laid out as ``situation``."""
    prepare(root, situation)
    client, error = make_client(kind, root, situation.timeout_s)
    message = ""
    async with played_worker(root, situation.answer) as worker:
        try:
            async with asyncio.timeout(CALL_DEADLINE_S):
                score = await client(A.PROMPT, A.COMPLETIONS, answer=A.ANSWER)
        except error as exc:
            message = str(exc)
            found = exc.kind if isinstance(exc, A.ContractCallFailed) else A.classify(message)
            outcome: tuple[str, object] = ("failed", found)
        else:
            outcome = ("ok", score)
    return Seen(
        outcome=outcome,
        message=message,
        tasks=worker.tasks,
        inbox_left=sorted((root / "inbox").glob("*/*.json")),
        outbox_left=sorted((root / "outbox").glob("*.json")),
    )


@pytest.fixture(params=["contract", "real"])
def clients(request: pytest.FixtureRequest) -> list[str]:
    """The clients a test runs in one run directory: ours alone, or (where areal-fs is) the
    real one and ours, to compare."""
    if request.param == "contract":
        return ["contract"]
    shared.require(shared.AREAL)
    return ["real", "contract"]


@pytest.mark.parametrize("name", list(SITUATIONS))
async def test_the_contract_client_fails_and_scores_as_the_real_one(
    name: str, clients: list[str], tmp_path: Path
) -> None:
    """In each situation the call scores or fails with the expected kind, and both clients in
    the same run directory do the same: the same outcome, the same task written (or none),
    nothing left in the inbox or the outbox."""
    situation, expected = SITUATIONS[name]
    root = tmp_path / "run"
    seen = {kind: await call_in(root, situation, kind) for kind in clients}
    for kind, got in seen.items():
        assert got.outcome == expected, f"{kind}: {got.outcome} ({got.message})"
        assert got.inbox_left == [], f"{kind} left its task in the inbox"
        assert got.outbox_left == [], f"{kind} left its result in the outbox"
        wrote = expected[0] == "ok" or expected[1] in (A.TASK_FAILED, A.TIMEOUT)
        assert len(got.tasks) == (1 if wrote else 0), f"{kind}: {got.tasks}"
        if expected[1] == A.TASK_FAILED:
            error = situation.answer(got.tasks[0][1])
            assert error is not None
            assert str(error["error"] or error["status"]) in got.message, got.message
    if len(seen) == 2:
        real, ours = seen["real"], seen["contract"]
        assert [sorted(r) for _, r in real.tasks] == [sorted(r) for _, r in ours.tasks]


async def test_the_contract_client_writes_the_task_record_into_its_shard(
    clients: list[str], tmp_path: Path
) -> None:
    """A call writes one task record with the contract's fields (a fresh task id naming the
    file, the reward fn, the call's answer) into ``inbox/<shard of its id>/``, the shard the
    real client's own ``stable_shard`` gives too where areal-fs is."""
    situation = Situation()
    for kind in clients:
        seen = await call_in(tmp_path / kind, situation, kind)
        assert seen.outcome == ("ok", 1.0), seen.message
        [(path, record)] = seen.tasks
        assert set(record) == TASK_FIELDS, record
        assert path.name == f"{record['task_id']}.json"
        assert record["reward_fn"] == REWARD_FN
        assert record["args"][:2] == [A.PROMPT, A.COMPLETIONS]
        assert record["kwargs"] == {"answer": A.ANSWER}
        assert path.parent.name == str(A.contract_shard(record["task_id"], SHARDS))
        if "real" in clients:
            areal = shared.require(shared.AREAL)
            assert path.parent.name == str(A.stable_shard(areal, record["task_id"], SHARDS))


def test_the_contract_shard_is_the_real_clients_for_every_shard_count(areal_fs: Path) -> None:
    """``contract_shard`` sends every task id where AReaL's ``stable_shard`` does, for shard
    counts from 1 to 64 (where areal-fs is)."""
    ids = [uuid.uuid4().hex for _ in range(500)] + ["", "a", "é/é", "x" * 300]
    for count in (1, 2, 3, 4, 7, 16, 64):
        ours = [A.contract_shard(task_id, count) for task_id in ids]
        real = [A.stable_shard(areal_fs, task_id, count) for task_id in ids]
        assert ours == real, count
    assert len({A.contract_shard(task_id, 64) for task_id in ids}) > 32
