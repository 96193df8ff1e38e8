"""A command's stdin, written by ``RemoteHost.run``: a command that exits without reading it
is not a lost connection."""

from __future__ import annotations

from typing import Any, cast

import asyncssh
import pytest

from supervisor import remote


class _Stdin:
    """The write side of a channel; ``closed_after`` writes succeed, then it is closed."""

    def __init__(self, closed_after: int) -> None:
        self.calls: list[str] = []
        self._left = closed_after

    def _call(self, what: str) -> None:
        if self._left == 0:
            raise BrokenPipeError("Channel not open for sending")
        self._left -= 1
        self.calls.append(what)

    def write(self, text: str) -> None:
        """Send text, or fail as asyncssh does once the channel is closed."""
        self._call(f"write {len(text)}")

    def write_eof(self) -> None:
        """Send EOF, or fail likewise."""
        self._call("eof")


class _Process:
    """Only the stdin of an ``SSHClientProcess``."""

    def __init__(self, stdin: _Stdin) -> None:
        self.stdin = stdin


def send(stdin: _Stdin, text: str) -> None:
    """``remote._send_input`` on a process with ``stdin``."""
    process = cast("asyncssh.SSHClientProcess[str]", cast(Any, _Process(stdin)))
    remote._send_input(process, text)


@pytest.mark.parametrize("closed_after", [0, 1])
def test_a_channel_closed_before_its_input_is_sent_is_not_an_error(closed_after: int) -> None:
    """The command already exited (before the data, or before the EOF): nothing raises, and
    what could be sent was sent in order."""
    stdin = _Stdin(closed_after)
    send(stdin, "abc")
    assert stdin.calls == ["write 3", "eof"][:closed_after]


def test_an_open_channel_gets_the_input_then_eof() -> None:
    """The ordinary case: the whole input, then EOF."""
    stdin = _Stdin(closed_after=2)
    send(stdin, "hello")
    assert stdin.calls == ["write 5", "eof"]
