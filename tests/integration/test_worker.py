"""The reference worker as a real subprocess on a temporary run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

HOST = "worker-0"
SHARD = 0
# Generous: the machine is shared and noisy; a passing test never waits this long.
TIMEOUT_S = 30.0
# Short heartbeats keep the tests fast; the worker's logic does not depend on the value.
FAST_BEAT = "0.05"
# How long "nothing happens" is watched for: twenty heartbeat intervals at FAST_BEAT.
QUIET_WINDOW_S = 1.0

REWARD_MODULE = """
import os

def counting(task):
    # One short O_APPEND write per call: lines from concurrent threads never interleave.
    with open(os.environ["COUNT_LOG"], "a") as f:
        f.write(task["id"] + "\\n")
    return 1.0 if str(task.get("answer")).strip() == str(task.get("reference")).strip() else 0.0

def boom(task):
    if task.get("explode"):
        raise KeyError("no verifier")
    return 1.0
"""


def wait_for(predicate: Callable[[], T | None], what: str, timeout_s: float = TIMEOUT_S) -> T:
    """Poll ``predicate`` until it returns something other than None/False; fail after timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)  # wait-ok: poll interval of a deadline loop


def holds_for(predicate: Callable[[], bool], window_s: float) -> bool:
    """True if ``predicate`` stays true for the whole window (a negative observation)."""
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(0.02)  # wait-ok: sampling interval of an observation window
    return predicate()


def read_json(path: Path) -> Any:
    """Parsed JSON of ``path``, or None when it is missing."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None


def write_task(root: Path, name: str, task: Mapping[str, Any], shard: int = SHARD) -> None:
    """Put a task into the shard inbox the way a trainer does: temp file, then rename."""
    inbox = root / "inbox" / str(shard)
    inbox.mkdir(parents=True, exist_ok=True)
    tmp = inbox / f".{name}.tmp"
    tmp.write_text(json.dumps(task))
    os.replace(tmp, inbox / f"{name}.json")


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped mid-read
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@dataclass
class Worker:
    """A running worker subprocess and its run directory."""

    proc: subprocess.Popen[bytes]
    root: Path
    log_path: Path

    @property
    def status_path(self) -> Path:
        """The worker's heartbeat file."""
        return self.root / "status" / f"{HOST}.json"

    def status(self) -> dict[str, Any] | None:
        """The current heartbeat, or None before the first one."""
        return read_json(self.status_path)  # type: ignore[no-any-return]

    def log_events(self) -> list[dict[str, Any]]:
        """The worker's JSON log lines so far."""
        events = []
        for line in self.log_path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a traceback or a partial last line
        return events

    def has_event(self, event: str) -> dict[str, Any] | None:
        """The first logged event named ``event``, or None."""
        return next((e for e in self.log_events() if e.get("event") == event), None)

    def wait_ready(self) -> dict[str, Any]:
        """Wait for a ready heartbeat from this process and return it."""

        def ready() -> dict[str, Any] | None:
            status = self.status()
            return status if status and status["ready"] and status["pid"] == self.proc.pid else None

        return wait_for(ready, "a ready heartbeat")

    def wait_exit(self) -> int:
        """Wait for the process to end; its return code (negative: killed by that signal)."""
        return self.proc.wait(timeout=TIMEOUT_S)

    def outbox(self) -> dict[str, dict[str, Any]]:
        """Every result in the outbox, by file stem."""
        results = {}
        for path in (self.root / "outbox").glob("*.json"):
            results[path.stem] = json.loads(path.read_bytes())
        return results

    def inbox_names(self) -> list[str]:
        """File names left in the shard inbox (not its .bad/ directory)."""
        inbox = self.root / "inbox" / str(SHARD)
        return sorted(p.name for p in inbox.iterdir() if p.is_file())


StartWorker = Callable[..., Worker]


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    """The run directory the workers of a test serve."""
    root = tmp_path / "run"
    root.mkdir()
    return root


@pytest.fixture
def start_worker(tmp_path: Path, run_root: Path) -> Iterator[StartWorker]:
    """Start workers on ``run_root``; every one still running is killed at teardown."""
    started: list[Worker] = []
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "rewards_for_test.py").write_text(REWARD_MODULE)

    def start(
        *,
        fault: str | None = None,
        env: Mapping[str, str] | None = None,
        concurrency: int = 2,
        extra: tuple[str, ...] = (),
    ) -> Worker:
        root = run_root
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(modules), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        full_env["COUNT_LOG"] = str(tmp_path / "count.log")
        for name in ("REWARD_WORKER_FAULT", "REWARD_WORKER_CLOCK_OFFSET_S"):
            full_env.pop(name, None)
        full_env.pop("REWARD_WORKER_TASK_DELAY_S", None)
        if fault is not None:
            full_env["REWARD_WORKER_FAULT"] = fault
        full_env.update(env or {})
        log_path = tmp_path / f"worker-{len(started)}.log"
        argv = [
            sys.executable,
            "-m",
            "supervisor.demo.worker",
            "--root",
            str(root),
            "--shard",
            str(SHARD),
            "--host",
            HOST,
            "--concurrency",
            str(concurrency),
            "--heartbeat-interval",
            FAST_BEAT,
            *extra,
        ]
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=full_env
            )
        worker = Worker(proc=proc, root=root, log_path=log_path)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait(timeout=TIMEOUT_S)


# -- heartbeats ----------------------------------------------------------------------------


def test_heartbeats_advance_and_are_never_seen_partial(start_worker: StartWorker) -> None:
    """A reader looping on the status file sees only whole JSON, seq never going back, no litter."""
    worker = start_worker(extra=("--heartbeat-interval", "0.005"))
    first = worker.wait_ready()
    assert first["host"] == HOST
    assert first["shard"] == SHARD
    assert isinstance(first["heartbeat_at"], float)
    seqs: list[int] = []
    stamps: set[float] = set()
    # At least 1.5 s of reads, and on until ten heartbeats were seen: a loaded box may run
    # the worker far less often than every 5 ms.
    least = time.monotonic() + 1.5
    deadline = least + 30.0
    while time.monotonic() < least or (
        (len(set(seqs)) < 10 or len(stamps) < 10) and time.monotonic() < deadline
    ):
        raw = worker.status_path.read_bytes()  # os.replace: the file always exists once written
        status = json.loads(raw)  # raises, failing the test, on a torn read
        assert status["pid"] == worker.proc.pid
        assert status["ready"] is True
        seqs.append(status["seq"])
        stamps.add(status["heartbeat_at"])
    assert seqs == sorted(seqs)
    assert len(set(seqs)) >= 10
    assert len(stamps) >= 10
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
    assert [p.name for p in worker.status_path.parent.iterdir()] == [f"{HOST}.json"]


def test_status_has_every_contract_field(start_worker: StartWorker) -> None:
    """The heartbeat carries ready, heartbeat_at, pid, seq, host, shard, started_at and counters."""
    worker = start_worker()
    status = worker.wait_ready()
    for field in ("started_at", "processed", "in_flight", "failed"):
        assert field in status
    assert status["processed"] == status["in_flight"] == status["failed"] == 0
    assert status["started_at"] <= status["heartbeat_at"]


def test_clock_offset_shifts_every_wall_clock_stamp(start_worker: StartWorker) -> None:
    """REWARD_WORKER_CLOCK_OFFSET_S moves heartbeat_at and started_at by that many seconds."""
    worker = start_worker(env={"REWARD_WORKER_CLOCK_OFFSET_S": "-3600"})
    status = worker.wait_ready()
    now = time.time()
    # An hour is far outside any scheduling noise; 60 s of slack on each side is generous.
    assert now - 3600 - 60 < status["heartbeat_at"] < now - 3600 + 60
    assert now - 3600 - 60 < status["started_at"] < now - 3600 + 60


# -- tasks ---------------------------------------------------------------------------------


def test_hundreds_of_tasks_are_processed_exactly_once(
    start_worker: StartWorker, run_root: Path
) -> None:
    """300 tasks, some written before start and some during, each get one result and one call."""
    total = 300

    def task(i: int) -> dict[str, Any]:
        return {"id": f"t{i:04d}", "answer": str(i % 3), "reference": "0"}

    for i in range(total // 2):
        write_task(run_root, f"t{i:04d}", task(i))
    # The colon form of the flag, and a reward fn that logs every call.
    worker = start_worker(concurrency=4, extra=("--reward-fn", "rewards_for_test:counting"))
    worker.wait_ready()
    for i in range(total // 2, total):
        write_task(run_root, f"t{i:04d}", task(i))

    wait_for(lambda: len(worker.outbox()) >= total and not worker.inbox_names(), "all results")
    results = worker.outbox()
    assert sorted(results) == [f"t{i:04d}" for i in range(total)]
    for i in range(total):
        result = results[f"t{i:04d}"]
        assert result["reward"] == (1.0 if i % 3 == 0 else 0.0)
        assert result["pid"] == worker.proc.pid
        assert result["host"] == HOST
        assert "error" not in result
    calls = (worker.root.parent / "count.log").read_text().split()
    assert sorted(calls) == sorted(results)  # each id computed exactly once
    final = wait_for(
        lambda: (s := worker.status()) and s["processed"] == total and s, "processed counter"
    )
    assert final["failed"] == 0
    assert not [p for p in (worker.root / "outbox").iterdir() if p.name.startswith(".")]
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


def test_manifest_reward_fn_is_used_without_the_flag(
    start_worker: StartWorker, run_root: Path
) -> None:
    """Without --reward-fn the worker imports the manifest's reward_fn."""
    (run_root / "manifest.json").write_text(json.dumps({"reward_fn": "rewards_for_test.counting"}))
    run = start_worker()
    assert run.wait_ready()["reward_fn"] == "rewards_for_test.counting"
    write_task(run.root, "m1", {"id": "m1", "answer": "x", "reference": "x"})
    result = wait_for(lambda: run.outbox().get("m1"), "the result")
    assert result["reward"] == 1.0
    assert "error" not in result
    assert (run.root.parent / "count.log").read_text().split() == ["m1"]


def test_existing_result_only_removes_the_inbox_file(start_worker: StartWorker) -> None:
    """A task whose result exists (its worker died before the unlink) is not computed again."""
    worker = start_worker()
    worker.wait_ready()
    (worker.root / "outbox" / "dup.json").write_text('{"marker": true}')
    write_task(worker.root, "dup", {"answer": "1", "reference": "1"})
    wait_for(lambda: not worker.inbox_names(), "the inbox file to go")
    assert read_json(worker.root / "outbox" / "dup.json") == {"marker": True}


def test_hidden_and_temp_files_are_left_alone(start_worker: StartWorker) -> None:
    """Files named .*.json or *.json.tmp in the inbox are never taken as tasks."""
    worker = start_worker()
    worker.wait_ready()
    inbox = worker.root / "inbox" / str(SHARD)
    (inbox / ".hidden.json").write_text('{"answer": "1"}')
    (inbox / "partial.json.tmp").write_text('{"answ')
    write_task(worker.root, "real", {"answer": "1", "reference": "1"})
    wait_for(lambda: "real" in worker.outbox(), "the real task's result")
    assert sorted(p.name for p in inbox.iterdir() if p.is_file()) == [
        ".hidden.json",
        "partial.json.tmp",
    ]
    assert set(worker.outbox()) == {"real"}


def test_failing_reward_fn_yields_error_result_and_worker_carries_on(
    start_worker: StartWorker,
) -> None:
    """A reward fn that raises gives reward 0.0 with the error; later tasks still succeed."""
    worker = start_worker(extra=("--reward-fn", "rewards_for_test.boom"))
    worker.wait_ready()
    write_task(worker.root, "bad", {"explode": True})
    wait_for(lambda: "bad" in worker.outbox(), "the error result")
    write_task(worker.root, "good", {})
    wait_for(lambda: "good" in worker.outbox(), "the next result")
    results = worker.outbox()
    assert results["bad"]["reward"] == 0.0
    assert results["bad"]["error"] == "KeyError: 'no verifier'"
    assert results["good"]["reward"] == 1.0
    status = wait_for(lambda: (s := worker.status()) and s["processed"] == 2 and s, "counters")
    assert status["failed"] == 1
    assert worker.proc.poll() is None


def test_malformed_task_is_quarantined_with_an_error_result(start_worker: StartWorker) -> None:
    """A task file that never parses moves to inbox/<shard>/.bad/ and gets an error result."""
    worker = start_worker()
    worker.wait_ready()
    inbox = worker.root / "inbox" / str(SHARD)
    (inbox / "junk.json").write_bytes(b"{definitely not json")
    wait_for(lambda: (inbox / ".bad" / "junk.json").exists(), "quarantine")
    assert (inbox / ".bad" / "junk.json").read_bytes() == b"{definitely not json"
    result = wait_for(lambda: worker.outbox().get("junk"), "the error result")
    assert result["reward"] == 0.0
    assert result["error"].startswith("malformed task: not JSON")
    # Logged last, after the result and the move: seen a moment after them.
    wait_for(lambda: worker.has_event("task.malformed"), "the task.malformed line")
    write_task(worker.root, "after", {"answer": "1", "reference": "1"})
    wait_for(lambda: "after" in worker.outbox(), "a later task")


def test_task_written_in_place_is_not_quarantined_while_being_written(
    start_worker: StartWorker,
) -> None:
    """A non-atomic writer that finishes the file within the grace period loses nothing."""
    worker = start_worker()
    worker.wait_ready()
    path = worker.root / "inbox" / str(SHARD) / "slow.json"
    with path.open("w") as f:
        f.write('{"id": "slow", "answer": "1",')
        f.flush()
        # Let the worker see the partial file at least a few scans before finishing it.
        time.sleep(0.2)  # wait-ok: the partial state is the point; no event marks "scanned"
        f.write(' "reference": "1"}')
    result = wait_for(lambda: worker.outbox().get("slow"), "the result")
    assert result["reward"] == 1.0
    assert not (worker.root / "inbox" / str(SHARD) / ".bad").exists()


# -- stopping ------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_finishes_in_flight_tasks_then_exits_0(
    start_worker: StartWorker, signum: signal.Signals
) -> None:
    """SIGTERM/SIGINT: no new task is taken, in-flight ones finish, last heartbeat is not ready."""
    worker = start_worker(concurrency=2, env={"REWARD_WORKER_TASK_DELAY_S": "2"})
    for i in range(5):
        write_task(worker.root, f"s{i}", {"answer": "1", "reference": "1"})
    wait_for(lambda: (s := worker.status()) and s["in_flight"] == 2, "two tasks in flight")
    worker.proc.send_signal(signum)
    assert worker.wait_exit() == 0
    results = worker.outbox()
    assert len(results) == 2
    assert all(r["reward"] == 1.0 for r in results.values())
    assert len(worker.inbox_names()) == 3
    assert not set(worker.inbox_names()) & {f"{name}.json" for name in results}
    final = worker.status()
    assert final is not None
    assert final["ready"] is False
    assert final["in_flight"] == 0
    assert final["processed"] == 2
    assert worker.has_event("worker.stopped") is not None


def test_idle_worker_stops_promptly_on_sigterm(start_worker: StartWorker) -> None:
    """An idle worker exits 0 on SIGTERM, leaving a final not-ready heartbeat with a higher seq."""
    worker = start_worker()
    ready = worker.wait_ready()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
    final = worker.status()
    assert final is not None
    assert final["ready"] is False
    assert final["seq"] > ready["seq"]


# -- startup failures ----------------------------------------------------------------------


def test_unimportable_reward_fn_exits_2_and_never_becomes_ready(start_worker: StartWorker) -> None:
    """A reward fn that cannot be imported is fatal: exit 2, a clear log line, never ready."""
    worker = start_worker(extra=("--reward-fn", "no_such_module_xyz.reward"))
    assert worker.wait_exit() == 2
    event = worker.has_event("worker.reward_fn_failed")
    assert event is not None
    assert "no_such_module_xyz" in event["error"]
    status = worker.status()
    assert status is None or status["ready"] is False


def test_unimportable_manifest_reward_fn_exits_2(start_worker: StartWorker, run_root: Path) -> None:
    """The manifest's reward_fn gets the same treatment as the flag's."""
    (run_root / "manifest.json").write_text(json.dumps({"reward_fn": "areal.reward.nope.fn"}))
    run = start_worker()
    assert run.wait_exit() == 2
    event = run.has_event("worker.reward_fn_failed")
    assert event is not None
    assert "areal" in event["error"]


@pytest.mark.parametrize(
    "env",
    [
        {"REWARD_WORKER_FAULT": "explode"},
        {"REWARD_WORKER_TASK_DELAY_S": "soon"},
        {"REWARD_WORKER_CLOCK_OFFSET_S": "nan"},
    ],
)
def test_bad_test_environment_exits_2(start_worker: StartWorker, env: dict[str, str]) -> None:
    """A malformed fault spec or timing variable is refused at start with exit 2."""
    worker = start_worker(env=env)
    assert worker.wait_exit() == 2
    assert worker.has_event("worker.bad_environment") is not None


# -- faults --------------------------------------------------------------------------------


def test_abort_on_start_exits_3_before_writing_anything(start_worker: StartWorker) -> None:
    """abort_on_start: exit 3 with no heartbeat at all."""
    worker = start_worker(fault="abort_on_start")
    assert worker.wait_exit() == 3
    assert worker.status() is None


def test_crash_exits_with_its_code_after_being_ready(start_worker: StartWorker) -> None:
    """crash:after=S:code=N: ready first, then exit N with no final not-ready heartbeat."""
    worker = start_worker(fault="crash:after=0.2:code=7")
    worker.wait_ready()
    assert worker.wait_exit() == 7
    last = worker.status()
    assert last is not None
    assert last["ready"] is True
    assert worker.has_event("worker.stopped") is None


def test_exit0_exits_cleanly_but_unexpectedly(start_worker: StartWorker) -> None:
    """exit0: status 0 without a stop signal, and the last heartbeat still says ready."""
    worker = start_worker(fault="exit0:after=0.2")
    worker.wait_ready()
    assert worker.wait_exit() == 0
    last = worker.status()
    assert last is not None
    assert last["ready"] is True
    assert worker.has_event("worker.stopped") is None


def test_hang_stops_heartbeats_and_tasks_but_dies_on_sigterm(start_worker: StartWorker) -> None:
    """hang: alive, no heartbeats, no tasks; SIGTERM kills it by signal, status left as it was."""
    worker = start_worker(fault="hang:after=0.2")
    worker.wait_ready()
    wait_for(lambda: worker.has_event("worker.fault"), "the hang to start")
    frozen = worker.status_path.read_bytes()
    write_task(worker.root, "ignored", {"answer": "1", "reference": "1"})
    assert holds_for(
        lambda: worker.proc.poll() is None and worker.status_path.read_bytes() == frozen,
        QUIET_WINDOW_S,
    )
    assert worker.outbox() == {}
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == -signal.SIGTERM
    assert worker.status_path.read_bytes() == frozen


def test_hang_ignore_term_survives_sigterm_until_sigkill(start_worker: StartWorker) -> None:
    """hang_ignore_term: heartbeats stop, SIGTERM changes nothing, SIGKILL ends it."""
    worker = start_worker(fault="hang_ignore_term:after=0")
    worker.wait_ready()
    wait_for(lambda: worker.has_event("worker.fault"), "the hang to start")
    frozen = worker.status_path.read_bytes()
    worker.proc.send_signal(signal.SIGTERM)
    assert holds_for(
        lambda: worker.proc.poll() is None and worker.status_path.read_bytes() == frozen,
        QUIET_WINDOW_S,
    )
    assert is_alive(worker.proc.pid)
    worker.proc.kill()
    assert worker.wait_exit() == -signal.SIGKILL


def test_slow_start_heartbeats_not_ready_until_ready_after(start_worker: StartWorker) -> None:
    """slow_start:ready_after=S: not-ready heartbeats first; ready no earlier than S after start."""
    worker = start_worker(fault="slow_start:ready_after=1")
    seen_not_ready: set[int] = set()

    def ready() -> dict[str, Any] | None:
        status = worker.status()
        if status is None:
            return None
        if not status["ready"]:
            seen_not_ready.add(status["seq"])
            return None
        return status

    status = wait_for(ready, "ready after the slow start")
    assert seen_not_ready  # at least one not-ready heartbeat came first
    assert status["seq"] > max(seen_not_ready)
    # A lower bound only: the fault must never let the worker be ready early.
    assert status["heartbeat_at"] - status["started_at"] >= 1.0


def test_never_ready_heartbeats_forever_and_takes_no_task(start_worker: StartWorker) -> None:
    """never_ready: heartbeats keep advancing with ready false and the inbox is not touched."""
    worker = start_worker(fault="never_ready")
    write_task(worker.root, "waiting", {"answer": "1", "reference": "1"})
    readiness: list[bool] = []

    def advanced() -> bool:
        status = worker.status()
        if status is None:
            return False
        readiness.append(status["ready"])
        return bool(status["seq"] >= 20)

    wait_for(advanced, "twenty heartbeats")
    assert not any(readiness)
    assert worker.inbox_names() == ["waiting.json"]
    assert worker.outbox() == {}
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
