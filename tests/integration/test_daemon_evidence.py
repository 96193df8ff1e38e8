"""The daemon's side of evidence before a kill (the SSH links adapter, ``links.Links``):
whatever the host's agent does (hangs, fails, answers), the terminate goes ahead within
``health.evidence_timeout_s`` plus a round trip, and its result carries what was captured.
The host is a stand-in behind the adapter's own ``RemoteLike`` protocol, and the daemon a
``shell.Shell`` that records what the adapter emits: the point is the bound, not SSH."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from pathlib import Path
from typing import Any

import pytest

from supervisor import config as config_mod
from supervisor import health, leadership, vocabulary
from supervisor.config import Config, HostConfig, SshConfig
from supervisor.errors import RemoteError
from supervisor.layout import LaunchSpec
from supervisor.links import EVIDENCE_SLACK_S, Links

EVIDENCE_S = 0.5


class StandIn:
    """A host whose agent answers evidence as told: ``hang``, ``fail`` or ``answer``."""

    def __init__(self, evidence: str) -> None:
        """Answer evidence requests the way ``evidence`` says."""
        self.how = evidence
        self.cancelled = False
        self.terminated: list[int] = []

    @property
    def connected(self) -> bool:
        """Always up."""
        return True

    async def maintain(self) -> None:
        """Nothing to maintain."""

    def update(self, host: HostConfig, ssh: SshConfig, python: str) -> None:
        """Nothing to update."""

    async def launch(self, spec: LaunchSpec) -> Any:
        """Not used here."""
        raise RemoteError(spec.host, "not used")

    async def terminate(self, spec: LaunchSpec, pid: int, *, grace_s: float, kill: bool) -> None:
        """Confirm at once."""
        self.terminated.append(pid)

    async def start_agent(self) -> None:
        """Not used here."""

    async def watch(self, spec: LaunchSpec, pid: int, start_time: int | None) -> None:
        """Never asked here."""
        raise AssertionError("watch")

    async def probe(self, spec: LaunchSpec, pid: int | None) -> int | None:
        """Not used here."""
        return None

    async def evidence(
        self, spec: LaunchSpec, pid: int, *, timeout_s: float, stacks: str
    ) -> health.Evidence:
        """Hang until cancelled, fail, or answer with stacks."""
        if self.how == "fail":
            raise RemoteError(spec.host, "evidence: the agent gave no reason")
        if self.how == "answer":
            return health.Evidence(pid=pid, stacks="Thread 1\n", stacks_via="py-spy")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Nothing to close."""


class RecordingShell:
    """The daemon as the adapter sees it: the config, an epoch, and every event it emits."""

    def __init__(self, config: Config) -> None:
        """Record into empty lists."""
        self.config = config
        self.epoch = 1
        self.events: list[vocabulary.Event] = []
        self.led: list[leadership.Event] = []
        self.tasks: list[asyncio.Task[None]] = []

    def emit(self, event: vocabulary.Event) -> None:
        """Recorded."""
        self.events.append(event)

    def emit_all(self, events: Iterable[vocabulary.Event]) -> None:
        """Recorded, in order."""
        self.events.extend(events)

    def lead(self, event: leadership.Event) -> None:
        """Recorded."""
        self.led.append(event)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A task, kept to be awaited or cancelled by the test."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task


@contextlib.asynccontextmanager
async def linked(tmp_path: Path, stand_in: StandIn) -> AsyncIterator[tuple[Links, RecordingShell]]:
    """The links adapter for one host, worker-0, connected to ``stand_in``."""
    raw = {
        "run": {"root": str(tmp_path / "run")},
        "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
        "health": {"evidence_timeout_s": EVIDENCE_S},
        "hosts": [{"name": "worker-0", "shard": 0}],
    }
    shell = RecordingShell(config_mod.parse(raw, tmp_path / "rs.toml"))

    links = Links(
        shell,
        remote_factory=lambda *args: stand_in,
        timed=lambda op, seconds: None,
    )
    links.connect(vocabulary.Connect(host="worker-0", shard=0, added=False, machine="worker-0"))
    try:
        yield links, shell
    finally:
        for task in shell.tasks:
            task.cancel()
        await asyncio.gather(*shell.tasks, return_exceptions=True)


async def terminated(links: Links, shell: RecordingShell, action: vocabulary.Terminate) -> float:
    """Perform ``action`` and wait for its task; the seconds it took."""
    started = time.monotonic()
    links.terminate(action)
    await shell.tasks[-1]
    return time.monotonic() - started


@pytest.mark.parametrize("how", ["hang", "fail", "answer"])
async def test_the_terminate_goes_ahead_within_the_bound_whatever_the_agent_does(
    tmp_path: Path, how: str
) -> None:
    """An agent that never answers is given up on (its call cancelled) after the bound; one
    that fails is a note; one that answers hands its stacks on: in every case the terminate
    follows and its confirmation carries the evidence."""
    stand_in = StandIn(how)
    action = vocabulary.Terminate(
        host="worker-0",
        machine="worker-0",
        shard=0,
        pid=41,
        grace_s=1.0,
        kill=True,
        collect_evidence=True,
    )
    async with linked(tmp_path, stand_in) as (links, shell):
        elapsed = await terminated(links, shell, action)
    [observed] = shell.events
    assert isinstance(observed, vocabulary.HostObserved)
    event = observed.event
    assert isinstance(event, health.TerminateConfirmed) and event.pid == 41
    assert stand_in.terminated == [41]
    evidence = event.evidence
    assert evidence is not None and evidence.pid == 41
    if how == "hang":
        assert stand_in.cancelled
        assert evidence.notes == ("not collected: no answer in time",)
        assert elapsed >= EVIDENCE_S + EVIDENCE_SLACK_S  # waited out the bound, not less
    elif how == "fail":
        assert evidence.notes == ("not collected: evidence: the agent gave no reason",)
    else:
        assert (evidence.stacks, evidence.stacks_via) == ("Thread 1\n", "py-spy")


async def test_no_evidence_is_taken_when_the_core_does_not_ask(tmp_path: Path) -> None:
    """A terminate without ``collect_evidence`` (an operator's stop) asks the host nothing."""
    stand_in = StandIn("fail")
    action = vocabulary.Terminate(
        host="worker-0", machine="worker-0", shard=0, pid=41, grace_s=1.0, kill=True
    )
    async with linked(tmp_path, stand_in) as (links, shell):
        await terminated(links, shell, action)
    [observed] = shell.events
    assert isinstance(observed, vocabulary.HostObserved)
    assert observed.event == health.TerminateConfirmed(pid=41)
