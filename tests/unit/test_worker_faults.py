"""Parsing of the worker's fault-injection and timing environment variables."""

from __future__ import annotations

import pytest

from supervisor.demo.worker import Fault, FaultKind, parse_env_seconds, parse_fault


@pytest.mark.parametrize("text", [None, "", "   "])
def test_absent_or_blank_fault_means_none(text: str | None) -> None:
    """An unset or blank REWARD_WORKER_FAULT injects nothing."""
    assert parse_fault(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("crash:after=3:code=7", Fault(kind=FaultKind.CRASH, after_s=3.0, code=7)),
        ("crash", Fault(kind=FaultKind.CRASH, after_s=0.0, code=1)),
        ("exit0:after=2", Fault(kind=FaultKind.EXIT0, after_s=2.0)),
        ("hang:after=0.5", Fault(kind=FaultKind.HANG, after_s=0.5)),
        ("hang_ignore_term:after=2", Fault(kind=FaultKind.HANG_IGNORE_TERM, after_s=2.0)),
        ("slow_start:ready_after=5", Fault(kind=FaultKind.SLOW_START, ready_after_s=5.0)),
        ("never_ready", Fault(kind=FaultKind.NEVER_READY)),
        ("abort_on_start", Fault(kind=FaultKind.ABORT_ON_START)),
        (" crash : after = 1 : code = 255 ", Fault(kind=FaultKind.CRASH, after_s=1.0, code=255)),
        ("hang_call", Fault(kind=FaultKind.HANG_CALL)),
        (
            "hang_call:task=t0-000007:marker=/tmp/m",
            Fault(kind=FaultKind.HANG_CALL, task="t0-000007", marker="/tmp/m"),
        ),
    ],
)
def test_documented_fault_specs_parse(text: str, expected: Fault) -> None:
    """Every syntax example in the module docstring parses to the fault it describes."""
    assert parse_fault(text) == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("explode", "unknown fault"),
        ("crash:after", "key=value"),
        ("crash:ready_after=1", "unknown key"),
        ("never_ready:after=1", "unknown key"),
        ("crash:after=1:after=2", "twice"),
        ("crash:after=-1", ">= 0"),
        ("crash:after=inf", ">= 0"),
        ("hang:after=soon", "not a number"),
        ("crash:code=256", "0-255"),
        ("crash:code=1.5", "not an integer"),
        ("hang_call:after=1", "unknown key"),
    ],
)
def test_bad_fault_specs_are_refused_with_a_reason(text: str, needle: str) -> None:
    """A spec with an unknown kind, key or value raises ValueError saying which part is wrong."""
    with pytest.raises(ValueError, match=needle):
        parse_fault(text)


def test_env_seconds_unset_is_zero_and_negative_offsets_allowed() -> None:
    """Unset means 0; a clock offset may be negative, a task delay may not."""
    assert parse_env_seconds("X", None, allow_negative=False) == 0.0
    assert parse_env_seconds("X", "-3600", allow_negative=True) == -3600.0
    assert parse_env_seconds("X", "0.25", allow_negative=False) == 0.25
    with pytest.raises(ValueError, match=">= 0"):
        parse_env_seconds("X", "-1", allow_negative=False)
    with pytest.raises(ValueError, match="not a number"):
        parse_env_seconds("X", "abc", allow_negative=True)
    with pytest.raises(ValueError, match="finite"):
        parse_env_seconds("X", "nan", allow_negative=True)
