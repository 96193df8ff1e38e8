"""import-seed's guesses: the seed's interpreter and environment, and where the shipped unit
may write the pointer file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from supervisor import seedimport

UNIT = Path(__file__).parent.parent.parent / "systemd" / "reward-supervisor@.service"


def make_venv(path: Path, pyvenv: str | None, *libs: str) -> Path:
    """A venv's skeleton at ``path``: ``pyvenv.cfg`` with ``pyvenv`` (none if None) and
    ``lib/<name>/site-packages`` for each of ``libs``."""
    path.mkdir(parents=True)
    if pyvenv is not None:
        (path / "pyvenv.cfg").write_text(pyvenv)
    for name in libs:
        (path / "lib" / name / "site-packages").mkdir(parents=True)
    return path


def test_options_give_the_seeds_own_paths(tmp_path: Path) -> None:
    """--ws alone: the seed's _paths defaults (venv and repo under the workspace), with the
    venv's own Python version."""
    ws = tmp_path / "ws"
    venv = make_venv(ws / "tmp" / "runtime-venv", "home = /usr/bin\nversion = 3.12.4\n")
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws=str(ws), venv=None, repo=None, environ={}, wrappers=[], warnings=warnings
    )
    assert runtime.python == f"{venv}/bin/python"
    assert runtime.env == {
        "PATH": f"/usr/bin:/bin:{venv}/bin:/usr/local/bin",
        "PYTHONPATH": f"{venv}/lib/python3.12/site-packages:{ws}/repo/AReaL",
        "HOME": f"{ws}/tmp/home",
        "TMPDIR": f"{ws}/tmp",
    }
    assert runtime.ws == str(ws)
    assert warnings == []


def test_venv_and_repo_options_win_over_the_workspace_defaults(tmp_path: Path) -> None:
    """--venv and --repo replace what --ws (or $SAO_WS) would imply, as in the seed."""
    venv = make_venv(tmp_path / "venv", "version = 3.12.1\n")
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws=None,
        venv=str(venv),
        repo="/src/AReaL",
        environ={"SAO_WS": "/ws"},
        wrappers=[],
        warnings=warnings,
    )
    assert runtime.python == f"{venv}/bin/python"
    assert runtime.env["PYTHONPATH"] == f"{venv}/lib/python3.12/site-packages:/src/AReaL"
    assert runtime.env["HOME"] == "/ws/tmp/home"
    assert warnings == []


def test_a_venv_without_repo_or_workspace_warns_about_the_missing_checkout(
    tmp_path: Path,
) -> None:
    """--venv alone: the interpreter is known, but PYTHONPATH lacks AReaL, and it says so."""
    venv = make_venv(tmp_path / "venv", "version = 3.12.1\n")
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws=None, venv=str(venv), repo=None, environ={}, wrappers=[], warnings=warnings
    )
    assert runtime.python == f"{venv}/bin/python"
    assert "/repo/AReaL" not in runtime.env["PYTHONPATH"]
    assert len(warnings) == 1 and "PYTHONPATH lacks the AReaL checkout" in warnings[0]


@pytest.mark.parametrize(
    ("pyvenv", "libs", "version", "source"),
    [
        ("home = /usr/bin\nversion = 3.11.7\n", ["python3.11"], "3.11", "pyvenv.cfg"),
        ("implementation = CPython\nversion_info = 3.13.1.final.0\n", [], "3.13", "pyvenv.cfg"),
        ("version = 3.11\n", [], "3.11", "pyvenv.cfg"),
        (None, ["python3.11"], "3.11", "lib/python3.11"),
        ("home = /usr/bin\n", ["python3.13"], "3.13", "lib/python3.13"),
    ],
)
def test_the_venvs_site_packages_are_those_of_its_own_python_and_it_says_so(
    tmp_path: Path, pyvenv: str | None, libs: list[str], version: str, source: str
) -> None:
    """The seed named python3.12's site-packages whatever the venv held: import-seed names
    the version its pyvenv.cfg (``version``, or uv's ``version_info``) or its one
    lib/python3.N says, and a note says which and where from."""
    venv = make_venv(tmp_path / "venv", pyvenv, *libs)
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws=None, venv=str(venv), repo="/src/AReaL", environ={}, wrappers=[], warnings=warnings
    )
    assert runtime.env["PYTHONPATH"] == f"{venv}/lib/python{version}/site-packages:/src/AReaL"
    assert warnings == []
    [note] = runtime.notes
    assert f"Python {version}, from {venv}/{source}" in note
    assert "not python3.12, which the seed assumed" in note


@pytest.mark.parametrize("libs", [[], ["python3.11", "python3.12"]])
def test_a_venv_whose_version_cannot_be_told_keeps_the_seeds_and_warns(
    tmp_path: Path, libs: list[str]
) -> None:
    """No pyvenv.cfg to read and no single lib/python3.N (a venv this machine cannot see, or
    an odd one): the seed's python3.12, and a warning saying how to check it."""
    venv = tmp_path / "venv"
    if libs:
        make_venv(venv, None, *libs)
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws=None, venv=str(venv), repo="/src/AReaL", environ={}, wrappers=[], warnings=warnings
    )
    assert runtime.env["PYTHONPATH"] == f"{venv}/lib/python3.12/site-packages:/src/AReaL"
    assert runtime.notes == ()
    [warning] = warnings
    assert f"cannot tell the Python version of {venv}" in warning
    assert f"{venv}/bin/python -V" in warning


def test_nothing_known_falls_back_to_python3_with_a_warning() -> None:
    """No options, no wrapper, no $SAO_WS: python3, no environment, and a warning saying
    what the seed would have run and which options fix it."""
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws=None, venv=None, repo=None, environ={}, wrappers=[], warnings=warnings
    )
    assert (runtime.python, runtime.env, runtime.ws) == (None, {}, None)
    assert len(warnings) == 1
    assert "SAO_WS is not set" in warnings[0] and "--ws" in warnings[0]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/shared/reward/ws/tmp/sao-reward-current.json", None),
        ("/shared/reward", None),
        ("/shared/rewards/p.json", "ReadWritePaths=/shared/rewards"),
        ("/data/ws/tmp/sao-reward-current.json", "ReadWritePaths=/data/ws/tmp"),
        ("/home/alice/ws/tmp/p.json", "ProtectHome=tmpfs and BindPaths=/home/alice/ws/tmp"),
        ("/root/ws/tmp/p.json", "BindPaths=/root/ws/tmp"),
        ("/tmp/p.json", "PrivateTmp=yes"),
        ("/shared/reward/../elsewhere/p.json", "ReadWritePaths=/shared/elsewhere"),
    ],
)
def test_unit_write_hint_names_the_drop_in_line(path: str, expected: str | None) -> None:
    """Under the unit's ReadWritePaths nothing is needed; elsewhere the exact line to add,
    or, where that cannot help (ProtectHome, PrivateTmp), what can."""
    hint = seedimport.unit_write_hint(path)
    if expected is None:
        assert hint is None
    else:
        assert hint is not None and expected in hint


def test_unit_sandbox_constants_match_the_shipped_unit() -> None:
    """The paths import-seed reasons about are the shipped unit's own settings."""
    text = UNIT.read_text()

    def setting(name: str) -> str:
        """The value of ``name=`` in the unit."""
        match = re.search(rf"^{name}=(.*)$", text, flags=re.MULTILINE)
        assert match, name
        return match.group(1).strip()

    assert tuple(setting("ReadWritePaths").split()) == seedimport.UNIT_READ_WRITE_PATHS
    assert setting("ProtectSystem") == "strict"
    assert setting("ProtectHome") == "yes"
    assert setting("PrivateTmp") == "yes"
