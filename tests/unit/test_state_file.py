"""``ctl/supervisor-state.json`` as the daemon reads it back: every value validated, a bad host
entry skipped with one problem, and no content at all able to make the parser raise."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor import health
from supervisor.runfiles import (
    HISTORY_MAX_COUNT,
    HISTORY_MAX_TEXT,
    HISTORY_SKEW_S,
    HistoryEncoder,
    history_entry,
    history_from_json,
)

NOW = 1_700_000_000.0  # a wall-clock reading
OFFSET = -1_699_990_000.0  # wall + OFFSET = monotonic: the daemon's clock reads 10 000 s
POLICY = health.Policy(backoff_max_s=300.0)


def parse(raw: object) -> tuple[dict[str, health.History], list[tuple[str, str]]]:
    """``history_from_json`` at ``NOW`` under ``POLICY``."""
    return history_from_json(raw, now_wall=NOW, offset=OFFSET, policy=POLICY)


def entry(**fields: Any) -> dict[str, Any]:
    """A host entry as the daemon writes it, with ``fields`` replaced."""
    base: dict[str, Any] = {
        "failures": 2,
        "restarts": 5,
        "restart_times": [NOW - 100.0, NOW - 50.0],
        "next_restart_at": NOW + 30.0,
        "cause": "worker exited with code 1",
        "cause_code": "exited",
        "failed": None,
    }
    return base | fields


def test_a_saved_entry_loads_back_with_instants_on_our_clock() -> None:
    """What the daemon saved comes back as the same history, instants moved to monotonic."""
    history, problems = parse({"version": 1, "hosts": {"worker-0": entry()}})
    assert problems == []
    assert history == {
        "worker-0": health.History(
            failures=2,
            restarts=5,
            restart_times_at=(NOW - 100.0 + OFFSET, NOW - 50.0 + OFFSET),
            next_restart_at=NOW + 30.0 + OFFSET,
            cause="worker exited with code 1",
            cause_code=health.Cause.EXITED,
            failed=None,
        )
    }


def test_missing_optional_fields_are_an_empty_history() -> None:
    """An entry with no fields at all is a host that never failed."""
    assert parse({"hosts": {"h": {}}}) == ({"h": health.History()}, [])


def test_old_instants_and_a_restart_due_now_are_valid() -> None:
    """Restart times a week old and a next restart in the past are real histories."""
    old = entry(restart_times=[NOW - 7 * 86400], next_restart_at=NOW - 5)
    history, problems = parse({"hosts": {"h": old}})
    assert problems == []
    assert history["h"].next_restart_at == NOW - 5 + OFFSET


def test_the_limits_themselves_are_accepted() -> None:
    """A restart time at the skew allowance and a next restart at backoff_max_s beyond it,
    and counts at the maximum, load."""
    edge = entry(
        restart_times=[NOW + HISTORY_SKEW_S],
        next_restart_at=NOW + HISTORY_SKEW_S + POLICY.backoff_max_s,
        failures=HISTORY_MAX_COUNT,
        cause="x" * HISTORY_MAX_TEXT,
    )
    history, problems = parse({"hosts": {"h": edge}})
    assert problems == []
    assert history["h"].failures == HISTORY_MAX_COUNT


BAD_ENTRIES: list[tuple[str, Any, str]] = [
    ("NaN next restart", entry(next_restart_at=math.nan), "next_restart_at nan"),
    ("infinite next restart", entry(next_restart_at=math.inf), "next_restart_at inf"),
    ("a year away", entry(next_restart_at=NOW + 365 * 86400), "within backoff_max_s (300s)"),
    (
        "just past backoff_max_s",
        entry(next_restart_at=NOW + HISTORY_SKEW_S + POLICY.backoff_max_s + 1),
        "not a finite time within backoff_max_s",
    ),
    ("a string instant", entry(next_restart_at="soon"), "next_restart_at 'soon'"),
    ("NaN restart time", entry(restart_times=[NOW, math.nan]), "restart_times holds nan"),
    ("future restart time", entry(restart_times=[NOW + 3600]), "not a finite time in the past"),
    ("-inf restart time", entry(restart_times=[-math.inf]), "restart_times holds -inf"),
    ("a 5000-digit time", entry(restart_times=[10**5000]), "holds an int too big to show"),
    ("true as a time", entry(restart_times=[True]), "restart_times holds True"),
    ("a nested time", entry(restart_times=[[NOW]]), "restart_times holds [1700000000.0]"),
    ("times not a list", entry(restart_times={"a": 1}), "restart_times must be a list"),
    ("1e999 failures", entry(failures=math.inf), "failures must be an integer"),
    ("negative failures", entry(failures=-1), "not -1"),
    ("float failures", entry(failures=2.0), "not 2.0"),
    ("boolean failures", entry(failures=True), "not True"),
    ("string failures", entry(failures="3"), "not '3'"),
    ("huge restarts", entry(restarts=10**400), "restarts must be an integer"),
    ("cause not text", entry(cause=5), "cause must be null or a string"),
    ("unknown cause code", entry(cause_code="bored"), "cause_code must be null or one of"),
    ("cause code not text", entry(cause_code=[1]), "not [1]"),
    ("failed too long", entry(failed="x" * (HISTORY_MAX_TEXT + 1)), "failed must be null"),
    ("entry not an object", [1, 2], "not an object"),
]


@pytest.mark.parametrize(
    ("bad", "problem"), [(b, p) for _, b, p in BAD_ENTRIES], ids=[w for w, _, _ in BAD_ENTRIES]
)
def test_a_bad_entry_is_one_problem_and_the_others_still_load(bad: Any, problem: str) -> None:
    """One host's entry with an impossible value is skipped with one problem naming the host
    and the value; the other host's history loads as written."""
    history, problems = parse({"hosts": {"bad": bad, "good": entry()}})
    assert set(history) == {"good"}
    assert len(problems) == 1
    host, text = problems[0]
    assert host == "bad"
    assert problem in text


@pytest.mark.parametrize(
    "raw", [None, [], "hosts", 7, {"hosts": []}, {"hosts": None}, {"version": 1}]
)
def test_a_file_without_a_hosts_object_is_no_history(raw: object) -> None:
    """A state file whose top level is not ``{"hosts": {...}}`` loads nothing, with one
    problem."""
    assert parse(raw) == ({}, [("*", "no 'hosts' object")])


# --- fuzz ----------------------------------------------------------------------------

#: Any JSON value, and a few things JSON cannot say but a buggy writer could pass in.
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
#: Entries shaped like the daemon's, each field drawn from anything.
fields = st.sampled_from(
    [
        "failures",
        "restarts",
        "restart_times",
        "next_restart_at",
        "cause",
        "cause_code",
        "failed",
        "other",
    ]
)
entries = st.dictionaries(fields, values | st.lists(scalars, max_size=5), max_size=7)
state_files = st.fixed_dictionaries(
    {"hosts": st.dictionaries(st.text(max_size=10), entries | values, max_size=5)}
)


def check_accepted(history: dict[str, health.History]) -> None:
    """Every history that loaded holds only values the daemon could have written."""
    for h in history.values():
        assert 0 <= h.failures <= HISTORY_MAX_COUNT and 0 <= h.restarts <= HISTORY_MAX_COUNT
        for t in h.restart_times_at:
            assert math.isfinite(t) and t <= NOW + HISTORY_SKEW_S + OFFSET
        if h.next_restart_at is not None:
            assert math.isfinite(h.next_restart_at)
            assert h.next_restart_at <= NOW + HISTORY_SKEW_S + POLICY.backoff_max_s + OFFSET
        for text in (h.cause, h.failed):
            assert text is None or (isinstance(text, str) and len(text) <= HISTORY_MAX_TEXT)


@given(values)
def test_history_parser_never_raises_on_any_value(raw: object) -> None:
    """Whatever JSON (or near-JSON) value the file holds, the parser returns; what it
    accepts is in range."""
    history, problems = parse(raw)
    check_accepted(history)
    assert all(isinstance(host, str) and text for host, text in problems)


@given(state_files)
def test_history_parser_never_raises_on_any_entry(raw: dict[str, Any]) -> None:
    """Entries with every field of every type, huge, NaN or nested: one result or one problem
    per host, never an exception, and what loads is in range."""
    history, problems = parse(raw)
    check_accepted(history)
    assert len(history) + len(problems) == len(raw["hosts"])


# --- writing: the daemon's encoder ------------------------------------------------------

MONO_NOW = 10_000.0  # the daemon's monotonic clock as it saves
histories = st.builds(
    health.History,
    failures=st.integers(0, 50),
    restarts=st.integers(0, 50),
    restart_times_at=st.lists(st.floats(MONO_NOW - 3000, MONO_NOW), max_size=3).map(tuple),
    next_restart_at=st.none() | st.floats(MONO_NOW, MONO_NOW + 200),
    cause=st.none() | st.text(max_size=20),
    cause_code=st.none() | st.sampled_from(list(health.Cause)),
    failed=st.none() | st.text(max_size=20),
)
host_names = st.sampled_from(["worker-0", "worker-1", 'w\u00e9"2', "3"])
#: One save: hosts whose history is new (or that joined), hosts that left, the offset.
saves = st.tuples(
    st.dictionaries(host_names, histories, max_size=4),
    st.lists(host_names, max_size=2),
    st.sampled_from([NOW - MONO_NOW, NOW - MONO_NOW + 0.0001, NOW - MONO_NOW + 3600.0]),
)


def encode(
    encoder: HistoryEncoder, current: dict[str, health.History], wall_minus_mono: float
) -> Any:
    """One save through ``encoder``, parsed back as JSON."""
    data = encoder.encode(
        current, wall_minus_mono=wall_minus_mono, saved_at=NOW, hostname="node-1", version=1
    )
    assert data.endswith(b"}\n")
    return json.loads(data)


@given(st.lists(saves, min_size=1, max_size=8))
def test_each_save_is_the_whole_history_however_little_changed(
    sequence: list[tuple[dict[str, health.History], list[str], float]],
) -> None:
    """An encoder that keeps unchanged hosts' lines writes, at every save, exactly what a
    fresh one writes: changed, joined and departed hosts and a stepped wall clock included."""
    kept = HistoryEncoder()
    current: dict[str, health.History] = {}
    for changed, left, offset in sequence:
        current = {n: h for n, h in current.items() if n not in left} | changed
        written = encode(kept, current, offset)
        assert written == encode(HistoryEncoder(), current, offset)
        assert written["version"] == 1 and written["saved_at"] == NOW
        assert written["hostname"] == "node-1"
        assert written["hosts"] == {
            name: history_entry(h, round(offset, 3)) for name, h in current.items()
        }


@given(st.dictionaries(host_names, histories, max_size=4))
def test_what_the_encoder_writes_loads_back(current: dict[str, health.History]) -> None:
    """Written at one offset and read at the same instant: the same histories, to the
    millisecond the offset is rounded to."""
    offset = NOW - MONO_NOW + 0.0004
    written = encode(HistoryEncoder(), current, offset)
    policy = health.Policy(backoff_max_s=300.0)
    loaded, problems = history_from_json(
        written, now_wall=NOW + 0.0004, offset=-offset, policy=policy
    )
    assert problems == [] and loaded.keys() == current.keys()
    for name, h in current.items():
        back = loaded[name]
        assert back.restart_times_at == pytest.approx(h.restart_times_at, abs=0.002)
        assert (back.next_restart_at is None) == (h.next_restart_at is None)
        if h.next_restart_at is not None:
            assert back.next_restart_at == pytest.approx(h.next_restart_at, abs=0.002)
        assert (back.failures, back.restarts, back.cause, back.cause_code, back.failed) == (
            h.failures,
            h.restarts,
            h.cause,
            h.cause_code,
            h.failed,
        )
