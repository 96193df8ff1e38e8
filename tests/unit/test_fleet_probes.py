"""Reward probes in the fleet core: the probe each host's core asks for goes out with its
shard, and the same probe failure on several hosts within the window is a probe signature,
held but for the canary and released like a crash signature (canary ready, a reload that
changes the workers or the probe, an unfreeze)."""

from __future__ import annotations

from dataclasses import replace

from supervisor import fleet as f
from supervisor import health as h
from supervisor import vocabulary as v
from supervisor.health import HostState as S
from tests.unit.test_fleet_core import Shell

PROBED = h.Policy(
    heartbeat_stale_s=10.0,
    ready_timeout_s=20.0,
    restart_cooldown_s=1.0,
    probe_interval_s=30.0,
    probe_timeout_s=5.0,
    probe_task='{"reward_fn":"pkg.missing.fn"}',
    probe_expect=1.0,
)
POLICY = v.FleetPolicy(crash_signature_hosts=3, startup_timeout_s=1e6)
MISSING = "ModuleNotFoundError: No module named 'pkg.missing'"


def probed_fleet(n: int, health: h.Policy = PROBED) -> Shell:
    """``n`` hosts (``w0``... on shards 0...) whose launched workers heartbeat ready and
    each have a probe in flight."""
    members = [v.Member(name=f"w{i}", shard=i) for i in range(n)]
    s = Shell(f.Fleet(members, health, POLICY))
    s.boot()
    for i in range(n):
        name = f"w{i}"
        s.on(name, h.SshRestored())
        s.on(name, h.ProbeResult(pid=None))
        s.on(name, h.Launched(pid=100 + i))
        s.on(name, h.HeartbeatSeen(pid=100 + i, ready=True, remote_heartbeat_at=1.0))
    return s


def fail_probe(s: Shell, i: int, pid: int | None = None) -> None:
    """Host ``w{i}``'s probe comes back with the import error (its current worker's)."""
    answer = h.RewardProbeAnswered(pid=pid or 100 + i, status="error", error=MISSING)
    s.on(f"w{i}", answer)


def test_the_probe_a_host_asks_for_goes_out_with_its_shard() -> None:
    """A starting worker's first heartbeat sends one probe to its shard, with the task."""
    s = probed_fleet(2)
    sent = [a for a in s.actions if isinstance(a, v.SendRewardProbe)]
    assert sent == [
        v.SendRewardProbe(host="w0", shard=0, pid=100, task=PROBED.probe_task, timeout_s=5.0),
        v.SendRewardProbe(host="w1", shard=1, pid=101, task=PROBED.probe_task, timeout_s=5.0),
    ]
    assert all(s.state(n) is S.STARTING for n in ("w0", "w1"))


def test_the_same_probe_failure_on_three_hosts_holds_all_but_the_canary() -> None:
    """Three hosts answering the probe with the same import error: one probe signature (the
    error, numbers blurred), the first two held, the third its canary; nothing crashed."""
    s = probed_fleet(3)
    for i in range(3):
        fail_probe(s, i)
    [found] = [a for a in s.actions if isinstance(a, v.CrashSignatureFound)]
    assert found.kind == "probe"
    assert found.signature == f"probe: reward probe failed: {MISSING}"
    assert found.hosts == ("w0", "w1", "w2") and found.canary == "w2"
    assert set(s.core.signature_state.held) == {"w0", "w1"}
    for name in ("w0", "w1"):
        held = s.core.hosts[name].held
        assert held is not None and "failed their reward probe the same way" in held


def test_the_canary_scoring_its_probe_releases_the_held_hosts() -> None:
    """The canary's restarted worker scores its probe: it is ready, and the signature goes."""
    s = probed_fleet(3)
    for i in range(3):
        fail_probe(s, i)
    s.on("w2", h.TerminateConfirmed(pid=102))
    s.on("w2", h.Launched(pid=200))
    s.on("w2", h.HeartbeatSeen(pid=200, ready=True, remote_heartbeat_at=2.0))
    assert s.state("w2") is S.STARTING  # a heartbeat is not a score
    s.on("w2", h.RewardProbeAnswered(pid=200, status="ok", score=1.0))
    assert s.state("w2") is S.READY
    cleared = s.last(v.CrashSignatureCleared)
    assert cleared is not None and cleared.kind == "probe"
    assert cleared.reason == "the canary w2 is ready"
    assert not s.core.signature_state.held


def test_a_reload_that_changes_the_probe_releases_only_probe_signatures() -> None:
    """A reload whose probe task differs releases the probe signature; one that changes
    neither the workers nor the probe releases nothing."""
    s = probed_fleet(3)
    for i in range(3):
        fail_probe(s, i)
    members = tuple(v.Member(name=f"w{i}", shard=i) for i in range(3))
    s.feed(v.Reconfigured(members=members, health=PROBED, policy=POLICY, token=1))
    assert s.core.signature_state.active and s.core.signature_state.held
    fixed = replace(PROBED, probe_task='{"reward_fn":"pkg.fixed.fn"}')
    s.feed(v.Reconfigured(members=members, health=fixed, policy=POLICY, token=2))
    cleared = s.last(v.CrashSignatureCleared)
    assert cleared is not None and cleared.reason == "a reload changed the reward probe"
    assert not s.core.signature_state.active and not s.core.signature_state.held


def test_probe_failures_that_differ_or_come_too_few_make_no_signature() -> None:
    """Two alike failures and one different make no signature, and with the count at 0
    nothing is ever counted."""
    s = probed_fleet(3)
    fail_probe(s, 0)
    fail_probe(s, 1)
    s.on("w2", h.RewardProbeAnswered(pid=102, status="ok", score=0.0))
    assert not s.core.signature_state.active
    off = Shell(
        f.Fleet([v.Member(name="w0", shard=0)], PROBED, replace(POLICY, crash_signature_hosts=0))
    )
    off.boot()
    off.on("w0", h.SshRestored(), h.ProbeResult(pid=None), h.Launched(pid=100))
    off.on("w0", h.HeartbeatSeen(pid=100, ready=True, remote_heartbeat_at=1.0))
    off.on("w0", h.RewardProbeAnswered(pid=100, status="error", error=MISSING))
    assert off.state("w0") is S.STALE and not off.core.signature_state.active


def test_an_unfreeze_releases_a_probe_signature() -> None:
    """An operator's unfreeze ends a probe signature's hold, as it ends a crash signature's."""
    s = probed_fleet(3)
    for i in range(3):
        fail_probe(s, i)
    assert s.core.signature_state.held
    s.feed(v.UnfreezeRequested(token=1))
    cleared = s.last(v.CrashSignatureCleared)
    assert cleared is not None and cleared.kind == "probe" and cleared.reason == "operator unfreeze"
    assert not s.core.signature_state.active and not s.core.signature_state.held
    assert all(host.held is None for host in s.core.hosts.values())


def test_a_reload_that_changes_only_the_probe_keeps_a_crash_signature() -> None:
    """Hosts crashing alike are not mended by another probe task: the crash signature and
    its hold stay through a reload that changes the probe alone."""
    s = probed_fleet(3)
    tail = "Traceback (most recent call last):\nImportError: libfoo.so\n"
    for i in range(3):
        s.on(f"w{i}", h.WorkerExited(pid=100 + i, exit_code=2, log_tail=tail))
    [signature] = s.core.signature_state.active.values()
    assert signature.kind == "crash" and s.core.signature_state.held
    members = tuple(v.Member(name=f"w{i}", shard=i) for i in range(3))
    fixed = replace(PROBED, probe_task='{"reward_fn":"pkg.fixed.fn"}')
    s.feed(v.Reconfigured(members=members, health=fixed, policy=POLICY, token=1))
    assert (
        list(s.core.signature_state.active.values()) == [signature] and s.core.signature_state.held
    )


def test_each_answer_is_reported_once_before_what_it_leads_to_and_an_unasked_one_never() -> None:
    """The core's judgement of an answer goes out first, then the changes it causes; an
    answer nobody asked for (no probe in flight) is not reported at all."""
    s = probed_fleet(1)
    out = s.on("w0", h.RewardProbeAnswered(pid=100, status="error", error=MISSING))
    kinds = [type(a) for a in out]
    assert kinds[0] is v.ProbeReported and v.HostStateChanged in kinds
    [report] = [a for a in out if isinstance(a, v.ProbeReported)]
    assert report.host == "w0" and report.report.cause is h.Cause.PROBE_FAILED
    again = s.on("w0", h.RewardProbeAnswered(pid=100, status="ok", score=1.0))
    assert not [a for a in again if isinstance(a, v.ProbeReported)]
