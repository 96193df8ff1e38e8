"""The reference worker as a real subprocess (in its own session, as a shepherd starts it) on a
temporary run directory: the real task and result records, its process pool, its heartbeat,
its stop, its faults; and, where areal-fs is (``tests/shared.py``; skipped, named, where it is
absent), the real trainer client against it and the real worker's heartbeat beside its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
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
EXACT_MATCH = "supervisor.demo.worker.exact_match"
#: The real worker's heartbeat fields (areal.reward.fs_worker._write_status).
REAL_STATUS_FIELDS = frozenset(
    [
        "host",
        "shard",
        "ready",
        "heartbeat_at",
        "started_at",
        "pid",
        "concurrency",
        "inflight",
        "queue_depth",
        "qps",
        "completed",
        "errors",
        "semantic_zero",
        "verify_timeout_n",
        "queue_wait_ms_p50",
        "queue_wait_ms_p95",
        "verify_ms_p50",
        "verify_ms_p95",
        "rss_gib",
    ]
)
#: The real result record's fields (areal.reward.fs_protocol.build_result).
RESULT_FIELDS = frozenset(
    [
        "schema_version",
        "task_id",
        "status",
        "score",
        "error",
        "queue_wait_ms",
        "verify_ms",
        "total_ms",
        "worker_host",
        "shard",
        "finished_at",
    ]
)

REWARD_MODULE = """
import os
import time


def counting(prompt, completions, prompt_ids=None, completion_ids=None, answer=None, **kw):
    # One short O_APPEND write per call: lines from concurrent processes never interleave.
    with open(os.environ["COUNT_LOG"], "a") as f:
        f.write(f"{kw.get('tag')} {os.getpid()}\\n")
    return 1.0 if str(answer) in str(completions) else 0.0


def boom(*args, explode=False, **kw):
    if explode:
        raise KeyError("no verifier")
    return 1.0


def die(*args, **kw):
    os._exit(1)  # the pool process dies under the call, as a segfault would end it


def slow(*args, seconds=0.0, **kw):
    time.sleep(seconds)
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


def task_record(
    task_id: str,
    reward_fn: str = EXACT_MATCH,
    *,
    completions: str = "the answer is 1",
    answer: object = "1",
    **kwargs: object,
) -> dict[str, Any]:
    """A task as FSRewardClient writes it: args (prompt, completions, [], []), kwargs."""
    return {
        "schema_version": 1,
        "task_id": task_id,
        "reward_fn": reward_fn,
        "args": ["prompt", completions, [], []],
        "kwargs": {"answer": answer, **kwargs},
        "created_at": time.time(),
    }


def write_task(root: Path, record: Mapping[str, Any], shard: int = SHARD) -> Path:
    """Put a task into the shard inbox the way the client does: temp file, then rename."""
    inbox = root / "inbox" / str(shard)
    inbox.mkdir(parents=True, exist_ok=True)
    tmp = inbox / f".{record['task_id']}.tmp"
    tmp.write_text(json.dumps(record))
    path = inbox / f"{record['task_id']}.json"
    os.replace(tmp, path)
    return path


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped mid-read
        return None
    return stat.rpartition(")")[2].split()


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat is not None and stat[0] != "Z" and int(stat[2]) == pgid:
                members.append(int(name))
    return members


def cmdline(pid: int) -> str:
    """The command line of ``pid``, space-joined ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class Worker:
    """A running worker subprocess (leader of its own process group) and its run directory."""

    proc: subprocess.Popen[bytes]
    root: Path
    log_path: Path

    @property
    def pid(self) -> int:
        """The coordinator's pid (also its process group and session)."""
        return self.proc.pid

    @property
    def status_path(self) -> Path:
        """The worker's heartbeat file."""
        return self.root / "status" / f"{HOST}.json"

    def status(self) -> dict[str, Any] | None:
        """The current heartbeat, or None before the first one."""
        return read_json(self.status_path)  # type: ignore[no-any-return]

    def log_events(self) -> list[dict[str, Any]]:
        """The worker's JSON log lines so far (its pool processes' included)."""
        events = []
        for line in self.log_path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a traceback, a stack dump or a partial last line
        return events

    def has_event(self, event: str) -> dict[str, Any] | None:
        """The first logged event named ``event``, or None."""
        return next((e for e in self.log_events() if e.get("event") == event), None)

    def wait_ready(self) -> dict[str, Any]:
        """Wait for a ready heartbeat from this process and return it."""

        def ready() -> dict[str, Any] | None:
            status = self.status()
            return status if status and status["ready"] and status["pid"] == self.pid else None

        return wait_for(ready, "a ready heartbeat")

    def wait_status(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        """Wait for a heartbeat of this process for which ``predicate`` holds."""

        def matching() -> dict[str, Any] | None:
            status = self.status()
            if status is None or status["pid"] != self.pid:
                return None
            return status if predicate(status) else None

        return wait_for(matching, what)

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
        """File names left in the shard inbox."""
        inbox = self.root / "inbox" / str(SHARD)
        return sorted(p.name for p in inbox.iterdir() if p.is_file())

    def pool_pids(self) -> list[int]:
        """The live pool processes: spawned children in the worker's group."""
        return [
            pid
            for pid in group_members(self.pid)
            if pid != self.pid and "spawn_main" in cmdline(pid)
        ]

    def wait_group_gone(self) -> None:
        """Wait until no process of the worker's group is alive (pool processes included)."""
        wait_for(lambda: not group_members(self.pid), "every process of the worker's group to end")


StartWorker = Callable[..., Worker]


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    """The run directory the workers of a test serve."""
    root = tmp_path / "run"
    root.mkdir()
    return root


@pytest.fixture
def start_worker(tmp_path: Path, run_root: Path) -> Iterator[StartWorker]:
    """Start workers on ``run_root``, each leading its own session as under a shepherd; every
    group still alive at teardown is killed whole."""
    started: list[Worker] = []
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "rewards_for_test.py").write_text(REWARD_MODULE)
    (modules / "rewards_broken.py").write_text("def score(:\n    return 1.0\n")

    def start(
        *,
        fault: str | None = None,
        env: Mapping[str, str] | None = None,
        concurrency: int = 2,
        extra: tuple[str, ...] = (),
    ) -> Worker:
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
            *(sys.executable, "-m", "supervisor.demo.worker", "--root", str(run_root)),
            *("--shard", str(SHARD), "--host", HOST, "--concurrency", str(concurrency)),
            *("--heartbeat-interval", FAST_BEAT, *extra),
        ]
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=full_env,
                start_new_session=True,
            )
        worker = Worker(proc=proc, root=run_root, log_path=log_path)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if group_members(worker.pid):
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(worker.pid, signal.SIGKILL)
        worker.proc.wait(timeout=TIMEOUT_S)


def count_log(tmp_path: Path) -> list[tuple[str, int]]:
    """``(tag, pid)`` of every call of ``rewards_for_test.counting``, in call order."""
    try:
        lines = (tmp_path / "count.log").read_text().split("\n")
    except FileNotFoundError:
        return []
    return [(tag, int(pid)) for tag, pid in (line.split() for line in lines if line)]


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
        assert status["pid"] == worker.pid
        assert status["ready"] is True
        seqs.append(status["seq"])
        stamps.add(status["heartbeat_at"])
    assert seqs == sorted(seqs)
    assert len(set(seqs)) >= 10
    assert len(stamps) >= 10
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
    assert [p.name for p in worker.status_path.parent.iterdir()] == [f"{HOST}.json"]


def test_status_has_the_real_worker_s_fields_and_seq(start_worker: StartWorker) -> None:
    """The heartbeat has exactly the real worker's fields plus seq (no processed/in_flight/
    failed any more), zero counters at the start, and the RSS in GiB, not 1024 times less."""
    worker = start_worker(concurrency=3)
    status = worker.wait_ready()
    assert set(status) == REAL_STATUS_FIELDS | {"seq"}
    assert (status["completed"], status["errors"], status["inflight"]) == (0, 0, 0)
    assert (status["semantic_zero"], status["verify_timeout_n"], status["qps"]) == (0, 0, 0.0)
    assert status["queue_depth"] == 0 and status["concurrency"] == 3
    assert status["verify_ms_p95"] is None and status["queue_wait_ms_p50"] is None
    assert status["started_at"] <= status["heartbeat_at"]
    # A Python interpreter holds more than 1 MiB and less than 4 GiB (the real worker's
    # figure for one is about 2e-5: KiB divided by 1024**3).
    assert 1 / 1024 < status["rss_gib"] < 4


def test_clock_offset_shifts_every_wall_clock_stamp(start_worker: StartWorker) -> None:
    """REWARD_WORKER_CLOCK_OFFSET_S moves heartbeat_at, started_at and finished_at."""
    worker = start_worker(env={"REWARD_WORKER_CLOCK_OFFSET_S": "-3600"})
    status = worker.wait_ready()
    write_task(worker.root, task_record("skewed"))
    result = wait_for(lambda: worker.outbox().get("skewed"), "the result")
    now = time.time()
    # An hour is far outside any scheduling noise; 60 s of slack on each side is generous.
    for stamp in (status["heartbeat_at"], status["started_at"], result["finished_at"]):
        assert now - 3600 - 60 < stamp < now - 3600 + 60


# -- tasks ---------------------------------------------------------------------------------


def test_hundreds_of_tasks_are_scored_exactly_once_in_pool_processes(
    start_worker: StartWorker, run_root: Path, tmp_path: Path
) -> None:
    """300 real task records, some written before start and some during, each get one ok
    result with the right score and one call, made in pool processes (at most --concurrency
    of them, none the coordinator) of the worker's process group and session."""
    total = 300

    def record(i: int) -> dict[str, Any]:
        return task_record(
            f"t{i:04d}",
            "rewards_for_test.counting",
            completions=f"the answer is {i % 3}",
            answer="0",
            tag=f"t{i:04d}",
        )

    for i in range(total // 2):
        write_task(run_root, record(i))
    worker = start_worker(concurrency=4)
    worker.wait_ready()
    for i in range(total // 2, total):
        write_task(run_root, record(i))

    wait_for(lambda: len(worker.outbox()) >= total and not worker.inbox_names(), "all results")
    results = worker.outbox()
    assert sorted(results) == [f"t{i:04d}" for i in range(total)]
    for i in range(total):
        result = results[f"t{i:04d}"]
        assert set(result) == RESULT_FIELDS
        assert (result["task_id"], result["status"], result["error"]) == (f"t{i:04d}", "ok", None)
        assert result["score"] == (1.0 if i % 3 == 0 else 0.0)
        assert (result["worker_host"], result["shard"], result["schema_version"]) == (HOST, 0, 1)
        assert result["verify_ms"] >= 0 and result["queue_wait_ms"] >= 0
        assert result["total_ms"] == pytest.approx(result["queue_wait_ms"] + result["verify_ms"])
    calls = count_log(tmp_path)
    assert sorted(tag for tag, _ in calls) == sorted(results)  # each id computed exactly once
    pool = {pid for _, pid in calls}
    assert 1 <= len(pool) <= 4 and worker.pid not in pool
    for pid in pool:
        stat = proc_stat(pid)
        assert stat is not None, "pool processes stay up while the worker runs"
        assert (int(stat[1]), int(stat[2]), int(stat[3])) == (worker.pid,) * 3  # ppid pgrp sid
    final = worker.wait_status(lambda s: s["completed"] == total, "the completed counter")
    assert (final["errors"], final["inflight"], final["queue_depth"]) == (0, 0, 0)
    assert final["semantic_zero"] == total - len(range(0, total, 3))
    assert final["verify_ms_p95"] is not None and final["qps"] >= 0
    assert not [p for p in (worker.root / "outbox").iterdir() if p.name.startswith(".")]
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


def test_tasks_are_taken_oldest_first(
    start_worker: StartWorker, run_root: Path, tmp_path: Path
) -> None:
    """With one pool process, waiting tasks are scored in the order of their files' mtime,
    whatever their names."""
    names = [f"n{i}" for i in range(6)]
    base = time.time() - 100
    for age, name in enumerate(reversed(names)):  # n5 is the oldest
        path = write_task(run_root, task_record(name, "rewards_for_test.counting", tag=name))
        os.utime(path, (base + age, base + age))
    worker = start_worker(concurrency=1)
    wait_for(lambda: len(worker.outbox()) == len(names), "every result")
    assert [tag for tag, _ in count_log(tmp_path)] == list(reversed(names))


def test_each_task_names_its_own_reward_fn(start_worker: StartWorker) -> None:
    """Tasks naming different reward fns (by dotted or colon path) are each scored by theirs."""
    worker = start_worker()
    worker.wait_ready()
    write_task(worker.root, task_record("em", answer="7", completions="x=7"))
    write_task(worker.root, task_record("slow", "rewards_for_test:slow", seconds=0.1))
    write_task(worker.root, task_record("miss", answer="8", completions="x=7"))
    wait_for(lambda: len(worker.outbox()) == 3, "three results")
    scores = {name: r["score"] for name, r in worker.outbox().items()}
    assert scores == {"em": 1.0, "slow": 1.0, "miss": 0.0}


def test_existing_result_only_removes_the_inbox_file(start_worker: StartWorker) -> None:
    """A task whose result exists (its worker died before the unlink) is not computed again."""
    worker = start_worker()
    worker.wait_ready()
    (worker.root / "outbox" / "dup.json").write_text('{"marker": true}')
    write_task(worker.root, task_record("dup"))
    wait_for(lambda: not worker.inbox_names(), "the inbox file to go")
    assert read_json(worker.root / "outbox" / "dup.json") == {"marker": True}
    assert worker.has_event("task.duplicate") is not None


def test_hidden_and_temp_files_are_left_alone(start_worker: StartWorker) -> None:
    """Files named .*.json or *.json.tmp in the inbox are never taken as tasks."""
    worker = start_worker()
    worker.wait_ready()
    inbox = worker.root / "inbox" / str(SHARD)
    (inbox / ".hidden.json").write_text(json.dumps(task_record("hidden")))
    (inbox / "partial.json.tmp").write_text('{"task_')
    write_task(worker.root, task_record("real"))
    wait_for(lambda: "real" in worker.outbox(), "the real task's result")
    assert sorted(p.name for p in inbox.iterdir() if p.is_file()) == [
        ".hidden.json",
        "partial.json.tmp",
    ]
    assert set(worker.outbox()) == {"real"}


def test_failing_reward_fn_yields_an_error_result_and_the_worker_carries_on(
    start_worker: StartWorker,
) -> None:
    """A reward fn that raises gives status error, no score and the error as the real worker
    writes it; later tasks still succeed, and the counters say one of each."""
    worker = start_worker()
    worker.wait_ready()
    write_task(worker.root, task_record("bad", "rewards_for_test.boom", explode=True))
    wait_for(lambda: "bad" in worker.outbox(), "the error result")
    write_task(worker.root, task_record("good", "rewards_for_test.boom"))
    wait_for(lambda: "good" in worker.outbox(), "the next result")
    results = worker.outbox()
    assert (results["bad"]["status"], results["bad"]["score"]) == ("error", None)
    assert results["bad"]["error"] == "KeyError: 'no verifier'"
    assert (results["good"]["status"], results["good"]["score"]) == ("ok", 1.0)
    status = worker.wait_status(lambda s: s["completed"] + s["errors"] == 2, "the counters")
    assert (status["completed"], status["errors"], status["ready"]) == (1, 1, True)
    assert worker.proc.poll() is None


def test_an_unimportable_reward_fn_is_an_error_result_not_an_exit(
    start_worker: StartWorker,
) -> None:
    """Tasks naming a missing module, a module with a syntax error or a missing attribute
    each get an error result saying so; the worker stays up and ready, same pid, and a task
    with a good reward fn after them is scored."""
    worker = start_worker()
    ready = worker.wait_ready()
    bad = {
        "nomod": "no_such_module_xyz.reward",
        "syntax": "rewards_broken.score",
        "noattr": "rewards_for_test.nope",
    }
    for task_id, fn in bad.items():
        write_task(worker.root, task_record(task_id, fn))
    wait_for(lambda: set(bad) <= set(worker.outbox()), "three error results")
    write_task(worker.root, task_record("after"))
    wait_for(lambda: "after" in worker.outbox(), "a later task's result")
    results = worker.outbox()
    assert {name: r["status"] for name, r in results.items()} == {
        "nomod": "error",
        "syntax": "error",
        "noattr": "error",
        "after": "ok",
    }
    assert "No module named 'no_such_module_xyz'" in results["nomod"]["error"]
    assert "SyntaxError" in results["syntax"]["error"]
    assert "has no attribute 'nope'" in results["noattr"]["error"]
    status = worker.wait_status(lambda s: s["completed"] + s["errors"] == 4, "the counters")
    assert (status["errors"], status["ready"], status["pid"]) == (3, True, ready["pid"])
    assert worker.proc.poll() is None
    assert worker.has_event("worker.stopped") is None


def test_a_file_that_is_not_json_gets_bad_inbox_json_after_the_grace(
    start_worker: StartWorker,
) -> None:
    """A task file that never parses is answered, under its file stem, with status error and
    bad_inbox_json (as the real worker), and removed; a later task is served as usual."""
    worker = start_worker()
    worker.wait_ready()
    inbox = worker.root / "inbox" / str(SHARD)
    (inbox / "junk.json").write_bytes(b"{definitely not json")
    result = wait_for(lambda: worker.outbox().get("junk"), "the error result")
    assert (result["task_id"], result["status"], result["score"]) == ("junk", "error", None)
    assert result["error"].startswith("bad_inbox_json: ")
    wait_for(lambda: not (inbox / "junk.json").exists(), "the file to be removed")
    # Logged last, after the result and the unlink: seen a moment after them.
    wait_for(lambda: worker.has_event("task.malformed"), "the task.malformed line")
    write_task(worker.root, task_record("after"))
    wait_for(lambda: "after" in worker.outbox(), "a later task")
    status = worker.wait_status(lambda s: s["errors"] == 1 and s["completed"] == 1, "counters")
    assert status["ready"] is True


def test_json_that_is_no_task_record_gets_a_bad_task_error(start_worker: StartWorker) -> None:
    """A JSON file without a reward fn is answered at once with a bad_task error under its
    task_id, and removed."""
    worker = start_worker()
    worker.wait_ready()
    write_task(worker.root, {"task_id": "norf", "args": [], "kwargs": {}})
    result = wait_for(lambda: worker.outbox().get("norf"), "the error result")
    assert result["status"] == "error"
    assert result["error"].startswith("bad_task: reward_fn")
    wait_for(lambda: not worker.inbox_names(), "the file to be removed")


def test_task_written_in_place_is_not_answered_while_being_written(
    start_worker: StartWorker,
) -> None:
    """A non-atomic writer that finishes the file within the grace period loses nothing."""
    worker = start_worker()
    worker.wait_ready()
    path = worker.root / "inbox" / str(SHARD) / "slow.json"
    text = json.dumps(task_record("slow"))
    with path.open("w") as f:
        f.write(text[:20])
        f.flush()
        # Let the worker see the partial file at least a few scans before finishing it.
        time.sleep(0.2)  # wait-ok: the partial state is the point; no event marks "scanned"
        f.write(text[20:])
    result = wait_for(lambda: worker.outbox().get("slow"), "the result")
    assert (result["status"], result["score"]) == ("ok", 1.0)


def test_a_pool_process_that_dies_is_replaced_and_only_its_task_fails(
    start_worker: StartWorker,
) -> None:
    """A reward call that kills its pool process breaks the pool: the worker replaces it and
    stays ready; the tasks in flight with it are scored on the new pool, the killer alone
    gets an error result (pool_broken); no pool process is left over."""
    worker = start_worker(concurrency=3)
    ready = worker.wait_ready()
    write_task(worker.root, task_record("killer", "rewards_for_test.die"))
    for i in range(3):
        write_task(worker.root, task_record(f"slow{i}", "rewards_for_test.slow", seconds=0.3))
    wait_for(lambda: len(worker.outbox()) == 4, "four results")
    write_task(worker.root, task_record("later"))
    wait_for(lambda: "later" in worker.outbox(), "a task after the breaks")
    results = worker.outbox()
    assert results["killer"]["status"] == "error"
    assert results["killer"]["error"].startswith("pool_broken: ")
    assert all(results[f"slow{i}"]["status"] == "ok" for i in range(3))
    assert results["later"]["score"] == 1.0
    # Two breaks: the killer's first (with whatever was in flight), then its second, alone.
    assert len([e for e in worker.log_events() if e.get("event") == "pool.broken"]) == 2
    status = worker.wait_status(lambda s: s["completed"] + s["errors"] == 5, "the counters")
    assert (status["errors"], status["ready"], status["pid"]) == (1, True, ready["pid"])
    # The broken pools' processes are gone: what is left is one pool's worth at most.
    wait_for(lambda: len(worker.pool_pids()) <= 3, "at most one pool of processes")


def test_an_idle_pool_process_that_dies_costs_no_task(start_worker: StartWorker) -> None:
    """An idle pool process killed (the OOM killer's pick) breaks the pool with nothing in
    flight: the next task is scored on a new pool, by the same ready worker. On Python 3.12+
    this hung the worker: the executor's manager thread joined the pool's other processes
    (which ignore SIGTERM) while holding the lock that the next submit takes."""
    worker = start_worker(concurrency=2)
    ready = worker.wait_ready()
    for i in range(2):
        write_task(worker.root, task_record(f"warm{i}", "rewards_for_test.slow", seconds=0.3))
    wait_for(lambda: len(worker.outbox()) == 2, "both warm-up results")
    pool = wait_for(lambda: p if len(p := worker.pool_pids()) == 2 else None, "a pool of two")
    os.kill(pool[0], signal.SIGKILL)
    # Reaped: the executor has seen the death (its manager thread joins the pool's processes).
    wait_for(lambda: not Path(f"/proc/{pool[0]}").exists(), "the dead pool process reaped")
    write_task(worker.root, task_record("after"))
    result = wait_for(lambda: worker.outbox().get("after"), "the task after the death")
    assert (result["status"], result["score"]) == ("ok", 1.0)
    status = worker.wait_status(lambda s: s["completed"] == 3, "the counters")
    assert (status["errors"], status["ready"], status["pid"]) == (0, True, ready["pid"])
    assert pool[1] not in worker.pool_pids()  # the broken pool's survivor is gone too


# -- stopping ------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_drains_in_flight_tasks_then_exits_0_leaving_no_process(
    start_worker: StartWorker, signum: signal.Signals
) -> None:
    """SIGTERM/SIGINT: no new task is taken, the heartbeat says not ready at once, the tasks
    in flight finish and are answered, the last heartbeat is not ready with nothing in
    flight, exit 0, and no process of the worker's group (pool included) outlives it."""
    worker = start_worker(concurrency=2, env={"REWARD_WORKER_TASK_DELAY_S": "2"})
    for i in range(5):
        write_task(worker.root, task_record(f"s{i}"))
    worker.wait_status(lambda s: s["inflight"] == 2, "two tasks in flight")
    assert len(worker.pool_pids()) == 2
    worker.proc.send_signal(signum)
    worker.wait_status(lambda s: not s["ready"] and s["inflight"] > 0, "not ready, draining")
    assert worker.wait_exit() == 0
    results = worker.outbox()
    assert len(results) == 2
    assert all(r["status"] == "ok" and r["score"] == 1.0 for r in results.values())
    assert len(worker.inbox_names()) == 3
    assert not set(worker.inbox_names()) & {f"{name}.json" for name in results}
    final = worker.status()
    assert final is not None
    assert (final["ready"], final["inflight"], final["completed"]) == (False, 0, 2)
    assert worker.has_event("worker.stopped") is not None
    worker.wait_group_gone()


def test_sigterm_to_the_whole_group_drains_as_well(start_worker: StartWorker) -> None:
    """The supervisor signals the worker's process group: the pool processes ignore it, so
    the tasks in flight still finish and are answered ok before the exit 0."""
    worker = start_worker(concurrency=2, env={"REWARD_WORKER_TASK_DELAY_S": "1"})
    for i in range(2):
        write_task(worker.root, task_record(f"g{i}"))
    worker.wait_status(lambda s: s["inflight"] == 2, "two tasks in flight")
    os.killpg(worker.pid, signal.SIGTERM)
    assert worker.wait_exit() == 0
    results = worker.outbox()
    assert sorted(results) == ["g0", "g1"]
    assert all(r["status"] == "ok" for r in results.values())
    assert worker.inbox_names() == []
    worker.wait_group_gone()


def test_the_drain_is_bounded_and_abandons_a_hung_call_to_the_successor(
    start_worker: StartWorker,
) -> None:
    """A call that never returns is abandoned after --drain-timeout: its pool process is
    killed, its task gets no result and stays in the inbox for the next worker, exit 0."""
    worker = start_worker(fault="hang_call:task=hung", extra=("--drain-timeout", "0.5"))
    write_task(worker.root, task_record("hung"))
    worker.wait_status(lambda s: s["inflight"] == 1, "the call in flight")
    wait_for(lambda: worker.has_event("worker.fault"), "the call to hang")
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
    assert worker.outbox() == {}
    assert worker.inbox_names() == ["hung.json"]
    event = worker.has_event("worker.drain_timeout")
    assert event is not None and event["abandoned"] == ["hung"]
    final = worker.status()
    assert final is not None and (final["ready"], final["inflight"]) == (False, 0)
    worker.wait_group_gone()


def test_a_sigkilled_worker_leaves_no_pool_process_behind(start_worker: StartWorker) -> None:
    """The coordinator SIGKILLed with calls in flight: its orphaned pool processes notice
    and exit, so nothing of the worker is left (its tasks wait in the inbox)."""
    worker = start_worker(concurrency=2, env={"REWARD_WORKER_TASK_DELAY_S": "30"})
    for i in range(2):
        write_task(worker.root, task_record(f"k{i}"))
    worker.wait_status(lambda s: s["inflight"] == 2, "two tasks in flight")
    pool = worker.pool_pids()
    assert len(pool) == 2
    worker.proc.kill()
    assert worker.wait_exit() == -signal.SIGKILL
    wait_for(lambda: not any(is_alive(pid) for pid in pool), "the orphaned pool to exit")
    worker.wait_group_gone()
    assert worker.inbox_names() == ["k0.json", "k1.json"]


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


def test_bad_arguments_exit_2(start_worker: StartWorker) -> None:
    """A bad command line exits 2 with argparse's usage message, before any heartbeat."""
    worker = start_worker(extra=("--drain-timeout", "never"))
    assert worker.wait_exit() == 2
    assert "--drain-timeout" in worker.log_path.read_text()
    assert worker.status() is None


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
    write_task(worker.root, task_record("ignored"))
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
    assert is_alive(worker.pid)
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
    write_task(worker.root, task_record("waiting"))
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


def test_hang_call_is_a_stuck_pool_process_under_a_heartbeating_worker(
    start_worker: StartWorker,
) -> None:
    """hang_call: the named task's call hangs in a pool process (of the worker's group) while
    the other tasks are scored; then heartbeats go on with one task in flight and
    completed + errors frozen; SIGUSR1 puts the hung call's stack in the log (passed on to
    the pool) and the worker lives on."""
    worker = start_worker(fault="hang_call:task=h1")
    for name in ("h0", "h1", "h2", "h3"):
        write_task(worker.root, task_record(name))
    wait_for(lambda: set(worker.outbox()) == {"h0", "h2", "h3"}, "the other three results")
    hung = wait_for(lambda: worker.has_event("worker.fault"), "the call to hang")
    assert (hung["kind"], hung["task"]) == ("hang_call", "h1")
    assert hung["pid"] != worker.pid and hung["pid"] in worker.pool_pids()
    stuck = worker.wait_status(lambda s: s["completed"] == 3 and s["inflight"] == 1, "stuck")

    def still_stuck() -> bool:
        status = worker.status()
        assert status is not None
        return (status["completed"] + status["errors"], status["inflight"], status["ready"]) == (
            3,
            1,
            True,
        )

    assert holds_for(still_stuck, QUIET_WINDOW_S)
    later = worker.status()
    assert later is not None and later["seq"] > stuck["seq"] + 1  # heartbeats went on
    assert "h1" not in worker.outbox()

    size = worker.log_path.stat().st_size
    worker.proc.send_signal(signal.SIGUSR1)
    wait_for(
        lambda: "hung_reward_call" in worker.log_path.read_text()[size:], "the hung call's stack"
    )
    assert worker.proc.poll() is None
    worker.wait_status(lambda s: s["seq"] > later["seq"], "a heartbeat after the stacks")


def test_hang_call_with_a_marker_hangs_only_the_first_worker(
    start_worker: StartWorker, tmp_path: Path
) -> None:
    """With a marker, the worker that creates it hangs; one that finds it there (its
    replacement) scores the task."""
    marker = tmp_path / "hang.marker"
    marker.write_text("")  # as a first worker that hung left it
    worker = start_worker(fault=f"hang_call:task=m1:marker={marker}")
    write_task(worker.root, task_record("m1"))
    result = wait_for(lambda: worker.outbox().get("m1"), "the result")
    assert result["status"] == "ok"
    assert worker.has_event("worker.fault") is None


# -- the real worker and client, where areal-fs is (the areal_fs fixture) ------------------


CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from areal.reward.fs_client import FSRewardClient, RewardInfraError
    from areal.reward.fs_protocol import write_manifest

    root, host, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

    def client(fn):
        return FSRewardClient(fn, root=root, shard_count=1, worker_hosts=[host])

    async def error_of(call):
        try:
            await call
        except RewardInfraError as exc:
            return str(exc)
        return None

    async def main():
        if mode == "score":
            write_manifest(root, {"shard_count": 1})
            good = client("supervisor.demo.worker.exact_match")
            calls = [good("q", f"answer {i}", [1], [2], answer=str(i % 4)) for i in range(20)]
            scores = await asyncio.gather(*calls)
            failing = client("rewards_for_test.boom")
            error = await error_of(failing("q", "c", [], [], explode=True))
            missing = await error_of(client("no_such_module_xyz.f")("q", "c"))
            print(json.dumps({"scores": scores, "error": error, "missing": missing}))
        else:
            print(json.dumps({"error": await error_of(client("x.y")("q", "c"))}))

    asyncio.run(main())
    """
)


def run_client(areal: Path, worker: Worker, mode: str) -> dict[str, Any]:
    """Run the real FSRewardClient (from ``areal``) in its own process against ``worker``."""
    env = {**os.environ, "PYTHONPATH": str(areal)}
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, str(worker.root), HOST, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    reply: dict[str, Any] = json.loads(done.stdout)
    return reply


def test_the_real_trainer_client_gets_its_scores_and_errors_from_the_reference_worker(
    start_worker: StartWorker, areal_fs: Path
) -> None:
    """FSRewardClient, run from areal-fs, finds the heartbeat fresh and ready, gets the right
    score for 20 concurrent calls, a RewardInfraError carrying the reward fn's error (and the
    import failure) for failing ones, and refuses to call once the worker has stopped."""
    worker = start_worker(concurrency=4)
    worker.wait_ready()
    reply = run_client(areal_fs, worker, "score")
    assert reply["scores"] == [1.0 if str(i % 4) in f"answer {i}" else 0.0 for i in range(20)]
    assert reply["error"] is not None and "KeyError: 'no verifier'" in reply["error"]
    assert reply["missing"] is not None and "no_such_module_xyz" in reply["missing"]
    assert worker.outbox() == {}  # the client takes every result it reads
    assert worker.proc.poll() is None
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
    stopped = run_client(areal_fs, worker, "stopped")
    assert stopped["error"] == f"reward worker not ready: {HOST}"


def test_the_real_worker_writes_the_same_heartbeat_fields_but_seq(
    tmp_path: Path, areal_fs: Path
) -> None:
    """areal.reward.fs_worker's heartbeat has exactly the fields the reference worker writes,
    but seq (ours)."""
    root = tmp_path / "real"
    argv = [sys.executable, "-m", "areal.reward.fs_worker", "--root", str(root), "--shard", "0"]
    argv += ["--host", "real-0", "--concurrency", "1"]
    env = {**os.environ, "PYTHONPATH": str(areal_fs)}
    real = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        status = wait_for(lambda: read_json(root / "status" / "real-0.json"), "its heartbeat")
    finally:
        os.killpg(real.pid, signal.SIGKILL)
        real.wait(timeout=TIMEOUT_S)
    assert set(status) == REAL_STATUS_FIELDS
