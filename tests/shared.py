"""The team's files some tests use from beside the checkout, never copied into it: the old
script (``../shared/seed``) and the real AReaL worker and client (``../shared/areal-fs``).

A clone elsewhere has no ``../shared``. There a test that needs one of them skips, named, with
what is missing and how to provide it (``require``), and strict mode (``./dev test``) accepts
that skip, and only that one: ``SharedFilesAbsent``, which ``tests/conftest.py`` recognises,
counts, and lists at the end of the run. The same scenarios run on the reference worker where
there is one (see ``tests/areal.py``).

Truly absent means: no environment variable names another place, and the directory
``../shared/<name>`` does not exist. Anything else that is not the complete set of files
(a variable naming a wrong place, a ``../shared/seed`` without its patch, a dangling symlink)
is broken, and a test that needs it fails: the machines that have ``../shared`` (CI) must
keep running those tests, not skip them quietly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn

import pytest

REPO: Final = Path(__file__).resolve().parent.parent
#: Where the team keeps them: a ``shared`` directory beside the checkout.
SHARED: Final = REPO.parent / "shared"
#: A file ``./dev test`` names: each pytest run appends its ``summary_line`` to it (when a
#: test was skipped for absent shared files), for ./dev to repeat at the end of its run.
REPORT_ENV: Final = "REWARD_SUPERVISOR_SHARED_REPORT"
#: The user property a skip for absent shared files gives its report, with the files' name:
#: reports travel from pytest-xdist's workers to the run's end with their user properties.
ABSENT_PROPERTY: Final = "shared_files_absent"


@dataclass(frozen=True, slots=True)
class SharedFiles:
    """One set of shared files: the directory ``name`` under ``shared``, or where ``env`` says."""

    #: The directory's name under ``../shared`` (and the set's name in messages).
    name: str
    #: What they are, for messages.
    what: str
    #: The environment variable naming another place.
    env: str
    #: Files (relative to the directory) that must all be regular files.
    files: tuple[str, ...]
    #: The one of ``files`` that ``env`` may name instead of the directory, and that
    #: ``locate`` returns; None: ``env`` names the directory, which is what is returned.
    main: str | None = None
    #: The directory ``name`` is looked for in (``../shared``; a test's own in unit tests).
    shared: Path = SHARED

    @property
    def default(self) -> Path:
        """Where the team keeps them: ``../shared/<name>``."""
        return self.shared / self.name

    def how(self) -> str:
        """How to provide them, for a message."""
        names = f"the file {self.main} or its directory" if self.main else "its directory"
        return (
            f"put {self.name}/ at {self.default} (../shared/{self.name} beside the checkout),"
            f" or set ${self.env} to {names}"
        )

    def locate(self, environ: Mapping[str, str] = os.environ) -> Found | Absent | Broken:
        """Where they are, that they are truly absent, or what is wrong with them."""
        given = environ.get(self.env)
        if not given:
            directory = self.default
            if not directory.exists() and not directory.is_symlink():
                return Absent(
                    self, f"{self.what} not found: {directory} does not exist; {self.how()}"
                )
            return self._check(directory, None, str(directory))
        path = Path(given)
        where = f"${self.env}={given}"
        if self.main is not None and path.is_file():
            return self._check(path.parent, path, where)
        return self._check(path, None, where)

    def _check(self, directory: Path, main: Path | None, where: str) -> Found | Broken:
        """Every file there (``main`` standing for the file of that name), or which are not."""
        wanted = {name: directory / name for name in self.files}
        if main is not None and self.main is not None:
            wanted[self.main] = main
        missing = [name for name, path in wanted.items() if not path.is_file()]
        if not directory.exists():
            wrong = "does not exist"
        elif not directory.is_dir():
            wrong = "is not a directory"
        elif missing:
            wrong = f"lacks {', '.join(missing)}"
        else:
            wrong = ""
        if wrong:
            return Broken(self, f"{self.what} are broken: {where} {wrong}; {self.how()}")
        # Absolute (a test may change directory); a main file named by the variable is kept
        # as named, not resolved: its siblings were looked for beside that name.
        if main is not None:
            return Found(self, main.absolute())
        if self.main is not None:
            return Found(self, directory.resolve() / self.main)
        return Found(self, directory.resolve())


@dataclass(frozen=True, slots=True)
class Found:
    """The files are there: ``path`` is the main file, or the directory."""

    files: SharedFiles
    path: Path


@dataclass(frozen=True, slots=True)
class Absent:
    """Truly absent: nothing names them and ``../shared/<name>`` does not exist."""

    files: SharedFiles
    reason: str


@dataclass(frozen=True, slots=True)
class Broken:
    """Named or present, but not the complete set: never a skip."""

    files: SharedFiles
    reason: str


# pytest exports its skip exception only as an attribute of ``pytest.skip``, which mypy cannot
# take for a base class; subclassing it is how pytest still reports the test as skipped.
class SharedFilesAbsent(pytest.skip.Exception):  # type: ignore[name-defined,misc]
    """The skip of a test whose shared files are truly absent: the one skip strict mode takes."""

    def __init__(self, absent: Absent) -> None:
        super().__init__(absent.reason)
        #: The name of the missing set (``seed``, ``areal-fs``).
        self.name = absent.files.name


#: The old script reward-supervisor replaces, and the patch without which it cannot start.
SEED: Final = SharedFiles(
    name="seed",
    what="the old script reward_workers_ctl.py and its selfmatch-fix.patch",
    env="REWARD_SUPERVISOR_SEED",
    files=("reward_workers_ctl.py", "selfmatch-fix.patch"),
    main="reward_workers_ctl.py",
)
#: The real AReaL worker and trainer client (areal-fs: the directory holding ``areal/``).
AREAL: Final = SharedFiles(
    name="areal-fs",
    what="the real AReaL worker and client (areal-fs)",
    env="REWARD_SUPERVISOR_AREAL",
    files=tuple(f"areal/reward/{m}.py" for m in ("fs_worker", "fs_client", "fs_protocol")),
)


#: Every set of shared files the tests use.
ALL: Final = (SEED, AREAL)


def require(files: SharedFiles, environ: Mapping[str, str] = os.environ) -> Path:
    """The path of ``files`` (``Found.path``); skips the test when they are truly absent, and
    fails it when they are broken."""
    found = files.locate(environ)
    if isinstance(found, Found):
        return found.path
    if isinstance(found, Absent):
        raise SharedFilesAbsent(found)
    _fail(found.reason)


def _fail(reason: str) -> NoReturn:
    """Fail the test now (no traceback: the reason says it all)."""
    pytest.fail(reason, pytrace=False)


def summary_line(count: int, names: Sequence[str], version: Sequence[int]) -> str:
    """The loud line ending a run where ``count`` tests were skipped because the shared files
    ``names`` are truly absent."""
    by_name = {files.name: files for files in ALL}
    how = "; ".join(f"../shared/{n} or ${by_name[n].env}" for n in names if n in by_name)
    python = ".".join(str(part) for part in version[:2])
    tests = "test" if count == 1 else "tests"
    return (
        f"{count} {tests} SKIPPED on Python {python}: shared files absent ({', '.join(names)});"
        f" to run them, provide {how} (tests/shared.py)"
    )
