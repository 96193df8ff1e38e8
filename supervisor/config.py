"""The TOML config (DESIGN §6) read into frozen, validated objects; every problem is reported.

This module owns ``tomllib`` and the rules of a valid config; it reads no other file
(``check()`` looks at the SSH files a config names with stat, never reading them).
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import itertools
import json
import os
import re
import stat
import string
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, MISSING, dataclass, field, fields, replace
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Final, Literal, cast, get_args

from supervisor.errors import ConfigError, ConfigProblem
from supervisor.policies import FleetPolicy, HaPolicy, Member, RewardsPolicy
from supervisor.policies import HealthPolicy as Policy

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
#: The reward fn the manifest names (and a probe sends) when the config names none: one the
#: AReaL shared-FS worker our users run has (``areal.reward.gsm8k`` is upstream AReaL's,
#: and missing there). ``preflight`` checks that the workers can import it.
DEFAULT_REWARD_FN: Final = "areal.reward.simple_answer.simple_answer_reward_fn"

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
#: How a worker that is replaced is ended (health.restart_stop).
RESTART_STOPS: Final = ("kill", "drain")
# Start-up waits one connect timeout plus this for probes and launches to answer before
# READY=1 goes out anyway (a host that cannot be reached must not block the others).
STARTUP_SLACK_S: Final = 10.0
#: What the daemon's shutdown allows past ``stop_grace_s`` (``shutdown_timeout_s``): the
#: stop requests' round trips over SSH and, for a worker killed after its grace, the kill's.
#: Past it the daemon gives up on the hosts still stopping and exits.
SHUTDOWN_SLACK_S: Final = 15.0
#: What a client waiting for a stopping daemon allows past its shutdown bound
#: (``exit_wait_s``): closing connections and exiting.
EXIT_SLACK_S: Final = 15.0
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
    # Algorithm lists, in order of preference; None: the modern defaults (sshalgs.DEFAULT_ALGS,
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
class TrainerConfig:
    """``[trainer]``: what the trainer's reward client tolerates (``FSRewardClient``'s
    defaults). The client fails every call once any host's heartbeat is older than
    ``heartbeat_stale_s`` or says ``ready: false``, and a call whose result has not come
    within ``task_timeout_s``: the health defaults are derived from it (``trainer_defaults``)
    so that a crash, a hang or a stuck worker is replaced before the client fails a call."""

    heartbeat_stale_s: float = 15.0
    task_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeConfig:
    """``[probe]``: a known task sent through each shard's own queue, in the run's task
    record (``reward_fn``, ``args``, ``kwargs``), whose answer says the worker can score;
    absent: no probes."""

    interval_s: float = 30.0
    timeout_s: float = 20.0
    #: Empty: ``run.reward_fn`` (the validator fills it in).
    reward_fn: str = ""
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: The score the probe must have (None: any score; an error never passes).
    expect: float | None = None

    def task(self) -> str:
        """The task record without its id, as JSON text (``fs_protocol.build_task``)."""
        record = {
            "schema_version": 1,
            "reward_fn": self.reward_fn,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
        }
        return json.dumps(record, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class FailoverConfig:
    """``[failover]``: when a lost host's shard moves to a spare (``[[spares]]``)."""

    #: A host is lost once its connection is down and its heartbeat this old; derived from
    #: ``[trainer]`` (``failover_after_s``) so the spare beats before the trainer gives up.
    after_s: float = 11.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SpareConfig:
    """One ``[[spares]]`` entry: a host with the keys of ``[[hosts]]`` but no shard."""

    name: str
    address: str
    port: int = 22
    concurrency: int = 48
    username: str | None = None


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
    #: ``[ha]``: the leadership core's own policy (docs/OPERATIONS.md §9).
    ha: HaPolicy = field(default_factory=HaPolicy)
    trainer: TrainerConfig = TrainerConfig()
    #: ``[probe]``; None: the table is absent and no probe is ever sent.
    probe: ProbeConfig | None = None
    #: ``[[spares]]``: connected and checked, running nothing until a shard fails over.
    spares: tuple[SpareConfig, ...] = ()
    failover: FailoverConfig = FailoverConfig()
    #: The keys the file sets (``"health.heartbeat_stale_s"``...): a default derived from
    #: ``[trainer]`` is ours to answer for, a value set by hand the operator's.
    keys_set: frozenset[str] = frozenset()

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


#: What a restart takes once the old worker is found unhealthy, besides the evidence: the
#: kill, the launch and the new worker's first heartbeat (a few hundred milliseconds for
#: AReaL's worker here, docs/BENCHMARKS.md; a second leaves room for a loaded host).
RESTART_ALLOWANCE_S: Final = 1.0


def trainer_defaults(trainer: TrainerConfig, watch: WatchConfig) -> Policy:
    """The ``[health]`` defaults that beat the trainer's client (docs/CONFIG.md, "Defaults that beat
    the trainer"): a third of its heartbeat limit to call a worker hung and to wait before a
    second restart, a third of its task timeout to call one stuck, and no longer than the
    task timeout for a stop's drain (past it the trainer has given up on those tasks)."""
    stale_floor = stale_floor_s(watch)
    return Policy(
        heartbeat_stale_s=max(stale_floor, trainer.heartbeat_stale_s / 3),
        restart_cooldown_s=trainer.heartbeat_stale_s / 3,
        progress_stale_s=max(stale_floor, trainer.task_timeout_s / 3),
        stop_grace_s=trainer.task_timeout_s,
    )


#: A worker beats about once a second: the trainer may read a beat this much older.
HEARTBEAT_INTERVAL_S: Final = 1.0
#: A failover's own time: the launch on the spare's open connection, the worker's start and
#: its first heartbeat (a few hundred milliseconds for AReaL's worker; room for a load).
FAILOVER_LAUNCH_S: Final = 2.0


def failover_after_s(trainer: TrainerConfig, watch: WatchConfig) -> float:
    """The default ``failover.after_s``: the trainer's heartbeat limit less one beat, the
    watch's lag and the failover's own launch, so the spare's first heartbeat lands before
    the trainer sees a heartbeat ``trainer.heartbeat_stale_s`` old (15 - 1 - 2 - 1 = 11 s
    with a polled watch, 12 s with inotify)."""
    lag = watch.poll_interval_s if watch.mode != "inotify" else 0.0
    budget = trainer.heartbeat_stale_s - HEARTBEAT_INTERVAL_S - FAILOVER_LAUNCH_S - lag
    return max(stale_floor_s(watch), budget)


def shutdown_timeout_s(stop_grace_s: float) -> float:
    """How long the daemon's shutdown may take with ``stop_grace_s``; systemd's
    ``TimeoutStopSec`` must be longer."""
    return stop_grace_s + SHUTDOWN_SLACK_S


def exit_wait_s(stop_grace_s: float) -> float:
    """How long ``stop`` waits for a daemon with ``stop_grace_s`` to exit: its shutdown
    bound, and its exit after that."""
    return shutdown_timeout_s(stop_grace_s) + EXIT_SLACK_S


def trainer_warnings(config: Config) -> list[tuple[str, str]]:
    """``(key, why)`` for each health setting with which a failure would reach the trainer
    before it is mended: the trainer's client then fails calls the supervisor could have
    saved. Each names both numbers; a key the file does not set is said to be derived."""
    h, t, watch = config.health, config.trainer, config.watch
    lag = watch.poll_interval_s if watch.mode != "inotify" else 0.0
    evidence = h.evidence_timeout_s
    out: list[tuple[str, str]] = []

    def origin(key: str) -> str:
        return "" if f"health.{key}" in config.keys_set else " (derived from [trainer])"

    if not h.auto_restart:
        out.append(
            (
                "health.auto_restart",
                "false: a crashed or hung worker is never replaced, and the trainer fails every"
                f" call once its heartbeat is {t.heartbeat_stale_s:g}s old"
                " (trainer.heartbeat_stale_s)",
            )
        )
    hang = h.heartbeat_stale_s + lag + evidence + RESTART_ALLOWANCE_S
    if hang >= t.heartbeat_stale_s:
        out.append(
            (
                "health.heartbeat_stale_s",
                f"{h.heartbeat_stale_s:g}s{origin('heartbeat_stale_s')} cannot beat the trainer:"
                f" a hung worker is replaced about {hang:g}s after its last heartbeat"
                f" (+ {lag:g}s watch lag, {evidence:g}s evidence, {RESTART_ALLOWANCE_S:g}s"
                f" restart), but the trainer fails every call once a heartbeat is"
                f" {t.heartbeat_stale_s:g}s old (trainer.heartbeat_stale_s)",
            )
        )
    if h.progress_stale_s <= 0:
        out.append(
            (
                "health.progress_stale_s",
                "0: a worker whose every slot hangs in a reward call is never replaced, and every"
                f" call on its shard fails at the trainer's {t.task_timeout_s:g}s task timeout",
            )
        )
    else:
        stuck = h.progress_stale_s + evidence + RESTART_ALLOWANCE_S
        if stuck >= t.task_timeout_s:
            out.append(
                (
                    "health.progress_stale_s",
                    f"{h.progress_stale_s:g}s{origin('progress_stale_s')} cannot beat the"
                    f" trainer: a stuck worker is replaced about {stuck:g}s after its last"
                    " finished task, but a task queued behind it fails at the trainer's"
                    f" {t.task_timeout_s:g}s timeout (trainer.task_timeout_s)",
                )
            )
    second = h.restart_cooldown_s + RESTART_ALLOWANCE_S
    if second >= t.heartbeat_stale_s:
        out.append(
            (
                "health.restart_cooldown_s",
                f"{h.restart_cooldown_s:g}s{origin('restart_cooldown_s')} cannot beat the"
                f" trainer: a worker that fails again soon is restarted {second:g}s later,"
                " and its old heartbeat fails every trainer call after"
                f" {t.heartbeat_stale_s:g}s (trainer.heartbeat_stale_s)",
            )
        )
    return out


def _keys_set(raw: Mapping[str, Any]) -> frozenset[str]:
    """``section.key`` of every key the document sets in its tables (not ``[[hosts]]``)."""
    return frozenset(
        f"{section}.{key}"
        for section, table in raw.items()
        if isinstance(table, dict)
        for key in table
    )


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


def spare_host(spare: SpareConfig) -> HostConfig:
    """A spare's connection settings as a host's (its shard is given when it serves one)."""
    return HostConfig(
        name=spare.name,
        shard=-1,
        address=spare.address,
        port=spare.port,
        concurrency=spare.concurrency,
        username=spare.username,
    )


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


def sockets_from_raw_file(path: Path) -> tuple[Path, ...]:
    """``socket_candidates`` of a config file that may not validate: its ``control.socket``,
    or every default place."""
    try:
        raw = _read(path)
    except ConfigError:
        return default_socket_candidates(path)
    control = raw.get("control")
    socket = control.get("socket") if isinstance(control, dict) else None
    if isinstance(socket, str) and socket.startswith("/"):
        return (Path(socket),)
    return default_socket_candidates(path)


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


#: Where a root daemon's control socket goes by default, and the shipped unit's
#: ``RuntimeDirectory`` (owned by the unit's user, 0700).
SYSTEM_SOCKET_DIR: Final = Path("/run/reward-supervisor")
#: A user's runtime directory as systemd-logind makes it (0700, what ``$XDG_RUNTIME_DIR``
#: names in a login session); named from the uid, never read from the environment, so that a
#: daemon and a CLI of one user started from different environments agree.
USER_RUNTIME_DIR: Final = "/run/user/{uid}"
#: The last resort: a directory of our own in /tmp, made 0700 by the daemon, which refuses it
#: if someone else made it first.
TMP_SOCKET_DIR: Final = "/tmp/reward-supervisor-{uid}"  # noqa: S108 - private, checked
#: A config name longer than this is shortened in the socket's name (with a hash of the
#: whole, so names stay apart), keeping the longest default path under AF_UNIX's 107 bytes.
MAX_SOCKET_STEM: Final = 48


def default_socket_candidates(config_path: Path, euid: int | None = None) -> tuple[Path, ...]:
    """Every place the control socket of ``config_path`` may be when ``[control] socket`` is
    not set, in order of preference; the daemon binds the first usable one
    (``default_socket_path``), the CLI looks in each."""
    uid = os.geteuid() if euid is None else euid
    name = _socket_name(config_path.stem or "reward-supervisor")
    system = SYSTEM_SOCKET_DIR / name
    if uid == 0:
        return (system,)
    return (
        system,
        Path(USER_RUNTIME_DIR.format(uid=uid)) / "reward-supervisor" / name,
        Path(TMP_SOCKET_DIR.format(uid=uid)) / name,
    )


def default_socket_path(config_path: Path, euid: int | None = None) -> Path:
    """Where the control socket goes when ``[control] socket`` is not set: for root,
    ``/run/reward-supervisor/NAME.sock``; for another user, the same where that directory
    is theirs and private (the shipped unit's ``RuntimeDirectory``), else under their
    runtime directory ``/run/user/UID`` (while it exists), else in a private
    ``/tmp/reward-supervisor-UID``."""
    uid = os.geteuid() if euid is None else euid
    candidates = default_socket_candidates(config_path, uid)
    if uid == 0:
        return candidates[0]
    system, user_runtime, tmp = candidates
    if _private_to(system.parent, uid):
        return system
    # /run/user/UID itself, above the subdirectory the daemon makes.
    if _private_to(user_runtime.parent.parent, uid):
        return user_runtime
    return tmp


def socket_candidates(config: Config) -> tuple[Path, ...]:
    """Where the daemon of ``config`` may have its control socket: the configured one, or
    every default place (``default_socket_candidates``)."""
    if "control.socket" in config.keys_set:
        return (config.control.socket,)
    return default_socket_candidates(config.source)


def _socket_name(stem: str) -> str:
    """``STEM.sock``; a stem past MAX_SOCKET_STEM bytes is cut, with a hash of the whole."""
    encoded = os.fsencode(stem)
    if len(encoded) <= MAX_SOCKET_STEM:
        return f"{stem}.sock"
    digest = hashlib.sha256(encoded).hexdigest()[:8]
    return f"{encoded[:32].decode('utf-8', 'ignore')}-{digest}.sock"


def _private_to(directory: Path, uid: int) -> bool:
    """``directory`` is a real directory owned by ``uid`` that nobody else may write."""
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022


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
    missing, unreadable or empty is a warning (the file may yet be installed), not a problem;
    so is a health setting that cannot beat the trainer (``trainer_warnings``)."""
    source = Path(path)
    try:
        raw = _read(source)
    except ConfigError as exc:
        return Checked(None, tuple(exc.problems), ())
    warnings = tuple(file_warnings(raw, source))
    try:
        config = parse(raw, source)
    except ConfigError as exc:
        return Checked(None, tuple(exc.problems), warnings)
    beaten = tuple(ConfigProblem(str(source), key, why) for key, why in trainer_warnings(config))
    return Checked(config, (), warnings + beaten)


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
# The schema: every key of every table, written once. A key's default is its dataclass
# field's unless the table derives it; the validator reads each key by its kind, and
# keeps only the rules that span keys.

#: ``ha.check_interval_s`` at most: well within an NFS lease (90 s by default).
HA_CHECK_MAX_S: Final = 30.0
#: ``rewards.window_s`` at least: the workers' counts are sampled this often
#: (``rewards.LOOK_S``; a unit test keeps the two equal).
REWARDS_LOOK_S: Final = 5.0

Kind = Literal[
    "seconds",  # float > 0, finite; `minimum` is "too short"; `off`: 0 turns it off
    "count",  # int >= `minimum` (1 unless given)
    "integer",  # int; its bounds are `check`s, each worded for its key
    "rate",  # float >= 0, finite (0: no limit)
    "fraction",  # float in (0, 1]
    "flag",  # true or false
    "text",  # a string
    "choice",  # one of `choices`
    "path",  # an absolute path, normalized
    "strings",  # an array of strings
    "paths",  # an array of absolute paths
    "algorithms",  # a non-empty array of names this asyncssh supports for the key
    "exit_codes",  # an array of exit codes 0-255
    "env",  # a table of environment variables
    "number",  # a finite float
    "json_list",  # an array of JSON values
    "json_table",  # a table of JSON values
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Given:
    """What a derived default or bound may depend on: the sections read before its table,
    and (``read``) the keys of its own table read before it."""

    source: Path
    watch: WatchConfig = WatchConfig()
    trainer: TrainerConfig = TrainerConfig()
    read: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a table: the kind of value it holds, the bounds it keeps and why.

    Its default is its field's in the table's dataclass, unless ``derive`` computes it. A
    value of the wrong kind is reported and reads as the default, and a number out of its
    bounds is reported and kept as written: either way the rules across keys still run.
    """

    kind: Kind
    _: KW_ONLY
    #: None: optional. Otherwise it must be set; a non-empty text says why.
    required: str | None = None
    #: The default, computed from what is given (other sections, keys read before).
    derive: Callable[[Given], object] | None = None
    #: An empty string means the default: a name that may be left blank.
    blank_is_default: bool = False
    #: ``seconds``: shorter is "too short", because of ``why``; ``count``: less is refused.
    minimum: float | Callable[[Given], float] | None = None
    why: str | Callable[[Given], str] = ""
    #: More is refused, because of ``max_why``.
    maximum: float | None = None
    max_why: str = ""
    #: ``seconds``: 0 turns the setting off, and is not held to the minimum.
    off: bool = False
    choices: tuple[str, ...] = ()
    #: A rule on the value alone: why it is refused, or None.
    check: Callable[[Any], str | None] | None = None


@dataclass(frozen=True, slots=True)
class Section:
    """A table of the file: the dataclass it becomes, its keys in the order they are read,
    and the fields of that dataclass that are not keys (the validator fills them)."""

    result: type
    keys: Mapping[str, Key]
    not_keys: frozenset[str] = frozenset()


def stale_floor_s(watch: WatchConfig) -> float:
    """The shortest stale threshold: 3 beats, and two poll intervals + 1 s (a poller sees a
    change up to one interval late, so a fresh worker could otherwise look stale)."""
    return max(MIN_HEARTBEAT_STALE_S, 2 * watch.poll_interval_s + 1)


def _stale_floor_why(given: Given) -> str:
    if 2 * given.watch.poll_interval_s + 1 > MIN_HEARTBEAT_STALE_S:
        return (
            f"2 x watch.poll_interval_s ({given.watch.poll_interval_s:g}s) + 1s: when the status"
            " files are polled, a heartbeat is seen up to one interval late, so a fresh worker"
            " could look stale"
        )
    return (
        "a worker beats about once a second, and under 3 beats scheduler noise"
        " would restart healthy workers"
    )


def _not_filesystem_root(path: Path) -> str | None:
    return "must not be /" if path == Path("/") else None


def _file_name_problem(name: str) -> str | None:
    return f"must not contain '/' or NUL: {name!r}" if "/" in name or "\0" in name else None


def _command_problem(command: str) -> str | None:
    return "must be a command name or path" if not command or "\0" in command else None


def _user_name_problem(name: str) -> str | None:
    return None if _USER_NAME.match(name) else f"{name!r} is not a valid user name"


def _host_name_problem(name: str) -> str | None:
    if is_valid_host_name(name):
        return None
    return (
        f"{name!r} is not a valid DNS host name (letters, digits, '-' and '.';"
        " no spaces or shell characters)"
    )


def _address_problem(address: str) -> str | None:
    return None if is_valid_address(address) else f"{address!r} is not a host name or IP address"


def _listen_problem(listen: str) -> str | None:
    if _split_host_port(listen) is None:
        return f"must be HOST:PORT or PORT, not {listen!r}"
    return None


#: Every table and its keys (``[[hosts]]`` entries as one table). docs/CONFIG.md's
#: configuration reference is checked against it, and so are the dataclasses' fields.
#: How a machine is reached and what its worker gets: the keys ``[[hosts]]`` and
#: ``[[spares]]`` share.
_MACHINE_KEYS: Final[Mapping[str, Key]] = {
    "address": Key("text", derive=lambda g: g.read["name"] or "", check=_address_problem),
    "port": Key(
        "integer",
        check=lambda n: None if 0 < n < 65536 else f"must be in 1..65535, not {n}",
    ),
    "username": Key("text", check=_user_name_problem),
    "concurrency": Key("count"),
}

SCHEMA: Final[Mapping[str, Section]] = {
    "run": Section(
        RunConfig,
        {
            "root": Key("path", required="", check=_not_filesystem_root),
            "cleanup_prefix": Key("path"),
            # 0: the highest shard of [[hosts]] + 1 (a rule: it needs the hosts).
            "shard_count": Key(
                "integer", check=lambda n: f"must be positive, not {n}" if n < 0 else None
            ),
            "experiment": Key("text", check=_file_name_problem),
            "trial": Key("text", check=_file_name_problem),
            "run_id": Key(
                "text",
                derive=lambda g: g.read["root"].name if g.read["root"] else "",
                blank_is_default=True,
                check=_file_name_problem,
            ),
            "reward_fn": Key("text", blank_is_default=True),
            "forbid_hosts": Key("strings"),
            "allow_hosts": Key("strings"),
            "pointer_file": Key("path"),
            "on_exit": Key("choice", choices=get_args(OnExit)),
        },
    ),
    "worker": Section(
        WorkerConfig,
        {
            "argv": Key("strings"),
            "python": Key("text", check=_command_problem),
            "env": Key("env"),
            "log_max_bytes": Key("count", minimum=4096),
            "log_backups": Key("count", minimum=0),
        },
    ),
    "health": Section(
        Policy,
        {
            "heartbeat_stale_s": Key(
                "seconds",
                derive=lambda g: trainer_defaults(g.trainer, g.watch).heartbeat_stale_s,
                minimum=lambda g: stale_floor_s(g.watch),
                why=_stale_floor_why,
            ),
            "ready_timeout_s": Key(
                "seconds",
                minimum=MIN_READY_TIMEOUT_S,
                why="no Python worker starts and reports ready faster",
            ),
            "restart_cooldown_s": Key(
                "seconds", derive=lambda g: trainer_defaults(g.trainer, g.watch).restart_cooldown_s
            ),
            "backoff_max_s": Key("seconds"),
            "backoff_reset_s": Key("seconds"),
            "max_restarts": Key("count", minimum=0),
            "restart_window_s": Key("seconds"),
            "stop_grace_s": Key(
                "seconds", derive=lambda g: trainer_defaults(g.trainer, g.watch).stop_grace_s
            ),
            "kill_after_grace": Key("flag"),
            "kill_stuck": Key("flag"),
            "auto_restart": Key("flag"),
            "progress_stale_s": Key(
                "seconds",
                derive=lambda g: trainer_defaults(g.trainer, g.watch).progress_stale_s,
                minimum=lambda g: stale_floor_s(g.watch),
                off=True,
            ),
            "permanent_exit_codes": Key("exit_codes"),
            "evidence_timeout_s": Key(
                "seconds",
                minimum=MIN_EVIDENCE_TIMEOUT_S,
                maximum=MAX_EVIDENCE_TIMEOUT_S,
                max_why="it holds back the restart of a stuck worker",
                off=True,
            ),
            "evidence_stacks": Key("choice", choices=EVIDENCE_STACKS),
            "restart_stop": Key("choice", choices=RESTART_STOPS),
            "quarantine_stuck_tasks": Key("flag"),
        },
        # The reward probe's settings come from [probe].
        not_keys=frozenset({"probe_interval_s", "probe_timeout_s", "probe_task", "probe_expect"}),
    ),
    "probe": Section(
        ProbeConfig,
        {
            "interval_s": Key(
                "seconds", minimum=1.0, why="each probe is a task in the trainer's own queue"
            ),
            "timeout_s": Key("seconds"),
            "reward_fn": Key("text", blank_is_default=True),
            "args": Key("json_list"),
            "kwargs": Key("json_table"),
            "expect": Key("number"),
        },
    ),
    "trainer": Section(
        TrainerConfig,
        {
            "heartbeat_stale_s": Key("seconds"),
            "task_timeout_s": Key("seconds"),
        },
    ),
    "ssh": Section(
        SshConfig,
        {
            "username": Key("text", derive=lambda g: _current_user(), check=_user_name_problem),
            "known_hosts": Key("path", required="host keys are always verified"),
            "client_keys": Key("paths"),
            "reconnect_min_s": Key("seconds"),
            "reconnect_max_s": Key("seconds"),
            "max_channels_per_host": Key(
                "count", maximum=9, max_why="OpenSSH's default MaxSessions (10)"
            ),
            **{key: Key("algorithms") for key in SSH_ALGORITHM_KEYS},
            "connect_timeout_s": Key("seconds"),
            "keepalive_interval_s": Key("seconds"),
            "keepalive_count_max": Key("count"),
            "keepalive_fleet_rate": Key("rate"),
            "max_concurrent_handshakes": Key("count"),
        },
    ),
    "control": Section(
        ControlConfig,
        {"socket": Key("path", derive=lambda g: default_socket_path(g.source))},
    ),
    "watch": Section(
        WatchConfig,
        {
            "mode": Key("choice", choices=get_args(WatchMode)),
            "poll_interval_s": Key("seconds"),
            "debounce_ms": Key("count"),
            "rescan_interval_s": Key("seconds"),
        },
    ),
    "fleet": Section(
        FleetPolicy,
        {
            "freeze_fraction": Key("fraction"),
            "freeze_window_s": Key("seconds"),
            "max_concurrent_launches": Key("count"),
            "max_launches_per_minute": Key("count"),
            "crash_signature_hosts": Key("count", minimum=0),
            "crash_signature_window_s": Key("seconds"),
        },
        # The fleet's own deadlines, the pointer file and failover's delay come from other
        # tables.
        not_keys=frozenset(
            {
                "startup_timeout_s",
                "shutdown_timeout_s",
                "pointer_file",
                "detach_on_exit",
                "failover_after_s",
                "rewards",
            }
        ),
    ),
    "rewards": Section(
        RewardsPolicy,
        {
            "window_s": Key(
                "seconds",
                minimum=REWARDS_LOOK_S,
                why="the workers' counts are sampled every 5 s",
                off=True,
            ),
            "min_tasks": Key("count", minimum=20),
            "tolerance": Key(
                "rate",
                check=lambda x: (
                    None
                    if x > 1
                    else f"must be above 1 (a healthy host's rate is the fleet's), not {x:g}"
                ),
            ),
            "sustain_s": Key("seconds"),
            "clear_s": Key("seconds"),
            "move": Key("flag"),
        },
    ),
    "metrics": Section(MetricsConfig, {"listen": Key("text", check=_listen_problem)}),
    "ha": Section(
        HaPolicy,
        {
            "standby": Key("flag"),
            "poll_interval_s": Key("seconds"),
            "check_interval_s": Key("seconds"),
            "confirm_timeout_s": Key("seconds"),
            "handover_hold_s": Key("seconds"),
        },
    ),
    "failover": Section(
        FailoverConfig,
        {
            "after_s": Key(
                "seconds",
                derive=lambda g: failover_after_s(g.trainer, g.watch),
                minimum=lambda g: stale_floor_s(g.watch),
                why=_stale_floor_why,
            ),
        },
    ),
    "spares": Section(
        SpareConfig, {"name": Key("text", required="", check=_host_name_problem), **_MACHINE_KEYS}
    ),
    "hosts": Section(
        HostConfig,
        {
            "name": Key("text", required="", check=_host_name_problem),
            "shard": Key(
                "integer",
                required="",
                check=lambda n: f"must be 0 or more, not {n}" if n < 0 else None,
            ),
            **_MACHINE_KEYS,
        },
    ),
}

#: Every key of every section: the validator rejects others (with a did-you-mean), and the
#: configuration reference (docs/CONFIG.md) is checked against this table by a test.
KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    name: tuple(section.keys) for name, section in SCHEMA.items()
}
_SECTIONS: Final = tuple(SCHEMA)
_KEY_SETS: Final[Mapping[str, frozenset[str]]] = {
    name: frozenset(keys) for name, keys in KEYS.items()
}


def _field_defaults(result: type) -> dict[str, Any]:
    """The defaults of a dataclass's fields, by name (fields without one left out)."""
    out: dict[str, Any] = {}
    for f in fields(result):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


_DEFAULTS: Final[Mapping[str, Mapping[str, Any]]] = {
    name: _field_defaults(section.result) for name, section in SCHEMA.items()
}
#: A value that cannot be used: the key reads as its default.
_UNSET: Final = object()


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

    # --- keys, as the schema says ------------------------------------------------------

    def read(self, table: Mapping[str, Any], where: str, given: Given) -> dict[str, Any]:
        """Every key of the table at ``where``, by the schema: its dataclass's arguments."""
        section = _section(where)
        if not table.keys() <= _KEY_SETS[section]:
            self.unknown_keys(table, KEYS[section], where)
        defaults = _DEFAULTS[section]
        values: dict[str, Any] = {}
        for name, key in SCHEMA[section].keys.items():
            value = _UNSET
            if name in table:
                path = f"{where}.{name}"
                value = _READERS[key.kind](self, path, table[name], key, given)
                if value is not _UNSET and key.check is not None:
                    reason = key.check(value)
                    if reason is not None:
                        self.problem(path, reason)
            elif key.required is not None:
                why = f": {key.required}" if key.required else ""
                self.problem(_join(where, name), f"required{why}")
            if value is _UNSET or (key.blank_is_default and value == ""):
                if key.required is not None:
                    value = None
                elif key.derive is not None:
                    value = key.derive(replace(given, read=values))
                else:
                    value = defaults[name]
            values[name] = value
        return values

    def typed(self, path: str, value: object, kind: type) -> Any:
        """``value`` if it is of ``kind`` (an integer is also a number), else _UNSET."""
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        self.problem(path, f"must be {_kind_name(kind)}, not {_type_name(value)}")
        return _UNSET

    def seconds(self, path: str, raw: object, key: Key, given: Given) -> Any:
        if key.off and raw == 0 and not isinstance(raw, bool):
            return 0.0
        value = self.typed(path, raw, float)
        if value is _UNSET:
            return value
        minimum = key.minimum(given) if callable(key.minimum) else key.minimum or 0.0
        if value <= 0 or value != value or value == float("inf"):
            self.problem(path, f"must be a positive number of seconds, not {value}")
        elif value < minimum:
            why = key.why(given) if callable(key.why) else key.why
            because = f" ({why})" if why else ""
            self.problem(path, f"{value:g}s is too short; use at least {minimum:g}s{because}")
        if key.maximum is not None and value > key.maximum:
            self.problem(path, f"{value:g}s is too long; at most {key.maximum:g}s ({key.max_why})")
        return value

    def count(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, int)
        if value is _UNSET:
            return value
        minimum = 1 if key.minimum is None else key.minimum
        if value < minimum:
            self.problem(path, f"must be at least {minimum}, not {value}")
        if key.maximum is not None and value > key.maximum:
            self.problem(path, f"{value} reaches {key.max_why}; use at most {key.maximum}")
        return value

    def integer(self, path: str, raw: object, key: Key, given: Given) -> Any:
        return self.typed(path, raw, int)

    def rate(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, float)
        if value is not _UNSET and (value < 0 or value != value or value == float("inf")):
            self.problem(path, f"must be a rate per second >= 0, not {value}")
        return value

    def fraction(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, float)
        if value is not _UNSET and not 0 < value <= 1:
            self.problem(path, f"must be in (0, 1], not {value}")
        return value

    def flag(self, path: str, raw: object, key: Key, given: Given) -> Any:
        return self.typed(path, raw, bool)

    def text(self, path: str, raw: object, key: Key, given: Given) -> Any:
        return self.typed(path, raw, str)

    def choice(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, str)
        if value is not _UNSET and value not in key.choices:
            self.problem(path, f"must be one of {', '.join(key.choices)}; got {value!r}")
            return _UNSET
        return value

    def path(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, str)
        if value is _UNSET:
            return value
        if not value:
            self.problem(path, "must not be empty")
        elif "\0" in value:
            self.problem(path, "must not contain NUL")
        elif not PurePosixPath(value).is_absolute():
            self.problem(path, f"must be an absolute path, not {value!r}")
        else:
            return Path(os.path.normpath(value))
        return _UNSET

    def strings(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, list)
        if value is _UNSET:
            return value
        out: list[str] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                out.append(item)
            else:
                self.problem(f"{path}[{i}]", f"must be a string, not {_type_name(item)}")
        return tuple(out)

    def paths(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, list)
        if value is _UNSET:
            return value
        out: list[Path] = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                self.problem(f"{path}[{i}]", f"must be a string, not {_type_name(item)}")
            elif not PurePosixPath(item).is_absolute():
                self.problem(f"{path}[{i}]", f"must be an absolute path, not {item!r}")
            else:
                out.append(Path(item))
        return tuple(out)

    def algorithms(self, path: str, raw: object, key: Key, given: Given) -> Any:
        names = self.strings(path, raw, key, given)
        if names is _UNSET or len(names) < len(cast(list[object], raw)):
            return _UNSET  # reported by strings()
        if not names:
            self.problem(path, "must name at least one algorithm (omit it for defaults)")
            return _UNSET
        # Imported here, and only for a config that sets a list: asyncssh knows what it
        # supports, and a command that reads a config without one need not load it.
        from supervisor.sshalgs import SUPPORTED_ALGS

        name = path.rsplit(".", 1)[1]
        supported = SUPPORTED_ALGS[name]
        for i, alg in enumerate(names):
            if alg not in supported:
                self.problem(
                    f"{path}[{i}]", f"{alg!r} is not an algorithm this asyncssh supports for {name}"
                )
        return names

    def exit_codes(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, list)
        if value is _UNSET:
            return value
        codes: set[int] = set()
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= 255:
                self.problem(f"{path}[{i}]", f"must be an exit code 0-255, not {item!r}")
            else:
                codes.add(item)
        return frozenset(codes)

    def number(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, float)
        if value is not _UNSET and (value != value or value in (float("inf"), float("-inf"))):
            self.problem(path, f"must be a finite number, not {value}")
            return _UNSET
        return value

    def json_list(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, list)
        return value if value is _UNSET else tuple(self._json(path, value))

    def json_table(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, dict)
        return value if value is _UNSET else MappingProxyType(self._json(path, value))

    def _json(self, path: str, value: Any) -> Any:
        """``value`` as JSON can carry it (TOML dates cannot be): reported otherwise."""
        try:
            return json.loads(json.dumps(value))
        except (TypeError, ValueError) as exc:
            self.problem(path, f"must hold only JSON values: {exc}")
            return [] if isinstance(value, list) else {}

    def env(self, path: str, raw: object, key: Key, given: Given) -> Any:
        value = self.typed(path, raw, dict)
        if value is _UNSET:
            return value
        env: dict[str, str] = {}
        for name, item in value.items():
            if not _ENV_NAME.match(name):
                self.problem(f"{path}.{name}", "is not a valid environment variable name")
            elif not isinstance(item, str):
                self.problem(f"{path}.{name}", f"must be a string, not {_type_name(item)}")
            elif "\0" in item:
                self.problem(f"{path}.{name}", "must not contain NUL")
            else:
                env[name] = item
        return MappingProxyType(env)

    # --- sections: their keys, then the rules across keys -----------------------------

    def config(self, raw: Mapping[str, Any], source: Path) -> Config | None:
        self.unknown_keys(raw, _SECTIONS, "")
        given = Given(source=source)
        hosts = self.hosts(raw, given)
        run = self.run(self.table(raw, "run"), hosts, given)
        worker = self.worker(self.table(raw, "worker"), given)
        watch = WatchConfig(**self.read(self.table(raw, "watch"), "watch", given))
        trainer = TrainerConfig(**self.read(self.table(raw, "trainer"), "trainer", given))
        given = Given(source=source, watch=watch, trainer=trainer)
        health = self.health(self.table(raw, "health"), given)
        probe = self.probe(raw, run, given)
        if probe is not None:
            health = replace(
                health,
                probe_interval_s=probe.interval_s,
                probe_timeout_s=probe.timeout_s,
                probe_task=probe.task(),
                probe_expect=probe.expect,
            )
        ssh = self.ssh(self.table(raw, "ssh"), given)
        control = self.control(self.table(raw, "control"), given)
        pointer_file = run.pointer_file if run is not None else None
        detach = run is not None and run.on_exit == "detach"
        fleet = self.fleet(self.table(raw, "fleet"), given, health, ssh, pointer_file, detach)
        metrics = MetricsConfig(**self.read(self.table(raw, "metrics"), "metrics", given))
        ha = self.ha(self.table(raw, "ha"), given)
        failover = FailoverConfig(**self.read(self.table(raw, "failover"), "failover", given))
        rewards = RewardsPolicy(**self.read(self.table(raw, "rewards"), "rewards", given))
        spares = self.spares(raw, hosts or (), given)
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
            fleet=replace(fleet, failover_after_s=failover.after_s, rewards=rewards),
            metrics=metrics,
            hosts=hosts,
            ha=ha,
            trainer=trainer,
            probe=probe,
            spares=spares,
            failover=failover,
            keys_set=_keys_set(raw),
        )

    def run(
        self, t: Mapping[str, Any], hosts: tuple[HostConfig, ...] | None, given: Given
    ) -> RunConfig | None:
        # Every key is read, and the hosts checked against them, whether or not the root is
        # valid: one bad key must not hide the other problems of the file.
        values = self.read(t, "run", given)
        root, prefix = values["root"], values["cleanup_prefix"]
        if root is not None and prefix is not None and not _is_within(root, prefix):
            self.problem(
                "run.root", f"{root} is outside run.cleanup_prefix {prefix}; cleanup could not run"
            )
        if values["shard_count"] <= 0 and hosts:
            values["shard_count"] = max(h.shard for h in hosts) + 1
        if hosts is not None:
            self.check_hosts_against_run(
                hosts, values["forbid_hosts"], values["allow_hosts"], values["shard_count"]
            )
        return None if root is None else RunConfig(**values)

    def worker(self, t: Mapping[str, Any], given: Given) -> WorkerConfig:
        values = self.read(t, "worker", given)
        if not values["argv"]:
            self.problem("worker.argv", "must not be empty")
            values["argv"] = DEFAULT_ARGV
        for i, element in enumerate(values["argv"]):
            self.check_template(f"worker.argv[{i}]", element)
        return WorkerConfig(**values)

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

    def health(self, t: Mapping[str, Any], given: Given) -> Policy:
        policy = Policy(**self.read(t, "health", given))
        if policy.backoff_max_s < policy.restart_cooldown_s:
            self.problem(
                "health.backoff_max_s",
                f"{policy.backoff_max_s:g}s is below restart_cooldown_s"
                f" ({policy.restart_cooldown_s:g}s)",
            )
        return policy

    def probe(
        self, raw: Mapping[str, Any], run: RunConfig | None, given: Given
    ) -> ProbeConfig | None:
        if "probe" not in raw:
            return None
        values = self.read(self.table(raw, "probe"), "probe", given)
        if not values["reward_fn"]:
            values["reward_fn"] = run.reward_fn if run is not None else DEFAULT_REWARD_FN
        return ProbeConfig(**values)

    def ssh(self, t: Mapping[str, Any], given: Given) -> SshConfig | None:
        values = self.read(t, "ssh", given)
        if values["reconnect_max_s"] < values["reconnect_min_s"]:
            self.problem("ssh.reconnect_max_s", "must not be below ssh.reconnect_min_s")
        if values["known_hosts"] is None:
            return None
        return SshConfig(**values)

    def control(self, t: Mapping[str, Any], given: Given) -> ControlConfig:
        control = ControlConfig(**self.read(t, "control", given))
        if len(os.fsencode(str(control.socket))) > MAX_SOCKET_PATH:
            self.problem(
                "control.socket", f"path is longer than {MAX_SOCKET_PATH} bytes (AF_UNIX limit)"
            )
        return control

    def fleet(
        self,
        t: Mapping[str, Any],
        given: Given,
        health: Policy,
        ssh: SshConfig | None,
        pointer_file: Path | None,
        detach_on_exit: bool,
    ) -> FleetPolicy:
        connect_timeout_s = ssh.connect_timeout_s if ssh is not None else 0.0
        return FleetPolicy(
            **self.read(t, "fleet", given),
            detach_on_exit=detach_on_exit,
            pointer_file=None if pointer_file is None else str(pointer_file),
            startup_timeout_s=connect_timeout_s + STARTUP_SLACK_S,
            shutdown_timeout_s=shutdown_timeout_s(health.stop_grace_s),
        )

    def ha(self, t: Mapping[str, Any], given: Given) -> HaPolicy:
        ha = HaPolicy(**self.read(t, "ha", given))
        if ha.check_interval_s > HA_CHECK_MAX_S:
            # The NFS lease (90 s) is the takeover's worst case; a leader must learn it was
            # deposed well within it.
            self.problem(
                "ha.check_interval_s",
                f"must be at most {HA_CHECK_MAX_S:g}, not {ha.check_interval_s}",
            )
        return ha

    def hosts(self, raw: Mapping[str, Any], given: Given) -> tuple[HostConfig, ...] | None:
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
            host = self.host(entry, f"hosts[{i}]", given)
            if host is not None:
                self.host_index[len(hosts)] = i
                hosts.append(host)
        self.check_duplicates(hosts)
        return tuple(hosts)

    def spares(
        self, raw: Mapping[str, Any], hosts: tuple[HostConfig, ...], given: Given
    ) -> tuple[SpareConfig, ...]:
        value = raw.get("spares", [])
        if not isinstance(value, list):
            self.problem(
                "spares", f"must be an array of tables ([[spares]]), not {_type_name(value)}"
            )
            return ()
        names = {h.name: "hosts" for h in hosts}
        spares: list[SpareConfig] = []
        for i, entry in enumerate(value):
            w = f"spares[{i}]"
            if not isinstance(entry, dict):
                self.problem(w, f"must be a table, not {_type_name(entry)}")
                continue
            before = len(self.problems)
            values = self.read(cast(Mapping[str, Any], entry), w, given)
            if len(self.problems) != before:
                continue
            spare = SpareConfig(**values)
            if spare.name in names:
                self.problem(
                    f"{w}.name", f"duplicate host {spare.name!r} (also in [[{names[spare.name]}]])"
                )
                continue
            names[spare.name] = "spares"
            spares.append(spare)
        return tuple(spares)

    def host(self, entry: object, w: str, given: Given) -> HostConfig | None:
        if not isinstance(entry, dict):
            self.problem(w, f"must be a table, not {_type_name(entry)}")
            return None
        before = len(self.problems)
        values = self.read(cast(Mapping[str, Any], entry), w, given)
        if len(self.problems) == before:
            return HostConfig(**values)
        # An entry whose name or shard is refused is left out of the checks across hosts
        # (they would only echo its problem); a shard it names is not "unserved".
        refused = {p.key for p in self.problems[before:]}
        if f"{w}.name" in refused or f"{w}.shard" in refused:
            if f"{w}.shard" not in refused and values["shard"] is not None:
                self.claimed_shards.add(values["shard"])
            return None
        return HostConfig(**values)

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
        # The first 11 unserved shards lie below len(served) + 11: a typo of a billion shards
        # costs a few steps here, not a list of a billion numbers.
        missing = list(itertools.islice((s for s in range(shard_count) if s not in served), 11))
        if missing and hosts:
            shown = ", ".join(str(s) for s in missing[:10]) + (" ..." if len(missing) > 10 else "")
            self.problem(
                "hosts",
                f"no host serves shard(s) {shown} of run.shard_count={shard_count};"
                " their tasks would never be consumed",
            )


#: How each kind of key is read: its value, or _UNSET after reporting why it cannot be used.
_READERS: Final[Mapping[Kind, Callable[[_Validator, str, object, Key, Given], Any]]] = {
    "seconds": _Validator.seconds,
    "count": _Validator.count,
    "integer": _Validator.integer,
    "rate": _Validator.rate,
    "fraction": _Validator.fraction,
    "flag": _Validator.flag,
    "text": _Validator.text,
    "choice": _Validator.choice,
    "path": _Validator.path,
    "strings": _Validator.strings,
    "paths": _Validator.paths,
    "algorithms": _Validator.algorithms,
    "exit_codes": _Validator.exit_codes,
    "env": _Validator.env,
    "number": _Validator.number,
    "json_list": _Validator.json_list,
    "json_table": _Validator.json_table,
}


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
