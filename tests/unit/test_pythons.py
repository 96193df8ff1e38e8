"""The promised Python versions agree everywhere they are written: pyproject.toml's classifiers
(which ./dev test reads to pick interpreters), requires-python, the tools' target version,
the README and docs/INSTALL.md; and the oldest host Python they state is the one the tests
try."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests import pythons

REPO = Path(__file__).resolve().parents[2]
#: The README's first fleet and docs/INSTALL.md's "Supported Pythons" both say them.
DOCS = {
    name: (REPO / name).read_text(encoding="utf-8") for name in ("README.md", "docs/INSTALL.md")
}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_classifiers_promise_consecutive_versions_from_requires_python_on() -> None:
    """The classifiers start at requires-python's floor and skip no minor version."""
    versions = pythons.supported()
    assert PYPROJECT["project"]["requires-python"] == f">={versions[0]}"
    minors = [int(v.split(".")[1]) for v in versions]
    assert minors == list(range(minors[0], minors[0] + len(minors)))


def test_tools_check_against_the_oldest_promised_version() -> None:
    """mypy and ruff judge the code as the oldest promised Python would run it."""
    oldest = pythons.supported()[0]
    assert PYPROJECT["tool"]["mypy"]["python_version"] == oldest
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py" + oldest.replace(".", "")


def test_readme_names_every_promised_version() -> None:
    """The README's and docs/INSTALL.md's "supervisor runs on" sentence lists exactly the
    classifiers' versions."""
    for name, text in DOCS.items():
        match = re.search(
            r"supervisor\s+runs\s+on\s+Python\s+((?:3\.\d+,\s+)*3\.\d+\s+and\s+3\.\d+)", text
        )
        assert match, f"{name}: no 'supervisor runs on Python 3.x, ... and 3.y' sentence"
        listed = re.findall(r"3\.\d+", match.group(1))
        assert listed == pythons.supported(), name


def test_readme_states_the_oldest_host_python_the_tests_try() -> None:
    """The README's and docs/INSTALL.md's host floor is tests/pythons.py's, which the agent
    tests run on."""
    for name, text in DOCS.items():
        match = re.search(r"worker\s+hosts\s+need\s+Python\s+≥\s+(3\.\d+)", text)
        assert match, f"{name}: no 'worker hosts need Python ≥ 3.x' sentence"
        assert (
            match.group(1)
            == pythons.OLDEST_HOST
            == min(pythons.OLD_HOSTS, key=lambda v: int(v.split(".")[1]))
        ), name
