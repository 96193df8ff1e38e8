"""One hostile host cannot take the daemon or another host down: a live daemon with three hosts,
one of whose agents is a seeded fuzzer (``hostile_agent.py``)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.remote import NOISE_BURST, NOISE_EVERY_S
from tests.faults.harness import READY_S, FaultRun, events, host_row, pid_of, wall
from tests.system.daemonproc import FAST_WORKER_ARGV, DaemonProcess

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

HOSTILE_AGENT = Path(__file__).with_name("hostile_agent.py")
#: Garbage items across the whole run (lines on stdout and stderr, huge ones included).
BUDGET = 400
#: Fixed, so a failure replays; change it to explore (each seed is a different run).
SEED = 16
#: The host whose agent is hostile: worker-2, on 127.0.0.3 (``tests/sshd.py``).
BAD, BAD_ADDRESS = "worker-2", "127.0.0.3"
GOOD = ("worker-0", "worker-1")
#: Enough for the fuzz budget at the daemon's retry pace on a loaded machine.
FUZZ_DEADLINE_S = 300.0
#: Log events that mean a fault escaped into a task root: contained, but a bug.
INTERNAL_ERRORS = ("agent.failed", "ssh.link_failed", "ssh.connect_internal_error")
NOISE = ("agent.noise", "agent.stderr")


def dispatcher(tmp_path: Path, state: Path) -> Path:
    """A ``worker.python`` that is the hostile agent on the bad host and python elsewhere,
    told apart by the address the SSH connection came in on."""
    script = tmp_path / "python-dispatch"
    script.write_text(
        "#!/bin/sh\n"
        'case "$SSH_CONNECTION" in\n'
        f'  *" {BAD_ADDRESS} "*) exec {sys.executable} {HOSTILE_AGENT} {state} {SEED} {BUDGET} ;;\n'
        "esac\n"
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script


def used(state: Path) -> int:
    """Garbage items the hostile agent has sent so far."""
    try:
        return int(state.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def good_hosts_untouched(daemon: DaemonProcess, pids: dict[str, int], mark: int) -> list[str]:
    """What happened to a good host since log line ``mark``: state changes, launches,
    terminates, lost connections (empty when nothing did)."""
    kinds = ("host.state", "host.launch", "host.terminate", "ssh.down")
    return [
        f"{line['event']} {line.get('host')} {line.get('to', '')} {line.get('reason', '')}"
        for line in daemon.lines[mark:]
        if line.get("event") in kinds and line.get("host") in pids
    ]


async def test_a_fuzzing_agent_costs_only_its_own_host(fault_run: FaultRun, tmp_path: Path) -> None:
    """An agent that answers with random bytes, bad ids, deep nesting, 10 MB lines, NULs,
    invalid UTF-8, stray hellos and channels closed mid-line, for a bounded seeded run: the
    daemon stays up and logs no internal error, the two other hosts stay ready with the same
    pids and no restart, and the bad host shows the reason its agent gives."""
    state = tmp_path / "hostile.state"
    argv = [sys.executable if arg == "{python}" else arg for arg in FAST_WORKER_ARGV]
    raw = fault_run.raw(
        3,
        health={"restart_cooldown_s": 0.2, "backoff_max_s": 1.0, "ready_timeout_s": 10.0},
        worker={"python": str(dispatcher(tmp_path, state)), "argv": argv},
    )
    fault_run.write(raw)
    daemon = await fault_run.start()
    status = await daemon.wait_status(
        lambda s: all(host_row(s, h)["state"] == "ready" for h in GOOD), READY_S, "good hosts"
    )
    pids = {h: pid_of(status, h) for h in GOOD}
    mark = len(daemon.lines)

    async def fuzz_spent() -> None:
        """Wait for the agent's budget to run out, failing early if a good host is touched or
        the operator's ``status`` stops answering."""
        while used(state) < BUDGET:
            assert good_hosts_untouched(daemon, pids, mark) == []
            await daemon.status()  # raises if one host's text broke the reply
            await asyncio.sleep(0.1)  # wait-ok: polls the agent's state file under a deadline

    async with asyncio.timeout(FUZZ_DEADLINE_S):
        await fuzz_spent()
    final = await daemon.wait_status(
        lambda s: "fuzz budget spent" in str(host_row(s, BAD).get("last_error")),
        READY_S,
        "the bad host to show its agent's refusal",
    )

    assert daemon.process is not None and daemon.process.returncode is None
    assert good_hosts_untouched(daemon, pids, mark) == []
    for host in GOOD:
        row: dict[str, Any] = host_row(final, host)
        assert (row["state"], row["pid"], row["restarts"], row["ssh"]) == (
            "ready",
            pids[host],
            0,
            "connected",
        )
    assert [line for line in daemon.lines if "exception" in line] == []
    assert [line for line in daemon.lines if line.get("event") in INTERNAL_ERRORS] == []
    assert daemon.bad_lines == []
    # Its flood was logged within the budget and the rest counted.
    noise = [line for line in daemon.lines if line.get("event") in NOISE and line["host"] == BAD]
    assert noise, "the fuzzer's garbage was never seen"
    span_s = wall(daemon.lines[-1]) - wall(noise[0])
    assert len(noise) <= NOISE_BURST + span_s / NOISE_EVERY_S + 1
    assert events(daemon, "agent.lines_dropped", host=BAD)
    # The operator's table shows what the host said escaped, not obeyed (its reason cell
    # holds the latest of the fuzzer's texts; tests/unit/test_terminal.py pins the escaping).
    table = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "supervisor.cli",
        "status",
        "-c",
        str(fault_run.config_path),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await table.communicate()
    assert table.returncode == 0
    lines = out.decode().splitlines()
    assert len(lines) == 5  # the daemon, the header, three hosts: no line was split
    assert all(line.isprintable() for line in lines)
    assert lines[4].startswith(BAD)
