"""The Python versions the project promises, and where this machine has an interpreter of each.

The promise is ``pyproject.toml``'s ``Programming Language :: Python :: 3.N`` classifiers (the
README repeats them; ``tests/unit/test_pythons.py`` keeps the three in step). ``./dev test``
runs this file as a script to learn which interpreter runs which test tiers, and the mixed-fleet
tests import it to give worker hosts another Python than the supervisor's.

    python tests/pythons.py      one line per promised version: "3.12 /path/to/python" or
                                 "3.12 -" when none was found
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
_CLASSIFIER = re.compile(r"Programming Language :: Python :: (3\.\d+)")
#: Extra interpreters to consider first, separated by spaces (a uv or conda python, say).
EXTRA_ENV = "REWARD_SUPERVISOR_PYTHONS"
#: Set to 1 to let ``./dev test`` and the mixed-fleet tests pass although a promised version
#: has no interpreter here (the run still says which ones it could not test).
ALLOW_MISSING_ENV = "REWARD_SUPERVISOR_ALLOW_MISSING_PYTHONS"
#: The oldest Python a worker host may have (README, docs/INSTALL.md): it runs the agent,
#: launcher and shepherd (``supervisor/agent.py``); 3.6 cannot parse it.
OLDEST_HOST = "3.7"
#: Host Pythons older than every promised supervisor version, tested where present.
OLD_HOSTS = ("3.7", "3.8")
#: Starting an interpreter to ask its version takes ~20 ms; a pyenv shim, ~150 ms.
_ASK_TIMEOUT_S = 30.0


def supported() -> list[str]:
    """The promised minor versions, oldest first (``["3.11", "3.12", "3.13"]``)."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    found = {m.group(1) for c in project["classifiers"] if (m := _CLASSIFIER.fullmatch(c))}
    return sorted(found, key=lambda v: tuple(int(n) for n in v.split(".")))


def current() -> str:
    """The minor version of the interpreter running this code."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def missing_allowed() -> bool:
    """Whether a promised version without an interpreter is tolerated (see ALLOW_MISSING_ENV)."""
    return os.environ.get(ALLOW_MISSING_ENV) == "1"


def _candidates(version: str) -> Iterator[str]:
    """Places an interpreter of ``version`` may be, most specific first."""
    yield from os.environ.get(EXTRA_ENV, "").split()
    if current() == version:
        yield sys.executable
    on_path = shutil.which(f"python{version}")
    if on_path:
        yield on_path
    yield f"/usr/bin/python{version}"
    yield f"/usr/local/bin/python{version}"
    # pyenv's builds, newest patch first; "3.13.0t" (free-threaded) and the like are skipped.
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    pattern = re.compile(re.escape(version) + r"\.(\d+)")
    builds = [(int(m.group(1)), p) for p in _listdir(root) if (m := pattern.fullmatch(p.name))]
    for _, build in sorted(builds, reverse=True):
        yield str(build / "bin" / f"python{version}")


def _listdir(path: Path) -> list[Path]:
    """The entries of ``path``, or none when it does not exist."""
    try:
        return list(path.iterdir())
    except OSError:
        return []


def _identify(python: str) -> tuple[str, str] | None:
    """The minor version ``python`` reports and the program it really is (a pyenv shim
    names the build it runs), or None if it does not run."""
    if not os.access(python, os.X_OK):
        return None
    try:
        result = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2], sys.executable)"],
            capture_output=True,
            text=True,
            timeout=_ASK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    version, _, executable = result.stdout.strip().partition(" ")
    return (version, executable) if result.returncode == 0 and executable else None


@cache
def find(version: str) -> str | None:
    """An interpreter of ``version`` ("3.12") on this machine, or None."""
    for python in _candidates(version):
        found = _identify(python)
        if found is not None and found[0] == version:
            return found[1]
    return None


def others() -> dict[str, str | None]:
    """Every promised version but the running one, with its interpreter here (or None)."""
    return {version: find(version) for version in supported() if version != current()}


def main() -> int:
    """Print each promised version and its interpreter ("-" when there is none)."""
    for version in supported():
        print(version, find(version) or "-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
