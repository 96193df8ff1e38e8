"""Crash and probe signatures (fleet rule 8): hosts that fail the same way within a window
share a cause (a bad deploy), so restarting each into it only hides it. Their restarts are
held but for one canary host at a time, until the canary runs again, a reload changes what
the workers (or the probe) run, or an operator unfreezes.

A frozen value and pure functions of it. Each transition returns the new value and what it
says: actions for the shell (``CrashSignatureFound``, ``CrashSignatureCleared``) and
``ToHost`` words for the per-host cores (``RestartHeld``, ``RestartReleased``), which
``Fleet`` feeds in order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import field, replace
from typing import Final

from supervisor import health
from supervisor.health import Host, HostState
from supervisor.records import record
from supervisor.vocabulary import (
    CrashSignature,
    CrashSignatureCleared,
    CrashSignatureFound,
    FleetPolicy,
    Said,
    ToHost,
)


@record
class Signatures:
    """Recent failures by signature, the signatures that hold restarts, the hosts held."""

    #: signature -> (when, host) of its recent failures, oldest first.
    recent: Mapping[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)
    #: The signatures that hold restarts now.
    active: Mapping[str, CrashSignature] = field(default_factory=dict)
    #: host -> the signature holding its restarts.
    held: Mapping[str, str] = field(default_factory=dict)


NONE: Final = Signatures()

#: SIGHUP, SIGINT, SIGKILL, SIGTERM: sent to a worker by someone (the OOM killer, an operator,
#: a scheduler), so they say nothing about what the worker runs.
_SENT_SIGNALS: Final = frozenset({1, 2, 9, 15})
#: How much of the log's last line a signature keeps.
_SIGNATURE_LINE: Final = 160
_NUMBERS: Final = re.compile(r"0x[0-9a-fA-F]+|\d+")
_SPACE: Final = re.compile(r"\s+")


def crash_signature(event: health.WorkerExited) -> str | None:
    """How the worker crashed, alike for alike crashes on different hosts; None for an exit
    that says nothing about what the worker runs (a signal someone sent)."""
    if event.signal is not None:
        if event.signal in _SENT_SIGNALS:
            return None
        head = f"signal {event.signal}"
    elif event.exit_code is not None:
        head = f"exit {event.exit_code}"
    else:
        return None
    line = health.last_log_line(event.log_tail)
    if not line:
        return head
    return f"{head}: {blurred(line)}"


def probe_signature(
    host: Host, event: health.RewardProbeAnswered, policy: health.Policy
) -> str | None:
    """How a reward probe failed, alike on every host; None if it did not fail."""
    reason = health.probe_failure(host, event, policy)
    return None if reason is None else f"probe: {blurred(reason)}"


def blurred(line: str) -> str:
    """``line`` alike on every host: pids, addresses, times and counts differ from host to
    host; the words do not."""
    return _SPACE.sub(" ", _NUMBERS.sub(_blur, line)).strip()[:_SIGNATURE_LINE]


def _blur(number: re.Match[str]) -> str:
    return "0x?" if number.group().startswith("0x") else "N"


def failed(
    sigs: Signatures,
    name: str,
    signature: str,
    *,
    kind: str,
    log_tail: str | None,
    hosts: Mapping[str, Host],
    now: float,
    policy: FleetPolicy,
) -> tuple[Signatures, list[Said]]:
    """``name`` failed with ``signature``: a new signature once enough hosts have within the
    window (holding the others that are not ready), and a hold on this host unless it is
    the signature's canary."""
    window = policy.crash_signature_window_s
    recent = tuple((t, h) for t, h in sigs.recent.get(signature, ()) if now - t < window)
    recent = (*recent, (now, name))
    sigs = replace(sigs, recent={**sigs.recent, signature: recent})
    active = sigs.active.get(signature)
    if active is None:
        names = frozenset(h for _, h in recent)
        if len(names) < policy.crash_signature_hosts:
            return sigs, []
        active = CrashSignature(
            signature=signature, since_at=now, hosts=names, canary=name, kind=kind
        )
        sigs = replace(sigs, active={**sigs.active, signature: active})
        out: list[Said] = [
            CrashSignatureFound(
                signature=signature,
                hosts=tuple(sorted(names)),
                canary=name,
                log_tail=log_tail,
                kind=kind,
            )
        ]
        for other in sorted(names - {name}):
            if other in hosts and hosts[other].state is not HostState.READY:
                sigs = _hold(sigs, other, signature, out)
        return sigs, out
    active = replace(active, hosts=active.hosts | {name})
    if active.canary not in hosts:
        active = replace(active, canary=name)  # the canary left: this one tries next
    sigs = replace(sigs, active={**sigs.active, signature: active})
    out = []
    if active.canary != name:
        sigs = _hold(sigs, name, signature, out)
    return sigs, out


def _hold(sigs: Signatures, name: str, signature: str, out: list[Said]) -> Signatures:
    active = sigs.active[signature]
    how = "failed their reward probe" if active.kind == "probe" else "crashed"
    reason = f"{len(active.hosts)} hosts {how} the same way ({signature})"
    out.append(ToHost(host=name, event=health.RestartHeld(reason=reason)))
    return replace(sigs, held={**sigs.held, name: signature})


def ran_again(sigs: Signatures, name: str) -> tuple[Signatures, list[Said]]:
    """``name`` is ready again: it is held no more, and a canary that runs clears its
    signature (whatever crashed it is gone)."""
    if name in sigs.held:
        sigs = replace(sigs, held={h: s for h, s in sigs.held.items() if h != name})
    out: list[Said] = []
    for signature, active in list(sigs.active.items()):
        if active.canary == name:
            sigs = _clear(sigs, signature, f"the canary {name} is ready", out)
    return sigs, out


def cleared(
    sigs: Signatures, reason: str, kind: str | None = None
) -> tuple[Signatures, list[Said]]:
    """Every signature (of ``kind``, if given) stops holding restarts, for ``reason``."""
    out: list[Said] = []
    for signature, active in list(sigs.active.items()):
        if kind is None or active.kind == kind:
            sigs = _clear(sigs, signature, reason, out)
    return sigs, out


def _clear(sigs: Signatures, signature: str, reason: str, out: list[Said]) -> Signatures:
    kind = sigs.active[signature].kind
    released = sorted(n for n, s in sigs.held.items() if s == signature)
    out.append(
        CrashSignatureCleared(
            signature=signature, reason=reason, released=tuple(released), kind=kind
        )
    )
    out.extend(ToHost(host=n, event=health.RestartReleased()) for n in released)
    return Signatures(
        recent={s: r for s, r in sigs.recent.items() if s != signature},
        active={s: a for s, a in sigs.active.items() if s != signature},
        held={h: s for h, s in sigs.held.items() if s != signature},
    )


def forget(sigs: Signatures, name: str) -> Signatures:
    """``name`` left the fleet: it is held no more."""
    if name not in sigs.held:
        return sigs
    return replace(sigs, held={h: s for h, s in sigs.held.items() if h != name})


def held_by(sigs: Signatures, signature: str) -> list[str]:
    """The hosts whose restarts ``signature`` holds, by name."""
    return sorted(name for name, held in sigs.held.items() if held == signature)
