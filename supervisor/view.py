"""What operators see: status rows and tables, from the daemon's hosts or from files alone.

Pure presentation; the only I/O is ``offline_status``, which reads the run directory when
no daemon is running (and says so).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from supervisor import health, pointer, runfiles, vocabulary
from supervisor.config import Config, HostConfig
from supervisor.layout import RunLayout, layout_of
from supervisor.statusfiles import StatusProblem, StatusRecord, read_exit, read_status
from supervisor.terminal import terminal_text

if TYPE_CHECKING:
    from supervisor import fleet

# Order of states in summaries: the ones that need attention last, where the eye lands.
_SUMMARY_ORDER = [s.value for s in health.HostState]


def host_row(
    host: health.Host, cfg: HostConfig, now: float, policy: health.Policy
) -> dict[str, Any]:
    """The status of one host as plain JSON (DESIGN §7 fields, plus more)."""
    age = health.heartbeat_age_s(host, now)
    # A held restart has no time: it waits for the hold's release (its backoff is kept for then).
    held = host.held is not None
    next_at = None if held else host.next_restart_at
    next_in = None if next_at is None else max(0.0, next_at - now)
    return {
        "state": host.state.value,
        "shard": cfg.shard,
        "pid": host.pid,
        "ssh": "connected" if host.ssh_up else "unreachable",
        "ssh_reason": host.ssh_reason,
        "heartbeat_age_s": None if age is None else round(age, 3),
        "restarts": host.restarts,
        "restarts_in_window": health.restarts_in_window(host, now, policy),
        #: Planned replacements of a healthy worker (not faults), by who asked.
        "planned_restarts": {who.value: n for who, n in host.planned_restarts},
        "failures": host.failures,
        "last_reason": host.reason,
        #: Why the worker was last found unhealthy, as a code (``health.Cause``), kept after
        #: it recovers: metrics and alerts read the code, never ``last_reason``'s words.
        "last_cause": None if host.cause_code is None else host.cause_code.value,
        "next_restart_in_s": None if next_in is None else round(next_in, 3),
        #: A crash signature holds the host's automatic restarts (``last_reason`` says which).
        "restart_held": held,
        "in_state_s": round(max(0.0, now - host.since_at), 3),
        "address": f"{cfg.address}:{cfg.port}",
        "last_pid": host.last_pid,
        "last_exit": host.last_exit,
        "last_error": host.last_error,
        "status_problem": host.status_problem,
        "stop_sentinel": host.stop_sentinel,
        "operation": host.op,
        # A worker that reports no progress is judged by its heartbeat alone: say so.
        "progress": "reported" if _reports_progress(host) else "heartbeat only",
        "processed": host.processed,
        "in_flight": host.in_flight,
        "tasks_per_min": _rounded(health.tasks_per_minute(host), 1),
        "evidence_age_s": _age_of(host.evidence_at, now),
        "work": work_row(host.stats),
        #: The last reward probe answered (``[probe]``), or None.
        "last_probe": _last_probe(host, now),
    }


def _last_probe(host: health.Host, now: float) -> dict[str, Any] | None:
    """What the last reward probe found: in words, its failure code (None: it scored), its
    round trip and its age."""
    if host.last_probe is None:
        return None
    cause = host.last_probe_cause
    return {
        "what": host.last_probe,
        "cause": None if cause is None else cause.value,
        "round_trip_s": _rounded(host.last_probe_round_trip_s, 3),
        "age_s": _age_of(host.last_probe_at, now),
    }


def work_row(stats: health.WorkerStats | None) -> dict[str, Any] | None:
    """What the worker says of its work (its own figures, not judged), or None."""
    if stats is None:
        return None
    return {
        "completed": stats.completed,
        "errors": stats.errors,
        "semantic_zero": stats.semantic_zero,
        "queue_depth": stats.queue_depth,
        "qps": _rounded(stats.qps, 3),
        "concurrency": stats.concurrency,
        "rss_gib": _rounded(stats.rss_gib, 3),
        "verify_ms_p95": _rounded(stats.verify_ms_p95, 1),
    }


def work_text(work: Mapping[str, Any] | None, in_flight: object = None) -> str:
    """A worker's own figures in a few words: ``1234 ok, 3 errors, 4 in flight, queue 12``."""
    if not work:
        return ""
    parts = []
    if work.get("completed") is not None:
        parts.append(f"{work['completed']} ok")
    if work.get("errors") is not None:
        parts.append(f"{work['errors']} errors")
    if in_flight is not None:
        slots = work.get("concurrency")
        parts.append(f"{in_flight} in flight" + (f" of {slots}" if slots is not None else ""))
    if work.get("queue_depth") is not None:
        parts.append(f"queue {work['queue_depth']}")
    return ", ".join(parts)


def host_detail(
    host: health.Host,
    cfg: HostConfig,
    now: float,
    policy: health.Policy,
    *,
    wall_now: float | None = None,
) -> dict[str, Any]:
    """Everything ``status HOST`` shows of one host, as plain JSON: its row, then progress,
    restarts, the last exit and the last evidence in full. With ``wall_now`` (Unix time at
    ``now``), each instant is also given as Unix time (``*_at``)."""
    row = host_row(host, cfg, now, policy)
    next_in = row["next_restart_in_s"]
    detail = {
        **row,
        "since_s": row["in_state_s"],
        "progress": progress_detail(host, now, policy),
        "restart": {
            "total": host.restarts,
            "in_window": row["restarts_in_window"],
            "window_s": policy.restart_window_s,
            "max_restarts": policy.max_restarts,
            "failures": host.failures,
            "next_restart_in_s": next_in,
            "held": host.held,
        },
        "last_exit": _last_exit(host, now),
        "evidence": (
            None
            if host.evidence is None
            else evidence_row(
                host.evidence, age_s=_age_of(host.evidence_at, now), cause=host.evidence_cause
            )
        ),
    }
    if wall_now is not None:
        detail["restart"]["next_restart_at"] = _wall(wall_now, next_in, ahead=True)
        for part in ("last_exit", "evidence"):
            if detail[part] is not None:
                detail[part]["at"] = _wall(wall_now, detail[part].get("age_s"), ahead=False)
    return detail


def waiting_row(member: vocabulary.Member) -> dict[str, Any]:
    """A configured host that waits for its shard or name to be free (``vocabulary.WAITING``)."""
    return {
        "state": vocabulary.WAITING,
        "shard": member.shard,
        "last_reason": vocabulary.WAITING_REASON,
    }


def shown_row(
    shown: health.Host | vocabulary.Member,
    cfg: HostConfig,
    now: float,
    policy: health.Policy,
    *,
    detail: bool = False,
    wall_now: float | None = None,
) -> dict[str, Any]:
    """A host as ``Fleet.shown`` gives it: its row (``detail``: in full), or a waiting one's."""
    if isinstance(shown, vocabulary.Member):
        return waiting_row(shown)
    if detail:
        return host_detail(shown, cfg, now, policy, wall_now=wall_now)
    return host_row(shown, cfg, now, policy)


def _wall(wall_now: float, seconds: float | None, *, ahead: bool) -> float | None:
    """Unix time ``seconds`` after (``ahead``) or before ``wall_now``."""
    if seconds is None:
        return None
    return round(wall_now + seconds if ahead else wall_now - seconds, 3)


def progress_detail(host: health.Host, now: float, policy: health.Policy) -> dict[str, Any]:
    """The worker's reported progress, or that it reports none and is judged by its
    heartbeat alone."""
    if not _reports_progress(host):
        return {"reported": False, "judged_by": "heartbeat only"}
    stuck_after = None
    if policy.progress_stale_s > 0 and host.in_flight and host.progress_at is not None:
        stuck_after = max(0.0, host.progress_at + policy.progress_stale_s - now)
    return {
        "reported": True,
        "judged_by": "heartbeat and progress",
        "processed": host.processed,
        "in_flight": host.in_flight,
        "tasks_per_min": _rounded(health.tasks_per_minute(host), 1),
        "last_progress_age_s": _age_of(host.progress_at, now),
        "stuck_in_s": _rounded(stuck_after, 3),
        "progress_stale_s": policy.progress_stale_s,
    }


def evidence_row(
    evidence: health.Evidence, *, age_s: float | None = None, cause: str | None = None
) -> dict[str, Any]:
    """What was captured of a worker before it was terminated, as plain JSON."""
    row: dict[str, Any] = {
        "pid": evidence.pid,
        "via": evidence.stacks_via,
        "stacks": evidence.stacks,
        "log_tail": evidence.log_tail,
        "notes": list(evidence.notes),
        "elapsed_s": evidence.elapsed_s,
    }
    if age_s is not None:
        row["age_s"] = age_s
    if cause is not None:
        row["cause"] = cause
    return row


def _last_exit(host: health.Host, now: float) -> dict[str, Any] | None:
    if host.last_exit is None:
        return None
    return {
        "pid": host.last_exit_pid,
        "what": host.last_exit,
        "exit_code": host.last_exit_code,
        "signal": host.last_exit_signal,
        "reaped": host.last_exit_reaped,
        "age_s": _age_of(host.last_exit_at, now),
        "log_tail": host.last_log_tail,
    }


def _reports_progress(host: health.Host) -> bool:
    return host.processed is not None or host.in_flight is not None


def _age_of(at: float | None, now: float) -> float | None:
    return None if at is None else round(max(0.0, now - at), 3)


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


#: ``status HOST`` reads at most this much of the end of the worker's log for its lines.
LOG_TAIL_READ_BYTES: Final = 256 * 1024
#: Lines of the log a ``status HOST`` may ask for.
MAX_LOG_LINES: Final = 1000


def log_lines(config: Config, host: str, lines: int) -> dict[str, Any]:
    """The last ``lines`` lines of ``ctl/<host>.log`` (from its last LOG_TAIL_READ_BYTES,
    never through a symlink, decode errors replaced), or why they cannot be read."""
    layout = layout_of(config)
    path = layout.log(host)
    out: dict[str, Any] = {"path": str(path), "lines": [], "error": None}
    if lines <= 0:
        return out
    try:
        data = runfiles.read_tail(path, LOG_TAIL_READ_BYTES, root=layout.root)
    except FileNotFoundError:
        out["error"] = "no log yet"
        return out
    except OSError as exc:  # UnsafeFileError too: a planted symlink, a FIFO
        out["error"] = str(exc)
        return out
    text = data.decode("utf-8", "replace")
    kept = text.splitlines()
    if len(data) == LOG_TAIL_READ_BYTES and kept:
        kept = kept[1:]  # the first line was cut by the read: not shown half
    out["lines"] = kept[-lines:]
    return out


def pointer_row(
    path: Path | None, pointer: pointer.Pointer, written_wall: float | None, now: float
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


def status_line(fleet_view: fleet.FleetView) -> str:
    """The one line for ``STATUS=`` (``systemctl status``) and ``status``'s ``summary``: the
    states of the joined hosts, led by what holds restarts (a freeze, crash signatures). A
    signature quotes a worker's log line, and systemctl prints the line raw: it is escaped
    here."""
    shown = fleet_view.hosts
    text = summary(
        h.state.value
        for name, h in shown.items()
        if isinstance(h, health.Host) and name not in fleet_view.joining
    )
    if fleet_view.frozen:
        finding = f"{fleet_view.finding}; " if fleet_view.finding else ""
        text = f"FROZEN ({finding}restarts held: {fleet_view.frozen_reason}); {text}"
    for signature, held_hosts in (*fleet_view.crash_signatures, *fleet_view.probe_signatures):
        held = len(held_hosts)
        text = (
            f"{signature.kind.upper()} SIGNATURE ({terminal_text(signature.signature)}):"
            f" restarts held on {held} hosts, canary {signature.canary}; {text}"
        )
    return text


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
        lines += [terminal_text(line) for line in crash_signature_lines(daemon)]
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
    header = (
        "HOST",
        "SHARD",
        "STATE",
        "PID",
        "SSH",
        "BEAT",
        "RESTARTS",
        "NEXT",
        "TASKS",
        "LAST REASON",
    )
    rows: list[tuple[str, ...]] = [header]
    for name, row in hosts.items():
        state = str(row.get("state"))
        if row.get("ssh") == "unreachable" and state == "ready":
            state = "ready*"
        machine = row.get("machine")
        raw = (
            name if machine in (None, name) else f"{name} on {machine}",
            str(row.get("shard", "")),
            state,
            _dash(row.get("pid")),
            str(row.get("ssh", "")),
            _age(row.get("heartbeat_age_s")),
            _dash(row.get("restarts")),
            "held" if row.get("restart_held") else _age(row.get("next_restart_in_s")),
            _tasks_cell(row),
            str(row.get("last_reason") or row.get("last_error") or ""),
        )
        # Escaped before measuring, so widths are those of what is shown.
        shown = tuple(terminal_text(cell) for cell in raw)
        rows.append((*shown[:-1], _clip(shown[-1], 60)))
    lines += _aligned(rows)
    if any(r[2] == "ready*" for r in rows[1:]):
        lines.append("ready* = heartbeat fresh but SSH unreachable: remote actions wait")
    spares = [s for s in daemon.get("spares") or () if isinstance(s, Mapping)]
    if spares:
        described = ", ".join(
            f"{s.get('name')} {s.get('role')}" + (f" {s['serves']}" if s.get("serves") else "")
            for s in spares
        )
        lines.append(terminal_text(f"spares ({daemon.get('free_spares', 0)} free): {described}"))
    return "\n".join(lines)


def _tasks_cell(row: Mapping[str, Any]) -> str:
    """Finished tasks (errors among them) and the shard's queue, in a narrow cell."""
    work = row.get("work")
    if not isinstance(work, Mapping):
        return "-" if row.get("processed") is None else str(row["processed"])
    done = row.get("processed")
    cell = _dash(done)
    if work.get("errors"):
        cell += f" ({work['errors']} err)"
    if work.get("queue_depth") is not None:
        cell += f" q{work['queue_depth']}"
    return cell


def crash_signature_lines(daemon: Mapping[str, Any]) -> list[str]:
    """One line per crash signature that holds restarts (``status --json``'s
    ``crash_signatures``), with what releases it; unescaped (the signature quotes a log)."""
    lines = []
    for kind, how, fix in (
        ("crash", "crashed", "the worker"),
        ("probe", "failed their reward probe", "the worker or the probe's reward fn"),
    ):
        for sig in daemon.get(f"{kind}_signatures") or ():
            held = sig.get("held") or []
            lines.append(
                f"{kind.upper()} SIGNATURE for {_duration(sig.get('since_s'))}:"
                f" {len(sig.get('hosts') or [])} hosts {how} the same way"
                f" ({sig.get('signature')}); restarts held on {len(held)},"
                f" canary {sig.get('canary')}; a reload that changes {fix}, or"
                " `reward-supervisor unfreeze`, releases them"
            )
    return lines


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
    with _run_dirs(layout) as dirs:
        for cfg in config.hosts:
            hosts[cfg.name] = _offline_row(layout, dirs, cfg, now_wall, stale_s)
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


#: ``status/`` and ``ctl/`` descriptors (``None``: not a directory there).
_Dirs = tuple[int | None, int | None]


@contextlib.contextmanager
def _run_dirs(layout: RunLayout) -> Iterator[_Dirs]:
    """``status/`` and ``ctl/`` opened without following a symlink: a planted one (into a hung
    mount, say) must not hang a standby daemon's view or ``status``; their files are then
    opened by name in them."""
    fds: list[int | None] = []
    try:
        for path in (layout.status_dir, layout.ctl):
            try:
                fds.append(runfiles.open_dir_path(path))
            except OSError:
                fds.append(None)
        yield fds[0], fds[1]
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)


def _status_at(layout: RunLayout, dirs: _Dirs, host: str) -> StatusRecord | StatusProblem:
    if dirs[0] is None:
        return StatusProblem("missing")
    return read_status(layout.status(host), dir_fd=dirs[0])


def _lstat_at(fd: int | None, name: str) -> os.stat_result | None:
    """``name`` in the directory ``fd``, not followed; None when it is not there."""
    if fd is None:
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None


def _offline_row(
    layout: RunLayout, dirs: _Dirs, cfg: HostConfig, now_wall: float, stale_s: float
) -> dict[str, Any]:
    record = _status_at(layout, dirs, cfg.name)
    st = _lstat_at(dirs[0], layout.status(cfg.name).name)
    age = None if st is None else max(0.0, now_wall - st.st_mtime)
    sentinel = _lstat_at(dirs[1], layout.stop_sentinel(cfg.name).name) is not None
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
        "planned_restarts": None,
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


def offline_host_detail(
    config: Config, host: str, *, now_wall: float | None = None
) -> dict[str, Any]:
    """``status HOST`` from the run directory alone, for when no daemon answers: the seed's
    verdict, the status file's progress and the exit record."""
    layout = layout_of(config)
    now_wall = time.time() if now_wall is None else now_wall
    cfg = config.host(host)
    if cfg is None:
        raise KeyError(host)
    with _run_dirs(layout) as dirs:
        row = _offline_row(layout, dirs, cfg, now_wall, config.health.heartbeat_stale_s)
        record = _status_at(layout, dirs, host)
        exit_record = (
            None if dirs[1] is None else read_exit(layout.exit_record(host), dir_fd=dirs[1])
        )
    progress: dict[str, Any] = {"reported": False, "judged_by": "heartbeat only"}
    if isinstance(record, StatusRecord) and (
        record.processed is not None or record.in_flight is not None
    ):
        progress = {
            "reported": True,
            "judged_by": "heartbeat and progress",
            "processed": record.processed,
            "in_flight": record.in_flight,
        }
    work = work_row(record.stats) if isinstance(record, StatusRecord) else None
    last_exit = None
    if exit_record is not None:
        last_exit = {
            "pid": exit_record.pid,
            "what": health.describe_exit(
                health.WorkerExited(
                    pid=exit_record.pid,
                    exit_code=exit_record.exit_code,
                    signal=exit_record.signal,
                )
            ),
            "exit_code": exit_record.exit_code,
            "signal": exit_record.signal,
            "reaped": exit_record.reaped,
            "age_s": None
            if exit_record.exited_at is None
            else round(max(0.0, now_wall - exit_record.exited_at), 3),
            "at": exit_record.exited_at,
            "log_tail": exit_record.log_tail,
        }
    return {
        "daemon": {
            "running": False,
            "note": "daemon not running: state read from the run directory only",
            "root": str(config.run.root),
        },
        "host": host,
        **row,
        "progress": progress,
        "work": work,
        "last_exit": last_exit,
        "evidence": None,
    }


def render_host(detail: Mapping[str, Any]) -> str:
    """``status HOST`` as text for a terminal; every value escaped (``terminal_text``), each
    line of a multi-line text (stacks, log lines) on its own line."""
    out: list[str] = []

    def say(text: object, indent: int = 0) -> None:
        out.append(" " * indent + terminal_text(text))

    def block(text: object, indent: int = 4) -> None:
        for line in str(text).splitlines():
            say(line, indent)

    daemon = detail.get("daemon", {})
    name = detail.get("host")
    if not daemon.get("running", True):
        say(daemon.get("note", "daemon not running"))
        say(f"{name}: verdict {detail.get('verdict', '?')} ({detail.get('last_reason') or '-'})")
    else:
        since = _duration(detail.get("since_s"))
        say(f"{name}: {detail.get('state')} for {since}: {detail.get('last_reason') or '-'}")
    age = detail.get("heartbeat_age_s")
    beat = "no heartbeat seen yet" if age is None else f"heartbeat {_age(age)} ago"
    say(
        f"shard {detail.get('shard')}, pid {_dash(detail.get('pid'))}, ssh {detail.get('ssh')}"
        f" ({detail.get('address')}), {beat}",
        2,
    )
    progress = detail.get("progress")
    if isinstance(progress, Mapping) and progress.get("reported"):
        text = f"progress: {_dash(progress.get('processed'))} processed"
        text += f", {_dash(progress.get('in_flight'))} in flight"
        if progress.get("tasks_per_min") is not None:
            text += f", {progress['tasks_per_min']:g} tasks/min"
        if progress.get("last_progress_age_s") is not None:
            text += f", last change {_age(progress['last_progress_age_s'])} ago"
        if progress.get("stuck_in_s") is not None:
            text += f" (stuck in {_age(progress['stuck_in_s'])} without one)"
        say(text, 2)
    else:
        say("progress: not reported: judged by heartbeat only", 2)
    work = detail.get("work")
    if isinstance(work, Mapping):
        in_flight = progress.get("in_flight") if isinstance(progress, Mapping) else None
        text = "work (as the worker reports it): " + work_text(work, in_flight)
        if work.get("semantic_zero") is not None:
            text += f", {work['semantic_zero']} scored 0"
        if work.get("qps") is not None:
            text += f", {work['qps']:g} tasks/s"
        if work.get("verify_ms_p95") is not None:
            text += f", verify p95 {work['verify_ms_p95']:g} ms"
        if work.get("rss_gib") is not None:
            text += f", rss {work['rss_gib']:g} GiB"
        say(text, 2)
    restart = detail.get("restart")
    if isinstance(restart, Mapping):
        text = (
            f"restarts: {restart.get('in_window')} in the last {_duration(restart.get('window_s'))}"
            f" ({restart.get('total')} in all), {restart.get('failures')} failures in a row"
        )
        planned = detail.get("planned_restarts")
        if isinstance(planned, Mapping) and planned:
            by_whom = ", ".join(f"{n} {who}" for who, n in sorted(planned.items()))
            text += f"; planned (not faults): {by_whom}"
        if restart.get("next_restart_in_s") is not None:
            text += f", next restart in {_age(restart['next_restart_in_s'])}"
        if restart.get("held"):
            text += f", held: {restart['held']}"
        say(text, 2)
    probe = detail.get("last_probe")
    if isinstance(probe, Mapping):
        age = probe.get("age_s")
        when = f", {_age(age)} ago" if age is not None else ""
        say(f"last reward probe: {probe.get('what')}{when}", 2)
    last_exit = detail.get("last_exit")
    if isinstance(last_exit, Mapping):
        age = last_exit.get("age_s")
        when = f", {_age(age)} ago" if age is not None else ""
        reaped = last_exit.get("reaped")
        if isinstance(reaped, int):
            when += f"; {reaped} process{'' if reaped == 1 else 'es'} of its session reaped"
        say(f"last exit: pid {_dash(last_exit.get('pid'))} {last_exit.get('what')}{when}", 2)
    else:
        say("last exit: none seen", 2)
    evidence = detail.get("evidence")
    if isinstance(evidence, Mapping):
        age = evidence.get("age_s")
        when = f", {_age(age)} ago" if age is not None else ""
        say(f"evidence: pid {evidence.get('pid')}{when}, for: {evidence.get('cause') or '-'}", 2)
        for note in evidence.get("notes") or []:
            say(f"note: {note}", 4)
        if evidence.get("stacks"):
            say(f"stacks ({evidence.get('via')}):", 4)
            block(evidence["stacks"], 6)
        if evidence.get("log_tail"):
            say("log before the stacks:", 4)
            block(evidence["log_tail"], 6)
    else:
        say("evidence: none taken", 2)
    log = detail.get("log")
    if isinstance(log, Mapping):
        lines = log.get("lines") or []
        if log.get("error"):
            say(f"log {log.get('path')}: {log['error']}", 2)
        else:
            say(f"log {log.get('path')} (last {len(lines)} lines):", 2)
            for line in lines:
                say(line, 4)
    return "\n".join(out)
