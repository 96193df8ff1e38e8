"""The operator's terminal: text from hosts and shared files is shown escaped, never obeyed.

A worker's error, an agent's stderr or a status file's reason can carry escape sequences
(clear the screen, set the title, rewrite a line with ``\\r``), bidi overrides or lone
surrogates; printed raw they would drive the operator's terminal. JSON output needs none of
this (JSON escapes control characters itself); tables, event lines and console logs do.
"""

from __future__ import annotations


def terminal_text(value: object) -> str:
    """``str(value)`` with every character that is not printable shown as its Python escape
    (``\\x1b``, ``\\n``, ``\\u202e``, ``\\ud800``): C0 and C1 controls, DEL, format characters
    such as bidi overrides, line separators, and lone surrogates. Printable text, spaces and
    backslashes included, is unchanged."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
