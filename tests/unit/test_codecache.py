"""The agent's compiled code kept on the host (``supervisor/codecache.py``): used only when it
is ours, private, whole and of this very program and Python build; anything else is
compiled as if there were no cache, and nothing breaks a start."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import CodeType

import pytest

from supervisor import codecache, remote

KEY = "0123456789abcdef0123456789abcdef"
#: A python user nobody may run (the venvs' live under root's 0700 home).
SYSTEM_PYTHON = Path("/usr/bin/python3")
#: ``codes``' texts: a module, then the program (as ``packed_program`` orders them).
TEXTS = ("VALUE = 41\n", "import sys\nRESULT = sys.modules['mod'].VALUE + 1\n")


def packed(texts: tuple[str, ...] = TEXTS) -> str:
    """``texts`` packed as ``packed_program`` packs them."""
    import base64
    import zlib

    return base64.b64encode(zlib.compress("\0".join(texts).encode())).decode("ascii")


def run(codes: list[CodeType]) -> int:
    """Run ``codes`` as the program does; the program's RESULT."""
    module: dict[str, object] = {}
    sys.modules["mod"] = type(sys)("mod")
    try:
        exec(codes[0], sys.modules["mod"].__dict__)  # noqa: S102 - the code under test
        exec(codes[1], module)  # noqa: S102
    finally:
        del sys.modules["mod"]
    result = module["RESULT"]
    assert isinstance(result, int)
    return result


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory of our own, as ``$HOME``."""
    path = tmp_path / "home"
    path.mkdir(mode=0o755)
    monkeypatch.setenv("HOME", str(path))
    return path


def cache_file(home: Path) -> Path:
    """Where ``KEY``'s code is kept under ``home``."""
    return home / ".cache" / "reward-supervisor" / codecache.cache_name(KEY)


def test_the_first_start_compiles_and_keeps_the_code_the_next_loads_it(home: Path) -> None:
    """A first start compiles and writes the cache (private directory and file); the next
    loads the same code from it."""
    assert codecache.load(KEY, 2) is None
    assert run(codecache.codes(KEY, packed(), ("mod",))) == 42
    path = cache_file(home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    loaded = codecache.load(KEY, 2)
    assert loaded is not None
    assert run(loaded) == 42
    assert [c.co_filename for c in loaded] == [
        "<reward-supervisor mod>",
        "<reward-supervisor agent>",
    ]
    # What is loaded is what is run: the packed texts are not read again.
    assert run(codecache.codes(KEY, "not base64 at all!", ("mod",))) == 42


@pytest.mark.parametrize(
    "damage",
    ["flip a byte", "truncate", "empty", "another key", "another python", "too large", "not code"],
)
def test_a_damaged_or_foreign_file_is_compiled_over(home: Path, damage: str) -> None:
    """A torn, corrupt, foreign (another program or Python build) or oversized cache file is
    never loaded: the texts are compiled and the file written again."""
    codecache.codes(KEY, packed(), ("mod",))
    path = cache_file(home)
    data = path.read_bytes()
    match damage:
        case "flip a byte":
            data = data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:]
        case "truncate":
            data = data[: len(data) // 2]
        case "empty":
            data = b""
        case "another key":
            data = data.replace(KEY.encode(), b"f" * len(KEY), 1)
        case "another python":
            data = data.replace(sys.version.encode(), b"2.7.18 (default)", 1)
        case "too large":
            data = data + b"\0" * codecache.CACHE_MAX
        case "not code":
            path.unlink()
            codecache.store(KEY, [])  # a valid file holding no code objects
            data = path.read_bytes()
    path.write_bytes(data)
    assert codecache.load(KEY, 2) is None
    assert run(codecache.codes(KEY, packed(), ("mod",))) == 42
    assert codecache.load(KEY, 2) is not None


def test_a_symlink_in_place_of_the_file_is_never_followed(home: Path, tmp_path: Path) -> None:
    """A symlink named like the cache file is not read through, and the write replaces the
    link itself, never its target."""
    codecache.codes(KEY, packed(), ("mod",))
    path = cache_file(home)
    target = tmp_path / "elsewhere.bin"
    shutil.copyfile(path, target)
    target.chmod(0o600)
    before = target.read_bytes()
    path.unlink()
    path.symlink_to(target)
    assert codecache.load(KEY, 2) is None
    codecache.codes(KEY, packed(), ("mod",))
    assert not path.is_symlink()
    assert target.read_bytes() == before


def test_a_directory_others_can_write_or_a_symlinked_one_is_not_used(
    home: Path, tmp_path: Path
) -> None:
    """A cache directory writable by group or others, or a symlink to a directory, is neither
    read nor written."""
    codecache.codes(KEY, packed(), ("mod",))
    directory = cache_file(home).parent
    directory.chmod(0o777)
    assert codecache.load(KEY, 2) is None
    mtime = cache_file(home).stat().st_mtime_ns
    codecache.codes(KEY, packed(), ("mod",))
    assert cache_file(home).stat().st_mtime_ns == mtime
    directory.chmod(0o700)
    moved = tmp_path / "moved"
    directory.rename(moved)
    directory.symlink_to(moved)
    assert codecache.load(KEY, 2) is None


def test_a_file_of_another_user_is_not_used(home: Path) -> None:
    """A cache file owned by someone else (root may own it: ``chown``) is not loaded."""
    if os.geteuid() != 0:
        # Under ./dev test (CI, as root) a skip fails the run: tests/conftest.py.
        pytest.skip("needs root to give a file to another user")
    codecache.codes(KEY, packed(), ("mod",))
    os.chown(cache_file(home), 65534, 65534)
    assert codecache.load(KEY, 2) is None


@pytest.mark.parametrize("value", ["", "relative/home", "/", "missing", "others-can-write"])
def test_no_cache_without_a_home_of_our_own(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No usable home (unset, relative, ``/``, missing, writable by others): the code is
    compiled and nothing is written anywhere; a missing home is not created."""
    match value:
        case "missing":
            home = str(tmp_path / "missing")
        case "others-can-write":
            home = str(tmp_path / "shared")
            os.mkdir(home)
            os.chmod(home, 0o777)  # noqa: S103 - the home the cache must not trust
        case _:
            home = value
    monkeypatch.setenv("HOME", home)
    monkeypatch.chdir(tmp_path)
    assert codecache.cache_dir() is None
    assert run(codecache.codes(KEY, packed(), ("mod",))) == 42
    assert not (tmp_path / "missing").exists()
    assert not (tmp_path / "relative").exists()
    if value == "others-can-write":
        assert os.listdir(home) == []


def test_files_of_other_versions_unused_for_a_week_are_removed(home: Path) -> None:
    """Writing one version's file removes others' not used for ``STALE_S``, and only those."""
    codecache.codes(KEY, packed(), ("mod",))
    directory = cache_file(home).parent
    old, recent, foreign = (directory / n for n in ("code-old.bin", "code-new.bin", "notes.txt"))
    for path in (old, recent, foreign):
        path.write_bytes(b"x")
    week_ago = time.time() - codecache.STALE_S - 60
    os.utime(old, (week_ago, week_ago))
    os.utime(foreign, (week_ago, week_ago))
    cache_file(home).unlink()
    codecache.codes(KEY, packed(), ("mod",))
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [cache_file(home).name, recent.name, foreign.name]
    )


def test_the_packed_agent_keeps_its_code_and_runs_from_it_as_another_user(
    tmp_path: Path,
) -> None:
    """The program sent to hosts, run twice with a home of its own, writes its code once and
    runs from it (the file unchanged by the second start); as ``nobody``, whose home does not
    exist, it runs all the same and creates nothing."""
    program = remote.packed_program(remote.agent_source(), remote.agent_modules())
    home = tmp_path / "home"
    home.mkdir()

    def start(*prefix: str, env_home: str, python: str = sys.executable) -> tuple[int, str]:
        ran = subprocess.run(
            [*prefix, python, "-X", "utf8", "-c", program, "no-such-mode"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd="/",
            env={"PATH": os.environ["PATH"], "HOME": env_home},
        )
        return ran.returncode, ran.stderr

    usage = (2, "usage: agent | launcher | shepherd\n")
    assert start(env_home=str(home)) == usage
    [kept] = (home / ".cache" / "reward-supervisor").iterdir()
    written = kept.stat().st_mtime_ns
    assert start(env_home=str(home)) == usage
    assert kept.stat().st_mtime_ns == written
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not SYSTEM_PYTHON.exists():
        pytest.skip("needs root, setpriv and a python nobody may run to start it as nobody")
    missing = tmp_path / "nobody-home"
    nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    assert start(*nobody, env_home=str(missing), python=str(SYSTEM_PYTHON)) == usage
    assert not missing.exists()
