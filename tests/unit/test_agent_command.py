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
    # The agent's source itself travels in the command (under ./dev test, the wrapper that
    # measures its coverage and carries it compressed).
    assert words[5:] == ["-c", remote_program(remote.agent_source(), remote.AGENT_PATH), "agent"]
