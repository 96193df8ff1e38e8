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

import json
import logging
import os
import re
import sys
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


def dropped_lines() -> int:
    """How many log lines could not be written since start (the stream broke: its reader
    gone, a full disk)."""
    return _dropped_lines


class _DroppingWriteLogger(structlog.WriteLogger):
    """structlog's ``WriteLogger``, but a line that cannot be written is dropped and counted,
    never raised: log calls sit in signal handlers and task roots, and a reader gone from
    our stdout (EPIPE) ended the daemon, or swallowed a SIGTERM half-handled."""

    def msg(self, message: str) -> None:
        """Write and flush ``message``, or count it dropped."""
        global _dropped_lines
        try:
            super().msg(message)
        except (OSError, ValueError):  # ValueError: the stream was closed
            _dropped_lines += 1

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _DroppingWriteLoggerFactory:
    """``logger_factory`` for ``structlog.configure``: ``_DroppingWriteLogger`` on ``file``."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _DroppingWriteLogger:
        return _DroppingWriteLogger(self._file)


class _LineHandler(logging.Handler):
    """Writes formatted stdlib records as whole lines through structlog's per-stream lock.

    structlog's ``WriteLogger`` serialises writers of one stream with a lock kept per
    file object; going through a ``WriteLogger`` of the same stream shares that lock, so a
    stdlib line and a structlog line never interleave.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._out = _DroppingWriteLogger(stream)

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
) -> None:
    """Route structlog and stdlib logging to ``stream`` (default: stdout) in one format.

    ``auto`` means console on a terminal, JSON otherwise (journald, pipes, files).
    ``cache=True`` caches loggers on first use (faster; production only: tests that
    capture logs need it off). Calling it again replaces the previous configuration.
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

    structlog.configure(
        processors=[*shared, *renderers],
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        context_class=dict,
        logger_factory=_DroppingWriteLoggerFactory(out),
        cache_logger_on_first_use=cache,
    )

    handler = _LineHandler(out)
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
