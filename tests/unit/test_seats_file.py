"""The seats in the state file (failover): written with the restart history, read back as
they were, and a hostile or broken ``seats`` object read as none, never an exception."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import runfiles, vocabulary
from tests.examples import examples

SEATS = vocabulary.SavedSeats(
    serving={"w-0": "spare-0"},
    fenced=frozenset({"w-0"}),
    drained=frozenset(),
    held=frozenset({"w-3"}),
    left={"w-0": ("w-0", 0, 4242)},
)


def encoded(seats: vocabulary.SavedSeats | None) -> dict[str, Any]:
    """The state file the encoder writes with ``seats``, parsed."""
    data = runfiles.HistoryEncoder().encode(
        {}, wall_minus_mono=0.0, saved_at=1.0, hostname="h", version=1, seats=seats
    )
    parsed: dict[str, Any] = json.loads(data)
    return parsed


def test_seats_written_with_the_history_read_back_as_they_were() -> None:
    """Encode then parse: the same seats; without seats the file has no ``seats`` key."""
    assert runfiles.seats_from_json(encoded(SEATS)) == SEATS
    assert "seats" not in encoded(None)
    assert runfiles.seats_from_json(encoded(None)) is None


@pytest.mark.parametrize(
    "broken",
    [
        {"seats": []},
        {"seats": {"serving": [], "left": {}}},
        {"seats": {"serving": {"a": 3}, "left": {}}},
        {"seats": {"serving": {"a": ""}, "left": {}}},
        {"seats": {"serving": {"a": "b" * 300}, "left": {}}},
        {"seats": {"serving": {}, "left": {}, "fenced": "a", "drained": [], "held": []}},
        {"seats": {"serving": {}, "left": {}, "fenced": [1], "drained": [], "held": []}},
        {"seats": {**runfiles.seats_record(SEATS), "left": {"w-0": {"host": "w-0"}}}},
        {"seats": {**runfiles.seats_record(SEATS), "left": {"w-0": []}}},
        {"seats": {**runfiles.seats_record(SEATS), "left": {"": {"host": "a", "shard": 0}}}},
        {
            "seats": {
                **runfiles.seats_record(SEATS),
                "left": {"w-0": {"host": "w-0", "shard": 0, "pid": -1}},
            }
        },
        {
            "seats": {
                **runfiles.seats_record(SEATS),
                "left": {"w-0": {"host": "w-0", "shard": True, "pid": None}},
            }
        },
    ],
)
def test_a_broken_seats_object_is_no_seats(broken: dict[str, Any]) -> None:
    """Any part malformed: the whole is dropped (the config's seats apply), not half kept."""
    assert runfiles.seats_from_json(broken) is None


@settings(max_examples=examples(200), deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.sampled_from(["serving", "left", "fenced", "host", "a"]), inner)
        ),
        max_leaves=20,
    )
)
def test_any_json_value_as_seats_never_raises(value: object) -> None:
    """Whatever a hostile state file holds under ``seats``, reading it never raises."""
    found = runfiles.seats_from_json({"seats": value})
    assert found is None or isinstance(found, vocabulary.SavedSeats)
