"""The agent's ``disarm_seed`` op against real bash respawn loops shaped like the old script's
wrapper: every loop process ends, the worker it started lives on, nothing starts again."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor import agent, safefiles

DEADLINE_S = 30.0
POLL_S = 0.01
#: A respawn loop without a pause starts its next worker within milliseconds of the last
#: one's exit: nothing appearing for this long means nothing is left to start one.
QUIET_S = 1.5

# The old script's wrapper (reward_workers_ctl.py), with ``sleep TOKEN`` as its worker so
# that the test's processes are told apart from everything else on a shared machine.
LOOP = """#!/usr/bin/env bash
set +e
STOP="{stop}"
PIDF="{pidfile}"
while [ ! -f "$STOP" ]; do
  {start} &
  wpid=$!
  {record}
  wait "$wpid"
  {pause}
done
"""


@dataclass
class Loop:
    """One host's wrapper script and the files it uses."""

    ctl: Path
    token: str
    script: Path
    pidfile: Path

    def spec(self) -> dict[str, Any]:
        """The launch spec the daemon would send for this host."""
        return {"argv": ["sleep", self.token], "host": "seedhost-0", "pidfile": str(self.pidfile)}

    def start(self, *, relative: bool = False) -> None:
        """Run the loop detached (``setsid -f``, as the old script's ``nohup ... &``)."""
        arg = self.script.name if relative else str(self.script)
        subprocess.run(["setsid", "-f", "bash", arg], cwd=self.ctl, check=True)

    def workers(self) -> list[int]:
        """Live ``sleep TOKEN`` processes."""
        return sorted(p for p in _pids() if _args(p) == ["sleep", self.token] and _alive(p))

    def loops(self) -> list[int]:
        """Live processes running this very script (the loop, or a subshell of it): named by
        its path, or by its name from its directory. Another run's tests use the same names
        at the same time, and the fixture kills what this returns."""
        return sorted(p for p in _pids() if self._runs_script(p) and _alive(p))

    def _runs_script(self, pid: int) -> bool:
        """``pid`` names this script by its path, or by its name with ``ctl`` as its cwd."""
        args = _args(pid)[1:]
        if str(self.script) in args:
            return True
        if self.script.name not in args:
            return False
        try:
            return os.readlink(f"/proc/{pid}/cwd") == str(self.ctl)
        except OSError:
            return False


@pytest.fixture
def make_loop(tmp_path: Path) -> Iterator[Callable[..., Loop]]:
    """Wrapper scripts in ``tmp_path/ctl``; every process of theirs is killed afterwards."""
    made: list[Loop] = []

    def make(
        *, worker_s: str = "3600", pause: str = "sleep 2", record: bool = True, exec_after: str = ""
    ) -> Loop:
        """A wrapper whose worker is ``sleep`` for ``worker_s`` (made unique per loop); with
        ``exec_after``, the forked subshell waits that long before it execs the worker (the
        old script's redirection to a log on NFS can take that long)."""
        ctl = tmp_path / "ctl"
        ctl.mkdir(exist_ok=True)
        token = f"{worker_s}{random.randrange(10**6, 10**7)}"
        script = ctl / f"seedhost-{len(made)}.wrap.sh"
        pidfile = ctl / "seedhost-0.pid"
        script.write_text(
            LOOP.format(
                stop=ctl / "seedhost-0.stop",
                pidfile=pidfile,
                start=f"( sleep {exec_after}; exec sleep {token} )"
                if exec_after
                else f"sleep {token}",
                record='echo "$wpid" > "$PIDF"' if record else ":",
                pause=pause,
            )
        )
        loop = Loop(ctl=ctl, token=token, script=script, pidfile=pidfile)
        made.append(loop)
        return loop

    yield make
    for loop in made:
        for pid in loop.loops() + loop.workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


def disarm(loop: Loop, *, dry_run: bool = False) -> dict[str, Any]:
    """The op as the agent serves it (``answer``), unwrapped."""
    reply = agent.answer(
        {
            "id": 1,
            "op": "disarm_seed",
            "spec": loop.spec(),
            "wrap_script": str(loop.script),
            "dry_run": dry_run,
        }
    )
    assert reply["ok"], reply
    result: dict[str, Any] = reply["result"]
    return result


def test_the_loop_dies_and_its_worker_lives_and_is_not_restarted(
    make_loop: Callable[..., Loop],
) -> None:
    """A dry run changes nothing; then the loop is killed, the worker survives it, and when
    that worker exits no other takes its place."""
    loop = make_loop()
    loop.start()
    wait_until(lambda: len(loop.workers()) == 1 and _pidfile(loop) == loop.workers()[0], "a worker")
    worker = loop.workers()[0]
    wrapper = loop.loops()
    assert len(wrapper) == 1

    looked = disarm(loop, dry_run=True)
    assert (looked["wrappers"], looked["workers"], looked["killed"]) == (wrapper, [worker], False)
    assert loop.loops() == wrapper

    done = disarm(loop)
    assert done["wrappers"] == wrapper and done["workers"] == [worker] and done["killed"]
    assert loop.loops() == []
    assert _alive(worker)
    os.kill(worker, signal.SIGTERM)
    wait_until(lambda: not _alive(worker), "the worker gone")
    stays_true(lambda: loop.workers() == [], "no worker started again")


def test_a_worker_forked_but_not_yet_started_is_never_started(
    make_loop: Callable[..., Loop],
) -> None:
    """The loop has forked its next worker, which has not exec'd yet (it still runs the
    loop's script): that subshell is ended with the loop, so no worker appears after."""
    loop = make_loop(pause=":", exec_after="2")
    loop.start()
    wait_until(lambda: len(loop.workers()) == 1, "the first worker")
    first = loop.workers()[0]
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: len(loop.loops()) == 2 and not loop.workers(), "the next one forked")
    done = disarm(loop)
    assert len(done["wrappers"]) == 2 and done["workers"] == [], done
    assert loop.loops() == []
    stays_true(lambda: loop.workers() == [], "no worker started after the disarm")


def test_a_loop_respawning_as_fast_as_it_can_is_still_stopped(
    make_loop: Callable[..., Loop],
) -> None:
    """A worker that exits at once and a loop with no pause: forks race the freeze, and the
    op still ends every process of the loop, after which nothing starts."""
    loop = make_loop(worker_s="0.00", pause=":")
    loop.start()
    wait_until(lambda: _pidfile(loop) is not None, "the loop running")
    done = disarm(loop)
    assert done["wrappers"], done
    assert loop.loops() == []
    # A worker the loop started just before it was frozen may still be ending (its sleep of
    # 0 s, on a loaded machine): only a worker that was not there at the end counts.
    there = set(loop.workers())
    stays_true(lambda: set(loop.workers()) <= there, "no worker started after the disarm")


def test_a_relative_path_two_loops_and_an_unrecorded_worker(
    make_loop: Callable[..., Loop],
) -> None:
    """A loop started by a relative path is found by file identity; a loop that never wrote
    the pidfile gets it pointed at its worker; two loops for one host (start run twice) both
    end and both workers are reported, with the pidfile left alone."""
    loop = make_loop(record=False)
    loop.start(relative=True)
    wait_until(lambda: len(loop.workers()) == 1, "the worker")
    worker = loop.workers()[0]
    done = disarm(loop)
    assert done["wrappers"] and loop.loops() == []
    assert (done["pidfile_was"], done["pidfile_now"]) == (None, worker)
    assert _pidfile(loop) == worker

    twice = make_loop()
    twice.start()
    wait_until(lambda: len(twice.workers()) == 1, "the first loop's worker")
    # The second start of the same script finds the first one's worker already running.
    twice.start()
    wait_until(lambda: len(twice.workers()) == 2 and len(twice.loops()) == 2, "two loops")
    both = twice.workers()
    # Each loop writes the pidfile just after it starts its worker: wait for the second
    # loop's write (its worker is the newer pid).
    wait_until(lambda: _pidfile(twice) == max(both), "the pidfile naming the second worker")
    recorded = _pidfile(twice)
    done = disarm(twice)
    assert len(done["wrappers"]) == 2 and done["workers"] == both
    assert twice.loops() == []
    assert done["pidfile_now"] == recorded == _pidfile(twice)


# --- helpers ----------------------------------------------------------------------------


def wait_until(predicate: Callable[[], object], what: str) -> None:
    """Poll until ``predicate()``; fail after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {DEADLINE_S}s waiting for {what}")
        time.sleep(POLL_S)  # wait-ok: polling /proc, which has no event to await


def stays_true(predicate: Callable[[], bool], what: str) -> None:
    """``predicate()`` holds at every look for QUIET_S: for what must not happen."""
    end = time.monotonic() + QUIET_S
    while time.monotonic() < end:
        assert predicate(), what
        time.sleep(POLL_S)  # wait-ok: the quiet period is the check itself


def _pidfile(loop: Loop) -> int | None:
    """The pid the loop recorded."""
    return safefiles.read_pid(loop.pidfile)


def _pids() -> list[int]:
    """Every pid on the machine."""
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _args(pid: int) -> list[str]:
    """The command line of ``pid``."""
    return agent.cmdline(pid)


def _alive(pid: int) -> bool:
    """Running or stopped, not gone and not a zombie."""
    return not agent.is_dead(agent.proc_stat(pid))
