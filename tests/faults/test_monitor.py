"""The suite's own checks can fail: the monitor sees doubled and leftover workers, the data
check sees lost, wrong and stray results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.harness import (
    Workload,
)
from tests.faults.monitor import InvariantMonitor, parse_worker_argv
from tests.system.daemonproc import pid_alive, poll_until

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


#: A "worker" that forks a child and both sleep: the child keeps the parent's command line, as a
#: real worker's child does between fork and exec (the AReaL worker spawns its pool so).
_FORKING = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    time.sleep(60)\n"


def start_forking_worker(root: Path) -> subprocess.Popen[bytes]:
    """A worker command line that forks a child with the same command line, in its own group."""
    argv = [sys.executable, "-c", _FORKING, "-m", "supervisor.demo.worker"]
    argv += ["--root", str(root), "--shard", "0", "--host", "a"]
    return subprocess.Popen(argv, start_new_session=True)


async def test_a_worker_s_child_before_exec_is_not_a_second_worker(elsewhere: Path) -> None:
    """A worker's own child that still shows the worker's command line (fork, not yet exec)
    is not a second worker on the shard; the parent is the one worker seen."""
    watcher = InvariantMonitor(elsewhere.parent)
    watcher.start()
    proc = start_forking_worker(elsewhere)
    try:
        child: list[int] = []

        def forked() -> bool:
            """The child exists (listed by the kernel under the parent)."""
            text = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
            child.extend(int(pid) for pid in text.split())
            return bool(child)

        await poll_until(forked, 30, "the child forked")
        seen_after = watcher.samples
        await poll_until(lambda: watcher.samples >= seen_after + 3, 30, "three more samples")
        assert watcher.live_on(0) == [proc.pid]
        assert watcher.violations == []
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    watcher.finish(5.0)


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


def test_data_check_finds_lost_wrong_stray_and_stuck_tasks(tmp_path: Path) -> None:
    """Every way a task can go wrong is named: no result, a wrong id, a wrong reward, a
    result without a task, a task left in the inbox."""
    root = tmp_path / "run"
    work = Workload(root, shards=1, total=6, duration_s=0.0).start()
    work.join()
    assert work.written == 6
    outbox = root / "outbox"
    outbox.mkdir(parents=True)
    inbox = root / "inbox" / "0"
    tasks = work.tasks
    for task in tasks[:4]:
        result = {"id": task.id, "reward": task.reward, "shard": 0}
        (outbox / f"{task.id}.json").write_text(json.dumps(result))
        (inbox / f"{task.id}.json").unlink()
    bad_id, bad_reward, lost, stuck = tasks[1], tasks[2], tasks[4], tasks[5]
    (outbox / f"{bad_id.id}.json").write_text(json.dumps({"id": "other", "reward": 0.0}))
    (outbox / f"{bad_reward.id}.json").write_text(
        json.dumps({"id": bad_reward.id, "reward": 1.0 - bad_reward.reward, "shard": 0})
    )
    (inbox / f"{lost.id}.json").unlink()
    (outbox / "stray.json").write_text(json.dumps({"id": "stray", "reward": 1.0}))
    problems = "\n".join(work.problems())
    assert f"task {bad_id.id}: result names id 'other'" in problems
    assert f"task {bad_reward.id}: reward" in problems
    assert f"task {lost.id}: no result" in problems
    assert f"task {stuck.id}: no result" in problems
    assert "1 results without a task" in problems
    assert "1 tasks left in the inbox" in problems
    assert len(work.problems()) == 6
    with pytest.raises(AssertionError):
        work.assert_all_done_once()
