"""The skip for shared files (``tests/shared.py``): present, a test runs; truly absent, it
skips, named, with how to provide them, and strict mode takes that skip and counts it at the
end of the run; present but broken, it fails, in strict mode or not, never a quiet skip."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import shared

REPO = Path(__file__).resolve().parents[2]
SCRIPT, PATCH = shared.SEED.files
FS_CLIENT = "areal/reward/fs_client.py"


def seed_in(tmp_path: Path) -> shared.SharedFiles:
    """``shared.SEED`` looked for under ``tmp_path/shared`` instead of ``../shared``."""
    return dataclasses.replace(shared.SEED, shared=tmp_path / "shared")


def areal_in(tmp_path: Path) -> shared.SharedFiles:
    """``shared.AREAL`` looked for under ``tmp_path/shared`` instead of ``../shared``."""
    return dataclasses.replace(shared.AREAL, shared=tmp_path / "shared")


def make(directory: Path, *names: str) -> Path:
    """``directory`` holding a small file at each of ``names``."""
    for name in names:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text("# " + name + "\n")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def test_present_files_are_found_where_the_team_keeps_them(tmp_path: Path) -> None:
    """``../shared/seed`` with the script and its patch: the script; ``../shared/areal-fs``
    with the AReaL modules: the directory."""
    seed, areal = seed_in(tmp_path), areal_in(tmp_path)
    make(seed.default, SCRIPT, PATCH)
    make(areal.default, *areal.files)
    assert seed.locate({}) == shared.Found(seed, seed.default.resolve() / SCRIPT)
    assert areal.locate({}) == shared.Found(areal, areal.default.resolve())
    assert shared.require(seed, {}) == seed.default.resolve() / SCRIPT


def test_a_variable_names_another_place_and_the_seed_file_itself(tmp_path: Path) -> None:
    """``$REWARD_SUPERVISOR_SEED`` may name the script's directory or the script (its patch
    beside it); ``$REWARD_SUPERVISOR_AREAL`` the directory holding ``areal/``; what they
    name wins over ``../shared``, which need not exist."""
    seed, areal = seed_in(tmp_path), areal_in(tmp_path)
    elsewhere = make(tmp_path / "old", "ctl.py", PATCH, SCRIPT)
    env = {seed.env: str(elsewhere / "ctl.py")}
    assert seed.locate(env) == shared.Found(seed, elsewhere / "ctl.py")
    assert seed.locate({seed.env: str(elsewhere)}) == shared.Found(seed, elsewhere / SCRIPT)
    fs = make(tmp_path / "fs", *areal.files)
    assert areal.locate({areal.env: str(fs)}) == shared.Found(areal, fs)
    assert not seed.default.exists()


def test_truly_absent_files_skip_naming_what_is_missing_and_how_to_provide_it(
    tmp_path: Path,
) -> None:
    """No variable and no ``../shared/<name>``: absent, and ``require`` raises the one skip
    strict mode accepts, whose message names the files, where they were looked for, the
    ``../shared`` layout and the variable."""
    for files in (seed_in(tmp_path), areal_in(tmp_path)):
        found = files.locate({files.env: ""})
        assert isinstance(found, shared.Absent), found
        with pytest.raises(shared.SharedFilesAbsent) as raised:
            shared.require(files, {})
        assert isinstance(raised.value, pytest.skip.Exception)
        assert raised.value.name == files.name
        message = str(raised.value)
        assert message.startswith(files.what + " not found: "), message
        assert f"{files.default} does not exist" in message
        assert f"../shared/{files.name} beside the checkout" in message
        assert f"${files.env}" in message


@pytest.mark.parametrize(
    ("case", "lacking"),
    [
        ("the seed without its patch", PATCH),
        ("an empty areal-fs", FS_CLIENT),
        ("a variable naming nothing", "nowhere does not exist"),
        ("a variable naming a file that is not the seed's", "is not a directory"),
        ("the seed named by a variable without its patch", PATCH),
        ("a dangling symlink at ../shared/seed", "seed does not exist"),
    ],
)
def test_present_but_broken_files_fail_and_never_skip(
    tmp_path: Path, case: str, lacking: str
) -> None:
    """Files that are named or present but incomplete are broken: ``require`` fails the test
    (a failure, not a skip, strict mode or not), saying what is wrong."""
    seed, areal = seed_in(tmp_path), areal_in(tmp_path)
    files, env = seed, {}
    if case == "the seed without its patch":
        make(seed.default, SCRIPT)
    elif case == "an empty areal-fs":
        files = areal
        make(areal.default)
    elif case == "a variable naming nothing":
        env = {seed.env: str(tmp_path / "nowhere")}
    elif case == "a variable naming a file that is not the seed's":
        files, env = areal, {areal.env: str(make(tmp_path / "x", "fs.py") / "fs.py")}
    elif case == "the seed named by a variable without its patch":
        env = {seed.env: str(make(tmp_path / "old", SCRIPT) / SCRIPT)}
    else:
        seed.shared.mkdir()
        seed.default.symlink_to(tmp_path / "gone")
    found = files.locate(env)
    assert isinstance(found, shared.Broken), found
    assert lacking in found.reason, found.reason
    with pytest.raises(pytest.fail.Exception) as raised:
        shared.require(files, env)
    assert not isinstance(raised.value, pytest.skip.Exception)
    assert str(raised.value).startswith(files.what + " are broken"), raised.value


def test_the_summary_line_counts_the_skips_and_names_how_to_provide_each_set() -> None:
    """One line: how many, on which Python, which sets, and for each ``../shared/<name>`` or
    its variable."""
    line = shared.summary_line(27, ["areal-fs", "seed"], (3, 11, 7))
    assert line == (
        "27 tests SKIPPED on Python 3.11: shared files absent (areal-fs, seed); to run them,"
        " provide ../shared/areal-fs or $REWARD_SUPERVISOR_AREAL; ../shared/seed or"
        " $REWARD_SUPERVISOR_SEED (tests/shared.py)"
    )
    assert shared.summary_line(1, ["seed"], (3, 13)).startswith("1 test SKIPPED on Python 3.13")


# --- the decision under pytest, strict mode included -------------------------------------------

#: A conftest and a test module run by a pytest of its own with this repository's conftest
#: hooks: ``needs`` and ``needs_too`` take the seed from ``$SHARED_UNDER/shared/seed``, ``other``
#: skips for another reason when ``$OTHER_SKIP`` is 1.
CONFTEST = textwrap.dedent(
    """
    import dataclasses, os
    from pathlib import Path

    import pytest

    from tests import shared
    from tests.conftest import pytest_runtest_makereport, pytest_terminal_summary

    SEED = dataclasses.replace(shared.SEED, shared=Path(os.environ["SHARED_UNDER"]) / "shared")


    @pytest.fixture(scope="session")
    def seed():
        return shared.require(SEED)
    """
)
SUITE = textwrap.dedent(
    """
    import os

    import pytest


    def test_needs(seed):
        assert seed.name == "reward_workers_ctl.py"


    def test_needs_too(seed):
        assert seed.is_file()


    def test_other():
        if os.environ.get("OTHER_SKIP") == "1":
            pytest.skip("promtool not found")
    """
)


def run_suite(
    tmp_path: Path, *, strict: bool, other_skip: bool = False, workers: int = 0
) -> tuple[int, str, str]:
    """Run ``SUITE`` in ``tmp_path`` (strict mode or not; with pytest-xdist ``workers``, if
    any); its exit code, its output, and what it appended to
    ``$REWARD_SUPERVISOR_SHARED_REPORT``."""
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    (suite / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_suite.py").write_text(SUITE)
    report = tmp_path / "report.txt"
    report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (shared.SEED.env, "PYTEST_ADDOPTS")}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "SHARED_UNDER": str(tmp_path),
            "REWARD_SUPERVISOR_STRICT_SKIPS": "1" if strict else "",
            shared.REPORT_ENV: str(report),
            "OTHER_SKIP": "1" if other_skip else "",
        }
    )
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs"),
            *(("-n", str(workers)) if workers else ("-p", "no:xdist")),
        ],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    appended = report.read_text() if report.exists() else ""
    return done.returncode, done.stdout + done.stderr, appended


def test_under_pytest_present_files_run_and_nothing_is_said(tmp_path: Path) -> None:
    """With the seed in place, strict mode: both tests pass, no skip is listed, no loud line,
    nothing appended to the report file."""
    make(tmp_path / "shared" / "seed", SCRIPT, PATCH)
    code, out, appended = run_suite(tmp_path, strict=True)
    assert code == 0, out
    assert "3 passed" in out, out
    assert "SharedFilesAbsent" not in out and "shared files absent" not in out, out
    assert appended == ""


def test_under_pytest_absent_files_skip_by_name_and_are_counted_loudly(tmp_path: Path) -> None:
    """Without ``shared/seed``, strict mode: the run passes, each test that needs it is
    listed by name with its reason, and the last line counts them and says how to provide
    the seed, which the report file gets too."""
    code, out, appended = run_suite(tmp_path, strict=True)
    assert code == 0, out
    assert "1 passed, 2 skipped" in out, out
    assert "SharedFilesAbsent: the old script reward_workers_ctl.py" in out, out
    for name in ("test_needs", "test_needs_too"):
        assert f"SKIPPED test_suite.py::{name}: no seed" in out, out
    line = f"2 tests SKIPPED on Python {sys.version_info[0]}.{sys.version_info[1]}"
    assert line in out, out
    assert appended.startswith(line) and "../shared/seed or $REWARD_SUPERVISOR_SEED" in appended


def test_under_pytest_broken_files_and_other_skips_fail_in_strict_mode(tmp_path: Path) -> None:
    """A ``shared/seed`` without its patch: the tests that need it error, strict mode or not,
    and nothing is counted as absent; another skip still fails in strict mode."""
    make(tmp_path / "shared" / "seed", SCRIPT)
    for strict in (True, False):
        code, out, appended = run_suite(tmp_path, strict=strict)
        assert code == 1, out
        assert "1 passed, 2 errors" in out, out
        assert "lacks selfmatch-fix.patch" in out, out
        assert "SKIPPED" not in out and "skipped" not in out, out
        assert appended == ""
    make(tmp_path / "shared" / "seed", PATCH)
    code, out, _ = run_suite(tmp_path, strict=True, other_skip=True)
    assert code == 1, out
    assert "skipped in strict mode (CI installs everything)" in out, out
    assert "1 failed, 2 passed" in out, out


def test_under_pytest_xdist_the_skips_are_counted_once_by_the_controller(tmp_path: Path) -> None:
    """With two pytest-xdist workers, whichever runs the tests that need the seed: the run's
    end names both, and the report file gets one line counting two, from the controller, not
    one more from each worker that skipped one."""
    code, out, appended = run_suite(tmp_path, strict=True, workers=2)
    assert code == 0, out
    for name in ("test_needs", "test_needs_too"):
        assert f"SKIPPED test_suite.py::{name}: no seed" in out, out
    assert len(appended.splitlines()) == 1, appended
    assert appended.startswith("2 tests SKIPPED on Python"), appended
