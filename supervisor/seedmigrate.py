"""``reward-supervisor disarm-seed``: take a fleet over from reward_workers_ctl.py without
stopping a worker.

Owns the old script's control files in the run directory (``ctl/watch.pid``,
``ctl/watch.stop``, the ``ctl/<host>.stop`` its ``stop`` writes, ``ctl/<host>.wrap.sh``); the
work on each worker host goes through ``remote.py`` (the agent's ``disarm_seed`` op). In
order, each step only once the one before succeeded:

1. The old ``watch`` loop (``ctl/watch.pid``) is asked to exit the way the old ``stop`` asks
   it, ``ctl/watch.stop``, which it checks every round, and awaited until it removes its
   pidfile. It may run on any node, so it is not signalled; a restart it has begun ends
   first, so no host is half restarted.
2. On every host at once, the respawn wrappers (``bash ctl/<host>.wrap.sh``) are frozen and
   killed (``agent.op_disarm_seed``); the worker keeps running, and the pidfile is pointed
   at it when the wrapper had not yet written it.
3. A ``ctl/<host>.stop`` written by the old ``stop`` (its exact text, ``stop``) is removed, so
   a fleet the old script stopped does not stay stopped under the daemon. Any other stop
   file (``stop-host``'s, or one an operator made) is kept and reported.

Nothing is done to a host that cannot be reached: the report says so, the exit code is 1,
and running it again finishes the job (every step is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from supervisor import layout
from supervisor.config import Config, HostConfig
from supervisor.errors import RemoteError

log = structlog.get_logger()

#: What the old script's ``stop`` writes into ``ctl/<host>.stop`` (``echo stop > FILE``).
SEED_STOP_TEXT: Final = b"stop\n"
#: The most of a stop file read to tell whose it is; the seed's is 5 bytes.
SENTINEL_READ_MAX: Final = 256
#: How often the old watch's pidfile is looked at while waiting for it to go.
WATCH_POLL_S: Final = 0.2
#: The most pids taken from one host's report (a host is hostile; a real one has a few).
MAX_PIDS: Final = 64


@dataclass
class WatchOutcome:
    """What became of the old ``watch`` loop."""

    pid: int | None = None
    #: ``none`` (no pidfile), ``stopped``, ``would_stop`` (dry run) or ``still_running``.
    outcome: str = "none"
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Nothing of the old watch is left that could restart a host."""
        return self.outcome != "still_running"


@dataclass
class HostOutcome:
    """What was done on one host and to its stop file."""

    name: str
    error: str | None = None
    wrappers: list[int] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)
    pidfile_was: int | None = None
    pidfile_now: int | None = None
    #: ``none``, ``cleared``, ``would_clear`` (dry run), ``kept`` or ``not_checked``.
    sentinel: str = "not_checked"
    sentinel_detail: str = ""

    @property
    def ok(self) -> bool:
        """The host was reached, and at most one worker serves its shard."""
        return self.error is None and len(self.workers) <= 1


@dataclass
class Report:
    """Everything ``disarm-seed`` did (or, with ``dry_run``, would do)."""

    dry_run: bool
    watch: WatchOutcome
    hosts: list[HostOutcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every step succeeded on every host: the daemon may take over now."""
        return self.watch.ok and all(h.ok for h in self.hosts) and len(self.hosts) > 0

    def as_json(self) -> dict[str, Any]:
        """The report for ``--json``."""
        return {
            "ok": self.ok,
            "dry_run": self.dry_run,
            "watch": {"pid": self.watch.pid, "outcome": self.watch.outcome},
            "watch_detail": self.watch.detail,
            "hosts": {
                h.name: {
                    "ok": h.ok,
                    "error": h.error,
                    "wrappers_killed": [] if self.dry_run else h.wrappers,
                    "wrappers_found": h.wrappers,
                    "workers": h.workers,
                    "pidfile_was": h.pidfile_was,
                    "pidfile_now": h.pidfile_now,
                    "sentinel": h.sentinel,
                    "sentinel_detail": h.sentinel_detail,
                }
                for h in self.hosts
            },
        }

    def lines(self) -> list[str]:
        """The report for people, one line per finding, the verdict last."""
        would = "would " if self.dry_run else ""
        out = [f"watch: {self.watch.detail}"]
        for h in self.hosts:
            if h.error is not None:
                out.append(f"{h.name}: NOT DONE: {h.error}")
                continue
            parts = []
            if h.wrappers:
                parts.append(f"{would}kill respawn wrapper pid(s) {_pids(h.wrappers)}")
            else:
                parts.append("no respawn wrapper")
            if len(h.workers) == 1:
                parts.append(f"worker pid {h.workers[0]} left running")
            elif not h.workers:
                parts.append("no worker running (the daemon will launch one)")
            else:
                parts.append(
                    f"{len(h.workers)} workers on one shard: pids {_pids(h.workers)};"
                    " stop all but one before starting the daemon"
                )
            if h.pidfile_now != h.pidfile_was:
                parts.append(f"ctl/{h.name}.pid now names {h.pidfile_now} (was {h.pidfile_was})")
            if h.sentinel != "none":
                parts.append(h.sentinel_detail)
            out.append(f"{h.name}: " + "; ".join(parts))
        if self.dry_run:
            out.append("dry run: nothing was changed")
        elif self.ok:
            out.append(
                "done: start the daemon now; it adopts every running worker without a restart"
            )
        else:
            out.append("NOT DONE: fix what is named above and run disarm-seed again")
        return out


def run(config: Config, *, dry_run: bool, watch_timeout_s: float) -> Report:
    """Disarm the old script's watch and wrappers and clear its stop files (see the module)."""
    run_dir = layout.layout_of(config)
    watch = stop_watch(run_dir, timeout_s=watch_timeout_s, dry_run=dry_run)
    report = Report(dry_run=dry_run, watch=watch)
    if not watch.ok:
        report.hosts = [
            HostOutcome(name=h.name, error="not attempted: the old watch still runs")
            for h in config.hosts
        ]
        return report
    report.hosts = asyncio.run(_disarm_all(config, dry_run=dry_run))
    for outcome in report.hosts:
        if outcome.error is None:
            clear_seed_sentinel(run_dir, outcome, dry_run=dry_run)
    return report


# --- the old watch loop -------------------------------------------------------------------


def stop_watch(run_dir: layout.RunLayout, *, timeout_s: float, dry_run: bool) -> WatchOutcome:
    """Ask the old ``watch`` to exit (``ctl/watch.stop``) and wait until its pidfile goes."""
    pidfile = run_dir.ctl / "watch.pid"
    pid = _read_pid(pidfile)
    if pid is None and not _exists(pidfile):
        return WatchOutcome(detail="no ctl/watch.pid: the old watch loop is not running")
    where = _where(pid)
    if dry_run:
        return WatchOutcome(
            pid=pid,
            outcome="would_stop",
            detail=f"would write ctl/watch.stop and wait for watch pid {pid} ({where}) to exit",
        )
    try:
        _write_new(run_dir.ctl / "watch.stop", f"{time.time()}\n".encode())
    except OSError as exc:
        return WatchOutcome(
            pid=pid,
            outcome="still_running",
            detail=f"cannot write ctl/watch.stop to stop the old watch (pid {pid}): {exc}",
        )
    deadline = time.monotonic() + timeout_s
    while _exists(pidfile):
        if time.monotonic() > deadline:
            return WatchOutcome(
                pid=pid,
                outcome="still_running",
                detail=(
                    f"the old watch (ctl/watch.pid: {pid}, {where}) did not exit within"
                    f" {timeout_s:g}s of ctl/watch.stop. If it runs on another node, stop it"
                    " there; if it is dead (killed, node rebooted), delete ctl/watch.pid;"
                    " then run disarm-seed again"
                ),
            )
        time.sleep(WATCH_POLL_S)
    return WatchOutcome(
        pid=pid, outcome="stopped", detail=f"the old watch (pid {pid}) exited on ctl/watch.stop"
    )


def _where(pid: int | None) -> str:
    """Where a watch pid seems to run, as far as this node can tell."""
    if pid is None:
        return "pid unreadable"
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "not a process on this node"
    if any(a.endswith(b"reward_workers_ctl.py") for a in args) and b"watch" in args:
        return "running on this node"
    return "not the old watch on this node"


# --- the hosts -----------------------------------------------------------------------------


async def _disarm_all(config: Config, *, dry_run: bool) -> list[HostOutcome]:
    handshakes = asyncio.Semaphore(config.ssh.max_concurrent_handshakes)
    outcomes = [HostOutcome(name=h.name) for h in config.hosts]
    async with asyncio.TaskGroup() as tg:
        for cfg, outcome in zip(config.hosts, outcomes, strict=True):
            tg.create_task(_disarm_one(config, cfg, outcome, handshakes, dry_run=dry_run))
    return outcomes


async def _disarm_one(
    config: Config,
    cfg: HostConfig,
    outcome: HostOutcome,
    handshakes: asyncio.Semaphore,
    *,
    dry_run: bool,
) -> None:
    spec = layout.launch_spec(config, cfg)
    script = str(layout.layout_of(config).ctl / f"{cfg.name}.wrap.sh")
    try:
        async with _connected(config, cfg, handshakes) as remote:
            reply = await remote.disarm_seed(spec, script, dry_run=dry_run)
    except RemoteError as exc:
        outcome.error = f"{exc.reason}; its respawn wrapper may still run"
        return
    except Exception as exc:  # task root: one host's surprise must not hide the others'
        log.exception("seed.disarm_failed", host=cfg.name)
        outcome.error = f"internal error: {exc!r}; its respawn wrapper may still run"
        return
    outcome.wrappers = _int_list(reply.get("wrappers"))
    outcome.workers = _int_list(reply.get("workers"))
    outcome.pidfile_was = _opt_int(reply.get("pidfile_was"))
    outcome.pidfile_now = _opt_int(reply.get("pidfile_now"))


@contextlib.asynccontextmanager
async def _connected(
    config: Config, cfg: HostConfig, handshakes: asyncio.Semaphore
) -> AsyncIterator[Any]:
    """A ``RemoteHost`` connected to ``cfg`` for the block; RemoteError if it never is."""
    from supervisor.remote import RemoteHost

    up = asyncio.Event()
    why: list[str] = []

    def on_connection(ok: bool, reason: str) -> None:
        if ok:
            up.set()
        else:
            why.append(reason)

    remote = RemoteHost(
        cfg,
        config.ssh,
        python=config.worker.python,
        handshakes=handshakes,
        on_connection=on_connection,
    )
    # Not a TaskGroup: it would wrap the block's own RemoteError in an ExceptionGroup.
    keeper = asyncio.create_task(remote.maintain(), name=f"ssh:{cfg.name}")
    try:
        try:
            async with asyncio.timeout(config.ssh.connect_timeout_s + 5):
                await up.wait()
        except TimeoutError:
            raise RemoteError(cfg.name, why[-1] if why else "no connection") from None
        yield remote
    finally:
        await remote.aclose()
        await asyncio.wait([keeper], timeout=5)  # maintain() returns after aclose()
        keeper.cancel()


def _int_list(value: object) -> list[int]:
    if not isinstance(value, list):
        return []
    return sorted({v for v in value[:MAX_PIDS] if isinstance(v, int) and v > 0})


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# --- stop files ----------------------------------------------------------------------------


def clear_seed_sentinel(run_dir: layout.RunLayout, outcome: HostOutcome, *, dry_run: bool) -> None:
    """Remove ``ctl/<host>.stop`` if the old ``stop`` wrote it; keep (and say so) any other."""
    path = run_dir.stop_sentinel(outcome.name)
    name = f"ctl/{outcome.name}.stop"
    kind, detail = sentinel_kind(path)
    if kind == "none":
        outcome.sentinel = "none"
    elif kind == "seed" and dry_run:
        outcome.sentinel = "would_clear"
        outcome.sentinel_detail = f"would remove {name} (written by the old script's stop)"
    elif kind == "seed":
        path.unlink(missing_ok=True)
        outcome.sentinel = "cleared"
        outcome.sentinel_detail = f"removed {name} (written by the old script's stop)"
    else:
        outcome.sentinel = "kept"
        outcome.sentinel_detail = (
            f"kept {name} ({detail}): not the old script's, so the host stays stopped"
            " until start-host"
        )


def sentinel_kind(path: Path) -> tuple[str, str]:
    """``("none"|"seed"|"other", detail)``: whose stop file ``path`` is."""
    try:
        data = _read_regular(path, SENTINEL_READ_MAX)
    except FileNotFoundError:
        return "none", ""
    except OSError as exc:
        return "other", f"unreadable: {exc.strerror or exc}"
    if data == SEED_STOP_TEXT:
        return "seed", ""
    if not data:
        return "other", "empty"
    return "other", f"says {data[:40].decode('utf-8', 'replace').strip()!r}"


def _read_pid(path: Path) -> int | None:
    try:
        text = _read_regular(path, 64).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file, never through a symlink and never
    blocking on a FIFO; OSError otherwise (FileNotFoundError when it is missing)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _write_new(path: Path, data: bytes) -> None:
    """Write a small file, never through a symlink someone left at ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def _pids(pids: list[int]) -> str:
    return ", ".join(str(p) for p in pids)
