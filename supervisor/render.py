"""What an operator's terminal shows of a status: the JSON the daemon answers with (or
``view.offline_status``'s) as text. Stdlib only, so that ``status`` imports no core; every
value escaped (``terminal_text``), so that a host's text cannot drive the screen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Final

from supervisor.terminal import terminal_text

#: ``health.HostState``'s values in its order (a unit test keeps the two equal), here so that
#: rendering a status needs no core. In summaries, the ones that need attention come last,
#: where the eye lands.
STATE_ORDER: Final = (
    "starting",
    "ready",
    "stale",
    "cooling_down",
    "failed",
    "stopping",
    "stopped",
)
#: ``vocabulary.LYING``: a ready host whose rewards are named as lying (not a health state;
#: a unit test keeps the two equal). It counts last in a summary: it needs someone most.
LYING: Final = "lying"


def summary(states: Iterable[str]) -> str:
    """``48/50 ready, 1 cooling_down, 1 lying``: the one line for STATUS= and humans."""
    counts = Counter(states)
    total = sum(counts.values())
    parts = [f"{counts.get('ready', 0)}/{total} ready"]
    parts += [f"{counts[s]} {s}" for s in (*STATE_ORDER, LYING) if s != "ready" and counts.get(s)]
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
        lines += [terminal_text(line) for line in crash_signature_lines(daemon)]
        lines += [terminal_text(line) for line in rewards_lines(daemon)]
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
        "ZERO/ERR",
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
            _rates_cell(row.get("rewards")),
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


def _rates_cell(rewards: object) -> str:
    """A host's recent zero and error rates (``31%/0%``), ``-`` where not judged yet."""
    if not isinstance(rewards, Mapping) or rewards.get("results") is None:
        return "-"
    return f"{_percent(rewards.get('zero_rate'))}/{_percent(rewards.get('error_rate'))}"


def _percent(rate: object) -> str:
    return f"{100 * rate:.0f}%" if isinstance(rate, int | float) else "-"


def rewards_lines(daemon: Mapping[str, Any]) -> list[str]:
    """The fleet's rewards when something is wrong with them (``status --json``'s
    ``rewards``): a fleet-wide signature, the hosts named as lying, the machines held for
    it; unescaped."""
    rewards = daemon.get("rewards")
    if not isinstance(rewards, Mapping):
        return []
    lines = []
    signature = rewards.get("signature")
    if isinstance(signature, Mapping):
        lines.append(
            f"REWARD SIGNATURE for {_duration(signature.get('since_s'))}:"
            f" {signature.get('reason')}; one cause (a deploy, a shared dependency): nothing"
            " is moved or restarted; `reward-supervisor unfreeze` takes the rates now as normal"
        )
    lying = rewards.get("lying") or []
    if lying:
        fleet = (
            f"fleet zero rate {_percent(rewards.get('fleet_zero_rate'))},"
            f" error rate {_percent(rewards.get('fleet_error_rate'))}"
        )
        lines.append(f"REWARDS LIE on {', '.join(str(h) for h in lying)} ({fleet}): not ready")
    for held in rewards.get("held") or []:
        if isinstance(held, Mapping):
            lines.append(
                f"{held.get('machine')} held for lying ({held.get('host')} moved off it, named"
                f" {_duration(held.get('since_s'))} ago: {held.get('reason')});"
                " fix it, then `reward-supervisor undrain`"
            )
    return lines


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
            # What the files prove beats the seed's verdict (a stopped worker's is "stale").
            "stopped" if row.get("state") == "stopped" else str(row.get("verdict", "?")),
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
        if detail.get("state") == "stopped":
            say(f"{name}: {detail.get('last_reason') or 'stopped'}")
        else:
            verdict = detail.get("verdict", "?")
            say(f"{name}: verdict {verdict} ({detail.get('last_reason') or '-'})")
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
        say(text, 2)
        memory = memory_text(work)
        if memory is not None:
            say(f"memory: {memory}", 2)
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
    rewards = detail.get("rewards")
    if isinstance(rewards, Mapping):
        say(f"rewards: {rewards_text(rewards)}", 2)
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


def rewards_text(rewards: Mapping[str, Any]) -> str:
    """``in line: zero rate 31% (fleet 30%), error rate 0% (fleet 0%), 450 results in 10s``."""
    verdict = str(rewards.get("verdict") or "?")
    if rewards.get("results") is None:
        text = verdict
    else:
        text = (
            f"{verdict}: zero rate {_percent(rewards.get('zero_rate'))}"
            f" (fleet {_percent(rewards.get('fleet_zero_rate'))}), error rate"
            f" {_percent(rewards.get('error_rate'))} (fleet"
            f" {_percent(rewards.get('fleet_error_rate'))}), {rewards.get('results')} results"
            f" in {_duration(rewards.get('window_s'))}"
        )
    if rewards.get("reason"):
        text += f"; named for {_duration(rewards.get('named_for_s'))}: {rewards['reason']}"
        if rewards.get("kept"):
            text += " (its shard could not be moved)"
    return text


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


#: Bytes in a GiB, and the units of ``bytes_text``.
_GIB: Final = 2**30
_UNITS: Final = (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10))


def memory_text(work: Mapping[str, Any] | None) -> str | None:
    """The memory of a status's work row (``view.work_row``): ``rss 1.21 GiB (its session,
    49 processes, measured)`` or ``rss 60 KiB (the worker's own figure)``; None without."""
    if not work or not isinstance(work.get("rss_bytes"), int):
        return None
    size = bytes_text(work["rss_bytes"])
    if work.get("rss_source") == "agent":
        count = work.get("rss_processes")
        processes = f"{count} process{'' if count == 1 else 'es'}"
        return f"rss {size} (its session, {processes}, measured)"
    return f"rss {size} (the worker's own figure)"


def bytes_text(count: int) -> str:
    """A size in bytes for people: ``812 KiB``, ``61.3 MiB``, ``1.21 GiB``."""
    for unit, size in _UNITS:
        if count >= size:
            value = count / size
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{count} B"


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
