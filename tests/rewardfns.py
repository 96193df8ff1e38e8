"""Reward functions for the real AReaL worker in tests and benchmarks (imported by the workers).

The worker imports them by name (``tests.rewardfns.exact``) inside its pool processes, on the
worker host's Python: so this file is stdlib-only and runs on Python 3.8+. Each has AReaL's
signature ``fn(prompt, completions, prompt_ids=None, completion_ids=None, answer=None, **kw)
-> float``. ``broken_import`` is not here on purpose: :data:`BROKEN_IMPORT` names a module that
does not exist, which the worker turns into an error result for every task.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

#: A reward fn path whose module cannot be imported (a deploy that lost its reward module).
BROKEN_IMPORT = "tests.rewardfns_missing.reward_fn"
#: ``hang_if_marker`` hangs while the file this names exists. ``{host}`` in it is replaced by
#: the ``--host`` of the worker running the call, so one host's slots can be hung alone.
HANG_MARKER_ENV = "TRAINER_HANG_MARKER"
#: sshd's environment variable for a session: client address and port, server address and
#: port. The server address is the machine as it was reached (a loopback alias per host
#: here), which a worker's ``--host`` is not: a shard moved to a spare keeps its label.
SSH_CONNECTION_ENV = "SSH_CONNECTION"
#: ``slowish`` sleeps a random time in this range: every task stays in flight for a moment,
#: so a fault always finds work in the pool, and the two cores are not busy spinning.
SLOW_S = (0.02, 0.05)
# A hung call re-checks its marker this often: it ends within this long of the removal.
_HANG_RECHECK_S = 0.2

_host_cache: list[str] = []


def exact(
    prompt: Any,
    completions: Any,
    prompt_ids: Any = None,
    completion_ids: Any = None,
    answer: Any = None,
    **kw: Any,
) -> float:
    """1.0 when ``str(answer)`` occurs in ``str(completions)``, else 0.0 (no answer: 0.0)."""
    if answer is None:
        return 0.0
    return 1.0 if str(answer) in str(completions) else 0.0


def slowish(
    prompt: Any,
    completions: Any,
    prompt_ids: Any = None,
    completion_ids: Any = None,
    answer: Any = None,
    **kw: Any,
) -> float:
    """:func:`exact` after sleeping 20-50 ms, so that there is always work in flight."""
    # time.sleep, not an Event: a pool process inside a call then sleeps in the kernel's
    # nanosleep, which tells it from an idle one (tests/areal.py busy_pool_process).
    time.sleep(random.uniform(*SLOW_S))
    return exact(prompt, completions, answer=answer)


def hang_if_marker(
    prompt: Any,
    completions: Any,
    prompt_ids: Any = None,
    completion_ids: Any = None,
    answer: Any = None,
    **kw: Any,
) -> float:
    """Block while the marker file exists (kwarg ``hang_marker``, else ``$TRAINER_HANG_MARKER``,
    ``{host}`` replaced by this worker's ``--host``), then score as :func:`slowish`.

    With no marker configured, or the file absent, it is :func:`slowish`: the marker switches
    "every slot of this host stuck" on and off without restarting anything.
    """
    marker = _marker_path(kw.get("hang_marker"))
    if marker is not None:
        wait = threading.Event()
        while os.path.exists(marker):
            wait.wait(_HANG_RECHECK_S)
    return slowish(prompt, completions, answer=answer)


def zero_if_marker(
    prompt: Any,
    completions: Any,
    prompt_ids: Any = None,
    completion_ids: Any = None,
    answer: Any = None,
    **kw: Any,
) -> float:
    """:func:`hang_if_marker`'s score, but 0.0 while the file named by kwarg ``zero_marker``
    exists, ``{addr}`` in it replaced by the address this worker's machine was reached at
    over SSH and ``{host}`` by its ``--host``: a verifier dependency gone from one machine,
    whose sandbox client scores the connection error 0 (the shard moved to a spare scores
    right again). Kwarg ``zero_share``: that share of the other calls scores 0 too, at
    random (a healthy run's wrong answers)."""
    score = hang_if_marker(prompt, completions, answer=answer, hang_marker=kw.get("hang_marker"))
    marker = kw.get("zero_marker")
    if isinstance(marker, str) and os.path.exists(
        marker.replace("{addr}", _ssh_address()).replace("{host}", _worker_host())
    ):
        return 0.0
    share = kw.get("zero_share")
    if isinstance(share, (int, float)) and random.random() < share:
        return 0.0
    return score


def _ssh_address() -> str:
    """The address this worker's machine was reached at (sshd's ``SSH_CONNECTION``), or
    ``""`` outside an SSH session."""
    fields = os.environ.get(SSH_CONNECTION_ENV, "").split()
    return fields[2] if len(fields) == 4 else ""


def _marker_path(given: object | None) -> str | None:
    """The marker this call checks, with ``{host}`` filled in (None: no marker configured)."""
    template = given if isinstance(given, str) else os.environ.get(HANG_MARKER_ENV)
    if not template:
        return None
    return template.replace("{host}", _worker_host())


def _worker_host() -> str:
    """The ``--host`` of the worker coordinator (this pool process's parent), or ``""``."""
    if not _host_cache:
        _host_cache.append(_host_of(os.getppid()) or _host_of(os.getpid()) or "")
    return _host_cache[0]


def _host_of(pid: int) -> str | None:
    """The value after ``--host`` in ``pid``'s command line, if it has one."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    for i, arg in enumerate(argv[:-1]):
        if arg == b"--host":
            return argv[i + 1].decode("utf-8", "replace")
        if arg.startswith(b"--host="):
            return arg[len(b"--host=") :].decode("utf-8", "replace")
    return None
