"""Why an operator command was refused: the codes the control socket answers with beside its
message, the one list the cores, the daemon, the client and the CLI share (stdlib only).

The values are contract: a script matches them (``--json``'s ``code``), never the wording.
"""

from __future__ import annotations

from enum import StrEnum


class Refusal(StrEnum):
    """A code beside a refusal's message; each is said by one side of the socket."""

    # --- the fleet core (``fleet.Reply``) ---
    #: The host named is not a member (or is leaving the fleet, or never was).
    UNKNOWN_HOST = "unknown_host"
    #: restart-host of a host its stop sentinel keeps stopped (start-host is the way).
    SENTINEL_HELD = "sentinel_held"
    #: The stop sentinel could not be written or removed.
    FILE_ERROR = "file_error"
    #: The daemon is stopping (or, for a handover, already stopping).
    SHUTTING_DOWN = "shutting_down"
    #: drain: every spare serves a shard, is lost or still being cleaned.
    NO_FREE_SPARE = "no_free_spare"
    #: drain: no ``[[spares]]`` are configured.
    NO_SPARES = "no_spares"
    #: drain: the host serves no shard (a spare, lost, or drained already).
    NOT_SERVING = "not_serving"
    #: undrain: the host was not drained.
    NOT_DRAINED = "not_drained"

    # --- the leadership core ---
    #: A standby, or a leader that was deposed: only the leader serves this command.
    NOT_LEADER = "not_leader"

    # --- the daemon's control socket ---
    #: The daemon is starting or stopping and serves no command that changes the fleet.
    UNAVAILABLE = "unavailable"
    #: The request is not one: malformed JSON, no or a bad ``cmd``, a missing or bad
    #: argument, an unexpected one, or over the size limit.
    BAD_REQUEST = "bad_request"
    #: ``cmd`` names no command the daemon knows.
    UNKNOWN_COMMAND = "unknown_command"
    #: The peer's uid is neither the daemon's nor root's.
    PERMISSION_DENIED = "permission_denied"
    #: Too many connections at once, none idle to close: try again.
    BUSY = "busy"
    #: The connection sent no request for too long and was closed.
    IDLE_TIMEOUT = "idle_timeout"
    #: The daemon failed to serve the command (a bug: its log has the traceback).
    INTERNAL_ERROR = "internal_error"

    # --- the client, never on the wire ---
    #: No daemon runs for this socket: none there, or a stale one nobody listens on.
    NO_DAEMON = "no_daemon"
    #: The socket cannot be used: not ours, not a socket, a connect or send that failed.
    UNREACHABLE = "unreachable"
    #: No reply in time, or the connection closed or broke before one.
    NO_REPLY = "no_reply"
    #: The reply is not one: not JSON, not an object, or over the size limit.
    BAD_REPLY = "bad_reply"
    #: Anything else: the message says what (a daemon that gave no code, an older one).
    FAILED = "failed"
