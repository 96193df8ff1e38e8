"""Sweeping a dead worker's session, with real processes and signals: the agent runs as the
daemon starts it, talked to over its pipes (``test_launcher.Agent``), and its workers are
``tests/family_worker.py``: two children in the worker's group and a grandchild in a group
of its own, all in the worker's session.

Each of the shepherd, the agent's exit watch and a terminate kills what the worker left and
says how many it killed; none may let a replacement start while one of them lives.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import agent as agent_module
from tests.family_worker import alive, families
from tests.integration.test_launcher import (
    DEADLINE_S,
    INTERPRETERS,
    Agent,
    Cleanup,
    exit_record_of,
    is_alive,
    make_spec,
    read_json,
    wait_until,
    worker_log_once_it_says,
)

FAMILY_WORKER = Path(__file__).parent.parent / "family_worker.py"
#: The family a stand-in leaves: two children and a grandchild.
FAMILY = 3


class Families(Cleanup):
    """``Cleanup`` that also kills, at the end, every family member a test's workers named."""

    records: list[Path]

    def run(self) -> None:
        """Kill every member still alive (by pid and start time), then what Cleanup kills."""
        for record in getattr(self, "records", []):
            for line in families(record):
                for member in line["family"]:
                    if alive(member):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(member[0], signal.SIGKILL)
        super().run()


@pytest.fixture
def cleanup() -> Iterator[Families]:
    """What a test starts dies with it, families included."""
    keeper = Families()
    keeper.records = []
    try:
        yield keeper
    finally:
        keeper.run()


def family_spec(root: Path, keeper: Families, *options: str) -> tuple[dict[str, Any], Path]:
    """A launch spec for a family stand-in under ``root``, and the file it records to."""
    record = root / "families.jsonl"
    keeper.records.append(record)
    argv = [sys.executable, str(FAMILY_WORKER), str(record), *options]
    return make_spec(root, argv), record


def family_of(record: Path, pid: int) -> list[list[int]]:
    """Wait for worker ``pid``'s line in ``record``; its family as ``[pid, start]`` pairs."""
    found: list[list[list[int]]] = []

    def recorded() -> bool:
        """Record the family once worker ``pid`` has written it."""
        found[:] = [line["family"] for line in families(record) if line["worker"] == pid]
        return bool(found)

    wait_until(recorded, f"worker {pid} to record its family")
    return found[0]


def session_alive(pid: int) -> list[int]:
    """Live processes whose session or process group is ``pid`` (``pid`` itself aside)."""
    return sorted(agent_module.session_members(pid))


def pushed_exit(agent: Agent, pid: int) -> dict[str, Any]:
    """The exit of ``pid`` the agent pushed (already, or next)."""
    for news in agent.pushed:
        if news["pid"] == pid:
            return news
    while True:
        message = agent.read_message()
        assert "id" not in message, message
        if message["exit"]["pid"] == pid:
            return dict(message["exit"])


def later_exits(agent: Agent, first: dict[str, Any]) -> list[dict[str, Any]]:
    """``first``, a pushed exit, and the copies of it the agent pushed after it, until one
    says how many were killed in the worker's session."""
    found = [first] + [n for n in agent.pushed if n["pid"] == first["pid"] and n is not first]
    while found[-1]["reaped"] is None:
        message = agent.read_message()
        assert "id" not in message, message
        if message["exit"]["pid"] == first["pid"]:
            found.append(dict(message["exit"]))
    return found


@pytest.mark.parametrize("python", INTERPRETERS)
def test_kill9_reaps_the_session_before_the_record_and_before_a_replacement(
    python: str, tmp_path: Path, cleanup: Families
) -> None:
    """A worker killed with SIGKILL leaves two children and a grandchild in another group:
    the exit is pushed at once; a replacement launched the moment it is heard of starts only
    once none of them lives (its shepherd sweeps before it hands the shard lock over), and
    so does the exit record. The record counts all three, and so does the push, or a second
    push of the same exit that follows the shepherd's sweep. On every host Python (no pidfds
    before 3.9: /proc is polled, kill() signals)."""
    spec, record = family_spec(tmp_path, cleanup)
    agent = cleanup.agent(python)
    launched = cleanup.launch(agent, spec)
    family = family_of(record, launched.pid)
    assert len(family) == FAMILY
    grandchild = family[2][0]
    assert os.getsid(grandchild) == launched.pid
    assert os.getpgid(grandchild) == grandchild  # out of the worker's group: killpg misses it
    assert session_alive(launched.pid) == sorted(m[0] for m in family)

    os.kill(launched.pid, signal.SIGKILL)
    news = pushed_exit(agent, launched.pid)
    assert news["signal"] == signal.SIGKILL
    replacement = cleanup.launch(agent, spec)
    assert [m for m in family if alive(m)] == [], "a family member outlived the replacement's start"
    assert replacement.pid != launched.pid
    exit_record = exit_record_of(spec, launched.pid)
    assert [m for m in family if alive(m)] == []
    assert "survivors" not in exit_record
    assert exit_record["reaped"] == FAMILY
    copies = later_exits(agent, news)
    assert copies[-1]["reaped"] == FAMILY, copies
    worker_log_once_it_says(spec, f"worker pid {launched.pid} exited (signal 9)")


def test_a_shepherd_that_cannot_sweep_leaves_it_to_the_agent(
    tmp_path: Path, cleanup: Families
) -> None:
    """The shepherd stopped (SIGSTOP) when its worker is killed: the agent pushes the exit at
    once, waits for the shepherd as long as a launch would wait for its shard lock, then
    sweeps the session itself and pushes the exit again with the count; the shepherd, let
    go, finds nothing left and still writes its record."""
    spec, record = family_spec(tmp_path, cleanup)
    agent = cleanup.agent()
    launched = cleanup.launch(agent, spec)
    family = family_of(record, launched.pid)
    os.kill(launched.shepherd, signal.SIGSTOP)
    try:
        os.kill(launched.pid, signal.SIGKILL)
        news = pushed_exit(agent, launched.pid)
        copies = later_exits(agent, news)
        assert [m for m in family if alive(m)] == [], "the agent's sweep left a member"
        assert copies[-1]["reaped"] == FAMILY, copies
        assert not Path(spec["exit_record"]).exists()  # the shepherd had not got that far
    finally:
        os.kill(launched.shepherd, signal.SIGCONT)
    exit_record = exit_record_of(spec, launched.pid)
    assert exit_record["reaped"] == 0


def test_with_no_agent_the_shepherd_alone_reaps_the_session_before_the_record(
    tmp_path: Path, cleanup: Families
) -> None:
    """With the agent gone (the channel down), the shepherd's sweep kills the whole family
    before it writes the exit record, and the record counts all three."""
    spec, record = family_spec(tmp_path, cleanup)
    agent = cleanup.agent()
    launched = cleanup.launch(agent, spec)
    family = family_of(record, launched.pid)
    agent.kill()

    os.kill(launched.pid, signal.SIGKILL)
    exit_record = exit_record_of(spec, launched.pid)
    assert [m for m in family if alive(m)] == [], "a family member outlived the record"
    assert exit_record["reaped"] == FAMILY
    assert "survivors" not in exit_record
    worker_log_once_it_says(spec, f"killed {FAMILY} left in its session")


@pytest.mark.parametrize("python", INTERPRETERS)
def test_terminate_of_a_worker_ignoring_sigterm_kills_and_reaps_its_session(
    python: str, tmp_path: Path, cleanup: Families
) -> None:
    """A worker that ignores SIGTERM is SIGKILLed after the grace, with its group, and the
    grandchild outside its group is swept: the reply counts all three and none lives (on
    every host Python)."""
    spec, record = family_spec(tmp_path, cleanup, "--ignore-term")
    agent = cleanup.agent(python)
    launched = cleanup.launch(agent, spec)
    family = family_of(record, launched.pid)
    reply = agent.call("terminate", spec=spec, pid=launched.pid, grace_s=0.3, kill=True)
    assert reply["ok"], reply
    assert reply["result"] == {"outcome": "killed", "reaped": FAMILY}
    assert not is_alive(launched.pid)
    assert [m for m in family if alive(m)] == []
    assert session_alive(launched.pid) == []


def test_terminate_signals_sigterm_to_the_worker_alone_then_reaps_what_it_left(
    tmp_path: Path, cleanup: Families
) -> None:
    """SIGTERM goes to the worker only (its pool must live to finish the tasks it drains):
    the worker exits 0 on it, and its children, untouched by it, are what the shepherd's
    sweep kills: all three (so the two in its group were alive when it had exited), as its
    record, the terminate's reply and the agent's push (at once or once it is done) say."""
    marker = tmp_path / "term"
    spec, record = family_spec(tmp_path, cleanup, "--term-file", str(marker))
    agent = cleanup.agent()
    launched = cleanup.launch(agent, spec)
    family = family_of(record, launched.pid)
    reply = agent.call("terminate", spec=spec, pid=launched.pid, grace_s=20.0, kill=True)
    assert reply["ok"], reply
    assert reply["result"]["outcome"] == "terminated"
    assert marker.read_text() == "TERM\n"
    assert [m for m in family if alive(m)] == []
    exit_record = exit_record_of(spec, launched.pid)
    assert exit_record["exit_code"] == 0
    assert (reply["result"]["reaped"], exit_record["reaped"]) == (FAMILY, FAMILY)
    copies = later_exits(agent, pushed_exit(agent, launched.pid))
    assert copies[-1]["reaped"] == FAMILY, copies


def test_terminate_with_no_grace_kills_at_once_without_sigterm(
    tmp_path: Path, cleanup: Families
) -> None:
    """``grace_s`` 0 with ``kill``: SIGKILL to the group at once, no SIGTERM first (the
    worker never gets to report ``ready: false``), and the session is swept."""
    marker = tmp_path / "term"
    spec, record = family_spec(tmp_path, cleanup, "--term-file", str(marker))
    agent = cleanup.agent()
    launched = cleanup.launch(agent, spec)
    family = family_of(record, launched.pid)
    reply = agent.call("terminate", spec=spec, pid=launched.pid, grace_s=0.0, kill=True)
    assert reply["ok"], reply
    assert reply["result"] == {"outcome": "killed", "reaped": FAMILY}
    assert [m for m in family if alive(m)] == []
    assert exit_record_of(spec, launched.pid)["signal"] == signal.SIGKILL
    assert not marker.exists(), "the worker got a SIGTERM"


def test_a_worker_dead_with_no_sweeper_is_swept_by_the_next_terminate(
    tmp_path: Path, cleanup: Families
) -> None:
    """Shepherd and agent killed first, then the worker: nobody sweeps, its zombie is reaped
    by init and its pid is gone, its family lives on; a terminate of that pid finds it dead,
    and, as the launch record names it and no exit record does, sweeps its family."""
    spec, record = family_spec(tmp_path, cleanup)
    agent = cleanup.agent()
    launched = cleanup.launch(agent, spec)
    family = family_of(record, launched.pid)
    agent.kill()
    os.kill(launched.shepherd, signal.SIGKILL)
    wait_until(lambda: not is_alive(launched.shepherd), "the shepherd to die")
    os.kill(launched.pid, signal.SIGKILL)
    wait_until(lambda: agent_module.proc_ids(launched.pid) is None, "init to reap the worker")
    assert [m for m in family if alive(m)] == family, "the family outlived its worker"
    assert read_json(spec["exit_record"]) is None

    again = cleanup.agent()
    reply = again.call("terminate", spec=spec, pid=launched.pid, grace_s=1.0, kill=True)
    assert reply["ok"], reply
    assert reply["result"] == {"outcome": "dead", "reaped": FAMILY}
    assert [m for m in family if alive(m)] == []


def test_sweep_of_a_gone_leader_kills_its_session_and_of_a_live_one_does_nothing(
    tmp_path: Path, cleanup: Families
) -> None:
    """``sweep`` itself: while the worker lives it does nothing (None); once the worker is
    reaped and its pid gone, its session still holds the number, so the family found by it
    is the worker's, and is killed and waited for."""
    record = tmp_path / "families.jsonl"
    cleanup.records.append(record)
    worker = subprocess.Popen(
        [sys.executable, str(FAMILY_WORKER), str(record)], start_new_session=True
    )
    try:
        family = family_of(record, worker.pid)
        ids = agent_module.proc_ids(worker.pid)
        assert ids is not None
        assert agent_module.sweep(worker.pid, ids[3]) is None
        assert [m for m in family if alive(m)] == family
        worker.kill()
        worker.wait()
        assert agent_module.proc_ids(worker.pid) is None
        swept = agent_module.sweep(worker.pid, ids[3])
        assert swept is not None
        killed, survivors = swept
        assert sorted(killed.items()) == sorted((m[0], m[1]) for m in family)
        assert survivors == []
        assert [m for m in family if alive(m)] == []
        assert agent_module.sweep(worker.pid, ids[3]) == ({}, [])
    finally:
        worker.kill()
        worker.wait()


def test_the_watch_sweeps_only_a_session_leader(tmp_path: Path) -> None:
    """A watched worker that leads no session of its own (an old-script worker) has its
    exit pushed with ``reaped`` null and its session, which is its parent's, left alone."""
    pushed: list[str] = []
    done = threading.Event()

    def send(line: str) -> None:
        """Keep the pushed line."""
        pushed.append(line)
        done.set()

    with subprocess.Popen(["sleep", "300"]) as worker:
        assert os.getsid(worker.pid) != worker.pid
        assert agent_module.ExitWatch().watch(make_spec(tmp_path), worker.pid, None, send)
        worker.kill()
        assert done.wait(DEADLINE_S)
    news = json.loads(pushed[0])["exit"]
    assert (news["pid"], news["reaped"]) == (worker.pid, None)
