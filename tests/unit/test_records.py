"""``@record`` is ``@dataclass(frozen=True, slots=True, kw_only=True)`` with shared equality,
hash and repr: the same values, compared, hashed and shown the same way."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor import health, vocabulary
from supervisor.records import record


@record
class Made:
    """A record with a default, a factory default, and fields hidden from compare and repr."""

    name: str
    count: int = 0
    tags: tuple[str, ...] = field(default_factory=tuple)
    cached: str = field(default="", compare=False)
    secret: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reference:
    """The same fields, made by dataclass itself."""

    name: str
    count: int = 0
    tags: tuple[str, ...] = field(default_factory=tuple)
    cached: str = field(default="", compare=False)
    secret: str = field(default="", repr=False)


@record(kw_only=False)
class Positional:
    """A record whose fields may be given in order."""

    host: str
    value: int


values = st.tuples(
    st.text(max_size=5),
    st.integers(-3, 3),
    st.lists(st.text(max_size=2), max_size=2).map(tuple),
    st.text(max_size=2),
    st.text(max_size=2),
)


@given(values, values)
def test_equality_hash_and_repr_are_dataclass_s(
    a: tuple[str, int, tuple[str, ...], str, str], b: tuple[str, int, tuple[str, ...], str, str]
) -> None:
    """Two records are equal, hash alike and show alike exactly when dataclass's would."""
    ma, mb = (Made(name=n, count=c, tags=t, cached=h, secret=x) for n, c, t, h, x in (a, b))
    ra, rb = (Reference(name=n, count=c, tags=t, cached=h, secret=x) for n, c, t, h, x in (a, b))
    assert (ma == mb) == (ra == rb)
    assert (ma != mb) == (ra != rb)
    if ma == mb:
        assert hash(ma) == hash(mb)
    assert repr(ma).replace("Made(", "X(") == repr(ra).replace("Reference(", "X(")


def test_a_record_is_frozen_slotted_and_keyword_only() -> None:
    """No field can be set after it is made, no attribute added, and fields are named."""
    made = Made(name="a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.count = 1  # type: ignore[misc]
    assert not hasattr(made, "__dict__")
    with pytest.raises(TypeError):
        Made("a")  # type: ignore[call-arg]
    assert Positional("h", 1) == Positional(host="h", value=1)
    assert dataclasses.replace(made, count=2) == Made(name="a", count=2)


def test_records_of_different_classes_are_never_equal() -> None:
    """Equality asks for the same class, as dataclass's does."""
    others: list[object] = [Reference(name="a"), health.DeadlinePassed()]
    assert Made(name="a") != others[0]
    assert vocabulary.DeadlinePassed() != others[1]
    assert vocabulary.DeadlinePassed() == vocabulary.DeadlinePassed()
    assert health.SshLost(reason="x") in [health.SshRestored(), health.SshLost(reason="x")]


def test_match_works_by_keyword_and_by_position() -> None:
    """``match`` sees a record's fields as it sees a dataclass's."""
    match Positional("h", 2):
        case Positional("h", value):
            assert value == 2
        case _:
            raise AssertionError("no match")
    match vocabulary.Launch(host="a", machine="b", shard=3):
        case vocabulary.Launch(machine=machine):
            assert machine == "b"
        case _:
            raise AssertionError("no match")
