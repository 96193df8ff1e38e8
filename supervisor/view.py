"""What operators see: status rows, from the daemon's hosts or from files alone (the text a
terminal shows of them is ``render.py``'s).

Pure presentation; the only I/O is ``offline_status`` and ``offline_host_detail``, which read
the run directory when no daemon is running (and say so), and ``log_lines``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from supervisor import health, pointer, rewards, runfiles, vocabulary
from supervisor.config import Config, HostConfig
from supervisor.layout import RunLayout, layout_of
from supervisor.policies import RewardsPolicy
from supervisor.render import summary
from supervisor.statusfiles import MISSING, StatusProblem, StatusRecord, read_exit, read_status
from supervisor.terminal import terminal_text

if TYPE_CHECKING:
    from supervisor import fleet


def host_row(
    host: health.Host,
    cfg: HostConfig,
    now: float,
    policy: health.Policy,
    *,
    lie: rewards.Lie | None = None,
    reward_row: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The status of one host as plain JSON (DESIGN §7 fields, plus more). A ready host the
    fleet named as lying (``lie``) shows ``vocabulary.LYING`` and the lie as its reason;
    ``reward_row`` is its row of ``rewards_row``."""
    age = health.heartbeat_age_s(host, now)
    # A held restart has no time: it waits for the hold's release (its backoff is kept for then).
    held = host.held is not None
    next_at = None if held else host.next_restart_at
    next_in = None if next_at is None else max(0.0, next_at - now)
    return {
        "state": host.state.value if lie is None else vocabulary.LYING,
        "shard": cfg.shard,
        "pid": host.pid,
        "ssh": "connected" if host.ssh_up else "unreachable",
        "ssh_reason": host.ssh_reason,
        "heartbeat_age_s": None if age is None else round(age, 3),
        "restarts": host.restarts,
        "restarts_in_window": health.restarts_in_window(host, now, policy),
        #: Planned replacements of a healthy worker (not faults), by who asked, and who asked
        #: for the one under way, if one is.
        "planned_restarts": {who.value: n for who, n in host.planned_restarts},
        "planned": None if host.planned is None else host.planned.value,
        "failures": host.failures,
        "last_reason": host.reason if lie is None else f"rewards lie: {lie.reason}",
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
        "work": work_row(host.stats, _of_worker(host, now), now),
        #: The last reward probe answered (``[probe]``), or None.
        "last_probe": _last_probe(host, now),
        #: Its recent zero and error rates beside the fleet's, and the verdict (``[rewards]``).
        "rewards": reward_row,
    }


def rewards_row(state: rewards.Rewards, name: str, now: float) -> dict[str, Any] | None:
    """What the last look at ``name``'s rewards found: its recent tasks, its zero and error
    rates beside the fleet's (the median of the other hosts'), and the verdict: ``lying``
    (named: ``reason`` says why), ``out of line`` (not for long enough yet), ``in line``, or
    ``not judged`` (too few tasks, or no other host to compare with). None: never looked at
    (no worker reports its counts)."""
    host = state.hosts.get(name)
    look = None if host is None else host.last
    named = state.named.get(name)
    if look is None and named is None:
        return None
    row: dict[str, Any] = {}
    if look is not None:
        recent = look.recent
        row.update(
            {
                "window_s": round(look.span_s, 1),
                "results": round(recent.results),
                "scored": round(recent.scored),
                "zero": round(recent.zero),
                "errors": round(recent.errors),
                "zero_rate": _rounded(recent.zero_rate, 4),
                "error_rate": _rounded(recent.error_rate, 4),
                "fleet_zero_rate": _rounded(look.fleet_zero, 4),
                "fleet_error_rate": _rounded(look.fleet_error, 4),
                "out_of_line": list(look.out),
                "out_of_line_with_its_past": list(look.past_out),
                "age_s": _age_of(host.looked_at if host is not None else None, now),
            }
        )
    if named is not None:
        verdict = "lying"
    elif look is not None and look.out:
        verdict = "out of line"
    elif look is not None and look.judged:
        verdict = "in line"
    else:
        verdict = "not judged"
    row["verdict"] = verdict
    if named is not None:
        row.update(
            {
                "reason": named.reason,
                "kinds": list(named.kinds),
                "named_on": named.machine,
                "named_for_s": _age_of(named.since_at, now),
                "kept": name in state.kept,
            }
        )
    return row


def fleet_rewards_row(state: rewards.Rewards, policy: RewardsPolicy, now: float) -> dict[str, Any]:
    """The fleet's side of rewards that lie, for ``status``'s daemon row: the fleet's rates,
    the hosts named, the machines held for lying (until ``undrain``), a fleet-wide
    signature."""
    signature = state.signature
    return {
        "judged": policy.window_s > 0,
        "fleet_zero_rate": _rounded(state.fleet_zero, 4),
        "fleet_error_rate": _rounded(state.fleet_error, 4),
        "lying": sorted(state.named),
        "held": [
            {
                "machine": machine,
                "host": lie.host,
                "reason": lie.reason,
                "since_s": _age_of(lie.since_at, now),
            }
            for machine, lie in sorted(state.held.items())
        ],
        "signature": None
        if signature is None
        else {
            "kinds": list(signature.kinds),
            "hosts": sorted(signature.hosts),
            "reason": signature.reason,
            "since_s": _age_of(signature.since_at, now),
        },
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


def work_row(
    stats: health.WorkerStats | None, measured: Measured | None = None, now: float = 0.0
) -> dict[str, Any] | None:
    """What the worker says of its work (its own figures, not judged) and the memory its
    session holds, or None when there is neither.

    ``rss_bytes`` is the agent's measure of the current worker's whole session (``measured``,
    when it is that worker's and recent), else the worker's own ``rss_gib`` in bytes (taken
    whole: rounded first, the AReaL worker's figure, itself 1024 times too small, was 0);
    ``rss_source`` says which ("agent" or "worker"). ``rss_gib`` is the worker's own figure
    as it wrote it.
    """
    if stats is None and measured is None:
        return None
    stats = stats or health.WorkerStats()
    row: dict[str, Any] = {
        "completed": stats.completed,
        "errors": stats.errors,
        "semantic_zero": stats.semantic_zero,
        "queue_depth": stats.queue_depth,
        "qps": _rounded(stats.qps, 3),
        "concurrency": stats.concurrency,
        "rss_gib": stats.rss_gib,
        "verify_ms_p95": _rounded(stats.verify_ms_p95, 1),
        "rss_bytes": None if stats.rss_gib is None else round(stats.rss_gib * GIB),
        "rss_source": None if stats.rss_gib is None else "worker",
    }
    if measured is not None:
        row["rss_bytes"] = measured.usage.rss_bytes
        row["rss_source"] = "agent"
        row["rss_processes"] = measured.usage.processes
        row["rss_via"] = measured.usage.via
        row["rss_age_s"] = _age_of(measured.at, now)
    return row


@dataclass(frozen=True, slots=True)
class Measured:
    """What a host's agent last measured of its worker's session (``health.UsageMeasured``),
    and when (our monotonic clock)."""

    usage: health.UsageMeasured
    at: float


#: Bytes in a GiB, the unit of the worker's ``rss_gib``.
GIB: Final = 2**30
#: The agent measures every ``USAGE_S`` (10 s): a measure older than three of those is of a
#: connection gone quiet, and the worker's own figure (if any) is shown instead.
MEASURE_FRESH_S: Final = 30.0


def _of_worker(host: health.Host, now: float) -> Measured | None:
    """The host's last measure of its worker's session, if it is of the current worker (not
    of the one before it) and recent."""
    usage, at = host.usage, host.usage_at
    if usage is None or at is None or host.pid is None or usage.pid != host.pid:
        return None
    return Measured(usage, at) if now - at <= MEASURE_FRESH_S else None


def host_detail(
    host: health.Host,
    cfg: HostConfig,
    now: float,
    policy: health.Policy,
    *,
    wall_now: float | None = None,
    lie: rewards.Lie | None = None,
    reward_row: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything ``status HOST`` shows of one host, as plain JSON: its row, then progress,
    restarts, the last exit and the last evidence in full. With ``wall_now`` (Unix time at
    ``now``), each instant is also given as Unix time (``*_at``)."""
    row = host_row(host, cfg, now, policy, lie=lie, reward_row=reward_row)
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
    lie: rewards.Lie | None = None,
    reward_row: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A host as ``Fleet.view`` gives it: its row (``detail``: in full), or a waiting one's."""
    if isinstance(shown, vocabulary.Member):
        return waiting_row(shown)
    if detail:
        return host_detail(
            shown, cfg, now, policy, wall_now=wall_now, lie=lie, reward_row=reward_row
        )
    return host_row(shown, cfg, now, policy, lie=lie, reward_row=reward_row)


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
    stuck_at = health.stuck_at(host, policy)
    stuck_after = None if stuck_at is None else max(0.0, stuck_at - now)
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


def status_line(fleet_view: fleet.FleetView) -> str:
    """The one line for ``STATUS=`` (``systemctl status``) and ``status``'s ``summary``: the
    states of the joined hosts (a host named as lying counts as ``lying``), led by what
    holds restarts (a freeze, crash signatures) and what makes rewards wrong (lying hosts, a
    fleet-wide reward signature). A signature quotes a worker's log line, and systemctl
    prints the line raw: it is escaped here."""
    shown = fleet_view.hosts
    text = summary(
        vocabulary.LYING if name in fleet_view.lying else h.state.value
        for name, h in shown.items()
        if isinstance(h, health.Host) and name not in fleet_view.joining
    )
    lying = sorted(fleet_view.lying)
    if lying:
        more = f" and {len(lying) - 3} more" if len(lying) > 3 else ""
        text = f"REWARDS LIE on {', '.join(lying[:3])}{more}; {text}"
    reward_signature = fleet_view.rewards.signature
    if reward_signature is not None:
        text = (
            f"REWARD SIGNATURE ({', '.join(reward_signature.kinds)} rate):"
            f" {len(reward_signature.hosts)} hosts out of line with their own past at once,"
            f" nothing moved; {text}"
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


def offline_status(
    config: Config, *, now_wall: float | None = None, look_at_lock: bool = True
) -> dict[str, Any]:
    """Status from the run directory alone, for when no daemon answers.

    Heartbeat age here is the status file's modification time against this machine's
    clock: it cannot be skew-immune without a daemon watching the file change. Each row
    carries the seed's verdict too (``verdict``, ``ok``, ``status_pid``, ``ready``).
    ``look_at_lock`` False in a daemon's own process (a standby's view): closing any
    descriptor of the lock file releases the locks its process holds.
    """
    layout = layout_of(config)
    now_wall = time.time() if now_wall is None else now_wall
    stale_s = config.health.heartbeat_stale_s
    daemon, stop = last_daemon(layout, look_at_lock=look_at_lock)
    hosts: dict[str, Any] = {}
    with _run_dirs(layout) as dirs:
        for cfg in config.hosts:
            hosts[cfg.name] = _offline_row(layout, dirs, cfg, now_wall, stale_s, stop)
    return {
        "daemon": {**daemon, "root": str(config.run.root), "heartbeat_stale_s": stale_s},
        "hosts": hosts,
    }


#: ``status``'s exit status when no daemon answered (LSB init scripts' ``status`` codes, as
#: ``systemctl status`` gives them): a daemon elsewhere holds the run lock (running), the
#: last one stopped cleanly or none ever led the run (not running), or the last one to lead
#: did not stop cleanly (dead: killed, crashed, its node lost; its workers may run on).
OFFLINE_RUNNING: Final = 0
OFFLINE_DEAD: Final = 1
OFFLINE_NOT_RUNNING: Final = 3


def offline_exit_status(daemon: Mapping[str, Any]) -> int:
    """The exit status of ``status`` for an offline ``daemon`` row (``last_daemon``)."""
    if daemon.get("lock_holder"):
        return OFFLINE_RUNNING
    if daemon.get("stopped_cleanly_at") is not None or not daemon.get("last_epoch"):
        return OFFLINE_NOT_RUNNING
    return OFFLINE_DEAD


def wall_text(at: float) -> str:
    """A wall-clock instant for people, in UTC as the logs are."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def last_daemon(
    layout: RunLayout, *, look_at_lock: bool = True
) -> tuple[dict[str, Any], runfiles.StopRecord | None]:
    """What the run directory says of the daemon that last led the run, when none answers:
    the ``daemon`` row of an offline status (``running``, ``note``, ``lock_holder``,
    ``last_epoch``, ``stopped_cleanly_at``, ``stopped_by``), and its stop record when that
    record is of the last leadership (its epoch is the one on disk) and nobody is seen to
    lead now (the lock is looked at only with ``look_at_lock``)."""
    epoch = runfiles.read_epoch(layout.epoch_file, root=layout.root)
    holder = runfiles.current_holder(layout.lock_file, root=layout.root) if look_at_lock else ""
    row: dict[str, Any] = {
        "running": False,
        "lock_holder": holder or None,
        "last_epoch": epoch or None,
        "stopped_cleanly_at": None,
        "stopped_by": None,
    }
    record = runfiles.read_stop_record(layout.stop_record, root=layout.root)
    if holder:
        row["note"] = (
            f"no daemon answered here, but {holder} holds the run lock: a daemon leads this"
            " run (another node's, or one with another control socket); state read from the"
            " run directory only"
        )
        return row, None
    if record is not None and epoch is not None and record.epoch == epoch:
        row["stopped_cleanly_at"] = record.stopped_at
        row["stopped_by"] = record.by
        row["note"] = (
            f"daemon not running: it stopped cleanly at {wall_text(record.stopped_at)}"
            f" ({record.by}); state read from the run directory only"
        )
        return row, record
    if epoch:
        row["note"] = (
            f"daemon not running, and the last one to lead this run (epoch {epoch}) did not"
            " stop cleanly (killed, crashed, or its node lost): its workers may run"
            " unsupervised; start it again (it adopts them). State read from the run"
            " directory only"
        )
    else:
        row["note"] = (
            "daemon not running (none has led this run yet): state read from the run directory only"
        )
    return row, None


#: The seed's verdicts (``reward_workers_ctl.py status``: its ``reason``), worst first.
SEED_VERDICTS = ("status_missing", "status_bad", "heartbeat_stale", "not_ready", "ok")


def seed_verdict(record: StatusRecord | StatusProblem, age_s: float | None, stale_s: float) -> str:
    """The seed's verdict on one host from its status file: ``status_missing``,
    ``status_bad``, ``heartbeat_stale`` (older than ``stale_s``), ``not_ready`` or ``ok``,
    checked in that order as the seed did."""
    if isinstance(record, StatusProblem):
        return "status_missing" if record.missing else "status_bad"
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
        return StatusProblem(MISSING)
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
    layout: RunLayout,
    dirs: _Dirs,
    cfg: HostConfig,
    now_wall: float,
    stale_s: float,
    stop: runfiles.StopRecord | None,
) -> dict[str, Any]:
    record = _status_at(layout, dirs, cfg.name)
    st = _lstat_at(dirs[0], layout.status(cfg.name).name)
    age = None if st is None else max(0.0, now_wall - st.st_mtime)
    sentinel = _lstat_at(dirs[1], layout.stop_sentinel(cfg.name).name) is not None
    pid = _read_pid(layout, cfg.name)
    ok = isinstance(record, StatusRecord)
    verdict = seed_verdict(record, age, stale_s)
    status_pid = record.pid if isinstance(record, StatusRecord) else None
    reason = (
        ("ready" if record.ready else "not ready") + f" (status pid {record.pid})"
        if isinstance(record, StatusRecord)
        else record.reason
    )
    stopped = sentinel
    at_stop = None if stop is None else stop.hosts.get(cfg.name)
    if stop is not None and at_stop is not None:
        when = wall_text(stop.stopped_at)
        state, stopped_pid = at_stop
        # The daemon confirmed this worker dead; a status file of another pid is news since.
        if state == "stopped" and status_pid in (None, stopped_pid):
            stopped = True
            reason = f"stopped (daemon stopped cleanly at {when})"
        else:
            reason += f"; {state} when the daemon stopped cleanly at {when}"
    return {
        "state": "stopped" if stopped else "unknown",
        "verdict": verdict,
        "ok": verdict == "ok",
        "shard": cfg.shard,
        "pid": pid,
        "status_pid": status_pid,
        "ready": record.ready if isinstance(record, StatusRecord) else None,
        "ssh": "unknown",
        "heartbeat_age_s": None if age is None else round(age, 3),
        "restarts": None,
        "planned_restarts": None,
        "last_reason": reason,
        "status_ok": ok,
        "stop_sentinel": sentinel,
        "address": f"{cfg.address}:{cfg.port}",
    }


def _read_pid(layout: RunLayout, host: str) -> int | None:
    return runfiles.read_pid(layout.pidfile(host), root=layout.root)


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
    daemon, stop = last_daemon(layout)
    with _run_dirs(layout) as dirs:
        row = _offline_row(layout, dirs, cfg, now_wall, config.health.heartbeat_stale_s, stop)
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
        "daemon": {**daemon, "root": str(config.run.root)},
        "host": host,
        **row,
        "progress": progress,
        "work": work,
        "last_exit": last_exit,
        "evidence": None,
    }
