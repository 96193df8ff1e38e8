"""What operators, the page and the alerts see of rewards that lie: the status rows (a ready
host named as lying shows ``lying`` with its rates beside the fleet's), the daemon's
rewards row, the table and ``status HOST``, STATUS=, the fleet page and the metrics, all
from a fleet core driven into each case."""

from __future__ import annotations

from typing import Any

from supervisor import fleet as f
from supervisor import page, render, view, vocabulary
from supervisor.config import HostConfig
from supervisor.policies import RewardsPolicy
from tests.unit.test_fleet_core import HEALTH, members
from tests.unit.test_fleet_rewards import B_LIES, HEALTHY, NAMES, POLICY, Fleet
from tests.unit.test_operator_views import scrape


def status(s: Fleet) -> dict[str, Any]:
    """``status --json`` as the presenter builds it from the fleet's view."""
    shown = s.core.view(s.now)
    hosts = {}
    for name, host in shown.hosts.items():
        cfg = HostConfig(name=name, shard=shown.shards[name], address="10.0.0.1")
        hosts[name] = {
            **view.shown_row(
                host,
                cfg,
                s.now,
                shown.health_policy,
                lie=shown.lying.get(name),
                reward_row=view.rewards_row(shown.rewards, name, s.now),
            ),
            "machine": shown.machines[name],
        }
    daemon = {
        "running": True,
        "summary": view.status_line(shown),
        "rewards": view.fleet_rewards_row(shown.rewards, RewardsPolicy(), s.now),
        "spares": shown.spares,
        "free_spares": shown.free_spares,
        "failover_counts": dict(shown.failover_counts),
    }
    return {"daemon": daemon, "hosts": hosts}


def lying_fleet(spares: tuple[str, ...] = ()) -> Fleet:
    """Four hosts; b scores everything 0 long enough to be named."""
    s = Fleet(f.Fleet(members(*((n, i) for i, n in enumerate(NAMES))), HEALTH, POLICY, spares))
    s.start(spares)
    s.rollouts(30, HEALTHY)
    s.rollouts(60, B_LIES)
    return s


def test_a_lying_host_s_row_shows_lying_and_its_rates_beside_the_fleet_s() -> None:
    """The row's state is ``lying``, its reason the lie (its rate beside the fleet's); its
    rewards row gives the window's counts and rates; a healthy host's says ``in line``."""
    st = status(lying_fleet())
    b, a = st["hosts"]["b"], st["hosts"]["a"]
    assert b["state"] == vocabulary.LYING == render.LYING
    assert b["last_reason"].startswith("rewards lie: zero rate 100% (")
    assert "vs the fleet's 30%" in b["last_reason"]
    rewards = b["rewards"]
    assert rewards["verdict"] == "lying" and rewards["kinds"] == ["zero"]
    assert rewards["zero_rate"] == 1.0 and rewards["fleet_zero_rate"] == 0.3
    assert rewards["kept"] is True and rewards["named_on"] == "b"
    assert a["state"] == "ready" and a["rewards"]["verdict"] == "in line"
    assert a["rewards"]["zero_rate"] == 0.3
    fleet = st["daemon"]["rewards"]
    assert fleet["lying"] == ["b"] and fleet["fleet_zero_rate"] == 0.3
    assert fleet["signature"] is None and fleet["held"] == []


def test_the_table_status_host_and_summary_name_the_lie() -> None:
    """The table's ZERO/ERR column and a REWARDS LIE line; ``status HOST`` says the verdict
    with both rates; the summary counts the host as lying, not ready."""
    st = status(lying_fleet())
    table = render.render_table(st)
    assert any(line.startswith("HOST ") and " ZERO/ERR " in line for line in table.splitlines())
    b_line = next(line for line in table.splitlines() if line.startswith("b "))
    assert " lying " in b_line and " 100%/0% " in b_line
    assert any(
        line.startswith("REWARDS LIE on b (fleet zero rate 30%, error rate 0%): not ready")
        for line in table.splitlines()
    )
    assert st["daemon"]["summary"] == "REWARDS LIE on b; 3/4 ready, 1 lying"
    detail = render.render_host({"daemon": {}, "host": "b", **st["hosts"]["b"]})
    assert "rewards: lying: zero rate 100% (fleet 30%), error rate 0% (fleet 0%)" in detail
    assert "(its shard could not be moved)" in detail


def test_a_machine_held_for_lying_is_said_with_what_to_do() -> None:
    """Moved to a spare, the host is no longer named; the machine it left is held, and the
    table and the page say so and that undrain gives it back."""
    s = lying_fleet(("s0",))
    st = status(s)
    assert st["hosts"]["b"]["state"] == "starting"
    [held] = st["daemon"]["rewards"]["held"]
    assert (held["machine"], held["host"]) == ("b", "b")
    table = render.render_table(st)
    assert "b held for lying (b moved off it, named" in table
    assert "`reward-supervisor undrain`" in table
    html = page.fleet_page(st)
    assert "HELD FOR LYING" in html


def test_the_page_shows_a_lying_tile_a_banner_and_the_fleet_s_rates() -> None:
    """The fleet page: b's tile in the lying colour among the problems, a REWARDS LIE banner,
    the fleet's recent zero and error rates; b's own page gives its rewards."""
    st = status(lying_fleet())
    html = page.fleet_page(st)
    assert 'class="t s-lying' in html and page.tile_order(st["hosts"])[0] == "b"
    assert "REWARDS LIE</b>b is not ready" in html
    assert "recent zero rate <b>30%</b>, error rate <b>0%</b>" in html
    host_page = page.host_page({"host": "b", **st["hosts"]["b"]}, None)
    assert "<dt>rewards</dt><dd>lying: zero rate 100% (fleet 30%)" in host_page


def test_the_metrics_give_each_host_s_rates_the_verdict_and_the_fleet_s() -> None:
    """Per host: the zero and error rates and 1 for the lying one; the fleet's medians, the
    count of lying hosts, held machines, no signature; hosts by state count it as lying;
    the worker's own zero count as a counter."""
    metrics = scrape(status(lying_fleet()))
    assert metrics['reward_supervisor_host_zero_rate{host="b"}'] == 1.0
    assert metrics['reward_supervisor_host_zero_rate{host="a"}'] == 0.3
    assert metrics['reward_supervisor_host_error_rate{host="b"}'] == 0.0
    assert metrics['reward_supervisor_host_rewards_lying{host="b"}'] == 1
    assert metrics['reward_supervisor_host_rewards_lying{host="a"}'] == 0
    assert metrics["reward_supervisor_fleet_zero_rate"] == 0.3
    assert metrics["reward_supervisor_rewards_lying_hosts"] == 1
    assert metrics["reward_supervisor_rewards_held_machines"] == 0
    assert metrics["reward_supervisor_reward_signature"] == 0
    assert metrics['reward_supervisor_hosts{state="lying"}'] == 1
    assert metrics['reward_supervisor_hosts{state="ready"}'] == 3
    assert metrics['reward_worker_tasks_zero_total{host="b"}'] > 0


def test_a_fleet_wide_signature_leads_the_summary_the_table_and_the_page() -> None:
    """Every host to 100 % zeros at once: the signature leads STATUS=, has its own line in
    the table and a banner, and its gauge is 1; nobody is shown lying."""
    s = Fleet(f.Fleet(members(*((n, i) for i, n in enumerate(NAMES))), HEALTH, POLICY))
    s.start()
    s.rollouts(120, HEALTHY)
    s.rollouts(60, dict.fromkeys(NAMES, 1.0))
    st = status(s)
    assert st["daemon"]["summary"].startswith("REWARD SIGNATURE (zero rate): 4 hosts")
    assert st["daemon"]["summary"].endswith("4/4 ready")
    assert "REWARD SIGNATURE for " in render.render_table(st)
    assert "REWARD SIGNATURE</b>" in page.fleet_page(st)
    assert scrape(st)["reward_supervisor_reward_signature"] == 1
    assert all(row["state"] == "ready" for row in st["hosts"].values())


def test_a_host_s_verdict_reads_out_of_line_before_it_is_named_and_not_judged_alone() -> None:
    """Before sustain_s a host out of line reads ``out of line`` (not lying, still ready); a
    fleet of one reads ``not judged`` (nobody to compare with); a host never looked at has
    no rewards row."""
    s = Fleet(f.Fleet(members(*((n, i) for i, n in enumerate(NAMES))), HEALTH, POLICY))
    s.start()
    assert view.rewards_row(s.core.rewards_state, "a", s.now) is None
    s.rollouts(30, HEALTHY)
    s.rollouts(15, B_LIES)
    st = status(s)
    assert st["hosts"]["b"]["rewards"]["verdict"] == "out of line"
    assert st["hosts"]["b"]["state"] == "ready"
    alone = Fleet(f.Fleet(members(("a", 0)), HEALTH, POLICY))
    alone.counts = {}
    alone.boot()
    alone.run_worker("a", 100)
    alone.rollouts(30, {"a": 1.0})
    row = view.rewards_row(alone.core.rewards_state, "a", alone.now)
    assert row is not None and row["verdict"] == "not judged"
    assert row["fleet_zero_rate"] is None
