"""A real OpenSSH ``sshd`` on loopback for the integration and system tiers.

``OpenSsh.create(workdir)`` generates ed25519 host and client keys with ``ssh-keygen``, writes
an ``sshd_config`` that listens on one free port on several loopback addresses (the "host
aliases" 127.0.0.1, 127.0.0.2, 127.0.0.3), a matching ``known_hosts`` and ``authorized_keys``,
and starts ``/usr/sbin/sshd -D -e -f CONFIG`` with its log in ``sshd.log``. Everything else
in the server is stock OpenSSH: ``MaxSessions 10``, ``MaxStartups 10:30:100``, no
``AcceptEnv``. It is a plain subprocess (no event loop), so one server can serve a whole
session; ``stop()``/``start()`` take it down and bring it back on the same port and keys for
fault tests, and ``kill_sessions()`` drops established connections.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.config import Config, parse
from supervisor.demo.worker import argv_template
from tests import ports

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "ssh-keygen"
#: Loopback aliases the server listens on; each stands for one "remote host".
ADDRESSES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
#: The reference worker, as the worker host would run it (``{python}`` is the venv's).
WORKER_ARGV = tuple(argv_template())
# Starting sshd and accepting its first connection takes ~20 ms; a loaded CI box is slower.
START_TIMEOUT_S = 20.0


@dataclass
class OpenSsh:
    """One OpenSSH server, its keys and files; see the module docstring."""

    workdir: Path
    port: int
    addresses: tuple[str, ...] = ADDRESSES
    username: str = field(default_factory=getpass.getuser)
    #: An argv prefix sshd runs under (``unshare ...``): its sessions inherit what it sets up.
    launcher: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    #: ``ssh-keygen -t`` of the host key (the file keeps its name whatever the type).
    host_key_type: str = "ed25519"
    #: More ``sshd_config`` lines, e.g. to offer only some algorithms.
    extra_config: tuple[str, ...] = ()

    # --- files ------------------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        """The server's ``sshd_config``."""
        return self.workdir / "sshd_config"

    @property
    def host_key(self) -> Path:
        """The server's private host key."""
        return self.workdir / "ssh_host_ed25519_key"

    @property
    def client_key(self) -> Path:
        """The private key the supervisor logs in with (``ssh.client_keys``)."""
        return self.workdir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """``[127.0.0.x]:port key`` lines for every address (``ssh.known_hosts``)."""
        return self.workdir / "known_hosts"

    @property
    def wrong_known_hosts(self) -> Path:
        """A known_hosts naming every address with a key the server does not have."""
        return self.workdir / "known_hosts.wrong"

    @property
    def authorized_keys(self) -> Path:
        """The server's ``AuthorizedKeysFile``."""
        return self.workdir / "authorized_keys"

    @property
    def log_path(self) -> Path:
        """Everything sshd logged (``LogLevel VERBOSE``), across restarts."""
        return self.workdir / "sshd.log"

    @property
    def pid_file(self) -> Path:
        """The server's ``PidFile``."""
        return self.workdir / "sshd.pid"

    # --- lifecycle --------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        workdir: Path,
        addresses: Sequence[str] = ADDRESSES,
        *,
        host_key_type: str = "ed25519",
        extra_config: Sequence[str] = (),
        launcher: Sequence[str] = (),
    ) -> OpenSsh:
        """Generate keys and config in ``workdir`` and start the server (under ``launcher``)."""
        workdir.mkdir(parents=True, exist_ok=True)
        server = cls(
            workdir=workdir,
            port=ports.reserve(*addresses),
            addresses=tuple(addresses),
            host_key_type=host_key_type,
            extra_config=tuple(extra_config),
            launcher=tuple(launcher),
        )
        server._write_files()
        server.start()
        return server

    def _write_files(self) -> None:
        """Keys, known_hosts (right and wrong), authorized_keys and sshd_config."""
        _keygen(self.host_key, "test host key", self.host_key_type)
        _keygen(self.client_key, "reward-supervisor tests")
        wrong = self.workdir / "other_host_key"
        _keygen(wrong, "a key no server here has")
        self.authorized_keys.write_text(_public(self.client_key))
        host_pub = _public(self.host_key).split()[:2]
        wrong_pub = _public(wrong).split()[:2]
        self.known_hosts.write_text(
            "".join(f"[{a}]:{self.port} {' '.join(host_pub)}\n" for a in self.addresses)
        )
        self.wrong_known_hosts.write_text(
            "".join(f"[{a}]:{self.port} {' '.join(wrong_pub)}\n" for a in self.addresses)
        )
        lines = [
            *(f"ListenAddress {a}:{self.port}" for a in self.addresses),
            f"HostKey {self.host_key}",
            f"PidFile {self.pid_file}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            # The key files live under /tmp, whose mode StrictModes would reject.
            "StrictModes no",
            # PAM would need a login session setup this container doesn't have.
            "UsePAM no",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UseDNS no",
            "X11Forwarding no",
            "PrintMotd no",
            "LogLevel VERBOSE",
            *self.extra_config,
        ]
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        """Start the server (again) on the same port and keys; returns once it accepts."""
        if self.running:
            return
        # sshd refuses to start without its privilege-separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [*self.launcher, SSHD, "-D", "-e", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(self.addresses)
        while pending:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.process.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not accept within {START_TIMEOUT_S}s")
            pending = {a for a in pending if not _speaks_ssh(a, self.port)}
            if pending:
                time.sleep(0.01)  # wait-ok: sshd is a subprocess; poll its port with a deadline

    def stop(self, *, sessions: bool = True) -> None:
        """Stop the listener and, unless ``sessions=False``, every established connection."""
        process = self.process
        if process is None:
            return
        pids = self.session_pids() if sessions else []
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.process = None
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @property
    def running(self) -> bool:
        """The listener is up."""
        return self.process is not None and self.process.poll() is None

    # --- connections ------------------------------------------------------------------

    def session_pids(self, address: str | None = None) -> list[int]:
        """Per-connection sshd processes (children of the listener), optionally only those
        whose connection came in on ``address``."""
        if self.process is None:
            return []
        pids = children(self.process.pid)
        if address is None:
            return pids
        inodes = _tcp_inodes(local=(address, self.port))
        return [pid for pid in pids if inodes & _socket_inodes(pid)]

    def kill_sessions(self, address: str | None = None) -> list[int]:
        """SIGKILL the per-connection sshd of every connection (on ``address``); the pids."""
        pids = self.session_pids(address)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the sshd log, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    # --- configs ----------------------------------------------------------------------

    def config_dict(
        self,
        root: Path,
        hosts: int = 1,
        *,
        python: str = sys.executable,
        argv: Sequence[str] = WORKER_ARGV,
        env: Mapping[str, str] | None = None,
        ssh: Mapping[str, Any] | None = None,
        health: Mapping[str, Any] | None = None,
        worker: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A raw config (as TOML would parse) for a run at ``root`` with ``hosts`` hosts.

        Host ``i`` is ``worker-i`` on shard ``i`` at ``addresses[i % len(addresses)]``;
        ``ssh``, ``health`` and ``worker`` entries override the defaults key by key.
        """
        raw_ssh: dict[str, Any] = {
            "username": self.username,
            "known_hosts": str(self.known_hosts),
            "client_keys": [str(self.client_key)],
            "connect_timeout_s": 10.0,
            "keepalive_interval_s": 5.0,
            "reconnect_min_s": 0.05,
            "reconnect_max_s": 0.5,
        }
        raw_ssh.update(ssh or {})
        raw_worker: dict[str, Any] = {"argv": list(argv), "python": python, "env": dict(env or {})}
        raw_worker.update(worker or {})
        return {
            "run": {
                "root": str(root),
                "experiment": "tests",
                "trial": "t",
                "run_id": "run-1",
                # The manifest's record of the trainer's reward fn (the reference worker's
                # built-in one); workers score each task with the reward fn the task names.
                "reward_fn": "supervisor.demo.worker.exact_match",
            },
            "worker": raw_worker,
            "health": dict(health or {}),
            "ssh": raw_ssh,
            "control": {"socket": str(self.workdir / f"ctl-{os.getpid()}.sock")},
            "hosts": [
                {
                    "name": f"worker-{i}",
                    "address": self.addresses[i % len(self.addresses)],
                    "port": self.port,
                    "shard": i,
                    "concurrency": 2,
                }
                for i in range(hosts)
            ],
        }

    def config(self, root: Path, hosts: int = 1, **overrides: Any) -> Config:
        """``config_dict(...)`` validated by ``supervisor.config.parse``."""
        raw = self.config_dict(root, hosts, **overrides)
        return parse(raw, root.parent / "reward-supervisor.toml")


# --- helpers --------------------------------------------------------------------------


def _keygen(path: Path, comment: str, key_type: str = "ed25519") -> None:
    """A new passphrase-less key pair (ed25519 by default) at ``path`` and ``path.pub``."""
    # ssh-keygen asks before overwriting; a reused workdir gets fresh keys.
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".pub").unlink(missing_ok=True)
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", key_type, "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )


def _public(private: Path) -> str:
    """The public key line of ``private``."""
    return private.with_name(private.name + ".pub").read_text()


def _speaks_ssh(address: str, port: int) -> bool:
    """Something at ``address:port`` accepts and sends an SSH banner."""
    try:
        with socket.create_connection((address, port), timeout=1.0) as s:
            return s.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (zombies included)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` has open."""
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _tcp_inodes(local: tuple[str, int]) -> set[int]:
    """Inodes of established TCP sockets whose local end is ``local`` (IPv4 only)."""
    address, port = local
    want = f"{socket.inet_aton(address)[::-1].hex().upper()}:{port:04X}"
    inodes: set[int] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        # st 01 is ESTABLISHED; the listening socket (0A) is shared by every child.
        if fields[1] == want and fields[3] == "01":
            inodes.add(int(fields[9]))
    return inodes
