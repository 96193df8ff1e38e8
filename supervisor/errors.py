"""The exceptions this package raises; every message names the host, the state or the key."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.refusals import Refusal
from supervisor.safefiles import UnsafeFile


class SupervisorError(Exception):
    """Base of every error this package raises on purpose."""


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One thing wrong with a config file: where, and why."""

    file: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.reason}"


class ConfigError(SupervisorError):
    """A config file that cannot be used; carries every problem found, not just the first."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class RemoteError(SupervisorError):
    """A remote operation that failed or whose outcome is unknown."""

    def __init__(self, host: str, reason: str, *, connection_lost: bool = False) -> None:
        self.host = host
        self.reason = reason
        #: True when the SSH connection went away under the operation: its outcome is unknown.
        self.connection_lost = connection_lost
        super().__init__(f"{host}: {reason}")


class ShardHeld(RemoteError):
    """The remote launch refused because a live worker already holds the shard (the core
    hears it as the event ``health.LaunchRefused``)."""

    def __init__(self, host: str, reason: str, *, holder_pid: int | None) -> None:
        self.holder_pid = holder_pid
        super().__init__(host, reason)


class ControlError(SupervisorError):
    """A control-socket request that could not be served, or a daemon that cannot be reached.

    ``code`` says why for a program (a ``Refusal`` value; from a daemon, whatever code it
    sent), the message for a person: match the code, never the wording.
    """

    def __init__(self, message: str, *, code: str = Refusal.FAILED) -> None:
        self.code = code
        super().__init__(message)


class DaemonNotRunning(ControlError):
    """No daemon answers for this config: no socket, or a socket nobody listens on."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=Refusal.NO_DAEMON)


class RunLocked(SupervisorError):
    """Another reward-supervisor holds this run's lock (``ctl/supervisor.lock``); ``holder``
    is who, as it wrote it ("" when unknown)."""

    def __init__(self, message: str, *, holder: str = "") -> None:
        self.holder = holder
        super().__init__(message)


class Fenced(RemoteError):
    """A host's agent refused a launch or terminate: the run directory's epoch is higher
    than the one the request carried, so another supervisor leads now."""


class UnsafeFileError(SupervisorError, UnsafeFile):
    """A file or directory under the run root that is not what it must be (a symbolic link,
    a FIFO, a device, a hard link, a swapped directory): refused, never followed.

    ``safefiles.UnsafeFile`` (which the agent raises on hosts) as the daemon raises it
    (``runfiles``): an ``OSError``, so every caller that already survives a bad file survives
    this one; the message names the file, ``reason`` is the short why (``"a symbolic link"``).
    """
