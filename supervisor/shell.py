"""What the interpreter (``daemon.Daemon``) gives each adapter: the config in force, the
epoch this daemon leads under, a way to emit events to the cores, and a way to spawn tasks
that the daemon owns (started in its task group, cancelled and awaited when it stops).

An adapter is handed this and nothing else of the daemon: it performs actions and reports
what happened; it never calls a core, never reads a core's state to decide, and never
starts a task of its own that nobody awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, Protocol

from supervisor import leadership, vocabulary
from supervisor.config import Config


class Shell(Protocol):
    """The daemon as its adapters see it."""

    @property
    def config(self) -> Config:
        """The config in force (a reload replaces it)."""
        ...

    @property
    def epoch(self) -> int:
        """This leadership's epoch (0 until the daemon leads): every remote act carries it."""
        ...

    def emit(self, event: vocabulary.Event) -> None:
        """Queue one event for the fleet core."""
        ...

    def emit_all(self, events: Iterable[vocabulary.Event]) -> None:
        """Queue events for the fleet core, in this order, in one batch where possible."""
        ...

    def lead(self, event: leadership.Event) -> None:
        """Feed the leadership core one event (a fenced request, a failed write)."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``coro`` as a task the daemon owns."""
        ...
