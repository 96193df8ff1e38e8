"""The promised Python versions agree everywhere they are written: pyproject.toml's classifiers
(which ./dev test reads to pick interpreters), requires-python, the tools' target version and
the README; and the oldest host Python the README states is the one the tests try."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests import pythons

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
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
    """The README's "Supported Pythons" sentence lists exactly the classifiers' versions."""
    match = re.search(r"supervisor runs on Python ((?:3\.\d+, )*3\.\d+ and 3\.\d+)", README)
    assert match, "README: no 'supervisor runs on Python 3.x, ... and 3.y' sentence"
    listed = re.findall(r"3\.\d+", match.group(1))
    assert listed == pythons.supported()


def test_readme_states_the_oldest_host_python_the_tests_try() -> None:
    """The README's host floor is tests/pythons.py's, which the agent tests run on."""
    match = re.search(r"worker hosts need Python ≥ (3\.\d+)", README)
    assert match, "README: no 'worker hosts need Python ≥ 3.x' sentence"
    assert (
        match.group(1)
        == pythons.OLDEST_HOST
        == min(pythons.OLD_HOSTS, key=lambda v: int(v.split(".")[1]))
    )
