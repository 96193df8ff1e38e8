"""A hostile stand-in for the remote agent: a seeded fuzzer that answers the daemon's JSON-lines
protocol with garbage, then, its budget spent, refuses every launch with a fixed reason.

Run as ``python hostile_agent.py STATE SEED BUDGET`` in place of ``worker.python``'s agent
(``tests/faults/test_hostile_host.py`` puts it behind a dispatcher that picks it for one host).
Every agent process continues one seeded sequence: ``STATE`` holds the number of garbage items
sent so far across processes, so a session that ends (a channel closed mid-line, a crash)
does not restart the sequence, and the whole run is bounded by ``BUDGET`` items. Stdlib only.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import sys
from collections.abc import Callable
from typing import BinaryIO

#: What the host says once its budget is spent; an escape sequence and a bell ride along, so
#: the test can check they reach an operator's terminal escaped.
REFUSAL = "hostile agent: fuzz budget spent \x1b[31mRED\x1b[0m\x07"
#: Lines this long exceed every buffer the daemon has (asyncssh's window is 2 MiB).
HUGE = 10 * 1024 * 1024
#: At most this many huge lines in a run: each costs ~0.2 s of ssh encryption on both ends.
MAX_HUGE = 3

Line = bytes


class Budget:
    """The run-wide count of garbage items, kept in ``STATE`` under an exclusive lock."""

    def __init__(self, path: str, limit: int) -> None:
        """Open (or create) the state file."""
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.limit = limit

    def take(self, n: int = 1) -> int | None:
        """Reserve ``n`` items; the index of the first, or None once the budget is spent."""
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            text = os.pread(self._fd, 64, 0).decode() or "0 0"
            used, huge = (int(x) for x in text.split())
            if used >= self.limit:
                return None
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{used + n} {huge}".encode(), 0)
            return used
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def take_huge(self) -> bool:
        """Whether one more huge line is allowed in this run (and count it)."""
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            text = os.pread(self._fd, 64, 0).decode() or "0 0"
            used, huge = (int(x) for x in text.split())
            if huge >= MAX_HUGE:
                return False
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{used} {huge + 1}".encode(), 0)
            return True
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)


def weird_id(rng: random.Random, rid: int) -> bytes:
    """An ``id`` value that is not one of ours: float, huge, negative, string, not a number."""
    choices: list[Callable[[], bytes]] = [
        lambda: b"1e999",
        lambda: b"-1e999",
        lambda: b"%d.0" % rid,
        lambda: b"%d.5" % rid,
        lambda: b'"%d"' % rid,
        lambda: b"-%d" % rid,
        lambda: b"0",
        lambda: b"true",
        lambda: b"null",
        lambda: b"NaN",
        lambda: b"Infinity",
        lambda: b"9" * rng.choice((19, 20, 400, 4300, 5000)),
        lambda: b"[%d]" % rid,
        lambda: b'{"id": %d}' % rid,
        lambda: b"%d" % (rid + rng.randrange(1, 10**6)),  # an id nobody is waiting for
        lambda: b"%d" % (2**63 + rid),
    ]
    return rng.choice(choices)()


def bad_text(rng: random.Random) -> str:
    """Text with control characters, escapes, bidi overrides, NULs and lone surrogates."""
    pieces = [
        "\x1b[2J\x1b[H",
        "\x1b]0;owned\x07",
        "\x1b[31m",
        "\r",
        "\n",
        "\t",
        "\x00",
        "\x7f",
        "\u202e",
        "\u2028",
        "\ud800",
        "\x9b",
        "ok",
        " ",
        "é",
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))


def dumps(value: object) -> bytes:
    """JSON with lone surrogates escaped (as a hostile encoder may emit them)."""
    return json.dumps(value).encode()


def bad_result(rng: random.Random) -> object:
    """A ``result`` whose fields have the wrong types or absurd values. Rarely a positive int:
    the daemon then rightly waits ``ready_timeout_s`` for a worker that never reports, which
    tests nothing new and costs the run that long."""
    value: object = rng.choice(
        [1e999, -1, 0, 1.5, "31337", True, None, [1], {"x": 1}, -(10**30), -(2**63)]
    )
    if rng.randrange(40) == 0:
        value = rng.choice((1, 10**30, 2**63))
    key = rng.choice(["pid", "start_time", "outcome"])
    return rng.choice([{key: value}, [value], value, {"pid": -1, "start_time": value}])


def garbage(rng: random.Random, rid: int, budget: Budget) -> Line:
    """One line (without its newline) that is not a valid reply to request ``rid``."""
    kind = rng.randrange(16)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
    if kind == 1:
        return b'{"id": ' + weird_id(rng, rid) + b', "ok": true, "result": {"pid": null}}'
    if kind == 2:
        depth = rng.choice((998, 1000, 1001, 5000, 60000, 200000))
        opener = rng.choice((b"[", b'{"a":', b'{"id": 1, "r": ['))
        return opener * depth
    if kind == 3:
        if budget.take_huge():
            return rng.choice((b"x", b"[", b"\xff", b"\x00")) * HUGE
        return b"x" * 70000
    if kind == 4:
        return b'{"id": %d, "ok": true, "result": {"pid": null}}' % (rid + 1000)
    if kind == 5:
        return rng.choice((b"\x00", b"\x00{\x00}", b'{"id": 1\x00}', b"\x00" * 1000))
    if kind == 6:
        return rng.choice(
            (b"\xff\xfe{", b"\xc0\xaf", b"\xed\xa0\x80", b'{"id": "\xff"}', b"\x80" * 100)
        )
    if kind == 7:
        return dumps({"hello": {"pid": bad_result(rng), "python": bad_text(rng)}})
    if kind == 8:
        return rng.choice((b"null", b"[]", b"{}", b"1", b'"x"', b"{", b"}", b"", b" "))
    if kind == 9:
        return b'{"id": %d, "id": "x"}' % rid
    if kind == 10:
        return dumps({"id": rid + 1, "ok": True, "result": bad_result(rng)})
    if kind == 11:
        return dumps({"id": bad_text(rng), "error": bad_text(rng)})
    if kind == 12:
        return ("\x1b[2J" + bad_text(rng) * 50).encode("utf-8", "surrogatepass")
    if kind == 13:
        return b'{"id": %d, "ok": true, "result": ' % (rid + 7) + b"[" * 3000
    if kind == 14:
        return dumps({f"k{i}": i for i in range(rng.choice((10, 3000, 7000)))})
    return b'{"id": ' + b"1" * 4301 + b', "ok": true}'


def ending(rng: random.Random, rid: int, op: str) -> tuple[Line | None, bool]:
    """How request ``rid`` ends: a reply line (or None) and whether the process then exits
    (a channel closed mid-line when the line has no newline)."""
    kind = rng.randrange(10)
    if kind <= 2:
        return dumps({"id": rid, "ok": False, "kind": "error", "error": bad_text(rng)}), False
    if kind == 3:
        holder = rng.choice([None, 1, -5, 1.5, "7", 10**30, True])
        reply = {"id": rid, "ok": False, "kind": "refused", "error": bad_text(rng)}
        return dumps({**reply, "holder_pid": holder}), False
    if kind == 4:
        return dumps({"id": rid, "ok": True, "result": bad_result(rng)}), False
    if kind == 5:
        return dumps({"id": rid, "ok": rng.choice(["yes", 1, None]), "error": 5}), False
    if kind == 6 and op == "probe":
        return dumps({"id": rid, "ok": True, "result": {"pid": None}}), False
    if kind == 7:
        whole = dumps({"id": rid, "ok": True, "result": {"pid": None}})
        return whole[: rng.randrange(1, len(whole))], True  # closes mid-line
    if kind == 8:
        return None, True  # closes with the request unanswered
    return dumps({"id": rid, "ok": False, "error": bad_text(rng) * 200}), False


def write_line(out: BinaryIO, line: Line, *, newline: bool = True) -> None:
    """Write ``line`` (and its newline) and flush."""
    out.write(line + (b"\n" if newline else b""))
    out.flush()


def refuse_forever(out: BinaryIO) -> int:
    """Budget spent: a plain hello, then ``refusal`` for every request."""
    write_line(out, dumps({"hello": {"pid": os.getpid(), "python": "hostile"}}))
    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
            rid, op = request["id"], request["op"]
        except (ValueError, KeyError, TypeError):
            continue
        write_line(out, refusal(rid, op))
    return 0


def refusal(rid: object, op: object) -> Line:
    """The reply once the budget is spent: every launch refused with ``REFUSAL``; probes find
    no worker and terminates say it is gone, so the daemon's shutdown need not wait out its
    deadline for a host that can never confirm one."""
    if op in ("probe", "terminate"):
        return dumps({"id": rid, "ok": True, "result": {"pid": None, "outcome": "gone"}})
    return dumps({"id": rid, "ok": False, "kind": "error", "error": REFUSAL})


def main(argv: list[str]) -> int:
    """Fuzz until the budget is spent or the session ends."""
    state, seed, limit = argv[0], int(argv[1]), int(argv[2])
    budget = Budget(state, limit)
    out, err = sys.stdout.buffer, sys.stderr.buffer
    start = budget.take(4)
    if start is None:
        return refuse_forever(out)
    rng = random.Random(seed * 1_000_003 + start)
    # Before the hello: replies nobody asked for, garbage, a flood on stderr.
    for _ in range(rng.randrange(0, 4)):
        write_line(out, rng.choice((b'{"id": 1, "ok": true, "result": {}}', b"\x1b[2J", b"[[[")))
    for _ in range(rng.choice((0, 0, 5, 300))):
        write_line(err, bad_text(rng).encode("utf-8", "surrogatepass"))
    if rng.randrange(8) == 0:
        write_line(out, b'{"hello": {"pid": 1', newline=False)
        return 3  # dies before its hello is whole
    write_line(out, dumps({"hello": {"pid": os.getpid(), "python": bad_text(rng)}}))
    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
            rid, op = int(request["id"]), str(request["op"])
        except (ValueError, KeyError, TypeError):
            continue
        n = rng.randrange(1, 12)
        first = budget.take(n)
        if first is None:
            write_line(out, refusal(rid, op))
            continue
        rng = random.Random(seed * 1_000_003 + first)
        for _ in range(n):
            target = err if rng.randrange(4) == 0 else out
            write_line(target, garbage(rng, rid, budget))
        line, close = ending(rng, rid, op)
        if line is not None:
            write_line(out, line, newline=not close)
        if close:
            return rng.choice((0, 1, 137))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
