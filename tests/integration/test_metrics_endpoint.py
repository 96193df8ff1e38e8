"""The metrics endpoint on a real loopback socket: bounded connections, deadlines and sizes,
any bytes as a request, and a snapshot built at most once a second."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from supervisor.metrics import Endpoint, Metrics, Reply, snapshot_on_loop
from tests.examples import examples

WAIT_S = 10.0
GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n"


def handle(path: str, fields: Mapping[str, str]) -> Reply:
    """A fixed exposition at /metrics naming the request's Accept header; 404 elsewhere."""
    if path != "/metrics":
        return "404 Not Found", [("Content-Type", "text/plain")], b"not here\n"
    body = f"up 1\n# accept {fields.get('accept', '')}\n".encode()
    return "200 OK", [("Content-Type", "text/plain")], body


@contextlib.contextmanager
def endpoint(**options: Any) -> Iterator[Endpoint]:
    """A started endpoint on a free loopback port, stopped at the end."""
    server = Endpoint(handle, "127.0.0.1", 0, **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def fetch(port: int, request: bytes = GET, *, hang_up: bool = False) -> tuple[str, bytes]:
    """Send ``request`` (then, with ``hang_up``, our end of the stream) and read to EOF: the
    status line and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        if hang_up:
            writer.write_eof()
        async with asyncio.timeout(WAIT_S):
            reply = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), body


@contextlib.asynccontextmanager
async def half_open(port: int, count: int) -> AsyncIterator[list[asyncio.StreamWriter]]:
    """``count`` connections that send nothing, or half a request, and never finish."""
    writers: list[asyncio.StreamWriter] = []
    try:
        for i in range(count):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: " if i % 2 else b"")
            writers.append(writer)
        yield writers
    finally:
        for writer in writers:
            writer.transport.abort()


async def test_a_scrape_is_served_while_200_connections_hang_half_open() -> None:
    """200 connections that never finish their request take no thread each and at most the
    cap in slots; a real scrape made after them is answered."""
    threads_before = threading.active_count()
    with endpoint(max_connections=16, read_timeout_s=60.0) as server:
        async with half_open(server.port, 200):
            status, body = await fetch(server.port)
            assert status == "HTTP/1.1 200 OK"
            assert body.startswith(b"up 1\n")
            assert server.connection_count <= 16
            assert threading.active_count() == threads_before + 1  # the endpoint's own


async def test_a_silent_client_gets_408_at_its_deadline() -> None:
    """A client that sends nothing is told so and closed once the read deadline passes."""
    with endpoint(read_timeout_s=0.2) as server:
        status, _ = await fetch(server.port, b"GET /metrics HTTP/1.1\r\nHo")
        assert status == "HTTP/1.1 408 Request Timeout"


async def test_an_oversized_request_gets_431() -> None:
    """Headers past the size cap are refused without reading them all."""
    with endpoint(max_request_bytes=1024) as server:
        big = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 4096 + b"\r\n\r\n"
        status, _ = await fetch(server.port, big)
        assert status == "HTTP/1.1 431 Request Header Fields Too Large"


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        (b"POST /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 405 Method Not Allowed"),
        (b"GET /other HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found"),
        (b"GET /metrics?name[]=up HTTP/1.0\r\n\r\n", "HTTP/1.1 200 OK"),
        (b"HEAD /other HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found"),
        (b"PUT / HTTP/1.1\r\n\r\n", "HTTP/1.1 405 Method Not Allowed"),
        (b"GET /metrics\r\n\r\n", "HTTP/1.1 400 Bad Request"),
        (b"\x00\xff\r\n\r\n", "HTTP/1.1 400 Bad Request"),
    ],
)
async def test_requests_get_the_status_they_deserve(request_: bytes, status: str) -> None:
    """Only GET and HEAD reach the routes (which answer 200 or 404); anything else gets its
    4xx from the endpoint itself."""
    with endpoint() as server:
        assert (await fetch(server.port, request_))[0] == status


async def test_head_sends_no_body_and_accept_reaches_the_renderer() -> None:
    """HEAD answers 200 with the length but no body; GET's Accept header picks the format."""
    with endpoint() as server:
        status, body = await fetch(server.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert (status, body) == ("HTTP/1.1 200 OK", b"")
        _, body = await fetch(server.port, b"GET /metrics HTTP/1.1\r\nAccept: text/x\r\n\r\n")
        assert b"# accept text/x" in body


async def _fuzz(chunks: list[bytes]) -> tuple[list[str], str, list[Any]]:
    """Send each chunk on its own connection, then one real scrape."""
    statuses: list[str] = []
    with capture_logs() as logs, endpoint(read_timeout_s=0.5) as server:
        for chunk in chunks:
            with contextlib.suppress(ConnectionError):
                statuses.append((await fetch(server.port, chunk, hang_up=True))[0])
        final, _ = await fetch(server.port)
    return statuses, final, logs


@settings(max_examples=examples(60))
@given(
    st.lists(
        st.binary(max_size=200) | st.sampled_from([GET[:n] for n in range(len(GET))]),
        max_size=8,
    )
)
@example([b"\r\n\r\n", b"G" * 9000 + b"\r\n\r\n", b"GET  /metrics HTTP/1.1\r\n\r\n"])
def test_any_bytes_as_a_request_get_a_status_line_or_a_close(chunks: list[bytes]) -> None:
    """Whatever a client sends, it gets an HTTP status line or the connection closes, no
    request reaches the endpoint's task root, and a real scrape after it is served."""
    statuses, final, logs = asyncio.run(_fuzz(chunks))
    assert all(s == "" or s.startswith("HTTP/1.1 ") for s in statuses)
    assert final == "HTTP/1.1 200 OK"
    assert [e for e in logs if e["event"].startswith("metrics.")] == []


async def test_scrapes_within_a_second_share_one_snapshot_built_on_the_loop() -> None:
    """However many scrapes come in within ``max_age_s``, the loop builds the snapshot once,
    on its own thread; after that age the next scrape builds a new one."""
    loop = asyncio.get_running_loop()
    builds: list[int] = []

    def build() -> dict[str, Any]:
        """Count the build and say which thread ran it."""
        builds.append(threading.get_ident())
        return {"hosts": {}, "daemon": {}}

    take = snapshot_on_loop(loop, build, max_age_s=3600.0)
    results = await asyncio.gather(*(asyncio.to_thread(take) for _ in range(20)))
    assert builds == [threading.get_ident()]
    assert all(r is results[0] for r in results)
    fresh = snapshot_on_loop(loop, build, max_age_s=0.0)
    await asyncio.to_thread(fresh)
    await asyncio.to_thread(fresh)
    assert len(builds) == 3


async def test_metrics_stop_frees_the_port_and_a_bad_address_raises() -> None:
    """Stopping ends the endpoint's thread and frees its port; an address that cannot be
    bound raises OSError at start, with no thread left behind."""
    threads_before = threading.active_count()
    metrics = Metrics(lambda: {"hosts": {}, "daemon": {}})
    metrics.start("127.0.0.1", 0)
    port = metrics.port
    assert port is not None
    metrics.stop()
    assert threading.active_count() == threads_before
    again = Metrics(lambda: {"hosts": {}, "daemon": {}})
    again.start("127.0.0.1", port)
    with pytest.raises(OSError):  # noqa: PT011 - the errno depends on the kernel
        Metrics(lambda: {}).start("127.0.0.1", port)
    again.stop()
    assert threading.active_count() == threads_before


def test_role_and_epoch_gauges_and_a_standby_exports_no_host_series() -> None:
    """A leader exports ``role{role="leader"} 1`` and its epoch with its host series; a
    standby ``role{role="standby"} 1``, the epoch on disk, and no per-host series (the hosts
    are the leader's to report)."""
    row = {"state": "ready", "ssh": "connected", "restarts": 2, "heartbeat_age_s": 0.5}
    leader = (
        Metrics(lambda: {"daemon": {"role": "leader", "epoch": 7}, "hosts": {"worker-0": row}})
        .render("text/plain", "")[0]
        .decode()
    )
    assert 'reward_supervisor_role{role="leader"} 1.0' in leader
    assert 'reward_supervisor_role{role="standby"} 0.0' in leader
    assert "reward_supervisor_epoch 7.0" in leader
    assert 'reward_supervisor_host_state{host="worker-0",state="ready"} 1.0' in leader
    standby = (
        Metrics(lambda: {"daemon": {"role": "standby", "epoch": 7}, "hosts": {"worker-0": row}})
        .render("text/plain", "")[0]
        .decode()
    )
    assert 'reward_supervisor_role{role="standby"} 1.0' in standby
    assert "reward_supervisor_epoch 7.0" in standby
    assert "reward_supervisor_up 1.0" in standby
    assert "worker-0" not in standby


async def test_making_the_metrics_on_the_loop_takes_no_snapshot() -> None:
    """The daemon makes its Metrics on its loop's thread: registering the snapshot collector
    must not ask that loop for a snapshot (it would wait for itself until the deadline and
    log a failed snapshot); the first scrape, from the endpoint's thread, builds it."""
    loop = asyncio.get_running_loop()
    builds: list[int] = []

    def build() -> dict[str, Any]:
        """Count the build."""
        builds.append(1)
        return {"hosts": {}, "daemon": {}}

    with capture_logs() as logs:
        metrics = Metrics(snapshot_on_loop(loop, build))
    assert builds == []
    assert [e for e in logs if e["event"] == "metrics.snapshot_failed"] == []
    body, _ = await asyncio.to_thread(metrics.render, "text/plain", "")
    assert b"reward_supervisor_up 1.0" in body
    assert builds == [1]
