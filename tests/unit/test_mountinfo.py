"""Which filesystem holds the run root, and whether watching it needs polling."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.mounts import choose_mode, filesystem_type, needs_polling

# A synthetic /proc/self/mountinfo (format: proc(5)): optional fields such as
# "shared:1" sit before the lone "-"; spaces in mount points are written \040.
MOUNTINFO = "\n".join(
    [
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        "23 22 0:21 / /proc rw,nosuid - proc proc rw",
        "30 22 0:40 / /shared rw,relatime shared:5 - nfs4 fs1:/export rw,vers=4.2",
        "31 30 0:41 / /shared/scratch rw - tmpfs tmpfs rw",
        "32 22 0:42 / /mnt/cifs rw - cifs //srv/share rw",
        "33 22 0:43 / /lustre rw master:3 - lustre 10.0.0.1@tcp:/fs rw",
        "34 22 0:44 / /home/user/remote rw,nosuid - fuse.sshfs user@host:/data rw",
        r"35 22 0:45 / /mnt/with\040space rw - nfs srv:/x rw",
        "36 22 0:46 / /mnt/ab rw - xfs /dev/sdb rw",
        "37 22 0:47 / /over rw - ext4 /dev/sdc rw",
        "38 37 0:48 / /over rw - gpfs gpfs0 rw",
        "this line is garbage",
        "39 22 0:49 / /broken rw shared:9",
        "",
    ]
)


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/", "ext4"),
        ("/etc/passwd", "ext4"),
        ("/shared", "nfs4"),
        ("/shared/reward/gsm8k/run-1", "nfs4"),
        ("/shared/scratch/x", "tmpfs"),
        ("/sharedx/y", "ext4"),
        ("/mnt/cifs/run", "cifs"),
        ("/lustre/project/run", "lustre"),
        ("/home/user/remote/run", "fuse.sshfs"),
        ("/mnt/with space/run", "nfs"),
        ("/mnt/a", "ext4"),
        ("/mnt/ab/run", "xfs"),
        ("/over/run", "gpfs"),
        ("/broken/run", "ext4"),
    ],
)
def test_filesystem_type_is_that_of_the_longest_containing_mount(path: str, fstype: str) -> None:
    """The mount is the longest whole-component prefix; later entries shadow earlier ones."""
    assert filesystem_type(Path(path), MOUNTINFO) == fstype


def test_filesystem_type_follows_symlinks_to_the_real_mount(tmp_path: Path) -> None:
    """A run root reached through a symlink is judged by where the link leads."""
    link = tmp_path / "run-link"
    link.symlink_to("/shared/reward")
    assert filesystem_type(link / "status", MOUNTINFO) == "nfs4"


def test_filesystem_type_decodes_escaped_non_ascii_mount_points() -> None:
    """Octal escapes are undone on bytes, so UTF-8 mount point names match."""
    escaped = "".join(f"\\{b:03o}" for b in "données".encode())
    info = f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:50 / /{escaped} rw - cifs //s/x rw\n"
    assert filesystem_type(Path("/données/run"), info) == "cifs"


def test_filesystem_type_is_empty_when_nothing_matches() -> None:
    """With no usable mount table the type is unknown: the empty string."""
    assert filesystem_type(Path("/anything"), "") == ""


def test_real_mount_table_knows_the_root_filesystem() -> None:
    """Without a synthetic table, /proc/self/mountinfo is read and names a type for /."""
    assert filesystem_type(Path(os.sep)) != ""


@pytest.mark.parametrize(
    "path",
    ["/shared/run", "/mnt/cifs/run", "/lustre/run", "/home/user/remote/run", "/over/run"],
)
def test_auto_mode_polls_network_and_fuse_filesystems(path: str) -> None:
    """nfs4, cifs, lustre, fuse.sshfs and gpfs deliver no inotify events for remote writers."""
    assert choose_mode(Path(path), "auto", MOUNTINFO) == "poll"


@pytest.mark.parametrize("path", ["/var/run", "/shared/scratch/run", "/mnt/ab/run"])
def test_auto_mode_uses_inotify_on_local_filesystems(path: str) -> None:
    """ext4, tmpfs and xfs are local: inotify sees every writer."""
    assert choose_mode(Path(path), "auto", MOUNTINFO) == "inotify"


def test_an_explicit_mode_wins_over_the_filesystem() -> None:
    """A configured mode is used as is, whatever the mount table says."""
    assert choose_mode(Path("/shared/run"), "inotify", MOUNTINFO) == "inotify"
    assert choose_mode(Path("/var/run"), "poll", MOUNTINFO) == "poll"


def test_auto_mode_polls_when_the_filesystem_is_unknown() -> None:
    """Polling works everywhere; inotify silently does not: an unknown type polls."""
    assert choose_mode(Path("/run"), "auto", "") == "poll"


@pytest.mark.parametrize(
    ("fstype", "poll"),
    [
        ("nfs", True),
        ("smb3", True),
        ("smbfs", True),
        ("ceph", True),
        ("beegfs", True),
        ("fuse", True),
        ("fuse.glusterfs", True),
        ("9p", True),
        ("ext4", False),
        ("btrfs", False),
        ("overlay", False),
        ("fuseblk", False),
    ],
)
def test_needs_polling_by_type(fstype: str, poll: bool) -> None:
    """Shared and FUSE filesystems poll; local block filesystems and overlays do not."""
    assert needs_polling(fstype) is poll
