"""The fleet page: the status snapshot as HTML for a browser; pure rendering, no I/O.

Everything is rendered here, on the server: the page reads without JavaScript. A small inline
script (ours, allowed by its hash in the Content-Security-Policy, nothing else runs) refreshes
the live part in place. Every text from a host, a file or the daemon's status is escaped,
attribute values included; nothing is fetched from anywhere else.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeGuard
from urllib.parse import quote

from supervisor import health, vocabulary
from supervisor.render import memory_text, rewards_text, work_text
from supervisor.terminal import terminal_text

#: The script fetches the page again this often and swaps the live part in place: the
#: snapshot behind it is at most a second old, and a person glancing at a fleet needs no
#: faster; each refresh costs the daemon at most the snapshot a scrape would build anyway.
REFRESH_S: Final = 5
#: Without JavaScript the page reloads itself this often (a whole navigation: less often).
NOSCRIPT_REFRESH_S: Final = 15
#: A host's reason, shown whole on its own page, is cut to this many characters on a tile's
#: hover text: 1000 tiles stay a page of a few hundred KB whatever the hosts say.
TILE_REASON_CHARS: Final = 160
#: Lines of the worker's log on ``/host/<name>`` (``status HOST`` shows 20 by default).
LOG_LINES: Final = 50
#: A log line is cut to this many characters on the page (a line can be 256 KiB long).
LOG_LINE_CHARS: Final = 2000
#: Any other text (stacks, a log tail, a banner's fields) is cut to this many characters.
TEXT_CHARS: Final = 64 * 1024

#: Tiles are ordered by this rank, problems first; a state not listed (one added later) ranks
#: with the problems, before the states that need nobody.
_RANK: Final = {
    health.HostState.FAILED.value: 0,
    vocabulary.LYING: 1,
    health.HostState.STALE.value: 1,
    health.HostState.COOLING_DOWN.value: 2,
    health.HostState.STARTING.value: 4,
    health.HostState.STOPPING.value: 5,
    vocabulary.WAITING: 6,
    health.HostState.STOPPED.value: 7,
    health.HostState.READY.value: 9,
}
_UNLISTED_RANK: Final = 3
#: A ready host with something to look at (SSH down, found stuck) comes before the others.
_READY_WITH_A_PROBLEM_RANK: Final = 8

_CSS: Final = """
:root{color-scheme:light dark;--ok:#1a7f37;--start:#0969da;--warn:#bf8700;--cool:#d4a72c;
--bad:#cf222e;--stop:#6e7781;--wait:#8c959f;--fg:#1f2328;--bg:#fff;--mute:#656d76}
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--bg:#0d1117;--mute:#8d96a0}}
*{box-sizing:border-box}
body{margin:0;font:14px/1.35 system-ui,sans-serif;color:var(--fg);background:var(--bg)}
header{display:flex;gap:1em;align-items:baseline;padding:.5em 1em;
border-bottom:1px solid var(--mute)}
header h1{font-size:1.1em;margin:0}header a{color:inherit}
#conn{color:var(--mute)}#conn.bad{color:var(--bad);font-weight:bold}
main{padding:.5em 1em}
.daemon,.flow{margin:.3em 0}.mute{color:var(--mute)}
.banner{padding:.5em .8em;margin:.4em 0;border-radius:4px;color:#fff;background:var(--bad)}
.banner.b-warn{background:var(--warn)}.banner.b-info{background:var(--start)}
.banner b{margin-right:.4em}
.counts{display:flex;flex-wrap:wrap;gap:.4em;list-style:none;padding:0;margin:.5em 0}
.counts li{padding:.15em .6em;border-radius:3px;color:#fff}.counts li.zero{opacity:.35}
.tiles{display:grid;grid-template-columns:repeat(auto-fill,minmax(9em,1fr));gap:3px}
.t{display:block;padding:2px 5px;border-radius:3px;color:#fff;text-decoration:none;
font:12px/1.25 ui-monospace,monospace;overflow:hidden;white-space:nowrap;text-overflow:ellipsis}
.t b,.t i{display:block;overflow:hidden;text-overflow:ellipsis;font-style:normal}
.t b{font-weight:600}.t.x{outline:3px solid var(--bad);outline-offset:-3px}
.s-ready{background:var(--ok)}.s-starting{background:var(--start)}
.s-stale{background:var(--warn)}.s-cooling_down{background:var(--cool);color:#111}
.s-failed{background:var(--bad)}.s-stopping,.s-stopped{background:var(--stop)}
.s-waiting{background:var(--wait);color:#111}.s-other{background:#8250df}
.s-lying{background:#a40e6c}
.state{padding:.1em .5em;border-radius:3px;color:#fff}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.2em 1em}dt{color:var(--mute)}dd{margin:0}
pre{white-space:pre-wrap;word-break:break-all;padding:.5em;border:1px solid var(--mute);
border-radius:4px;font:12px/1.3 ui-monospace,monospace;max-height:40em;overflow:auto}
""".strip()

# The refresh: fetch this very URL, take its #live element and swap it in (no reload, so no
# flicker and the scroll position stays), unless the person is selecting text in it. It
# pauses while the tab is hidden, and says when the page stopped being current.
_SCRIPT: Final = """
(function () {
  "use strict";
  var every = 1000 * Number(document.body.getAttribute("data-refresh-s") || 5);
  var conn = document.getElementById("conn");
  var done = 0, lastGood = Date.now(), lastHtml = document.getElementById("live").innerHTML;
  function say(text, bad) { conn.textContent = text; conn.className = bad ? "bad" : ""; }
  function later() { setTimeout(tick, every); }
  function tick() {
    if (document.hidden) { later(); return; }
    var abort = new AbortController();
    var timer = setTimeout(function () { abort.abort(); }, every);
    fetch(location.href, {cache: "no-store", signal: abort.signal,
                          headers: {"Accept": "text/html"}})
      .then(function (reply) {
        if (!reply.ok) { throw new Error("HTTP " + reply.status); }
        return reply.text();
      })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.getElementById("live");
        if (!fresh) { throw new Error("no live part in the reply"); }
        var live = document.getElementById("live");
        if (fresh.innerHTML !== lastHtml && String(window.getSelection()) === "") {
          live.replaceWith(document.adoptNode(fresh));
          lastHtml = fresh.innerHTML;
        }
        document.title = doc.title;
        done += 1;
        lastGood = Date.now();
        document.body.setAttribute("data-refreshes", String(done));
        say("live, updated " + new Date(lastGood).toLocaleTimeString(), false);
      })
      .catch(function (error) {
        var ago = Math.round((Date.now() - lastGood) / 1000);
        say("NOT CURRENT: last update " + ago + " s ago (" + error.message + ")", true);
      })
      .finally(function () { clearTimeout(timer); later(); });
  }
  say("live, every " + every / 1000 + " s", false);
  later();
})();
""".strip()


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


#: Only our own inline style and script run: a text that escaped its escaping could not run
#: a script, load anything, submit a form or frame the page. ``connect-src 'self'`` is the
#: refresh's fetch of this page.
CONTENT_SECURITY_POLICY: Final = (
    f"default-src 'none'; script-src {_sha256(_SCRIPT)}; style-src {_sha256(_CSS)};"
    " connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none';"
    " frame-ancestors 'none'"
)

#: Headers of every HTML reply.
HEADERS: Final = (
    ("Content-Type", "text/html; charset=utf-8"),
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)


def text(value: object, limit: int = TEXT_CHARS) -> str:
    """``value`` as HTML text or an attribute value: control characters, bidi overrides and
    lone surrogates shown as escapes (``terminal_text``), then ``& < > " '`` escaped; cut to
    ``limit`` characters first."""
    raw = str(value)
    shown = terminal_text(raw[:limit])  # escapes only lengthen: cut before, then after
    if len(raw) > limit or len(shown) > limit:
        shown = shown[: limit - 1] + "…"
    return html.escape(shown, quote=True)


def _block(value: object, limit: int = TEXT_CHARS) -> str:
    """A multi-line text for a ``<pre>``: each line escaped as ``text`` does, lines kept."""
    raw = str(value)
    if len(raw) > limit:
        raw = "…" + raw[-(limit - 1) :]  # a log or a stack: its end matters most
    return "\n".join(text(line, limit) for line in raw.splitlines())


def host_href(name: str, *, prefix: str = "") -> str:
    """The relative link to a host's page (``host/NAME``, percent-encoded)."""
    return f"{prefix}host/{quote(name, safe='')}"


def state_class(state: str) -> str:
    """The CSS class of a state's colour (``s-other`` for a state this page does not know)."""
    return f"s-{state}" if state in _RANK else "s-other"


# ---------------------------------------------------------------------------------------
# The fleet: /


def fleet_page(status: Mapping[str, Any]) -> str:
    """The whole fleet page for a status snapshot (``status --json``'s shape)."""
    daemon = _mapping(status.get("daemon"))
    hosts = _hosts(status)
    title = f"{daemon.get('summary') or view_summary(hosts)} · reward-supervisor"
    body = "".join(
        [
            _daemon_line(daemon),
            *_banners(daemon),
            _counts(hosts),
            _flow(hosts, daemon),
            _tiles(hosts),
        ]
    )
    return _document(title, body, home="")


def view_summary(hosts: Mapping[str, Mapping[str, Any]]) -> str:
    """``995/1000 ready``: the title when the status has no summary (a standby's files)."""
    ready = sum(1 for row in hosts.values() if row.get("state") == "ready")
    return f"{ready}/{len(hosts)} ready"


def tile_order(hosts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Host names in the order of their tiles: problems first (failed, stale, cooling down,
    unknown states, starting, stopping, waiting, stopped, ready ones with a problem), then
    ready; by name within each."""
    return sorted(hosts, key=lambda name: (_rank(hosts[name]), name))


def _rank(row: Mapping[str, Any]) -> int:
    state = str(row.get("state"))
    if state == health.HostState.READY.value and _flags(row):
        return _READY_WITH_A_PROBLEM_RANK
    return _RANK.get(state, _UNLISTED_RANK)


def _flags(row: Mapping[str, Any]) -> list[str]:
    """What is wrong besides the state: no SSH connection (lost, or not made yet: remote
    actions wait), a worker found stuck, a held restart, a status file that does not read."""
    flags = []
    if row.get("ssh") == "unreachable":
        flags.append("no ssh")
    if row.get("last_cause") == health.Cause.STUCK.value and row.get("state") != "ready":
        flags.append("stuck")
    if row.get("restart_held"):
        flags.append("restart held")
    if row.get("status_problem"):
        flags.append("status file: " + str(row["status_problem"]))
    return flags


def _daemon_line(daemon: Mapping[str, Any]) -> str:
    parts = [
        f"daemon pid {daemon.get('pid', '?')}",
        f"up {_duration(daemon.get('uptime_s'))}",
        str(daemon.get("role") or "leader"),
    ]
    if daemon.get("epoch"):
        parts.append(f"epoch {daemon['epoch']}")
    if daemon.get("watch_mode"):
        parts.append(f"watch {daemon['watch_mode']}")
    if daemon.get("version"):
        parts.append(f"version {daemon['version']}")
    at = _snapshot_wall(daemon)
    when = "" if at is None else f" · status as of {time.strftime('%H:%M:%S', time.gmtime(at))} UTC"
    return f'<p class="daemon mute">{text(", ".join(parts))}{text(when)}</p>'


def _snapshot_wall(daemon: Mapping[str, Any]) -> float | None:
    """The snapshot's Unix time, from the daemon's start and uptime (None: not a date)."""
    started, uptime = daemon.get("started_at"), daemon.get("uptime_s")
    if _number(started) and _number(uptime) and 0 <= started + uptime < 2**33:
        return float(started) + float(uptime)
    return None


def _banners(daemon: Mapping[str, Any]) -> list[str]:
    """One banner per thing that holds or moves the fleet: a standby's view, a freeze, crash
    and probe signatures, failovers, a stop in progress, a pointer file not written, a
    reload that failed. Fields this page does not know the shape of are shown as they are."""
    out = []
    if daemon.get("role") == "standby":
        out.append(
            _banner(
                "info",
                "STANDBY",
                f"the leader is {daemon.get('leader') or '?'}; hosts as the run directory"
                " shows them (the leader acts)",
            )
        )
    if daemon.get("stopping"):
        out.append(_banner("warn", "STOPPING", "the daemon is shutting down"))
    if daemon.get("frozen"):
        reason = daemon.get("frozen_reason") or "?"
        finding = daemon.get("freeze_finding")
        detail = f"restarts held: {reason}" + (f" ({finding})" if finding else "")
        out.append(_banner("crit", "FROZEN", detail + "; `reward-supervisor unfreeze` once fixed"))
    for sig in _items(daemon.get("crash_signatures")):
        if isinstance(sig, Mapping):
            held = sig.get("held") or []
            detail = (
                f"{len(sig.get('hosts') or [])} hosts crashed the same way for"
                f" {_duration(sig.get('since_s'))}: {sig.get('signature')}; restarts held on"
                f" {len(held)}, canary {sig.get('canary')}; a reload that changes the worker,"
                " or `reward-supervisor unfreeze`, releases them"
            )
        else:
            detail = str(sig)
        out.append(_banner("crit", "CRASH SIGNATURE", detail))
    for sig in _items(daemon.get("probe_signatures")):
        out.append(_banner("crit", "PROBE SIGNATURE", _described(sig)))
    rewards = _mapping(daemon.get("rewards"))
    signature = rewards.get("signature")
    if signature:
        out.append(
            _banner(
                "crit",
                "REWARD SIGNATURE",
                _described(signature)
                + "; one cause (a deploy, a shared dependency): nothing is moved or restarted;"
                " `reward-supervisor unfreeze` takes the rates now as normal",
            )
        )
    for name in _items(rewards.get("lying")):
        out.append(_banner("crit", "REWARDS LIE", f"{name} is not ready: its rewards are wrong"))
    for held in _items(rewards.get("held")):
        out.append(_banner("info", "HELD FOR LYING", _described(held) + "; fix it, then `undrain`"))
    for move in _items(daemon.get("failovers")):
        out.append(_banner("warn", "FAILOVER", _described(move)))
    pointer = daemon.get("pointer")
    if isinstance(pointer, Mapping) and pointer.get("error"):
        out.append(
            _banner(
                "warn",
                "POINTER FILE",
                f"{pointer.get('path')} not written: {pointer['error']}",
            )
        )
    if daemon.get("last_reload_errors"):
        out.append(_banner("warn", "RELOAD FAILED", _described(daemon["last_reload_errors"])))
    return out


def _items(value: object) -> list[Any]:
    """A banner field as a list of items: a list as it is, a mapping of name to item as its
    items, anything else true as one item, nothing for None or empty."""
    if not value:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, Mapping):
        return [
            {"name": k, **v} if isinstance(v, Mapping) else f"{k}: {v}" for k, v in value.items()
        ]
    return [value]


#: Keys shown first, in this order, when a banner describes an item it knows nothing else of.
_HEADLINE_KEYS: Final = ("signature", "reason", "name", "host", "shard", "from", "to", "state")


def _described(item: object) -> str:
    """An item of unknown shape in one line: a mapping's headline keys first, then the others
    as ``key: value``; a list joined; anything else as its text."""
    if isinstance(item, Mapping):
        keys = [k for k in _HEADLINE_KEYS if k in item] + sorted(
            str(k) for k in item if k not in _HEADLINE_KEYS
        )
        return "; ".join(f"{k}: {_described(item[k])}" for k in keys if k in item)
    if isinstance(item, list | tuple):
        return ", ".join(_described(x) for x in item)
    return str(item)


def _banner(level: str, label: str, detail: str) -> str:
    return f'<div class="banner b-{level}"><b>{text(label)}</b>{text(detail, 2000)}</div>'


def _counts(hosts: Mapping[str, Mapping[str, Any]]) -> str:
    counts = Counter(str(row.get("state")) for row in hosts.values())
    states = [s.value for s in health.HostState] + [vocabulary.LYING]
    states += sorted(s for s in counts if s not in states)
    items = [
        f'<li class="{state_class(s)}{"" if counts.get(s) else " zero"}">'
        f"{text(s)} <b>{counts.get(s, 0)}</b></li>"
        for s in states
    ]
    total = f'<li class="s-other">hosts <b>{len(hosts)}</b></li>'
    return f'<ul class="counts">{total}{"".join(items)}</ul>'


def _flow(hosts: Mapping[str, Mapping[str, Any]], daemon: Mapping[str, Any]) -> str:
    """The fleet's reward flow from the workers' own figures: tasks finished a minute, the
    shards' backlog, error results, and the fleet's recent zero and error rates."""
    rates = [r["tasks_per_min"] for r in hosts.values() if _number(r.get("tasks_per_min"))]
    works = [w for r in hosts.values() if isinstance(w := r.get("work"), Mapping)]
    backlog = [w["queue_depth"] for w in works if _number(w.get("queue_depth"))]
    errors = [w["errors"] for w in works if _number(w.get("errors"))]
    if not rates and not works:
        return '<p class="flow mute">rewards: no worker reports its progress</p>'
    if rates:
        parts = [f"<b>{sum(rates):,.0f}</b> tasks/min from {len(rates)} of {len(hosts)} workers"]
    else:  # a rate is taken over a minute of a worker's progress
        parts = ["no rate of tasks yet (a minute of progress needed)"]
    if backlog:
        parts.append(f"backlog <b>{sum(backlog):,}</b> tasks in {len(backlog)} shards")
    if errors:
        parts.append(f"<b>{sum(errors):,}</b> error results (current workers)")
    rewards = _mapping(daemon.get("rewards"))
    zero, error = rewards.get("fleet_zero_rate"), rewards.get("fleet_error_rate")
    if _number(zero) or _number(error):
        parts.append(
            f"recent zero rate <b>{_percent(zero)}</b>, error rate <b>{_percent(error)}</b>"
            " (median of hosts)"
        )
    legend = '<span class="mute"> · a ready tile: tasks/min, q queue, e errors</span>'
    return f'<p class="flow">rewards: {" · ".join(parts)}{legend}</p>'


def _tiles(hosts: Mapping[str, Mapping[str, Any]]) -> str:
    return '<div class="tiles">' + "".join(_tile(n, hosts[n]) for n in tile_order(hosts)) + "</div>"


def _tile(name: str, row: Mapping[str, Any]) -> str:
    """One host: its name, then its flow when ready (tasks a minute, queue, errors) or its
    state; coloured by state, outlined when something else is wrong; the reason on hover."""
    state = str(row.get("state"))
    flags = _flags(row)
    second = _tile_flow(row) if state == "ready" and not flags else ", ".join([state, *flags])
    lines = [f"{name} (shard {row.get('shard', '?')}): {state}"]
    if row.get("in_state_s") is not None:
        lines[0] += f" for {_duration(row['in_state_s'])}"
    reason = row.get("last_reason") or row.get("last_error")
    if reason:
        lines.append(str(reason)[:TILE_REASON_CHARS])
    lines += flags
    if row.get("ssh") == "unreachable" and row.get("ssh_reason"):
        lines.append(f"ssh: {row['ssh_reason']}")
    work = work_text(_mapping(row.get("work")) or None, row.get("in_flight"))
    if _number(row.get("tasks_per_min")):
        work = f"{row['tasks_per_min']:g} tasks/min" + (f", {work}" if work else "")
    if work:
        lines.append(work)
    age = row.get("heartbeat_age_s")
    lines.append("no heartbeat seen" if age is None else f"heartbeat {_age(age)} ago")
    if row.get("restarts"):
        lines.append(f"{row['restarts']} restarts")
    title = "&#10;".join(text(line, 400) for line in lines)
    extra = " x" if flags else ""
    return (
        f'<a class="t {state_class(state)}{extra}" href="{text(host_href(name))}"'
        f' title="{title}"><b>{text(name, 200)}</b><i>{text(second or state, 200)}</i></a>'
    )


def _tile_flow(row: Mapping[str, Any]) -> str:
    """``12/min q3 2e``: a ready worker's flow in a tile's width (tasks finished a minute,
    queue depth, error results); ``ready`` when it reports none."""
    parts = []
    rate = row.get("tasks_per_min")
    if _number(rate):
        parts.append(f"{rate:.0f}/min" if rate >= 10 else f"{rate:.1f}/min")
    work = _mapping(row.get("work"))
    if _number(work.get("queue_depth")):
        parts.append(f"q{work['queue_depth']}")
    if _number(work.get("errors")) and work["errors"]:
        parts.append(f"{work['errors']}e")
    return " ".join(parts) or "ready"


# ---------------------------------------------------------------------------------------
# One host: /host/<name>


def host_page(detail: Mapping[str, Any], log: Mapping[str, Any] | None) -> str:
    """One host as ``status HOST`` shows it: state and reason, pid, heartbeat, progress, the
    worker's figures, restarts and the next one, the last exit, the last evidence (stacks)
    and the log's last lines (``log``: ``view.log_lines``' shape)."""
    name = str(detail.get("host", "?"))
    state = str(detail.get("state", "?"))
    daemon = _mapping(detail.get("daemon"))
    title = f"{name}: {state} · reward-supervisor"
    parts = [
        _daemon_line(daemon) if daemon else "",
        f'<p class="mute">{text(daemon["note"])}</p>' if daemon.get("note") else "",
        f'<h2>{text(name)} <span class="state {state_class(state)}">{text(state)}</span>'
        f" for {text(_duration(detail.get('since_s', detail.get('in_state_s'))))}</h2>",
        f"<p>{text(detail.get('last_reason') or '-')}</p>",
        _host_facts(detail),
        _last_exit(detail.get("last_exit")),
        _evidence(detail.get("evidence")),
        _log(log),
    ]
    return _document(title, "".join(parts), home="../")


def _host_facts(detail: Mapping[str, Any]) -> str:
    rows: list[tuple[str, object]] = [
        ("shard", detail.get("shard")),
        ("pid", _dash(detail.get("pid"))),
        (
            "ssh",
            f"{detail.get('ssh')} ({detail.get('address')})"
            + (f": {detail['ssh_reason']}" if detail.get("ssh") == "unreachable" else ""),
        ),
    ]
    age = detail.get("heartbeat_age_s")
    rows.append(("heartbeat", "no heartbeat seen yet" if age is None else f"{_age(age)} ago"))
    rows.append(("progress", _progress(detail.get("progress"))))
    rewards = detail.get("rewards")
    if isinstance(rewards, Mapping):
        rows.append(("rewards", rewards_text(rewards)))
    work = detail.get("work")
    if isinstance(work, Mapping):
        rows.append(("work (its own figures)", _work(work, detail.get("progress"))))
    restart = detail.get("restart")
    if isinstance(restart, Mapping):
        text_ = (
            f"{restart.get('in_window')} in the last {_duration(restart.get('window_s'))}"
            f" ({restart.get('total')} in all), {restart.get('failures')} failures in a row"
        )
        rows.append(("restarts", text_))
        nxt = restart.get("next_restart_in_s")
        rows.append(("next restart", "-" if nxt is None else f"in {_age(nxt)}"))
        if restart.get("held"):
            rows.append(("held", restart["held"]))
    elif detail.get("restarts") is not None:
        rows.append(("restarts", detail["restarts"]))
    planned = detail.get("planned_restarts")
    if isinstance(planned, Mapping) and planned:
        by_whom = ", ".join(f"{n} {who}" for who, n in sorted(planned.items()))
        rows.append(("planned restarts (not faults)", by_whom))
    for key, label in (
        ("last_error", "last error"),
        ("status_problem", "status file"),
        ("operation", "operation"),
        ("verdict", "verdict"),
    ):
        if detail.get(key):
            rows.append((label, detail[key]))
    if detail.get("stop_sentinel"):
        rows.append(("stop file", "present: kept stopped"))
    items = "".join(f"<dt>{text(k)}</dt><dd>{text(v)}</dd>" for k, v in rows)
    return f"<dl>{items}</dl>"


def _progress(progress: object) -> str:
    if not isinstance(progress, Mapping) or not progress.get("reported"):
        return "not reported: judged by heartbeat only"
    out = f"{_dash(progress.get('processed'))} processed"
    out += f", {_dash(progress.get('in_flight'))} in flight"
    if _number(progress.get("tasks_per_min")):
        out += f", {progress['tasks_per_min']:g} tasks/min"
    if progress.get("last_progress_age_s") is not None:
        out += f", last change {_age(progress['last_progress_age_s'])} ago"
    if progress.get("stuck_in_s") is not None:
        out += f" (stuck in {_age(progress['stuck_in_s'])} without one)"
    return out


def _work(work: Mapping[str, Any], progress: object) -> str:
    in_flight = progress.get("in_flight") if isinstance(progress, Mapping) else None
    out = work_text(work, in_flight)
    for key, fmt in (
        ("semantic_zero", "{} scored 0"),
        ("qps", "{:g} tasks/s"),
        ("verify_ms_p95", "verify p95 {:g} ms"),
    ):
        if _number(work.get(key)):
            out += ", " + fmt.format(work[key])
    memory = memory_text(work)
    return out if memory is None else f"{out}; {memory}" if out else memory


def _last_exit(last_exit: object) -> str:
    if not isinstance(last_exit, Mapping):
        return "<h3>last exit</h3><p>none seen</p>"
    age = last_exit.get("age_s")
    when = f", {_age(age)} ago" if age is not None else ""
    pid = _dash(last_exit.get("pid"))
    what = f"pid {pid} {last_exit.get('what')}{when}"
    out = f"<h3>last exit</h3><p>{text(what)}</p>"
    if last_exit.get("log_tail"):
        # The log is every worker's of the host, appended: these lines are this pid's own.
        label = f"the last lines pid {pid} wrote to the log:"
        out += f"<p>{text(label)}</p><pre>{_block(last_exit['log_tail'])}</pre>"
    return out


def _evidence(evidence: object) -> str:
    if not isinstance(evidence, Mapping):
        return "<h3>evidence</h3><p>none taken</p>"
    age = evidence.get("age_s")
    when = f", {_age(age)} ago" if age is not None else ""
    out = [
        f"<h3>evidence</h3><p>pid {text(evidence.get('pid'))}{text(when)}, for:"
        f" {text(evidence.get('cause') or '-')}</p>"
    ]
    notes = evidence.get("notes") or []
    if notes:
        out.append("<ul>" + "".join(f"<li>{text(n)}</li>" for n in _items(notes)) + "</ul>")
    if evidence.get("stacks"):
        out.append(
            f"<p>stacks ({text(evidence.get('via'))}):</p><pre>{_block(evidence['stacks'])}</pre>"
        )
    if evidence.get("log_tail"):
        out.append(f"<p>log before the stacks:</p><pre>{_block(evidence['log_tail'])}</pre>")
    return "".join(out)


def _log(log: Mapping[str, Any] | None) -> str:
    if log is None:
        return ""
    path = text(log.get("path"))
    if log.get("error"):
        return f"<h3>log {path}</h3><p>{text(log['error'])}</p>"
    lines: Iterable[object] = log.get("lines") or []
    shown = [text(line, LOG_LINE_CHARS) for line in lines]
    return f"<h3>log {path} (last {len(shown)} lines)</h3><pre>{chr(10).join(shown)}</pre>"


# ---------------------------------------------------------------------------------------


def _document(title: str, live: str, *, home: str) -> str:
    """The page around its live part; ``home`` is the relative link to the fleet page."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<noscript><meta http-equiv="refresh" content="{NOSCRIPT_REFRESH_S}"></noscript>'
        f'<title>{text(title, 300)}</title><link rel="icon" href="data:,">'
        f"<style>{_CSS}</style></head>"
        f'<body data-refresh-s="{REFRESH_S}"><header><h1><a href="{home or "./"}">'
        "reward-supervisor</a></h1>"
        f'<span id="conn">reloads every {NOSCRIPT_REFRESH_S} s</span>'
        '<a href="">reload</a></header>'
        f'<main id="live">{live}</main><script>{_SCRIPT}</script></body></html>'
    )


def _hosts(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    hosts = status.get("hosts")
    if not isinstance(hosts, Mapping):
        return {}
    return {str(k): v for k, v in hosts.items() if isinstance(v, Mapping)}


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _number(value: object) -> TypeGuard[int | float]:
    """A finite number (not a bool, NaN or an infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _percent(value: object) -> str:
    return f"{100 * value:.0f}%" if _number(value) else "-"


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _age(value: object) -> str:
    if not _number(value):
        return "-"
    seconds = float(value)
    return f"{seconds:.1f}s" if seconds < 100 else _duration(seconds)


def _duration(value: object) -> str:
    if not _number(value):
        return "?"
    seconds = int(value)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
