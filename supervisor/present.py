"""The presentation adapter: the cores' actions shown to people and their tools, as log
lines (structlog), systemd's ``STATUS=``/``READY=``/watchdog (``notify.py``), Prometheus
metrics (``metrics.py``), the live event stream (``reward-supervisor events``), and the
``status`` answers built from the cores' queries (``view.py`` renders the rows).

It decides nothing: what happened is the cores' to say; this module only says it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

import structlog

from supervisor import config as config_mod
from supervisor import fleet, leadership, logs, page, view, vocabulary
from supervisor.config import HostConfig
from supervisor.control import EventHub, EventSubscription
from supervisor.errors import ControlError
from supervisor.links import Links
from supervisor.metrics import Metrics, detail_on_loop, snapshot_on_loop
from supervisor.notify import NotifierProtocol
from supervisor.refusals import Refusal
from supervisor.rundir import RunDirectory
from supervisor.shell import Shell

log = structlog.get_logger("supervisor.daemon")

__version__: Final = "0.1.0"

# STATUS= is for people; one summary per 0.1 s of changes is as current as anyone reads it.
STATUS_COALESCE_S: Final = 0.1


@dataclass
class Facts:
    """What the daemon knows of itself that ``status`` shows (the interpreter keeps it)."""

    started_wall: float = field(default_factory=time.time)
    started_at: float = 0.0
    reloads: int = 0
    last_reload_errors: list[str] = field(default_factory=list)


class Presenter:
    """Logs, ``STATUS=``, metrics, events and ``status`` answers."""

    def __init__(
        self,
        shell: Shell,
        *,
        notifier: NotifierProtocol,
        core: fleet.Fleet,
        leading: Callable[[], leadership.Leadership],
        links: Links,
        rundir: RunDirectory,
        facts: Facts,
    ) -> None:
        self._shell = shell
        self.notifier = notifier
        self._core = core
        self._leading = leading
        self._links = links
        self._rundir = rundir
        self._facts = facts
        self._events = EventHub()
        self._metrics: Metrics | None = None
        self._summary = ""
        self._publish_pending = False

    # --- the fleet core's actions --------------------------------------------------------

    def state_changed(self, change: vocabulary.HostStateChanged) -> None:
        """``host.state``: logged, streamed, and in ``STATUS=`` soon."""
        fields: dict[str, Any] = {
            "host": change.host,
            "from": change.from_.value,
            "to": change.to.value,
            "reason": change.reason,
            "pid": change.pid,
        }
        if change.cause is not None:
            fields["cause"] = change.cause.value
        if change.evidence is not None:
            fields["evidence"] = view.evidence_row(change.evidence)
        (log.warning if change.fault else log.info)("host.state", **fields)
        self._events.publish({"event": "host.state", "timestamp": _utc_now(), **fields})
        self.publish_status_soon()

    def launch_asked(self, action: vocabulary.LaunchAsked) -> None:
        """``host.launch``, and a restart counted by its cause (automatic) or by who asked
        (planned: an operator, a reload)."""
        planned = None if action.planned is None else action.planned.value
        log.info(
            "host.launch",
            host=action.host,
            reason=action.reason,
            restart=action.is_restart,
            planned=planned,
        )
        if self._metrics is None:
            return
        if action.is_restart:
            reason = action.cause.value if action.cause is not None else "other"
            self._metrics.restarts.labels(host=action.host, reason=reason).inc()
        elif planned is not None:
            self._metrics.planned_restarts.labels(host=action.host, reason=planned).inc()

    def launches_waiting(self, action: vocabulary.LaunchesWaiting) -> None:
        """Launches queued behind the fleet's budget."""
        log.info("fleet.launches_queued", waiting=action.waiting)

    def pointer_not_written(self, action: vocabulary.PointerNotWritten) -> None:
        """The pointer file could not be written; the core retries it."""
        log.error(
            "pointer.not_written",
            path=action.path,
            reason=action.reason,
            attempt=action.attempt,
            retry_in_s=round(action.retry_at - asyncio.get_running_loop().time(), 3),
        )

    def freeze_changed(self, change: vocabulary.FreezeChanged) -> None:
        """The fleet froze or thawed."""
        if change.frozen:
            log.error("fleet.frozen", reason=change.reason, hosts=list(change.hosts))
        else:
            log.warning("fleet.thawed", reason=change.reason)
        self.publish_event("fleet.frozen" if change.frozen else "fleet.thawed", change.reason)
        self.publish_status(force=True)

    def freeze_explained(self, action: vocabulary.FreezeExplained) -> None:
        """What the diagnosis of a freeze found."""
        log.error("fleet.freeze_finding", finding=action.finding, free_bytes=action.free_bytes)
        self.publish_event("fleet.freeze_finding", reason=action.finding)
        self.publish_status(force=True)

    def crash_signature_found(self, action: vocabulary.CrashSignatureFound) -> None:
        """Hosts crashed (or failed their reward probe) the same way: restarts held but for
        the canary."""
        event = f"fleet.{action.kind}_signature"
        log.error(
            event,
            signature=action.signature,
            hosts=list(action.hosts),
            canary=action.canary,
            log_tail=action.log_tail,
        )
        self.publish_event(event, reason=action.signature)
        self.publish_status(force=True)

    def crash_signature_cleared(self, action: vocabulary.CrashSignatureCleared) -> None:
        """A crash (or probe) signature no longer holds restarts."""
        event = f"fleet.{action.kind}_signature_cleared"
        log.warning(
            event, signature=action.signature, reason=action.reason, released=list(action.released)
        )
        self.publish_event(event, reason=action.reason)
        self.publish_status(force=True)

    def failed_over(self, action: vocabulary.Failover) -> None:
        """``shard.failover``: a member's shard is served by a spare from now on."""
        log.warning(
            "shard.failover",
            host=action.label,
            shard=action.shard,
            from_machine=action.from_machine,
            to_machine=action.to_machine,
            reason=action.reason,
        )
        self.publish_event(
            "shard.failover",
            reason=f"{action.label} (shard {action.shard}) moved from"
            f" {action.from_machine} to {action.to_machine}: {action.reason}",
        )
        self.publish_status(force=True)

    def no_free_spare(self, action: vocabulary.NoFreeSpare) -> None:
        """A member's machine is lost and no spare is free: its shard stays unserved."""
        log.error(
            "shard.no_free_spare", host=action.label, shard=action.shard, machine=action.machine
        )
        self.publish_event(
            "shard.no_free_spare", reason=f"{action.label} lost ({action.machine}): no free spare"
        )

    def lying_host_named(self, action: vocabulary.LyingHostNamed) -> None:
        """``rewards.lying``: a host's rewards are out of line with the fleet's; it is not
        ready from now on (its shard moves to a spare where one is free)."""
        log.warning(
            "rewards.lying",
            host=action.host,
            machine=action.machine,
            kinds=list(action.kinds),
            reason=action.reason,
        )
        self.publish_event("rewards.lying", reason=f"{action.host}: {action.reason}")
        self.publish_status(force=True)

    def lying_host_kept(self, action: vocabulary.LyingHostKept) -> None:
        """``rewards.not_moved``: a host named as lying keeps serving its shard."""
        log.error(
            "rewards.not_moved", host=action.host, machine=action.machine, reason=action.reason
        )
        self.publish_event("rewards.not_moved", reason=f"{action.host}: {action.reason}")

    def lying_host_cleared(self, action: vocabulary.LyingHostCleared) -> None:
        """``rewards.cleared``: a host is no longer named as lying."""
        log.info("rewards.cleared", host=action.host, machine=action.machine, reason=action.reason)
        self.publish_event("rewards.cleared", reason=f"{action.host}: {action.reason}")
        self.publish_status(force=True)

    def reward_signature_found(self, action: vocabulary.RewardSignatureFound) -> None:
        """``fleet.reward_signature``: most of the fleet's rewards moved out of line at once."""
        log.error(
            "fleet.reward_signature",
            kinds=list(action.kinds),
            hosts=list(action.hosts),
            reason=action.reason,
        )
        self.publish_event("fleet.reward_signature", reason=action.reason)
        self.publish_status(force=True)

    def reward_signature_cleared(self, action: vocabulary.RewardSignatureCleared) -> None:
        """``fleet.reward_signature_cleared``: the fleet-wide reward signature is over."""
        log.warning("fleet.reward_signature_cleared", reason=action.reason)
        self.publish_event("fleet.reward_signature_cleared", reason=action.reason)
        self.publish_status(force=True)

    def exit_reported(self, action: vocabulary.ExitReported) -> None:
        """A worker's exit its machine's agent pushed: ``worker.exit_reported`` for a host's,
        ``spare.exit_reported`` for a leftover of a machine serving none."""
        if action.host is None:
            log.info("spare.exit_reported", machine=action.machine, pid=action.pid)
            return
        log.info(
            "worker.exit_reported",
            host=action.host,
            pid=action.pid,
            exit_code=action.exit_code,
            signal=action.signal,
            reaped=action.reaped,
            via="agent",
        )

    def probe_reported(self, action: vocabulary.ProbeReported) -> None:
        """``host.reward_probe``: what a reward probe found, as the core judged it; its round
        trip observed and a failure counted by its cause."""
        report, answer, host = action.report, action.report.answer, action.host
        fields: dict[str, Any] = {
            "host": host,
            "pid": answer.pid,
            "status": answer.status,
            "score": answer.score,
            "round_trip_s": round(answer.round_trip_s, 4),
        }
        if report.busy:
            fields["busy"] = True  # unanswered behind the worker's backlog: not counted
        cause = None if report.cause is None else report.cause.value
        if cause is not None:
            log.warning("host.reward_probe", cause=cause, error=report.error, **fields)
        else:
            log.info("host.reward_probe", **fields)
        if self._metrics is not None:
            if answer.status is not None:  # an unanswered probe has no round trip
                self._metrics.probe_seconds.labels(host=host).observe(answer.round_trip_s)
            if cause is not None:
                self._metrics.probe_failures.labels(host=host, cause=cause).inc()

    def settled(self, action: vocabulary.Settled) -> None:
        """Start-up is over: READY for systemd, ``daemon.ready`` in the journal."""
        if action.slow:
            waited = self._shell.config.fleet.startup_timeout_s
            log.warning("daemon.ready_without", hosts=list(action.slow), waited_s=waited)
        self.notifier.ready()
        self.publish_status()
        log.info("daemon.ready", summary=self._summary, watch_mode=self._rundir.watcher.mode)

    def shutdown_began(self, action: vocabulary.ShutdownBegan) -> None:
        """STOPPING for systemd."""
        self.notifier.stopping()
        log.info("daemon.stopping", on_exit=self._shell.config.run.on_exit)

    def shutdown_done(self, done: vocabulary.ShutdownDone) -> None:
        """The hosts the stop could not end, if any."""
        if done.incomplete:
            log.error(
                "daemon.stop_incomplete",
                hosts=list(done.incomplete),
                waited_s=self._shell.config.fleet.shutdown_timeout_s,
            )
        elif done.unreachable:
            log.error(
                "daemon.stop_incomplete",
                hosts=list(done.unreachable),
                reason=(
                    "unreachable over SSH: their workers may still run; the next daemon adopts them"
                ),
            )

    # --- the leadership core's actions ---------------------------------------------------

    def leader_changed(self, action: leadership.LeaderChanged) -> None:
        """Another daemon holds the lock now."""
        log.info("ha.leader_changed", leader=action.leader)

    def takeover_failed(self, action: leadership.TakeoverFailed) -> None:
        """The lock was free but could not be taken."""
        log.error("ha.takeover_failed", reason=action.reason, retry_in_s=action.retry_in_s)

    def leading(self, action: leadership.Leading) -> None:
        """``ha.leading``: the lock is ours, the epoch bumped (with the warm connections a
        standby brings)."""
        fields: dict[str, Any] = {"epoch": action.epoch, "leader": action.leader}
        if action.took_over:
            warm = self._links.warm_counts()
            fields.update(warm=warm["connected"], probed=warm["probed"], hosts=warm["hosts"])
        log.info("ha.leading", **fields)

    def announce(self, action: leadership.Announce) -> None:
        """``STATUS=`` as the leadership core words it."""
        self.notifier.status(action.text)

    def in_charge(self, action: leadership.InCharge) -> None:
        """A takeover is complete."""
        shown = self._core.view(asyncio.get_running_loop().time())
        log.info(
            "ha.in_charge",
            epoch=action.epoch,
            since_lock_s=action.since_lock_s,
            since_lock_free_s=action.since_lock_free_s,
            adopted=shown.workers,
            hosts=len(shown.hosts),
        )

    def stood_by(self, action: leadership.StandBy) -> None:
        """Waiting as a standby: READY for systemd."""
        log.info("ha.standby", leader=action.leader, poll_interval_s=action.poll_interval_s)
        self.notifier.status(action.summary)
        self.notifier.ready()

    def deposed(self, action: leadership.Deposed) -> None:
        """``ha.deposed``, streamed; STOPPING for systemd."""
        log.error(
            "ha.deposed",
            epoch=action.epoch,
            epoch_on_disk=action.epoch_on_disk,
            reason=action.reason,
            exit_code=leadership.EXIT_DEPOSED,
        )
        self.publish_event("ha.deposed", action.reason)
        self.notifier.stopping()

    def stood_down(self, action: leadership.StandDown) -> None:
        """STOPPING for systemd."""
        self.notifier.stopping()

    def handover(self, action: leadership.HandOver) -> None:
        """A handover begins."""
        log.info("ha.handover", epoch=action.epoch, hold_s=action.hold_s)

    def handed_over(self, action: leadership.HandedOver) -> None:
        """A standby took the lock after our handover."""
        log.info("ha.handed_over", leader=action.leader)

    def handover_unclaimed(self, action: leadership.HandoverUnclaimed) -> None:
        """No standby took the lock within the hold-off."""
        log.warning("ha.handover_unclaimed", waited_s=action.waited_s)

    def cannot_start(self, action: leadership.CannotStart) -> None:
        """The daemon may not start (the lock is held and it is no standby)."""
        log.error("daemon.cannot_start", reason=action.reason)

    def ping_watchdog(self, action: leadership.PingWatchdog) -> None:
        """WATCHDOG=1."""
        self.notifier.watchdog()

    def withhold_watchdog(self, action: leadership.WithholdWatchdog) -> None:
        """No WATCHDOG=1, and why."""
        log.warning("daemon.watchdog_withheld", reason=action.reason)

    def role_changed(self, action: leadership.RoleChanged) -> None:
        """``ha.role`` at every change of role."""
        log.info(
            "ha.role", **{"from": action.from_.value, "to": action.to.value}, reason=action.reason
        )

    # --- metrics ----------------------------------------------------------------------------

    def start_metrics(self, loop: asyncio.AbstractEventLoop, status: Callable[[], Any]) -> None:
        """Serve ``/metrics`` and the fleet page on ``[metrics] listen``, if set."""
        config = self._shell.config
        listen = config.metrics.listen
        if listen is None:
            return
        host, port = config_mod.split_host_port(listen)
        metrics = Metrics(
            snapshot_on_loop(loop, status),
            host_detail=detail_on_loop(loop, self.host_status),
            # Read in the endpoint's own reader thread, never on the loop: the log is a file
            # under the run root (bounded, never through a symlink: view.log_lines).
            log_tail=lambda host: view.log_lines(self._shell.config, host, page.LOG_LINES),
        )
        try:
            metrics.start(host, port)
        except OSError as exc:
            # Supervision matters more than its dashboard: run on, and say so loudly.
            log.error("metrics.not_started", listen=listen, reason=str(exc))
            return
        self._metrics = metrics

    async def stop_metrics(self) -> None:
        """Close the metrics listener."""
        if self._metrics is not None:
            await asyncio.to_thread(self._metrics.stop)

    def timed(self, op: str, seconds: float) -> None:
        """A launch or a terminate took ``seconds``."""
        if self._metrics is not None:
            histogram = self._metrics.launch_seconds
            if op == "terminate":
                histogram = self._metrics.terminate_seconds
            histogram.observe(seconds)

    def reload_counted(self, result: str) -> None:
        """A reload ended: ``"ok"`` or ``"error"``."""
        if self._metrics is not None:
            self._metrics.reloads.labels(result=result).inc()

    # --- STATUS= and the event stream -------------------------------------------------------

    def publish_status_soon(self) -> None:
        """``publish_status`` within STATUS_COALESCE_S, once however many hosts change
        meanwhile: the summary counts all N hosts, and start-up changes thousands."""
        if not self._publish_pending:
            self._publish_pending = True
            asyncio.get_running_loop().call_later(STATUS_COALESCE_S, self.publish_status)

    def publish_status(self, shown: fleet.FleetView | None = None, *, force: bool = False) -> None:
        """``STATUS=`` with the fleet's summary, if it changed (or ``force``)."""
        self._publish_pending = False
        if shown is None:
            shown = self._core.view(asyncio.get_running_loop().time())
        text = view.status_line(shown)
        if text != self._summary or force:
            self._summary = text
            if self._core.settled:
                self.notifier.status(text)

    def publish_event(self, event: str, reason: str) -> None:
        """One fleet-wide event on the live stream."""
        self._events.publish({"event": event, "timestamp": _utc_now(), "reason": reason})

    def subscribe(self) -> EventSubscription:
        """A live stream of ``host.state`` events for ``reward-supervisor events``."""
        return self._events.subscribe()

    def close_events(self) -> None:
        """End every subscriber's stream."""
        self._events.close()

    # --- status answers -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``{"daemon": {...}, "hosts": {...}}``: every configured host's row."""
        now = asyncio.get_running_loop().time()
        shown = self._core.view(now)
        self.publish_status(shown)  # the summary as of now, not as of the last coalesced one
        policy = shown.health_policy
        hosts = {
            name: {
                **view.shown_row(
                    host,
                    self._settings(shown, name),
                    now,
                    policy,
                    lie=shown.lying.get(name),
                    reward_row=view.rewards_row(shown.rewards, name, now),
                ),
                "machine": shown.machines[name],
            }
            for name, host in shown.hosts.items()
        }
        return {"daemon": self._daemon_row(shown, now), "hosts": hosts}

    def host_status(self, name: str) -> dict[str, Any]:
        """``{"daemon": {...}, "host": H, ...}``: the host's row with its progress, restarts,
        last exit and evidence in full."""
        now = asyncio.get_running_loop().time()
        shown = self._core.view(now)
        self.publish_status(shown)
        host = shown.hosts.get(name)
        if host is None:
            raise ControlError(f"unknown host {name!r}", code=Refusal.UNKNOWN_HOST)
        detail = view.shown_row(
            host,
            self._settings(shown, name),
            now,
            shown.health_policy,
            detail=True,
            wall_now=time.time(),
            lie=shown.lying.get(name),
            reward_row=view.rewards_row(shown.rewards, name, now),
        )
        return {
            "daemon": self._daemon_row(shown, now),
            "host": name,
            **detail,
            "machine": shown.machines[name],
        }

    def row(self, name: str) -> dict[str, Any]:
        """One host's row, as a command's answer."""
        now = asyncio.get_running_loop().time()
        shown = self._core.view(now)
        host = self._core.host(name)
        if host is None:  # it left between the command and its answer
            raise ControlError(f"unknown host {name!r}", code=Refusal.UNKNOWN_HOST)
        row = view.host_row(
            host,
            self._settings(shown, name),
            now,
            shown.health_policy,
            lie=shown.lying.get(name),
            reward_row=view.rewards_row(shown.rewards, name, now),
        )
        return {"host": name, **row}

    def _settings(self, shown: fleet.FleetView, name: str) -> HostConfig:
        """What ``status`` shows of a host's settings: its machine's address, its own shard."""
        cfg = self._links.machine_cfg(shown.machines[name])
        return replace(cfg, name=name, shard=shown.shards[name])

    def standby_status(self, view_at: float | None) -> dict[str, Any]:
        """A standby's status: who leads, the epoch, its warm connections, and the hosts as
        the run directory shows them."""
        now = asyncio.get_running_loop().time()
        lead = self._leading()
        leader = lead.leader or "unknown"
        return {
            "daemon": {
                **self._identity(now),
                "role": "standby",
                "leader": leader,
                "epoch": lead.epoch_on_disk,
                "ready": True,
                "summary": f"standby, leader: {leader}",
                "warm": self._links.warm_counts(),
                "note": "standby: hosts as the run directory shows them; the leader acts",
                "view_age_s": round(now - (view_at or self._facts.started_at), 3),
            },
            "hosts": dict(self._rundir.standby_view.get("hosts", {})),
        }

    def _identity(self, now: float) -> dict[str, Any]:
        """The fields of a status's ``daemon`` row that a leader and a standby share."""
        config = self._shell.config
        return {
            "running": True,
            "pid": os.getpid(),
            "version": __version__,
            "config": str(config.source),
            "root": str(config.run.root),
            "uptime_s": round(now - self._facts.started_at, 3),
            "started_at": self._facts.started_wall,
            "stopping": leadership.asked_to_stop(self._leading()),
            "log_lines": logs.logged_lines(),
            "log_lines_dropped": logs.dropped_lines(),
            "on_exit": config.run.on_exit,
            "stop_grace_s": config.health.stop_grace_s,
        }

    def _daemon_row(self, shown: fleet.FleetView, now: float) -> dict[str, Any]:
        lead = self._leading()
        watcher = self._rundir.watcher
        return {
            **self._identity(now),
            "role": lead.shown_role,
            "leader": lead.leader,
            "epoch": lead.epoch,
            "ready": self._core.settled,
            "all_ready": shown.all_ready,
            "summary": self._summary,
            "watch_mode": watcher.mode,
            "reloads": self._facts.reloads,
            "last_reload_errors": self._facts.last_reload_errors,
            "frozen": shown.frozen,
            "frozen_reason": shown.frozen_reason or None,
            "freeze_finding": shown.finding,
            "crash_signatures": [
                _signature_row(sig, held, now) for sig, held in shown.crash_signatures
            ],
            #: Reward probes failing the same way on several hosts (``[probe]``).
            "probe_signatures": [
                _signature_row(sig, held, now) for sig, held in shown.probe_signatures
            ],
            #: ``[trainer] task_timeout_s``, beside which a probe's round trip is judged.
            "trainer_task_timeout_s": self._shell.config.trainer.task_timeout_s,
            #: ``[[spares]]``: each spare machine's role; shards moved to one, by reason.
            "spares": shown.spares,
            "free_spares": shown.free_spares,
            "failovers": shown.moves,
            "failover_counts": dict(shown.failover_counts),
            "launches_waiting": shown.launches_waiting,
            "launches_in_flight": shown.launches_in_flight,
            #: Rewards that lie (``[rewards]``): the fleet's rates, the hosts named, the
            #: machines held for it, a fleet-wide signature.
            "rewards": view.fleet_rewards_row(shown.rewards, self._shell.config.fleet.rewards, now),
            "status_parse_errors": getattr(watcher, "parse_errors", 0),
            "pointer": view.pointer_row(
                self._shell.config.run.pointer_file,
                shown.pointer,
                self._rundir.pointer_written_wall,
                now,
            ),
        }


def _signature_row(
    sig: vocabulary.CrashSignature, held: tuple[str, ...], now: float
) -> dict[str, Any]:
    return {
        "signature": sig.signature,
        "since_s": round(now - sig.since_at, 3),
        "hosts": sorted(sig.hosts),
        "canary": sig.canary,
        "held": list(held),
    }


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
