"""The agent's fence against a real OpenSSH sshd: a launch or terminate whose epoch is lower
than the run directory's ``ctl/supervisor.epoch`` is refused (``Fenced``), touching nothing;
one at the current epoch goes through. Plus the run lock and epoch helpers of runfiles."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor import runfiles
from supervisor.errors import Fenced, RunLocked, UnsafeFileError
from supervisor.layout import layout_of
from tests.integration.test_remote import Reaper, is_alive, maintained, make_config
from tests.sshd import OpenSsh

pytestmark = pytest.mark.openssh


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    """A run directory with a space in its name (as test_remote's)."""
    return tmp_path / "shared fs" / "run 1"


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    """Workers launched by a test die with it, whatever the test did."""
    keeper = Reaper()
    try:
        yield keeper
    finally:
        keeper.reap()


def set_epoch(root: Path, epoch: int) -> None:
    """Write the run directory's epoch as a leader would."""
    (root / "ctl" / "supervisor.epoch").write_text(f"{epoch}\n")


async def test_a_lower_epoch_can_neither_launch_nor_terminate(
    openssh: OpenSsh, run_root: Path, reaper: Reaper
) -> None:
    """Epoch 3 on disk: a launch at epoch 2 is fenced and starts nothing; at 3 it starts a
    worker; a terminate at 2 is fenced and the worker lives on; at 4 (a newer leader) it
    stops it."""
    config = make_config(openssh, run_root)
    set_epoch(run_root, 3)
    async with maintained(config) as h:
        old = replace(h.spec, epoch=2)
        assert h.spec.epoch_file == str(run_root / "ctl" / "supervisor.epoch")
        with pytest.raises(Fenced) as fenced:
            await h.remote.launch(old)
        assert "epoch is 3" in fenced.value.reason
        assert not Path(h.spec.pidfile).exists()
        assert await h.remote.probe(h.spec, None) is None

        started = reaper.add(await h.remote.launch(replace(h.spec, epoch=3)))
        await h.wait_ready(started.pid)
        with pytest.raises(Fenced):
            await h.remote.terminate(old, started.pid, grace_s=5, kill=True)
        assert is_alive(started.pid)

        set_epoch(run_root, 4)
        with pytest.raises(Fenced):
            await h.remote.terminate(replace(h.spec, epoch=3), started.pid, grace_s=5, kill=True)
        assert is_alive(started.pid)
        await h.remote.terminate(replace(h.spec, epoch=4), started.pid, grace_s=20, kill=True)
        assert not is_alive(started.pid)


@pytest.mark.parametrize("content", [b"", b"garbage\n", b"-5\n", b"9" * 40 + b"\n"])
async def test_an_unreadable_epoch_file_fences_nothing(
    openssh: OpenSsh, run_root: Path, reaper: Reaper, content: bytes
) -> None:
    """A file that is not a number is no fence (the lock is the election): the launch goes
    through rather than every launch of the run stopping."""
    config = make_config(openssh, run_root)
    (run_root / "ctl" / "supervisor.epoch").write_bytes(content)
    async with maintained(config) as h:
        started = reaper.add(await h.remote.launch(replace(h.spec, epoch=1)))
        assert is_alive(started.pid)


async def test_a_symlinked_epoch_file_is_not_followed(
    openssh: OpenSsh, run_root: Path, reaper: Reaper, tmp_path: Path
) -> None:
    """A symlink planted as the epoch file, pointing at a file saying 99, fences nothing."""
    config = make_config(openssh, run_root)
    target = tmp_path / "elsewhere"
    target.write_text("99\n")
    (run_root / "ctl" / "supervisor.epoch").symlink_to(target)
    async with maintained(config) as h:
        started = reaper.add(await h.remote.launch(replace(h.spec, epoch=1)))
        assert is_alive(started.pid)


# --- runfiles: epoch and lock ------------------------------------------------------------


def test_epoch_bumps_from_nothing_and_from_what_is_there(tmp_path: Path) -> None:
    """No file: 0, and the first bump writes 1; each bump adds one; garbage, a FIFO or an
    oversized file reads as None and bumps to 1; a symlink is replaced, never followed."""
    root = tmp_path / "run"
    (root / "ctl").mkdir(parents=True)
    path = root / "ctl" / "supervisor.epoch"
    assert runfiles.read_epoch(path, root=root) == 0
    assert runfiles.bump_epoch(path, root=root) == 1
    assert runfiles.bump_epoch(path, root=root) == 2
    assert path.read_text() == "2\n"
    path.write_text("nope")
    assert runfiles.read_epoch(path, root=root) is None
    assert runfiles.bump_epoch(path, root=root) == 1
    path.unlink()
    outside = tmp_path / "outside"
    outside.write_text("7\n")
    path.symlink_to(outside)
    assert runfiles.read_epoch(path, root=root) is None
    assert runfiles.bump_epoch(path, root=root) == 1
    assert outside.read_text() == "7\n" and not path.is_symlink()
    path.unlink()
    os.mkfifo(path)  # read without blocking, refused; replaced by the bump
    assert runfiles.read_epoch(path, root=root) is None
    assert runfiles.bump_epoch(path, root=root) == 1
    path.write_bytes(b"9" * 100)  # more than an epoch file holds
    assert runfiles.read_epoch(path, root=root) is None


def test_check_lock_sees_a_replaced_or_removed_lock_file(tmp_path: Path) -> None:
    """Held: None, and another process is refused naming us. The name replaced by another
    file, or removed: the reason (the next daemon would lock the new file)."""
    config_root = tmp_path / "run"
    (config_root / "ctl").mkdir(parents=True)
    lock = config_root / "ctl" / "supervisor.lock"
    fd = runfiles.lock_run(lock, root=config_root)
    try:
        assert runfiles.check_lock(fd, lock, root=config_root) is None
        # (Not read here: closing any descriptor of the file would release our lock.)
        with pytest.raises(RunLocked) as locked:
            _lock_in_child(lock, config_root)
        assert f"pid {os.getpid()}" in locked.value.holder
        assert runfiles.check_lock(fd, lock, root=config_root) is None
        planted = lock.with_name("planted")
        planted.write_text("")
        os.replace(planted, lock)
        assert "replaced" in str(runfiles.check_lock(fd, lock, root=config_root))
        lock.unlink()
        assert "removed" in str(runfiles.check_lock(fd, lock, root=config_root))
    finally:
        os.close(fd)


def _lock_in_child(lock: Path, root: Path) -> None:
    """Try the run lock from another process (lockf locks are per process); re-raise its
    RunLocked here."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        os.close(read)
        try:
            os.close(runfiles.lock_run(lock, root=root))
            os.write(write, b"free")
        except RunLocked as exc:
            os.write(write, exc.holder.encode())
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    if answer != "free":
        raise RunLocked("locked", holder=answer)


def test_lock_holder_and_layout_paths(tmp_path: Path, openssh: OpenSsh) -> None:
    """``lock_holder`` reads who wrote the lock, "" when there is none or it is unsafe."""
    root = tmp_path / "run"
    config = make_config(openssh, root)
    run = layout_of(config)
    assert run.lock_file == root / "ctl" / "supervisor.lock"
    assert runfiles.lock_holder(run.lock_file, root=root) == ""
    run.lock_file.write_text("node-a pid 1\n")
    assert runfiles.lock_holder(run.lock_file, root=root) == "node-a pid 1"
    run.lock_file.unlink()
    run.lock_file.symlink_to(tmp_path / "x")
    assert runfiles.lock_holder(run.lock_file, root=root) == ""
    with pytest.raises(UnsafeFileError):
        runfiles.lock_run(run.lock_file, root=root)
