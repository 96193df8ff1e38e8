"""The daemon raises its own soft limit on open files, as systemd expects of a program that
needs more than 1024: checked in a child started under ``prlimit`` (our own limit stays)."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys

import pytest

from supervisor import process
from supervisor.process import OPEN_FILE_LIMIT_WANTED

# Prints what raise_open_file_limit returned, then the limits the process then has.
_PROBE = (
    "import resource; from supervisor.process import raise_open_file_limit as r; "
    "print(r(), *resource.getrlimit(resource.RLIMIT_NOFILE))"
)


def limits_after_raise(soft: int, hard: int) -> tuple[int, int, int]:
    """(returned, soft, hard) in a Python started with these limits."""
    prlimit = shutil.which("prlimit")
    assert prlimit is not None, "prlimit (util-linux) is installed by ./dev setup"
    done = subprocess.run(
        [prlimit, f"--nofile={soft}:{hard}", "--", sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    returned, new_soft, new_hard = (int(x) for x in done.stdout.split())
    return returned, new_soft, new_hard


def test_a_child_under_prlimit_raises_its_soft_limit_to_the_hard_one() -> None:
    """Real limits (no CAP_SYS_RESOURCE needed: only the soft limit moves): raised to the
    hard limit, never lowered, and left alone where there is nowhere to go."""
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    assert hard > 300, "the machine's hard limit leaves no room to test"
    assert limits_after_raise(256, hard) == (hard, hard, hard)
    assert limits_after_raise(hard, hard) == (hard, hard, hard)
    assert limits_after_raise(300, 300) == (300, 300, 300)


class FakeLimits:
    """``resource`` with settable NOFILE limits, and a setrlimit that may refuse."""

    RLIMIT_NOFILE = resource.RLIMIT_NOFILE
    RLIM_INFINITY = resource.RLIM_INFINITY

    def __init__(self, soft: int, hard: int, *, refuse: bool = False) -> None:
        self.limits = (soft, hard)
        self.refuse = refuse

    def getrlimit(self, which: int) -> tuple[int, int]:
        """The limits as set."""
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        """Set the limits, or refuse as a sandbox may."""
        assert which == self.RLIMIT_NOFILE
        if self.refuse:
            raise ValueError("not allowed")  # what Python raises for EPERM here
        self.limits = limits


@pytest.mark.parametrize(
    ("soft", "hard", "expected"),
    [
        (1024, 524288, (OPEN_FILE_LIMIT_WANTED, 524288)),  # systemd's default: up to our cap
        (1024, resource.RLIM_INFINITY, (OPEN_FILE_LIMIT_WANTED, resource.RLIM_INFINITY)),
        (100000, 200000, (100000, 200000)),  # above the cap already: never lowered
        (resource.RLIM_INFINITY, resource.RLIM_INFINITY, (-1, -1)),
    ],
)
def test_the_raise_stops_at_our_cap_and_never_lowers(
    monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, expected: tuple[int, int]
) -> None:
    """The raise goes up to our cap at most, never lowers a limit set higher, and copes
    with unlimited limits."""
    fake = FakeLimits(soft, hard)
    monkeypatch.setattr(process, "resource", fake)
    returned = process.raise_open_file_limit()
    assert fake.limits == expected
    assert returned == (OPEN_FILE_LIMIT_WANTED if soft == resource.RLIM_INFINITY else expected[0])


def test_a_refused_raise_keeps_the_limit_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    """A raise the system refuses leaves the limit as it was, and says so by returning it."""
    fake = FakeLimits(1024, 524288, refuse=True)
    monkeypatch.setattr(process, "resource", fake)
    assert process.raise_open_file_limit() == 1024
    assert fake.limits == (1024, 524288)
