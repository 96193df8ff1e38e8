"""A new user's first fleet, as the README tells it, by a user who is not root: ``init``
(keys read from the hosts and confirmed), ``check-config``, ``preflight``, ``run``,
``status``, against a real OpenSSH sshd on loopback, with the reference worker and (where
areal-fs is) the real AReaL worker.

The tests run as root, so the user is one of our own, ``rs-first-hour`` (made once per
machine with ``useradd`` and left there; it has no password and a home of its own), and every
command runs as that user through ``setpriv`` with a clean environment: Debian's
``/usr/bin/python3`` with the checkout and the test venv's packages on ``PYTHONPATH`` (the
venv's own interpreter lives under root's 0700 home), as an installed package would be. The
hosts log in as that user too, with a key it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from supervisor import config as config_mod
from tests.sshd import OpenSsh

pytestmark = [pytest.mark.system, pytest.mark.openssh]

REPO = Path(__file__).resolve().parent.parent.parent
USER = "rs-first-hour"
SYSTEM_PYTHON = Path("/usr/bin/python3")
#: Whole commands (an SSH handshake per host and key type, a python start each).
COMMAND_TIMEOUT_S = 120.0
#: From ``run`` to every host ready: two logins, two agents, two workers' first heartbeats.
READY_TIMEOUT_S = 90.0


def _can_become_a_user() -> str | None:
    """Why this machine cannot run these tests, or None."""
    if os.geteuid() != 0:
        return "needs root, to make and become a user of its own"
    if not (shutil.which("useradd") and shutil.which("setpriv")):
        return "needs useradd and setpriv"
    if not SYSTEM_PYTHON.exists():
        return f"needs {SYSTEM_PYTHON}, a python any user may run"
    version = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if version != str(sys.version_info[:2]):
        return (
            f"{SYSTEM_PYTHON} is {version}: the test venv's packages are for {sys.version_info[:2]}"
        )
    return None


def _the_user() -> pwd.struct_passwd:
    """``rs-first-hour``, made the first time (under a lock: test runs share the machine)."""
    with open("/tmp/rs-first-hour-useradd.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(USER)
        # "*": no password, yet not locked ("!"), which sshd without PAM would refuse.
        subprocess.run(
            ["useradd", "--create-home", "--shell", "/bin/sh", "--password", "*", USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(USER)


@dataclass
class User:
    """The test's unprivileged user and how to run a command as it."""

    entry: pwd.struct_passwd
    #: PYTHONPATH of the supervisor as installed: the checkout, then the venv's packages.
    pythonpath: str

    @property
    def uid(self) -> int:
        """Its uid."""
        return self.entry.pw_uid

    def argv(self, *command: str) -> list[str]:
        """``command`` run as the user, its groups cleared."""
        return [
            *("setpriv", f"--reuid={self.entry.pw_uid}", f"--regid={self.entry.pw_gid}"),
            "--clear-groups",
            *command,
        ]

    def env(self) -> dict[str, str]:
        """A login's environment, nothing of the test run's (no coverage, no venv)."""
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.entry.pw_dir,
            "USER": USER,
            "LOGNAME": USER,
            "LANG": "C.UTF-8",
            "PYTHONPATH": self.pythonpath,
        }

    def supervisor(self, *args: str) -> list[str]:
        """``reward-supervisor ARGS`` as the user (the console script's entry point; -S: not
        Debian's own packages, only those an install of ours would have)."""
        return self.argv(str(SYSTEM_PYTHON), "-S", str(REPO / "reward_supervisor.py"), *args)

    def run(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """``reward-supervisor ARGS`` as the user, to completion, stdin not a terminal."""
        return subprocess.run(
            self.supervisor(*args),
            env=self.env(),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )


@pytest.fixture(scope="module")
def user() -> User:
    """The unprivileged user (skips where one cannot be made or become)."""
    why = _can_become_a_user()
    if why is not None:
        pytest.skip(why)
    return User(_the_user(), f"{REPO}{os.pathsep}{sysconfig.get_paths()['purelib']}")


@dataclass
class Site:
    """What the user has: a directory of its own, a key, and hosts on a loopback sshd."""

    base: Path
    home: Path
    key: Path
    sshd: OpenSsh
    #: Run roots go under here (the user's: it makes them).
    shared: Path
    daemons: list[asyncio.subprocess.Process] = field(default_factory=list)


@pytest.fixture
def site(user: User) -> Iterator[Site]:
    """A directory the user may reach (pytest's is root's, 0700), an sshd whose authorized
    key is the user's own new one; everything removed, every worker killed, afterwards."""
    base = Path(tempfile.mkdtemp(prefix="rs-first-hour-", dir="/tmp"))
    base.chmod(0o755)
    home, shared = base / "home", base / "shared"
    for directory in (home, shared):
        directory.mkdir(mode=0o700)
        os.chown(directory, user.uid, user.entry.pw_gid)
    key = home / "id_ed25519"
    subprocess.run(
        user.argv("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", USER, "-f", str(key)),
        env=user.env(),
        check=True,
        capture_output=True,
    )
    # sshd reads authorized keys as the user: the whole path must be the user's to read.
    sshd = OpenSsh.create(base / "sshd")
    try:
        with sshd.authorized_keys.open("a") as keys:
            keys.write(key.with_name("id_ed25519.pub").read_text())
        sshd.authorized_keys.chmod(0o644)
        yield Site(base=base, home=home, key=key, sshd=sshd, shared=shared)
    finally:
        sshd.stop()
        _kill_workers(shared)
        shutil.rmtree(base, ignore_errors=True)


def _kill_workers(shared: Path) -> None:
    """SIGKILL every worker a run under ``shared`` left (a failed test's)."""
    for pidfile in shared.glob("*/ctl/*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pidfile.read_text().strip())
            if str(shared) in Path(f"/proc/{pid}/cmdline").read_text():
                os.killpg(pid, signal.SIGKILL)


@dataclass
class Stack:
    """The worker the fleet runs: the reference one, or the real AReaL worker."""

    name: str
    init_args: tuple[str, ...]


@pytest.fixture(params=["reference", "real"])
def stack(request: pytest.FixtureRequest) -> Stack:
    """``real`` skips, named, where areal-fs is absent (the ``areal_fs`` fixture)."""
    if request.param == "reference":
        return Stack(
            "reference",
            (
                *("--worker-module", "supervisor.demo.worker"),
                *("--reward-fn", "supervisor.demo.worker.exact_match"),
                *("--env", f"PYTHONPATH={REPO}"),
            ),
        )
    areal: Path = request.getfixturevalue("areal_fs")
    # The default worker module and reward fn: both are areal-fs's.
    return Stack("real", ("--env", f"PYTHONPATH={areal}"))


@contextlib.asynccontextmanager
async def daemon(user: User, config: Path) -> AsyncIterator[Daemon]:
    """``reward-supervisor run -c CONFIG`` as the user; killed on the way out if still up."""
    process = await asyncio.create_subprocess_exec(
        *user.supervisor("run", "-c", str(config), "--log-format", "json"),
        env=user.env(),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    running = Daemon(process)
    reader = asyncio.create_task(running.read())
    try:
        yield running
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


@dataclass
class Daemon:
    """A running daemon's process and the log lines it wrote."""

    process: asyncio.subprocess.Process
    lines: list[dict[str, Any]] = field(default_factory=list)
    other: list[str] = field(default_factory=list)

    async def read(self) -> None:
        """Keep every stdout line (JSON, or kept as text)."""
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            text = raw.decode(errors="replace").rstrip("\n")
            try:
                self.lines.append(json.loads(text))
            except ValueError:
                self.other.append(text)

    async def logged(self, event: str) -> dict[str, Any]:
        """The first line with ``event``, waited for (the daemon must not exit first)."""
        async with asyncio.timeout(READY_TIMEOUT_S):
            while True:
                found = [line for line in self.lines if line.get("event") == event]
                if found:
                    return found[0]
                if self.process.returncode is not None:
                    pytest.fail(f"the daemon exited before {event}: {self.lines[-5:]} {self.other}")
                await asyncio.sleep(0.05)  # wait-ok: polling its log under a deadline


async def in_thread(user: User, *args: str) -> subprocess.CompletedProcess[str]:
    """``user.run`` without blocking the event loop (the daemon's log is read on it)."""
    return await asyncio.to_thread(user.run, *args)


def fingerprint(public_key: Path) -> str:
    """``SHA256:...`` of a public key, as ``ssh-keygen -lf`` prints it on the host."""
    listed = subprocess.run(
        ["ssh-keygen", "-lf", str(public_key)], capture_output=True, text=True, check=True
    )
    return listed.stdout.split()[1]


def stderr_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    """What a command said on stderr, line by line."""
    return done.stderr.splitlines()


async def test_a_user_who_is_not_root_goes_from_init_to_a_ready_fleet(
    user: User, site: Site, stack: Stack
) -> None:
    """As the README's "A first real fleet" says, by a user who is not root: ``init --scan``
    shows each host's key with the fingerprint the host itself prints and writes nothing
    until told yes (a script without a terminal is refused); the config it writes is clean
    for ``check-config`` (no warning, the reward fn found) and ``preflight``; ``run`` puts
    its control socket in a private place of the user's own, and ``status`` and ``stop``,
    given only the config, find it: two hosts ready, then stopped."""
    port = site.sshd.port
    hosts = f"127.0.0.1:{port},127.0.0.2:{port}"
    config = site.home / f"fleet-{secrets.token_hex(3)}.toml"
    root = site.shared / "run-1"
    init = [
        *("init", "--hosts", hosts, "--root", str(root), "--key", str(site.key), "--scan"),
        *("--python", str(SYSTEM_PYTHON), "--concurrency", "2", "-o", str(config)),
        *stack.init_args,
    ]

    refused = await in_thread(user, *init)
    assert refused.returncode == 1, refused.stderr
    assert "host keys not confirmed: nothing written" in refused.stderr
    assert not config.exists() and not config.with_suffix(".known_hosts").exists()
    host_fingerprint = fingerprint(site.sshd.host_key.with_name("ssh_host_ed25519_key.pub"))
    shown = [line.split() for line in refused.stdout.splitlines() if line.startswith("  ")]
    assert shown == [
        ["127.0.0.1", f"[127.0.0.1]:{port}", "ssh-ed25519", host_fingerprint],
        ["127.0.0.2", f"[127.0.0.2]:{port}", "ssh-ed25519", host_fingerprint],
    ]

    written = await in_thread(user, *init, "--yes")
    assert written.returncode == 0, written.stderr
    assert written.stderr == ""
    assert "check-config: no problems" in written.stdout.splitlines()
    assert f"reward-supervisor preflight -c {config}" in written.stdout
    known = config.with_suffix(".known_hosts").read_text().splitlines()[1:]
    host_key = " ".join(site.sshd.known_hosts.read_text().split()[1:3])
    assert known == [f"[127.0.0.{i}]:{port} {host_key}" for i in (1, 2)]
    assert config.stat().st_uid == user.uid

    checked = await in_thread(user, "check-config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert stderr_lines(checked) == []
    assert "module located" in checked.stdout

    preflight = await in_thread(user, "preflight", "-c", str(config))
    assert preflight.returncode == 0, preflight.stdout + preflight.stderr
    assert preflight.stdout.splitlines()[-1].startswith("preflight: all 2 hosts ok")

    async with daemon(user, config) as running:
        listening = await running.logged("control.listening")
        socket = Path(listening["path"])
        assert socket in config_mod.default_socket_candidates(config, user.uid)
        st = socket.parent.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (user.uid, 0o700)
        deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_S
        while True:
            status = await in_thread(user, "status", "-c", str(config), "--json")
            assert status.returncode == 0, status.stderr
            report = json.loads(status.stdout)
            states = {name: host["state"] for name, host in report["hosts"].items()}
            if states == {"127.0.0.1": "ready", "127.0.0.2": "ready"}:
                break
            assert asyncio.get_running_loop().time() < deadline, states
            await asyncio.sleep(0.25)  # wait-ok: polling the fleet's status under a deadline
        assert report["daemon"].get("all_ready") is True
        stopped = await in_thread(user, "stop", "-c", str(config))
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() == "daemon stopped"
        assert await asyncio.wait_for(running.process.wait(), COMMAND_TIMEOUT_S) == 0
    for host in ("127.0.0.1", "127.0.0.2"):
        assert (root / "status" / f"{host}.json").stat().st_uid == user.uid
