"""The daemon's side of evidence before a kill: whatever the host's agent does (hangs, fails,
answers), the terminate goes ahead within ``health.evidence_timeout_s`` plus a round trip, and
its result carries what was captured. The host is a stand-in behind the daemon's own
``RemoteLike`` protocol: the point is the daemon's bound, not SSH."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor import config as config_mod
from supervisor import fleet, health
from supervisor.config import HostConfig, SshConfig
from supervisor.daemon import EVIDENCE_SLACK_S, Daemon, _Link
from supervisor.errors import RemoteError
from supervisor.layout import LaunchSpec
from supervisor.notify import Notifier

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


class NoWatcher:
    """A watcher that watches nothing (the daemon's run loop is not started here)."""

    mode = None
    changes_seen = 0
    parse_errors = 0

    async def run(self, sink: Callable[[list[Any]], None]) -> None:
        """Never called."""

    async def scan_all(self) -> list[Any]:
        """Nothing."""
        return []

    async def scan(self, hosts: Any) -> list[Any]:
        """Nothing."""
        return []

    def set_hosts(self, hosts: Any) -> None:
        """Ignored."""

    def healthy(self, now: float) -> bool:
        """Always."""
        return True


def a_daemon(tmp_path: Path, stand_in: StandIn) -> Daemon:
    """A daemon for one host, worker-0, whose link goes to ``stand_in``."""
    raw = {
        "run": {"root": str(tmp_path / "run")},
        "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
        "health": {"evidence_timeout_s": EVIDENCE_S},
        "hosts": [{"name": "worker-0", "shard": 0}],
    }
    cfg = config_mod.parse(raw, tmp_path / "rs.toml")
    daemon = Daemon(
        cfg,
        notifier=Notifier({}),
        remote_factory=lambda *args: stand_in,
        watcher_factory=lambda config: NoWatcher(),
    )
    daemon._links["worker-0"] = _Link(cfg=cfg.hosts[0], remote=stand_in)
    return daemon


@pytest.mark.parametrize("how", ["hang", "fail", "answer"])
async def test_the_terminate_goes_ahead_within_the_bound_whatever_the_agent_does(
    tmp_path: Path, how: str
) -> None:
    """An agent that never answers is given up on (its call cancelled) after the bound; one
    that fails is a note; one that answers hands its stacks on: in every case the terminate
    follows and its confirmation carries the evidence."""
    stand_in = StandIn(how)
    daemon = a_daemon(tmp_path, stand_in)
    action = fleet.Terminate(host="worker-0", pid=41, grace_s=1.0, kill=True, collect_evidence=True)
    started = time.monotonic()
    await daemon._terminate(action)
    elapsed = time.monotonic() - started
    [observed] = await daemon._inbox.take()
    assert isinstance(observed, fleet.HostObserved)
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
    daemon = a_daemon(tmp_path, stand_in)
    await daemon._terminate(fleet.Terminate(host="worker-0", pid=41, grace_s=1.0, kill=True))
    [observed] = await daemon._inbox.take()
    assert isinstance(observed, fleet.HostObserved)
    assert observed.event == health.TerminateConfirmed(pid=41)
