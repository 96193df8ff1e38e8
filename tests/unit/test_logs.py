"""Log output: one JSON object per line, contract fields, redaction, stdlib records, no locals."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from supervisor import logs

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Each test configures logging afresh; put structlog and stdlib back afterwards."""
    root = logging.getLogger()
    levels = {n: logging.getLogger(n).level for n in (None, *logs.FOREIGN_LOGGERS)}
    handlers = list(root.handlers)
    yield
    logs.stop_background()
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _lines(text: str) -> list[dict[str, Any]]:
    """Every line parsed as JSON (fails the test on any line that is not one object)."""
    out = []
    for line in text.splitlines():
        obj = json.loads(line)
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def test_every_line_is_one_json_object_with_the_contract_fields() -> None:
    """Each event is a line with an ISO 8601 UTC timestamp, level, event and its fields."""
    out = io.StringIO()
    logs.configure("json", stream=out)
    structlog.get_logger().info("ssh.connected", host="worker-0", port=22)
    structlog.get_logger().warning("host.state", host="worker-0", to="stale", reason="exited")
    first, second = _lines(out.getvalue())
    assert ISO_UTC.match(first["timestamp"])
    assert datetime.fromisoformat(first["timestamp"]).tzinfo == UTC
    assert first | {"timestamp": None} == {
        "event": "ssh.connected",
        "level": "info",
        "host": "worker-0",
        "port": 22,
        "timestamp": None,
    }
    assert (second["level"], second["event"], second["to"]) == ("warning", "host.state", "stale")


def test_events_below_the_level_are_dropped() -> None:
    """At level warning, info and debug events write nothing."""
    out = io.StringIO()
    logs.configure("json", level="warning", stream=out)
    log = structlog.get_logger()
    log.debug("a")
    log.info("b")
    log.error("c")
    assert [line["event"] for line in _lines(out.getvalue())] == ["c"]


def test_unknown_level_is_refused() -> None:
    """A level name that is not a logging level raises ValueError naming it."""
    with pytest.raises(ValueError, match="verbose"):
        logs.configure("json", level="verbose", stream=io.StringIO())


def test_bound_context_is_included() -> None:
    """Context bound with bind() or bind_contextvars() appears in each line."""
    out = io.StringIO()
    logs.configure("json", stream=out)
    structlog.get_logger().bind(host="worker-3").info("launch.sent")
    structlog.contextvars.bind_contextvars(host="worker-4")
    structlog.get_logger().info("probe.sent")
    lines = _lines(out.getvalue())
    assert [(line["event"], line["host"]) for line in lines] == [
        ("launch.sent", "worker-3"),
        ("probe.sent", "worker-4"),
    ]


def test_stdlib_library_records_become_json_lines_from_warning_up() -> None:
    """asyncssh and watchfiles records render as JSON lines, with context, and only from WARNING."""
    out = io.StringIO()
    logs.configure("json", level="debug", stream=out)
    structlog.contextvars.bind_contextvars(host="worker-1")
    logging.getLogger("asyncssh").info("[conn=0] Opening SSH connection")
    logging.getLogger("watchfiles.main").info("3 changes detected")
    logging.getLogger("asyncssh").warning("[conn=%d] Connection lost", 7)
    (line,) = _lines(out.getvalue())
    assert line["event"] == "[conn=7] Connection lost"
    assert (line["level"], line["logger"], line["host"]) == ("warning", "asyncssh", "worker-1")
    assert ISO_UTC.match(line["timestamp"])


def test_exceptions_are_structured_and_carry_no_local_variables() -> None:
    """An exception renders as exc_type, exc_value and frames, never the frames' locals."""
    out = io.StringIO()
    logs.configure("json", stream=out)

    def connect() -> None:
        passphrase_in_a_local = "hunter2-correct-horse"  # noqa: S105 (a fake, to be kept out)
        raise ConnectionError(f"refused ({len(passphrase_in_a_local)})")

    try:
        connect()
    except ConnectionError:
        structlog.get_logger().exception("ssh.failed", host="worker-2")
    try:
        connect()
    except ConnectionError:
        logging.getLogger("asyncssh").exception("stdlib failure")
    text = out.getvalue()
    assert "hunter2" not in text
    for line in _lines(text):
        (exc,) = line["exception"]
        assert (exc["exc_type"], exc["exc_value"]) == ("ConnectionError", "refused (21)")
        assert exc["frames"][-1]["name"] == "connect"
        assert all("locals" not in frame for frame in exc["frames"])


def test_huge_exception_messages_and_deep_stacks_are_trimmed() -> None:
    """A 100 KB exception message and a 200-deep stack give a line under journald's 48 KiB."""
    out = io.StringIO()
    logs.configure("json", stream=out)

    def recurse(n: int) -> None:
        if n == 0:
            raise RuntimeError("x" * 100_000)
        recurse(n - 1)

    try:
        recurse(200)
    except RuntimeError:
        structlog.get_logger().exception("deep.failure")
    text = out.getvalue()
    (line,) = _lines(text)
    assert len(text) < 48 * 1024
    (exc,) = line["exception"]
    assert exc["exc_value"].endswith("[truncated]")
    assert len(exc["frames"]) == 21  # the first 10, a "Skipped frames" marker, the last 10
    assert exc["frames"][10]["name"].startswith("Skipped frames")


def test_secret_fields_are_redacted_at_any_depth() -> None:
    """Secret-looking keys are redacted at top level, in nested dicts and in lists of dicts."""
    out = io.StringIO()
    logs.configure("json", stream=out)
    nested = {"password": "pw1", "keepalive_interval_s": 15, "inner": [{"api_token": "t1"}]}
    structlog.get_logger().info(
        "config.loaded",
        passphrase="pp",  # noqa: S106 (a fake secret whose redaction is tested)
        client_key="-----BEGIN OPENSSH PRIVATE KEY-----",
        key_count=2,
        ssh=nested,
    )
    logging.getLogger("asyncssh").warning("auth", extra={"secret": "s1", "user": "reward"})
    first, second = _lines(out.getvalue())
    assert first["passphrase"] == first["client_key"] == logs.REDACTED
    assert first["key_count"] == 2
    assert first["ssh"] == {
        "password": "[redacted]",
        "keepalive_interval_s": 15,
        "inner": [{"api_token": "[redacted]"}],
    }
    assert (second["secret"], second["user"]) == ("[redacted]", "reward")
    assert nested == {"password": "pw1", "keepalive_interval_s": 15, "inner": [{"api_token": "t1"}]}
    assert not {"pw1", "t1", "s1", "pp"} & set(re.findall(r'"(\w+)"', out.getvalue()))


@pytest.mark.parametrize(
    "key",
    [
        "token",
        "api_token",
        "accessToken",
        "AUTH_TOKEN",
        "secret",
        "client_secret",
        "password",
        "db_password",
        "sshPassphrase",
        "passwd",
        "key",
        "private_key",
        "apiKey",
        "api-key",
        "privkey",
        "client_keys",
        "credentials",
    ],
)
def test_secret_looking_keys_are_secret(key: str) -> None:
    """Names that say token, secret, password, passphrase, credential or key are redacted."""
    assert logs.is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "keepalive_interval_s",
        "keepalive_count_max",
        "key_count",
        "token_count",
        "key_path",
        "password_file",
        "host_key_alias",
        "key_type",
        "key_fingerprint",
        "monkey",
        "turkey_id",
        "tokenizer",
        "hotkeys_enabled",
        "host",
        "event",
    ],
)
def test_metadata_and_lookalike_keys_are_not_secret(key: str) -> None:
    """Counts, paths, types of secrets and words merely containing "key" are kept."""
    assert not logs.is_secret_key(key)


def test_console_format_is_plain_text_without_colors_off_a_terminal() -> None:
    """The console renderer writes readable lines, and no ANSI colors into a non-terminal."""
    out = io.StringIO()
    logs.configure("console", stream=out)
    structlog.get_logger().info("ssh.connected", host="worker-0")
    text = out.getvalue()
    assert "ssh.connected" in text
    assert "host=worker-0" in text
    assert "\x1b[" not in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_auto_format_is_json_off_a_terminal() -> None:
    """auto picks JSON for pipes, files and journald streams."""
    out = io.StringIO()
    logs.configure("auto", stream=out)
    structlog.get_logger().info("daemon.started")
    assert _lines(out.getvalue())[0]["event"] == "daemon.started"


def test_auto_format_is_console_on_a_terminal() -> None:
    """auto picks the console renderer when the stream is a real terminal (a pty here)."""
    master, slave = os.openpty()
    with os.fdopen(master, "rb", buffering=0) as reader, open(slave, "w") as tty:
        logs.configure("auto", stream=tty)
        structlog.get_logger().info("daemon.started", host="worker-0")
        text = reader.read(4096).decode()
    assert "daemon.started" in text
    assert not text.lstrip().startswith("{")


def test_capture_logs_sees_events_after_configure() -> None:
    """Loggers are not cached by default, so structlog.testing.capture_logs still works."""
    logs.configure("json", stream=io.StringIO())
    log = structlog.get_logger()
    log.info("before")
    with capture_logs() as captured:
        log.info("host.state", host="worker-0", to="ready")
    assert captured == [
        {"event": "host.state", "host": "worker-0", "to": "ready", "log_level": "info"}
    ]


def test_configuring_twice_does_not_duplicate_stdlib_lines() -> None:
    """A second configure replaces the first: one line per stdlib record, on the new stream."""
    first, second = io.StringIO(), io.StringIO()
    logs.configure("json", stream=first)
    logs.configure("json", stream=second)
    logging.getLogger("asyncssh").error("once")
    assert first.getvalue() == ""
    assert [line["event"] for line in _lines(second.getvalue())] == ["once"]


def test_concurrent_structlog_and_stdlib_lines_never_interleave(tmp_path: Path) -> None:
    """Threads writing big structlog and stdlib events to one file produce only whole lines."""
    path = tmp_path / "out.log"
    with path.open("w", encoding="utf-8") as out:
        logs.configure("json", stream=out)
        payload = "p" * 20_000  # bigger than the text layer's buffer: several raw writes

        def write(n: int) -> None:
            log = structlog.get_logger()
            stdlib = logging.getLogger("asyncssh")
            for i in range(50):
                if i % 2:
                    log.warning("structlog.line", writer=n, i=i, payload=payload)
                else:
                    stdlib.warning("stdlib %d %d %s", n, i, payload)

        threads = [threading.Thread(target=write, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    lines = _lines(path.read_text(encoding="utf-8"))
    assert len(lines) == 6 * 50
    assert sum(line["event"] == "structlog.line" for line in lines) == 6 * 25


class BrokenStream(io.StringIO):
    """A stream whose reader is gone: every write fails as a pipe's does (EPIPE)."""

    def write(self, s: str) -> int:
        """Fail as a write to a pipe without a reader does."""
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_line_that_cannot_be_written_is_dropped_and_counted_never_raised(
    fmt: logs.LogFormat,
) -> None:
    """structlog and stdlib records alike: a log call on a broken stream returns (it sits in
    signal handlers and task roots), and the count says how many lines were lost."""
    logs.configure(fmt, "info", stream=BrokenStream())
    before, logged = logs.dropped_lines(), logs.logged_lines()
    structlog.get_logger("t").info("daemon.stop_requested", by="SIGTERM")
    structlog.get_logger("t").error("history.not_saved", reason="x")
    structlog.get_logger("t").debug("below.the.level")
    logging.getLogger("asyncssh").warning("a foreign record")
    assert logs.dropped_lines() == before + 3
    assert logs.logged_lines() == logged + 3
    closed = io.StringIO()
    closed.close()
    logs.configure(fmt, "info", stream=closed)
    structlog.get_logger("t").info("after.close")
    assert logs.dropped_lines() == before + 4


def _read_all_once_written(fd: int, out: io.TextIOWrapper) -> list[dict[str, Any]]:
    """Start reading JSON lines from pipe ``fd``; once the background writer says all is
    written (``flush``) and has ended, close its end ``out``: every line read."""
    got: list[dict[str, Any]] = []

    def read() -> None:
        with os.fdopen(fd, encoding="utf-8") as pipe:
            got.extend(json.loads(line) for line in pipe)

    reader = threading.Thread(target=read)
    reader.start()
    assert logs.flush(60.0)
    logs.stop_background()
    out.close()
    reader.join(60.0)
    return got


def test_in_the_background_a_reader_that_stops_reading_never_blocks_a_log_call() -> None:
    """Written in the background (the daemon), a megabyte of lines is logged while nobody
    reads the pipe (16 times what it holds): every call returns; once read, every line is
    there, structlog's and stdlib's, in the order logged, and ``flush`` says so."""
    r, w = os.pipe()
    out = os.fdopen(w, "w", encoding="utf-8")
    logs.configure("json", stream=out, background=True)
    payload = "x" * 1000
    log, stdlib = structlog.get_logger(), logging.getLogger("asyncssh")
    for i in range(1000):
        if i % 10:
            log.info("line", i=i, payload=payload)
        else:
            stdlib.warning("stdlib %d", i)
    got = _read_all_once_written(r, out)
    assert [line.get("i", line["event"]) for line in got] == [
        i if i % 10 else f"stdlib {i}" for i in range(1000)
    ]


def test_in_the_background_lines_past_the_bound_are_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the reader stopped, lines past ``PENDING_MAX`` waiting are dropped and counted,
    and never block the caller; the ones kept come out in order."""
    monkeypatch.setattr(logs, "PENDING_MAX", 50)
    r, w = os.pipe()
    out = os.fdopen(w, "w", encoding="utf-8")
    logs.configure("json", stream=out, background=True)
    before, logged = logs.dropped_lines(), logs.logged_lines()
    for i in range(3000):
        structlog.get_logger().info("line", i=i, payload="y" * 1000)
    # Kept at most: those waiting, a batch in the writer's hands, what the pipe holds.
    assert logs.dropped_lines() - before >= 3000 - 50 - logs.BATCH_MAX - 70
    got = _read_all_once_written(r, out)
    numbers = [line["i"] for line in got]
    assert numbers == sorted(numbers) and len(numbers) == 3000 - (logs.dropped_lines() - before)
    # What a status reply's log_lines and log_lines_dropped tell a reader to expect.
    assert logs.logged_lines() - logged - (logs.dropped_lines() - before) == len(got)


def test_in_the_background_what_is_queued_is_written_at_exit(tmp_path: Path) -> None:
    """A process that logs in the background and exits at once still writes every line
    (the exit handler waits for the writer)."""
    import subprocess
    import sys

    program = (
        "import structlog\n"
        "from supervisor import logs\n"
        "logs.configure('json', background=True)\n"
        "for i in range(2000):\n"
        "    structlog.get_logger().info('line', i=i)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    )
    assert [line["i"] for line in _lines(ran.stdout)] == list(range(2000))
