"""The agent's launcher (its fork server) with real processes and signals: the agent runs as
the daemon starts it (``python -X utf8 -u -c SRC agent``), talked to over its pipes.

Workers are ``sleep``: what matters here is who forked them, what they inherited, and what
outlives what.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from supervisor import agent as agent_module
from supervisor import remote
from tests import pythons
from tests.sshd import children

#: What the daemon sends: the agent and safefiles packed, measured when ./dev test measures
#: coverage.
AGENT_PROGRAM = remote.agent_program()
#: Polling interval of the waits below; every wait has a deadline.
POLL_S = 0.01
#: Generous: a loaded 2-core box starts python and forks in well under this.
DEADLINE_S = 30.0
SYSTEM_PYTHON = Path("/usr/bin/python3")


# --- helpers ----------------------------------------------------------------------------


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = DEADLINE_S) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(POLL_S)  # wait-ok: polling /proc and files, which have no event to await


def status_field(pid: int, name: str) -> str:
    """One field of /proc/PID/status (``PPid``, ``SigIgn``...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    raise AssertionError(f"no {name} in /proc/{pid}/status")


def signal_mask(pid: int, name: str) -> set[int]:
    """The signals in a mask of /proc/PID/status (``SigIgn``, ``SigBlk``, ``SigCgt``)."""
    bits = int(status_field(pid, name), 16)
    return {n for n in range(1, 65) if bits & (1 << (n - 1))}


def is_alive(pid: int) -> bool:
    """Running or stopped; gone and zombies are dead."""
    return not agent_module.is_dead(agent_module.proc_stat(pid))


def comm(pid: int) -> str:
    """``/proc/PID/comm`` (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def ancestors(pid: int) -> list[int]:
    """The parent chain of ``pid`` up to (and including) PID 1."""
    chain: list[int] = []
    while pid > 1:
        pid = int(status_field(pid, "PPid"))
        chain.append(pid)
    return chain


def open_fd_targets(pid: int) -> dict[int, str]:
    """What each open descriptor of ``pid`` points at."""
    targets = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            targets[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return targets


def read_json(path: str) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None while missing or partial."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def make_spec(root: Path, argv: list[str] | None = None) -> dict[str, Any]:
    """A launch spec for shard 0 under ``root``."""
    ctl = root / "ctl"
    ctl.mkdir(parents=True, exist_ok=True)
    return {
        "host": "worker-0",
        "shard": 0,
        "argv": argv or ["sleep", "300"],
        "env": {},
        "python": sys.executable,
        "root": str(root),
        "pidfile": str(ctl / "worker-0.pid"),
        "launch_record": str(ctl / "worker-0.launch.json"),
        "exit_record": str(ctl / "worker-0.exit.json"),
        "log": str(root / "worker-0.log"),
        "lock": str(ctl / "shard-0.lock"),
        "log_max_bytes": 1 << 20,
        "log_backups": 1,
    }


@dataclass
class Launched:
    """A worker a launch reported, and its shepherd (from the launch record)."""

    pid: int
    shepherd: int
    via: str


class PosixSpawned:
    """A child started by ``os.posix_spawn`` with pipes on its stdin and stdout, as the
    embedded SSH server (and Python 3.13's subprocess) start theirs: the parts of ``Popen``
    that ``Agent`` uses."""

    def __init__(self, argv: list[str]) -> None:
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        try:
            self.pid = os.posix_spawn(
                argv[0],
                argv,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, stdin_r, 0),
                    (os.POSIX_SPAWN_DUP2, stdout_w, 1),
                ],
            )
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        self.stdin: IO[bytes] | None = os.fdopen(stdin_w, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(stdout_r, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the child has exited (reaped), else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Reap the child (within ``timeout`` if given); its exit code."""
        wait_until(lambda: self.poll() is not None, f"pid {self.pid} to exit", timeout or 3600)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child unless it was reaped already."""
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


class Agent:
    """``agent.py`` in agent mode as a child process, spoken to over its stdin and stdout."""

    def __init__(
        self,
        python: str,
        prefix: tuple[str, ...] = (),
        ignore: tuple[int, ...] = (),
        *,
        posix_spawn: bool = False,
    ) -> None:
        def ignore_signals() -> None:
            """In the child before exec: ignore ``ignore``, as a parent shell may have."""
            for sig in ignore:
                signal.signal(sig, signal.SIG_IGN)

        argv = [*prefix, python, "-X", "utf8", "-u", "-c", AGENT_PROGRAM, "agent"]
        self.process: subprocess.Popen[bytes] | PosixSpawned
        if posix_spawn:
            assert not ignore
            self.process = PosixSpawned(argv)
        else:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                preexec_fn=ignore_signals if ignore else None,
            )
        assert self.process.stdout is not None
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.process.stdout, selectors.EVENT_READ)
        self._buffer = b""
        self._next_id = 0
        #: Exits the agent pushed (``{"exit": {...}}`` lines), in order.
        self.pushed: list[dict[str, Any]] = []
        self.hello = self.read_message()["hello"]

    @property
    def pid(self) -> int:
        """The agent's pid."""
        return self.process.pid

    def read_message(self) -> dict[str, Any]:
        """The next line the agent writes, as JSON; fails the test after ``DEADLINE_S``."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + DEADLINE_S
        while b"\n" not in self._buffer:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                pytest.fail(f"the agent said nothing for {DEADLINE_S}s")
            if self._selector.select(remaining_s):
                chunk = os.read(self.process.stdout.fileno(), 65536)
                if not chunk:
                    pytest.fail(f"the agent closed its stdout; exit {self.process.poll()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        message = json.loads(line)
        assert isinstance(message, dict)
        return message

    def call(self, op: str, **payload: Any) -> dict[str, Any]:
        """One request and its reply (requests are not overlapped here)."""
        assert self.process.stdin is not None
        self._next_id += 1
        request = {"id": self._next_id, "op": op, **payload}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        reply = self.read_message()
        while "exit" in reply and "id" not in reply:
            self.pushed.append(reply["exit"])  # a worker's exit, pushed unasked
            reply = self.read_message()
        assert reply["id"] == self._next_id
        return reply

    def launch(self, spec: dict[str, Any]) -> Launched:
        """Launch ``spec``'s worker; fail the test unless the launch succeeds."""
        reply = self.call("launch", spec=spec)
        assert reply["ok"], reply
        record = read_json(spec["launch_record"])
        assert record is not None
        assert record["pid"] == reply["result"]["pid"]
        return Launched(reply["result"]["pid"], int(record["shepherd_pid"]), reply["result"]["via"])

    def launcher(self) -> int:
        """The pid of the agent's live launcher, once it has one and its Python is up (it
        names itself ``rs-launcher``): a launch that comes while a loaded machine still starts
        it could wait past ``LAUNCHER_ACK_S`` and go to a fresh interpreter instead."""
        found: list[int] = []

        def live_launcher() -> bool:
            # Named rs-launcher once its Python is up, started in ``launcher`` mode or forked
            # from the agent (whose command line it then shares).
            found[:] = [
                pid for pid in children(self.pid) if is_alive(pid) and comm(pid) == "rs-launcher"
            ]
            return len(found) == 1

        wait_until(live_launcher, f"a live launcher under agent {self.pid}")
        return found[0]

    def kill(self) -> None:
        """SIGKILL the agent and reap it."""
        self.process.kill()
        self.process.wait()
        self._selector.close()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


@dataclass
class Cleanup:
    """Agents and workers started by a test; killed at its end, whatever it did."""

    agents: list[Agent] = field(default_factory=list)
    #: Each worker's pid (its process group's id) and its start time when launched.
    workers: list[tuple[int, int | None]] = field(default_factory=list)

    def agent(
        self,
        python: str = sys.executable,
        prefix: tuple[str, ...] = (),
        *,
        ignore: tuple[int, ...] = (),
        posix_spawn: bool = False,
    ) -> Agent:
        """A new agent, killed at the end of the test."""
        started = Agent(python, prefix, ignore, posix_spawn=posix_spawn)
        self.agents.append(started)
        return started

    def launch(self, on: Agent, spec: dict[str, Any]) -> Launched:
        """``on.launch(spec)``, the worker's group killed at the end of the test."""
        launched = on.launch(spec)
        self.track(launched.pid)
        return launched

    def track(self, pid: int) -> None:
        """Kill ``pid``'s process group at the end of the test, if it is still that group."""
        stat = agent_module.proc_stat(pid)
        self.workers.append((pid, stat[2] if stat is not None else None))

    def run(self) -> None:
        """Kill every worker group (its shepherd then exits) and every agent still running.

        A group whose leader has died and whose number now belongs to another process is
        not ours any more (the kernel reuses a number only once no group holds it): with
        several test runs at once it may be another run's launcher, so it is left alone."""
        for pid, launched_at in self.workers:
            stat = agent_module.proc_stat(pid)
            if stat is not None and (launched_at is None or stat[2] != launched_at):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for started in self.agents:
            if started.process.poll() is None:
                started.kill()


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    """What a test starts dies with it."""
    keeper = Cleanup()
    try:
        yield keeper
    finally:
        keeper.run()


def exit_record_of(spec: dict[str, Any], pid: int) -> dict[str, Any]:
    """Wait for the shepherd's exit record of ``pid``; return it."""
    wait_until(
        lambda: (r := read_json(spec["exit_record"])) is not None and r["pid"] == pid,
        f"the exit record of pid {pid}",
    )
    record = read_json(spec["exit_record"])
    assert record is not None
    return record


def worker_log_once_it_says(spec: dict[str, Any], text: str) -> str:
    """The worker's log once it contains ``text``: the shepherd writes its "exited" line just
    after the exit record (the record first, so that the daemon learns of the exit soonest)."""
    log = Path(spec["log"])
    wait_until(lambda: text in log.read_text(), f"{text!r} in the worker's log")
    return log.read_text()


def stop_and_await_shepherd(spec: dict[str, Any], launched: Launched) -> None:
    """SIGKILL the worker; wait for its exit record and its shepherd's end."""
    os.killpg(launched.pid, signal.SIGKILL)
    exit_record_of(spec, launched.pid)
    wait_until(lambda: not is_alive(launched.shepherd), f"shepherd {launched.shepherd} to exit")


# --- through the launcher ---------------------------------------------------------------


INTERPRETERS = [
    pytest.param(sys.executable, id=f"python{pythons.current()}"),
    *(
        pytest.param(
            pythons.find(version) or f"/nonexistent/python{version}",
            id=f"python{version}",
            marks=[
                pytest.mark.optional_env,
                pytest.mark.skipif(
                    pythons.find(version) is None, reason=f"no Python {version} on this machine"
                ),
            ],
        )
        for version in pythons.OLD_HOSTS
    ),
]


@pytest.mark.parametrize("python", INTERPRETERS)
def test_launched_worker_is_outside_the_agents_tree_and_outlives_agent_and_launcher(
    python: str, tmp_path: Path, cleanup: Cleanup
) -> None:
    """A launch through the launcher gives a worker whose parent chain holds neither agent
    nor launcher, which keeps running when both are SIGKILLed, and whose exit is recorded."""
    spec = make_spec(tmp_path)
    agent = cleanup.agent(python)
    launcher = agent.launcher()
    launched = cleanup.launch(agent, spec)
    assert launched.via == f"launcher pid {launcher}"
    # The shepherd may report before the launcher's middle child has finished exiting (a
    # loaded machine): until then the chain still runs through it.
    wait_until(
        lambda: not {agent.pid, launcher} & set(ancestors(launched.pid)),
        "the shepherd to leave the launcher's tree",
    )
    chain = ancestors(launched.pid)
    assert chain[0] == launched.shepherd
    assert Path(f"/proc/{launched.shepherd}/comm").read_text().strip() == "rs-shepherd"
    # The shepherd is no session leader (it cannot gain a terminal), and the worker leads
    # its own group, which terminate signals.
    assert os.getsid(launched.shepherd) != launched.shepherd
    assert os.getsid(launched.shepherd) not in (os.getsid(agent.pid), os.getsid(0))
    assert os.getpgid(launched.pid) == launched.pid

    agent.kill()
    os.kill(launcher, signal.SIGKILL)
    wait_until(lambda: not is_alive(launcher), "the launcher to die")
    assert is_alive(launched.pid)
    assert is_alive(launched.shepherd)

    os.kill(launched.pid, signal.SIGTERM)
    record = exit_record_of(spec, launched.pid)
    assert (record["exit_code"], record["signal"]) == (None, signal.SIGTERM)


@pytest.mark.parametrize("posix_spawn", [False, True], ids=["popen", "posix_spawn"])
def test_worker_and_shepherd_inherit_nothing_from_the_launcher(
    posix_spawn: bool, tmp_path: Path, cleanup: Cleanup
) -> None:
    """The worker gets default signal dispositions, an empty mask and only its stdio; the
    shepherd keeps no socket or pipe of the launcher's and waits with SIGCHLD at default;
    also when the agent was started by posix_spawn, whose child has the C library's reserved
    signals ignored (glibc: 32 and 33)."""
    if posix_spawn:
        # What the agent below starts with (it puts them back to default itself).
        probe = PosixSpawned(["/bin/sleep", "60"])
        try:
            assert set(range(32, signal.SIGRTMIN)) <= signal_mask(probe.pid, "SigIgn")
        finally:
            probe.kill()
            probe.wait(DEADLINE_S)
            for pipe in (probe.stdin, probe.stdout):
                if pipe is not None:
                    pipe.close()
    spec = make_spec(tmp_path)
    agent = cleanup.agent(posix_spawn=posix_spawn)
    launched = cleanup.launch(agent, spec)
    assert launched.via.startswith("launcher pid ")

    assert signal_mask(launched.pid, "SigIgn") == set()
    assert signal_mask(launched.pid, "SigBlk") == set()
    log = os.path.realpath(spec["log"])
    assert open_fd_targets(launched.pid) == {0: "/dev/null", 1: log, 2: log}

    # What a fresh python ignores (SIGPIPE, so a lost report is EPIPE; SIGXFSZ), nothing
    # else: in particular not SIGCHLD.
    assert signal_mask(launched.shepherd, "SigIgn") == {signal.SIGPIPE, signal.SIGXFSZ}
    assert signal_mask(launched.shepherd, "SigBlk") == set()
    assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} <= signal_mask(
        launched.shepherd, "SigCgt"
    )
    assert signal.SIGCHLD not in signal_mask(launched.shepherd, "SigCgt")
    targets = open_fd_targets(launched.shepherd)
    assert not [t for t in targets.values() if t.startswith(("socket:", "pipe:"))], targets
    assert set(targets.values()) == {"/dev/null", log, os.path.realpath(spec["lock"])}


def test_signals_the_agent_inherited_ignored_stay_ignored_by_either_launch_path(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """A shepherd forked by the launcher has the signal state a fresh interpreter would
    have, including what the agent's own parent ignored (SIGQUIT here, as a background job
    of a script has it), and so does its worker: the launcher is faster, not different."""
    spec = make_spec(tmp_path)
    agent = cleanup.agent(ignore=(signal.SIGQUIT,))
    forked = cleanup.launch(agent, spec)
    assert forked.via.startswith("launcher pid ")
    names = ("SigIgn", "SigBlk", "SigCgt")
    forked_masks = {name: signal_mask(forked.shepherd, name) for name in names}
    assert signal.SIGQUIT in forked_masks["SigIgn"]
    forked_worker_ignores = signal_mask(forked.pid, "SigIgn")
    assert signal.SIGQUIT in forked_worker_ignores
    stop_and_await_shepherd(spec, forked)

    first = agent.launcher()
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: not is_alive(first), "the launcher to die")
    fresh = cleanup.launch(agent, spec)
    assert fresh.via.startswith("fresh interpreter; ")
    assert {name: signal_mask(fresh.shepherd, name) for name in names} == forked_masks
    assert signal_mask(fresh.pid, "SigIgn") == forked_worker_ignores


def test_shepherd_shrugs_off_sigterm_sighup_sigint_and_still_records_the_exit(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """A launcher-forked shepherd ignores SIGTERM, SIGHUP and SIGINT and records the exit of
    its worker afterwards; the worker itself dies of SIGTERM."""
    spec = make_spec(tmp_path)
    agent = cleanup.agent()
    launched = cleanup.launch(agent, spec)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        os.kill(launched.shepherd, sig)
    # Signals are delivered before the shepherd runs again; so if it records the exit
    # below, it lived through them.
    os.kill(launched.pid, signal.SIGTERM)
    record = exit_record_of(spec, launched.pid)
    assert record["signal"] == signal.SIGTERM
    worker_log_once_it_says(spec, f"worker pid {launched.pid} exited (signal {signal.SIGTERM})")


@pytest.mark.parametrize("filler_lines", [0, 500], ids=["short log", "log past the cap"])
def test_exit_record_carries_the_end_of_the_workers_log(
    filler_lines: int, tmp_path: Path, cleanup: Cleanup
) -> None:
    """A worker that exits 2 after a traceback leaves its exit record with the log's end:
    the worker's last line last (the shepherd's own lines left out), at most LOG_TAIL_BYTES,
    starting at a whole line."""
    script = (
        f"for i in $(seq {filler_lines}); do echo filler line $i; done;"
        " echo 'Traceback (most recent call last):' >&2;"
        " echo \"ModuleNotFoundError: No module named 'reward_v2'\" >&2; exit 2"
    )
    spec = make_spec(tmp_path, ["/bin/sh", "-c", script])
    launched = cleanup.launch(cleanup.agent(), spec)
    record = exit_record_of(spec, launched.pid)
    assert (record["exit_code"], record["signal"]) == (2, None)
    tail = record["log_tail"]
    assert tail.endswith("ModuleNotFoundError: No module named 'reward_v2'\n")
    assert len(tail.encode()) <= agent_module.LOG_TAIL_BYTES
    assert "[shepherd " not in tail
    assert "worker pid" in Path(spec["log"]).read_text()  # the shepherd did write its lines
    if filler_lines:
        assert tail.startswith("filler line ")  # a whole line, not the cut end of one
        assert "filler line 1\n" not in tail
    else:
        assert tail == (
            "Traceback (most recent call last):\nModuleNotFoundError: No module named 'reward_v2'\n"
        )


def test_launcher_leaves_no_zombies_after_several_launches(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """After five launches and exits nothing is left under the launcher, not even a zombie:
    it reaps its middle children, and the shepherds were never its children."""
    spec = make_spec(tmp_path)
    agent = cleanup.agent()
    launcher = agent.launcher()
    for _ in range(5):
        launched = cleanup.launch(agent, spec)
        assert launched.via == f"launcher pid {launcher}"
        assert launched.shepherd not in children(launcher)
        stop_and_await_shepherd(spec, launched)
    wait_until(lambda: children(launcher) == [], f"no children under launcher {launcher}")
    assert agent.launcher() == launcher


def test_a_worker_s_exit_is_pushed_with_its_code_after_the_launch_reply(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """A worker that exits 3 is pushed unasked, after the launch's reply, with code 3, its
    start time and its last words, as its exit record then says (the same log tail, so a
    crash signature is the same whichever of the two comes first)."""
    spec = make_spec(
        tmp_path, ["sh", "-c", "sleep 0.3; echo 'ImportError: no module named rewards'; exit 3"]
    )
    agent = cleanup.agent()
    launched = cleanup.launch(agent, spec)
    pushed = agent.read_message()
    assert "id" not in pushed
    news = pushed["exit"]
    assert (news["pid"], news["exit_code"], news["signal"]) == (launched.pid, 3, None)
    assert news["log_tail"].endswith("ImportError: no module named rewards\n"), news
    wait_until(lambda: read_json(spec["exit_record"]) is not None, "the exit record")
    record = read_json(spec["exit_record"])
    assert record is not None
    assert (record["pid"], record["exit_code"], record["start_time"], record["log_tail"]) == (
        launched.pid,
        3,
        news["start_time"],
        news["log_tail"],
    )


def test_an_exit_carries_its_own_workers_last_words_and_no_earlier_ones(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """Every worker of a host appends to one log: a worker that wrote nothing has no log
    tail, in its pushed exit and its exit record alike, rather than the last words of the
    one before it; the next one's tail holds its own lines only."""
    spec = make_spec(tmp_path, ["sh", "-c", "sleep 0.2; echo 'first: ImportError'; exit 3"])
    agent = cleanup.agent()
    tails = []
    for argv in (
        spec["argv"],
        ["sh", "-c", "sleep 0.2; exit 4"],
        ["sh", "-c", "sleep 0.2; echo third; exit 5"],
    ):
        launched = cleanup.launch(agent, {**spec, "argv": argv})
        pushed = agent.read_message()["exit"]
        assert pushed["pid"] == launched.pid
        record = exit_record_of(spec, launched.pid)
        assert record["log_tail"] == pushed["log_tail"]
        tails.append(record["log_tail"])
        wait_until(lambda: not is_alive(launched.shepherd), "the shepherd to let go")  # noqa: B023
    assert tails == ["first: ImportError\n", None, "third\n"]
    # Still in the log, where the second worker's whole tail would have shown it.
    assert "first: ImportError\n" in Path(spec["log"]).read_text().splitlines(keepends=True)


def test_launcher_exits_when_the_agent_does_and_the_worker_carries_on(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """Closing the agent's stdin ends the agent and then its launcher; the worker and its
    shepherd keep running."""
    spec = make_spec(tmp_path)
    agent = cleanup.agent()
    launcher = agent.launcher()
    launched = cleanup.launch(agent, spec)
    assert agent.process.stdin is not None
    agent.process.stdin.close()
    assert agent.process.wait(timeout=DEADLINE_S) == 0
    agent.kill()  # closes our pipes; the agent is gone already
    wait_until(lambda: not is_alive(launcher), "the launcher to exit")
    assert is_alive(launched.pid)
    assert is_alive(launched.shepherd)


def test_launch_after_the_launcher_was_killed_goes_fresh_and_restarts_it(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """With the launcher SIGKILLed, the next launch still succeeds, through a fresh
    interpreter, and says so; the launch after it goes through a restarted launcher. Both
    shepherds are alike."""
    spec = make_spec(tmp_path)
    agent = cleanup.agent()
    first = agent.launcher()
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: not is_alive(first), "the launcher to die")

    fresh = cleanup.launch(agent, spec)
    assert fresh.via.startswith(f"fresh interpreter; launcher pid {first} is gone")
    assert "died of signal 9" in fresh.via
    assert agent.pid not in ancestors(fresh.pid)
    masks = {name: signal_mask(fresh.shepherd, name) for name in ("SigIgn", "SigBlk", "SigCgt")}
    stop_and_await_shepherd(spec, fresh)

    second = agent.launcher()
    assert second != first
    forked = cleanup.launch(agent, spec)
    assert forked.via == f"launcher pid {second}"
    assert {name: signal_mask(forked.shepherd, name) for name in masks} == masks


def test_stopped_launcher_is_replaced_and_the_launch_starts_one_worker(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """A SIGSTOPped launcher costs a launch ``LAUNCHER_ACK_S``, then is killed and replaced,
    and the launch goes to a fresh interpreter: exactly one worker, no refusal."""
    spec = make_spec(tmp_path)
    agent = cleanup.agent()
    stopped = agent.launcher()
    os.kill(stopped, signal.SIGSTOP)
    wait_until(lambda: status_field(stopped, "State").startswith("T"), "the launcher to stop")

    launched = cleanup.launch(agent, spec)
    assert launched.via.startswith(
        f"fresh interpreter; launcher pid {stopped} did not answer within"
        f" {agent_module.LAUNCHER_ACK_S:g}s"
    )
    wait_until(lambda: not is_alive(stopped), "the stopped launcher to be killed")
    assert agent.launcher() != stopped
    assert agent.call("probe", spec=spec, pid=None)["result"]["pid"] == launched.pid


@pytest.mark.skipif(
    os.geteuid() != 0 or not SYSTEM_PYTHON.exists() or not shutil.which("setpriv"),
    reason="needs root (to become nobody), setpriv and a python nobody may run",
)
def test_agent_as_nobody_launches_through_its_launcher(cleanup: Cleanup) -> None:
    """An agent running as user nobody starts its launcher as nobody, and the worker it
    launches runs as nobody outside the agent's tree."""
    shared = Path(tempfile.mkdtemp(prefix="launcher-nonroot-"))
    try:
        shared.chmod(0o755)
        root = shared / "run"
        spec = make_spec(root)
        nobody = int(subprocess.run(["id", "-u", "nobody"], capture_output=True, check=True).stdout)
        for path in (root, root / "ctl"):
            os.chown(path, nobody, -1)
        prefix = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")
        agent = cleanup.agent(str(SYSTEM_PYTHON), prefix)
        launcher = agent.launcher()
        assert os.stat(f"/proc/{launcher}").st_uid == nobody
        launched = cleanup.launch(agent, spec)
        assert launched.via == f"launcher pid {launcher}"
        assert os.stat(f"/proc/{launched.pid}").st_uid == nobody
        assert agent.pid not in ancestors(launched.pid)
        os.kill(launched.pid, signal.SIGTERM)
        assert exit_record_of(spec, launched.pid)["signal"] == signal.SIGTERM
    finally:
        cleanup.run()
        shutil.rmtree(shared)


# --- in-process, as the fleet simulator calls it ----------------------------------------


@pytest.fixture
def in_process() -> Iterator[None]:
    """``agent.answer`` usable in this process (its program set, as ``bench/fleetsim.py``
    does); any launcher it starts is killed at the end."""
    agent_module._SOURCE[:] = [AGENT_PROGRAM]
    try:
        yield
    finally:
        with agent_module._LAUNCHER_LOCK:
            for launcher in agent_module._LAUNCHER:
                launcher.discard()
            agent_module._LAUNCHER.clear()


@pytest.mark.usefixtures("in_process")
def test_answer_in_process_starts_a_launcher_on_first_launch(
    tmp_path: Path, cleanup: Cleanup
) -> None:
    """Without ``serve()`` no launcher runs; the first launch starts one, and says so."""
    assert agent_module._LAUNCHER == []
    spec = make_spec(tmp_path)
    reply = agent_module.answer({"id": 7, "op": "launch", "spec": spec})
    assert reply["ok"], reply
    cleanup.track(reply["result"]["pid"])
    [launcher] = agent_module._LAUNCHER
    assert reply["result"]["via"] == f"launcher pid {launcher.process.pid} (started now)"
    assert os.getpid() not in ancestors(reply["result"]["pid"])


@pytest.mark.usefixtures("in_process")
def test_launch_goes_fresh_when_no_launcher_can_start(
    tmp_path: Path, cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher that cannot be started (here: no such program) does not fail the launch:
    a fresh interpreter starts the shepherd, and the reply says why."""

    def cannot_start(python: str) -> agent_module._Launcher:
        """Fail as Popen fails on a missing interpreter."""
        raise FileNotFoundError(2, "No such file or directory", python)

    monkeypatch.setattr(agent_module, "_Launcher", cannot_start)
    spec = make_spec(tmp_path)
    reply = agent_module.answer({"id": 1, "op": "launch", "spec": spec})
    assert reply["ok"], reply
    cleanup.track(reply["result"]["pid"])
    assert reply["result"]["via"].startswith("fresh interpreter; no launcher (cannot start one:")
    assert "No such file or directory" in reply["result"]["via"]
    log = Path(spec["log"]).read_text()
    assert "starting worker (via fresh interpreter; no launcher" in log


@pytest.mark.usefixtures("in_process")
def test_shepherd_dying_before_its_report_closes_the_pipe_with_its_traceback(
    tmp_path: Path,
) -> None:
    """A forked shepherd that dies before reporting (here: an order without ``via``) leaves
    the agent EOF on the report pipe and its traceback, not a wait for the deadline."""
    launcher = agent_module._Launcher(sys.executable)
    agent_module._LAUNCHER.append(launcher)  # the fixture discards it
    read_fd, write_fd = os.pipe()
    order = json.dumps({"spec": make_spec(tmp_path)}).encode()
    fds = [
        (
            socket.SOL_SOCKET,
            socket.SCM_RIGHTS,
            bytes(array.array("i", [write_fd])),
        )
    ]
    launcher.channel.sendmsg([order], fds)
    os.close(write_fd)
    assert b"forked" in launcher.channel.recv(4096)
    started = time.monotonic()
    output = agent_module._read_to_eof(read_fd, DEADLINE_S)
    assert output is not None
    assert time.monotonic() - started < DEADLINE_S
    assert "KeyError: 'via'" in output
    with pytest.raises(agent_module.OpError, match="exited without a report: Traceback"):
        agent_module._parse_report(output, "", "exited")
    assert not Path(make_spec(tmp_path)["pidfile"]).exists()


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc-polling"])
def test_wait_dead_times_out_on_a_live_process_and_returns_once_it_dies(
    pidfd: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """terminate's wait: False after its timeout while the process lives; True once it died
    (a zombie is dead), or at once when the pid's start time is not ours (reused). With the
    kernel's pidfd, and by polling /proc where the kernel or Python has none."""
    opened: list[int] = []
    if pidfd:
        real_open = os.pidfd_open

        def spy(pid: int, flags: int = 0) -> int:
            """os.pidfd_open, noting which pid it was asked for."""
            opened.append(pid)
            return real_open(pid, flags)

        monkeypatch.setattr(os, "pidfd_open", spy)
    else:
        monkeypatch.delattr(os, "pidfd_open")
    proc = subprocess.Popen(["sleep", "60"])
    try:
        stat = agent_module.proc_stat(proc.pid)
        assert stat is not None
        start_time = stat[2]
        assert agent_module._wait_dead(proc.pid, start_time, 0.05) is False
        assert agent_module._wait_dead(proc.pid, start_time + 1, DEADLINE_S) is True
        outcome: list[bool] = []
        waiter = threading.Thread(
            target=lambda: outcome.append(agent_module._wait_dead(proc.pid, start_time, DEADLINE_S))
        )
        waiter.start()
        os.kill(proc.pid, signal.SIGKILL)  # our child: a zombie until proc.wait() below
        waiter.join(DEADLINE_S + 5)
        assert outcome == [True]
        assert opened == ([proc.pid] * 3 if pidfd else [])
    finally:
        proc.kill()
        proc.wait()


# --- the exit watch, on its own --------------------------------------------------------


class Pushes:
    """The lines an ``ExitWatch`` pushed, read back as exits."""

    def __init__(self) -> None:
        self.exits: list[agent_module.WorkerExit] = []
        self._lock = threading.Lock()

    def send(self, line: str) -> None:
        """The ``send`` handed to the watch (called from its thread)."""
        news = agent_module.read_push(json.loads(line))
        assert isinstance(news, agent_module.WorkerExit)
        with self._lock:
            self.exits.append(news)

    def pids(self) -> list[int]:
        """The pids pushed so far, in order."""
        with self._lock:
            return [news.pid for news in self.exits]


def test_without_pidfds_the_watch_polls_proc_and_still_pushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel or Python has no pidfd, a killed worker's exit is still pushed (found
    by the watch's bounded look at /proc)."""
    monkeypatch.delattr(os, "pidfd_open")
    spec = make_spec(tmp_path)
    pushes = Pushes()
    watch = agent_module.ExitWatch()
    with subprocess.Popen(["sleep", "300"]) as worker:
        assert watch.watch(spec, worker.pid, None, pushes.send)
        assert pushes.pids() == []
        worker.kill()
        wait_until(lambda: pushes.pids() == [worker.pid], "the pushed exit")
    assert watch.watched() == []


def test_a_pid_already_dead_is_pushed_at_once_with_its_record_s_status(tmp_path: Path) -> None:
    """Asked to watch a worker that ended while nobody watched, the watch pushes its exit at
    once, with the code its shepherd's exit record gives."""
    spec = make_spec(tmp_path)
    with subprocess.Popen(["sleep", "300"]) as worker:
        start = agent_module.proc_stat(worker.pid)
        assert start is not None
        worker.kill()
    Path(spec["exit_record"]).write_text(
        json.dumps({"pid": worker.pid, "start_time": start[2], "exit_code": 7, "signal": None})
    )
    pushes = Pushes()
    assert not agent_module.ExitWatch().watch(spec, worker.pid, start[2], pushes.send)
    assert [(n.pid, n.exit_code, n.signal) for n in pushes.exits] == [(worker.pid, 7, None)]


def test_the_watch_keeps_at_most_its_limit_dropping_the_oldest(tmp_path: Path) -> None:
    """Past its limit the watch forgets the oldest worker: its exit is left to its record."""
    spec = make_spec(tmp_path)
    pushes = Pushes()
    watch = agent_module.ExitWatch(limit=2)
    workers = [subprocess.Popen(["sleep", "300"]) for _ in range(3)]
    try:
        for worker in workers:
            assert watch.watch(spec, worker.pid, None, pushes.send)
        assert watch.watched() == [w.pid for w in workers[1:]]
        for worker in workers:
            worker.kill()
        wait_until(lambda: sorted(pushes.pids()) == sorted(w.pid for w in workers[1:]), "two")
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert workers[0].pid not in pushes.pids()


#: Run by each host Python: watch ``n`` sleeps, kill them in reverse order, print each
#: pushed exit line as it comes, then the pids still watched. ``agent.py`` and
#: ``safefiles.py`` are loaded from their files as the daemon sends them (a host has no
#: ``supervisor`` package).
_WATCH_MANY = """
import importlib.util, json, os, signal, subprocess, sys, threading, time
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as the daemon's ``-c`` program runs it: a module of its own
    spec.loader.exec_module(module)
    return module
load(sys.argv[3], sys.argv[4])
agent = load("agent", sys.argv[1])
n = int(sys.argv[2])
lines, lock = [], threading.Lock()
def send(line):
    with lock:
        lines.append(line)
watch = agent.ExitWatch()
workers = [subprocess.Popen(["sleep", "300"]) for _ in range(n)]
for w in workers:
    assert watch.watch({"exit_record": None, "root": None}, w.pid, None, send)
spawned = [w.pid for w in workers]
print(json.dumps({"watched": sorted(watch.watched()), "spawned": spawned}), flush=True)
for w in reversed(workers):
    w.kill()
    deadline = time.monotonic() + 30
    while not any('"pid":%d,' % w.pid in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.005)  # wait-ok: poll interval of a deadline loop
    w.wait()
time.sleep(0.2)  # wait-ok: an absence is checked: a second push of one exit would be here
for line in lines:
    print(line.strip(), flush=True)
print(json.dumps({"left": watch.watched()}), flush=True)
"""


@pytest.mark.parametrize("python", INTERPRETERS)
def test_the_watch_pushes_each_of_many_exits_once_on_every_host_python(python: str) -> None:
    """On every host Python (pidfds from 3.9, /proc looks before), each of many watched
    workers' exits is pushed once, in the order they died, and leaves the watch empty."""
    agent_path = Path(agent_module.__file__)
    [(module, module_path)] = remote.AGENT_MODULES
    done = subprocess.run(
        [python, "-c", _WATCH_MANY, str(agent_path), "8", module, str(module_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    first, *pushed, last = (json.loads(line) for line in done.stdout.splitlines())
    spawned = first["spawned"]
    assert first["watched"] == sorted(spawned)
    exits = [agent_module.read_push(message) for message in pushed]
    assert all(isinstance(e, agent_module.WorkerExit) for e in exits)
    assert [(e.pid, e.signal) for e in exits if isinstance(e, agent_module.WorkerExit)] == [
        (pid, signal.SIGKILL) for pid in reversed(spawned)
    ]
    assert last == {"left": []}
