"""The agent's ``evidence`` op against real processes: a reference worker whose reward call
hangs in one of its pool processes, its stacks taken by py-spy and by the faulthandler
signal, and each way of failing to take them said in a note rather than raised."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import agent
from supervisor.agent import EvidenceRequest, op_evidence

HOST = "worker-0"
TIMEOUT_S = 60.0
#: The evidence bound the tests ask for: the daemon's default.
EVIDENCE_S = 3.0
PY_SPY = Path(sys.executable).with_name("py-spy")


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until true; fail after TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)  # wait-ok: poll interval of a deadline loop


def spec_for(root: Path, python: str = sys.executable, path: str = "") -> dict[str, Any]:
    """A launch spec (as the agent reads it) of the reference worker for HOST at ``root``;
    ``path`` is the worker environment's PATH."""
    return {
        "root": str(root),
        "host": HOST,
        "shard": 0,
        "python": python,
        "argv": [python, "-m", "supervisor.demo.worker", "--root", str(root), "--host", HOST],
        "env": {"PATH": path} if path else {},
        "log": str(root / "ctl" / f"{HOST}.log"),
        "launch_record": str(root / "ctl" / f"{HOST}.launch.json"),
        "pidfile": str(root / "ctl" / f"{HOST}.pid"),
    }


@pytest.fixture
def hung_worker(tmp_path: Path) -> Iterator[tuple[dict[str, Any], int]]:
    """A reference worker with its stderr on ``ctl/HOST.log`` (as a shepherd starts it, in
    its own session), one task in its inbox whose reward call hangs in a pool process;
    yields its spec and pid once it hangs."""
    root = tmp_path / "run"
    (root / "ctl").mkdir(parents=True)
    (root / "inbox" / "0").mkdir(parents=True)
    task = {
        "schema_version": 1,
        "task_id": "t1",
        "reward_fn": "supervisor.demo.worker.exact_match",
        "args": ["q", "1", [], []],
        "kwargs": {"answer": "1"},
        "created_at": time.time(),
    }
    (root / "inbox" / "0" / "t1.json").write_text(json.dumps(task))
    log = root / "ctl" / f"{HOST}.log"
    env = {**os.environ, "REWARD_WORKER_FAULT": "hang_call:task=t1"}
    argv = [sys.executable, "-m", "supervisor.demo.worker", "--root", str(root), "--shard", "0"]
    argv += ["--host", HOST, "--concurrency", "2", "--heartbeat-interval", "0.1"]
    with log.open("ab") as out:
        worker = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            cwd=tmp_path,
            start_new_session=True,
        )
    try:
        # The worker's own line just before the call hangs (its start line names the fault too).
        wait_for(lambda: b'"kind": "hang_call"' in log.read_bytes(), "the reward call to hang")
        # Written just before the call blocks: two more heartbeats (0.1 s apart) and it has.
        seq = beat_seq(root)
        wait_for(lambda: beat_seq(root) >= seq + 2, "two more heartbeats")
        yield spec_for(root), worker.pid
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # its pool too
        worker.wait()


def beat_seq(root: Path) -> int:
    """The ``seq`` of HOST's last heartbeat (-1 before the first)."""
    try:
        return int(json.loads((root / "status" / f"{HOST}.json").read_text())["seq"])
    except (OSError, ValueError, KeyError):
        return -1


def test_the_signal_path_reads_the_stacks_of_the_hung_call_back_from_the_log(
    hung_worker: tuple[dict[str, Any], int],
) -> None:
    """SIGUSR1 makes the reference worker write every thread's stack to its log and pass
    the signal on to its pool; the agent reads back just what was appended, showing the
    reward call hung in the pool, and the log tail from before it; the worker lives on."""
    spec, pid = hung_worker
    reply = op_evidence(EvidenceRequest(spec=spec, pid=pid, timeout_s=EVIDENCE_S, stacks="signal"))
    assert reply.via == "faulthandler", reply.notes
    assert reply.stacks is not None and "hung_reward_call" in reply.stacks
    assert "Thread 0x" in reply.stacks and "worker.ready" not in reply.stacks
    assert reply.log_tail is not None and '"kind": "hang_call"' in reply.log_tail
    assert "hung_reward_call" not in reply.log_tail
    assert agent.proc_stat(pid) is not None and not agent.is_dead(agent.proc_stat(pid))


def test_py_spy_beside_the_worker_s_python_is_preferred(
    hung_worker: tuple[dict[str, Any], int],
) -> None:
    """In "auto", py-spy found beside the worker's interpreter takes the stacks of the
    worker's process (as root it can attach here): its heartbeat thread among them; no
    signal is sent, so nothing is appended to the log."""
    spec, pid = hung_worker
    assert PY_SPY.exists(), "py-spy is a test extra (pyproject.toml): ./dev setup installs it"
    log = Path(spec["log"])
    before = log.stat().st_size
    reply = op_evidence(EvidenceRequest(spec=spec, pid=pid, timeout_s=EVIDENCE_S, stacks="auto"))
    assert reply.via == "py-spy", reply.notes
    assert reply.stacks is not None and f"Process {pid}" in reply.stacks
    assert "_Worker._heartbeat_loop" in reply.stacks
    assert log.stat().st_size == before


def test_py_spy_shows_the_hung_call_in_the_worker_s_pool(
    hung_worker: tuple[dict[str, Any], int],
) -> None:
    """py-spy's stacks show the reward call hung in a pool process of the worker, as the
    signal's do."""
    spec, pid = hung_worker
    reply = op_evidence(EvidenceRequest(spec=spec, pid=pid, timeout_s=EVIDENCE_S, stacks="py-spy"))
    assert reply.via == "py-spy", reply.notes
    assert reply.stacks is not None and "hung_reward_call" in reply.stacks


def test_a_stopped_worker_s_stacks_are_read_by_py_spy_as_they_are(
    hung_worker: tuple[dict[str, Any], int],
) -> None:
    """A SIGSTOPped worker cannot answer the signal, and py-spy cannot pause it: py-spy
    reads it without pausing, and it is left stopped (the terminate continues it)."""
    spec, pid = hung_worker
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: (agent.proc_stat(pid) or ("?",))[0] in ("T", "t"), "the worker to stop")
    reply = op_evidence(EvidenceRequest(spec=spec, pid=pid, timeout_s=EVIDENCE_S))
    assert reply.via == "py-spy", reply.notes
    assert reply.stacks is not None and "_Worker._heartbeat_loop" in reply.stacks
    assert (agent.proc_stat(pid) or ("?",))[0] in ("T", "t")
    signal_only = op_evidence(
        EvidenceRequest(spec=spec, pid=pid, timeout_s=EVIDENCE_S, stacks="signal")
    )
    assert signal_only.stacks is None
    assert signal_only.notes == [
        "faulthandler: the worker is stopped (SIGSTOP or a debugger): it cannot answer"
    ]


def test_auto_without_py_spy_falls_back_to_the_signal_and_says_why(
    hung_worker: tuple[dict[str, Any], int], tmp_path: Path
) -> None:
    """A host without py-spy (none beside the interpreter, none on PATH): the signal."""
    spec, pid = hung_worker
    bare = tmp_path / "bare-venv" / "bin"
    bare.mkdir(parents=True)
    python = bare / "python"
    python.symlink_to(sys.executable)
    spec = {**spec, "python": str(python), "env": {"PATH": str(bare)}}
    old_path = os.environ["PATH"]
    saved_executable = sys.executable
    os.environ["PATH"] = str(bare)
    sys.executable = str(python)  # the agent runs the worker's python; so does this test
    try:
        assert agent.find_py_spy(spec) is None
        reply = op_evidence(EvidenceRequest(spec=spec, pid=pid, timeout_s=EVIDENCE_S))
    finally:
        os.environ["PATH"] = old_path
        sys.executable = saved_executable
    assert reply.via == "faulthandler"
    assert reply.stacks is not None and "hung_reward_call" in reply.stacks
    assert reply.notes == ["py-spy: not found beside the worker's python or on PATH"]


def test_a_py_spy_that_hangs_is_killed_in_time_for_the_signal(
    hung_worker: tuple[dict[str, Any], int], tmp_path: Path
) -> None:
    """A py-spy that never answers is killed SIGNAL_RESERVE_S before the deadline, the
    signal still gets the stacks, and the whole capture stays within its bound."""
    spec, pid = hung_worker
    venv = tmp_path / "slow-venv" / "bin"
    venv.mkdir(parents=True)
    fake = venv / "py-spy"
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'spy.pid'}\nexec sleep 600\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    spec = {**spec, "python": str(venv / "python")}
    reply = op_evidence(EvidenceRequest(spec=spec, pid=pid, timeout_s=EVIDENCE_S))
    assert reply.via == "faulthandler"
    assert reply.notes[0].startswith("py-spy: no answer within"), reply.notes
    assert reply.stacks is not None and "hung_reward_call" in reply.stacks
    spy = int((tmp_path / "spy.pid").read_text())
    assert agent.is_dead(agent.proc_stat(spy)), "the hung py-spy was left running"
    # The bound is the point of the timeout: generous slack for a loaded machine.
    assert reply.elapsed_s < EVIDENCE_S + 5.0


def test_a_failing_py_spy_is_a_note_and_py_spy_mode_sends_no_signal(
    hung_worker: tuple[dict[str, Any], int], tmp_path: Path
) -> None:
    """In "py-spy" mode a py-spy that fails leaves no stacks, says why, and no signal is
    sent (the log does not grow)."""
    spec, pid = hung_worker
    venv = tmp_path / "broken-venv" / "bin"
    venv.mkdir(parents=True)
    fake = venv / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Error: Permission denied (os error 13)' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    spec = {**spec, "python": str(venv / "python")}
    size = Path(spec["log"]).stat().st_size
    reply = op_evidence(EvidenceRequest(spec=spec, pid=pid, timeout_s=EVIDENCE_S, stacks="py-spy"))
    assert (reply.stacks, reply.via) == (None, None)
    assert reply.notes == ["py-spy: exited 1: Error: Permission denied (os error 13)"]
    assert Path(spec["log"]).stat().st_size == size


def test_a_worker_without_a_handler_is_never_sent_the_signal(tmp_path: Path) -> None:
    """A worker that does not catch SIGUSR1 (whose default action would kill it) gets no
    signal: a note says so, and it lives on."""
    root = tmp_path / "run"
    (root / "ctl").mkdir(parents=True)
    (root / "ctl" / f"{HOST}.log").write_bytes(b"\xff\xfe not utf-8\nlast line\n")
    code = "import sys, time; time.sleep(600)"
    # Its command line matches the spec's argv, as a worker's does.
    argv = [sys.executable, "-c", code, "supervisor.demo.worker", "--host", HOST]
    sleeper = subprocess.Popen(argv)
    try:
        spec = {**spec_for(root), "argv": argv}
        wait_for(lambda: agent.identify(spec, sleeper.pid) == "ours", "the process to start")
        reply = op_evidence(
            EvidenceRequest(spec=spec, pid=sleeper.pid, timeout_s=EVIDENCE_S, stacks="signal")
        )
        assert reply.stacks is None
        assert reply.notes == [
            "the worker does not handle SIGUSR1 (faulthandler.register): no signal sent"
        ]
        assert reply.log_tail == "\ufffd\ufffd not utf-8\nlast line\n"
        assert sleeper.poll() is None
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()


def test_the_log_tail_is_bounded_starts_at_a_whole_line_and_refuses_a_symlink(
    tmp_path: Path,
) -> None:
    """Only the last ``log_bytes`` are read, from the first whole line; a log planted as a
    symlink is not followed; a pid that is not ours gets no stacks."""
    root = tmp_path / "run"
    (root / "ctl").mkdir(parents=True)
    log = root / "ctl" / f"{HOST}.log"
    log.write_text("".join(f"line {i}\n" for i in range(10_000)))
    spec = spec_for(root)
    reply = op_evidence(EvidenceRequest(spec=spec, pid=1, timeout_s=EVIDENCE_S, log_bytes=100))
    assert reply.log_tail is not None and reply.log_tail.endswith("line 9999\n")
    assert reply.log_tail.startswith("line ") and len(reply.log_tail) <= 100
    assert reply.stacks is None and reply.notes[-1].startswith("pid 1 is ")
    # A mode the agent does not know takes no stacks, and says so.
    notes: list[str] = []
    assert agent.take_stacks(spec, os.getpid(), "gdb", time.monotonic() + 1, notes) == (None, None)
    assert notes == ["unknown way to take stacks 'gdb': none taken"]
    log.unlink()
    (tmp_path / "secret").write_text("not for the daemon\n")
    log.symlink_to(tmp_path / "secret")
    reply = op_evidence(EvidenceRequest(spec=spec, pid=1, timeout_s=EVIDENCE_S))
    assert reply.log_tail is None
    assert "symbolic link" in reply.notes[0]
