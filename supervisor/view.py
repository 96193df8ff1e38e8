"""What operators see: status rows and tables, from the daemon's hosts or from files alone.

Pure presentation; the only I/O is ``offline_status``, which reads the run directory when
no daemon is running (and says so).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from supervisor import fleet, health, runfiles
from supervisor.config import Config, HostConfig
from supervisor.layout import RunLayout, layout_of
from supervisor.statusfiles import StatusProblem, StatusRecord, read_status
from supervisor.terminal import terminal_text

# Order of states in summaries: the ones that need attention last, where the eye lands.
_SUMMARY_ORDER = [s.value for s in health.HostState]


def host_row(
    host: health.Host, cfg: HostConfig, now: float, policy: health.Policy
) -> dict[str, Any]:
    """The status of one host as plain JSON (DESIGN §7 fields, plus more)."""
    age = health.heartbeat_age_s(host, now)
    next_in = None if host.next_restart_at is None else max(0.0, host.next_restart_at - now)
    return {
        "state": host.state.value,
        "shard": cfg.shard,
        "pid": host.pid,
        "ssh": "connected" if host.ssh_up else "unreachable",
        "ssh_reason": host.ssh_reason,
        "heartbeat_age_s": None if age is None else round(age, 3),
        "restarts": host.restarts,
        "restarts_in_window": health.restarts_in_window(host, now, policy),
        "failures": host.failures,
        "last_reason": host.reason,
        "next_restart_in_s": None if next_in is None else round(next_in, 3),
        "in_state_s": round(max(0.0, now - host.since_at), 3),
        "address": f"{cfg.address}:{cfg.port}",
        "last_pid": host.last_pid,
        "last_exit": host.last_exit,
        "last_error": host.last_error,
        "status_problem": host.status_problem,
        "stop_sentinel": host.stop_sentinel,
        "operation": host.op,
    }


def pointer_row(
    path: Path | None, pointer: fleet.Pointer, written_wall: float | None, now: float
) -> dict[str, Any] | None:
    """The pointer file's progress for ``status`` (None when no pointer file is configured)."""
    if path is None:
        return None
    retry_in = None if pointer.retry_at is None else max(0.0, pointer.retry_at - now)
    return {
        "path": str(path),
        "written": pointer.written,
        "written_at": written_wall if pointer.written else None,
        "failures": pointer.failures,
        "error": pointer.last_error,
        "retry_in_s": None if retry_in is None else round(retry_in, 3),
    }


def summary(states: Iterable[str]) -> str:
    """``48/50 ready, 1 cooling_down, 1 starting``: the one line for STATUS= and humans."""
    counts = Counter(states)
    total = sum(counts.values())
    parts = [f"{counts.get('ready', 0)}/{total} ready"]
    parts += [f"{counts[s]} {s}" for s in _SUMMARY_ORDER if s != "ready" and counts.get(s)]
    return ", ".join(parts)


def render_table(status: Mapping[str, Any]) -> str:
    """The status JSON as an aligned text table with a header line, for a terminal: every
    value is escaped (``terminal_text``), so a host's text cannot drive the screen."""
    daemon = status.get("daemon", {})
    hosts: Mapping[str, Mapping[str, Any]] = status.get("hosts", {})
    lines: list[str] = []
    if daemon.get("role") == "standby":
        warm = daemon.get("warm") or {}
        lines.append(
            terminal_text(
                f"standby pid {daemon.get('pid')} up {_duration(daemon.get('uptime_s'))},"
                f" leader: {daemon.get('leader')}, epoch {daemon.get('epoch')},"
                f" warm {warm.get('connected')}/{warm.get('hosts')} connected,"
                f" {warm.get('probed')} probed; hosts as the run directory shows them:"
            )
        )
        return "\n".join([*lines, *_offline_table(hosts)])
    if daemon.get("running", True):
        frozen = " FROZEN: restarts held" if daemon.get("frozen") else ""
        if frozen and daemon.get("freeze_finding"):
            frozen += f" ({daemon['freeze_finding']})"
        lines.append(
            terminal_text(
                f"daemon pid {daemon.get('pid')} up {_duration(daemon.get('uptime_s'))},"
                f" {daemon.get('summary', '')}, watch {daemon.get('watch_mode', '?')}{frozen}"
                + (f", leader, epoch {daemon['epoch']}" if daemon.get("epoch") else "")
            )
        )
        pointer = daemon.get("pointer")
        if isinstance(pointer, Mapping) and pointer.get("error"):
            retry = pointer.get("retry_in_s")
            lines.append(
                f"pointer file {pointer.get('path')} not written: {pointer['error']}"
                + (f" (retry in {_age(retry)})" if retry is not None else "")
            )
    else:
        lines.append(terminal_text(daemon.get("note", "daemon not running")))
        return "\n".join([*lines, *_offline_table(hosts)])
    header = ("HOST", "SHARD", "STATE", "PID", "SSH", "BEAT", "RESTARTS", "NEXT", "LAST REASON")
    rows: list[tuple[str, ...]] = [header]
    for name, row in hosts.items():
        state = str(row.get("state"))
        if row.get("ssh") == "unreachable" and state == "ready":
            state = "ready*"
        raw = (
            name,
            str(row.get("shard", "")),
            state,
            _dash(row.get("pid")),
            str(row.get("ssh", "")),
            _age(row.get("heartbeat_age_s")),
            _dash(row.get("restarts")),
            _age(row.get("next_restart_in_s")),
            str(row.get("last_reason") or row.get("last_error") or ""),
        )
        # Escaped before measuring, so widths are those of what is shown.
        shown = tuple(terminal_text(cell) for cell in raw)
        rows.append((*shown[:-1], _clip(shown[-1], 60)))
    lines += _aligned(rows)
    if any(r[2] == "ready*" for r in rows[1:]):
        lines.append("ready* = heartbeat fresh but SSH unreachable: remote actions wait")
    return "\n".join(lines)


def _offline_table(hosts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Rows from files alone, with the seed's verdict where the daemon's state would be."""
    header = ("HOST", "SHARD", "VERDICT", "PID", "STATUS PID", "BEAT", "NOTE")
    rows: list[tuple[str, ...]] = [header]
    for name, row in hosts.items():
        note = str(row.get("last_reason") or "")
        if row.get("stop_sentinel"):
            note = f"ctl/{name}.stop present (kept stopped); {note}"
        raw = (
            name,
            str(row.get("shard", "")),
            str(row.get("verdict", "?")),
            _dash(row.get("pid")),
            _dash(row.get("status_pid")),
            _age(row.get("heartbeat_age_s")),
            note,
        )
        # What a file says is escaped before it reaches a terminal (and before measuring).
        shown = tuple(terminal_text(cell) for cell in raw)
        rows.append((*shown[:-1], _clip(shown[-1], 60)))
    return _aligned(rows)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as lines with every column but the last padded to its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join([c.ljust(w) for c, w in zip(r, widths, strict=False)] + [r[-1]]).rstrip()
        for r in rows
    ]


def offline_status(config: Config, *, now_wall: float | None = None) -> dict[str, Any]:
    """Status from the run directory alone, for when no daemon answers.

    Heartbeat age here is the status file's modification time against this machine's
    clock: it cannot be skew-immune without a daemon watching the file change. Each row
    carries the seed's verdict too (``verdict``, ``ok``, ``status_pid``, ``ready``).
    """
    layout = layout_of(config)
    now_wall = time.time() if now_wall is None else now_wall
    stale_s = config.health.heartbeat_stale_s
    hosts: dict[str, Any] = {}
    for cfg in config.hosts:
        hosts[cfg.name] = _offline_row(layout, cfg, now_wall, stale_s)
    return {
        "daemon": {
            "running": False,
            "note": "daemon not running: state read from the run directory only",
            "root": str(config.run.root),
            "heartbeat_stale_s": stale_s,
        },
        "hosts": hosts,
    }


#: The seed's verdicts (``reward_workers_ctl.py status``: its ``reason``), worst first.
SEED_VERDICTS = ("status_missing", "status_bad", "heartbeat_stale", "not_ready", "ok")


def seed_verdict(record: StatusRecord | StatusProblem, age_s: float | None, stale_s: float) -> str:
    """The seed's verdict on one host from its status file: ``status_missing``,
    ``status_bad``, ``heartbeat_stale`` (older than ``stale_s``), ``not_ready`` or ``ok``,
    checked in that order as the seed did."""
    if isinstance(record, StatusProblem):
        return "status_missing" if record.reason == "missing" else "status_bad"
    if age_s is None:
        return "status_missing"  # gone between the read and the stat
    if age_s > stale_s:
        return "heartbeat_stale"
    return "ok" if record.ready else "not_ready"


def _offline_row(
    layout: RunLayout, cfg: HostConfig, now_wall: float, stale_s: float
) -> dict[str, Any]:
    status_path = layout.status(cfg.name)
    record = read_status(status_path)
    try:
        age: float | None = max(0.0, now_wall - status_path.lstat().st_mtime)
    except OSError:
        age = None
    sentinel = layout.stop_sentinel(cfg.name).exists()
    pid = _read_pid(layout, cfg.name)
    ok = isinstance(record, StatusRecord)
    verdict = seed_verdict(record, age, stale_s)
    return {
        "state": "stopped" if sentinel else "unknown",
        "verdict": verdict,
        "ok": verdict == "ok",
        "shard": cfg.shard,
        "pid": pid,
        "status_pid": record.pid if isinstance(record, StatusRecord) else None,
        "ready": record.ready if isinstance(record, StatusRecord) else None,
        "ssh": "unknown",
        "heartbeat_age_s": None if age is None else round(age, 3),
        "restarts": None,
        "last_reason": (
            ("ready" if record.ready else "not ready") + f" (status pid {record.pid})"
            if isinstance(record, StatusRecord)
            else record.reason
        ),
        "status_ok": ok,
        "stop_sentinel": sentinel,
        "address": f"{cfg.address}:{cfg.port}",
    }


def _read_pid(layout: RunLayout, host: str) -> int | None:
    return runfiles.read_pid(layout.pidfile(host), root=layout.root)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _age(value: object) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.1f}s" if value < 100 else _duration(value)


def _duration(value: object) -> str:
    if not isinstance(value, int | float):
        return "?"
    seconds = int(value)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
