"""A worker stand-in with a family, for the tests of sweeping a dead worker's session.

    python family_worker.py RECORD [--ignore-term | --term-file PATH] [--then MODULE ARGS...]

Before anything else it forks two children (``sleep``, in its own process group) and, through
the second, a grandchild in a process group of its own, in the same session: the shapes a
process pool, its resource tracker and a verifier leave behind. Then it appends one JSON line
to RECORD: its pid, its family as ``[pid, start_time]`` pairs, and which members of the
families RECORD named before were still alive when it started (a replacement must find none).
Then it becomes ``python -m MODULE ARGS`` (the reference worker; exec keeps its pid), or
sleeps. Only then does its command line name the module (``-m MODULE --root R --shard N``):
the fault monitor counts it as a worker, and not the children it forked before.

``--ignore-term``: SIGTERM is ignored (across the exec too). ``--term-file PATH``: SIGTERM
writes ``TERM`` to PATH and exits 0 (without ``--then`` only).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

#: Long enough to outlive any test: only a sweep (or the test's cleanup) ends the family.
SLEEP = ["sleep", "3600"]


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat, or None when the process is gone or a zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def alive(member: list[int]) -> bool:
    """The ``[pid, start_time]`` still runs (not gone, not a zombie, not a reused pid)."""
    return start_time(member[0]) == member[1]


def families(record: Path) -> list[dict[str, Any]]:
    """Every line RECORD holds so far."""
    try:
        text = record.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _sleeper(own_group: bool) -> int:
    """Fork a child that becomes ``sleep``; with ``own_group``, in a group of its own."""
    child = os.fork()
    if child == 0:
        if own_group:
            os.setpgid(0, 0)
        os.execvp(SLEEP[0], SLEEP)  # noqa: S606 - a fixed argv: no shell to inject into
    if own_group:
        # From the parent too, so the group is set before anyone is told the pid.
        with contextlib.suppress(OSError):  # it has exec'd already, and set it itself
            os.setpgid(child, child)
    return child


def _family() -> list[int]:
    """Fork the two children and the grandchild; their pids."""
    first = _sleeper(own_group=False)
    read_end, write_end = os.pipe()
    second = os.fork()
    if second == 0:
        os.close(read_end)
        grandchild = _sleeper(own_group=True)
        os.write(write_end, f"{grandchild}\n".encode())
        os.close(write_end)
        os.execvp(SLEEP[0], SLEEP)  # noqa: S606 - a fixed argv: no shell to inject into
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        grandchild = int(pipe.read())
    return [first, second, grandchild]


def _on_term(path: str) -> None:
    """SIGTERM writes TERM to ``path`` and ends the process with code 0."""

    def handler(signum: int, frame: object) -> None:
        Path(path).write_text("TERM\n")
        os._exit(0)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str]) -> int:
    """Fork the family, record it, then be the worker."""
    record, rest = Path(argv[0]), argv[1:]
    inherited = [m for line in families(record) for m in line["family"] if alive(m)]
    members = [[pid, start_time(pid)] for pid in _family()]
    line = {"worker": os.getpid(), "family": members, "inherited": inherited}
    with record.open("a") as out:
        out.write(json.dumps(line) + "\n")
    if rest[:1] == ["--ignore-term"]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rest = rest[1:]
    elif rest[:1] == ["--term-file"]:
        _on_term(rest[1])
        rest = rest[2:]
    if rest[:1] == ["--then"]:
        python = [sys.executable, "-m", *rest[1:]]
        os.execv(python[0], python)  # noqa: S606 - the test's own argv: no shell involved
    while True:
        time.sleep(3600)  # wait-ok: a stand-in worker idles until it is killed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
