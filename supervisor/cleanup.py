"""``reward-supervisor cleanup``: delete a run directory, and only when that is safe.

Refuses when ``run.cleanup_prefix`` is unset, when the run root (symlinks resolved) is not
strictly inside the prefix (also resolved), while a daemon runs the run, or while any worker
may be alive (a status file changed recently, or a probe over SSH finds the worker or cannot
tell). Symlinks inside the tree are removed, never followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from supervisor import control, layout
from supervisor.config import Config
from supervisor.errors import ControlError, RemoteError

# Progress lines while deleting a big tree: one every this many seconds.
PROGRESS_EVERY_S = 2.0


class Refused(Exception):
    """Cleanup will not delete anything; the message says why."""


def run(config: Config, *, yes: bool, out: Callable[[str], None]) -> int:
    """Check everything, then delete the run root; returns an exit code (raises Refused)."""
    root = check_paths(config)
    if not root.exists():
        out(f"nothing to delete: {root} does not exist")
        return 0
    check_no_daemon(config)
    check_no_live_workers(config, out)
    files, size = _measure(root)
    if not yes:
        raise Refused(
            f"would delete {root} ({files} files, {size / 1e6:.1f} MB); re-run with --yes"
        )
    out(f"deleting {root} ({files} files, {size / 1e6:.1f} MB)")
    removed = _delete_tree(root, out)
    out(f"removed {root} ({removed} entries)")
    return 0


def check_paths(config: Config) -> Path:
    """The resolved run root, if it lies strictly inside the resolved cleanup prefix."""
    prefix = config.run.cleanup_prefix
    if prefix is None:
        raise Refused("run.cleanup_prefix is not set in the config: cleanup deletes nothing")
    real_root = Path(os.path.realpath(config.run.root))
    real_prefix = Path(os.path.realpath(prefix))
    via = f" (resolved from {config.run.root})" if real_root != config.run.root else ""
    if real_root == real_prefix or not _inside(real_root, real_prefix):
        raise Refused(
            f"refusing to delete {real_root}{via}: not inside run.cleanup_prefix {real_prefix}"
        )
    return real_root


def check_no_daemon(config: Config) -> None:
    """Refuse while a daemon answers on the socket or holds the run's lock."""
    try:
        control.request_sync(config.control.socket, "ping", timeout_s=3.0)
    except ControlError:
        pass
    else:
        raise Refused(f"a daemon is running this run ({config.control.socket}); stop it first")
    lock = layout.layout_of(config).ctl / "supervisor.lock"
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise Refused(f"a daemon holds {lock}; stop it first") from None
        finally:
            os.close(fd)


def check_no_live_workers(config: Config, out: Callable[[str], None]) -> None:
    """Refuse if any worker may be alive: fresh status files, or a probe that finds one."""
    run = layout.layout_of(config)
    now = time.time()
    fresh = []
    for host in config.hosts:
        with contextlib.suppress(OSError):
            if now - run.status(host.name).stat().st_mtime < config.health.heartbeat_stale_s:
                fresh.append(host.name)
    if fresh:
        raise Refused(
            f"status files changed within heartbeat_stale_s={config.health.heartbeat_stale_s:g}s"
            f" on {', '.join(fresh)}: workers may be alive; stop them first"
        )
    candidates = [h for h in config.hosts if run.pidfile(h.name).exists()]
    if not candidates:
        return
    out(f"probing {len(candidates)} host(s) over SSH for live workers ...")
    results = asyncio.run(_probe_all(config, [h.name for h in candidates]))
    alive = {name: r for name, r in results.items() if r is not None}
    if alive:
        detail = "; ".join(f"{name}: {r}" for name, r in sorted(alive.items()))
        raise Refused(f"workers may still be alive ({detail}); stop them first")


async def _probe_all(config: Config, names: list[str]) -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    async with asyncio.TaskGroup() as tg:
        for name in names:
            tg.create_task(_probe_one(config, name, results))
    return results


async def _probe_one(config: Config, name: str, results: dict[str, str | None]) -> None:
    from supervisor.remote import RemoteHost

    cfg = config.host(name)
    if cfg is None:
        return
    up = asyncio.Event()
    remote = RemoteHost(
        cfg,
        config.ssh,
        python=config.worker.python,
        handshakes=asyncio.Semaphore(config.ssh.max_concurrent_handshakes),
        on_connection=lambda ok, _reason: up.set() if ok else None,
    )
    async with asyncio.TaskGroup() as tg:
        keeper = tg.create_task(remote.maintain())
        try:
            async with asyncio.timeout(config.ssh.connect_timeout_s + 5):
                await up.wait()
            pid = await remote.probe(layout.launch_spec(config, cfg), None)
            results[name] = None if pid is None else f"pid {pid} alive"
        except (TimeoutError, RemoteError) as exc:
            results[name] = f"cannot verify ({str(exc) or 'unreachable'})"
        finally:
            await remote.aclose()
            keeper.cancel()


def _inside(path: Path, prefix: Path) -> bool:
    try:
        return os.path.commonpath([path, prefix]) == str(prefix)
    except ValueError:
        return False


def _measure(root: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            files += 1
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(dirpath, name)).st_size
    return files, size


def _delete_tree(root: Path, out: Callable[[str], None]) -> int:
    """Remove ``root`` bottom-up without following symlinks, reporting progress."""
    removed = 0
    last = time.monotonic()
    for dirpath, dirs, names in os.walk(root, topdown=False, followlinks=False):
        for name in names:
            os.unlink(os.path.join(dirpath, name))
            removed += 1
        for name in dirs:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                os.unlink(path)
            else:
                os.rmdir(path)
            removed += 1
        if time.monotonic() - last > PROGRESS_EVERY_S:
            last = time.monotonic()
            out(f"  ... {removed} entries removed")
    os.rmdir(root)
    return removed + 1
