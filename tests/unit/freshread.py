"""The shell's answer to ``RecheckStatus`` for tests that drive the cores by hand: a fresh
read of the status file that finds it as the host last saw it (the file did not change)."""

from __future__ import annotations

from supervisor import health as h


def fresh_read(host: h.Host) -> h.StatusRechecked:
    """What re-reading ``host``'s status file finds when nothing rewrote it."""
    if host.remote_heartbeat_at is None or host.beat_pid is None or host.status_problem:
        return h.StatusRechecked(beat=h.StatusMissing(reason=host.status_problem or "missing"))
    current = host.beat_pid == host.pid
    return h.StatusRechecked(
        beat=h.HeartbeatSeen(
            pid=host.beat_pid,
            ready=host.beat_ready,
            remote_heartbeat_at=host.remote_heartbeat_at,
            remote_seq=host.remote_seq,
            processed=host.processed if current else None,
            in_flight=host.in_flight if current else None,
            stats=host.stats if current else None,
        )
    )


def step_answering(
    host: h.Host, event: h.Event, now: float, policy: h.Policy
) -> tuple[h.Host, list[h.Action]]:
    """``h.step``, then, at the same instant, the fresh read any ``RecheckStatus`` asked for."""
    host, actions = h.step(host, event, now, policy)
    if any(isinstance(a, h.RecheckStatus) for a in actions):
        host, more = h.step(host, fresh_read(host), now, policy)
        actions = actions + more
    return host, actions
