"""The suite's own checks can fail: the monitor sees doubled and leftover workers, the data
check sees lost, wrong and stray results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.harness import (
    REWARD_FN,
    Workload,
)
from tests.faults.monitor import (
    InvariantMonitor,
    WorkerProcess,
    _without_unexeced_children,
    parse_worker_argv,
)
from tests.system.daemonproc import kill_quietly, pid_alive, poll_until

pytestmark = [pytest.mark.faults]


def start_worker(root: Path, shard: int, host: str) -> subprocess.Popen[bytes]:
    """A reference worker started by hand, outside any supervisor."""
    argv = [sys.executable, "-m", "supervisor.demo.worker", "--root", str(root)]
    argv += ["--shard", str(shard), "--host", host, "--concurrency", "1"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run root outside this test's directory, so the suite's own monitor ignores it."""
    return tmp_path_factory.mktemp("monitor-selftest") / "run"


def test_worker_command_lines_are_recognised() -> None:
    """Only ``-m supervisor.demo.worker`` with a root and a shard counts as a worker."""
    assert parse_worker_argv(
        ["py", "-m", "supervisor.demo.worker", "--root", "/r", "--shard", "3", "--host", "h"]
    ) == ("/r", 3, "h")
    assert parse_worker_argv(["py", "-m", "supervisor.cli", "--root", "/r", "--shard", "3"]) is None
    assert parse_worker_argv(["py", "-m", "supervisor.demo.worker", "--root", "/r"]) is None
    assert parse_worker_argv(["py", "-c", "x", "agent"]) is None


async def test_monitor_catches_two_workers_on_one_shard(elsewhere: Path) -> None:
    """Two live workers of one run on one shard are recorded as a violation naming both."""
    watcher = InvariantMonitor(elsewhere.parent)
    watcher.start()
    first = start_worker(elsewhere, 0, "a")
    second = start_worker(elsewhere, 0, "b")
    other_shard = start_worker(elsewhere, 1, "c")
    try:
        await poll_until(
            lambda: bool(watcher.violations) and bool(watcher.pids_seen(1)),
            30,
            "a violation, and the worker of shard 1 seen",
        )
        with pytest.raises(AssertionError, match="one worker per shard violated"):
            watcher.assert_clean()
        violation = watcher.violations[0]
        assert violation.shard[1] == 0
        assert {w.pid for w in violation.workers} == {first.pid, second.pid}
        assert watcher.pids_seen(1) == [other_shard.pid]
    finally:
        for proc in (first, second, other_shard):
            proc.kill()
            proc.wait()
    assert watcher.finish(5.0) != []


async def test_a_worker_s_own_fork_is_not_a_second_worker(elsewhere: Path) -> None:
    """A worker's child that has not exec'd yet (the AReaL worker's pool and resource tracker
    are spawned so) carries the worker's command line, and is not taken for a second worker;
    an unrelated second worker still is."""
    watcher = InvariantMonitor(elsewhere.parent)
    watcher.start()
    parent = start_forking_worker(elsewhere)
    try:
        await poll_until(
            lambda: len(_children(parent.pid)) == 1 and watcher.live_on(0) == [parent.pid],
            30,
            "the worker and its fork, the fork not counted",
        )
        assert watcher.violations == []
        second = start_worker(elsewhere, 0, "b")
        try:
            await poll_until(lambda: bool(watcher.violations), 30, "the second worker caught")
        finally:
            second.kill()
            second.wait()
    finally:
        for child in _children(parent.pid):
            kill_quietly(child)
        parent.kill()
        parent.wait()
    assert watcher.finish(5.0) != []


def start_forking_worker(root: Path) -> subprocess.Popen[bytes]:
    """A "worker" of shard 0 whose child keeps its command line: it forks, and neither execs."""
    forking = "import os, time; os.fork(); time.sleep(60)"  # wait-ok: run by the processes
    argv = [sys.executable, "-c", forking, "-m", "supervisor.demo.worker", "--root", str(root)]
    return subprocess.Popen([*argv, "--shard", "0"])


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


async def test_monitor_reports_and_kills_a_leftover_worker(elsewhere: Path) -> None:
    """A worker still alive when the test ends is reported, and killed so later tests start
    clean."""
    watcher = InvariantMonitor(elsewhere.parent)
    watcher.start()
    proc = start_worker(elsewhere, 0, "a")
    try:
        await poll_until(lambda: watcher.live_on(0) == [proc.pid], 30, "the worker seen")
        problems = watcher.finish(0.5)
        assert len(problems) == 1 and "still running" in problems[0], problems
        await poll_until(lambda: proc.poll() is not None, 30, "the leftover killed")
        assert not pid_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_s_child_before_its_exec_is_not_a_second_worker() -> None:
    """A process with a worker's command line whose parent is a worker of the same shard (a
    pool process between vfork and exec) is dropped; two unrelated ones are both kept."""
    parent = WorkerProcess(10, "/r", 0, "h", "D", 100, ppid=1)
    child = WorkerProcess(11, "/r", 0, "h", "R", 101, ppid=10)
    other_run = WorkerProcess(12, "/s", 0, "h", "R", 102, ppid=10)
    second = WorkerProcess(13, "/r", 0, "h", "S", 103, ppid=1)
    assert _without_unexeced_children([parent, child, other_run]) == [parent, other_run]
    assert _without_unexeced_children([parent, second]) == [parent, second]


def test_data_check_finds_lost_wrong_stray_and_stuck_tasks(tmp_path: Path) -> None:
    """Every way a task can go wrong is named: no result, a wrong id, a wrong score, an error
    result, a result without a task, a task left in the inbox."""
    root = tmp_path / "run"
    work = Workload(root, shards=1, total=6, duration_s=0.0).start()
    work.join()
    assert work.written == 6
    outbox = root / "outbox"
    outbox.mkdir(parents=True)
    inbox = root / "inbox" / "0"
    tasks = work.tasks
    record = json.loads((inbox / f"{tasks[0].id}.json").read_text())
    assert (record["task_id"], record["reward_fn"]) == (tasks[0].id, REWARD_FN)
    for task in tasks[:4]:
        result = {"task_id": task.id, "status": "ok", "score": task.score, "shard": 0}
        (outbox / f"{task.id}.json").write_text(json.dumps(result))
        (inbox / f"{task.id}.json").unlink()
    bad_id, bad_score, failed, lost, stuck = tasks[1], tasks[2], tasks[3], tasks[4], tasks[5]
    (outbox / f"{bad_id.id}.json").write_text(
        json.dumps({"task_id": "other", "status": "ok", "score": 0.0})
    )
    (outbox / f"{bad_score.id}.json").write_text(
        json.dumps(
            {"task_id": bad_score.id, "status": "ok", "score": 1.0 - bad_score.score, "shard": 0}
        )
    )
    (outbox / f"{failed.id}.json").write_text(
        json.dumps({"task_id": failed.id, "status": "error", "score": None, "error": "boom"})
    )
    (inbox / f"{lost.id}.json").unlink()
    (outbox / "stray.json").write_text(json.dumps({"task_id": "stray", "status": "ok"}))
    problems = "\n".join(work.problems())
    assert f"task {bad_id.id}: result names id 'other'" in problems
    assert f"task {bad_score.id}: score" in problems
    assert f"task {failed.id}: status 'error': boom" in problems
    assert f"task {lost.id}: no result" in problems
    assert f"task {stuck.id}: no result" in problems
    assert "1 results without a task" in problems
    assert "1 tasks left in the inbox" in problems
    assert len(work.problems()) == 7
    with pytest.raises(AssertionError):
        work.assert_all_done_once()
