"""The ``reward-supervisor`` command's entry point; it refuses to run beside supervisord's package.

Our import package is ``supervisor``, and so is supervisord's (pip's ``supervisor``, Debian's
``python3-supervisor``). In one environment one of the two breaks: the one found first on
``sys.path`` hides the other, and installed into one directory they overwrite each other's
files. This module lives outside both so that it can still say so when Python would import
theirs; it imports nothing from ``supervisor`` until the check has passed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

#: Where our package is: installed beside this module (or, installed editable, in the checkout).
OURS = Path(__file__).resolve().parent / "supervisor"
#: A module only supervisord's package has.
SUPERVISORD_MODULE = "supervisord.py"
ADVICE = (
    "install reward-supervisor into a virtual environment of its own"
    " (python3 -m venv /opt/reward-supervisor; see the README)"
)


def _imported_supervisor() -> Path | None:
    """The directory of the ``supervisor`` package Python imports here, or None if none."""
    spec = importlib.util.find_spec("supervisor")
    if spec is None:
        return None
    if spec.origin is not None and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).resolve().parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]).resolve() if locations else None


def _other_supervisors(path: list[str]) -> list[Path]:
    """Packages named ``supervisor`` in the ``path`` entries, other than ours."""
    found: list[Path] = []
    for entry in path:
        candidate = Path(entry or ".") / "supervisor"
        try:
            is_package = (candidate / "__init__.py").is_file() or (
                candidate / SUPERVISORD_MODULE
            ).is_file()
            resolved = candidate.resolve()
        except OSError:
            continue
        if is_package and resolved != OURS and resolved not in found:
            found.append(resolved)
    return found


def _whose(directory: Path) -> str:
    """How to name a foreign ``supervisor`` package in a message."""
    if (directory / SUPERVISORD_MODULE).is_file():
        return f"supervisord's package at {directory}"
    return f"another package named supervisor at {directory}"


def clash(path: list[str] | None = None) -> str | None:
    """Why the ``supervisor`` package here is not safely ours, or None when it is.

    ``path`` defaults to ``sys.path``; the first finding wins: Python imports a foreign
    ``supervisor``, supervisord's files share our directory, or ours hides another one.
    """
    imported = _imported_supervisor()
    if imported != OURS:
        found = _whose(imported) if imported is not None else "no package named supervisor"
        return (
            f"Python here imports {found}, not reward-supervisor's ({OURS}):"
            f" the two packages share the name; {ADVICE}"
        )
    if (OURS / SUPERVISORD_MODULE).is_file():
        return (
            f"supervisord's package was installed into the same directory as"
            f" reward-supervisor's ({OURS}): each overwrites the other's files; {ADVICE}"
        )
    others = _other_supervisors(sys.path if path is None else path)
    if others:
        return (
            f"reward-supervisor's package ({OURS}) hides {_whose(others[0])} in this"
            f" environment, which then cannot be imported (supervisord would fail); {ADVICE}"
        )
    return None


def main() -> int:
    """Run the command line, or exit 1 with the reason when the package here is not ours."""
    problem = clash()
    if problem is not None:
        print(f"reward-supervisor: {problem}", file=sys.stderr)
        return 1
    from supervisor.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
