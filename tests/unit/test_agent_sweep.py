"""The agent's sweep of a dead worker's session, on fake /proc readings: when it is safe, and
what it does with what it finds (the real thing is in tests/integration/test_sweep.py)."""

from __future__ import annotations

import pytest

from supervisor import agent

#: The dead worker's pid and start time, and a family of its session.
WORKER, STARTED = 4711, 1000
Ids = tuple[str, int, int, int]


@pytest.mark.parametrize(
    ("ids", "start_time", "safe"),
    [
        pytest.param(None, STARTED, True, id="gone"),
        pytest.param(None, None, True, id="gone, start time unknown"),
        pytest.param(("Z", WORKER, WORKER, STARTED), STARTED, True, id="its own zombie"),
        pytest.param(("X", WORKER, WORKER, STARTED), STARTED, True, id="its own, dying"),
        pytest.param(("S", WORKER, WORKER, STARTED), STARTED, False, id="alive"),
        pytest.param(("T", WORKER, WORKER, STARTED), STARTED, False, id="stopped"),
        pytest.param(("D", WORKER, WORKER, STARTED), STARTED, False, id="in the kernel"),
        pytest.param(("S", WORKER, WORKER, 2000), STARTED, False, id="reused, a leader"),
        pytest.param(("R", 1, 1, 2000), STARTED, False, id="reused"),
        pytest.param(("Z", WORKER, WORKER, 2000), STARTED, False, id="another's zombie"),
        pytest.param(("Z", WORKER, WORKER, STARTED), None, False, id="a zombie, unknown"),
    ],
)
def test_a_session_is_swept_only_while_its_number_is_no_live_process(
    ids: Ids | None, start_time: int | None, safe: bool
) -> None:
    """Gone, or the worker's own zombie: its number cannot be another session's, so what
    holds it is the worker's. Alive, a zombie of another start time, or one whose start
    time is unknown: never."""
    assert agent.sweep_safe(ids, start_time) is safe


class FakeProc:
    """/proc as the sweep reads it, and the kills it sends: processes die when killed."""

    def __init__(self, table: dict[int, Ids]) -> None:
        self.table = dict(table)
        self.killed: list[int] = []
        #: Pids that cannot be killed (another user's), and forks made at the first kill.
        self.immune: set[int] = set()
        self.forks: dict[int, Ids] = {}

    def ids(self, pid: int) -> Ids | None:
        """``proc_ids``."""
        return self.table.get(pid)

    def pids(self) -> list[int]:
        """``_live_pids``."""
        return sorted(self.table)

    def kill(self, pid: int, start_time: int) -> bool:
        """``_kill_exact``: the process becomes a zombie."""
        if pid in self.immune:
            return False
        _state, pgid, sid, started = self.table[pid]
        assert started == start_time
        self.killed.append(pid)
        self.table[pid] = ("Z", pgid, sid, started)
        self.table.update(self.forks)
        self.forks = {}
        return True

    def wait_dead(self, pid: int, start_time: int, timeout_s: float) -> bool:
        """``_wait_dead``, at once."""
        return agent.is_dead(self.table.get(pid))


@pytest.fixture
def proc(monkeypatch: pytest.MonkeyPatch) -> FakeProc:
    """A dead worker (gone), two children in its group, a grandchild in a group of its own,
    a zombie member, and bystanders: its shell's session and an unrelated one."""
    fake = FakeProc(
        {
            101: ("S", WORKER, WORKER, 1),
            102: ("S", WORKER, WORKER, 2),
            103: ("S", 103, WORKER, 3),
            104: ("Z", WORKER, WORKER, 4),
            200: ("S", 200, 200, 5),
            201: ("S", 201, 200, 6),
        }
    )
    monkeypatch.setattr(agent, "proc_ids", fake.ids)
    monkeypatch.setattr(agent, "_live_pids", fake.pids)
    monkeypatch.setattr(agent, "_kill_exact", fake.kill)
    monkeypatch.setattr(agent, "_wait_dead", fake.wait_dead)
    return fake


def test_every_live_member_of_session_or_group_is_killed_and_counted(proc: FakeProc) -> None:
    """Both children and the grandchild in another group are killed and counted; a zombie
    member is dead already, and processes of other sessions are left alone."""
    assert agent.sweep(WORKER, STARTED) == ({101: 1, 102: 2, 103: 3}, [])
    assert sorted(proc.killed) == [101, 102, 103]


def test_a_member_forked_during_the_sweep_is_found_by_the_next_look(proc: FakeProc) -> None:
    """A child forked between the look and the kill is killed by the look that follows."""
    proc.forks = {105: ("S", WORKER, WORKER, 7)}
    killed, survivors = agent.sweep(WORKER, STARTED) or ({}, [])
    assert sorted(killed) == [101, 102, 103, 105]
    assert survivors == []


def test_a_member_that_cannot_be_killed_is_a_survivor_not_a_kill(proc: FakeProc) -> None:
    """A member the agent may not signal is reported alive, not counted as killed."""
    proc.immune = {102}
    assert agent.sweep(WORKER, STARTED) == ({101: 1, 103: 3}, [102])


def test_nothing_is_touched_while_the_worker_lives_or_once_its_number_is_reused(
    proc: FakeProc,
) -> None:
    """The worker alive, or its number now another process's: no sweep (None), no kill."""
    for worker in (("S", WORKER, WORKER, STARTED), ("S", WORKER, WORKER, STARTED + 1)):
        proc.table[WORKER] = worker
        assert agent.sweep(WORKER, STARTED) is None
    assert proc.killed == []


def test_the_worker_s_own_zombie_is_swept_around_and_not_counted(proc: FakeProc) -> None:
    """While the shepherd holds the worker's zombie, its session is swept; the zombie itself
    is neither killed nor counted."""
    proc.table[WORKER] = ("Z", WORKER, WORKER, STARTED)
    assert agent.sweep(WORKER, STARTED) == ({101: 1, 102: 2, 103: 3}, [])
    assert WORKER not in proc.killed


def test_a_reuse_seen_mid_sweep_stops_the_looking(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the number is seen to be another live process's, the sweep looks no more (the
    old session was empty when the number was reused) and reports what it killed."""
    looks: list[int] = []
    real = proc.ids

    def reused_after_first_look(pid: int) -> Ids | None:
        """The worker's number is a new live process from the second look at it on."""
        if pid == WORKER:
            looks.append(pid)
            return None if len(looks) == 1 else ("S", WORKER, WORKER, STARTED + 9)
        return real(pid)

    proc.forks = {105: ("S", WORKER, WORKER, 7)}
    monkeypatch.setattr(agent, "proc_ids", reused_after_first_look)
    assert agent.sweep(WORKER, STARTED) == ({101: 1, 102: 2, 103: 3}, [])
    assert 105 not in proc.killed
