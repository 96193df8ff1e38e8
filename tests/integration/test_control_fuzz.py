"""The control socket under generated requests from an allowed client: every line gets one JSON
reply, nothing reaches a task root, and the connection keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from supervisor.control import ControlServer
from tests.examples import examples
from tests.integration.test_control import FakeDaemon

WAIT_S = 10.0
COMMANDS = [
    "ping",
    "status",
    "restart-host",
    "stop-host",
    "start-host",
    "reload",
    "stop",
    "unfreeze",
    "events",
]
#: Log events that mean a request reached a task root: the socket survived, but it is a bug.
INTERNAL_ERRORS = ("control.connection_failed", "control.handler_failed")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
requests = st.builds(
    lambda cmd, extra: {"cmd": cmd, **extra},
    st.sampled_from(COMMANDS) | json_values,
    st.dictionaries(st.sampled_from(["host", "x", "cmd", ""]) | st.text(max_size=8), json_values),
)
lines = (
    requests.map(lambda r: json.dumps(r).encode())
    | requests.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=300)
)
#: Nesting near and past the parser's limit, in every place a request can carry it.
DEEP = [
    b'{"cmd": "restart-host", "host": ' + b"[" * n + b"]" * n + b"}" for n in (900, 990, 2000)
] + [b'{"cmd": ' + b"[" * 995 + b"]" * 995 + b"}", b"[" * 5000, b'{"cmd": "ping", "x": {"a":' * 900]


class FuzzDaemon(FakeDaemon):
    """The fake daemon, minus the one command that ends the server (``stop``)."""

    async def stop(self) -> dict[str, Any]:
        """Record the call; leave the server up so the fuzz goes on."""
        self.calls.append(("stop", None))
        return {"stopping": True}


def expected_replies(chunks: list[bytes]) -> tuple[int, bool]:
    """How many reply lines the requests in ``chunks`` earn, and whether one of them turns
    the connection into an event stream (which answers nothing after its ``ok``)."""
    count = 0
    for line in b"\n".join(chunks).split(b"\n"):
        if not line.strip():
            continue
        count += 1
        with contextlib.suppress(ValueError, RecursionError):
            if json.loads(line) == {"cmd": "events"}:
                return count, True
    return count, False


async def exchange_all(path: Path, chunks: list[bytes]) -> list[dict[str, Any]]:
    """Send every chunk as a line, then a ping; every reply up to the ping's."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(b"".join(chunk + b"\n" for chunk in chunks) + b'{"cmd": "ping"}\n')
        await writer.drain()
        wanted, streaming = expected_replies(chunks)
        replies: list[dict[str, Any]] = []
        async with asyncio.timeout(WAIT_S):
            while len(replies) < wanted + (0 if streaming else 1):
                line = await reader.readline()
                assert line.endswith(b"\n"), f"connection ended after {replies}"
                reply = json.loads(line)
                assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), line
                replies.append(reply)
        return replies
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def serve_and_send(chunks: list[bytes]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Start a server for a fuzz daemon, send ``chunks`` on one connection, then check that a
    fresh connection is still served; the replies and what was logged."""
    directory = Path(tempfile.mkdtemp(prefix="ctl-fuzz-"))
    try:
        with capture_logs() as logs:
            server = ControlServer(directory / "s.sock", FuzzDaemon())
            await server.start()
            try:
                replies = await exchange_all(server.path, chunks)
                [pong] = await exchange_all(server.path, [])
                assert pong["ok"] is True
            finally:
                await server.aclose()
        return replies, logs
    finally:
        shutil.rmtree(directory)


@settings(max_examples=examples(150))
@given(st.lists(lines, max_size=12))
@example([b'{"cmd": "restart-host", "host": "\\ud800"}'])
@example([b'{"cmd": "\\udfff"}', b'{"cmd": "ping", "\\ud800": 1}'])
@example(DEEP)
def test_any_request_gets_a_json_reply_and_the_socket_keeps_serving(chunks: list[bytes]) -> None:
    """Whatever an allowed client sends (random bytes, any JSON, unknown or malformed
    commands, lone surrogates, nesting at the parser's limit), each line gets one JSON reply,
    the last being the ping's, no internal error is logged, and a new client is served."""
    replies, logs = asyncio.run(serve_and_send(chunks))
    _, streaming = expected_replies(chunks)
    if not streaming:
        assert replies[-1] == {"ok": True, "pid": replies[-1]["pid"]}
    assert [e for e in logs if e["event"] in INTERNAL_ERRORS] == []
