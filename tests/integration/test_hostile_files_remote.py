"""The agent and shepherd on a worker host, through the real OpenSSH sshd, meeting hostile names
under the shared run root: the shard lock, the log and its rotations, the pidfile, launch and
exit records and their temp names, a swapped ``ctl/``, and a package planted to be imported.

Each plant is a symlink to a victim outside the root, a FIFO, or a hard link: the victim keeps
its bytes, the launch answers (a FIFO would otherwise hold it until the 60 s report timeout)
and, where it is refused, the error names the file.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import agent as agent_module
from supervisor import remote
from supervisor.config import Config
from supervisor.errors import RemoteError
from supervisor.layout import LaunchSpec, launch_spec
from tests.integration.test_hostile_files import (
    Victim,
    plant_fifo,
    plant_symlink,
    swap_for_symlink,
)
from tests.integration.test_launcher import make_spec
from tests.integration.test_remote import Reaper, maintained, make_config, read_json, wait_until
from tests.sshd import OpenSsh

pytestmark = pytest.mark.openssh

#: A launch answers in well under a second; a shepherd blocked on a FIFO would hold it until
#: the agent's 60 s report timeout. Generous for a loaded machine, far below that.
ANSWER_S = 20.0
SLEEPER = ["sleep", "300"]
#: A python user nobody may run (the venv's lives under root's 0700 home).
SYSTEM_PYTHON = Path("/usr/bin/python3")


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    """Workers launched by a test die with it."""
    keeper = Reaper()
    try:
        yield keeper
    finally:
        keeper.reap()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The run root on the "shared" filesystem."""
    return tmp_path / "shared" / "run"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the run root."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


def sleeper_config(openssh: OpenSsh, root: Path, **worker: Any) -> Config:
    """A one-host config whose worker is ``sleep 300`` (what it runs does not matter here)."""
    return make_config(openssh, root, argv=SLEEPER, worker=worker)


async def refused_launch(config: Config) -> str:
    """Launch on the host and expect a refusal; its text."""
    async with maintained(config) as h:
        with pytest.raises(RemoteError) as caught:
            async with asyncio.timeout(ANSWER_S):
                await h.remote.launch(h.spec)
    return str(caught.value)


# --- the shard lock ----------------------------------------------------------------------


@pytest.mark.parametrize("plant", ["symlink", "fifo", "hard link"])
async def test_shard_lock_planted_is_refused_naming_it(
    openssh: OpenSsh, root: Path, outside: Path, plant: str
) -> None:
    """The shard lock (rewritten in place by the shepherd) planted as a symlink to a victim,
    a FIFO or a hard link of the victim: the launch is refused naming the lock, at once, and
    the victim keeps its bytes."""
    config = sleeper_config(openssh, root)
    spec = launch_spec(config, config.hosts[0])
    lock = Path(spec.lock)
    victim = Victim.create(outside / "victim")
    if plant == "symlink":
        plant_symlink(lock, victim.path)
    elif plant == "fifo":
        plant_fifo(lock)
    else:
        os.link(victim.path, lock)
    error = await refused_launch(config)
    assert str(lock) in error
    victim.assert_unchanged()
    assert not Path(spec.pidfile).exists()


# --- the log and its rotations -----------------------------------------------------------


@pytest.mark.parametrize("plant", ["symlink", "fifo", "hard link"])
async def test_worker_log_planted_is_refused_naming_it(
    openssh: OpenSsh, root: Path, outside: Path, plant: str
) -> None:
    """``ctl/<host>.log`` (appended to) planted as a symlink, a FIFO or a hard link: the
    launch is refused naming the log, no worker starts, the victim keeps its bytes."""
    config = sleeper_config(openssh, root)
    spec = launch_spec(config, config.hosts[0])
    log = Path(spec.log)
    victim = Victim.create(outside / "victim")
    if plant == "symlink":
        plant_symlink(log, victim.path)
    elif plant == "fifo":
        plant_fifo(log)
    else:
        os.link(victim.path, log)
    error = await refused_launch(config)
    assert str(log) in error
    victim.assert_unchanged()
    assert not Path(spec.pidfile).exists()


async def test_log_truncation_never_follows_a_symlinked_log(
    openssh: OpenSsh, root: Path, outside: Path
) -> None:
    """With no backups kept a large log is truncated in place: a log that is a symlink to a
    large victim is refused, not truncated through."""
    config = sleeper_config(openssh, root, log_max_bytes=4096, log_backups=0)
    spec = launch_spec(config, config.hosts[0])
    victim = Victim.create(outside / "victim", b"x" * 8192)
    plant_symlink(Path(spec.log), victim.path)
    error = await refused_launch(config)
    assert spec.log in error and "symbolic link" in error
    victim.assert_unchanged()


async def test_log_rotation_moves_planted_backups_and_never_follows_them(
    openssh: OpenSsh, root: Path, outside: Path, reaper: Reaper
) -> None:
    """``.1`` and ``.2`` planted as symlinks to victims while the log is over its cap: the
    rotation renames names (the links move, the victims stay as they were) and the worker
    starts on a fresh, regular log."""
    config = sleeper_config(openssh, root, log_max_bytes=4096, log_backups=2)
    spec = launch_spec(config, config.hosts[0])
    log = Path(spec.log)
    log.write_text("old\n" * 2000)
    victims = [Victim.create(outside / f"victim-{i}") for i in (1, 2)]
    plant_symlink(Path(f"{spec.log}.1"), victims[0].path)
    plant_symlink(Path(f"{spec.log}.2"), victims[1].path)
    async with maintained(config) as h:
        async with asyncio.timeout(ANSWER_S):
            started = reaper.add(await h.remote.launch(h.spec))
    assert Path(f"{spec.log}.1").read_text() == "old\n" * 2000
    assert os.readlink(f"{spec.log}.2") == str(victims[0].path)  # .1 moved to .2, as a link
    for victim in victims:
        victim.assert_unchanged()
    assert not log.is_symlink() and log.lstat().st_nlink == 1
    assert f"worker pid {started.pid} started" in log.read_text()


# --- pidfile, launch record, exit record and their temp names ----------------------------


def predictable_temp_names(spec: LaunchSpec, count: int) -> list[Path]:
    """The temp names the old shepherd used (``.<name>.<its pid>.tmp``) for the next
    ``count`` pids this machine hands out."""
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    # Past pid_max the kernel wraps around to 300 (the pids below are reserved).
    pids = {pid if pid < top else 300 + pid - top for pid in range(last + 1, last + count + 1)}
    names = []
    for path in (spec.pidfile, spec.launch_record, spec.exit_record):
        p = Path(path)
        names += [p.with_name(f".{p.name}.{pid}.tmp") for pid in sorted(pids)]
    return names


async def test_records_are_written_without_following_planted_names(
    openssh: OpenSsh, root: Path, outside: Path, reaper: Reaper
) -> None:
    """Pidfile, launch record and exit record planted as symlinks to victims, and the next
    few thousand pids' worth of the old predictable temp names too: the shepherd writes each
    record as a new regular file (random temp name, O_EXCL), and no victim changes."""
    config = sleeper_config(openssh, root)
    spec = launch_spec(config, config.hosts[0])
    records = [Path(spec.pidfile), Path(spec.launch_record), Path(spec.exit_record)]
    victims = [Victim.create(outside / f"victim-{i}") for i in range(len(records))]
    for path, victim in zip(records, victims, strict=True):
        plant_symlink(path, victim.path)
    temp_victim = Victim.create(outside / "temp-victim")
    temps = predictable_temp_names(spec, 3000)
    for name in temps:
        name.symlink_to(temp_victim.path)
    async with maintained(config) as h:
        async with asyncio.timeout(ANSWER_S):
            started = reaper.add(await h.remote.launch(h.spec))
        os.killpg(started.pid, signal.SIGKILL)
        await wait_until(
            lambda: (
                (r := read_json(Path(spec.exit_record))) is not None and r.get("pid") == started.pid
            ),
            f"the exit record of pid {started.pid}",
        )
    for path in records:
        assert not path.is_symlink() and path.lstat().st_nlink == 1, path
    assert Path(spec.pidfile).read_text() == f"{started.pid}\n"
    for victim in [*victims, temp_victim]:
        victim.assert_unchanged()
    left = {p.name for p in Path(spec.exit_record).parent.iterdir() if p.name.endswith(".tmp")}
    assert left == {p.name for p in temps}  # the planted ones, and no temp file of ours


@pytest.mark.parametrize("record", ["pidfile", "launch_record"])
async def test_fifo_records_are_read_without_blocking(
    openssh: OpenSsh, root: Path, reaper: Reaper, record: str
) -> None:
    """A FIFO as the pidfile or the launch record: a probe answers at once (nothing found),
    and a launch goes ahead and replaces the FIFO with the record."""
    config = sleeper_config(openssh, root)
    spec = launch_spec(config, config.hosts[0])
    path = Path(getattr(spec, record))
    plant_fifo(path)
    async with maintained(config) as h, asyncio.timeout(ANSWER_S):
        assert await h.remote.probe(h.spec, os.getpid()) is None  # a live pid, not a worker
        started = reaper.add(await h.remote.launch(h.spec))
        assert await h.remote.probe(h.spec, None) == started.pid
    assert path.is_file()


async def test_a_ctl_swapped_for_a_symlink_is_refused_and_nothing_lands_outside(
    openssh: OpenSsh, root: Path, outside: Path
) -> None:
    """``ctl/`` replaced by a symlink to another directory: the launch is refused naming
    ``ctl``, and not one file appears in the directory it points to."""
    config = sleeper_config(openssh, root)
    spec = launch_spec(config, config.hosts[0])
    ctl = Path(spec.lock).parent
    swap_for_symlink(ctl, outside)
    error = await refused_launch(config)
    assert f"{ctl}: not a directory (a symbolic link)" in error
    assert list(outside.iterdir()) == []


def test_a_record_directory_swapped_for_a_symlink_kills_the_unrecorded_worker(
    tmp_path: Path,
) -> None:
    """The pidfile's directory is a symlink when the shepherd records the worker it started:
    the write is refused, the worker is killed rather than left running unrecorded beside
    the next launch, and nothing lands where the symlink points."""
    root = tmp_path / "run"
    outside = tmp_path / "outside"
    outside.mkdir()
    spec = make_spec(root)
    (root / "records").symlink_to(outside)
    spec["pidfile"] = str(root / "records" / "worker-0.pid")
    with pytest.raises(agent_module.OpError, match="cannot record the worker's pid"):
        agent_module._start(spec, "test")
    said = re.search(
        r"cannot record worker pid (\d+): (.*); killed it", Path(spec["log"]).read_text()
    )
    assert said is not None
    assert said.group(2) == f"{root / 'records'}: not a directory (a symbolic link)"
    assert agent_module.is_dead(agent_module.proc_stat(int(said.group(1))))
    assert list(outside.iterdir()) == []


# --- the worker's working directory --------------------------------------------------------


async def test_worker_never_imports_a_package_planted_in_the_run_root(
    openssh: OpenSsh, root: Path, tmp_path: Path, reaper: Reaper
) -> None:
    """``<root>/areal/__init__.py`` planted by anyone who can write the run root is not run
    by ``python -m areal.reward.fs_worker`` (the default argv): the worker starts in its home,
    not in the root that ``python -m`` would put first on ``sys.path``."""
    marker = tmp_path / "planted-code-ran"
    package = root / "areal"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (package / "reward").mkdir()
    (package / "reward" / "__init__.py").write_text("")
    (package / "reward" / "fs_worker.py").write_text("import time\ntime.sleep(300)\n")
    argv = [sys.executable, "-m", "areal.reward.fs_worker", "--root", "{root}"]
    config = make_config(openssh, root, argv=argv)
    spec = launch_spec(config, config.hosts[0])
    async with maintained(config) as h:
        async with asyncio.timeout(ANSWER_S):
            started = reaper.add(await h.remote.launch(h.spec))
        await wait_until(
            lambda: (
                (r := read_json(Path(spec.exit_record))) is not None and r.get("pid") == started.pid
            ),
            "the worker to fail to import areal, and exit",
        )
    assert not marker.exists()
    assert "No module named 'areal'" in Path(spec.log).read_text()


def test_worker_cwd_is_home_and_never_inside_the_run_root(tmp_path: Path) -> None:
    """The worker's cwd is its HOME; a HOME inside the run root (or missing, or not
    searchable) falls back to the account's home, and then to ``/``."""
    root = tmp_path / "run"
    (root / "home").mkdir(parents=True)
    account = pwd.getpwuid(os.getuid()).pw_dir
    assert agent_module.worker_cwd({"HOME": str(tmp_path)}, str(root)) == str(tmp_path)
    assert agent_module.worker_cwd({"HOME": str(root / "home")}, str(root)) == account
    assert agent_module.worker_cwd({"HOME": str(root)}, str(root)) == account
    assert agent_module.worker_cwd({"HOME": "relative"}, str(root)) == account
    assert agent_module.worker_cwd({}, account) == "/"  # the account's home is the root


# --- as user nobody ----------------------------------------------------------------------


@pytest.fixture
def nobody_root() -> Iterator[Path]:
    """A scratch directory user nobody owns (pytest's tmp_path is root's and 0700)."""
    if os.geteuid() != 0 or not SYSTEM_PYTHON.exists() or not shutil.which("setpriv"):
        pytest.skip("needs root (to become nobody), setpriv and a python nobody may run")
    user = pwd.getpwnam("nobody")
    path = Path(tempfile.mkdtemp(prefix="hostile-remote-"))
    path.chmod(0o755)
    os.chown(path, user.pw_uid, user.pw_gid)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def test_agent_as_nobody_refuses_links_to_files_nobody_owns(nobody_root: Path) -> None:
    """An agent running as nobody (where the kernel's permission check cannot protect the
    victim: nobody owns it) refuses a symlinked log and a hard-linked shard lock, naming each,
    and writes nothing into the victims."""
    user = pwd.getpwnam("nobody")
    scratch = nobody_root
    root = scratch / "run"
    ctl = root / "ctl"
    ctl.mkdir(parents=True)
    victims = [Victim.create(scratch / f"victim-{i}") for i in range(2)]
    for path in (root, ctl, *(v.path for v in victims)):
        os.chown(path, user.pw_uid, user.pw_gid)
    victims = [Victim(v.path, Victim.look(v.path)) for v in victims]
    spec: dict[str, Any] = {
        "host": "h",
        "shard": 0,
        "argv": SLEEPER,
        "env": {},
        "python": str(SYSTEM_PYTHON),
        "root": str(root),
        "pidfile": str(ctl / "h.pid"),
        "launch_record": str(ctl / "h.launch.json"),
        "exit_record": str(ctl / "h.exit.json"),
        "log": str(ctl / "h.log"),
        "lock": str(ctl / "shard-0.lock"),
        "log_max_bytes": 1 << 20,
        "log_backups": 1,
    }
    requests = []
    (ctl / "h.log").symlink_to(victims[0].path)
    requests.append({"id": 1, "op": "launch", "spec": spec})
    replies = run_agent_as_nobody(requests)
    (ctl / "h.log").unlink()
    (ctl / "shard-0.lock").unlink()  # made by the first launch, which then met the log
    os.link(victims[1].path, ctl / "shard-0.lock")
    replies += run_agent_as_nobody([{"id": 2, "op": "launch", "spec": spec}])
    assert [r["ok"] for r in replies] == [False, False], replies
    assert replies[0]["error"] == f"{ctl / 'h.log'}: a symbolic link (not followed)"
    assert replies[1]["error"] == f"{ctl / 'shard-0.lock'}: hard-linked (2 links)"
    for victim in victims:
        victim.assert_unchanged()


def run_agent_as_nobody(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Serve ``requests`` with an agent running as user nobody; its replies (not the hello)."""
    with subprocess.Popen(
        [
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            str(SYSTEM_PYTHON),
            "-X",
            "utf8",
            "-u",
            "-c",
            remote.agent_program(),
            "agent",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as agent:
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write("".join(json.dumps(r) + "\n" for r in requests))
        agent.stdin.flush()
        lines = [agent.stdout.readline() for _ in range(len(requests) + 1)]
        agent.stdin.close()
        assert agent.wait(timeout=ANSWER_S) == 0
    return [reply for reply in map(json.loads, lines) if "hello" not in reply]
