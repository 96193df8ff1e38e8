"""The script reward-supervisor replaces, run for real: found, copied, patched and driven.

The seed (``reward_workers_ctl.py``) and its ``selfmatch-fix.patch`` are used from where the
team keeps them, ``../shared/seed/`` beside the checkout (never copied into it);
``$REWARD_SUPERVISOR_SEED`` (the script, or the directory holding it and its patch) points the
tests at another place.

``SeedWorld.create(workdir, openssh, hosts=N)`` makes what the seed needs to run as it does in
production, on the session's OpenSSH server:

- a copy of the script with ``selfmatch-fix.patch`` applied (unpatched, its ``ps | case``
  sweep matches its own ``bash -c`` text and kills the session that runs it);
- a workspace ``$SAO_WS`` with a stand-in ``areal`` package under ``repo/AReaL``:
  ``areal.reward.fs_protocol`` (the two functions the seed imports) and
  ``areal.reward.fs_worker``, which is the reference worker (``supervisor.demo.worker``);
  or, with ``areal=`` (an areal-fs directory, ``tests/areal.py``), the real ``areal`` package
  there and this repository's ``tests`` package (for ``tests.rewardfns``), both as symlinks;
- an ``ssh`` first on ``PATH`` that reaches the OpenSSH server for every host name, with
  the test's key and known_hosts (the seed runs plain ``ssh HOST SCRIPT``);
- host names unique to the test, because the seed's sweeps match every process on the
  machine whose command line names the host.

The worker interpreter (``--venv``) is this test run's virtualenv, where ``supervisor`` is
installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import shared
from tests.sshd import OpenSsh

SEED_ENV = shared.SEED.env
SCRIPT = "reward_workers_ctl.py"
PATCH = "selfmatch-fix.patch"
REPO = Path(__file__).resolve().parent.parent
#: The reference worker's reward fn, as the seed's ``--reward-fn`` (read from the manifest).
REWARD_FN = "supervisor.demo.worker.exact_match"

_FS_PROTOCOL = '''"""Stand-in for AReaL's fs_protocol: what reward_workers_ctl.py calls."""
import json
import os
from pathlib import Path


def ensure_run_dirs(root, shard_count):
    root = Path(root)
    for name in ("ctl", "status", "outbox"):
        (root / name).mkdir(parents=True, exist_ok=True)
    for shard in range(shard_count):
        (root / "inbox" / str(shard)).mkdir(parents=True, exist_ok=True)


def write_manifest(root, manifest):
    path = Path(root) / "manifest.json"
    tmp = path.with_name(".manifest.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, path)
'''

_FS_WORKER = '''"""Stand-in for areal.reward.fs_worker: the reference worker, same flags."""
import sys

from supervisor.demo.worker import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def find_seed() -> Path | None:
    """The seed script (with its patch beside it), or None where it is absent or broken
    (``tests/shared.py``; a test takes it from the ``seed_script`` fixture, which tells the two
    apart)."""
    found = shared.SEED.locate()
    return found.path if isinstance(found, shared.Found) else None


def seed_missing_reason() -> str:
    """Why the seed cannot be used here (empty where it can)."""
    found = shared.SEED.locate()
    return "" if isinstance(found, shared.Found) else found.reason


@dataclass
class SeedWorld:
    """A patched seed, its workspace, its ssh, and the hosts it manages; see the module."""

    workdir: Path
    script: Path
    ws: Path
    venv: Path
    root: Path
    hosts: list[str]
    openssh: OpenSsh
    env: dict[str, str] = field(default_factory=dict)
    watch: subprocess.Popen[bytes] | None = None
    #: Every host's ``--concurrency`` in ``workers_json``.
    concurrency: int = 2

    @classmethod
    def create(
        cls,
        workdir: Path,
        openssh: OpenSsh,
        seed: Path,
        hosts: int,
        *,
        areal: Path | None = None,
        concurrency: int = 2,
    ) -> SeedWorld:
        """Copy and patch ``seed`` into ``workdir``, build the workspace and ssh config; with
        ``areal``, the workspace's ``repo/AReaL`` holds the real AReaL package from there."""
        workdir.mkdir(parents=True, exist_ok=True)
        # The seed's ROOT is its script's grandparent (scripts/ in the team's repository).
        copy_dir = workdir / "seedrepo" / "scripts"
        copy_dir.mkdir(parents=True)
        script = copy_dir / SCRIPT
        shutil.copyfile(seed, script)
        patched = subprocess.run(
            ["patch", "-p1", "--no-backup-if-mismatch", "-i", str(seed.parent / PATCH)],
            cwd=copy_dir,
            capture_output=True,
            text=True,
            check=False,
        )
        if patched.returncode != 0:
            raise RuntimeError(f"cannot apply {PATCH}: {patched.stdout}{patched.stderr}")
        ws = workdir / "ws"
        repo = ws / "repo" / "AReaL"
        if areal is not None:
            # The wrapper's PYTHONPATH is {site}:{repo}: what repo/AReaL holds is importable.
            repo.mkdir(parents=True)
            (repo / "areal").symlink_to(areal / "areal", target_is_directory=True)
            (repo / "tests").symlink_to(REPO / "tests", target_is_directory=True)
        else:
            package = repo / "areal" / "reward"
            package.mkdir(parents=True)
            (package.parent / "__init__.py").write_text("")
            (package / "__init__.py").write_text("")
            (package / "fs_protocol.py").write_text(_FS_PROTOCOL)
            (package / "fs_worker.py").write_text(_FS_WORKER)
        (ws / "tmp").mkdir()
        tag = uuid.uuid4().hex[:6]
        names = [f"seed{tag}-{i}" for i in range(hosts)]
        world = cls(
            workdir=workdir,
            script=script,
            ws=ws,
            venv=Path(sys.prefix),
            root=workdir / "run",
            hosts=names,
            openssh=openssh,
            concurrency=concurrency,
        )
        world.env = world._environment()
        return world

    def _environment(self) -> dict[str, str]:
        """The seed's environment: its allow-list and workspace, and our ssh first on PATH."""
        bin_dir = self.workdir / "bin"
        bin_dir.mkdir()
        config = self.workdir / "ssh_config"
        server = self.openssh
        config.write_text(
            "Host *\n"
            f"  HostName {server.addresses[0]}\n"
            f"  Port {server.port}\n"
            f"  User {server.username}\n"
            f"  IdentityFile {server.client_key}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {server.known_hosts}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n"
            "  LogLevel ERROR\n"
        )
        real_ssh = shutil.which("ssh") or "/usr/bin/ssh"
        wrapper = bin_dir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {real_ssh} -F {config} "$@"\n')
        wrapper.chmod(0o755)
        env = dict(os.environ)
        env.update(
            {
                "PATH": f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}",
                "SAO_REWARD_WORKER_HOSTS": " ".join(self.hosts),
                "SAO_WS": str(self.ws),
                "REWARD_ROOT": str(self.workdir),
            }
        )
        return env

    # --- the seed's commands ------------------------------------------------------------

    def workers_json(self) -> str:
        """The seed's ``--workers-json``: host i on shard i, ``concurrency`` each."""
        return json.dumps(
            [
                {"host": h, "shard": i, "concurrency": self.concurrency}
                for i, h in enumerate(self.hosts)
            ]
        )

    def command(self, *args: str) -> list[str]:
        """The argv of ``reward_workers_ctl.py ARGS`` (run it with ``env``)."""
        return [sys.executable, str(self.script), *args]

    def run(self, *args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
        """``reward_workers_ctl.py ARGS``, to completion."""
        return subprocess.run(
            self.command(*args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def start(self, *extra: str) -> subprocess.CompletedProcess[str]:
        """``start`` every host (under the respawn wrapper unless ``--no-respawn``)."""
        return self.run(
            "start",
            *("--root", str(self.root), "--workers-json", self.workers_json()),
            *("--reward-fn", REWARD_FN, "--ready-timeout", "120", "--heartbeat-stale", "30"),
            *("--ws", str(self.ws), "--venv", str(self.venv)),
            *extra,
        )

    def stop(self) -> subprocess.CompletedProcess[str]:
        """``stop``: TERM every wrapper and worker, and write every ``ctl/<host>.stop``."""
        return self.run("stop", "--root", str(self.root), "--grace", "20")

    def start_watch(self) -> subprocess.Popen[bytes]:
        """``watch`` in the background (0.5 s rounds), as a team runs it beside the fleet."""
        log = (self.workdir / "watch.out").open("ab")
        self.watch = subprocess.Popen(
            [
                *(sys.executable, str(self.script), "watch", "--root", str(self.root)),
                # Fast rounds (a round is where it notices ctl/watch.stop); a stale limit
                # well above the workers' 1 s heartbeats, as in production.
                *("--interval", "0.5", "--heartbeat-stale", "30", "--restart-cooldown", "30"),
                *("--ws", str(self.ws), "--venv", str(self.venv)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        log.close()
        return self.watch

    # --- what it left ---------------------------------------------------------------------

    def pid(self, host: str, kind: str = "pid") -> int | None:
        """The pid in ``ctl/<host>.<kind>`` (``pid`` or ``wrap.pid``)."""
        with contextlib.suppress(OSError, ValueError):
            return int((self.root / "ctl" / f"{host}.{kind}").read_text().strip())
        return None

    def wrappers(self) -> list[int]:
        """Live processes running one of this world's respawn wrappers (``*.wrap.sh``)."""
        ctl = str(self.root / "ctl") + "/"
        found = []
        for pid in _pids():
            args = _cmdline(pid)
            if any(a.startswith(ctl) and a.endswith(".wrap.sh") for a in args) and _alive(pid):
                found.append(pid)
        return found

    def close(self) -> None:
        """Kill what the seed may have left running besides workers (watch, wrappers)."""
        if self.watch is not None and self.watch.poll() is None:
            self.watch.kill()
            self.watch.wait()
        for pid in self.wrappers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _pids() -> list[int]:
    """Every pid on the machine."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> list[str]:
    """The argv of ``pid`` (empty once it is gone)."""
    try:
        data = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [os.fsdecode(a) for a in data.split(b"\0")[:-1]]


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def pid_args(pid: int) -> list[str]:
    """The command line of ``pid`` (for assertions about what a process is)."""
    return _cmdline(pid)


def describe(result: subprocess.CompletedProcess[Any]) -> str:
    """A seed command's exit code and output, for failure messages."""
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
