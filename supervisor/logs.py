"""Log output (DESIGN §8): the only place logging is configured, for structlog and stdlib alike.

JSON mode writes one object per line with ``timestamp`` (ISO 8601 UTC), ``level`` and
``event``; console mode is for people at a terminal. Secret-looking fields are redacted.

Redaction rule. A key is split into lower-case words at ``_ - .``, spaces and camelCase
humps (``apiKey`` -> ``api key``). It is secret when a word
  - contains ``secret``, ``password``, ``passwd``, ``passphrase`` or ``credential``, or
  - is or ends with ``token``/``tokens`` (``token``, ``accesstoken``; not ``tokenizer``), or
  - is ``key``/``keys`` or a known key compound (``apikey``, ``privkey``, ``privatekey``,
    ``accesskey``, ``sshkey``, ``signingkey``),
unless its last word names metadata about the secret rather than the secret itself
(``key_count``, ``token_count``, ``key_path``, ``password_file``, ``key_type``,
``key_fingerprint``...). Substrings across word boundaries never match, so
``keepalive_interval_s``, ``monkey`` and ``turkey`` pass. Nested dicts (and lists of
them) are redacted the same way. A value is never inspected: a secret logged under an
innocent name, or inside an exception message, is not caught.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import Any, Final, Literal, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import EventDict, Processor, WrappedLogger

from supervisor.terminal import terminal_text

LogFormat = Literal["json", "console", "auto"]

REDACTED: Final = "[redacted]"
#: Libraries that log through the standard library; they are noisy below WARNING
#: (watchfiles logs every batch at INFO, asyncssh every channel).
FOREIGN_LOGGERS: Final = ("asyncssh", "watchfiles")
FOREIGN_LEVEL: Final = logging.WARNING

# Exceptions stay small: journald splits lines over 48 KiB (LineMax) and rate-limits floods.
_MAX_FRAMES: Final = 20
_MAX_EXC_VALUE: Final = 2000

_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

#: The level names ``configure`` accepts (any case).
LEVEL_NAMES: Final = tuple(_LEVELS)

_SECRET_SUBSTRINGS: Final = ("secret", "password", "passwd", "passphrase", "credential")
_KEY_WORDS: Final = frozenset(
    {"key", "keys", "apikey", "privkey", "privatekey", "accesskey", "sshkey", "signingkey"}
)
_METADATA_WORDS: Final = frozenset(
    {
        "count",
        "counts",
        "n",
        "num",
        "number",
        "len",
        "length",
        "size",
        "bits",
        "path",
        "paths",
        "file",
        "files",
        "dir",
        "type",
        "types",
        "kind",
        "algorithm",
        "algorithms",
        "alg",
        "fingerprint",
        "fingerprints",
        "alias",
        "id",
        "ids",
        "name",
        "names",
        "format",
        "source",
        "set",
        "present",
        "loaded",
        "expires",
        "expiry",
        "age",
    }
)
_WORD_SPLIT: Final = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])")


def is_secret_key(key: str) -> bool:
    """Whether a field called ``key`` holds a secret (see the module docstring for the rule)."""
    words = [w.lower() for w in _WORD_SPLIT.split(key) if w]
    if not words or words[-1] in _METADATA_WORDS:
        return False
    for word in words:
        if any(s in word for s in _SECRET_SUBSTRINGS):
            return True
        if word.endswith(("token", "tokens")) or word in _KEY_WORDS:
            return True
    return False


def redact(value: Any) -> Any:
    """``value`` with every secret-looking key's value replaced, at any depth; never mutates."""
    if isinstance(value, Mapping):
        return {
            k: REDACTED if isinstance(k, str) and is_secret_key(k) else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


def _redact_processor(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    # The structural keys are ours; everything else the caller chose.
    out: EventDict = {}
    for k, v in event_dict.items():
        if k in ("event", "level", "timestamp", "exc_info", "_record", "_from_structlog"):
            out[k] = v
        elif is_secret_key(k):
            out[k] = REDACTED
        else:
            out[k] = redact(v)
    return out


def _trim_exception(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    exception = event_dict.get("exception")
    if isinstance(exception, list):
        for entry in exception:
            if isinstance(entry, MutableMapping):
                text = entry.get("exc_value")
                if isinstance(text, str) and len(text) > _MAX_EXC_VALUE:
                    entry["exc_value"] = text[:_MAX_EXC_VALUE] + "...[truncated]"
    return event_dict


def _shared_processors() -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        _redact_processor,
    ]


def _escape_for_terminal(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    # Console lines go to a person's terminal, and ConsoleRenderer prints strings raw: a
    # host's stderr line or error text could otherwise clear the screen or rewrite lines.
    return {k: terminal_text(v) if isinstance(v, str) else v for k, v in event_dict.items()}


def _renderers(fmt: Literal["json", "console"], colors: bool) -> list[Processor]:
    if fmt == "console":
        # ConsoleRenderer formats exc_info itself (a readable traceback, no locals).
        return [_escape_for_terminal, structlog.dev.ConsoleRenderer(colors=colors)]
    return [
        # Locals in tracebacks would put secrets and huge objects into the logs.
        structlog.processors.ExceptionRenderer(
            ExceptionDictTransformer(show_locals=False, max_frames=_MAX_FRAMES, use_rich=False)
        ),
        _trim_exception,
        structlog.processors.JSONRenderer(serializer=json.dumps),
    ]


_dropped_lines = 0
_logged_lines = 0


def logged_lines() -> int:
    """How many log lines were logged since start: written, queued to be, or dropped. A
    reader of our stdout that has ``logged_lines() - dropped_lines()`` lines (as of a status
    reply) has every line logged before that reply, though it is written in the background."""
    return _logged_lines


def dropped_lines() -> int:
    """How many log lines could not be written since start (the stream broke: its reader
    gone, a full disk; or, written in the background, more than ``PENDING_MAX`` waited)."""
    return _dropped_lines


def _count_dropped(lines: int) -> None:
    global _dropped_lines
    _dropped_lines += lines


#: Lines waiting for the background writer, at most: a reader that stopped reading our
#: stdout (journald stalled, a pipe nobody drains) costs this much memory (a few MB), then
#: lines are dropped and counted, and the daemon goes on.
PENDING_MAX: Final = 10_000
#: Lines written at once, at most (one write and one flush per batch).
BATCH_MAX: Final = 512
#: Once woken by a line, the writer waits this long for more before it writes: each wake-up
#: takes the interpreter's lock from the event loop, and on a busy machine getting it back
#: can take the loop milliseconds; a burst of lines now costs it one hand-over, not one each.
GATHER_S: Final = 0.005
#: At exit, the writer gets this long to write what is still queued.
EXIT_FLUSH_S: Final = 2.0


class _BackgroundWriter:
    """Writes lines to a stream from a thread of its own.

    A write to a full pipe blocks: with a log line written on the event loop, a reader of
    our stdout that fell behind (the benchmark's, journald under load) stalled the daemon
    for up to 30 ms a line, 0.4 s of one start of 50 hosts (docs/BENCHMARKS.md). The loop
    now only queues the line (``SimpleQueue.put``, safe in a signal handler too); this
    thread writes them in order, a batch per write. What cannot be written is dropped and
    counted, as before.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._queue: queue.SimpleQueue[str | threading.Event | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rs-log-writer", daemon=True)
        self._thread.start()

    def write(self, line: str) -> None:
        """Queue ``line`` (with its newline), or count it dropped if too many wait."""
        if self._queue.qsize() >= PENDING_MAX:
            _count_dropped(1)
            return
        self._queue.put(line)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every line queued before this call is written (or dropped); False if
        that took longer than ``timeout_s`` or the writer is gone."""
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Write what is queued (for at most ``timeout_s``), then end the thread."""
        self.flush(timeout_s)
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            time.sleep(GATHER_S)
            lines: list[str] = []
            done: list[threading.Event] = []
            while True:
                if item is None:
                    self._write(lines)
                    return
                if isinstance(item, threading.Event):
                    done.append(item)
                else:
                    lines.append(item)
                if len(lines) >= BATCH_MAX:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._write(lines)
            for event in done:
                event.set()

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except (OSError, ValueError):  # ValueError: the stream was closed
            _count_dropped(len(lines))


#: The writer of the current configuration, when it writes in the background.
_writer: list[_BackgroundWriter] = []


def flush(timeout_s: float = EXIT_FLUSH_S) -> bool:
    """Wait until the lines logged so far are written (background writing only; True at
    once otherwise); False if that took longer than ``timeout_s``."""
    return _writer[0].flush(timeout_s) if _writer else True


def stop_background() -> None:
    """Write what is queued (for at most ``EXIT_FLUSH_S``) and end the background writer, if
    one runs (at exit, and before ``configure`` replaces it)."""
    while _writer:
        _writer.pop().close(EXIT_FLUSH_S)


atexit.register(stop_background)


class _DroppingWriteLogger(structlog.WriteLogger):
    """structlog's ``WriteLogger``, but a line that cannot be written is dropped and counted,
    never raised: log calls sit in signal handlers and task roots, and a reader gone from
    our stdout (EPIPE) ended the daemon, or swallowed a SIGTERM half-handled. With a
    background writer, the line is queued for it instead."""

    def __init__(self, file: TextIO, writer: _BackgroundWriter | None = None) -> None:
        super().__init__(file)
        self._writer = writer

    def msg(self, message: str) -> None:
        """Queue ``message``, or write and flush it, or count it dropped."""
        global _logged_lines
        _logged_lines += 1
        if self._writer is not None:
            self._writer.write(message + "\n")
            return
        try:
            super().msg(message)
        except (OSError, ValueError):  # ValueError: the stream was closed
            _count_dropped(1)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _DroppingWriteLoggerFactory:
    """``logger_factory`` for ``structlog.configure``: ``_DroppingWriteLogger`` on ``file``."""

    def __init__(self, file: TextIO, writer: _BackgroundWriter | None) -> None:
        self._file = file
        self._writer = writer

    def __call__(self, *args: Any) -> _DroppingWriteLogger:
        return _DroppingWriteLogger(self._file, self._writer)


class _LineHandler(logging.Handler):
    """Writes formatted stdlib records as whole lines through structlog's per-stream lock.

    structlog's ``WriteLogger`` serialises writers of one stream with a lock kept per
    file object; going through a ``WriteLogger`` of the same stream shares that lock, so a
    stdlib line and a structlog line never interleave.
    """

    def __init__(self, stream: TextIO, writer: _BackgroundWriter | None) -> None:
        super().__init__()
        self._out = _DroppingWriteLogger(stream, writer)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            self._out.msg(line)
        # logging's contract: a failing handler reports through handleError, never raises.
        except Exception:  # noqa: BLE001
            self.handleError(record)


def configure(
    fmt: LogFormat = "auto",
    level: str = "info",
    stream: TextIO | None = None,
    *,
    cache: bool = False,
    background: bool = False,
) -> None:
    """Route structlog and stdlib logging to ``stream`` (default: stdout) in one format.

    ``auto`` means console on a terminal, JSON otherwise (journald, pipes, files).
    ``cache=True`` caches loggers on first use (faster; production only: tests that
    capture logs need it off). ``background=True`` writes from a thread of its own (the
    daemon: its event loop must never wait on its log's reader); ``flush`` waits for it.
    Calling it again replaces the previous configuration (and writer).
    Raises ``ValueError`` for an unknown level.
    """
    try:
        min_level = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; one of {', '.join(_LEVELS)}") from None
    out = sys.stdout if stream is None else stream
    tty = _isatty(out)
    resolved: Literal["json", "console"] = ("console" if tty else "json") if fmt == "auto" else fmt
    colors = tty and "NO_COLOR" not in os.environ
    shared = _shared_processors()
    renderers = _renderers(resolved, colors)
    stop_background()
    writer = _BackgroundWriter(out) if background else None
    if writer is not None:
        _writer.append(writer)

    structlog.configure(
        processors=[*shared, *renderers],
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        context_class=dict,
        logger_factory=_DroppingWriteLoggerFactory(out, writer),
        cache_logger_on_first_use=cache,
    )

    handler = _LineHandler(out, writer)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(),
                _redact_processor,
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderers],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _LineHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    # Other libraries' records reach us from WARNING up, and so do these chatty ones even
    # when we run at debug.
    root.setLevel(max(min_level, FOREIGN_LEVEL))
    for name in FOREIGN_LOGGERS:
        logging.getLogger(name).setLevel(max(min_level, FOREIGN_LEVEL))


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # closed, or not a real file
        return False
