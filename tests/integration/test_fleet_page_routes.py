"""The fleet page's routes on the real endpoint over loopback: ``/``, ``/host/NAME``, 404s,
GET and HEAD only, the limits, a hung log read, and the daemon's loop asked only what it must."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import page
from supervisor.errors import ControlError
from supervisor.metrics import MAX_CONNECTIONS, Metrics, detail_on_loop
from tests.examples import examples
from tests.pageparse import parse_page

WAIT_S = 10.0

ROW = {"state": "ready", "shard": 0, "ssh": "connected", "pid": 11, "heartbeat_age_s": 0.2}
STATUS: dict[str, Any] = {
    "daemon": {"pid": 7, "role": "leader", "summary": "1/2 ready"},
    "hosts": {"w-0": ROW, "w-1": {**ROW, "state": "stale", "shard": 1, "last_reason": "gone"}},
}


@contextlib.contextmanager
def serving(metrics: Metrics) -> Iterator[int]:
    """``metrics`` serving on a free loopback port; stopped at the end."""
    metrics.start("127.0.0.1", 0)
    try:
        assert metrics.port is not None
        yield metrics.port
    finally:
        metrics.stop()


async def get(
    port: int, path: str, *, method: str = "GET", headers: str = ""
) -> tuple[str, dict[str, str], bytes]:
    """One request; the status line, the reply's headers (lower-cased names) and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(WAIT_S):
            reply = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status, fields, body


class Counted:
    """A callable that counts its calls and answers with ``answer(arg)``."""

    def __init__(self, answer: Callable[..., Any]) -> None:
        self.calls: list[Any] = []
        self._answer = answer

    def __call__(self, *args: Any) -> Any:
        """Record the call and answer."""
        self.calls.append(args)
        return self._answer(*args)


async def test_the_fleet_page_is_html_under_a_strict_policy_and_metrics_stay_at_metrics() -> None:
    """``/`` is the fleet page with a tile per host, its CSP and no caching; HEAD has its
    length but no body; ``/metrics`` is still the Prometheus exposition."""
    with serving(Metrics(lambda: STATUS)) as port:
        status, headers, body = await get(port, "/")
        assert status == "HTTP/1.1 200 OK"
        assert headers["content-type"] == "text/html; charset=utf-8"
        assert headers["content-security-policy"] == page.CONTENT_SECURITY_POLICY
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["cache-control"] == "no-store"
        read = parse_page(body.decode())
        assert read.states == {"w-1": "stale", "w-0": "ready"}
        assert [t.name for t in read.tiles] == ["w-1", "w-0"]
        status, head_headers, head_body = await get(port, "/", method="HEAD")
        assert (status, head_body) == ("HTTP/1.1 200 OK", b"")
        assert head_headers["content-length"] == str(len(body))
        status, headers, body = await get(port, "/metrics")
        assert headers["content-type"].startswith("text/plain")
        assert b'reward_supervisor_host_state{host="w-1",state="stale"} 1.0' in body


async def test_the_page_is_rendered_once_per_snapshot_and_gzipped_when_asked() -> None:
    """Any number of requests on one snapshot render the page once; a client accepting gzip
    gets the same page compressed."""
    render = Counted(page.fleet_page)
    metrics = Metrics(lambda: STATUS)
    with pytest.MonkeyPatch.context() as patch, serving(metrics) as port:
        patch.setattr(page, "fleet_page", render)
        _, _, plain = await get(port, "/")
        for _ in range(5):
            assert (await get(port, "/"))[2] == plain
        _, headers, packed = await get(port, "/", headers="Accept-Encoding: gzip\r\n")
        assert headers["content-encoding"] == "gzip"
        assert gzip.decompress(packed) == plain
        assert len(render.calls) == 1


async def test_a_host_page_has_its_detail_and_log_and_unknown_hosts_never_reach_the_loop() -> None:
    """``/host/NAME`` shows the detail ``status HOST`` has and the log's lines; an unknown
    host, an empty name, a name with a slash and any other path are 404 without asking for
    a detail or reading a log."""
    detail = Counted(lambda name: {**ROW, "host": name, "last_reason": "fine <b>", "daemon": {}})
    log = Counted(lambda name: {"path": f"ctl/{name}.log", "lines": ["hello <i>"], "error": None})
    with serving(Metrics(lambda: STATUS, host_detail=detail, log_tail=log)) as port:
        status, headers, body = await get(port, "/host/w-0")
        assert status == "HTTP/1.1 200 OK"
        assert headers["content-security-policy"] == page.CONTENT_SECURITY_POLICY
        read = parse_page(body.decode())
        assert "fine <b>" in read.text
        assert read.pres == ["hello <i>"]
        assert read.title == "w-0: ready · reward-supervisor"
        assert (await get(port, "/host/w%2D1"))[0] == "HTTP/1.1 200 OK"  # percent-encoded
        for path in ("/host/nope", "/host/", "/host/w-0/x", "/hosts/w-0", "/favicon.ico", "/x"):
            assert (await get(port, path))[0] == "HTTP/1.1 404 Not Found", path
        assert detail.calls == [("w-0",), ("w-1",)]
        assert log.calls == [("w-0",), ("w-1",)]


async def test_only_get_and_head_reach_the_pages() -> None:
    """POST, PUT and DELETE of the pages are 405 and never build a snapshot: the page has no
    command to run."""
    snapshot = Counted(lambda: STATUS)
    metrics = Metrics(snapshot)
    snapshot.calls.clear()  # the registry collects once when the collector is registered
    with serving(metrics) as port:
        for method in ("POST", "PUT", "DELETE", "OPTIONS"):
            for path in ("/", "/host/w-0"):
                status, headers, _ = await get(port, path, method=method)
                assert status == "HTTP/1.1 405 Method Not Allowed"
                assert headers["allow"] == "GET, HEAD"
        assert snapshot.calls == []


async def test_a_standby_or_a_removed_host_shows_its_row_with_the_daemons_word() -> None:
    """When the daemon has no detail to give (a standby, a host just removed), the host's
    page shows its row from the snapshot and says why."""

    def refuse(name: str) -> dict[str, Any]:
        """As a standby's control socket answers."""
        raise ControlError("this daemon is a standby; the leader is node-a")

    with serving(Metrics(lambda: STATUS, host_detail=refuse)) as port:
        status, _, body = await get(port, "/host/w-1")
        assert status == "HTTP/1.1 200 OK"
        text = parse_page(body.decode()).text
        assert "this daemon is a standby; the leader is node-a" in text
        assert "gone" in text


async def test_a_loop_that_does_not_answer_is_a_503_not_a_hang() -> None:
    """A snapshot that times out (the daemon's loop blocked) answers 503 on both pages; a
    host's detail that times out, 503 on that host's page alone."""

    def blocked() -> dict[str, Any]:
        """As ``snapshot_on_loop`` raises when the loop does not answer in time."""
        raise TimeoutError

    with serving(Metrics(blocked)) as port:
        for path in ("/", "/host/w-0"):
            assert (await get(port, path))[0] == "HTTP/1.1 503 Service Unavailable"

    def blocked_detail(name: str) -> dict[str, Any]:
        """As ``detail_on_loop`` raises when the loop does not answer in time."""
        raise TimeoutError

    with serving(Metrics(lambda: STATUS, host_detail=blocked_detail)) as port:
        assert (await get(port, "/host/w-0"))[0] == "HTTP/1.1 503 Service Unavailable"
        assert (await get(port, "/"))[0] == "HTTP/1.1 200 OK"


async def test_a_hung_log_read_holds_one_thread_and_the_page_says_so() -> None:
    """A log read that hangs (a hung run root) leaves the page served without the log after
    its deadline, saying so; while it still hangs, the next page does not start another read
    but says the earlier one hangs; the fleet page is served meanwhile; once it returns, reads
    work again."""
    release = threading.Event()

    def hung(name: str) -> dict[str, Any]:
        """A read stuck until released."""
        release.wait()
        return {"path": "ctl/w-0.log", "lines": ["back"], "error": None}

    log = Counted(hung)
    threads_before = threading.active_count()
    try:
        with serving(Metrics(lambda: STATUS, log_tail=log)) as port:
            status, _, body = await get(port, "/host/w-0")
            assert status == "HTTP/1.1 200 OK"
            assert "not read within 2 s (a hung run root?)" in parse_page(body.decode()).text
            _, _, body = await get(port, "/host/w-1")
            assert "an earlier read is still hanging" in parse_page(body.decode()).text
            assert (await get(port, "/"))[0] == "HTTP/1.1 200 OK"
            assert len(log.calls) == 1
            assert threading.active_count() == threads_before + 2  # the endpoint, one read
            [reader] = [t for t in threading.enumerate() if t.name == "metrics-log"]
            release.set()
            await asyncio.to_thread(reader.join, WAIT_S)
            assert not reader.is_alive()
            _, _, body = await get(port, "/host/w-0")
            assert parse_page(body.decode()).pres == ["back"]
    finally:
        release.set()


async def test_limits_hold_on_the_page_routes() -> None:
    """An oversized request for a page is 431, a silent one 408 (the same limits as a
    scrape), and a page is still served while the connection cap is full of half-open
    requests."""
    with serving(Metrics(lambda: STATUS)) as port:
        big = "X-Big: " + "a" * 20_000 + "\r\n"
        assert (await get(port, "/", headers=big))[
            0
        ] == "HTTP/1.1 431 Request Header Fields Too Large"
        writers: list[asyncio.StreamWriter] = []
        try:
            for _ in range(MAX_CONNECTIONS + 10):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /host/w-0 HTTP/1.1\r\nHost: x")
                writers.append(writer)
            status, _, body = await get(port, "/")
            assert status == "HTTP/1.1 200 OK"
            assert len(parse_page(body.decode()).tiles) == 2
        finally:
            for writer in writers:
                writer.transport.abort()


async def test_host_details_within_a_second_share_one_build_on_the_loop() -> None:
    """However many pages of one host are asked for within ``max_age_s``, the loop builds
    its detail once, on its own thread; another host gets its own build."""
    loop = asyncio.get_running_loop()
    builds: list[tuple[str, int]] = []

    def build(name: str) -> dict[str, Any]:
        """Record which host and which thread."""
        builds.append((name, threading.get_ident()))
        return {"host": name}

    take = detail_on_loop(loop, build, max_age_s=3600.0)
    await asyncio.gather(*(asyncio.to_thread(take, "a") for _ in range(10)))
    await asyncio.to_thread(take, "b")
    assert builds == [("a", threading.get_ident()), ("b", threading.get_ident())]


@settings(max_examples=examples(300))
@given(
    path=st.text(max_size=60).map(lambda s: "/" + s)
    | st.sampled_from(["/host/", "/host/%", "/host/%ff%00", "/host/w-0%2F..", "/host/w-0?x"])
)
def test_any_path_is_a_page_or_a_404_never_a_failure(path: str) -> None:
    """Whatever the path (percent signs, bytes that are not UTF-8, slashes, dots), the
    routes answer 200 for a page and 404 for anything else, and never raise."""
    metrics = Metrics(lambda: STATUS, host_detail=lambda name: {**ROW, "host": name})
    status, _, _ = metrics.handle(path, {})
    host = unquote(path.removeprefix("/host/")) if path.startswith("/host/") else None
    page_ = path in ("/", "/metrics") or host in STATUS["hosts"]
    assert status == ("200 OK" if page_ else "404 Not Found")
