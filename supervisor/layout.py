"""The run directory (DESIGN §5): where every file lives, and the files the supervisor writes.

The supervisor never deletes or rewrites ``inbox/``, ``outbox/`` or ``status/`` files; this
module writes only ``manifest.json``, ``ctl/launch_meta.json``, ``ctl/supervisor-state.json``
and the pointer file, always atomically (write a temp file, fsync, rename).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    def state_file(self) -> Path:
        """Restart history and backoff, kept across daemon restarts."""
        return self.ctl / "supervisor-state.json"

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
    )


def layout_of(config: Config) -> RunLayout:
    """The layout of the configured run."""
    return RunLayout(config.run.root)


def ensure_run_dirs(config: Config) -> None:
    """Create ``ctl/ status/ outbox/ inbox/<shard>/`` (existing ones are left as they are)."""
    layout = layout_of(config)
    for path in (layout.ctl, layout.status_dir, layout.outbox, layout.inbox):
        path.mkdir(parents=True, exist_ok=True)
    for shard in range(config.run.shard_count):
        layout.shard_inbox(shard).mkdir(parents=True, exist_ok=True)


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


def launch_meta(config: Config) -> dict[str, Any]:
    """``ctl/launch_meta.json`` with the seed's fields (``respawn`` is always false now)."""
    return {
        "root": str(config.run.root),
        "run_id": config.run.run_id,
        "workers": workers_list(config),
        "shard_count": config.run.shard_count,
        "reward_fn": config.run.reward_fn,
        "respawn": False,
        "supervisor": "reward-supervisor",
        "config": str(config.source),
    }


def write_run_files(config: Config) -> None:
    """Create the run directories and write the manifest and launch meta.

    Not the pointer file: that means "the workers are up" and waits for the fleet to be
    all ready (``write_pointer``).
    """
    ensure_run_dirs(config)
    layout = layout_of(config)
    write_json_atomic(layout.manifest, manifest(config))
    write_json_atomic(layout.launch_meta, launch_meta(config))


def write_pointer(path: Path, meta: Mapping[str, Any]) -> None:
    """Write the pointer file (``run.pointer_file``: a copy of ``ctl/launch_meta.json``, as
    the seed wrote it), creating its directory. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, meta)


def write_json_atomic(path: Path, data: object, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` as JSON so readers see the old or the new file, whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: Path, *, max_bytes: int = 1 << 20) -> Any:
    """Parse a small JSON file; raises OSError or ValueError (too big, not JSON)."""
    with path.open("rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes")
    return json.loads(data)


def host_names(config: Config) -> list[str]:
    """Configured host names, in config order."""
    return [h.name for h in config.hosts]
