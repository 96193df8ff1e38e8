"""``supervisor/measured.py``: outside the test suite the programs sent to hosts are their
source, unchanged; under it, a wrapper that runs the same source measured by coverage.py,
mapped to its file, in a process started with a clean environment (as sshd starts one),
in the children it forks and ends with ``os._exit``, and with ``-S``; and unmeasured, with
nothing on stderr, as a user who could not save the data."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import coverage
import pytest

from supervisor import measured
from supervisor.remote import AGENT_MODULES
from tests import pythons

DEADLINE_S = 60.0
SYSTEM_PYTHON = Path("/usr/bin/python3")

# A host program in miniature: __main__, its argv, a branch taken only in a forked child
# that ends with os._exit (as the launcher's shepherds do), and whether the coverage
# configuration reaches its children.
PROGRAM = """\
import os
import sys


def sign(n):
    if n > 0:
        return "positive"
    return "not positive"


if __name__ == "__main__":
    print(sys.argv[1:], __file__, sign(1), bool(os.environ.get("COVERAGE_PROCESS_CONFIG")))
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        sign(-1)
        os._exit(0)
    os.waitpid(child, 0)
"""


@pytest.fixture
def program_dir() -> Iterator[Path]:
    """A directory for the program and its coverage data, readable by every user."""
    path = Path(tempfile.mkdtemp(prefix="measured-"))
    try:
        path.chmod(0o755)
        (path / "hostprog.py").write_text(PROGRAM, encoding="utf-8")
        yield path
    finally:
        shutil.rmtree(path)


def run_config(directory: Path) -> str:
    """A test run's coverage configuration as coverage.py hands it to child processes:
    branches, the directory as source, the data file in it."""
    cov = coverage.Coverage(
        data_file=str(directory / ".coverage"), branch=True, source=[str(directory)]
    )
    cov.set_option("run:patch", ["subprocess"])
    return str(cov.config.serialize())


def measured_env(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Our environment as under ./dev test, with ``directory``'s configuration."""
    monkeypatch.setenv(measured.ENABLE_ENV, "1")
    monkeypatch.setenv(measured.CONFIG_ENV, run_config(directory))


def run_on_host(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with the bare environment sshd gives a session (no coverage variables)."""
    return subprocess.run(
        argv,
        env={"PATH": os.environ["PATH"], "HOME": "/"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )


def lines_measured(directory: Path, path: Path) -> set[int]:
    """The lines of ``path`` in the data files of ``directory``, combined."""
    combined = coverage.CoverageData(basename=str(directory / ".coverage-all"), no_disk=True)
    files = [str(f) for f in directory.glob(".coverage.*")]
    assert files, f"no data file in {directory}"
    try:
        for name in files:
            one = coverage.CoverageData(basename=name)
            try:
                one.read()
                combined.update(one)
            finally:
                # Closed here: an SQLite connection left to the garbage collector is reported
                # (ResourceWarning) in whichever test runs then, and fails it.
                one.close(force=True)
        return set(combined.lines(str(path)) or ())
    finally:
        combined.close(force=True)


def line_of(text: str) -> int:
    """The line number of ``text`` in PROGRAM."""
    [number] = [n for n, line in enumerate(PROGRAM.splitlines(), 1) if text in line]
    return number


def test_outside_the_test_suite_the_source_is_sent_unchanged(
    monkeypatch: pytest.MonkeyPatch, program_dir: Path
) -> None:
    """Without REWARD_SUPERVISOR_MEASURE_REMOTE=1, or without a coverage configuration to
    hand down (or with one that is not coverage.py's), the program is the source itself."""
    path = program_dir / "hostprog.py"
    monkeypatch.delenv(measured.ENABLE_ENV, raising=False)
    monkeypatch.setenv(measured.CONFIG_ENV, run_config(program_dir))
    assert measured.remote_program(PROGRAM, path) == PROGRAM
    monkeypatch.setenv(measured.ENABLE_ENV, "1")
    for config in ("", "not base64!", "W10=", "eyJwYXRjaCI6IFtdfQ=="):  # [], {"patch": []}
        monkeypatch.setenv(measured.CONFIG_ENV, config)
        assert measured.remote_program(PROGRAM, path) == PROGRAM
    monkeypatch.delenv(measured.CONFIG_ENV)
    assert measured.remote_program(PROGRAM, path) == PROGRAM
    monkeypatch.setenv(measured.CONFIG_ENV, run_config(program_dir))
    assert measured.remote_program(PROGRAM, path) != PROGRAM


def test_the_wrapper_parses_as_the_oldest_host_python(
    monkeypatch: pytest.MonkeyPatch, program_dir: Path
) -> None:
    """The measured agent (with the safefiles sent with it) must start on every host python
    the agent itself supports, and stays far below Linux's 128 KiB limit on one argv string."""
    measured_env(monkeypatch, program_dir)
    agent = Path(measured.__file__).with_name("agent.py")
    program = measured.remote_program(agent.read_text(encoding="utf-8"), agent, AGENT_MODULES)
    major, minor = (int(n) for n in pythons.OLDEST_HOST.split("."))
    ast.parse(program, feature_version=(major, minor))
    assert len(program.encode()) < 100_000


@pytest.mark.parametrize("site", [True, False], ids=["site", "no-site"])
def test_the_wrapper_runs_the_source_measured_under_its_own_path(
    monkeypatch: pytest.MonkeyPatch, program_dir: Path, site: bool
) -> None:
    """Run as ``python [-S] -c PROGRAM ARGS`` from a clean environment, the source runs as
    ``__main__`` under its real path with its arguments; coverage.py measures it there, in
    the child it forks (which ends with ``os._exit``), and hands its configuration to the
    processes it starts."""
    path = program_dir / "hostprog.py"
    measured_env(monkeypatch, program_dir)
    program = measured.remote_program(PROGRAM, path)
    flags = [] if site else ["-S"]
    done = run_on_host([sys.executable, *flags, "-X", "utf8", "-c", program, "one", "two"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"['one', 'two'] {path} positive True\n"
    assert done.stderr == ""
    lines = lines_measured(program_dir, path)
    assert {line_of('return "positive"'), line_of("print(sys.argv")} <= lines
    # Only the forked child took this branch, and it ended with os._exit.
    assert line_of('return "not positive"') in lines


# A module sent with the program, which it imports by the name it is registered under.
MODULE = """\
def twice(n):
    return 2 * n
"""
# No file of that name is on the path (the host runs it from /): only sys.modules has it.
USES_MODULE = """\
import _hostmod

print(_hostmod.twice(21), _hostmod.__name__, _hostmod.__file__)
"""


def test_the_wrapper_runs_modules_sent_with_the_source_measured_under_their_own_paths(
    monkeypatch: pytest.MonkeyPatch, program_dir: Path
) -> None:
    """A module sent with the source is run first, as a module registered under its name
    (which the source imports), compiled under its own real path: coverage.py measures it
    there."""
    path = program_dir / "usesmod.py"
    path.write_text(USES_MODULE, encoding="utf-8")
    module = program_dir / "hostmod.py"
    module.write_text(MODULE, encoding="utf-8")
    measured_env(monkeypatch, program_dir)
    program = measured.remote_program(USES_MODULE, path, [("_hostmod", module)])
    done = run_on_host([sys.executable, "-X", "utf8", "-c", program])
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"42 _hostmod {module}\n"
    assert done.stderr == ""
    assert 2 in lines_measured(program_dir, module)  # return 2 * n
    assert 3 in lines_measured(program_dir, path)  # print(...)


@pytest.mark.skipif(
    os.geteuid() != 0 or not SYSTEM_PYTHON.exists() or not shutil.which("setpriv"),
    reason="needs root (to become nobody), setpriv and a python nobody may run",
)
def test_a_user_who_cannot_save_the_data_runs_the_source_unmeasured(
    monkeypatch: pytest.MonkeyPatch, program_dir: Path
) -> None:
    """As user nobody, who may not write the data file's directory, the source runs as
    usual, unmeasured, hands nothing down, and nothing fails at its exit."""
    path = program_dir / "hostprog.py"
    measured_env(monkeypatch, program_dir)
    program = measured.remote_program(PROGRAM, path)
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    done = run_on_host([*nobody, str(SYSTEM_PYTHON), "-X", "utf8", "-c", program, "x"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"['x'] {path} positive False\n"
    assert done.stderr == ""
    assert list(program_dir.glob(".coverage*")) == []
