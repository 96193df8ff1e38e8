"""Failover: which machine serves each member's shard, and the machines serving none.

A label is a ``[[hosts]]`` name; the machine serving it is that host, or the spare its shard
was moved to. The status file keeps the label's name (the worker runs with ``--host
<label>``), so the trainer sees the same hosts whichever machine serves them.

Rules:

1. A machine is lost when its connection is seen down AND the heartbeat of what it serves
   is ``after_s`` old: a partition alone (the worker still beats on the shared filesystem)
   or a hung worker alone (health.py restarts it) is not a lost machine.
2. A lost machine's label goes to the first free spare (connected, not lost, serving
   nothing, not fenced); none free: the label stays and ``NoFreeSpare`` says so, once.
3. A machine that lost its label (lost or drained) is fenced: it is given nothing until its
   leftovers are killed (``KillLeftovers`` when it is seen again). Then it becomes a spare
   (lost) or stays out until ``undrain`` (drained): it never flaps back.
4. The shard lock on the shared filesystem is the last fence: a launch on the spare waits
   on it, so a lost machine's worker that is alive after all never serves beside it.
5. A drained label's launch on its spare waits until its old machine's worker is killed
   (gracefully, as a restart ends one); a lost one's goes at once.
6. A label whose rewards lie (``rewards.py``) moves as a drained one does, and its machine
   is held the same way (a missing dependency does not come back by itself), but its
   worker is killed at once: what it has in flight would score wrong, and its successor
   on the spare scores those tasks again.

All of it is one frozen value, ``Seating``, and pure functions of it that return the new
value and what they say: actions for the shell and ``ToHost`` words for the per-host cores
(``health.Relocated`` for a label that moves, SSH news for a label a spare serves), which
``Fleet`` feeds in order. Nothing here reads a clock: ``now`` is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import field, replace
from typing import Final

from supervisor import health
from supervisor.health import Host, HostState
from supervisor.records import record
from supervisor.vocabulary import (
    Failover,
    FleetPolicy,
    KeepSpare,
    KillLeftovers,
    NoFreeSpare,
    Refusal,
    Said,
    SavedSeats,
    ToHost,
)

#: How soon killing a returned machine's leftovers is tried again after it failed (while it
#: stays connected; a reconnect tries at once).
LEFTOVERS_RETRY_S: Final = 5.0


@record
class Seats:
    """Which machine serves each label, and the machines serving none."""

    #: label -> machine serving its shard (the label's own host until a failover).
    serving: Mapping[str, str]
    #: label -> shard.
    shards: Mapping[str, int]
    #: Free spares, in the order they are given shards (config order, then returns).
    spares: tuple[str, ...] = ()
    #: Machines that lost their label and whose leftovers are not yet known killed.
    fenced: frozenset[str] = frozenset()
    #: Fenced machines drained by an operator (out of service until ``undrain``).
    drained: frozenset[str] = frozenset()
    #: Drained machines cleaned up and waiting for ``undrain``.
    held: frozenset[str] = frozenset()


@record
class Sighting:
    """What the daemon knows of one machine's reachability and its worker's heartbeat."""

    connected: bool
    #: When its connection was last seen going down (None: up, or not tried yet).
    down_since: float | None = None
    #: Its worker's last heartbeat, on our clock (None: none seen).
    beat_at: float | None = None
    #: Why it is not connected, as its connection said (told to a member that joins on it).
    reason: str = "not connected yet"


@record
class Seating:
    """Everything failover knows: the seats, each machine's connection, and the work a
    machine that lost its label still owes."""

    seats: Seats
    #: Every machine whose connection news came (members' machines and spares).
    sightings: Mapping[str, Sighting] = field(default_factory=dict)
    #: Serving machines whose connection is down (where a loss can begin) -> their label.
    down: Mapping[str, str] = field(default_factory=dict)
    #: Machine that lost its label -> the (label, shard, pid) of the worker it may still run.
    left: Mapping[str, tuple[str, int, int | None]] = field(default_factory=dict)
    #: Fenced machines whose leftovers are being killed, or when to try again.
    killing: frozenset[str] = frozenset()
    kill_retry_at: Mapping[str, float] = field(default_factory=dict)
    #: Drained machine -> the label whose launch on its spare waits for the kill.
    release_waits: Mapping[str, str] = field(default_factory=dict)
    #: Machines whose leftovers are killed at once, whatever ``restart_stop`` says (rule 6).
    kill_now: frozenset[str] = frozenset()
    #: Labels lost with no free spare, said once until served again.
    unserved: frozenset[str] = frozenset()
    #: When the next down machine is lost, if nothing changes.
    lost_next_at: float | None = None
    #: Shards moved since start, by reason (``host_lost``/``drain``/``lying``).
    counts: Mapping[str, int] = field(default_factory=dict)
    #: Labels a previous daemon left on another machine, until they join.
    restored: Mapping[str, str] = field(default_factory=dict)
    #: A spare became free since the last look: a label lost with none free may move.
    spare_freed: bool = False
    #: Spares are configured: without one nothing can move, and nothing is watched.
    sparing: bool = False


def new(spares: Iterable[str]) -> Seating:
    """No member joined yet; every spare free, none connected."""
    names = tuple(spares)
    return Seating(
        seats=Seats(serving={}, shards={}, spares=names),
        sightings={m: Sighting(connected=False) for m in names},
        sparing=bool(names),
    )


# --- queries -----------------------------------------------------------------------------


def machine_of(seating: Seating, label: str) -> str:
    """The machine serving ``label``'s shard (its own, or a spare's)."""
    return seating.seats.serving.get(label, label)


def label_at(seating: Seating, machine: str) -> str | None:
    """The label ``machine`` serves, if any."""
    serving = seating.seats.serving
    if serving.get(machine) == machine:
        return machine
    return next((label for label, m in serving.items() if m == machine), None)


def connected(seating: Seating, machine: str) -> bool:
    """``machine``'s connection is up, as last told."""
    sighting = seating.sightings.get(machine)
    return sighting is not None and sighting.connected


def free_spares(seats: Seats, sightings: Mapping[str, Sighting]) -> tuple[str, ...]:
    """The spares a shard may be moved to now: connected, serving nothing, not fenced."""
    busy = set(seats.serving.values()) | seats.fenced | seats.held
    return tuple(
        m
        for m in seats.spares
        if m not in busy and (s := sightings.get(m)) is not None and s.connected
    )


def deadline_at(seating: Seating) -> float | None:
    """When time alone could change something here: a loss, or a kill's retry."""
    return min(
        (t for t in (seating.lost_next_at, *seating.kill_retry_at.values()) if t is not None),
        default=None,
    )


def saved(seating: Seating) -> SavedSeats | None:
    """What the state file keeps of the seats (None without spares: nothing to keep)."""
    if not seating.sparing:
        return None
    seats = seating.seats
    return SavedSeats(
        serving={label: m for label, m in seats.serving.items() if m != label},
        fenced=seats.fenced,
        drained=seats.drained,
        held=seats.held,
        left=dict(seating.left),
    )


def spare_rows(seating: Seating) -> list[dict[str, object]]:
    """Every machine that is or was a spare, for ``status``: its name, whether it is
    connected, and what it is (``free``, ``serving`` a member, ``fenced`` until its
    leftovers are killed, ``drained`` until ``undrain``, ``down``)."""
    seats = seating.seats
    serves = {m: label for label, m in seats.serving.items() if m != label}
    rows: list[dict[str, object]] = []
    for machine, sighting in seating.sightings.items():
        if machine in serves:
            role = "serving"
        elif machine in seats.fenced:
            role = "fenced"
        elif machine in seats.held:
            role = "drained"
        elif machine in seats.spares:
            role = "free" if sighting.connected else "down"
        else:
            continue  # a member's own machine, serving it
        rows.append(
            {
                "name": machine,
                "role": role,
                "connected": sighting.connected,
                "serves": serves.get(machine),
            }
        )
    return rows


def moving(seating: Seating, hosts: Mapping[str, Host]) -> list[dict[str, object]]:
    """Failovers in progress, for ``status`` and the fleet page's banner: each member
    served by another machine and not ready there yet, and each lost one no spare took."""
    seats = seating.seats
    moves: list[dict[str, object]] = []
    for label in sorted(seats.serving):
        machine, host = seats.serving[label], hosts.get(label)
        if label in seating.unserved:
            moves.append(
                {"host": label, "shard": seats.shards[label], "to": None, "state": "no free spare"}
            )
        elif machine != label and host is not None and host.state is not HostState.READY:
            moves.append(
                {"host": label, "shard": seats.shards[label], "to": machine, "state": host.state}
            )
    return moves


# --- membership ---------------------------------------------------------------------------


def restore(
    seating: Seating, saved_seats: SavedSeats | None, configured: Iterable[str]
) -> tuple[Seating, list[Said]]:
    """At boot: take the seats a previous daemon saved, as far as they fit this config (else
    the config's: every member on its own machine); keep the machines serving nothing."""
    spares = seating.seats.spares
    if saved_seats is None:
        return seating, [KeepSpare(machine=m) for m in spares]
    members = tuple(configured)
    machines = set(members) | set(spares)
    own = {label: label for label in members}
    moved = {
        label: m
        for label, m in saved_seats.serving.items()
        if label in own and m in machines and m != label
    }
    if len(set({**own, **moved}.values())) != len(own):
        # Two shards on one machine: not a state we could have saved.
        return seating, [KeepSpare(machine=m) for m in spares]
    in_use = set({**own, **moved}.values())
    idle = [m for m in (*spares, *members) if m not in in_use]
    fenced = saved_seats.fenced & set(idle)
    held = saved_seats.held & set(idle) - fenced
    seats = replace(
        seating.seats,
        spares=tuple(m for m in idle if m not in fenced and m not in held),
        fenced=frozenset(fenced),
        drained=frozenset(saved_seats.drained & fenced),
        held=frozenset(held),
    )
    seating = replace(
        seating,
        seats=seats,
        restored=moved,
        left={m: e for m, e in saved_seats.left.items() if m in fenced and e[0] in own},
        sightings={**{m: Sighting(connected=False) for m in idle}, **seating.sightings},
    )
    return seating, [KeepSpare(machine=m) for m in idle]


def seat(seating: Seating, label: str, shard: int) -> tuple[Seating, str]:
    """``label`` joined: it serves its shard on its own machine, or on the one a previous
    daemon moved it to (``restore``); that machine."""
    machine = seating.restored.get(label, label)
    seats = replace(
        seating.seats,
        serving={**seating.seats.serving, label: machine},
        shards={**seating.seats.shards, label: shard},
    )
    sightings = seating.sightings
    if machine not in sightings:
        sightings = {**sightings, machine: Sighting(connected=False)}
    restored = seating.restored
    if label in restored:
        restored = {k: v for k, v in restored.items() if k != label}
    return replace(seating, seats=seats, sightings=sightings, restored=restored), machine


def unseat(seating: Seating, label: str) -> Seating:
    """``label`` left: a spare that served it is free again (its worker was stopped)."""
    seats = seating.seats
    machine = seats.serving[label]
    spares, sightings, down = seats.spares, seating.sightings, seating.down
    if machine != label:
        spares = (*spares, machine)
    else:
        sightings = {m: s for m, s in sightings.items() if m != machine}
        down = {m: lb for m, lb in down.items() if m != machine}
    return replace(
        seating,
        seats=replace(
            seats,
            serving={k: v for k, v in seats.serving.items() if k != label},
            shards={k: v for k, v in seats.shards.items() if k != label},
            spares=spares,
        ),
        sightings=sightings,
        down=down,
        spare_freed=seating.spare_freed or machine != label,
        unserved=seating.unserved - {label},
    )


# --- a machine's connection -----------------------------------------------------------------


def connection_changed(
    seating: Seating,
    machine: str,
    ssh: health.SshLost | health.SshRestored,
    *,
    now: float,
    shutting_down: bool,
    health_policy: health.Policy,
) -> tuple[Seating, list[Said]]:
    """``machine``'s connection came up or went down: remembered (a member that joins on it
    is told), watched for a loss while it serves, a fenced one's leftovers killed once it
    is back, and told to the label it serves."""
    up = isinstance(ssh, health.SshRestored)
    before = seating.sightings.get(machine, Sighting(connected=False))
    if isinstance(ssh, health.SshRestored):
        sighting = replace(before, connected=True, down_since=None, reason="connected")
    else:
        since = now if before.connected or before.down_since is None else before.down_since
        sighting = replace(before, connected=False, down_since=since, reason=ssh.reason)
    seating = replace(seating, sightings={**seating.sightings, machine: sighting})
    label = label_at(seating, machine)
    down = dict(seating.down)
    if up:
        down.pop(machine, None)
        if machine in seating.seats.spares:
            seating = replace(seating, spare_freed=True)
    elif label is not None and seating.sparing:
        down[machine] = label  # without a spare nothing can move: nothing is watched
    seating = replace(seating, down=down, lost_next_at=seating.lost_next_at if down else None)
    out: list[Said] = []
    if up and machine in seating.seats.fenced:
        seating = _kill_leftovers(seating, machine, health_policy, shutting_down, out)
    if label is not None:
        out.append(ToHost(host=label, event=ssh))
    return seating, out


# --- losses ---------------------------------------------------------------------------------


def look(
    seating: Seating,
    hosts: Mapping[str, Host],
    *,
    now: float,
    policy: FleetPolicy,
    shutting_down: bool,
) -> tuple[Seating, list[Said]]:
    """Move the shards of lost machines to free spares (rules 1-3). Each batch while a
    machine is down: only the down machines are looked at; the whole fleet's sightings
    only when one of them is lost and may move."""
    if shutting_down:
        return replace(seating, lost_next_at=None), []
    after = policy.failover_after_s
    lost: list[str] = []
    pending: list[float] = []
    for machine, label in seating.down.items():
        sighting = replace(seating.sightings[machine], beat_at=hosts[label].beat_changed_at)
        at = lost_at(sighting, after)
        at = math.inf if at is None else at  # (a down machine's loss always has a time)
        if at <= now:
            lost.append(label)
        else:
            pending.append(at)
    seating = replace(seating, lost_next_at=min((t for t in pending if t < math.inf), default=None))
    movable = any(label not in seating.unserved for label in lost)
    if not movable and not (lost and seating.spare_freed):
        return seating, []
    seating = replace(seating, spare_freed=False)
    sightings = _with_beats(seating, hosts)
    out: list[Said] = []
    for label in sorted(seating.seats.serving):
        machine = seating.seats.serving[label]
        seen = sightings.get(machine)
        if seen is None or not is_lost(seen, now, after):
            continue
        free = free_spares(seating.seats, sightings)
        shard = seating.seats.shards[label]
        if not free:
            if label not in seating.unserved:
                seating = replace(seating, unserved=seating.unserved | {label})
                out.append(NoFreeSpare(label=label, shard=shard, machine=machine))
            continue
        move = Failover(
            label=label, shard=shard, from_machine=machine, to_machine=free[0], reason="host_lost"
        )
        down = {m: lb for m, lb in seating.down.items() if m != machine}
        seating = replace(seating, down=down)
        seating = _moved(seating, move, hosts[label].pid, drained=False, out=out)
    return seating, out


def lost_at(sighting: Sighting, after_s: float) -> float | None:
    """When the machine is lost if nothing changes: its connection seen down (not merely
    untried) and its heartbeat ``after_s`` old. The heartbeat's age is the clock, since an
    SSH keepalive may notice a dead peer late; without a heartbeat seen, the connection's
    loss is (a daemon that started beside a dead host still gives it ``after_s``)."""
    if sighting.connected or sighting.down_since is None:
        return None
    since = sighting.beat_at if sighting.beat_at is not None else sighting.down_since
    return since + after_s


def is_lost(sighting: Sighting, now: float, after_s: float) -> bool:
    """The machine is lost at ``now`` (``lost_at``)."""
    at = lost_at(sighting, after_s)
    return at is not None and now >= at


def _with_beats(seating: Seating, hosts: Mapping[str, Host]) -> dict[str, Sighting]:
    """Sightings with each serving machine's last heartbeat (of the label it serves)."""
    sightings = dict(seating.sightings)
    for label, machine in seating.seats.serving.items():
        beat_at = hosts[label].beat_changed_at
        sightings[machine] = replace(sightings[machine], beat_at=beat_at)
    return sightings


#: How a move's reason reads in the moved host's reason.
_WHY: Final = {"host_lost": "host lost", "drain": "drained", "lying": "lying (its rewards)"}


def _moved(
    seating: Seating, move: Failover, pid: int | None, *, drained: bool, out: list[Said]
) -> Seating:
    """``move.label`` starts afresh on ``move.to_machine``; what its old machine runs is
    fenced (the shard lock, the epoch, ``KillLeftovers``), never waited for (rules 3-5)."""
    seats = seating.seats
    machine, label = move.from_machine, move.label
    seats = replace(
        seats,
        serving={**seats.serving, label: move.to_machine},
        spares=tuple(m for m in seats.spares if m != move.to_machine),
        fenced=seats.fenced | {machine},
        drained=seats.drained | {machine} if drained else seats.drained,
    )
    counts = {**seating.counts, move.reason: seating.counts.get(move.reason, 0) + 1}
    seating = replace(
        seating,
        seats=seats,
        left={**seating.left, machine: (label, move.shard, pid)},
        unserved=seating.unserved - {label},
        counts=counts,
    )
    why = _WHY.get(move.reason, move.reason)
    reason = f"moving to {move.to_machine}: {machine} {why}"
    out.append(move)
    # A free spare is a connected one; a drained label's launch waits for the kill (rule 5).
    out.append(ToHost(host=label, event=health.Relocated(reason=reason, ssh_up=not drained)))
    if drained:
        seating = replace(seating, release_waits={**seating.release_waits, machine: label})
    return seating


# --- fenced machines' leftovers -----------------------------------------------------------------


def _kill_leftovers(
    seating: Seating,
    machine: str,
    health_policy: health.Policy,
    shutting_down: bool,
    out: list[Said],
) -> Seating:
    if machine in seating.killing or shutting_down:
        return seating
    label, shard, pid = seating.left.get(machine, (machine, 0, None))
    grace = 0.0
    if (
        machine in seating.release_waits
        and machine not in seating.kill_now
        and health_policy.restart_stop != "kill"
    ):
        grace = health_policy.stop_grace_s  # a drain ends its worker as a restart does
    out.append(KillLeftovers(machine=machine, label=label, shard=shard, pid=pid, grace_s=grace))
    retry = {m: t for m, t in seating.kill_retry_at.items() if m != machine}
    return replace(seating, killing=seating.killing | {machine}, kill_retry_at=retry)


def leftovers_killed(
    seating: Seating, machine: str, error: str | None, *, now: float, hosts: Mapping[str, Host]
) -> tuple[Seating, list[Said]]:
    """The answer to ``KillLeftovers``: a failure is tried again while the machine stays
    connected; done, the machine is a spare again (or held until ``undrain``), and a label
    waiting for it to be killed may launch on its spare."""
    seating = replace(seating, killing=seating.killing - {machine})
    if error is not None:
        if connected(seating, machine):
            retry_at = {**seating.kill_retry_at, machine: now + LEFTOVERS_RETRY_S}
            seating = replace(seating, kill_retry_at=retry_at)
        return seating, []
    seats = seating.seats
    if machine in seats.fenced:
        fenced = seats.fenced - {machine}
        if machine in seats.drained:
            seats = replace(
                seats, fenced=fenced, drained=seats.drained - {machine}, held=seats.held | {machine}
            )
        else:
            seats = replace(seats, fenced=fenced, spares=(*seats.spares, machine))
    label = seating.release_waits.get(machine)
    seating = replace(
        seating,
        seats=seats,
        left={m: e for m, e in seating.left.items() if m != machine},
        release_waits={m: lb for m, lb in seating.release_waits.items() if m != machine},
        kill_now=seating.kill_now - {machine},
        spare_freed=True,
    )
    if label is not None and label in hosts and connected(seating, machine_of(seating, label)):
        return seating, [ToHost(host=label, event=health.SshRestored())]
    return seating, []


def retry_kills(
    seating: Seating, *, now: float, shutting_down: bool, health_policy: health.Policy
) -> tuple[Seating, list[Said]]:
    """Try again the kills whose retry is due, on machines still connected."""
    out: list[Said] = []
    for machine, at in list(seating.kill_retry_at.items()):
        if at <= now:
            retry = {m: t for m, t in seating.kill_retry_at.items() if m != machine}
            seating = replace(seating, kill_retry_at=retry)
            if connected(seating, machine):
                seating = _kill_leftovers(seating, machine, health_policy, shutting_down, out)
    return seating, out


# --- drain and undrain -----------------------------------------------------------------------


def drain(
    seating: Seating,
    machine: str,
    hosts: Mapping[str, Host],
    *,
    health_policy: health.Policy,
    reason: str = "drain",
) -> tuple[Seating, Failover, list[Said]] | Refusal:
    """Move ``machine``'s label to a free spare (for maintenance, or ``reason`` "lying":
    rule 6); the machine is fenced, then held."""
    seats = seating.seats
    label = next((lb for lb, m in sorted(seats.serving.items()) if m == machine), None)
    if label is None:
        return Refusal.NOT_SERVING
    free = free_spares(seats, _with_beats(seating, hosts))
    if not free:
        return Refusal.NO_SPARES if not seating.sparing else Refusal.NO_FREE_SPARE
    move = Failover(
        label=label,
        shard=seats.shards[label],
        from_machine=machine,
        to_machine=free[0],
        reason=reason,
    )
    out: list[Said] = []
    seating = _moved(seating, move, hosts[label].pid, drained=True, out=out)
    if reason == "lying":
        seating = replace(seating, kill_now=seating.kill_now | {machine})
    seating = _kill_leftovers(seating, machine, health_policy, False, out)
    return seating, move, out


def undrain(seating: Seating, machine: str) -> Seating | Refusal:
    """A drained machine, cleaned up, goes back to the pool as a spare."""
    seats = seating.seats
    if machine not in seats.held:
        return Refusal.NOT_DRAINED
    seats = replace(seats, held=seats.held - {machine}, spares=(*seats.spares, machine))
    return replace(seating, seats=seats, spare_freed=True)
