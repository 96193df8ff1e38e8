"""reward-supervisor installed as an operator would (a wheel, pip, a virtual environment), alone
and beside supervisord's package, whose import name ``supervisor`` is ours too.

Our wheel is built from a copy of the checkout, without network (setuptools is a test
dependency); supervisord's wheel is the one ``./dev setup`` downloaded into the venv's
``wheels/`` directory. Scratch venvs are made without pip; the test venv's pip installs into
them (``pip --python``), with ``--no-deps``: the check runs before anything is imported that
needs a dependency, and ``--help`` needs none.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system]

REPO = Path(__file__).resolve().parents[2]
#: Where ./dev setup puts supervisord's wheel.
WHEELS = Path(sys.prefix) / "wheels"
#: Building a wheel, creating a venv or installing one wheel takes seconds; a loaded box, more.
STEP_TIMEOUT_S = 300.0


def run(argv: list[str], env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to completion, capturing its output."""
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, env=env, check=False
    )


def checked(argv: list[str]) -> None:
    """Run a setup step; fail the test with its output if it fails."""
    result = run(argv)
    assert result.returncode == 0, f"{argv}: {result.stdout}{result.stderr}"


@dataclass(frozen=True)
class Wheels:
    """Our freshly built wheel and supervisord's."""

    ours: Path
    supervisord: Path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    """Build our wheel from a copy of the sources (a build writes into its source tree, and
    other test runs may share this checkout); find supervisord's."""
    supervisord = sorted(WHEELS.glob("supervisor-*.whl"))
    if not supervisord:
        pytest.fail(f"no supervisord wheel in {WHEELS}: run ./dev setup")
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "reward_supervisor.py"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(
        REPO / "supervisor", source / "supervisor", ignore=shutil.ignore_patterns("__pycache__")
    )
    built = tmp_path_factory.mktemp("wheels")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    checked([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(built), str(source)])
    [ours] = built.glob("reward_supervisor-*.whl")
    return Wheels(ours=ours, supervisord=supervisord[-1])


class Venv:
    """A scratch virtual environment; ``install`` puts wheels into it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        checked([sys.executable, "-m", "venv", "--without-pip", str(path)])
        self.python = path / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        """Its site-packages directory."""
        [found] = self.path.glob("lib/python3.*/site-packages")
        return found

    def install(self, *wheels: Path, target: Path | None = None) -> None:
        """``pip install --no-deps`` the wheels into this venv (or into ``target``)."""
        where = ["--target", str(target)] if target is not None else []
        checked(
            [
                sys.executable,
                "-m",
                "pip",
                "--disable-pip-version-check",
                "--quiet",
                "--python",
                str(self.python),
                "install",
                "--no-deps",
                "--no-index",
                *where,
                *map(str, wheels),
            ]
        )

    def command(
        self, *args: str, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the venv's ``reward-supervisor`` console script."""
        return run([str(self.path / "bin" / "reward-supervisor"), *args], env=env)


@pytest.fixture
def venv(tmp_path: Path) -> Venv:
    """A fresh scratch venv."""
    return Venv(tmp_path / "venv")


def clean_env(**extra: str) -> dict[str, str]:
    """A minimal environment: nothing of the test venv's leaks into the scratch one."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **extra}


def test_alone_in_its_venv_the_command_runs(venv: Venv, wheels: Wheels) -> None:
    """Installed alone, the console script passes the check and runs the command line."""
    venv.install(wheels.ours)
    result = venv.command("--help", env=clean_env())
    assert result.returncode == 0, result.stderr
    assert "usage: reward-supervisor" in result.stdout
    # The demo subpackage is installed too: the reference worker runs from the wheel.
    worker = venv.command("worker", "--help", env=clean_env())
    assert worker.returncode == 0, worker.stderr
    assert "--shard" in worker.stdout


def test_the_alert_rules_and_the_dashboard_are_installed_with_the_package(
    venv: Venv, wheels: Wheels
) -> None:
    """The wheel carries ``supervisor/alerts.yml`` and ``supervisor/dashboard.json``; the
    installed commands print them as they are."""
    venv.install(wheels.ours)
    for command, name in (("alert-rules", "alerts.yml"), ("dashboard", "dashboard.json")):
        assert (venv.site_packages / "supervisor" / name).is_file()
        result = venv.command(command, env=clean_env())
        assert result.returncode == 0, result.stderr
        assert result.stdout == (REPO / "supervisor" / name).read_text(encoding="utf-8")


def test_supervisord_installed_into_the_same_venv_is_refused(venv: Venv, wheels: Wheels) -> None:
    """pip puts both packages into one ``supervisor`` directory; the command refuses to run
    and says why and what to do instead."""
    venv.install(wheels.ours)
    venv.install(wheels.supervisord)
    assert (venv.site_packages / "supervisor" / "supervisord.py").is_file()
    result = venv.command("--help", env=clean_env())
    assert result.returncode == 1
    assert "supervisord's package was installed into the same directory" in result.stderr
    assert "virtual environment of its own" in result.stderr
    assert "usage:" not in result.stdout


def test_supervisord_found_first_on_the_path_is_refused(
    venv: Venv, wheels: Wheels, tmp_path: Path
) -> None:
    """When Python would import supervisord's ``supervisor`` (earlier on ``sys.path``), the
    command says so instead of failing on a missing ``supervisor.cli``."""
    venv.install(wheels.ours)
    theirs = tmp_path / "theirs"
    venv.install(wheels.supervisord, target=theirs)
    result = venv.command("--help", env=clean_env(PYTHONPATH=str(theirs)))
    assert result.returncode == 1
    assert f"imports supervisord's package at {theirs / 'supervisor'}" in result.stderr
    assert "Traceback" not in result.stderr


def test_supervisord_hidden_behind_ours_is_refused(
    venv: Venv, wheels: Wheels, tmp_path: Path
) -> None:
    """When ours comes first and hides supervisord's (which then cannot be imported in this
    environment), the command refuses too."""
    venv.install(wheels.ours)
    theirs = tmp_path / "theirs"
    venv.install(wheels.supervisord, target=theirs)
    # A .pth entry goes after site-packages: ours is found first.
    (venv.site_packages / "zz-theirs.pth").write_text(f"{theirs}\n")
    hidden = run([str(venv.python), "-c", "import supervisor.supervisord"], env=clean_env())
    assert "No module named 'supervisor.supervisord'" in hidden.stderr
    result = venv.command("--help", env=clean_env())
    assert result.returncode == 1
    assert f"hides supervisord's package at {theirs / 'supervisor'}" in result.stderr
