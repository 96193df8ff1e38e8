"""The fleet page and a host's page as HTML: hostile text escaped everywhere, problems first,
banners from the status fields, every field ``status HOST`` shows, and a bounded size."""

from __future__ import annotations

import base64
import gzip
import hashlib
import math
import re
from dataclasses import replace
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from supervisor import health, page, render, view
from supervisor.config import HostConfig
from supervisor.health import Cause, HostState
from tests.examples import examples
from tests.pageparse import Page, parse_page

S = HostState

#: Text a hostile host might put in a reason, an error, a stack or a log line: markup, a
#: quote that ends an attribute, an entity, terminal escapes, a bidi override, a lone
#: surrogate (not encodable as UTF-8), NUL.
HOSTILE = '<script>alert(1)</script>" onmouseover="x()\' &amp; \x1b[2J\r\u202e\ud800\x00end'


def host(name: str, state: HostState, **fields: Any) -> health.Host:
    """A core host in ``state`` with these fields (a pid, SSH up and a fresh beat by default)."""
    base = health.Host(
        name=name,
        state=state,
        reason=f"{state.value} reason",
        since_at=0.0,
        pid=4242,
        ssh_up=True,
        alive_at=99.5,
    )
    return replace(base, **fields)


def row(h: health.Host, shard: int = 0) -> dict[str, Any]:
    """The status row ``status --json`` has for ``h``, 100 s after it entered its state."""
    return view.host_row(h, HostConfig(name=h.name, shard=shard, address="10.0.0.7"), 100.0, POLICY)


POLICY = health.Policy()


def status(hosts: dict[str, dict[str, Any]], **daemon: Any) -> dict[str, Any]:
    """A leader's status with these rows and daemon fields."""
    return {"daemon": {"pid": 7, "role": "leader", "summary": "s", **daemon}, "hosts": hosts}


def fleet(rows: dict[str, dict[str, Any]], **daemon: Any) -> Page:
    """The fleet page of these rows, read back."""
    return parse_page(page.fleet_page(status(rows, **daemon)))


def working(n: int, *, name: str = "worker-{i:04d}", reason: str = "ready") -> dict[str, Any]:
    """``n`` ready hosts reporting their work as the AReaL worker does."""
    stats = health.WorkerStats(completed=123000, errors=45, queue_depth=31, concurrency=8)
    rows = {}
    for i in range(n):
        h = host(name.format(i=i), S.READY, reason=reason, processed=123045, in_flight=7)
        rows[h.name] = row(replace(h, stats=stats, restarts=3), shard=i)
    return rows


def test_hostile_host_text_is_escaped_in_text_and_attributes() -> None:
    """A reason full of markup, quotes, escapes, a bidi override, a lone surrogate and NUL
    reaches the browser as text: no element, attribute or script of its own, the hover text
    shows it with control characters as visible escapes, and the page encodes as UTF-8."""
    rows = {"evil": row(host("evil", S.STALE, reason=HOSTILE, last_error=HOSTILE))}
    html = page.fleet_page(status(rows, frozen=True, frozen_reason=HOSTILE))
    html.encode("utf-8")  # a lone surrogate would raise here
    read = parse_page(html)
    assert len(read.scripts) == 1
    assert [e.tag for e in read.elements if e.tag == "script"] == ["script"]
    assert not [a for e in read.elements for a in e.attrs if a.startswith("on")]
    [tile] = read.tiles
    assert '<script>alert(1)</script>" onmouseover="x()\'' in tile.title
    assert "\\x1b[2J\\r\\u202e\\ud800\\x00end" in tile.title
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f\u202e]", html)
    assert "<script>alert" not in html
    assert '<script>alert(1)</script>" onmouseover' in read.banners[0]


def test_a_host_page_escapes_stacks_logs_and_every_field() -> None:
    """Stacks, the log before them, the last exit's log tail, log lines and the reason of a
    host's page are text in ``<pre>`` and ``<p>`` elements: nothing of them is markup."""
    evidence = health.Evidence(
        pid=4242,
        stacks=f"Thread 1:\n  {HOSTILE}\n",
        stacks_via="py-spy",
        log_tail=HOSTILE,
        notes=(HOSTILE,),
    )
    h = host(
        "evil",
        S.COOLING_DOWN,
        reason=HOSTILE,
        evidence=evidence,
        evidence_at=90.0,
        last_exit="killed by signal 9",
        last_exit_at=95.0,
        last_log_tail=HOSTILE,
    )
    detail = {
        "host": "evil",
        "daemon": {"pid": 7},
        **view.host_detail(h, cfg("evil"), 100.0, POLICY),
    }
    log = {"path": "/run/ctl/evil.log", "lines": [HOSTILE, "x" * 10_000], "error": None}
    html = page.host_page(detail, log)
    html.encode("utf-8")
    read = parse_page(html)
    assert len(read.scripts) == 1
    assert not [a for e in read.elements for a in e.attrs if a.startswith("on")]
    assert "<script>alert" not in html
    assert len(read.pres) == 4  # the exit's tail, stacks, the log before them, the log
    assert all("<script>alert(1)</script>" in pre for pre in read.pres)
    assert "x" * (page.LOG_LINE_CHARS - 1) + "…" in read.pres[-1]


def cfg(name: str) -> HostConfig:
    """A host's config on shard 3."""
    return HostConfig(name=name, shard=3, address="10.0.0.7")


def test_tiles_put_problems_first_then_ready_by_name() -> None:
    """Failed, stale and cooling-down hosts come first, then an unknown state, starting,
    stopping, waiting, stopped, ready ones with SSH down, and the ready ones by name."""
    rows = {
        "a-ready": row(host("a-ready", S.READY)),
        "b-stopped": row(host("b-stopped", S.STOPPED)),
        "c-failed": row(host("c-failed", S.FAILED)),
        "d-starting": row(host("d-starting", S.STARTING)),
        "e-ready-ssh-down": row(host("e-ready-ssh-down", S.READY, ssh_up=False)),
        "f-cooling": row(host("f-cooling", S.COOLING_DOWN)),
        "g-stale": row(host("g-stale", S.STALE)),
        "h-stopping": row(host("h-stopping", S.STOPPING)),
        "i-waiting": {"state": "waiting", "shard": 1, "last_reason": "shard busy"},
        "j-draining": {"state": "draining", "shard": 2},
        "0-ready": row(host("0-ready", S.READY)),
    }
    read = fleet(rows)
    assert [t.name for t in read.tiles] == [
        "c-failed",
        "g-stale",
        "f-cooling",
        "j-draining",
        "d-starting",
        "h-stopping",
        "i-waiting",
        "b-stopped",
        "e-ready-ssh-down",
        "0-ready",
        "a-ready",
    ]
    assert read.states["j-draining"] == "other"  # a state added later: shown, coloured apart
    assert read.states["e-ready-ssh-down"] == "ready"
    outlined = [t for t in read.tiles if t.outlined]
    assert [t.name for t in outlined] == ["e-ready-ssh-down"]
    assert outlined[0].second == "ready, no ssh"
    assert "ssh: not connected yet" in outlined[0].title.splitlines()
    assert read.counts["ready"] == 3
    assert read.counts["draining"] == 1
    assert read.counts["hosts"] == len(rows)
    assert {t.href for t in read.tiles} == {f"host/{name}" for name in rows}


def test_a_tile_shows_the_flow_and_its_hover_the_reason_and_figures() -> None:
    """A ready tile shows tasks a minute, queue depth and errors; its hover text says the
    shard, state, reason, the worker's figures and the heartbeat; a problem tile shows its
    state and what else is wrong."""
    rows = working(1)
    rows["worker-0000"]["tasks_per_min"] = 37.25
    stuck = host("stuck-0", S.STALE, reason="stuck: 7 tasks in flight", cause_code=Cause.STUCK)
    rows["stuck-0"] = row(stuck, shard=9)
    read = fleet(rows)
    tiles = {t.name: t for t in read.tiles}
    assert tiles["worker-0000"].second == "37/min q31 45e"
    assert "shard 0" in tiles["worker-0000"].title
    assert "37.25 tasks/min, 123000 ok, 45 errors, 7 in flight of 8, queue 31" in (
        tiles["worker-0000"].title
    )
    assert "heartbeat 0.5s ago" in tiles["worker-0000"].title
    assert tiles["stuck-0"].second == "stale, stuck"
    assert "stuck: 7 tasks in flight" in tiles["stuck-0"].title.splitlines()
    assert "rewards: 37 tasks/min from 1 of 2 workers" in read.text
    assert "backlog 31 tasks in 1 shards" in read.text
    young = fleet(working(2))  # their figures, but no minute of progress yet
    assert "rewards: no rate of tasks yet" in young.text
    assert "backlog 62 tasks in 2 shards" in young.text
    assert [t.second for t in young.tiles] == ["q31 45e", "q31 45e"]


def test_banners_show_a_freeze_crash_and_probe_signatures_and_failovers() -> None:
    """Each thing holding or moving the fleet gets a banner: the freeze with its finding, a
    crash signature with its canary and held hosts, and ``probe_signatures`` and
    ``failovers`` in whatever shape they come (a list of objects, a mapping, text)."""
    read = fleet(
        working(2),
        frozen=True,
        frozen_reason="40 hosts stale at once",
        freeze_finding="mount /shared not answering",
        crash_signatures=[
            {
                "signature": "exit 1: ImportError",
                "since_s": 75,
                "hosts": ["a", "b", "c"],
                "canary": "a",
                "held": ["b", "c"],
            },
        ],
        probe_signatures=[{"signature": "probe timed out", "hosts": ["a", "b"], "since_s": 3}],
        failovers={"worker-0001": {"to": "spare-0", "shard": 1, "state": "moving"}},
    )
    assert read.banners == [
        "FROZENrestarts held: 40 hosts stale at once (mount /shared not answering);"
        " `reward-supervisor unfreeze` once fixed",
        "CRASH SIGNATURE3 hosts crashed the same way for 1m15s: exit 1: ImportError; restarts"
        " held on 2, canary a; a reload that changes the worker, or `reward-supervisor"
        " unfreeze`, releases them",
        "PROBE SIGNATUREsignature: probe timed out; hosts: a, b; since_s: 3",
        "FAILOVERname: worker-0001; shard: 1; to: spare-0; state: moving",
    ]
    texts = fleet(working(1), failovers=["worker-7 -> spare-2"], probe_signatures="odd").banners
    assert texts == ["PROBE SIGNATUREodd", "FAILOVERworker-7 -> spare-2"]


def test_a_quiet_fleet_has_no_banner_and_a_standby_says_whose_fleet_it_is() -> None:
    """Without a freeze, signature or failover there is no banner (empty fields included);
    a standby's page says who leads and that the hosts are the run directory's view."""
    assert fleet(working(3), frozen=False, crash_signatures=[], failovers=[]).banners == []
    standby = fleet({}, role="standby", leader="node-a pid 12")
    assert standby.banners == [
        "STANDBYthe leader is node-a pid 12; hosts as the run directory shows them (the leader"
        " acts)"
    ]


def sha256(text: str) -> str:
    """The CSP source expression of ``text``'s hash."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_only_our_inline_script_and_style_may_run_and_nothing_is_fetched_elsewhere() -> None:
    """The policy allows exactly the page's one script and one style by hash, fetches only
    from the page's own origin, and every link in the page is relative (no scheme, no host):
    nothing is loaded from a third party."""
    html = page.fleet_page(status(working(3)))
    read = parse_page(html)
    [script], [style] = read.scripts, read.styles
    policy = dict(p.strip().split(" ", 1) for p in page.CONTENT_SECURITY_POLICY.split(";"))
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == sha256(script)
    assert policy["style-src"] == sha256(style)
    assert policy["connect-src"] == "'self'"
    links = [v for e in read.elements for k, v in e.attrs.items() if k in ("href", "src")]
    assert links
    assert all(v == "data:," or (v is not None and not re.match(r"^[a-z]+:|^//", v)) for v in links)
    assert not re.search(r"https?://", html)


def test_a_thousand_tiles_stay_under_400_kb_and_hostile_ones_under_1_2_mb() -> None:
    """1000 ready hosts with long names and their figures make a page under 400 KB (under
    40 KB gzipped); 1000 hosts whose reasons are 10 KB of text that escapes to six times
    its length stay under 1.2 MB: a tile's hover text is cut, a host's page has it whole."""
    name = "gpu-node-{i:04d}.cluster.example.com"
    body = page.fleet_page(status(working(1000, name=name))).encode()
    assert len(body) < 400_000
    assert len(gzip.compress(body)) < 40_000
    assert len(parse_page(body.decode()).tiles) == 1000
    hostile = working(1000, name=name, reason=('"&\x1b\u202e' * 2500))
    for r in hostile.values():
        r["state"] = "stale"
    body = page.fleet_page(status(hostile)).encode()
    assert len(body) < 1_200_000
    assert len(parse_page(body.decode()).tiles) == 1000


def test_a_host_page_shows_what_status_host_shows() -> None:
    """State and reason, pid, SSH, heartbeat, progress, the worker's figures, restarts and
    the next one, the hold, the last exit, the evidence and the log tail are all on the page,
    worded as ``status HOST`` words them."""
    evidence = health.Evidence(
        pid=4241,
        stacks="Thread 0x1 (most recent call first):\n  f()",
        stacks_via="faulthandler",
        log_tail="last line",
        notes=("slow",),
    )
    h = host(
        "w-3",
        S.COOLING_DOWN,
        reason="killed by signal 9",
        evidence=evidence,
        evidence_at=80.0,
        last_exit="killed by signal 9",
        last_exit_pid=4241,
        last_exit_at=95.0,
        last_log_tail="Traceback: boom",
        processed=1200,
        in_flight=2,
        progress_at=98.0,
        stats=health.WorkerStats(
            completed=1190, errors=10, queue_depth=5, concurrency=4, rss_gib=1.5
        ),
        restarts=4,
        planned_restarts=((health.Planned.OPERATOR, 2), (health.Planned.RELOAD, 1)),
        failures=2,
        next_restart_at=130.0,
        held="crash signature exit 1",
    )
    detail = {"host": "w-3", "daemon": {"pid": 7}, **view.host_detail(h, cfg("w-3"), 100.0, POLICY)}
    log = {"path": "/run/ctl/w-3.log", "lines": ["line one", "line two"], "error": None}
    read = parse_page(page.host_page(detail, log))
    terminal = render.render_host({**detail, "log": log})
    for shown in (
        "killed by signal 9",
        "4242",
        "connected (10.0.0.7:22)",
        "0.5s ago",
        "1200 processed, 2 in flight",
        "1190 ok, 10 errors, 2 in flight of 4, queue 5",
        "rss 1.5 GiB",
        "4 in all), 2 failures in a row",
        "2 operator, 1 reload",
        "crash signature exit 1",
        "pid 4241 killed by signal 9, 5.0s ago",
        "pid 4241, 20.0s ago, for: ",
        "slow",
        "Thread 0x1 (most recent call first):\n  f()",
        "line one\nline two",
    ):
        assert shown in read.text, shown
        assert shown.split("\n")[0] in terminal, shown
    # The last exit's log tail, said to be that pid's own lines: --json has it too.
    assert "the last lines pid 4241 wrote to the log:Traceback: boom" in read.text
    assert read.title == "w-3: cooling_down · reward-supervisor"


def test_a_host_page_says_why_its_log_is_missing() -> None:
    """A log that cannot be read (none yet, a symlink refused, a hung read) is said so in
    place of its lines; a host the daemon has no detail for shows its row."""
    log = {"path": "/run/ctl/w.log", "lines": [], "error": "no log yet"}
    read = parse_page(page.host_page({"host": "w", "state": "waiting"}, log))
    assert "log /run/ctl/w.log" in read.text
    assert "no log yet" in read.text
    assert "not reported: judged by heartbeat only" in read.text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=examples(200))
@example(
    hosts={"h": {"state": "ready", "tasks_per_min": math.inf, "heartbeat_age_s": math.nan}},
    daemon={
        "uptime_s": math.inf,
        "started_at": 1e300,
        "crash_signatures": [{"since_s": -math.inf}],
    },
)
@given(
    hosts=st.dictionaries(st.text(min_size=1, max_size=12), json_values, max_size=5),
    daemon=st.dictionaries(
        st.sampled_from(
            [
                "frozen",
                "frozen_reason",
                "crash_signatures",
                "probe_signatures",
                "failovers",
                "role",
                "pointer",
                "summary",
                "uptime_s",
                "started_at",
                "last_reload_errors",
            ]
        ),
        json_values,
    ),
)
def test_any_status_shape_renders_a_page_with_only_our_script(
    hosts: dict[str, Any], daemon: dict[str, Any]
) -> None:
    """Whatever the status holds (fields of other shapes, states unknown, junk rows), the
    fleet page and a host's page render, encode as UTF-8, and hold only our one script."""
    for html in (
        page.fleet_page({"daemon": daemon, "hosts": hosts}),
        page.host_page({"host": "x", "daemon": daemon, **daemon}, {"lines": list(hosts)}),
    ):
        html.encode("utf-8")
        assert len(parse_page(html).scripts) == 1


def test_the_daemon_line_and_the_other_banners_say_what_the_status_says() -> None:
    """The daemon's line has its epoch, watch mode, version and the snapshot's time; a stop
    in progress, a pointer file not written and a failed reload each get a banner; a ready
    host with a held restart or a bad status file is outlined and says so."""
    rows = working(2)
    rows["worker-0001"].update(restart_held=True, status_problem="not JSON")
    read = fleet(
        rows,
        epoch=4,
        watch_mode="poll",
        version="9.9",
        started_at=0.0,
        uptime_s=3723.0,
        stopping=True,
        pointer={"path": "/ws/current.json", "error": "Permission denied"},
        last_reload_errors=["hosts[2].shard: must be an integer"],
    )
    assert "daemon pid 7, up 1h02m, leader, epoch 4, watch poll, version 9.9" in read.text
    assert "status as of 01:02:03 UTC" in read.text
    assert read.banners == [
        "STOPPINGthe daemon is shutting down",
        "POINTER FILE/ws/current.json not written: Permission denied",
        "RELOAD FAILEDhosts[2].shard: must be an integer",
    ]
    [tile] = [t for t in read.tiles if t.outlined]
    assert tile.second == "ready, restart held, status file: not JSON"


def test_a_host_page_of_a_host_in_trouble_has_every_row_it_needs() -> None:
    """An unreachable host's page gives the SSH reason, its last error, the status file's
    problem, the operation in flight, a stop file, and a multi-line text cut at its start
    (its end matters most); a row with only a restart count shows it."""
    detail = {
        "host": "w",
        "state": "stopped",
        "ssh": "unreachable",
        "ssh_reason": "connection refused",
        "address": "10.0.0.9:22",
        "last_error": "launch refused: shard lock held",
        "status_problem": "too big",
        "operation": "terminate",
        "stop_sentinel": True,
        "restarts": 6,
        "evidence": {"pid": 3, "stacks": "x" * (page.TEXT_CHARS + 10) + "\nlast frame"},
    }
    read = parse_page(page.host_page(detail, None))
    for shown in (
        "unreachable (10.0.0.9:22): connection refused",
        "launch refused: shard lock held",
        "too big",
        "terminate",
        "present: kept stopped",
        "restarts6",
    ):
        assert shown in read.text, shown
    [stacks] = read.pres
    assert stacks.startswith("…x")
    assert stacks.endswith("last frame")
