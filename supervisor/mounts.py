"""The filesystem holding the run root: its type, the watch mode it needs, and whether it answers.

Reads ``/proc/self/mountinfo`` and asks the run root for ``statvfs``; it never writes.
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from supervisor.config import WatchMode
from supervisor.filethread import FileThread

ResolvedMode = Literal["inotify", "poll"]

#: Filesystems whose files other machines (or another kernel) write: inotify only reports
#: writes made through this kernel's VFS, so it never sees the workers' heartbeats there.
POLL_FSTYPES: Final = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "ceph",
        "beegfs",
        "fuse",
        "9p",
        "virtiofs",
        "afs",
        "gfs2",
        "ocfs2",
    }
)

# The thread a freeze diagnosis asks statvfs in, as ``top -H`` names it.
_CHECK_THREAD_NAME: Final = "rs-fscheck"


# --------------------------------------------------------------------------------------
# Filesystem type and watch mode. Blocking (realpath walks the path): callers run these off
# the event loop.


def filesystem_type(path: Path, mountinfo: str | None = None) -> str:
    """The type of the filesystem holding ``path`` (``"nfs4"``, ``"ext4"``...); ``""`` if unknown.

    The mount is the longest mount point of ``/proc/self/mountinfo`` (or ``mountinfo``)
    that contains the real path; of equal mount points the last one listed is on top.
    """
    if mountinfo is None:
        try:
            mountinfo = os.fsdecode(Path("/proc/self/mountinfo").read_bytes())
        except OSError:
            return ""
    target = os.path.realpath(path)
    best_len = -1
    best = ""
    for line in mountinfo.splitlines():
        # "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw": the optional
        # fields end at a lone "-", then come fstype, source and super options.
        fields = line.split(" ")
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if sep + 1 >= len(fields):
            continue
        mount_point = _unescape(fields[4])
        if _contains(mount_point, target) and len(mount_point) >= best_len:
            best_len = len(mount_point)
            best = _unescape(fields[sep + 1])
    return best


def choose_mode(path: Path, configured: WatchMode, mountinfo: str | None = None) -> ResolvedMode:
    """``configured``, or for ``"auto"``: poll where inotify cannot see other writers."""
    if configured != "auto":
        return configured
    return "poll" if needs_polling(filesystem_type(path, mountinfo)) else "inotify"


def needs_polling(fstype: str) -> bool:
    """Whether inotify misses other writers on ``fstype``; an unknown type plays safe."""
    return not fstype or fstype in POLL_FSTYPES or fstype.startswith("fuse.")


_OCTAL_ESCAPE: Final = re.compile(rb"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as \040, \011, \012, \134;
    # undo it on bytes so non-ASCII names survive.
    raw = _OCTAL_ESCAPE.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), os.fsencode(field))
    return os.fsdecode(raw)


def _contains(mount_point: str, path: str) -> bool:
    if mount_point == "/":
        return path.startswith("/")
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


# --------------------------------------------------------------------------------------
# Whether the run root answers.


# Below this much free space a worker cannot rewrite even its heartbeat reliably.
_NEARLY_FULL_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class FilesystemCheck:
    """What the run root's filesystem said when asked, to explain a fleet-wide silence."""

    answered: bool
    free_bytes: int | None = None
    free_inodes: int | None = None
    error: str | None = None

    @property
    def finding(self) -> str:
        """One line for the operator: the likely cause, or what was ruled out."""
        if not self.answered:
            return "the run root did not answer statvfs: this node's mount looks hung"
        if self.error is not None:
            return f"the run root cannot be examined: {self.error}"
        if self.free_bytes is not None and self.free_bytes < _NEARLY_FULL_BYTES:
            return f"the run filesystem is full ({self.free_bytes} bytes free)"
        if self.free_inodes == 0:
            return "the run filesystem has no free inodes"
        return (
            f"the run root answers and has {self.free_bytes} bytes free: suspect the workers'"
            " side (their mounts, the network)"
        )


async def check_filesystem(path: Path, timeout_s: float) -> FilesystemCheck:
    """statvfs of ``path`` in a thread of its own, abandoned after ``timeout_s``: the question
    is asked when the filesystem may be hung, and the answer must never hang us."""
    thread = FileThread(path, name=_CHECK_THREAD_NAME)
    try:
        async with asyncio.timeout(timeout_s):
            st = await thread.call(os.statvfs)
    except TimeoutError:
        return FilesystemCheck(answered=False)
    except OSError as exc:
        return FilesystemCheck(answered=True, error=exc.strerror or str(exc))
    finally:
        thread.close()
    return FilesystemCheck(
        answered=True, free_bytes=st.f_bavail * st.f_frsize, free_inodes=st.f_favail
    )
