"""import-seed's guesses: the seed's interpreter and environment, and where the shipped unit
may write the pointer file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from supervisor import seedimport

UNIT = Path(__file__).parent.parent.parent / "systemd" / "reward-supervisor@.service"


def test_options_give_the_seeds_own_paths() -> None:
    """--ws alone: the seed's _paths defaults (venv and repo under the workspace)."""
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws="/ws", venv=None, repo=None, environ={}, wrappers=[], warnings=warnings
    )
    assert runtime.python == "/ws/tmp/runtime-venv/bin/python"
    assert runtime.env == {
        "PATH": "/usr/bin:/bin:/ws/tmp/runtime-venv/bin:/usr/local/bin",
        "PYTHONPATH": "/ws/tmp/runtime-venv/lib/python3.12/site-packages:/ws/repo/AReaL",
        "HOME": "/ws/tmp/home",
        "TMPDIR": "/ws/tmp",
    }
    assert runtime.ws == "/ws"
    assert warnings == []


def test_venv_and_repo_options_win_over_the_workspace_defaults() -> None:
    """--venv and --repo replace what --ws (or $SAO_WS) would imply, as in the seed."""
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws=None,
        venv="/opt/venv",
        repo="/src/AReaL",
        environ={"SAO_WS": "/ws"},
        wrappers=[],
        warnings=warnings,
    )
    assert runtime.python == "/opt/venv/bin/python"
    assert runtime.env["PYTHONPATH"] == "/opt/venv/lib/python3.12/site-packages:/src/AReaL"
    assert runtime.env["HOME"] == "/ws/tmp/home"
    assert warnings == []


def test_a_venv_without_repo_or_workspace_warns_about_the_missing_checkout() -> None:
    """--venv alone: the interpreter is known, but PYTHONPATH lacks AReaL, and it says so."""
    warnings: list[str] = []
    runtime = seedimport.seed_runtime(
        ws=None, venv="/opt/venv", repo=None, environ={}, wrappers=[], warnings=warnings
    )
    assert runtime.python == "/opt/venv/bin/python"
    assert "/repo/AReaL" not in runtime.env["PYTHONPATH"]
    assert len(warnings) == 1 and "PYTHONPATH lacks the AReaL checkout" in warnings[0]


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
