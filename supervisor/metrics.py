"""Prometheus metrics, the fleet page and their HTTP endpoint: the only importer of
prometheus_client.

Counters and histograms are updated by the daemon as things happen; per-host gauges and the
fleet page (``/``) come from one snapshot of the daemon's status, built on the event loop's
thread at most once a second however often anyone scrapes or looks. The endpoint runs in its
own thread with its own small event loop, so rendering never runs on the daemon's loop, and it
is bounded: a cap on connections (the oldest one still sending its request makes room for a
new one), a deadline for the whole request, a size cap on it, and a deadline for writing the
reply. It only reads: nothing it serves changes the fleet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gzip
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, TypeVar
from urllib.parse import unquote

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from supervisor import page
from supervisor.errors import ControlError
from supervisor.health import UNHEALTHY_STATES, Cause, HostState
from supervisor.vocabulary import LYING

log = structlog.get_logger("supervisor.metrics")

# A scrape waits this long for the event loop to hand over a snapshot; a loop blocked for
# longer is itself worth a failed scrape.
SNAPSHOT_TIMEOUT_S: Final = 5.0
# Building the snapshot walks every host on the daemon's loop; scrapes within this long of
# the last build share it, so any scrape rate costs the loop at most one walk a second.
SNAPSHOT_MAX_AGE_S: Final = 1.0
# Prometheus holds one connection per target, a person a few more; past this the oldest
# connection still sending its request is dropped to make room (a slow-loris cannot starve a
# real scraper, whose request arrives at once).
MAX_CONNECTIONS: Final = 32
# A request is a request line and a few headers; the whole of it must arrive within this.
MAX_REQUEST_BYTES: Final = 8 * 1024
READ_TIMEOUT_S: Final = 5.0
# A reply is at most a few MB at 1000 hosts; a client that takes longer to read it is dropped.
WRITE_TIMEOUT_S: Final = 10.0
# A closing connection may take this long to flush before it is aborted.
CLOSE_TIMEOUT_S: Final = 2.0
# Launches are dominated by the agent round trip and a fork; terminates by the grace period.
LAUNCH_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TERMINATE_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
#: A reward probe is one task through the queue: tens of milliseconds when healthy, up to the
#: trainer's task timeout (30 s) when not.
PROBE_BUCKETS: Final = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
# A host's page reads the worker's log under the run root, which may hang (a hung mount):
# the page waits this long, then shows the rest without it.
LOG_READ_TIMEOUT_S: Final = 2.0

Snapshot = Mapping[str, Any]
#: What a route answers: the status line, the headers and the body.
Reply = tuple[str, list[tuple[str, str]], bytes]
_T = TypeVar("_T")


def restart_reason(cause: str) -> str:
    """A low-cardinality label for why a worker was restarted."""
    text = cause.lower()
    for needle, label in (
        ("signal", "killed"),
        ("exited", "exited"),
        ("heartbeat stale", "heartbeat_stale"),
        ("not ready", "not_ready"),
        ("launch", "launch_failed"),
        ("probe", "probe"),
        ("confirmed dead", "gone"),
    ):
        if needle in text:
            return label
    return "other"


class Metrics:
    """The daemon's metrics and fleet page and, once started, the HTTP endpoint serving them.

    ``host_detail(name)`` is ``status HOST``'s detail of one host (as the control socket
    answers it; raises ControlError when the daemon has none to give, as a standby); without
    it a host's page shows the snapshot's row. ``log_tail(name)`` reads the host's log
    (``view.log_lines``' shape); it runs in a thread of its own, one read at a time.
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        *,
        host_detail: Callable[[str], Snapshot] | None = None,
        log_tail: Callable[[str], Snapshot] | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._host_detail = host_detail
        self._log_tail = log_tail
        self._log_reader = _OneAtATime("metrics-log")
        # The fleet page of the last snapshot, plain and gzipped: any number of people looking
        # cost one rendering a snapshot (a second), on this thread.
        self._page: tuple[Snapshot, bytes, bytes] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.restarts = Counter(
            "reward_supervisor_restarts",
            "Automatic restarts, by host and reason.",
            ["host", "reason"],
            registry=self.registry,
        )
        self.planned_restarts = Counter(
            "reward_supervisor_planned_restarts",
            "Healthy workers replaced on purpose, by host and who asked (operator, reload):"
            " not faults, and not in reward_supervisor_restarts.",
            ["host", "reason"],
            registry=self.registry,
        )
        self.reloads = Counter(
            "reward_supervisor_reloads",
            "Config reloads, by result.",
            ["result"],
            registry=self.registry,
        )
        self.launch_seconds = Histogram(
            "reward_supervisor_launch_seconds",
            "Time from issuing a launch to the worker's pid.",
            buckets=LAUNCH_BUCKETS,
            registry=self.registry,
        )
        self.terminate_seconds = Histogram(
            "reward_supervisor_terminate_seconds",
            "Time from issuing a terminate to the pid confirmed dead.",
            buckets=TERMINATE_BUCKETS,
            registry=self.registry,
        )
        self.probe_seconds = Histogram(
            "reward_supervisor_probe_round_trip_seconds",
            "Reward probe round trip, written to result read: a reward as the trainer waits"
            " for it.",
            ["host"],
            buckets=PROBE_BUCKETS,
            registry=self.registry,
        )
        self.probe_failures = Counter(
            "reward_supervisor_probe_failures",
            "Reward probes that failed, by host and cause (probe_failed, probe_wrong,"
            " probe_timeout).",
            ["host", "cause"],
            registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(snapshot))
        self._endpoint: Endpoint | None = None

    @property
    def port(self) -> int | None:
        """The port the endpoint listens on (the bound one when asked for port 0)."""
        return None if self._endpoint is None else self._endpoint.port

    def start(self, host: str, port: int) -> None:
        """Serve the metrics on ``host:port`` from a background thread; raises OSError when
        the address cannot be bound."""
        endpoint = Endpoint(self.handle, host, port)
        endpoint.start()
        self._endpoint = endpoint
        log.info("metrics.listening", address=f"{host}:{endpoint.port}")

    def render(self, accept: str, accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
        """The exposition for a request with these headers: the body and its headers."""
        encoder, content_type = choose_encoder(accept)
        body = encoder(self.registry)
        headers = [("Content-Type", content_type)]
        if gzip_accepted(accept_encoding):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        return body, headers

    def stop(self) -> None:
        """Stop the endpoint (idempotent); blocks until its thread has ended."""
        if self._endpoint is not None:
            self._endpoint.stop()
            self._endpoint = None

    def handle(self, path: str, fields: Mapping[str, str]) -> Reply:
        """The reply to a GET (or HEAD) of ``path`` with these (lower-cased) header fields:
        ``/metrics``, the fleet page ``/``, a host's page ``/host/NAME``, or 404."""
        if path == "/metrics":
            body, headers = self.render(fields.get("accept", ""), fields.get("accept-encoding", ""))
            return "200 OK", headers, body
        gzipped = gzip_accepted(fields.get("accept-encoding", ""))
        if path == "/":
            return self._fleet_page(gzipped)
        if path.startswith("/host/"):
            return self._host_page(unquote(path.removeprefix("/host/")), gzipped)
        return _text_reply("404 Not Found", "not found: the fleet is at /, the metrics at /metrics")

    def _status(self) -> Snapshot | Reply:
        """The snapshot, or the reply saying why there is none."""
        try:
            return self._snapshot()
        except (TimeoutError, RuntimeError) as exc:
            log.warning("metrics.snapshot_failed", reason=repr(exc))
            return self._status_unavailable()

    def _fleet_page(self, gzipped: bool) -> Reply:
        status = self._status()
        if isinstance(status, tuple):
            return status
        if self._page is None or self._page[0] is not status:
            body = page.fleet_page(status).encode("utf-8", "replace")
            self._page = (status, body, gzip.compress(body, compresslevel=6))
        return _html_reply(self._page[1], self._page[2] if gzipped else None)

    def _host_page(self, name: str, gzipped: bool) -> Reply:
        status = self._status()
        if isinstance(status, tuple):
            return status
        row = status.get("hosts", {}).get(name)
        if not isinstance(row, Mapping):  # unknown names never reach the daemon's loop
            return _text_reply("404 Not Found", "no such host: the fleet is at /")
        detail: Snapshot = {"host": name, "daemon": status.get("daemon", {}), **row}
        if self._host_detail is not None:
            try:
                detail = self._host_detail(name)
            except ControlError as exc:  # a standby, a host just removed: its row says it
                detail = {**detail, "daemon": {**detail["daemon"], "note": str(exc)}}
            except (TimeoutError, RuntimeError) as exc:
                log.warning("metrics.snapshot_failed", reason=repr(exc))
                return self._status_unavailable()
        log_tail: Snapshot | None = None
        if self._log_tail is not None:
            reader = self._log_tail
            try:
                log_tail = self._log_reader.call(lambda: reader(name), LOG_READ_TIMEOUT_S)
            except TimeoutError as exc:
                log_tail = {"path": "the worker's log", "lines": [], "error": str(exc)}
        body = page.host_page(detail, log_tail).encode("utf-8", "replace")
        return _html_reply(body, gzip.compress(body) if gzipped else None)

    @staticmethod
    def _status_unavailable() -> Reply:
        return _text_reply(
            "503 Service Unavailable",
            f"the daemon did not hand over its status within {SNAPSHOT_TIMEOUT_S:g} s",
        )


def _text_reply(status: str, message: str) -> Reply:
    return status, [("Content-Type", "text/plain; charset=utf-8")], (message + "\n").encode()


def _html_reply(body: bytes, gzipped: bytes | None) -> Reply:
    headers = list(page.HEADERS)
    if gzipped is not None:
        headers.append(("Content-Encoding", "gzip"))
        body = gzipped
    return "200 OK", [*headers, ("Vary", "Accept-Encoding")], body


class _OneAtATime:
    """Blocking calls (file reads that may hang) in a thread of their own, one at a time:
    while one is still hung, the next is refused at once, so a hung mount holds one thread,
    never one per request, and never the endpoint's."""

    def __init__(self, name: str) -> None:
        self._name = name
        # The last call's answer: done once ``fn`` returned, a moment before its thread ends
        # (a request right after another must not find it "still hanging").
        self._busy: concurrent.futures.Future[Any] | None = None

    def call(self, fn: Callable[[], _T], timeout_s: float) -> _T:
        """``fn()``'s result; raises TimeoutError when it takes longer than ``timeout_s``
        (it runs on, alone) or when the previous call is still running."""
        if self._busy is not None and not self._busy.done():
            raise TimeoutError("an earlier read is still hanging (a hung run root?)")
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                future.set_exception(exc)

        self._busy = future
        threading.Thread(target=run, name=self._name, daemon=True).start()
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"not read within {timeout_s:g} s (a hung run root?)") from None


def snapshot_on_loop(
    loop: asyncio.AbstractEventLoop,
    build: Callable[[], Snapshot],
    *,
    max_age_s: float = SNAPSHOT_MAX_AGE_S,
) -> Callable[[], Snapshot]:
    """A thread-safe snapshot function: ``build`` runs on ``loop``'s thread, at most once per
    ``max_age_s``; calls in between get the last snapshot."""
    lock = threading.Lock()
    last: list[tuple[float, Snapshot]] = []

    def take() -> Snapshot:
        with lock:  # one build in flight; whoever waited behind it reuses the result
            if last and time.monotonic() - last[0][0] < max_age_s:
                return last[0][1]
            snapshot = _on_loop(loop, build)
            last[:] = [(time.monotonic(), snapshot)]
            return snapshot

    return take


def detail_on_loop(
    loop: asyncio.AbstractEventLoop,
    build: Callable[[str], Snapshot],
    *,
    max_age_s: float = SNAPSHOT_MAX_AGE_S,
) -> Callable[[str], Snapshot]:
    """``snapshot_on_loop`` for one host at a time: ``build(name)`` runs on ``loop``'s
    thread at most once per ``max_age_s`` for each name."""
    lock = threading.Lock()
    last: dict[str, tuple[float, Snapshot]] = {}

    def take(name: str) -> Snapshot:
        with lock:
            now = time.monotonic()
            for old in [n for n, (at, _) in last.items() if now - at >= max_age_s]:
                del last[old]  # the cache holds at most the names asked for within max_age_s
            if name in last:
                return last[name][1]
            detail = _on_loop(loop, lambda: build(name))
            last[name] = (time.monotonic(), detail)
            return detail

    return take


def _on_loop(loop: asyncio.AbstractEventLoop, build: Callable[[], Snapshot]) -> Snapshot:
    """``build()`` run on ``loop``'s thread; its result, or its exception, raised here.

    Raises TimeoutError after SNAPSHOT_TIMEOUT_S, RuntimeError when the loop is closed."""
    future: concurrent.futures.Future[Snapshot] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(build())
        except Exception as exc:  # noqa: BLE001 - re-raised in the calling thread
            future.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return future.result(timeout=SNAPSHOT_TIMEOUT_S)


#: Answers a GET or HEAD: the path (without its query) and the lower-cased header fields.
Handler = Callable[[str, Mapping[str, str]], Reply]


class Endpoint:
    """A bounded HTTP/1.1 server for GET and HEAD on its own thread and event loop.

    One request per connection (``Connection: close``). At most ``max_connections`` at once:
    a new one closes the oldest still reading its request, or is itself closed when every
    slot is writing a reply. The request (line and headers, at most ``max_request_bytes``)
    must arrive within ``read_timeout_s``; the reply must be taken within ``write_timeout_s``.
    """

    def __init__(
        self,
        handle: Handler,
        host: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout_s: float = READ_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        self._handle = handle
        self._host = host
        self.port = port
        self.max_connections = max_connections
        self._read_timeout_s = read_timeout_s
        self._write_timeout_s = write_timeout_s
        self._max_request_bytes = max_request_bytes
        # Connection -> "reading" or "writing"; dicts keep insertion order: oldest first.
        self._connections: dict[asyncio.Task[None], str] = {}
        self._transports: dict[asyncio.Task[None], asyncio.WriteTransport] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._bound = threading.Event()
        self._error: OSError | None = None

    @property
    def connection_count(self) -> int:
        """Connections open right now (read from another thread: a snapshot, not a promise)."""
        return len(self._connections)

    def start(self) -> None:
        """Bind and start serving; returns once bound, raises OSError if binding fails."""
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def stop(self) -> None:
        """Close the listener and every connection; blocks until the thread has ended."""
        loop, stopping, thread = self._loop, self._stopping, self._thread
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                loop.call_soon_threadsafe(stopping.set)
        if thread is not None:
            thread.join(timeout=CLOSE_TIMEOUT_S + 5)
        self._thread = None

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except Exception:  # thread root: the endpoint is lost, supervision goes on
            log.exception("metrics.endpoint_failed")
        finally:
            self._bound.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        try:
            server = await asyncio.start_server(
                self._on_connect, self._host, self.port, limit=self._max_request_bytes
            )
        except OSError as exc:
            self._error = exc
            return
        self.port = int(server.sockets[0].getsockname()[1])
        self._bound.set()
        async with server:
            await self._stopping.wait()
            server.close()
            tasks = list(self._connections)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections:
            oldest = next((t for t, s in self._connections.items() if s == "reading"), None)
            if oldest is None:
                writer.transport.abort()  # every slot is busy answering: no room
                return
            self._transports[oldest].abort()
            oldest.cancel()
            self._forget(oldest)
        task = asyncio.get_running_loop().create_task(self._serve_connection(reader, writer))
        self._connections[task] = "reading"
        self._transports[task] = writer.transport
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._connections.pop(task, None)
        self._transports.pop(task, None)

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Task root of one connection: read one request, answer it, close."""
        try:
            status, headers, body, send_body = await self._answer(reader)
            task = asyncio.current_task()
            if task in self._connections:
                self._connections[task] = "writing"
            head = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers)]
            head += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
            writer.write("\r\n".join(head).encode("latin-1") + (body if send_body else b""))
            async with asyncio.timeout(self._write_timeout_s):
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        except (TimeoutError, ConnectionError):
            pass  # a client too slow or gone: nothing to tell it
        except Exception:  # task root: one bad request must not end the endpoint
            log.exception("metrics.request_failed")
        finally:
            writer.transport.abort()

    async def _answer(
        self, reader: asyncio.StreamReader
    ) -> tuple[str, list[tuple[str, str]], bytes, bool]:
        """Read the request; the reply's status line, headers, body, and whether to send the
        body (not for HEAD)."""
        text = [("Content-Type", "text/plain; charset=utf-8")]
        try:
            async with asyncio.timeout(self._read_timeout_s):
                raw = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            return "408 Request Timeout", text, b"request not received in time\n", True
        except asyncio.LimitOverrunError:
            return "431 Request Header Fields Too Large", text, b"request too large\n", True
        except asyncio.IncompleteReadError as exc:
            raise ConnectionResetError("client hung up mid-request") from exc
        request = _parse_request(raw)
        if request is None:
            return "400 Bad Request", text, b"bad request\n", True
        method, path, fields = request
        if method not in ("GET", "HEAD"):
            allow = [*text, ("Allow", "GET, HEAD")]
            return "405 Method Not Allowed", allow, b"GET or HEAD only\n", True
        try:
            status, headers, body = self._handle(path, fields)
        except Exception:  # a collector's or a page's bug: this request fails, the endpoint stays
            log.exception("metrics.render_failed")
            return "500 Internal Server Error", text, b"rendering failed\n", True
        return status, headers, body, method == "GET"


def _parse_request(raw: bytes) -> tuple[str, str, dict[str, str]] | None:
    """Method, path and lower-cased header fields of a request head; None if malformed."""
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        return None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return parts[0], parts[1].split("?", 1)[0], fields


class _SnapshotCollector(Collector):
    """Gauges from the daemon's current status (the same data as ``status --json``)."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        """Nothing: without it the registry would collect, so take a snapshot, when the
        collector is registered, which the daemon does on its loop's own thread, where
        waiting for the loop to build the snapshot blocks it for SNAPSHOT_TIMEOUT_S."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        try:
            status = self._snapshot()
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            log.warning("metrics.snapshot_failed", reason=repr(exc))
            return
        hosts: Mapping[str, Mapping[str, Any]] = status.get("hosts", {})
        daemon: Mapping[str, Any] = status.get("daemon", {})
        role = str(daemon.get("role", "leader"))
        role_gauge = GaugeMetricFamily(
            "reward_supervisor_role",
            "1 for this daemon's role: leader (in charge) or standby (waiting for the lock).",
            labels=["role"],
        )
        for each in ("leader", "standby"):
            role_gauge.add_metric([each], 1 if each == role else 0)
        yield role_gauge
        yield _gauge(
            "reward_supervisor_epoch",
            "The run's leadership epoch this daemon leads under (a standby: the one on disk).",
            float(daemon.get("epoch") or 0),
        )
        if role == "standby":
            # The hosts are the leader's to report; a standby's view of them is the files'.
            yield _gauge("reward_supervisor_up", "1 while the daemon serves.", 1)
            return
        by_state = GaugeMetricFamily(
            "reward_supervisor_hosts", "Hosts in each state.", labels=["state"]
        )
        # A ready host named as lying is counted as "lying" (not ready), from 0.
        counts = {s.value: 0 for s in HostState} | {LYING: 0}
        for row in hosts.values():
            state = str(row.get("state"))
            counts[state] = counts.get(state, 0) + 1
        for state, n in sorted(counts.items()):
            by_state.add_metric([state], n)
        yield by_state
        yield from _per_host(hosts)
        yield _gauge(
            "reward_supervisor_fleet_frozen",
            "1 while restarts are frozen.",
            1 if daemon.get("frozen") else 0,
        )
        signatures = daemon.get("crash_signatures") or ()
        yield _gauge(
            "reward_supervisor_crash_signatures",
            "Crash signatures holding restarts now (hosts crashing the same way).",
            len(signatures),
        )
        probes = daemon.get("probe_signatures") or ()
        yield _gauge(
            "reward_supervisor_probe_signatures",
            "Probe signatures holding restarts now (hosts failing the reward probe the same way).",
            len(probes),
        )
        yield _gauge(
            "reward_supervisor_restarts_held",
            "Hosts whose automatic restarts a crash or probe signature holds.",
            sum(len(sig.get("held") or ()) for sig in (*signatures, *probes)),
        )
        if daemon.get("trainer_task_timeout_s") is not None:
            yield _gauge(
                "reward_supervisor_trainer_task_timeout_seconds",
                "[trainer] task_timeout_s: the trainer's client fails a call without a result"
                " within this long.",
                float(daemon["trainer_task_timeout_s"]),
            )
        yield _gauge(
            "reward_supervisor_launches_waiting",
            "Launches waiting for the budget.",
            daemon.get("launches_waiting", 0),
        )
        yield _gauge(
            "reward_supervisor_status_parse_errors",
            "Status files read that exist but are not a valid heartbeat (total; a missing"
            " file is not counted).",
            daemon.get("status_parse_errors", 0),
        )
        spares = daemon.get("spares") or ()
        if spares:
            by_role = GaugeMetricFamily(
                "reward_supervisor_spares",
                "Spare machines ([[spares]] and machines that lost their shard) by role: free,"
                " serving, fenced (leftovers not yet killed), drained, down.",
                labels=["role"],
            )
            roles = dict.fromkeys(("free", "serving", "fenced", "drained", "down"), 0)
            for row in spares:
                roles[str(row.get("role"))] = roles.get(str(row.get("role")), 0) + 1
            for each, n in sorted(roles.items()):
                by_role.add_metric([each], n)
            yield by_role
        failovers = CounterMetricFamily(
            "reward_supervisor_failovers",
            "Shards moved to a spare, by reason (host_lost, drain, lying).",
            labels=["reason"],
        )
        for reason in ("drain", "host_lost", "lying"):
            failovers.add_metric([reason], (daemon.get("failover_counts") or {}).get(reason, 0))
        yield failovers
        yield from _fleet_rewards(daemon)
        yield _gauge("reward_supervisor_up", "1 while the daemon serves.", 1)


def _per_host(hosts: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "reward_supervisor_host_state", "1 for the host's current state.", labels=["host", "state"]
    )
    age = GaugeMetricFamily(
        "reward_supervisor_heartbeat_age_seconds",
        "Seconds since the host's heartbeat last changed (our clock).",
        labels=["host"],
    )
    ssh = GaugeMetricFamily(
        "reward_supervisor_ssh_connected", "1 while the SSH connection is up.", labels=["host"]
    )
    restarts = GaugeMetricFamily(
        "reward_supervisor_host_restarts",
        "Automatic restarts of the host, kept across daemon restarts.",
        labels=["host"],
    )
    stuck = GaugeMetricFamily(
        "reward_supervisor_host_stuck",
        "1 while the host's worker, found stuck (tasks in flight, none finished for"
        " progress_stale_s), has not been replaced.",
        labels=["host"],
    )
    probe_ok = GaugeMetricFamily(
        "reward_supervisor_host_probe_ok",
        "1 when the host's last reward probe scored as expected, 0 when it failed (hosts"
        " probed only: [probe]).",
        labels=["host"],
    )
    probe_rtt = GaugeMetricFamily(
        "reward_supervisor_host_probe_round_trip_seconds",
        "The round trip of the host's last answered reward probe (written to result read).",
        labels=["host"],
    )
    for name, row in sorted(hosts.items()):
        probe = row.get("last_probe")
        if isinstance(probe, Mapping):
            probe_ok.add_metric([name], 0 if probe.get("cause") else 1)
            if probe.get("round_trip_s") is not None and probe.get("cause") != "probe_timeout":
                probe_rtt.add_metric([name], float(probe["round_trip_s"]))
        state.add_metric([name, str(row.get("state"))], 1)
        stuck.add_metric([name], 1 if _stuck(row) else 0)
        if row.get("heartbeat_age_s") is not None:
            age.add_metric([name], float(row["heartbeat_age_s"]))
        ssh.add_metric([name], 1 if row.get("ssh") == "connected" else 0)
        restarts.add_metric([name], float(row.get("restarts") or 0))
    yield from (state, age, ssh, restarts, stuck, probe_ok, probe_rtt)
    yield from _work(hosts)
    yield from _host_rewards(hosts)


def _host_rewards(hosts: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """Each host's recent zero and error rates (its last look: ``[rewards]``) and whether it
    is named as lying; a host not looked at yet has no rate sample."""
    zero = GaugeMetricFamily(
        "reward_supervisor_host_zero_rate",
        "The share of the host's recent scored results that scored 0 (its last"
        " rewards.window_s or more).",
        labels=["host"],
    )
    errors = GaugeMetricFamily(
        "reward_supervisor_host_error_rate",
        "The share of the host's recent results that were errors.",
        labels=["host"],
    )
    lying = GaugeMetricFamily(
        "reward_supervisor_host_rewards_lying",
        "1 while the host is named as lying: its zero or error rate is out of line with the"
        " rest of the fleet's (it is not ready).",
        labels=["host"],
    )
    for name, row in sorted(hosts.items()):
        rewards = row.get("rewards")
        if not isinstance(rewards, Mapping):
            continue
        lying.add_metric([name], 1 if rewards.get("verdict") == "lying" else 0)
        if rewards.get("zero_rate") is not None:
            zero.add_metric([name], float(rewards["zero_rate"]))
        if rewards.get("error_rate") is not None:
            errors.add_metric([name], float(rewards["error_rate"]))
    yield from (zero, errors, lying)


def _fleet_rewards(daemon: Mapping[str, Any]) -> Iterator[Metric]:
    """The fleet's recent rates (the median of the hosts'), the hosts named as lying, the
    machines held for it, and the fleet-wide reward signature."""
    rewards = daemon.get("rewards")
    if not isinstance(rewards, Mapping):
        return
    # Served from the start, with a sample once a host is judged (before that there is no
    # rate, and 0 would be a claim).
    for key, documentation in (
        ("zero", "The median of the judged hosts' recent zero rates (hosts named lying left out)."),
        (
            "error",
            "The median of the judged hosts' recent error rates (hosts named lying left out).",
        ),
    ):
        family = GaugeMetricFamily(f"reward_supervisor_fleet_{key}_rate", documentation)
        if rewards.get(f"fleet_{key}_rate") is not None:
            family.add_metric([], float(rewards[f"fleet_{key}_rate"]))
        yield family
    yield _gauge(
        "reward_supervisor_rewards_lying_hosts",
        "Hosts named as lying now (moved to a spare or not).",
        len(rewards.get("lying") or ()),
    )
    yield _gauge(
        "reward_supervisor_rewards_held_machines",
        "Machines held out of service for lying, until an operator undrains them.",
        len(rewards.get("held") or ()),
    )
    yield _gauge(
        "reward_supervisor_reward_signature",
        "1 while most of the fleet's rewards are out of line with their own past at once (a"
        " deploy, a shared dependency): nothing is moved or restarted for it.",
        1 if rewards.get("signature") else 0,
    )


def _work(hosts: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """What each worker reports of its work, as it reports it: counts that start again at 0
    with each new worker (counters, as a restarted process's are: ``rate()`` copes) and
    levels; a figure the worker does not report has no sample."""
    finished = CounterMetricFamily(
        "reward_worker_tasks_finished",
        "Tasks the host's current worker finished, with a score or an error result.",
        labels=["host"],
    )
    errors = CounterMetricFamily(
        "reward_worker_task_errors",
        "Tasks the host's current worker finished with an error result (a failed trainer call).",
        labels=["host"],
    )
    zeros = CounterMetricFamily(
        "reward_worker_tasks_zero",
        "Tasks the host's current worker scored exactly 0 (its semantic_zero).",
        labels=["host"],
    )
    in_flight = GaugeMetricFamily(
        "reward_worker_tasks_in_flight", "Tasks the worker is computing now.", labels=["host"]
    )
    queue = GaugeMetricFamily(
        "reward_worker_queue_depth",
        "Task files in the shard's inbox, as the worker counted them (in-flight ones included).",
        labels=["host", "shard"],
    )
    backlog = GaugeMetricFamily(
        "reward_shard_backlog",
        "Task files waiting in each shard's inbox, from its worker's last heartbeat.",
        labels=["shard"],
    )
    rss = GaugeMetricFamily(
        "reward_worker_rss_bytes",
        "The memory the worker's session holds: its agent's measure (the sum of the"
        " proportional set sizes of the worker and every process it started), else the"
        " worker's own figure (status's work.rss_source says which).",
        labels=["host"],
    )
    for name, row in sorted(hosts.items()):
        work = row.get("work")
        if row.get("processed") is not None:
            finished.add_metric([name], float(row["processed"]))
        if row.get("in_flight") is not None:
            in_flight.add_metric([name], float(row["in_flight"]))
        if not isinstance(work, Mapping):
            continue
        if work.get("errors") is not None:
            errors.add_metric([name], float(work["errors"]))
        if work.get("semantic_zero") is not None:
            zeros.add_metric([name], float(work["semantic_zero"]))
        if work.get("queue_depth") is not None:
            shard = str(row.get("shard"))
            queue.add_metric([name, shard], float(work["queue_depth"]))
            backlog.add_metric([shard], float(work["queue_depth"]))
        if work.get("rss_bytes") is not None:
            rss.add_metric([name], float(work["rss_bytes"]))
    yield from (finished, errors, zeros, in_flight, queue, backlog, rss)


_UNHEALTHY: Final = frozenset(s.value for s in UNHEALTHY_STATES)


def _stuck(row: Mapping[str, Any]) -> bool:
    """The host's worker was found stuck and is not replaced yet (terminating, waiting out a
    cooldown or a held restart, or given up on)."""
    return row.get("last_cause") == Cause.STUCK.value and row.get("state") in _UNHEALTHY


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation)
    gauge.add_metric([], float(value))
    return gauge
