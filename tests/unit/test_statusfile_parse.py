"""Parsing heartbeat and exit files: every byte string is a record or a reason, never a crash."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.health import WorkerStats
from supervisor.statusfiles import (
    MAX_FILE_BYTES,
    MAX_REAPED,
    ExitRecord,
    StatusProblem,
    StatusRecord,
    parse_exit,
    parse_status,
    read_exit,
    read_status,
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = (
    json_scalars
    | st.lists(json_scalars, max_size=3)
    | st.dictionaries(st.text(max_size=6), json_scalars, max_size=3)
)
#: Objects shaped like heartbeats: the real field names with values of any JSON type.
heartbeat_like = st.fixed_dictionaries(
    {},
    optional={
        "pid": json_values,
        "ready": json_values,
        "heartbeat_at": json_values,
        "seq": json_values,
        "host": json_values,
    },
)


def _dump(obj: Any) -> bytes:
    """``obj`` as JSON bytes, as a worker writes it."""
    return json.dumps(obj).encode()


def test_a_worker_heartbeat_parses_into_its_fields() -> None:
    """The reference worker's heartbeat yields pid, ready, heartbeat_at, seq; extras are ignored."""
    data = _dump(
        {
            "ready": True,
            "heartbeat_at": 1767225600.25,
            "pid": 4242,
            "seq": 17,
            "host": "worker-0",
            "processed": 9,
        }
    )
    assert parse_status(data) == StatusRecord(
        pid=4242, ready=True, heartbeat_at=1767225600.25, seq=17, processed=9
    )


@pytest.mark.parametrize("bad", ["9", -1, True, 1.5, None, [3]])
def test_progress_fields_of_the_wrong_type_are_not_reported_and_the_heartbeat_stands(
    bad: object,
) -> None:
    """A bad ``processed`` or ``in_flight`` is "not reported": it never hides a heartbeat."""
    data = _dump({"pid": 7, "heartbeat_at": 1.0, "processed": bad, "in_flight": bad})
    assert parse_status(data) == StatusRecord(pid=7, ready=False, heartbeat_at=1.0, seq=None)
    good = _dump({"pid": 7, "heartbeat_at": 1.0, "processed": 0, "in_flight": 4})
    assert parse_status(good) == StatusRecord(
        pid=7, ready=False, heartbeat_at=1.0, seq=None, processed=0, in_flight=4
    )


#: A heartbeat exactly as ``areal.reward.fs_worker`` writes it (../shared/areal-fs).
AREAL_HEARTBEAT: Final = {
    "host": "worker-0",
    "shard": 0,
    "ready": True,
    "heartbeat_at": 1796467978.0040958,
    "started_at": 1796467976.9283412,
    "pid": 14074,
    "concurrency": 48,
    "inflight": 5,
    "queue_depth": 12,
    "qps": 3.2,
    "completed": 1200,
    "errors": 34,
    "semantic_zero": 410,
    "verify_timeout_n": 0,
    "queue_wait_ms_p50": None,
    "queue_wait_ms_p95": 17.0,
    "verify_ms_p50": None,
    "verify_ms_p95": 2000.5,
    "rss_gib": 1.25,
}


def test_the_areal_worker_s_heartbeat_gives_progress_and_its_figures() -> None:
    """The real worker's fields: finished = completed + errors, in flight = inflight, and the
    figures it reports of its work carried as they are."""
    record = parse_status(_dump(AREAL_HEARTBEAT))
    assert isinstance(record, StatusRecord)
    assert (record.pid, record.ready, record.processed, record.in_flight) == (14074, True, 1234, 5)
    assert record.stats == WorkerStats(
        completed=1200,
        errors=34,
        queue_depth=12,
        qps=3.2,
        concurrency=48,
        rss_gib=1.25,
        verify_ms_p95=2000.5,
        semantic_zero=410,
    )


def test_errors_alone_are_progress_a_stuck_worker_advances_neither_count() -> None:
    """A worker whose every task fails still finishes tasks (its ``errors`` grow); one with
    neither count reported falls back to the older ``processed``."""
    only_errors = parse_status(_dump({"pid": 7, "heartbeat_at": 1.0, "errors": 3, "inflight": 0}))
    assert isinstance(only_errors, StatusRecord)
    assert (only_errors.processed, only_errors.in_flight) == (3, 0)
    older = parse_status(_dump({"pid": 7, "heartbeat_at": 1.0, "processed": 9, "in_flight": 2}))
    assert isinstance(older, StatusRecord)
    assert (older.processed, older.in_flight, older.stats) == (9, 2, None)


@pytest.mark.parametrize("bad", ["9", -1, True, None, [3], 1e300, float("nan")])
def test_figures_of_the_wrong_kind_are_not_reported_and_the_heartbeat_stands(bad: object) -> None:
    """A figure that is not a number of its kind (a count that is negative or not an integer,
    a measure past any real one) is left out, never a problem that hides the heartbeat."""
    obj = {k: bad for k in ("completed", "errors", "inflight", "queue_depth", "qps", "rss_gib")}
    record = parse_status(_dump({"pid": 7, "heartbeat_at": 1.0, "ready": True, **obj}))
    assert isinstance(record, StatusRecord)
    assert (record.ready, record.processed, record.in_flight, record.stats) == (
        True,
        None,
        None,
        None,
    )


def test_seed_style_heartbeat_without_ready_or_seq_is_not_ready() -> None:
    """A heartbeat without ``ready`` counts as not ready and one without ``seq`` has seq None."""
    assert parse_status(_dump({"pid": 7, "heartbeat_at": 12})) == StatusRecord(
        pid=7, ready=False, heartbeat_at=12.0, seq=None
    )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"  \n\t", "empty"),
        (b'{"ready": true, "heartbeat_at": 1.5, "pi', "not JSON"),
        (b"hello", "not JSON"),
        (b"\xff\xfe\x00binary\x80", "not UTF-8"),
        (b"[" * 50_000 + b"]" * 50_000, "too big"),
        (b"[" * 30_000 + b"]" * 30_000, "not JSON"),
        (b"[1, 2]", "not an object"),
        (b'"text"', "not an object"),
        (b"42", "not an object"),
        (b"null", "not an object"),
        (_dump({"heartbeat_at": 1.0}), "missing pid"),
        (_dump({"pid": True, "heartbeat_at": 1.0}), "bad pid"),
        (_dump({"pid": 0, "heartbeat_at": 1.0}), "bad pid"),
        (_dump({"pid": -3, "heartbeat_at": 1.0}), "bad pid"),
        (_dump({"pid": "12", "heartbeat_at": 1.0}), "bad pid"),
        (_dump({"pid": 12.0, "heartbeat_at": 1.0}), "bad pid"),
        (_dump({"pid": 12}), "missing heartbeat_at"),
        (_dump({"pid": 12, "heartbeat_at": "1.0"}), "bad heartbeat_at"),
        (_dump({"pid": 12, "heartbeat_at": None}), "bad heartbeat_at"),
        (_dump({"pid": 12, "heartbeat_at": False}), "bad heartbeat_at"),
        (b'{"pid": 12, "heartbeat_at": NaN}', "bad heartbeat_at"),
        (b'{"pid": 12, "heartbeat_at": Infinity}', "bad heartbeat_at"),
        (b'{"pid": 12, "heartbeat_at": ' + b"9" * 400 + b"}", "bad heartbeat_at"),
        (_dump({"pid": 12, "heartbeat_at": 1.0, "ready": "yes"}), "bad ready"),
        (_dump({"pid": 12, "heartbeat_at": 1.0, "ready": 1}), "bad ready"),
        (_dump({"pid": 12, "heartbeat_at": 1.0, "seq": "3"}), "bad seq"),
        (_dump({"pid": 12, "heartbeat_at": 1.0, "seq": 3.5}), "bad seq"),
    ],
)
def test_unusable_status_bytes_give_a_stable_reason(data: bytes, reason: str) -> None:
    """Each kind of broken heartbeat is a StatusProblem with a short, content-independent reason."""
    assert parse_status(data) == StatusProblem(reason)


@given(st.binary(max_size=2048))
def test_parse_status_never_raises_on_any_bytes(data: bytes) -> None:
    """Arbitrary bytes always give a StatusRecord or a StatusProblem."""
    assert isinstance(parse_status(data), StatusRecord | StatusProblem)


@given(heartbeat_like)
def test_parse_status_accepts_exactly_well_typed_heartbeats(obj: dict[str, Any]) -> None:
    """A heartbeat-shaped object parses iff every field the supervisor uses is well typed."""
    result = parse_status(json.dumps(obj).encode())
    pid: Any = obj.get("pid")
    beat: Any = obj.get("heartbeat_at")
    well_typed = (
        type(pid) is int
        and pid > 0
        and type(beat) in (int, float)
        and math.isfinite(beat)
        and type(obj.get("ready", False)) is bool
        and (obj.get("seq") is None or type(obj.get("seq")) is int)
    )
    if well_typed:
        assert result == StatusRecord(
            pid=pid,
            ready=obj.get("ready", False),
            heartbeat_at=float(beat),
            seq=obj.get("seq"),
        )
    else:
        assert isinstance(result, StatusProblem)


@given(
    pid=st.integers(min_value=1, max_value=2**22),
    ready=st.booleans(),
    beat=st.floats(allow_nan=False, allow_infinity=False),
    seq=st.none() | st.integers(min_value=0),
)
def test_any_valid_heartbeat_round_trips(
    pid: int, ready: bool, beat: float, seq: int | None
) -> None:
    """Whatever a worker may write, including negative or skewed stamps, reads back unchanged."""
    data = _dump({"pid": pid, "ready": ready, "heartbeat_at": beat, "seq": seq})
    assert parse_status(data) == StatusRecord(pid=pid, ready=ready, heartbeat_at=beat, seq=seq)


def test_an_exit_record_parses_into_its_fields() -> None:
    """The shepherd's exit record yields pid, exit code, signal and exit time."""
    data = _dump(
        {"pid": 99, "exit_code": None, "signal": 9, "exited_at": 1767225600.5, "start_time": 5}
    )
    assert parse_exit(data) == ExitRecord(pid=99, exit_code=None, signal=9, exited_at=1767225600.5)


def test_an_exit_record_s_log_tail_is_kept_to_its_last_characters() -> None:
    """The shepherd's log tail is text, kept to its end; any other type is dropped."""
    tail = "x" * 10_000 + "\nModuleNotFoundError: No module named 'x'\n"
    record = parse_exit(_dump({"pid": 5, "exit_code": 2, "log_tail": tail}))
    assert record is not None and record.log_tail is not None
    assert record.log_tail.endswith("No module named 'x'\n") and len(record.log_tail) == 4096
    record = parse_exit(_dump({"pid": 5, "exit_code": 2, "log_tail": ["no"]}))
    assert record is not None and record.log_tail is None


@pytest.mark.parametrize(
    ("reaped", "read"),
    [
        (49, 49),
        (0, 0),
        (MAX_REAPED, MAX_REAPED),
        (MAX_REAPED + 1, None),
        (-1, None),
        (True, None),
        ("49", None),
        (49.0, None),
        (None, None),
        (10**400, None),
    ],
)
def test_an_exit_record_s_reaped_count_is_kept_when_it_is_a_count_of_pids(
    reaped: object, read: int | None
) -> None:
    """How many processes of its session the shepherd killed: an int from 0 to the most pids
    there can be; anything else is not said (None), and the exit still counts."""
    record = parse_exit(_dump({"pid": 5, "signal": 9, "reaped": reaped}))
    assert record is not None and record.pid == 5
    assert record.reaped == read


def test_exit_record_with_odd_optional_fields_still_confirms_the_pid() -> None:
    """Wrongly typed optional fields become None, because the pid alone confirms the exit."""
    data = _dump({"pid": 99, "exit_code": "1", "signal": True, "exited_at": "never"})
    assert parse_exit(data) == ExitRecord(pid=99, exit_code=None, signal=None, exited_at=None)


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[]", _dump({"exit_code": 0}), _dump({"pid": "99"}), _dump({"pid": 0})],
)
def test_exit_bytes_without_a_usable_pid_are_none(data: bytes) -> None:
    """An exit record is only useful with a positive integer pid; otherwise it is None."""
    assert parse_exit(data) is None


@given(st.binary(max_size=2048) | heartbeat_like.map(_dump))
def test_parse_exit_never_raises(data: bytes) -> None:
    """Arbitrary bytes always give an ExitRecord or None."""
    assert parse_exit(data) is None or isinstance(parse_exit(data), ExitRecord)


def test_reading_a_missing_status_file_is_the_missing_problem(tmp_path: Path) -> None:
    """A status file that does not exist (or whose directory does not) reads as "missing"."""
    assert read_status(tmp_path / "h.json") == StatusProblem("missing")
    assert read_status(tmp_path / "no-dir" / "h.json") == StatusProblem("missing")
    assert read_exit(tmp_path / "h.exit.json") is None


def test_a_huge_status_file_is_too_big_without_reading_it_all(tmp_path: Path) -> None:
    """A 10 MB status file is StatusProblem("too big"), as is anything past the cap."""
    path = tmp_path / "h.json"
    path.write_bytes(b" " * (10 * 1024 * 1024))
    assert read_status(path) == StatusProblem("too big")
    path.write_bytes(_dump({"pid": 1, "heartbeat_at": 1, "pad": "x" * MAX_FILE_BYTES}))
    assert read_status(path) == StatusProblem("too big")
    assert read_exit(path) is None


def test_a_status_file_just_under_the_cap_is_read_whole(tmp_path: Path) -> None:
    """Padding a heartbeat up to the cap still parses: the cap does not cut valid files."""
    path = tmp_path / "h.json"
    head = _dump({"pid": 1, "heartbeat_at": 2, "pad": ""})[:-2]
    pad = MAX_FILE_BYTES - len(head) - 2
    path.write_bytes(head + b"x" * pad + b'"}')
    assert path.stat().st_size == MAX_FILE_BYTES
    assert read_status(path) == StatusRecord(pid=1, ready=False, heartbeat_at=2.0, seq=None)


def test_a_fifo_under_a_status_name_does_not_block_the_reader(tmp_path: Path) -> None:
    """A FIFO (or directory) where a status file should be is a problem, read without blocking."""
    fifo = tmp_path / "h.json"
    os.mkfifo(fifo)
    assert read_status(fifo) == StatusProblem("not a regular file")
    (tmp_path / "d.json").mkdir()
    assert read_status(tmp_path / "d.json") == StatusProblem("not a regular file")


def test_reading_files_parses_them(tmp_path: Path) -> None:
    """read_status and read_exit return what parse_status and parse_exit make of the bytes."""
    status = tmp_path / "h.json"
    status.write_bytes(_dump({"pid": 3, "heartbeat_at": 4.5, "ready": True, "seq": 0}))
    assert read_status(status) == StatusRecord(pid=3, ready=True, heartbeat_at=4.5, seq=0)
    exit_file = tmp_path / "h.exit.json"
    exit_file.write_bytes(_dump({"pid": 3, "exit_code": 7}))
    assert read_exit(exit_file) == ExitRecord(pid=3, exit_code=7, signal=None, exited_at=None)
