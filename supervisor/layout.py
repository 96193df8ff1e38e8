"""The run directory (DESIGN §5): where every file lives, and the files the supervisor writes.

The supervisor never deletes or rewrites ``inbox/``, ``outbox/`` or ``status/`` files; this
module writes only ``manifest.json``, ``ctl/launch_meta.json`` and the pointer file, always
atomically and through ``runfiles`` (which owns every open of a file under the root).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor import runfiles
from supervisor.config import Config, HostConfig, render_argv

#: Written into ``ctl/supervisor-state.json``; bump when its shape changes.
STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Paths of one run directory."""

    root: Path

    @property
    def ctl(self) -> Path:
        return self.root / "ctl"

    @property
    def status_dir(self) -> Path:
        return self.root / "status"

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def outbox(self) -> Path:
        return self.root / "outbox"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def launch_meta(self) -> Path:
        return self.ctl / "launch_meta.json"

    @property
    def epoch_file(self) -> Path:
        """``ctl/supervisor.epoch``: the current leadership's epoch (fencing)."""
        return self.ctl / "supervisor.epoch"

    @property
    def lock_file(self) -> Path:
        """``ctl/supervisor.lock``: the run lock, one leading supervisor per run."""
        return self.ctl / "supervisor.lock"

    @property
    def state_file(self) -> Path:
        """Restart history and backoff, kept across daemon restarts."""
        return self.ctl / "supervisor-state.json"

    @property
    def stop_record(self) -> Path:
        """Written by a leader whose stop ran to its end: when, under which epoch, and each
        host's last state (``runfiles.StopRecord``)."""
        return self.ctl / "supervisor-stopped.json"

    def shard_inbox(self, shard: int) -> Path:
        return self.inbox / str(shard)

    def status(self, host: str) -> Path:
        """Written by the worker: ``{"ready", "heartbeat_at", "pid", ...}``."""
        return self.status_dir / f"{host}.json"

    def pidfile(self, host: str) -> Path:
        """The worker's pid as text (seed-compatible), written by the shepherd."""
        return self.ctl / f"{host}.pid"

    def launch_record(self, host: str) -> Path:
        """pid, process start time and argv of the last launch: tells our pid from a reuse."""
        return self.ctl / f"{host}.launch.json"

    def exit_record(self, host: str) -> Path:
        """Written by the shepherd when the worker ends: pid, exit code or signal, time."""
        return self.ctl / f"{host}.exit.json"

    def log(self, host: str) -> Path:
        """Worker stdout and stderr, appended."""
        return self.ctl / f"{host}.log"

    def stop_sentinel(self, host: str) -> Path:
        """Operator sentinel: while it exists the host stays stopped."""
        return self.ctl / f"{host}.stop"

    def shard_lock(self, shard: int) -> Path:
        """Held by the shepherd for the worker's lifetime: one live worker per shard."""
        return self.ctl / f"shard-{shard}.lock"

    def host_of_ctl_file(self, path: Path) -> tuple[str, str] | None:
        """``(host, kind)`` for a per-host file in ``ctl/``, kind in pid/exit/stop/launch."""
        name = path.name
        for suffix, kind in (
            (".exit.json", "exit"),
            (".launch.json", "launch"),
            (".stop", "stop"),
            (".pid", "pid"),
        ):
            if name.endswith(suffix) and len(name) > len(suffix):
                return name[: -len(suffix)], kind
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """Everything the remote side needs to start, find and stop one host's worker.

    Plain data: paths are absolute strings as seen on the worker host (the run root is on
    the shared filesystem, so they are the same paths everywhere).
    """

    host: str
    shard: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    python: str
    root: str
    pidfile: str
    launch_record: str
    exit_record: str
    log: str
    lock: str
    log_max_bytes: int
    log_backups: int
    #: ``ctl/supervisor.epoch``, and the epoch of the leadership asking: the agent refuses a
    #: launch or terminate whose epoch is lower than the file's (fencing; 0: never refused).
    epoch_file: str = ""
    epoch: int = 0


def launch_spec(config: Config, host: HostConfig) -> LaunchSpec:
    """The launch spec of ``host`` under ``config``."""
    layout = layout_of(config)
    return LaunchSpec(
        host=host.name,
        shard=host.shard,
        argv=render_argv(config, host),
        env=dict(config.worker.env),
        python=config.worker.python,
        root=str(layout.root),
        pidfile=str(layout.pidfile(host.name)),
        launch_record=str(layout.launch_record(host.name)),
        exit_record=str(layout.exit_record(host.name)),
        log=str(layout.log(host.name)),
        lock=str(layout.shard_lock(host.shard)),
        log_max_bytes=config.worker.log_max_bytes,
        log_backups=config.worker.log_backups,
        epoch_file=str(layout.epoch_file),
    )


def layout_of(config: Config) -> RunLayout:
    """The layout of the configured run."""
    return RunLayout(config.run.root)


def run_dirs(config: Config) -> tuple[Path, ...]:
    """Every directory of the run under its root, parents first: ``ctl/ status/ outbox/
    inbox/ inbox/<shard>/``."""
    layout = layout_of(config)
    shards = (layout.shard_inbox(shard) for shard in range(config.run.shard_count))
    return (layout.ctl, layout.status_dir, layout.outbox, layout.inbox, *shards)


def ensure_run_dirs(config: Config) -> None:
    """Create the run root and ``run_dirs`` (existing ones are left as they are, but must be
    real directories: one that is a symlink raises UnsafeFileError)."""
    runfiles.ensure_dirs(config.run.root, run_dirs(config))


def workers_list(config: Config) -> list[dict[str, Any]]:
    """The seed's ``workers`` list: host, shard, concurrency per host."""
    return [{"host": h.name, "shard": h.shard, "concurrency": h.concurrency} for h in config.hosts]


def manifest(config: Config) -> dict[str, Any]:
    """``manifest.json`` with the seed's fields."""
    return {
        "experiment_name": config.run.experiment,
        "trial_name": config.run.trial,
        "run_id": config.run.run_id,
        "reward_fn": config.run.reward_fn,
        "shard_count": config.run.shard_count,
        "workers": workers_list(config),
    }


#: ``launch_meta.json``'s ``supervisor`` field in a run this program wrote (the seed's has none).
META_WRITER = "reward-supervisor"


def launch_meta(config: Config) -> dict[str, Any]:
    """``ctl/launch_meta.json`` with the seed's fields, saying what this daemon does.

    ``respawn`` means to the seed's readers what it meant to the seed: a worker that ends is
    started again. Here the daemon does that, unless ``health.auto_restart`` is false.
    ``auto_restart`` says the same in our own words; its presence tells ``import-seed`` that
    ``respawn`` can be believed (earlier versions wrote ``"respawn": false`` whatever they
    did). ``config`` is absolute: the file is read from other directories and machines.
    """
    return {
        "root": str(config.run.root),
        "run_id": config.run.run_id,
        "workers": workers_list(config),
        "shard_count": config.run.shard_count,
        "reward_fn": config.run.reward_fn,
        "respawn": config.health.auto_restart,
        "auto_restart": config.health.auto_restart,
        "supervisor": META_WRITER,
        "config": os.path.abspath(config.source),
    }


def write_run_files(config: Config) -> None:
    """Create the run directories and write the manifest and launch meta.

    Not the pointer file: that means "the workers are up" and waits for the fleet to be
    all ready (``write_pointer``).
    """
    ensure_run_dirs(config)
    layout = layout_of(config)
    runfiles.write_json_atomic(layout.manifest, manifest(config), root=layout.root)
    runfiles.write_json_atomic(layout.launch_meta, launch_meta(config), root=layout.root)


def write_pointer(path: Path, meta: Mapping[str, Any], *, root: Path | None = None) -> None:
    """Write the pointer file (``run.pointer_file``: a copy of ``ctl/launch_meta.json``, as
    the seed wrote it), creating its directory. Raises OSError.

    With ``root`` (the run root) a pointer file inside it is written as every file there is;
    elsewhere its directory is the operator's choice, trusted up to the file itself.
    """
    if root is not None and path.is_relative_to(root):
        runfiles.ensure_dirs(root, [path.parent])
        runfiles.write_json_atomic(path, meta, root=root)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        runfiles.write_json_atomic(path, meta, root=None)


def host_names(config: Config) -> list[str]:
    """Configured host names, in config order."""
    return [h.name for h in config.hosts]
