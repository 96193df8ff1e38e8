"""The command that starts a host's agent: one string for the whole fleet."""

from __future__ import annotations

import shlex

from supervisor import remote
from supervisor.measured import remote_program


def test_every_host_with_the_same_python_shares_one_command_string() -> None:
    """Each channel keeps its command for its life and the agent's source is in it (~90 KB):
    hosts with the same interpreter must share one string, not hold a copy each."""
    first = remote.agent_command("/usr/bin/python3")
    assert remote.agent_command("/usr/bin/python3") is first
    other = remote.agent_command("/opt/my python/bin/python3")
    assert other is not first
    words = shlex.split(other)
    assert words[:5] == ["exec", "/opt/my python/bin/python3", "-X", "utf8", "-u"]
    # The agent's source travels compressed in the command (under ./dev test, in the wrapper
    # that measures its coverage).
    source = remote.agent_source()
    program = remote_program(source, remote.AGENT_PATH)
    if program is source:
        program = remote.packed_program(source)
    assert words[5:] == ["-c", program, "agent"]


def test_the_packed_agent_runs_the_agent_and_leaves_room_to_grow() -> None:
    """The program sent is at most half of Linux's limit on one argv string, and running it
    runs agent.py itself (its usage line, for an unknown mode)."""
    import subprocess
    import sys

    program = remote.packed_program(remote.agent_source())
    assert len(program.encode()) <= remote.MAX_ARG_STRLEN // 2
    ran = subprocess.run(
        [sys.executable, "-c", program, "no-such-mode"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (ran.returncode, ran.stderr) == (2, "usage: agent | launcher | shepherd\n")
