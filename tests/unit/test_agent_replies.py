"""The parser of agent replies: any line a host sends is an answer or noise, never a crash."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.errors import RemoteError
from supervisor.remote import (
    MAX_REPLY_CHARS,
    PID_MAX,
    TokenBucket,
    host_text,
    parse_reply,
    reply_int,
)


@pytest.mark.parametrize(
    "line",
    [
        '{"id": 1e999}',
        '{"id": -1e999}',
        '{"id": NaN}',
        '{"id": 1.0}',
        '{"id": "1"}',
        '{"id": true}',
        '{"id": -3}',
        '{"id": 0}',
        '{"id": null}',
        "{}",
        "[1]",
        '"1"',
        "7",
        "null",
        "[" * 200_000,
        "[" * 50_000,
        '{"id": 1, "x": ' + "[" * 50_000,
        '{"id": 1, "x": ' + "[" * 20_000 + "]" * 20_000 + "}",
        '{"a":' * 100_000,
        '{"id": ' + "9" * 5000 + "}",
        "\x00\x00",
        "\ufffd\ufffd{",
        "",
        '{"id": 1' + " " * MAX_REPLY_CHARS + "}",
    ],
)
def test_hostile_lines_are_noise(line: str) -> None:
    """Floats, huge, negative or string ids, deep nesting, huge numbers, NUL and overlong
    lines are not replies, and parsing them raises nothing."""
    assert parse_reply(line) is None


def test_a_reply_with_a_positive_int_id_is_returned_whole() -> None:
    """A well-formed reply comes back with its id and every field."""
    line = json.dumps({"id": 7, "ok": True, "result": {"pid": 42}})
    assert parse_reply(line) == (7, {"id": 7, "ok": True, "result": {"pid": 42}})


@given(st.text(max_size=2000))
def test_any_text_parses_or_is_noise(line: str) -> None:
    """Arbitrary text never makes the parser raise, and what it accepts has a positive int id."""
    parsed = parse_reply(line)
    if parsed is not None:
        rid, reply = parsed
        assert type(rid) is int and rid > 0 and reply["id"] == rid


@given(
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=30,
    )
)
def test_any_json_value_as_id_parses_or_is_noise(value: object) -> None:
    """Whatever JSON value a host puts in ``id``, only a positive int makes a reply."""
    parsed = parse_reply(json.dumps({"id": value}))
    assert (parsed is not None) == (type(value) is int and value > 0)


@pytest.mark.parametrize("value", [1e999, 1.5, "12", [1], {"a": 1}, True])
def test_result_fields_of_the_wrong_type_are_a_remote_error(value: object) -> None:
    """A pid that is not an int is the host's error, reported as RemoteError naming the field."""
    with pytest.raises(RemoteError, match="'pid'"):
        reply_int("worker-0", "probe", {"pid": value}, "pid")


def test_absent_or_null_result_fields_are_none_and_ints_pass() -> None:
    """A missing or null field is None; an int is returned as it is."""
    assert reply_int("h", "probe", {}, "pid") is None
    assert reply_int("h", "probe", {"pid": None}, "pid") is None
    assert reply_int("h", "probe", {"pid": 12}, "pid") == 12


@pytest.mark.parametrize(
    ("key", "value"), [("pid", 0), ("pid", -1), ("pid", PID_MAX + 1), ("pid", 10**30)]
)
def test_pids_out_of_range_are_a_remote_error(key: str, value: int) -> None:
    """A pid no Linux kernel can hand out is the host's error, never passed on."""
    with pytest.raises(RemoteError, match="out of range"):
        reply_int("worker-0", "probe", {key: value}, key, low=1, high=PID_MAX)


def test_a_huge_int_is_not_echoed_whole() -> None:
    """An int of thousands of digits is described by its size, not printed into the reason."""
    with pytest.raises(RemoteError) as failed:
        reply_int("h", "launch", {"pid": 10**4000}, "pid", high=PID_MAX)
    assert len(failed.value.reason) < 200


@given(st.text(max_size=1000))
def test_host_text_is_bounded_and_always_encodes(text: str) -> None:
    """Whatever a host sends as text (lone surrogates included) comes back bounded and
    encodable as UTF-8, and unchanged when it already was."""
    cleaned = host_text(text, 100)
    assert cleaned is not None and len(cleaned) == min(len(text), 100)
    cleaned.encode("utf-8")
    if all(not 0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert cleaned == text[:100]


def test_host_text_of_a_non_string_is_none() -> None:
    """A number, list or null where text was expected gives None, for the caller's default."""
    assert host_text(5) is None
    assert host_text(None) is None
    assert host_text(["x"]) is None


@given(st.lists(st.floats(min_value=0, max_value=100), max_size=200))
def test_token_bucket_never_allows_more_than_its_budget(gaps: list[float]) -> None:
    """Over any sequence of attempts, the lines let through between the first and the last
    attempt are at most the burst plus one per refill interval elapsed."""
    bucket = TokenBucket(burst=5, every_s=3.0)
    now, allowed = 0.0, 0
    for gap in gaps:
        now += gap
        allowed += bucket.take(now)
    assert allowed <= 5 + now / 3.0


def test_token_bucket_refills_after_a_quiet_spell() -> None:
    """A burst is spent at once; after a quiet spell of a burst's worth of refills it is back."""
    bucket = TokenBucket(burst=3, every_s=1.0)
    assert [bucket.take(0.0) for _ in range(5)] == [True, True, True, False, False]
    assert bucket.take(0.5) is False
    assert [bucket.take(10.0) for _ in range(4)] == [True, True, True, False]
