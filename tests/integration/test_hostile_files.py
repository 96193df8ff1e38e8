"""Every file the daemon and the CLI touch under the run root, planted as a symlink to a victim
outside the root, as a FIFO, as a hard link, or behind a directory swapped for a symlink:
nothing outside the root changes, nothing blocks, and the error names the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from structlog.testing import capture_logs

from supervisor import cleanup, runfiles, seedimport, view
from supervisor import config as config_mod
from supervisor.config import Config
from supervisor.errors import UnsafeFileError
from supervisor.health import Policy
from supervisor.layout import RunLayout, launch_meta, layout_of, write_pointer, write_run_files
from supervisor.statusfiles import StatusProblem, read_exit, read_status

#: An open, read or write that does not block returns within milliseconds; a FIFO open that
#: blocks never returns. One second tells the two apart on the noisiest machine.
BLOCK_LIMIT_S = 1.0
VICTIM_TEXT = b"a file outside the run root that nobody may change\n"

_T = TypeVar("_T")
#: Puts something hostile under a name of the run directory.
Plant = Callable[[], None]


# --- helpers --------------------------------------------------------------------------


def promptly(fn: Callable[[], _T]) -> _T:
    """``fn()``, failing the test if it has not returned within ``BLOCK_LIMIT_S``."""
    outcome: list[Any] = []

    def run() -> None:
        """Run ``fn`` and keep what it returned or raised."""
        try:
            outcome.append(("value", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test below
            outcome.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)  # a blocked thread must not hang pytest
    thread.start()
    thread.join(BLOCK_LIMIT_S)
    if thread.is_alive():
        pytest.fail(f"blocked for more than {BLOCK_LIMIT_S}s")
    kind, value = outcome[0]
    if kind == "error":
        raise value
    result: _T = value
    return result


@dataclass
class Victim:
    """A file outside the run root, and how it looked before the test."""

    path: Path
    before: tuple[bytes, int, int]

    @classmethod
    def create(cls, path: Path, data: bytes = VICTIM_TEXT) -> Victim:
        """Write ``path`` with ``data`` and remember it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return cls(path, cls.look(path))

    @staticmethod
    def look(path: Path) -> tuple[bytes, int, int]:
        """Content, inode and mode of ``path``."""
        st = path.stat()
        return path.read_bytes(), st.st_ino, st.st_mode

    def assert_unchanged(self) -> None:
        """Same bytes, same inode, same mode as before."""
        assert self.look(self.path) == self.before


def plant_symlink(path: Path, target: Path) -> None:
    """Put a symlink to ``target`` at ``path`` (replacing what is there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.symlink_to(target)


def plant_fifo(path: Path) -> None:
    """Put a FIFO nobody writes to or reads from at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.mkfifo(path)


def plant_bytes(path: Path, data: bytes) -> None:
    """Put a regular file holding ``data`` at ``path`` (replacing what is there)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.write_bytes(data)


def swap_for_symlink(directory: Path, target: Path) -> None:
    """Replace ``directory`` (and what is in it) with a symlink to ``target``."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.symlink_to(target, target_is_directory=True)


def make_config(tmp_path: Path, **run: Any) -> Config:
    """A two-host config for a run at ``tmp_path/runs/run-1`` (no SSH is ever used)."""
    raw = {
        "run": {"root": str(tmp_path / "runs" / "run-1"), "shard_count": 2, **run},
        "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
        "control": {"socket": str(tmp_path / "control.sock")},
        "hosts": [{"name": "worker-0", "shard": 0}, {"name": "worker-1", "shard": 1}],
    }
    return config_mod.parse(raw, tmp_path / "rs.toml")


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """A config whose run directories exist."""
    cfg = make_config(tmp_path)
    write_run_files(cfg)
    return cfg


@pytest.fixture
def run(config: Config) -> RunLayout:
    """The run's layout."""
    return layout_of(config)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the run root."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


# --- ctl/supervisor.lock ---------------------------------------------------------------


def test_run_lock_planted_as_symlink_fifo_or_hard_link_is_refused(
    run: RunLayout, outside: Path
) -> None:
    """The daemon's lock, truncated and written in place, is refused (naming it) when it is
    a symlink to a victim, a FIFO or a hard link of one: the victim keeps its bytes."""
    lock = run.ctl / "supervisor.lock"
    victim = Victim.create(outside / "victim")

    def plant_hard_link() -> None:
        """Make the lock's name a second name of the victim."""
        lock.unlink()
        os.link(victim.path, lock)

    plants: list[tuple[Plant, str]] = [
        (lambda: plant_symlink(lock, victim.path), "a symbolic link"),
        (lambda: plant_fifo(lock), "not a regular file"),
        (plant_hard_link, "hard-linked"),
    ]
    for plant, reason in plants:
        plant()
        with pytest.raises(UnsafeFileError) as caught:
            promptly(lambda: runfiles.lock_run(lock, root=run.root))
        assert (caught.value.path, caught.value.reason) == (str(lock), reason)
        assert str(lock) in str(caught.value)
        victim.assert_unchanged()


def test_run_lock_in_a_ctl_swapped_for_a_symlink_is_refused(run: RunLayout, outside: Path) -> None:
    """``ctl/`` replaced by a symlink to another directory: the lock is not created there,
    and the error names ``ctl``."""
    swap_for_symlink(run.ctl, outside)
    with pytest.raises(UnsafeFileError) as caught:
        promptly(lambda: runfiles.lock_run(run.ctl / "supervisor.lock", root=run.root))
    assert caught.value.path == str(run.ctl)
    assert "not a directory" in str(caught.value)
    assert list(outside.iterdir()) == []


def test_run_lock_is_held_and_refused_to_a_second_daemon(run: RunLayout) -> None:
    """A regular lock file is taken, written with our name, seen held by another process and
    refused to a second taker. (Nothing here opens the file in this process meanwhile: any
    close of it would release our lock.)"""
    lock = run.ctl / "supervisor.lock"
    fd = runfiles.lock_run(lock, root=run.root)
    try:
        holder = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from pathlib import Path; from supervisor import runfiles;"
                "sys.exit(runfiles.lock_is_held(Path(sys.argv[1]), root=Path(sys.argv[2])))",
                str(lock),
                str(run.root),
            ],
            check=False,
            timeout=60,
        )
        assert holder.returncode == 1  # True: another process sees it held
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from pathlib import Path; from supervisor import runfiles;"
                "runfiles.lock_run(Path(sys.argv[1]), root=Path(sys.argv[2]))",
                str(lock),
                str(run.root),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert second.returncode == 1
        assert "RunLocked" in second.stderr and f"pid {os.getpid()}" in second.stderr
    finally:
        os.close(fd)
    assert f"pid {os.getpid()}" in lock.read_text()


def test_cleanup_lock_check_ignores_planted_lock_names(run: RunLayout, outside: Path) -> None:
    """cleanup's "is a daemon holding the lock" check does not follow a symlinked lock or
    block on a FIFO: neither can be a live daemon's lock."""
    lock = run.ctl / "supervisor.lock"
    victim = Victim.create(outside / "victim")
    plant_symlink(lock, victim.path)
    assert promptly(lambda: runfiles.lock_is_held(lock, root=run.root)) is False
    plant_fifo(lock)
    assert promptly(lambda: runfiles.lock_is_held(lock, root=run.root)) is False
    victim.assert_unchanged()


# --- ctl/supervisor-state.json ---------------------------------------------------------


def good_state(now: float) -> dict[str, Any]:
    """A state file a daemon could have written: worker-0 failed once, one restart."""
    return {
        "version": 1,
        "saved_at": now,
        "hosts": {
            "worker-0": {
                "failures": 1,
                "restarts": 1,
                "restart_times": [now - 10],
                "next_restart_at": None,
                "cause": "worker exited",
                "failed": None,
            }
        },
    }


def test_state_file_symlink_or_fifo_is_no_history_and_names_the_file(
    run: RunLayout, outside: Path
) -> None:
    """A symlinked state file is not read (even pointing at a valid state) and a FIFO does
    not block start-up: both are logged as unreadable, with the file's path, and ignored."""
    victim = Victim.create(outside / "state.json", json.dumps(good_state(time.time())).encode())
    plants: list[tuple[Plant, str]] = [
        (lambda: plant_symlink(run.state_file, victim.path), "a symbolic link"),
        (lambda: plant_fifo(run.state_file), "not a regular file"),
    ]
    for plant, reason in plants:
        plant()
        with capture_logs() as logs:
            history = promptly(
                lambda: runfiles.load_history(run.state_file, root=run.root, policy=Policy())
            )
        assert history == {}
        [unreadable] = [e for e in logs if e["event"] == "history.unreadable"]
        assert unreadable["path"] == str(run.state_file)
        assert str(run.state_file) in unreadable["reason"] and reason in unreadable["reason"]
    victim.assert_unchanged()


def test_state_file_write_replaces_a_planted_symlink_or_fifo(run: RunLayout, outside: Path) -> None:
    """Saving the history over a symlink or a FIFO replaces the name with our file: the
    victim is unchanged, the write does not block, and the new file is a regular 0644 file."""
    victim = Victim.create(outside / "victim")
    plants: list[Plant] = [
        lambda: plant_symlink(run.state_file, victim.path),
        lambda: plant_fifo(run.state_file),
    ]
    for plant in plants:
        plant()
        promptly(lambda: runfiles.write_json_atomic(run.state_file, {"hosts": {}}, root=run.root))
        st = run.state_file.lstat()
        assert st.st_mode & 0o777 == 0o644 and st.st_nlink == 1
        assert json.loads(run.state_file.read_text()) == {"hosts": {}}
        victim.assert_unchanged()
    assert [p.name for p in run.ctl.iterdir() if p.name.endswith(".tmp")] == []


def test_state_file_in_a_swapped_ctl_is_neither_read_nor_written(
    run: RunLayout, outside: Path
) -> None:
    """With ``ctl/`` swapped for a symlink to a directory holding a state file, that state is
    not loaded and a save writes nothing there; both name ``ctl``."""

    (outside / "supervisor-state.json").write_text(json.dumps(good_state(time.time())))
    victim = Victim.look(outside / "supervisor-state.json")
    swap_for_symlink(run.ctl, outside)
    with capture_logs() as logs:
        assert runfiles.load_history(run.state_file, root=run.root, policy=Policy()) == {}
    assert [str(run.ctl) in e["reason"] for e in logs if e["event"] == "history.unreadable"] == [
        True
    ]
    with pytest.raises(UnsafeFileError, match=str(run.ctl)):
        runfiles.write_json_atomic(run.state_file, {"hosts": {}}, root=run.root)
    assert Victim.look(outside / "supervisor-state.json") == victim
    assert sorted(p.name for p in outside.iterdir()) == ["supervisor-state.json"]


# --- ctl/<host>.stop ---------------------------------------------------------------------


def test_stop_sentinel_write_never_goes_through_a_planted_name(
    run: RunLayout, outside: Path
) -> None:
    """stop-host's sentinel over a symlink to a victim, a dangling symlink or a FIFO: the
    victim is unchanged, no file appears where the dangling link pointed, nothing blocks."""
    sentinel = run.stop_sentinel("worker-0")
    victim = Victim.create(outside / "victim")
    chosen = outside / "created-by-root"
    plants: list[Plant] = [
        lambda: plant_symlink(sentinel, victim.path),
        lambda: plant_symlink(sentinel, chosen),
        lambda: plant_fifo(sentinel),
    ]
    for plant in plants:
        plant()
        promptly(lambda: runfiles.write_stop_sentinel(sentinel, root=run.root))
        assert sentinel.lstat().st_nlink == 1 and sentinel.is_file() and not sentinel.is_symlink()
        assert sentinel.read_text().startswith("stopped by reward-supervisor stop-host at ")
        victim.assert_unchanged()
        assert not chosen.exists()


def test_stop_sentinel_in_a_swapped_ctl_is_neither_written_nor_removed(
    run: RunLayout, outside: Path
) -> None:
    """``ctl/`` swapped for a symlink: stop-host writes nothing there and start-host removes
    nothing there (a file of the sentinel's name outside stays); both errors name ``ctl``."""
    kept = outside / "worker-0.stop"
    kept.write_text("someone else's file\n")
    swap_for_symlink(run.ctl, outside)
    for act in (
        lambda: runfiles.write_stop_sentinel(run.stop_sentinel("worker-1"), root=run.root),
        lambda: runfiles.remove(run.stop_sentinel("worker-0"), root=run.root),
    ):
        with pytest.raises(UnsafeFileError) as caught:
            promptly(act)
        assert caught.value.path == str(run.ctl)
    assert kept.read_text() == "someone else's file\n"
    assert sorted(p.name for p in outside.iterdir()) == ["worker-0.stop"]


def test_start_host_removes_a_planted_symlink_not_its_target(run: RunLayout, outside: Path) -> None:
    """Removing a sentinel that is a symlink removes the link, never the file it names."""
    victim = Victim.create(outside / "victim")
    plant_symlink(run.stop_sentinel("worker-0"), victim.path)
    runfiles.remove(run.stop_sentinel("worker-0"), root=run.root)
    assert not run.stop_sentinel("worker-0").is_symlink()
    victim.assert_unchanged()


# --- ctl/<host>.pid (offline status) -----------------------------------------------------


def test_offline_status_reads_pidfiles_without_following_blocking_or_failing(
    config: Config, run: RunLayout, outside: Path
) -> None:
    """Offline status over a symlinked pidfile (to a victim holding a pid), a FIFO, bytes
    that are not UTF-8 and a non-ASCII digit: no pid, no hang, no traceback."""
    victim = Victim.create(outside / "victim", b"4242\n")
    cases: list[tuple[Callable[[Path], None], str]] = [
        (lambda p: plant_symlink(p, victim.path), "symlink"),
        (plant_fifo, "fifo"),
        (lambda p: plant_bytes(p, b"\xff\xfe12\n"), "not UTF-8"),
        (lambda p: plant_bytes(p, "\u00b2\n".encode()), "superscript two"),
        (lambda p: plant_bytes(p, b"1" * 100), "too long"),
    ]
    for plant, what in cases:
        plant(run.pidfile("worker-0"))
        status = promptly(lambda: view.offline_status(config))
        assert status["hosts"]["worker-0"]["pid"] is None, what
    run.pidfile("worker-0").unlink()
    run.pidfile("worker-0").write_text("4242\n")
    assert view.offline_status(config)["hosts"]["worker-0"]["pid"] == 4242
    victim.assert_unchanged()


def test_offline_status_cli_answers_over_a_fifo_pidfile_and_binary_bytes(
    config: Config, run: RunLayout, tmp_path: Path
) -> None:
    """``reward-supervisor status`` with no daemon, a FIFO pidfile and a non-UTF-8 one:
    it answers (before the old code's hang) and prints no traceback."""
    plant_fifo(run.pidfile("worker-0"))
    run.pidfile("worker-1").write_bytes(b"\xff\xff\n")
    plant_fifo(run.status("worker-1"))
    config_file = tmp_path / "rs.toml"
    config_file.write_text(
        seedimport.render_toml(
            {
                "run": {"root": str(run.root), "shard_count": 2},
                "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
                "control": {"socket": str(tmp_path / "control.sock")},
                "hosts": [{"name": "worker-0", "shard": 0}, {"name": "worker-1", "shard": 1}],
            }
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "status", "-c", str(config_file), "--json"],
        capture_output=True,
        text=True,
        timeout=60,  # a hang would be forever; python start-up alone takes seconds here
        check=False,
    )
    assert "Traceback" not in result.stderr, result.stderr
    hosts = json.loads(result.stdout)["hosts"]
    assert (hosts["worker-0"]["pid"], hosts["worker-1"]["pid"]) == (None, None)
    assert hosts["worker-1"]["last_reason"] == "not a regular file"


# --- status/<host>.json and ctl/<host>.exit.json (read by the watcher) -------------------


def test_status_and_exit_records_are_not_read_through_symlinks_or_fifos(
    run: RunLayout, outside: Path
) -> None:
    """A status file or exit record that is a symlink to a valid record outside is a
    problem ("a symbolic link"), not that record; a FIFO is "not a regular file", at once."""
    victim = Victim.create(outside / "victim", b'{"pid": 7, "ready": true, "heartbeat_at": 1}')
    status, exit_record = run.status("worker-0"), run.exit_record("worker-0")
    plant_symlink(status, victim.path)
    plant_symlink(exit_record, victim.path)
    assert promptly(lambda: read_status(status)) == StatusProblem("a symbolic link")
    assert promptly(lambda: read_exit(exit_record)) is None
    plant_fifo(status)
    plant_fifo(exit_record)
    assert promptly(lambda: read_status(status)) == StatusProblem("not a regular file")
    assert promptly(lambda: read_exit(exit_record)) is None
    victim.assert_unchanged()


# --- manifest.json, ctl/launch_meta.json, the pointer file --------------------------------


def test_run_files_replace_planted_symlinks_and_fifos_and_keep_victims(
    tmp_path: Path, outside: Path
) -> None:
    """manifest.json, launch_meta.json and the pointer file planted as symlinks to victims
    or as FIFOs: each is replaced by our file, the victims keep their bytes, nothing blocks,
    and each file is 0644 even under umask 077 (set on the descriptor, not by path)."""
    pointer = tmp_path / "ws" / "tmp" / "sao-reward-current.json"
    cfg = make_config(tmp_path, pointer_file=str(pointer))
    write_run_files(cfg)
    run = layout_of(cfg)
    write_pointer(pointer, launch_meta(cfg), root=run.root)
    names = [run.manifest, run.launch_meta, pointer]
    for plant in (plant_symlink, None):
        victims = [Victim.create(outside / f"victim-{i}") for i in range(len(names))]
        for path, victim in zip(names, victims, strict=True):
            if plant is None:
                plant_fifo(path)
            else:
                plant(path, victim.path)
        old_umask = os.umask(0o077)
        try:
            promptly(lambda: write_run_files(cfg))
            promptly(lambda: write_pointer(pointer, launch_meta(cfg), root=run.root))
        finally:
            os.umask(old_umask)
        for path, victim in zip(names, victims, strict=True):
            victim.assert_unchanged()
            st = path.lstat()
            assert st.st_mode & 0o777 == 0o644, path
            assert json.loads(path.read_text())["run_id"] == "run-1"


def test_a_pointer_file_inside_the_root_is_written_as_a_run_file(
    config: Config, run: RunLayout, outside: Path
) -> None:
    """A pointer file configured inside the run root is written like every file there: its
    directory swapped for a symlink is refused, naming it, and nothing lands outside."""
    pointer = run.root / "pointers" / "current.json"
    write_pointer(pointer, launch_meta(config), root=run.root)
    assert json.loads(pointer.read_text())["run_id"] == "run-1"
    swap_for_symlink(pointer.parent, outside)
    with pytest.raises(UnsafeFileError) as caught:
        promptly(lambda: write_pointer(pointer, launch_meta(config), root=run.root))
    assert caught.value.path == str(pointer.parent)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("swapped", ["ctl", "inbox", "status"])
def test_run_files_refuse_a_directory_swapped_for_a_symlink(
    config: Config, run: RunLayout, outside: Path, swapped: str
) -> None:
    """With ``ctl/``, ``inbox/`` or ``status/`` swapped for a symlink to another directory,
    writing the run files fails naming that directory, and creates nothing in it."""
    swap_for_symlink(run.root / swapped, outside)
    with pytest.raises(UnsafeFileError) as caught:
        promptly(lambda: write_run_files(config))
    assert caught.value.path == str(run.root / swapped)
    assert list(outside.iterdir()) == []


def test_import_seed_reads_launch_meta_without_following_or_blocking(
    tmp_path: Path, outside: Path
) -> None:
    """import-seed over a seed run whose launch_meta.json is a symlink or a FIFO refuses,
    promptly, naming the file."""
    root = tmp_path / "seed-run"
    meta = root / "ctl" / "launch_meta.json"
    victim = Victim.create(outside / "meta.json", json.dumps({"workers": []}).encode())
    plants: list[tuple[Plant, str]] = [
        (lambda: plant_symlink(meta, victim.path), "a symbolic link"),
        (lambda: plant_fifo(meta), "not a regular file"),
    ]
    for plant, reason in plants:
        plant()
        with pytest.raises(seedimport.ImportProblem) as caught:
            promptly(
                lambda: seedimport.config_from_seed(
                    root=str(root),
                    launch_meta=None,
                    environ={},
                    known_hosts="/k",
                    client_keys=None,
                    username=None,
                )
            )
        assert str(meta) in str(caught.value) and reason in str(caught.value)
    victim.assert_unchanged()


# --- cleanup ----------------------------------------------------------------------------


def fill(directory: Path, names: list[str]) -> None:
    """Create ``directory`` with a small file per name."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text(name)


def half_done(directory: Path) -> bool:
    """One of ``c/`` and ``d/`` in ``directory`` is emptied or gone, the other not yet."""
    done = [not (directory / s).is_dir() or not any((directory / s).iterdir()) for s in "cd"]
    return sum(done) == 1


def test_cleanup_never_deletes_outside_the_root_when_a_directory_is_swapped_mid_delete(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While cleanup deletes ``b/`` (one of its subdirectories done, the other not), ``b`` is
    moved aside and replaced by a symlink to a directory of the same shape outside: every
    file outside survives, and the link itself is what gets removed."""
    cfg = make_config(tmp_path, cleanup_prefix=str(tmp_path / "runs"))
    root = layout_of(cfg).root
    for sub in ("c", "d"):
        fill(root / "b" / sub, [f"{sub}-{i}" for i in range(3)])
        fill(outside / sub, [f"{sub}-{i}" for i in range(3)])
    fill(root / "a", ["a-0"])
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    swapped: list[bool] = []

    def out(line: str) -> None:
        """cleanup's progress output: swap ``b`` once half of it is gone."""
        b = root / "b"
        if not swapped and not b.is_symlink() and b.is_dir() and half_done(b):
            b.rename(root / "b-moved")
            b.symlink_to(outside, target_is_directory=True)
            swapped.append(True)

    monkeypatch.setattr(cleanup, "PROGRESS_EVERY_S", -1.0)  # progress after every directory
    with contextlib.suppress(cleanup.Refused, OSError):
        cleanup.run(cfg, yes=True, out=out)
    assert swapped == [True]
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before
    assert not (root / "b").exists() and not (root / "b").is_symlink()


def test_cleanup_refuses_a_root_replaced_after_its_checks(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run root swapped for a symlink between the checks and the delete is not followed:
    cleanup stops, naming the root, and the directory it pointed to keeps its files."""
    cfg = make_config(tmp_path, cleanup_prefix=str(tmp_path / "runs"))
    root = layout_of(cfg).root
    fill(root / "ctl", ["x"])
    fill(outside, ["precious"])
    real_probe = cleanup.check_no_live_workers

    def swap_then_check(config: Config, out: Callable[[str], None]) -> None:
        """The last check before the delete; the root is swapped right after it."""
        real_probe(config, out)
        root.rename(root.with_name("run-1.moved"))
        root.symlink_to(outside, target_is_directory=True)

    monkeypatch.setattr(cleanup, "check_no_live_workers", swap_then_check)
    with pytest.raises(cleanup.Refused) as caught:
        cleanup.run(cfg, yes=True, out=lambda _line: None)
    assert str(root) in str(caught.value)
    assert (outside / "precious").read_text() == "precious"


def test_cleanup_deletes_a_deep_tree_with_links_fifos_and_no_write_bits(
    tmp_path: Path, outside: Path
) -> None:
    """A tree 300 levels deep with symlinks to outside files and directories, FIFOs and
    read-only directories is removed entirely; the link targets are untouched."""
    cfg = make_config(tmp_path, cleanup_prefix=str(tmp_path / "runs"))
    root = layout_of(cfg).root
    victim = Victim.create(outside / "victim")
    deep = root
    for i in range(300):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "file").write_text("x")
    (root / "link-to-file").symlink_to(victim.path)
    (root / "link-to-dir").symlink_to(outside, target_is_directory=True)
    os.mkfifo(root / "fifo")
    fill(root / "ro", ["f"])
    (root / "ro").chmod(0o555)
    said: list[str] = []
    assert cleanup.run(cfg, yes=True, out=said.append) == 0
    assert not root.exists()
    assert said[-1] == f"removed {root} (307 entries)"
    victim.assert_unchanged()
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


# --- as a user other than root ------------------------------------------------------------


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A scratch directory owned by user nobody (the tests' tmp_path is root's, 0700)."""
    if os.geteuid() != 0:
        pytest.skip("becoming user nobody needs root (CI runs as root)")
    user = pwd.getpwnam("nobody")
    path = Path(tempfile.mkdtemp(prefix="hostile-files-"))
    path.chmod(0o755)
    os.chown(path, user.pw_uid, user.pw_gid)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def as_nobody(fn: Callable[[], str]) -> str:
    """``fn()`` in a forked child that dropped to user nobody; what it returned."""
    user = pwd.getpwnam("nobody")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.write(write_fd, fn().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        out = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out


def test_a_non_root_daemon_refuses_links_to_its_own_files(nobody_dir: Path) -> None:
    """Running as nobody, the daemon's writes meet victims nobody owns (so the kernel's
    permission checks cannot save them): a symlinked or hard-linked lock is refused, a
    symlinked sentinel and state file are replaced, and the victims keep their bytes."""
    root = nobody_dir / "run"
    outside = nobody_dir / "outside"

    def scenario() -> str:
        """As nobody: plant, act, report what happened."""
        run = RunLayout(root)
        runfiles.ensure_dirs(root, [run.ctl])
        outside.mkdir()
        victims = [Victim.create(outside / f"v{i}") for i in range(4)]
        results = []
        lock = run.ctl / "supervisor.lock"
        lock.symlink_to(victims[0].path)
        for plant in (None, "link"):
            if plant == "link":
                lock.unlink()
                os.link(victims[1].path, lock)
            try:
                os.close(runfiles.lock_run(lock, root=root))
                results.append("locked")
            except UnsafeFileError as exc:
                results.append(exc.reason)
        run.stop_sentinel("h").symlink_to(victims[2].path)
        runfiles.write_stop_sentinel(run.stop_sentinel("h"), root=root)
        run.state_file.symlink_to(victims[3].path)
        runfiles.write_json_atomic(run.state_file, {}, root=root)
        for victim in victims:
            victim.assert_unchanged()
        return ",".join(results)

    assert as_nobody(scenario) == "a symbolic link,hard-linked"


def test_cleanup_as_nobody_stops_cleanly_where_it_may_not_delete(nobody_dir: Path) -> None:
    """Run by a non-root operator over a tree holding a root-owned directory and a symlink to
    a file of that operator: cleanup stops with a refusal naming the file it could not remove
    (no traceback), and the symlink's target keeps its bytes."""
    user = pwd.getpwnam("nobody")
    cfg = make_config(nobody_dir, cleanup_prefix=str(nobody_dir / "runs"))
    root = layout_of(cfg).root
    fill(root / "ctl", ["a", "b"])
    fill(root / "roots", ["f"])  # stays root's: nobody may not unlink inside it
    victim = Victim.create(nobody_dir / "outside" / "victim")
    (root / "link").symlink_to(victim.path)
    for path in [nobody_dir / "runs", root, root / "ctl", *(root / "ctl").iterdir()]:
        os.chown(path, user.pw_uid, user.pw_gid)
    os.chown(victim.path, user.pw_uid, user.pw_gid)
    os.lchown(root / "link", user.pw_uid, user.pw_gid)
    victim = Victim(victim.path, Victim.look(victim.path))

    def scenario() -> str:
        """As nobody: clean up; what cleanup said when it stopped."""
        try:
            cleanup.run(cfg, yes=True, out=lambda _line: None)
        except cleanup.Refused as exc:
            return str(exc)
        return "deleted everything"

    said = as_nobody(scenario)
    assert said.startswith(f"stopped deleting {root}, part of it remains")
    assert f"Permission denied: '{root / 'roots' / 'f'}'" in said
    victim.assert_unchanged()
