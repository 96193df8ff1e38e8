"""The command that starts a host's agent: one string for the whole fleet."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from supervisor import remote


def test_every_host_with_the_same_python_shares_one_command_string() -> None:
    """Each channel keeps its command for its life and the agent's source is in it (~90 KB):
    hosts with the same interpreter must share one string, not hold a copy each."""
    first = remote.agent_command("/usr/bin/python3")
    assert remote.agent_command("/usr/bin/python3") is first
    other = remote.agent_command("/opt/my python/bin/python3")
    assert other is not first
    words = shlex.split(other)
    assert words[:5] == ["exec", "/opt/my python/bin/python3", "-X", "utf8", "-u"]
    # The agent's source travels compressed in the command, with safefiles' (under ./dev
    # test, in the wrapper that measures their coverage).
    assert words[5:] == ["-c", remote.agent_program(), "agent"]


#: What agent.py prints for an unknown mode: it ran, and so did every import it makes.
USAGE = (2, "usage: agent | launcher | shepherd\n")


def run_packed(flags: list[str], cwd: Path) -> tuple[int, str]:
    """Exit status and stderr of the packed agent program run in ``cwd`` by this python
    with ``flags``, for an unknown mode."""
    program = remote.packed_program(remote.agent_source(), remote.agent_modules())
    ran = subprocess.run(
        [sys.executable, *flags, "-c", program, "no-such-mode"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
    )
    return ran.returncode, ran.stderr


def test_the_packed_agent_runs_the_agent_and_leaves_room_to_grow(tmp_path: Path) -> None:
    """The program sent is at most half of Linux's limit on one argv string, and running it
    where no ``supervisor`` package can be imported (no site-packages, no working directory
    on the path) runs agent.py itself, with the safefiles it carries."""
    program = remote.packed_program(remote.agent_source(), remote.agent_modules())
    assert len(program.encode()) <= remote.MAX_ARG_STRLEN // 2
    assert run_packed(["-I", "-S"], tmp_path) == USAGE


def test_the_packed_agent_never_imports_a_host_supervisor_package(tmp_path: Path) -> None:
    """A ``supervisor`` package on the host's path (another version, another project's) is
    never imported in place of the safefiles the program carries."""
    planted = tmp_path / "supervisor"
    planted.mkdir()
    (planted / "__init__.py").write_text("")
    (planted / "safefiles.py").write_text("raise SystemExit('the host copy was imported')\n")
    # -c puts the working directory first on sys.path: the planted package is found there.
    assert run_packed(["-S"], tmp_path) == USAGE
