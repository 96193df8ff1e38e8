"""What reaches an operator's terminal: a host's text shown escaped, never obeyed."""

from __future__ import annotations

import io

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from supervisor import logs
from supervisor.cli import _event_line
from supervisor.render import render_table
from supervisor.terminal import terminal_text

HOSTILE = "boom\x1b[2J\x1b]0;owned\x07\r\n\t\x7f\x9b\u202e\u2028\ud800 done"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b[31mred", "\\x1b[31mred"),
        ("a\rb\nc\td", "a\\rb\\nc\\td"),
        ("\x07\x00\x7f\x9b", "\\x07\\x00\\x7f\\x9b"),
        ("\u202eevil", "\\u202eevil"),
        ("\ud800", "\\ud800"),
        ("plain text, é ü ß 漢字 \\ 'quoted'", "plain text, é ü ß 漢字 \\ 'quoted'"),
    ],
)
def test_control_characters_are_shown_as_escapes(raw: str, shown: str) -> None:
    """Controls, DEL, C1, bidi overrides and lone surrogates become escapes; printable text,
    non-ASCII letters and backslashes are kept as they are."""
    assert terminal_text(raw) == shown


@given(st.text())
def test_escaped_text_is_printable_encodable_and_stable(text: str) -> None:
    """Whatever the input, the result is printable, encodes as UTF-8 and escapes no further."""
    shown = terminal_text(text)
    assert shown.isprintable()
    shown.encode("utf-8")
    assert terminal_text(shown) == shown


def test_status_table_escapes_every_cell_and_keeps_columns_aligned() -> None:
    """A reason with escape sequences and newlines is one escaped cell: no control character
    reaches the output, and the rows stay one line each."""
    status = {
        "daemon": {"pid": 1, "uptime_s": 5, "summary": f"1/2 ready {HOSTILE}"},
        "hosts": {
            "worker-0": {"state": "ready", "shard": 0, "pid": 10, "ssh": "connected"},
            "worker-1": {"state": "stale", "shard": 1, "last_reason": HOSTILE, "ssh": "x"},
        },
    }
    table = render_table(status)
    assert all(line.isprintable() for line in table.split("\n"))
    assert len(table.split("\n")) == 4
    assert "\\x1b[2J" in table


def test_event_lines_are_escaped() -> None:
    """A host.state event's reason, and any other event's JSON, reach the terminal escaped."""
    line = _event_line({"event": "host.state", "host": "w", "to": "stale", "reason": HOSTILE})
    assert line.isprintable()
    assert "\\x1b[2J" in line
    assert _event_line({"event": "other", "x": "\x7f"}).isprintable()


def test_console_logs_escape_what_a_host_said() -> None:
    """In console mode (a person's terminal), a logged stderr line is escaped."""
    out = io.StringIO()
    logs.configure("console", stream=out)
    structlog.get_logger().warning("agent.stderr", host="worker-0", line=HOSTILE)
    text = out.getvalue()
    assert text.endswith("\n")
    assert text[:-1].isprintable()
    assert "\\x1b[2J" in text


def test_an_event_with_evidence_points_at_status_host() -> None:
    """A host.state event that carries evidence says so in one line, and where to read it."""
    event = {
        "event": "host.state",
        "host": "w",
        "from": "stale",
        "to": "starting",
        "reason": "restarting after: stuck",
        "evidence": {"pid": 7, "via": "py-spy", "stacks": "Thread 1\n    f (x.py:1)\n"},
    }
    line = _event_line(event)
    assert line.endswith("[evidence of pid 7: stacks by py-spy; see status w]")
    assert "\n" not in line
