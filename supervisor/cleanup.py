"""``reward-supervisor cleanup``: delete a run directory, and only when that is safe.

Refuses when ``run.cleanup_prefix`` is unset, when the run root (symlinks resolved) is not
strictly inside the prefix (also resolved), while a daemon runs the run, or while any worker
may be alive (a status file changed recently, or a probe over SSH finds the worker or cannot
tell). The delete itself is ``runfiles.delete_tree``: by descriptor, from the root re-opened
without following and checked to be the directory checked here; symlinks inside the tree
are removed, never followed, even when one replaces a directory mid-delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from supervisor import control, layout, runfiles
from supervisor.config import Config
from supervisor.errors import ControlError, RemoteError

# Progress lines while deleting a big tree: one every this many seconds.
PROGRESS_EVERY_S = 2.0


class Refused(Exception):
    """Cleanup will not delete anything (more); the message says why."""


def run(config: Config, *, yes: bool, out: Callable[[str], None]) -> int:
    """Check everything, then delete the run root; returns an exit code (raises Refused)."""
    root = check_paths(config)
    try:
        checked = runfiles.identity(root)
    except FileNotFoundError:
        out(f"nothing to delete: {root} does not exist")
        return 0
    check_no_daemon(config)
    check_no_live_workers(config, out)
    try:
        files, size = runfiles.measure_tree(root, checked)
    except OSError as exc:
        raise Refused(f"cannot walk {root}: {exc}") from None
    if not yes:
        raise Refused(
            f"would delete {root} ({files} files, {size / 1e6:.1f} MB); re-run with --yes"
        )
    out(f"deleting {root} ({files} files, {size / 1e6:.1f} MB)")
    try:
        removed = _delete_tree(root, checked, out)
    except OSError as exc:
        # Nothing outside the tree was touched; what is left of it stays for a look.
        raise Refused(f"stopped deleting {root}, part of it remains: {exc}") from None
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
    run = layout.layout_of(config)
    lock = run.ctl / "supervisor.lock"
    try:
        held = runfiles.lock_is_held(lock, root=run.root)
    except OSError as exc:
        raise Refused(f"cannot tell whether a daemon holds {lock}: {exc}") from None
    if held:
        raise Refused(f"a daemon holds {lock}; stop it first")


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


def _delete_tree(root: Path, checked: tuple[int, int], out: Callable[[str], None]) -> int:
    """Remove ``root`` (still the directory ``checked``), reporting progress."""
    last = [time.monotonic()]

    def progress(removed: int) -> None:
        if time.monotonic() - last[0] > PROGRESS_EVERY_S:
            last[0] = time.monotonic()
            out(f"  ... {removed} entries removed")

    return runfiles.delete_tree(root, checked, progress)
