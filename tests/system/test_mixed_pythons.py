"""A fleet whose hosts run another Python than the supervisor: the daemon on this interpreter,
``worker.python`` (agent, launcher, shepherd and the reference worker) on each other promised
version found here. ``./dev test`` runs this tier on every promised version, so each pair is
tried both ways round (3.11 supervising 3.13 hosts, and 3.13 supervising 3.11 hosts)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from supervisor import control
from tests import pythons
from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    Daemons,
    all_ready,
    fast_config,
    host_pids,
    pid_alive,
    poll_until,
    write_config,
)

pytestmark = [pytest.mark.system, pytest.mark.openssh]

REPO = Path(__file__).resolve().parents[2]


def host_python(version: str) -> str:
    """The interpreter of ``version`` on this machine; fails the test when there is none,
    unless ``REWARD_SUPERVISOR_ALLOW_MISSING_PYTHONS=1`` (then it skips, visibly)."""
    python = pythons.find(version)
    if python is None:
        reason = f"no Python {version} on this machine (promised in pyproject.toml)"
        if pythons.missing_allowed():
            pytest.skip(f"{reason}; allowed by {pythons.ALLOW_MISSING_ENV}=1")
        pytest.fail(f"{reason}; set {pythons.ALLOW_MISSING_ENV}=1 to allow")
    return python


def exe(pid: int) -> str:
    """The program ``pid`` runs, symlinks resolved."""
    return os.path.realpath(f"/proc/{pid}/exe")


def shepherd_of(pid: int) -> int:
    """The parent of ``pid`` (the worker's shepherd)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


@pytest.mark.optional_env  # host_python() itself fails or skips, as the environment allows
@pytest.mark.parametrize(
    "version",
    [pytest.param(v, id=f"hosts-{v}") for v in pythons.supported() if v != pythons.current()],
)
async def test_a_fleet_whose_hosts_run_another_python_starts_recovers_and_stops(
    version: str, openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """With hosts on another promised Python, every host's agent reports that version, its
    workers and their shepherds run on it, a SIGKILLed worker is replaced (its exit recorded
    by a shepherd on that Python), and `stop` ends every worker and the daemon."""
    python = host_python(version)
    raw = fast_config(openssh, tmp_path / "run", 2, tmp_path)
    raw["worker"]["python"] = python
    # The reference worker is stdlib-only; the host's bare interpreter finds it in the checkout.
    raw["worker"]["env"] = {"PYTHONPATH": str(REPO)}
    daemon = await daemons.start(write_config(tmp_path / "rs.toml", raw))
    status = await daemon.wait_status(lambda s: all_ready(s, 2), 90, "2 ready")

    agents = [line for line in daemon.lines if line.get("event") == "agent.started"]
    assert agents, daemon.tail()
    assert {line["python"] for line in agents} == {python}
    assert {line["python_version"].rsplit(".", 1)[0] for line in agents} == {version}
    pids = host_pids(status)
    expected_exe = os.path.realpath(python)
    for pid in pids.values():
        assert pid is not None
        assert exe(pid) == expected_exe
        assert exe(shepherd_of(pid)) == expected_exe

    victim = pids["worker-1"]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    status = await daemon.wait_status(
        lambda s: all_ready(s, 2) and s["hosts"]["worker-1"]["pid"] not in (None, victim),
        90,
        "worker-1 replaced",
    )
    record = json.loads((tmp_path / "run" / "ctl" / "worker-1.exit.json").read_text())
    assert (record["pid"], record["signal"]) == (victim, signal.SIGKILL)
    replacement = status["hosts"]["worker-1"]["pid"]
    assert exe(replacement) == expected_exe

    assert (await control.request(daemon.socket, "stop"))["stopping"] is True
    assert await daemon.wait_exit(90) == 0
    last = [pids["worker-0"], replacement]
    await poll_until(lambda: not any(pid_alive(pid) for pid in last), 30, "workers gone")
