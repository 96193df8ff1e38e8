"""The policies ``config.py`` builds for the cores, and the fleet's members: plain values,
stdlib only, so that reading a config imports no core (every CLI command reads one).

The cores use them under their own names (``health.Policy``, ``fleet.FleetPolicy``,
``fleet.Member``, ``leadership.Policy``); dependencies still point inward.
"""

from __future__ import annotations

from collections.abc import Hashable

from supervisor.records import record


@record
class HealthPolicy:
    """``[health]``: one host's timing and budget rules (``health.Policy``). The defaults are
    what a config without ``[health]`` gives with the default ``[trainer]`` and ``[watch]``
    (``config.trainer_defaults``: tests/unit/test_config.py holds them equal), so a test of
    the cores runs what production runs."""

    heartbeat_stale_s: float = 5.0
    ready_timeout_s: float = 60.0
    restart_cooldown_s: float = 5.0
    backoff_max_s: float = 300.0
    backoff_reset_s: float = 600.0
    max_restarts: int = 0
    restart_window_s: float = 3600.0
    stop_grace_s: float = 30.0
    kill_after_grace: bool = False
    #: A stuck worker is SIGKILLed after the grace even without ``kill_after_grace``: its
    #: hung call cannot end on SIGTERM, so without the kill it would never be replaced.
    kill_stuck: bool = True
    #: False: an unhealthy worker is never replaced automatically (the seed's --no-respawn).
    auto_restart: bool = True
    #: A ready worker with tasks in flight and no task finished for this long is stuck
    #: (0: progress is not judged).
    progress_stale_s: float = 10.0
    #: Exit codes after which a restart cannot help: the host goes ``failed`` at once.
    permanent_exit_codes: frozenset[int] = frozenset()
    #: How long the shell may spend capturing a live but unhealthy worker's stacks and log
    #: tail before terminating it (0: no evidence is collected).
    evidence_timeout_s: float = 3.0
    #: How its stacks are taken: "auto" (py-spy where the host has it, else the signal),
    #: "py-spy", "signal" (SIGUSR1, answered by ``faulthandler``) or "none" (log tail only).
    evidence_stacks: str = "auto"
    #: How a worker is ended when another is to replace it (a restart, automatic or not):
    #: "kill" (SIGKILL at once: its in-flight tasks are computed again by the next worker,
    #: and no ``ready: false`` ever reaches the trainer) or "drain" (SIGTERM and
    #: ``stop_grace_s``, as a stop: in-flight tasks finish, and the trainer's client fails
    #: every call from the worker's last ``ready: false`` to its successor's first heartbeat).
    restart_stop: str = "kill"
    #: The tasks a stuck worker hung on are quarantined before its successor starts, each
    #: answered with an error result, so one poison task cannot keep a shard restarting.
    quarantine_stuck_tasks: bool = True
    #: Reward probes (``[probe]``): one every this long per worker (0: no probes, and a
    #: worker is judged by its heartbeat alone).
    probe_interval_s: float = 0.0
    #: A probe not answered within this long failed.
    probe_timeout_s: float = 20.0
    #: The probe's task record without its id (JSON text, written as is); opaque here.
    probe_task: str = ""
    #: The score a probe must have (None: any score will do; an error never does).
    probe_expect: float | None = None


@record
class RewardsPolicy:
    """``[rewards]``: when a host's rewards are out of line with the fleet's (``rewards.py``).

    The defaults name a host that scores everything 0 (or fails every task) within about 30 s
    of the trainer's calls at a few tasks a second per host, and never one whose zero rate is
    within the +-30 % of the fleet's that hashing tasks to shards leaves between hosts."""

    #: A host's recent tasks: those its worker finished in this long, and longer (up to
    #: ``rewards.MAX_WINDOW_S``) until they are ``min_tasks``. 0: rewards are not judged.
    window_s: float = 10.0
    #: A host is judged only with this many recent results (its zero rate, with this many
    #: scored ones); fewer say too little.
    min_tasks: int = 200
    #: A host may score 0 (or fail) this many times as often as the rest of the fleet before
    #: it is out of line (and never more than three quarters of the way to 100 %).
    tolerance: float = 2.0
    #: Out of line at every look for this long: named.
    sustain_s: float = 15.0
    #: A named host back in line for this long: cleared.
    clear_s: float = 60.0
    #: A named host's shard moves to a free spare (``[[spares]]``); false: it is only named.
    move: bool = True


@record
class FleetPolicy:
    """``[fleet]`` settings and the fleet's own deadlines (``fleet.FleetPolicy``)."""

    freeze_fraction: float = 0.5
    freeze_window_s: float = 30.0
    max_concurrent_launches: int = 16
    max_launches_per_minute: int = 120
    #: Start-up waits this long for every host to answer before READY=1 goes out anyway
    #: (a host that cannot be reached must not hold the others back).
    startup_timeout_s: float = 30.0
    #: Shutdown gives up on hosts still stopping after this long (``health.stop_grace_s``
    #: and a margin: ``config.shutdown_timeout_s``).
    shutdown_timeout_s: float = 45.0
    #: A stop leaves the workers running (``run.on_exit = "detach"``) unless it says otherwise.
    detach_on_exit: bool = False
    #: ``run.pointer_file``, written once the fleet is first all ready (None: no pointer).
    pointer_file: str | None = None
    #: This many hosts crashing the same way within the window hold restarts (0: never).
    crash_signature_hosts: int = 3
    crash_signature_window_s: float = 300.0
    #: ``[failover] after_s``: a machine down this long with its heartbeat this old is lost
    #: and its shard moves to a spare (only with ``[[spares]]``).
    failover_after_s: float = 11.0
    #: ``[rewards]``: hosts whose rewards lie (zero scores, error results).
    rewards: RewardsPolicy = RewardsPolicy()


@record
class Member:
    """A configured host as the fleet sees it: its name, shard and what shapes its worker
    (``fleet.Member``)."""

    name: str
    shard: int
    #: Everything that shapes the worker (argv, env, python, address...): a reload that
    #: changes it restarts the host.
    launch_key: Hashable = ()


@record
class HaPolicy:
    """``[ha]``: a standby that takes over when the leader goes (``leadership.Policy``)."""

    #: Wait for the run lock instead of exiting when another daemon holds it.
    standby: bool = False
    #: How often a standby tries the run lock.
    poll_interval_s: float = 0.5
    #: How often the leader checks that it still holds the lock and the epoch is its own.
    check_interval_s: float = 5.0
    #: How long ``handover`` waits for a standby to take the lock.
    confirm_timeout_s: float = 30.0
    #: After a handover the old leader stays off the lock this long (a standby takes it).
    handover_hold_s: float = 5.0
