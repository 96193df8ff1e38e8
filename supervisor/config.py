"""The TOML config (DESIGN §6) read into frozen, validated objects; every problem is reported.

This module owns ``tomllib`` and the rules of a valid config; it reads no other file
(``check()`` looks at the SSH files a config names with stat, never reading them).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import stat
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Final, Literal, TypeVar, cast

from supervisor.errors import ConfigError, ConfigProblem
from supervisor.fleet import FleetPolicy, Member
from supervisor.health import Policy

WatchMode = Literal["auto", "inotify", "poll"]
OnExit = Literal["stop", "detach"]

#: A config of a thousand hosts is about 100 KB; a file far larger is a mistake (a log
#: symlinked in its place), and reading it whole would only grow our memory.
MAX_CONFIG_BYTES: Final = 16 * 1024 * 1024
#: Fields a ``worker.argv`` element may name; each is substituted inside one argument.
ARGV_FIELDS: Final = frozenset(
    {
        "python",
        "root",
        "shard",
        "host",
        "concurrency",
        "run_id",
        "reward_fn",
        "experiment",
        "trial",
        "shard_count",
    }
)
DEFAULT_ARGV: Final = (
    "{python}",
    "-m",
    "areal.reward.fs_worker",
    "--root",
    "{root}",
    "--shard",
    "{shard}",
    "--host",
    "{host}",
    "--concurrency",
    "{concurrency}",
)
DEFAULT_REWARD_FN: Final = "areal.reward.gsm8k.gsm8k_reward_fn"

# A worker beats about once a second; a stale threshold under three beats restarts healthy
# workers on scheduler noise, and no Python worker imports and reports ready in under 2 s.
MIN_HEARTBEAT_STALE_S: Final = 3.0
MIN_READY_TIMEOUT_S: Final = 2.0
# Evidence before a kill: py-spy attaches and dumps in well under a second, faulthandler
# writes at once; below this a dump is cut off before it starts. Above the maximum, the
# restart of a stuck worker waits longer than anyone reading the evidence would want.
MIN_EVIDENCE_TIMEOUT_S: Final = 0.5
MAX_EVIDENCE_TIMEOUT_S: Final = 30.0
#: How stacks are taken (health.evidence_stacks).
EVIDENCE_STACKS: Final = ("auto", "py-spy", "signal", "none")
# Start-up waits one connect timeout plus this for probes and launches to answer before
# READY=1 goes out anyway (a host that cannot be reached must not block the others).
STARTUP_SLACK_S: Final = 10.0
# Shutdown must finish before systemd's TimeoutStopSec (stop_grace_s + 30 in our unit).
SHUTDOWN_SLACK_S: Final = 15.0
#: Where ``metrics.listen`` binds when it names only a port: the endpoint has no
#: authentication, so serving it beyond this machine must be asked for by address.
METRICS_DEFAULT_HOST: Final = "127.0.0.1"
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH: Final = 107

_DNS_LABEL: Final = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_USER_NAME: Final = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}\$?$")
_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """``[run]``: where the run lives and what it is."""

    root: Path
    experiment: str = ""
    trial: str = ""
    run_id: str = ""
    reward_fn: str = DEFAULT_REWARD_FN
    cleanup_prefix: Path | None = None
    forbid_hosts: tuple[str, ...] = ("head",)
    allow_hosts: tuple[str, ...] | None = None
    shard_count: int = 0
    pointer_file: Path | None = None
    on_exit: OnExit = "stop"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    """``[worker]``: the argv template and environment of every worker."""

    argv: tuple[str, ...] = DEFAULT_ARGV
    python: str = "python3"
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    log_max_bytes: int = 256 * 1024 * 1024
    log_backups: int = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class SshConfig:
    """``[ssh]``: how we reach the hosts; nothing is read implicitly from ``$HOME``."""

    username: str
    known_hosts: Path
    client_keys: tuple[Path, ...] = ()
    connect_timeout_s: float = 20.0
    keepalive_interval_s: float = 15.0
    keepalive_count_max: int = 3
    #: The whole fleet's keepalives per second, at most: a large fleet's connections each
    #: send theirs less often than ``keepalive_interval_s`` (``fleet_ssh``). Nomad caps its
    #: fleet's heartbeats at 50/s the same way. 0: every connection at its interval.
    keepalive_fleet_rate: float = 50.0
    # OpenSSH drops unauthenticated connections past MaxStartups (default 10:30:100).
    max_concurrent_handshakes: int = 8
    # OpenSSH's MaxSessions defaults to 10 channels per connection; keep one spare.
    max_channels_per_host: int = 9
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    # Algorithm lists, in order of preference; None: the modern defaults (remote.DEFAULT_ALGS,
    # no SHA-1). A list given replaces the default whole, as OpenSSH's options do.
    kex_algs: tuple[str, ...] | None = None
    encryption_algs: tuple[str, ...] | None = None
    mac_algs: tuple[str, ...] | None = None
    signature_algs: tuple[str, ...] | None = None
    server_host_key_algs: tuple[str, ...] | None = None


#: The ``[ssh]`` keys that list algorithms (each named as asyncssh names its option).
SSH_ALGORITHM_KEYS: Final = (
    "kex_algs",
    "encryption_algs",
    "mac_algs",
    "signature_algs",
    "server_host_key_algs",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlConfig:
    """``[control]``: the operator socket."""

    socket: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchConfig:
    """``[watch]``: how status and ctl files are watched."""

    mode: WatchMode = "auto"
    poll_interval_s: float = 1.0
    # watchfiles batches changes until `debounce` ms pass without a new one; its default of
    # 1600 ms adds up to 1.7 s to every heartbeat when files change continuously.
    debounce_ms: int = 50
    # A full re-read of every file, in every mode: inotify can overflow, NFS can lie.
    rescan_interval_s: float = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsConfig:
    """``[metrics]``: the optional Prometheus endpoint."""

    listen: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HaConfig:
    """``[ha]``: a standby daemon that takes over when the leader goes (docs/OPERATIONS.md)."""

    #: Wait for the run lock instead of exiting when another daemon holds it.
    standby: bool = False
    #: How often a standby tries the run lock.
    poll_interval_s: float = 0.5
    #: How often the leader checks that it still holds the lock and the epoch is its own.
    check_interval_s: float = 5.0
    #: How long ``handover`` waits for a standby to take the lock.
    confirm_timeout_s: float = 30.0
    #: After a handover the old leader stays off the lock this long (a standby takes it).
    handover_hold_s: float = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HostConfig:
    """One ``[[hosts]]`` entry."""

    name: str
    shard: int
    address: str
    port: int = 22
    concurrency: int = 48
    username: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """A whole, valid configuration."""

    source: Path
    run: RunConfig
    worker: WorkerConfig
    health: Policy
    ssh: SshConfig
    control: ControlConfig
    watch: WatchConfig
    fleet: FleetPolicy
    metrics: MetricsConfig
    hosts: tuple[HostConfig, ...]
    ha: HaConfig = HaConfig()

    def host(self, name: str) -> HostConfig | None:
        """The host called ``name``, if configured."""
        return next((h for h in self.hosts if h.name == name), None)

    def summary(self) -> str:
        """One line for ``check-config`` and logs."""
        return (
            f"{self.source}: ok: {len(self.hosts)} hosts, {self.run.shard_count} shards,"
            f" root {self.run.root}"
        )


def argv_fields(config: Config, host: HostConfig) -> dict[str, str]:
    """The values ``{field}``s in ``worker.argv`` stand for, for ``host``."""
    return {
        "python": config.worker.python,
        "root": str(config.run.root),
        "shard": str(host.shard),
        "host": host.name,
        "concurrency": str(host.concurrency),
        "run_id": config.run.run_id,
        "reward_fn": config.run.reward_fn,
        "experiment": config.run.experiment,
        "trial": config.run.trial,
        "shard_count": str(config.run.shard_count),
    }


def render_argv(config: Config, host: HostConfig) -> tuple[str, ...]:
    """The worker's argv for ``host``: each template element becomes exactly one argument."""
    values = argv_fields(config, host)
    return tuple(element.format_map(values) for element in config.worker.argv)


def fleet_ssh(ssh: SshConfig, hosts: int) -> SshConfig:
    """``ssh`` as each of ``hosts`` connections uses it: its keepalive interval stretched so
    the fleet sends at most ``keepalive_fleet_rate`` keepalives a second (1000 hosts at
    50/s: one every 20 s each). Keepalives only find dead connections; whether a worker
    lives its heartbeat says, and a request that goes unanswered checks its connection at
    once (remote.py), so a longer interval delays nothing a worker needs."""
    rate = ssh.keepalive_fleet_rate
    if rate <= 0 or hosts / rate <= ssh.keepalive_interval_s:
        return ssh
    return replace(ssh, keepalive_interval_s=hosts / rate)


def members(config: Config) -> tuple[Member, ...]:
    """The configured hosts as the fleet core sees them."""
    return tuple(
        Member(name=h.name, shard=h.shard, launch_key=launch_key(config, h)) for h in config.hosts
    )


def launch_key(config: Config, host: HostConfig) -> tuple[object, ...]:
    """Everything that shapes ``host``'s worker; a reload restarts the host if it changes."""
    return (
        render_argv(config, host),
        tuple(sorted(config.worker.env.items())),
        host.address,
        host.port,
        host.username or config.ssh.username,
        config.worker.python,
        host.shard,
        # The manifest's reward fn, written at launch. Workers (the AReaL one and the
        # reference one) score each task with the reward fn the task names; a reload
        # that changes this one still relaunches them, as a new deploy of the run.
        config.run.reward_fn,
    )


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload changes, host by host."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    #: In both configs: their settings are refreshed in place.
    updated: tuple[str, ...]
    #: Of ``updated``, those whose worker must be replaced (launch parameters changed).
    restarted: tuple[str, ...]


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """Compare two configs: add new hosts, stop removed ones, restart only changed ones."""
    old_names = [h.name for h in old.hosts]
    new_names = [h.name for h in new.hosts]
    both = [n for n in new_names if n in old_names]
    restarted = []
    old_hosts = {h.name: h for h in old.hosts}
    new_hosts = {h.name: h for h in new.hosts}
    for name in both:
        if launch_key(old, old_hosts[name]) != launch_key(new, new_hosts[name]):
            restarted.append(name)
    return ReloadPlan(
        added=tuple(n for n in new_names if n not in old_names),
        removed=tuple(n for n in old_names if n not in new_names),
        updated=tuple(both),
        restarted=tuple(restarted),
    )


def socket_from_raw_file(path: Path) -> Path | None:
    """``control.socket`` of a config file that may not validate (or its default)."""
    try:
        raw = _read(path)
    except ConfigError:
        return default_socket_path(path)
    control = raw.get("control")
    socket = control.get("socket") if isinstance(control, dict) else None
    if isinstance(socket, str) and socket.startswith("/"):
        return Path(socket)
    return default_socket_path(path)


def privilege_warnings(config: Config, euid: int) -> list[tuple[str, dict[str, Any]]]:
    """The ``(event, fields)`` to log at start when ``config`` uses root: the daemon running
    as root (``euid`` 0), or logging in to hosts as root. Neither is refused; both widen what
    one compromised host or one planted file in the run root can reach."""
    warnings: list[tuple[str, dict[str, Any]]] = []
    if euid == 0:
        warnings.append(
            (
                "daemon.running_as_root",
                {"advice": "run it as a service account (docs/OPERATIONS.md, Installing)"},
            )
        )
    roots = [h.name for h in config.hosts if (h.username or config.ssh.username) == "root"]
    if roots:
        warnings.append(
            (
                "ssh.root_login",
                {
                    "hosts": roots[:20],
                    "host_count": len(roots),
                    "advice": "log in as an unprivileged user (ssh.username, hosts.username)",
                },
            )
        )
    return warnings


#: Descriptors the daemon may hold besides one SSH connection a host: control and metrics
#: clients (64 each at most), a connection being replaced while its host reconnects, the
#: watcher's, the run lock's, its logs'.
OPEN_FILES_SPARE: Final = 256


def open_files_needed(config: Config) -> int:
    """How many descriptors the daemon may need at once for ``config``'s fleet."""
    return len(config.hosts) + OPEN_FILES_SPARE


def open_file_limit_warnings(config: Config, limit: int) -> list[tuple[str, dict[str, Any]]]:
    """The ``(event, fields)`` to log when ``limit`` (the soft limit on open files, already
    raised as far as it goes) is too low for ``config``'s fleet. Not refused: the hosts past
    the limit fail to connect and are retried, and the rest run; but a daemon out of
    descriptors also fails its own file checks, so it must be said loudly and early."""
    needed = open_files_needed(config)
    if limit >= needed:
        return []
    return [
        (
            "daemon.open_file_limit_low",
            {
                "limit": limit,
                "needed": needed,
                "hosts": len(config.hosts),
                "advice": "raise LimitNOFILE= in the unit (or ulimit -n) to at least needed",
            },
        )
    ]


def default_socket_path(config_path: Path) -> Path:
    """Where the control socket goes when ``[control] socket`` is not set."""
    stem = config_path.stem or "reward-supervisor"
    if os.geteuid() == 0:
        return Path("/run/reward-supervisor") / f"{stem}.sock"
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"  # noqa: S108 - private 0700 subdir
    return Path(base) / f"reward-supervisor-{os.geteuid()}" / f"{stem}.sock"


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate the config at ``path``.

    Raises ConfigError listing every problem found (file, key path, reason).
    """
    source = Path(path)
    return parse(_read(source), source)


def _read(source: Path) -> dict[str, Any]:
    """The TOML document at ``source``; ConfigError if it cannot be read or parsed."""
    try:
        return tomllib.loads(_read_text(source))
    except FileNotFoundError:
        raise ConfigError([ConfigProblem(str(source), "-", "file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigProblem(str(source), "-", f"cannot read: {exc}")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([ConfigProblem(str(source), "-", f"not valid TOML: {exc}")]) from None
    except RecursionError:
        # tomllib recurses once per nested array or inline table.
        raise ConfigError(
            [ConfigProblem(str(source), "-", "not valid TOML: nested too deeply")]
        ) from None


def _read_text(source: Path) -> str:
    """The file's text, read without blocking on a FIFO and never past MAX_CONFIG_BYTES.

    Raises OSError, UnicodeDecodeError, or ConfigError for a file that is not a regular file
    (a FIFO blocks the reader forever; /dev/zero never ends) or is too large.
    """
    # O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, forever.
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError([ConfigProblem(str(source), "-", "cannot read: not a regular file")])
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1024 * 1024):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_CONFIG_BYTES:
                raise ConfigError(
                    [ConfigProblem(str(source), "-", f"larger than {MAX_CONFIG_BYTES} bytes")]
                )
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8")


@dataclass(frozen=True, slots=True)
class Checked:
    """What ``check()`` found: the config if it is valid, every problem, and warnings."""

    config: Config | None
    problems: tuple[ConfigProblem, ...]
    warnings: tuple[ConfigProblem, ...]


def check(path: str | os.PathLike[str]) -> Checked:
    """Validate like ``load()``, and look at the SSH files the config names: one that is
    missing, unreadable or empty is a warning (the file may yet be installed), not a problem."""
    source = Path(path)
    try:
        raw = _read(source)
    except ConfigError as exc:
        return Checked(None, tuple(exc.problems), ())
    warnings = tuple(file_warnings(raw, source))
    try:
        return Checked(parse(raw, source), (), warnings)
    except ConfigError as exc:
        return Checked(None, tuple(exc.problems), warnings)


def file_warnings(raw: Mapping[str, Any], source: Path) -> list[ConfigProblem]:
    """``ssh.known_hosts`` and ``ssh.client_keys`` files that cannot serve a connection as
    they are now (checked with stat and access, never read); keys that are not absolute
    paths are left to the validator."""
    ssh = raw.get("ssh")
    if not isinstance(ssh, dict):
        return []
    warnings = []
    known = ssh.get("known_hosts")
    if isinstance(known, str) and PurePosixPath(known).is_absolute():
        trouble = _file_trouble(Path(known))
        if trouble:
            warnings.append(
                ConfigProblem(
                    str(source),
                    "ssh.known_hosts",
                    f"{known} {trouble}: every connection will be refused until it holds"
                    " the hosts' keys",
                )
            )
    keys = ssh.get("client_keys")
    for i, key in enumerate(keys if isinstance(keys, list) else []):
        if isinstance(key, str) and PurePosixPath(key).is_absolute():
            trouble = _file_trouble(Path(key))
            if trouble:
                warnings.append(
                    ConfigProblem(
                        str(source),
                        f"ssh.client_keys[{i}]",
                        f"{key} {trouble}: logins with this key will fail",
                    )
                )
    return warnings


def _file_trouble(path: Path) -> str | None:
    """Why ``path`` cannot be used as an SSH file by this user, or None if it can."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if not os.access(path, os.R_OK):
        return f"is not readable by this user (uid {os.geteuid()})"
    if st.st_size == 0:
        return "is empty"
    return None


def parse(raw: Mapping[str, Any], source: Path) -> Config:
    """Validate an already-parsed TOML document; raises ConfigError with every problem."""
    v = _Validator(str(source))
    config = v.config(raw, source)
    if v.problems or config is None:
        raise ConfigError(v.problems)
    return config


# --------------------------------------------------------------------------------------

T = TypeVar("T")
_MISSING: Final = object()
#: ``ha.check_interval_s`` at most: well within an NFS lease (90 s by default).
HA_CHECK_MAX_S: Final = 30.0

_SECTIONS: Final = (
    "run",
    "worker",
    "health",
    "ssh",
    "control",
    "watch",
    "fleet",
    "metrics",
    "ha",
    "hosts",
)


#: Every key of every section: the validator rejects others (with a did-you-mean), and the
#: README's configuration reference is checked against this table by a test.
KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "run": (
        "root",
        "experiment",
        "trial",
        "run_id",
        "reward_fn",
        "cleanup_prefix",
        "forbid_hosts",
        "allow_hosts",
        "shard_count",
        "pointer_file",
        "on_exit",
    ),
    "worker": (
        "argv",
        "python",
        "env",
        "log_max_bytes",
        "log_backups",
    ),
    "health": (
        "heartbeat_stale_s",
        "ready_timeout_s",
        "restart_cooldown_s",
        "backoff_max_s",
        "backoff_reset_s",
        "max_restarts",
        "restart_window_s",
        "stop_grace_s",
        "kill_after_grace",
        "kill_stuck",
        "auto_restart",
        "progress_stale_s",
        "permanent_exit_codes",
        "evidence_timeout_s",
        "evidence_stacks",
    ),
    "ssh": (
        "username",
        "client_keys",
        "known_hosts",
        "connect_timeout_s",
        "keepalive_interval_s",
        "keepalive_count_max",
        "keepalive_fleet_rate",
        "max_concurrent_handshakes",
        "max_channels_per_host",
        "reconnect_min_s",
        "reconnect_max_s",
        *SSH_ALGORITHM_KEYS,
    ),
    "control": ("socket",),
    "watch": (
        "mode",
        "poll_interval_s",
        "debounce_ms",
        "rescan_interval_s",
    ),
    "fleet": (
        "freeze_fraction",
        "freeze_window_s",
        "max_concurrent_launches",
        "max_launches_per_minute",
        "crash_signature_hosts",
        "crash_signature_window_s",
    ),
    "metrics": ("listen",),
    "ha": (
        "standby",
        "poll_interval_s",
        "check_interval_s",
        "confirm_timeout_s",
        "handover_hold_s",
    ),
    "hosts": (
        "name",
        "address",
        "port",
        "shard",
        "concurrency",
        "username",
    ),
}


def _section(where: str) -> str:
    return where.split("[", 1)[0]


class _Validator:
    """Walks the document, collecting problems instead of stopping at the first."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[ConfigProblem] = []
        #: position among valid hosts -> index in the file's [[hosts]] array
        self.host_index: dict[int, int] = {}
        #: Shards of [[hosts]] entries dropped for another problem.
        self.claimed_shards: set[int] = set()

    def problem(self, key: str, reason: str) -> None:
        self.problems.append(ConfigProblem(self.file, key, reason))

    # --- generic readers -------------------------------------------------------------

    def table(self, raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        value = raw.get(key, {})
        if not isinstance(value, dict):
            self.problem(key, f"must be a table, not {_type_name(value)}")
            return {}
        return cast(Mapping[str, Any], value)

    def unknown_keys(self, table: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
        for key in table:
            if key not in allowed:
                hint = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
                suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
                self.problem(_join(where, key), f"unknown key{suggestion}")

    def get(
        self,
        table: Mapping[str, Any],
        where: str,
        key: str,
        kind: type[T],
        default: T | object = _MISSING,
    ) -> T | None:
        path = _join(where, key)
        if key not in table:
            if default is _MISSING:
                self.problem(path, "required")
                return None
            return cast(T, default)
        value = table[key]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            self.problem(path, f"must be {_kind_name(kind)}, not {_type_name(value)}")
            return None
        return cast(T, value)

    def seconds(
        self,
        table: Mapping[str, Any],
        where: str,
        key: str,
        default: float,
        minimum: float = 0.0,
        why: str = "",
    ) -> float:
        value = self.get(table, where, key, float, default)
        if value is None:
            return default
        if value <= 0 or value != value or value == float("inf"):
            self.problem(_join(where, key), f"must be a positive number of seconds, not {value}")
        elif value < minimum:
            because = f" ({why})" if why else ""
            self.problem(
                _join(where, key), f"{value:g}s is too short; use at least {minimum:g}s{because}"
            )
        return value

    def seconds_or_off(
        self, table: Mapping[str, Any], where: str, key: str, default: float, minimum: float
    ) -> float:
        """Like ``seconds``, but 0 turns the check off."""
        if table.get(key) == 0 and not isinstance(table.get(key), bool):
            return 0.0
        return self.seconds(table, where, key, default, minimum)

    def rate_or_off(self, table: Mapping[str, Any], where: str, key: str, default: float) -> float:
        """A rate per second, or 0 for no limit."""
        value = self.get(table, where, key, float, default)
        if value is None:
            return default
        if value < 0 or value != value or value == float("inf"):
            self.problem(_join(where, key), f"must be a rate per second >= 0, not {value}")
        return value

    def exit_codes(self, table: Mapping[str, Any], where: str, key: str) -> frozenset[int]:
        """A list of process exit codes (0-255)."""
        value = self.get(table, where, key, list, [])
        codes: set[int] = set()
        for i, item in enumerate(value or []):
            if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= 255:
                self.problem(
                    f"{_join(where, key)}[{i}]", f"must be an exit code 0-255, not {item!r}"
                )
            else:
                codes.add(item)
        return frozenset(codes)

    def positive_int(
        self, table: Mapping[str, Any], where: str, key: str, default: int, minimum: int = 1
    ) -> int:
        value = self.get(table, where, key, int, default)
        if value is None:
            return default
        if value < minimum:
            self.problem(_join(where, key), f"must be at least {minimum}, not {value}")
        return value

    def strings(
        self, table: Mapping[str, Any], where: str, key: str, default: tuple[str, ...] | None
    ) -> tuple[str, ...] | None:
        value = self.get(table, where, key, list, _MISSING if default is None else list(default))
        if value is None:
            return None if default is None else default
        out: list[str] = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                self.problem(
                    f"{_join(where, key)}[{i}]", f"must be a string, not {_type_name(item)}"
                )
            else:
                out.append(item)
        return tuple(out)

    def choice(
        self, table: Mapping[str, Any], where: str, key: str, choices: tuple[str, ...], default: str
    ) -> str:
        value = self.get(table, where, key, str, default)
        if value is None:
            return default
        if value not in choices:
            self.problem(_join(where, key), f"must be one of {', '.join(choices)}; got {value!r}")
            return default
        return value

    def abs_path(
        self, table: Mapping[str, Any], where: str, key: str, *, required: bool
    ) -> Path | None:
        value = self.get(table, where, key, str, _MISSING if required else None)
        if value is None:
            return None
        if not value:
            self.problem(_join(where, key), "must not be empty")
            return None
        if "\0" in value:
            self.problem(_join(where, key), "must not contain NUL")
            return None
        if not PurePosixPath(value).is_absolute():
            self.problem(_join(where, key), f"must be an absolute path, not {value!r}")
            return None
        return Path(os.path.normpath(value))

    # --- sections ----------------------------------------------------------------------

    def config(self, raw: Mapping[str, Any], source: Path) -> Config | None:
        self.unknown_keys(raw, _SECTIONS, "")
        hosts = self.hosts(raw)
        run = self.run(self.table(raw, "run"), hosts)
        worker = self.worker(self.table(raw, "worker"))
        watch = self.watch(self.table(raw, "watch"))
        health = self.health(self.table(raw, "health"), watch)
        ssh = self.ssh(self.table(raw, "ssh"))
        control = self.control(self.table(raw, "control"), source)
        pointer_file = run.pointer_file if run is not None else None
        fleet = self.fleet(self.table(raw, "fleet"), health, ssh, pointer_file)
        metrics = self.metrics(self.table(raw, "metrics"))
        ha = self.ha(self.table(raw, "ha"))
        if run is None or ssh is None or hosts is None:
            return None
        return Config(
            source=source,
            run=run,
            worker=worker,
            health=health,
            ssh=ssh,
            control=control,
            watch=watch,
            fleet=fleet,
            metrics=metrics,
            hosts=hosts,
            ha=ha,
        )

    def run(self, t: Mapping[str, Any], hosts: tuple[HostConfig, ...] | None) -> RunConfig | None:
        w = "run"
        self.unknown_keys(t, KEYS[_section(w)], w)
        root = self.abs_path(t, w, "root", required=True)
        prefix = self.abs_path(t, w, "cleanup_prefix", required=False)
        if root is not None and prefix is not None and not _is_within(root, prefix):
            self.problem(
                "run.root", f"{root} is outside run.cleanup_prefix {prefix}; cleanup could not run"
            )
        if root is not None and root == Path("/"):
            self.problem("run.root", "must not be /")
        shard_count = self.get(t, w, "shard_count", int, 0) or 0
        if shard_count < 0:
            self.problem("run.shard_count", f"must be positive, not {shard_count}")
        if shard_count <= 0 and hosts:
            shard_count = max(h.shard for h in hosts) + 1
        names = {
            key: self.get(t, w, key, str, "") or "" for key in ("experiment", "trial", "run_id")
        }
        names["run_id"] = names["run_id"] or (root.name if root else "")
        for key, value in names.items():
            if "/" in value or "\0" in value:
                self.problem(f"run.{key}", f"must not contain '/' or NUL: {value!r}")
        # Every key is read, and the hosts checked against them, whether or not the root is
        # valid: one bad key must not hide the other problems of the file.
        reward_fn = self.get(t, w, "reward_fn", str, DEFAULT_REWARD_FN) or DEFAULT_REWARD_FN
        forbid_hosts = self.strings(t, w, "forbid_hosts", ("head",)) or ()
        allow_hosts = self.strings(t, w, "allow_hosts", None) if "allow_hosts" in t else None
        pointer_file = self.abs_path(t, w, "pointer_file", required=False)
        on_exit = cast(OnExit, self.choice(t, w, "on_exit", ("stop", "detach"), "stop"))
        if hosts is not None:
            self.check_hosts_against_run(hosts, forbid_hosts, allow_hosts, shard_count)
        if root is None:
            return None
        return RunConfig(
            root=root,
            experiment=names["experiment"],
            trial=names["trial"],
            run_id=names["run_id"],
            reward_fn=reward_fn,
            cleanup_prefix=prefix,
            forbid_hosts=forbid_hosts,
            allow_hosts=allow_hosts,
            shard_count=shard_count,
            pointer_file=pointer_file,
            on_exit=on_exit,
        )

    def worker(self, t: Mapping[str, Any]) -> WorkerConfig:
        w = "worker"
        self.unknown_keys(t, KEYS["worker"], w)
        argv = self.strings(t, w, "argv", DEFAULT_ARGV)
        if not argv:
            self.problem("worker.argv", "must not be empty")
            argv = DEFAULT_ARGV
        for i, element in enumerate(argv):
            self.check_template(f"worker.argv[{i}]", element)
        python = self.get(t, w, "python", str, "python3")
        if not python or "\0" in python:
            self.problem("worker.python", "must be a command name or path")
        env_raw = self.get(t, w, "env", dict, {}) or {}
        env: dict[str, str] = {}
        for name, value in env_raw.items():
            if not _ENV_NAME.match(name):
                self.problem(f"worker.env.{name}", "is not a valid environment variable name")
            elif not isinstance(value, str):
                self.problem(f"worker.env.{name}", f"must be a string, not {_type_name(value)}")
            elif "\0" in value:
                self.problem(f"worker.env.{name}", "must not contain NUL")
            else:
                env[name] = value
        return WorkerConfig(
            argv=argv,
            python=python or "python3",
            env=MappingProxyType(env),
            log_max_bytes=self.positive_int(t, w, "log_max_bytes", 256 * 1024 * 1024, 4096),
            log_backups=self.positive_int(t, w, "log_backups", 2, 0),
        )

    def check_template(self, key: str, element: str) -> None:
        try:
            parsed = list(string.Formatter().parse(element))
        except ValueError as exc:
            self.problem(key, f"bad template {element!r}: {exc}")
            return
        for _literal, name, spec, conversion in parsed:
            if name is None:
                continue
            if name not in ARGV_FIELDS:
                hint = difflib.get_close_matches(name, sorted(ARGV_FIELDS), n=1)
                suggestion = f"; did you mean {{{hint[0]}}}?" if hint else ""
                known = ", ".join(f"{{{f}}}" for f in sorted(ARGV_FIELDS))
                self.problem(key, f"unknown field {{{name}}}{suggestion} (known: {known})")
            elif spec or conversion:
                self.problem(key, f"field {{{name}}} takes no format spec or conversion")

    def health(self, t: Mapping[str, Any], watch: WatchConfig) -> Policy:
        w = "health"
        d = Policy()
        self.unknown_keys(t, KEYS[_section(w)], w)
        # A poller sees a change up to one interval late; the stale threshold must cover two.
        poll_min = 2 * watch.poll_interval_s + 1
        stale_min = max(MIN_HEARTBEAT_STALE_S, poll_min)
        why = (
            f"2 x watch.poll_interval_s ({watch.poll_interval_s:g}s) + 1s: when the status"
            " files are polled, a heartbeat is seen up to one interval late, so a fresh worker"
            " could look stale"
            if poll_min > MIN_HEARTBEAT_STALE_S
            else "a worker beats about once a second, and under 3 beats scheduler noise"
            " would restart healthy workers"
        )
        stale = self.seconds(t, w, "heartbeat_stale_s", d.heartbeat_stale_s, stale_min, why)
        policy = Policy(
            heartbeat_stale_s=stale,
            ready_timeout_s=self.seconds(
                t,
                w,
                "ready_timeout_s",
                d.ready_timeout_s,
                MIN_READY_TIMEOUT_S,
                "no Python worker starts and reports ready faster",
            ),
            restart_cooldown_s=self.seconds(t, w, "restart_cooldown_s", d.restart_cooldown_s),
            backoff_max_s=self.seconds(t, w, "backoff_max_s", d.backoff_max_s),
            backoff_reset_s=self.seconds(t, w, "backoff_reset_s", d.backoff_reset_s),
            max_restarts=self.positive_int(t, w, "max_restarts", 0, 0),
            restart_window_s=self.seconds(t, w, "restart_window_s", d.restart_window_s),
            stop_grace_s=self.seconds(t, w, "stop_grace_s", d.stop_grace_s),
            kill_after_grace=bool(self.get(t, w, "kill_after_grace", bool, False)),
            kill_stuck=bool(self.get(t, w, "kill_stuck", bool, True)),
            auto_restart=bool(self.get(t, w, "auto_restart", bool, True)),
            progress_stale_s=self.seconds_or_off(
                t, w, "progress_stale_s", d.progress_stale_s, stale_min
            ),
            permanent_exit_codes=self.exit_codes(t, w, "permanent_exit_codes"),
            evidence_timeout_s=self.seconds_or_off(
                t, w, "evidence_timeout_s", d.evidence_timeout_s, MIN_EVIDENCE_TIMEOUT_S
            ),
            evidence_stacks=self.choice(
                t, w, "evidence_stacks", EVIDENCE_STACKS, d.evidence_stacks
            ),
        )
        if policy.evidence_timeout_s > MAX_EVIDENCE_TIMEOUT_S:
            self.problem(
                "health.evidence_timeout_s",
                f"{policy.evidence_timeout_s:g}s is too long; at most {MAX_EVIDENCE_TIMEOUT_S:g}s"
                " (it holds back the restart of a stuck worker)",
            )
        if policy.backoff_max_s < policy.restart_cooldown_s:
            self.problem(
                "health.backoff_max_s",
                f"{policy.backoff_max_s:g}s is below restart_cooldown_s"
                f" ({policy.restart_cooldown_s:g}s)",
            )
        return policy

    def ssh(self, t: Mapping[str, Any]) -> SshConfig | None:
        w = "ssh"
        self.unknown_keys(t, KEYS[_section(w)], w)
        username = self.get(t, w, "username", str, _current_user())
        if username is not None and not _USER_NAME.match(username):
            self.problem("ssh.username", f"{username!r} is not a valid user name")
        if "known_hosts" not in t:
            self.problem("ssh.known_hosts", "required: host keys are always verified")
        known_hosts = self.abs_path(t, w, "known_hosts", required=False)
        keys_raw = self.strings(t, w, "client_keys", ()) or ()
        client_keys: list[Path] = []
        for i, key in enumerate(keys_raw):
            if not PurePosixPath(key).is_absolute():
                self.problem(f"ssh.client_keys[{i}]", f"must be an absolute path, not {key!r}")
            else:
                client_keys.append(Path(key))
        d = SshConfig(username="x", known_hosts=Path("/"))
        reconnect_min = self.seconds(t, w, "reconnect_min_s", d.reconnect_min_s)
        reconnect_max = self.seconds(t, w, "reconnect_max_s", d.reconnect_max_s)
        if reconnect_max < reconnect_min:
            self.problem("ssh.reconnect_max_s", "must not be below ssh.reconnect_min_s")
        channels = self.positive_int(t, w, "max_channels_per_host", d.max_channels_per_host)
        if channels > 9:
            self.problem(
                "ssh.max_channels_per_host",
                f"{channels} reaches OpenSSH's default MaxSessions (10); use at most 9",
            )
        algorithms = {key: self.algorithms(t, key) for key in SSH_ALGORITHM_KEYS}
        if username is None or known_hosts is None:
            return None
        return SshConfig(
            **algorithms,
            username=username,
            known_hosts=known_hosts,
            client_keys=tuple(client_keys),
            connect_timeout_s=self.seconds(t, w, "connect_timeout_s", d.connect_timeout_s),
            keepalive_interval_s=self.seconds(t, w, "keepalive_interval_s", d.keepalive_interval_s),
            keepalive_count_max=self.positive_int(
                t, w, "keepalive_count_max", d.keepalive_count_max
            ),
            keepalive_fleet_rate=self.rate_or_off(
                t, w, "keepalive_fleet_rate", d.keepalive_fleet_rate
            ),
            max_concurrent_handshakes=self.positive_int(
                t, w, "max_concurrent_handshakes", d.max_concurrent_handshakes
            ),
            max_channels_per_host=channels,
            reconnect_min_s=reconnect_min,
            reconnect_max_s=reconnect_max,
        )

    def algorithms(self, t: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
        """``[ssh] key``: a non-empty list of algorithm names this asyncssh supports."""
        if key not in t:
            return None
        names = self.strings(t, "ssh", key, ())
        if not isinstance(t[key], list) or len(names or ()) < len(t[key]):
            return None  # reported by strings()
        if not names:
            self.problem(f"ssh.{key}", "must name at least one algorithm (omit it for defaults)")
            return None
        # Imported here, and only for a config that sets a list: remote.py is the only importer
        # of asyncssh, which knows what it supports, and other commands need not load it.
        from supervisor.remote import SUPPORTED_ALGS

        supported = SUPPORTED_ALGS[key]
        for i, name in enumerate(names):
            if name not in supported:
                self.problem(
                    f"ssh.{key}[{i}]",
                    f"{name!r} is not an algorithm this asyncssh supports for {key}",
                )
        return tuple(names)

    def control(self, t: Mapping[str, Any], source: Path) -> ControlConfig:
        self.unknown_keys(t, KEYS["control"], "control")
        socket = self.abs_path(t, "control", "socket", required=False)
        socket = socket or default_socket_path(source)
        if len(os.fsencode(str(socket))) > MAX_SOCKET_PATH:
            self.problem(
                "control.socket", f"path is longer than {MAX_SOCKET_PATH} bytes (AF_UNIX limit)"
            )
        return ControlConfig(socket=socket)

    def watch(self, t: Mapping[str, Any]) -> WatchConfig:
        w = "watch"
        d = WatchConfig()
        self.unknown_keys(t, KEYS["watch"], w)
        mode = cast(WatchMode, self.choice(t, w, "mode", ("auto", "inotify", "poll"), "auto"))
        return WatchConfig(
            mode=mode,
            poll_interval_s=self.seconds(t, w, "poll_interval_s", d.poll_interval_s),
            debounce_ms=self.positive_int(t, w, "debounce_ms", d.debounce_ms),
            rescan_interval_s=self.seconds(t, w, "rescan_interval_s", d.rescan_interval_s),
        )

    def fleet(
        self,
        t: Mapping[str, Any],
        health: Policy,
        ssh: SshConfig | None,
        pointer_file: Path | None,
    ) -> FleetPolicy:
        w = "fleet"
        d = FleetPolicy()
        self.unknown_keys(t, KEYS[_section(w)], w)
        fraction = self.get(t, w, "freeze_fraction", float, d.freeze_fraction)
        if fraction is not None and not 0 < fraction <= 1:
            self.problem("fleet.freeze_fraction", f"must be in (0, 1], not {fraction}")
        connect_timeout_s = ssh.connect_timeout_s if ssh is not None else 0.0
        return FleetPolicy(
            pointer_file=None if pointer_file is None else str(pointer_file),
            startup_timeout_s=connect_timeout_s + STARTUP_SLACK_S,
            shutdown_timeout_s=health.stop_grace_s + SHUTDOWN_SLACK_S,
            freeze_fraction=fraction if fraction is not None else d.freeze_fraction,
            freeze_window_s=self.seconds(t, w, "freeze_window_s", d.freeze_window_s),
            max_concurrent_launches=self.positive_int(
                t, w, "max_concurrent_launches", d.max_concurrent_launches
            ),
            max_launches_per_minute=self.positive_int(
                t, w, "max_launches_per_minute", d.max_launches_per_minute
            ),
            crash_signature_hosts=self.positive_int(
                t, w, "crash_signature_hosts", d.crash_signature_hosts, minimum=0
            ),
            crash_signature_window_s=self.seconds(
                t, w, "crash_signature_window_s", d.crash_signature_window_s
            ),
        )

    def metrics(self, t: Mapping[str, Any]) -> MetricsConfig:
        self.unknown_keys(t, KEYS["metrics"], "metrics")
        listen = self.get(t, "metrics", "listen", str, None)
        if listen is not None and _split_host_port(listen) is None:
            self.problem("metrics.listen", f"must be HOST:PORT or PORT, not {listen!r}")
        return MetricsConfig(listen=listen)

    def ha(self, t: Mapping[str, Any]) -> HaConfig:
        w = "ha"
        d = HaConfig()
        self.unknown_keys(t, KEYS[w], w)
        standby = self.get(t, w, "standby", bool, d.standby)
        poll = self.seconds(t, w, "poll_interval_s", d.poll_interval_s)
        check = self.seconds(t, w, "check_interval_s", d.check_interval_s)
        if check > HA_CHECK_MAX_S:
            # The NFS lease (90 s) is the takeover's worst case; a leader must learn it was
            # deposed well within it.
            self.problem("ha.check_interval_s", f"must be at most {HA_CHECK_MAX_S:g}, not {check}")
        return HaConfig(
            standby=bool(standby),
            poll_interval_s=poll,
            check_interval_s=check,
            confirm_timeout_s=self.seconds(t, w, "confirm_timeout_s", d.confirm_timeout_s),
            handover_hold_s=self.seconds(t, w, "handover_hold_s", d.handover_hold_s),
        )

    def hosts(self, raw: Mapping[str, Any]) -> tuple[HostConfig, ...] | None:
        value = raw.get("hosts")
        if value is None:
            self.problem("hosts", "required: at least one [[hosts]] entry")
            return None
        if not isinstance(value, list):
            self.problem(
                "hosts", f"must be an array of tables ([[hosts]]), not {_type_name(value)}"
            )
            return None
        if not value:
            self.problem("hosts", "must list at least one host")
        hosts: list[HostConfig] = []
        for i, entry in enumerate(value):
            host = self.host(entry, f"hosts[{i}]")
            if host is not None:
                self.host_index[len(hosts)] = i
                hosts.append(host)
        self.check_duplicates(hosts)
        return tuple(hosts)

    def host(self, entry: object, w: str) -> HostConfig | None:
        if not isinstance(entry, dict):
            self.problem(w, f"must be a table, not {_type_name(entry)}")
            return None
        self.unknown_keys(entry, KEYS["hosts"], w)
        name = self.get(entry, w, "name", str)
        shard = self.get(entry, w, "shard", int)
        if name is not None and not is_valid_host_name(name):
            self.problem(
                f"{w}.name",
                f"{name!r} is not a valid DNS host name (letters, digits, '-' and '.';"
                " no spaces or shell characters)",
            )
            name = None
        if shard is not None and shard < 0:
            self.problem(f"{w}.shard", f"must be 0 or more, not {shard}")
            shard = None
        address = self.get(entry, w, "address", str, name or "")
        if address and not is_valid_address(address):
            self.problem(f"{w}.address", f"{address!r} is not a host name or IP address")
        port = self.get(entry, w, "port", int, 22) or 22
        if not 0 < port < 65536:
            self.problem(f"{w}.port", f"must be in 1..65535, not {port}")
        username = self.get(entry, w, "username", str, None)
        if username is not None and not _USER_NAME.match(username):
            self.problem(f"{w}.username", f"{username!r} is not a valid user name")
        concurrency = self.positive_int(entry, w, "concurrency", 48)
        if name is None or shard is None or not address:
            if shard is not None:
                self.claimed_shards.add(shard)
            return None
        return HostConfig(
            name=name,
            shard=shard,
            address=address,
            port=port,
            concurrency=concurrency,
            username=username,
        )

    def check_duplicates(self, hosts: list[HostConfig]) -> None:
        seen_names: dict[str, int] = {}
        seen_shards: dict[int, str] = {}
        for j, host in enumerate(hosts):
            i = self.host_index[j]
            if host.name in seen_names:
                self.problem(
                    f"hosts[{i}].name",
                    f"duplicate host {host.name!r} (also hosts[{seen_names[host.name]}])",
                )
            seen_names.setdefault(host.name, i)
            if host.shard in seen_shards:
                self.problem(
                    f"hosts[{i}].shard",
                    f"shard {host.shard} is already served by {seen_shards[host.shard]!r};"
                    " one worker per shard",
                )
            seen_shards.setdefault(host.shard, host.name)

    def check_hosts_against_run(
        self,
        hosts: tuple[HostConfig, ...],
        forbid_hosts: tuple[str, ...],
        allow_hosts: tuple[str, ...] | None,
        shard_count: int,
    ) -> None:
        forbidden = set(forbid_hosts)
        for j, host in enumerate(hosts):
            i = self.host_index[j]
            if host.name in forbidden or host.address in forbidden:
                self.problem(f"hosts[{i}]", f"{host.name!r} is in run.forbid_hosts")
            if allow_hosts is not None and host.name not in allow_hosts:
                self.problem(f"hosts[{i}]", f"{host.name!r} is not in run.allow_hosts")
            if host.shard >= shard_count:
                self.problem(
                    f"hosts[{i}].shard",
                    f"shard {host.shard} is outside 0..{shard_count - 1} (run.shard_count)",
                )
        # A shard named by an entry that is invalid for another reason is not "unserved":
        # that entry's own problem is the one to fix.
        served = {h.shard for h in hosts} | self.claimed_shards
        missing = [s for s in range(shard_count) if s not in served]
        if missing and hosts:
            shown = ", ".join(str(s) for s in missing[:10]) + (" ..." if len(missing) > 10 else "")
            self.problem(
                "hosts",
                f"no host serves shard(s) {shown} of run.shard_count={shard_count};"
                " their tasks would never be consumed",
            )


def is_valid_host_name(name: str) -> bool:
    """A DNS name (RFC 1123): safe in file names, argv and logs."""
    if not name or len(name) > 253:
        return False
    return all(_DNS_LABEL.match(label) for label in name.rstrip(".").split("."))


def is_valid_address(address: str) -> bool:
    """A DNS name or an IP literal."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return is_valid_host_name(address)
    return True


def _split_host_port(text: str) -> tuple[str, int] | None:
    host, _, port = text.rpartition(":")
    # isdigit() also takes non-ASCII digits ("٩"), which int() accepts and no one means.
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    return host.strip("[]") or METRICS_DEFAULT_HOST, int(port)


def split_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of an already validated ``metrics.listen``; a bare ``PORT`` (or
    ``:PORT``) is on ``METRICS_DEFAULT_HOST``."""
    parsed = _split_host_port(text)
    if parsed is None:
        raise ValueError(f"not HOST:PORT: {text!r}")
    return parsed


def _is_within(path: Path, prefix: Path) -> bool:
    try:
        return os.path.commonpath([path, prefix]) == str(prefix)
    except ValueError:
        return False


def _current_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "root"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


_KIND_NAMES: Final[Mapping[type, str]] = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    list: "an array",
    dict: "a table",
}


def _kind_name(kind: type) -> str:
    return _KIND_NAMES.get(kind, kind.__name__)


def _type_name(value: object) -> str:
    for kind, name in _KIND_NAMES.items():
        if isinstance(value, bool):
            return "true or false"
        if isinstance(value, kind):
            return name
    return type(value).__name__


def describe_problems(error: ConfigError) -> str:
    """Every problem, one per line, for operators."""
    return "\n".join(str(p) for p in error.problems)
