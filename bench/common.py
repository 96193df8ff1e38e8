"""Shared helpers of the benchmarks: machine facts, statistics, /proc readings, file writes.

Nothing here measures anything by itself; every number in a report comes from the scripts
that import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import asyncssh

if TYPE_CHECKING:
    from tests.sshd import OpenSsh

ROOT = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
#: Where run directories go: tmpfs when there is one, so a disk's fsync latency is not what
#: we measure (the daemon never fsyncs status files; the workers and simulator write them).
SCRATCH = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


#: The status-file reader thread's name: in ``supervisor.statusfiles`` before the watcher
#: had a module of its own. Looked up there first, because with an older checkout on
#: ``PYTHONPATH`` the venv's editable install still supplies ``supervisor.watch``.
FILE_THREAD_NAME: Final[str] = (
    getattr(importlib.import_module("supervisor.statusfiles"), "FILE_THREAD_NAME", None)
    or importlib.import_module("supervisor.watch").FILE_THREAD_NAME
)


# --- machine -----------------------------------------------------------------------------


def machine_facts() -> dict[str, str]:
    """What the numbers were measured on."""
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        mem_gb = f"{int(first.split()[1]) / 1024 / 1024:.1f} GiB"
    ssh_version = "?"
    with contextlib.suppress(OSError):
        done = subprocess.run(["ssh", "-V"], capture_output=True, text=True, check=False)
        ssh_version = (done.stderr or done.stdout).strip()
    versions = {}
    for package in ("asyncssh", "watchfiles", "structlog"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "?"
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem_gb,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "asyncssh": versions["asyncssh"],
        "watchfiles": versions["watchfiles"],
        "structlog": versions["structlog"],
        "openssh": ssh_version,
        "scratch": f"{SCRATCH} ({_fstype(SCRATCH)})",
    }


def load_average() -> str:
    """The 1/5/15-minute load averages now."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def _fstype(path: Path) -> str:
    """The filesystem type of the mount that holds ``path``."""
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            mount = fields[1]
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fields[2]
    return kind


def raise_nofile() -> int:
    """Raise the soft open-file limit to the hard one (children inherit it); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# --- statistics --------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), nearest-rank; NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(samples: Sequence[float]) -> float:
    """The median; NaN for no samples."""
    return statistics.median(samples) if samples else math.nan


def fmt_s(seconds: float) -> str:
    """A duration for a table: ms below 10 s, s above."""
    if math.isnan(seconds):
        return "-"
    if abs(seconds) < 10:
        return f"{seconds * 1000:.0f} ms" if abs(seconds) >= 0.1 else f"{seconds * 1000:.1f} ms"
    return f"{seconds:.1f} s"


def fmt_range(samples: Sequence[float]) -> str:
    """``median (min-max)``."""
    if not samples:
        return "-"
    return f"{fmt_s(median(samples))} ({fmt_s(min(samples))}-{fmt_s(max(samples))})"


def ratio(baseline: Sequence[float], ours: Sequence[float]) -> str:
    """baseline median / our median, as ``12.3x``."""
    b, o = median(baseline), median(ours)
    if math.isnan(b) or math.isnan(o) or o <= 0:
        return "-"
    return f"{b / o:.1f}x"


# --- /proc -------------------------------------------------------------------------------


def proc_stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first), or None if there is no such process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].decode().split()


def pid_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (PID 1 here reaps orphans only every ~1.7 s)."""
    fields = proc_stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: start time in clock ticks since boot."""
    fields = proc_stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds; NaN if it is gone."""
    fields = proc_stat_fields(pid)
    if fields is None:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 if it is gone)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * PAGE_SIZE


def with_bytecode() -> None:
    """Let the processes a benchmark starts write and reuse compiled bytecode, as an install
    does (pip compiles at install): with ``PYTHONDONTWRITEBYTECODE`` set (this machine sets
    it), every daemon start compiled its whole source again, ~100 ms before its first
    connection that no installed daemon pays, and more for a larger checkout."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def machine_busy_s() -> float:
    """CPU seconds all cores have spent not idle since boot (/proc/stat), every process's."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(f) for f in fields]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / CLOCK_TICKS


def thread_count(pid: int) -> int:
    """Threads of ``pid``."""
    fields = proc_stat_fields(pid)
    return int(fields[17]) if fields is not None else 0


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of ``pid``: tid -> (its name, utime + stime in seconds)."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            data = Path(f"/proc/{pid}/task/{tid}/stat").read_bytes()
        except OSError:
            continue  # the thread ended meanwhile
        name = data[data.index(b"(") + 1 : data.rindex(b")")].decode(errors="replace")
        fields = data[data.rindex(b")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return out


#: How the daemon's threads are reported: its event loop, its status-file reader thread,
#: watchfiles' Rust inotify reader, and the rest (watchfiles' waiting thread, executors).
THREAD_KINDS: Final = ("event loop", "status-file reader", "inotify reader", "other threads")


def _thread_kind(pid: int, tid: int, name: str) -> str:
    """Which of THREAD_KINDS a thread is."""
    if tid == pid:
        return "event loop"
    if name == FILE_THREAD_NAME:
        return "status-file reader"
    return "inotify reader" if name.startswith("notify-rs") else "other threads"


@dataclass(frozen=True, slots=True)
class CpuWindow:
    """CPU used by one process over a wall-clock window."""

    seconds: float
    cpu_s: float
    rss_start: int
    rss_end: int
    rss_peak: int
    #: CPU seconds by THREAD_KINDS over the window (threads born in it count from zero).
    by_thread: dict[str, float] = field(default_factory=dict)

    def thread_percent(self, kind: str) -> float:
        """% of one core used by the threads of one kind."""
        return 100 * self.by_thread.get(kind, 0.0) / self.seconds if self.seconds > 0 else math.nan

    @property
    def percent(self) -> float:
        """% of one core."""
        return 100 * self.cpu_s / self.seconds if self.seconds > 0 else math.nan


async def measure_cpu(pid: int, seconds: float, *, sample_s: float = 1.0) -> CpuWindow:
    """utime+stime of ``pid`` over ``seconds`` of wall time, and its RSS along the way."""
    rss_start = rss_bytes(pid)
    peak = rss_start
    threads0 = thread_cpu_seconds(pid)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    end = t0 + seconds
    while (left := end - time.monotonic()) > 0:
        await asyncio.sleep(min(sample_s, left))  # wait-ok: the measurement window itself
        peak = max(peak, rss_bytes(pid))
    cpu1, t1 = cpu_seconds(pid), time.monotonic()
    by_thread: dict[str, float] = {}
    for tid, (name, spent) in thread_cpu_seconds(pid).items():
        kind = _thread_kind(pid, tid, name)
        before = threads0.get(tid, (name, 0.0))[1]
        by_thread[kind] = by_thread.get(kind, 0.0) + spent - before
    rss_end = rss_bytes(pid)
    return CpuWindow(
        seconds=t1 - t0,
        cpu_s=cpu1 - cpu0,
        rss_start=rss_start,
        rss_end=rss_end,
        rss_peak=peak,
        by_thread=by_thread,
    )


# --- files -------------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (temp file named ``.NAME.tmp`` in the same directory)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None (missing, partial, not an object)."""
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def iso_to_epoch(stamp: str) -> float:
    """``2026-12-02T17:29:52.123456Z`` -> Unix seconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class StatusWatch:
    """Looks at status files the way a fast, cheap observer can: ``stat`` each file, read it
    only when its inode or mtime changed. Used to time the supervisor and the old way alike."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self.paths = list(paths)
        self._sig: dict[Path, tuple[int, int]] = {}
        self.current: dict[Path, dict[str, Any] | None] = {}

    def refresh(self) -> None:
        """Re-read the files that changed since the last call."""
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                self._sig.pop(path, None)
                self.current[path] = None
                continue
            sig = (st.st_ino, st.st_mtime_ns)
            if self._sig.get(path) != sig:
                self._sig[path] = sig
                self.current[path] = read_json(path)

    def ready_pid(self, path: Path) -> int | None:
        """The pid the file shows ready, if it does."""
        status = self.current.get(path)
        if status is None or status.get("ready") is not True:
            return None
        pid = status.get("pid")
        return pid if isinstance(pid, int) else None


def old_ssh_argv(sshd: OpenSsh, address: str, script: str) -> list[str]:
    """The old way's ``ssh`` command line (the seed's ``_ssh``): a fresh client per command,
    no ``~/.ssh/config``, the test sshd's host key enforced."""
    return [
        *("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"),
        *("-o", f"UserKnownHostsFile={sshd.known_hosts}", "-o", "StrictHostKeyChecking=yes"),
        *("-F", "/dev/null", "-i", str(sshd.client_key), "-p", str(sshd.port)),
        f"{sshd.username}@{address}",
        script,
    ]


async def raw_connection(sshd: OpenSsh, address: str = "127.0.0.1") -> asyncssh.SSHClientConnection:
    """A plain asyncssh connection to the test sshd: what the floor's ``conn.run`` uses."""
    return await asyncssh.connect(
        address,
        sshd.port,
        username=sshd.username,
        known_hosts=str(sshd.known_hosts),
        client_keys=[str(sshd.client_key)],
        config=None,
        agent_path=None,
        gss_host=None,
    )
