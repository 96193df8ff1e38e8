"""Files under a shared run root, opened as hostile: whoever can write the root may plant a
symlink, a FIFO, a hard link or a device under any name there, or swap a directory mid-way.

The one implementation for both sides: the daemon's ``runfiles.py`` and every host's
``agent.py``, with which this text is sent (``remote.packed_program``), so it is stdlib-only
and runs on Python >= 3.7. Below the root nothing is followed and no open blocks on a FIFO,
reads are capped, files are created exclusively under random names. The root comes from the
operator's config and is trusted; ``root=None`` means a file whose directory is trusted,
which is still never followed itself.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Final, TypeAlias

    StrPath: TypeAlias = str | os.PathLike[str]

# O_NOFOLLOW: a symlink planted under the name is refused (ELOOP), never followed.
# O_NONBLOCK: opening a FIFO for reading returns at once (and for writing fails with ENXIO)
# instead of waiting for a peer that never comes; fstat then refuses it.
FILE_FLAGS: Final = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: A directory below the root: opened as a file is, and only if it is a directory.
DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | FILE_FLAGS
#: The root itself (or a trusted directory) may be reached through a symlink.
_TRUSTED_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: A pidfile or the epoch file holds one number and a newline.
NUMBER_MAX_BYTES: Final = 64
#: pid_t is a signed 32-bit number; nothing above it (nor 0: ``kill(0)`` is our own group).
_PID_LIMIT: Final = 1 << 31
#: The leadership epoch (``ctl/supervisor.epoch``): far beyond any count of takeovers, and
#: bounded so that a planted number stays a small int.
EPOCH_MAX: Final = 2**53
# Temp names: a random part too long to guess, and the name clipped so the whole fits NAME_MAX.
_TEMP_NAME_MAX: Final = 200
_TEMP_ATTEMPTS: Final = 10
#: Until its mode is set on the descriptor, a temp file is its writer's alone.
_TEMP_MODE: Final = 0o600


class UnsafeFile(OSError):
    """A file or directory under the run root that is not what it must be (a symbolic link,
    a FIFO, a device, a hard link, a swapped directory): refused, never followed.

    An ``OSError``, so every caller that already survives a bad file survives this one; the
    message names the file, ``reason`` is the short why (``"a symbolic link"``).
    """

    def __init__(self, path: StrPath, reason: str, detail: str = "") -> None:
        self.path = os.fspath(path)
        self.reason = reason
        self.detail = detail
        super().__init__(f"{self.path}: {reason}{f' ({detail})' if detail else ''}")


# --------------------------------------------------------------------------------------
# Opening, without following.


def open_dir(root: StrPath, parts: Sequence[str] = (), *, create: bool = False) -> int:
    """A descriptor of ``root/parts...``: ``root`` as given, each part below it opened
    without following a symlink (and made first, when ``create``). Raises UnsafeFile naming
    a part that is not a directory, FileNotFoundError for a missing one."""
    path = os.fspath(root)
    if create:
        os.makedirs(path, exist_ok=True)
    fd = os.open(path, _TRUSTED_DIR_FLAGS)
    try:
        for part in parts:
            path = os.path.join(path, part)
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            sub = open_subdir(fd, part, path)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_subdir(dir_fd: int, name: str, path: StrPath) -> int:
    """The directory ``name`` in ``dir_fd``, not through a symlink. Raises UnsafeFile (not a
    directory) or OSError, naming ``path``."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except NotADirectoryError:
        raise UnsafeFile(path, "not a directory", kind_at(dir_fd, name)) from None
    except OSError as exc:
        raise named(exc, path) from None


def open_parent(path: StrPath, root: StrPath | None, *, create: bool = False) -> tuple[int, str]:
    """The directory holding ``path``, opened as ``open_dir`` opens it below ``root`` (made
    first, when ``create``), and the last component's name. Without ``root`` the directory is
    trusted. Raises ValueError for a path that is not below ``root``, or goes up (``..``)."""
    text = os.fspath(path)
    parent, name = os.path.split(text)
    if root is None:
        if create and parent:
            os.makedirs(parent, exist_ok=True)
        return os.open(parent or ".", _TRUSTED_DIR_FLAGS), name
    top = os.fspath(root).rstrip("/")
    if parent != top and not parent.startswith(top + "/"):
        raise ValueError(f"{text} is not a file under {os.fspath(root)}")
    parts = [part for part in parent[len(top) :].split("/") if part and part != "."]
    if ".." in parts:
        raise ValueError(f"{text} goes up out of a directory below {os.fspath(root)}")
    return open_dir(root, parts, create=create), name


def open_at(
    dir_fd: int | None,
    name: StrPath,
    flags: int,
    *,
    path: StrPath,
    mode: int = 0o644,
    single_link: bool = False,
) -> int:
    """Open the regular file ``name`` (in ``dir_fd``; a path when None) without following or
    blocking; ``single_link`` refuses a file hard-linked elsewhere (it is about to be written
    in place, and its other name may be any file of the same owner, anywhere on the
    filesystem). Raises UnsafeFile or OSError naming ``path``."""
    try:
        fd = os.open(name, flags | FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(path, "a symbolic link", "not followed") from None
        if exc.errno == errno.ENXIO:  # opened for writing: a FIFO or socket with no reader
            raise UnsafeFile(path, "not a regular file", "a FIFO or socket") from None
        raise named(exc, path) from None
    try:
        _check_regular(os.fstat(fd), path, single_link)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(st: os.stat_result, path: StrPath, single_link: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(path, "not a regular file", kind(st.st_mode))
    if single_link and st.st_nlink > 1:
        raise UnsafeFile(path, "hard-linked", f"{st.st_nlink} links")


def open_file(
    path: StrPath, flags: int, root: StrPath | None = None, *, single_link: bool = False
) -> int:
    """``open_at`` of ``path``, its directories below ``root`` opened as ``open_parent`` opens
    them (and made first when ``flags`` has O_CREAT). Without ``root`` it is one open, as
    cheap as a plain one: the file itself is checked, its directory trusted."""
    create = bool(flags & os.O_CREAT)
    if root is None:
        parent = os.path.dirname(os.fspath(path))
        if create and parent:
            os.makedirs(parent, exist_ok=True)
        return open_at(None, path, flags, path=path, single_link=single_link)
    dir_fd, name = open_parent(path, root, create=create)
    try:
        return open_at(dir_fd, name, flags, path=path, single_link=single_link)
    finally:
        os.close(dir_fd)


def named(exc: OSError, path: StrPath) -> OSError:
    """``exc`` again, naming the whole path: relative to a directory descriptor an error
    names only the last component (and a rename, two of them)."""
    if exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, os.fspath(path))


def kind(mode: int) -> str:
    """What a file of ``mode`` is, for messages."""
    for test, what in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return what
    return "of unknown type"


def kind_at(dir_fd: int, name: str) -> str:
    """What ``name`` in ``dir_fd`` is, not following a symlink."""
    try:
        return kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return "vanished"


# --------------------------------------------------------------------------------------
# Reading and writing.


def read_capped(path: StrPath, max_bytes: int, root: StrPath | None = None) -> bytes:
    """At most ``max_bytes + 1`` bytes of the regular file ``path`` (one past the cap, so the
    caller can tell a file too big), opened as ``open_file`` opens it. Raises
    FileNotFoundError, UnsafeFile or OSError."""
    return read_fd(open_file(path, os.O_RDONLY, root), max_bytes)


def read_fd(fd: int, max_bytes: int) -> bytes:
    """At most ``max_bytes + 1`` bytes of ``fd``, which is closed."""
    try:
        chunks = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path: StrPath, max_bytes: int, root: StrPath | None = None) -> Any:
    """Parse a JSON file of at most ``max_bytes``, read as ``read_capped`` does; raises
    OSError or ValueError (too big, not UTF-8, not JSON, nested too deep), each naming it."""
    return parse_json(read_capped(path, max_bytes, root), max_bytes, path)


def parse_json(data: bytes, max_bytes: int, path: StrPath) -> Any:
    """Parse what ``read_capped`` read of ``path``; raises ValueError naming it."""
    if len(data) > max_bytes:
        raise ValueError(f"{os.fspath(path)} is larger than {max_bytes} bytes")
    try:
        # Decoded first: json.loads would take bytes in UTF-16 or UTF-32 as well.
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{os.fspath(path)} is nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"{os.fspath(path)}: {exc}") from None


def read_number(path: StrPath, max_digits: int, root: StrPath | None = None) -> int | None:
    """The number a small file holds (a pidfile, the epoch): at most ``max_digits`` decimal
    digits and whitespace around them; None when it holds anything else or is larger than
    NUMBER_MAX_BYTES. Raises OSError (FileNotFoundError when it is missing, UnsafeFile)."""
    data = read_capped(path, NUMBER_MAX_BYTES, root)
    text = data.strip()
    # bytes.isdigit is ASCII only: no "²", no other script's digits, no sign, no spaces.
    if len(data) > NUMBER_MAX_BYTES or not text.isdigit() or len(text) > max_digits:
        return None
    return int(text)


def read_pid(path: StrPath, root: StrPath | None = None) -> int | None:
    """The pid in a pidfile; None when it is missing, unsafe, unreadable, too big or not a
    number from 1 to 2**31 - 1."""
    try:
        pid = read_number(path, 10, root)
    except OSError:
        return None
    return pid if pid is not None and 0 < pid < _PID_LIMIT else None


def read_epoch(path: StrPath, root: StrPath | None = None) -> int | None:
    """The leadership epoch in ``ctl/supervisor.epoch``: 0 when there is none yet, None when
    the file is there but unsafe, unreadable, or not a number up to EPOCH_MAX."""
    try:
        epoch = read_number(path, len(str(EPOCH_MAX)), root)
    except FileNotFoundError:
        return 0
    except OSError:
        return None
    return epoch if epoch is not None and epoch <= EPOCH_MAX else None


def write_atomic(
    path: StrPath, data: bytes, root: StrPath | None = None, *, mode: int = 0o644
) -> None:
    """Replace ``path`` with ``data`` so readers (on any host) see the old file or the new
    one, whole; its directory is opened as ``open_parent`` opens it. See ``write_atomic_at``."""
    dir_fd, name = open_parent(path, root)
    try:
        write_atomic_at(dir_fd, name, data, path=path, mode=mode)
    finally:
        os.close(dir_fd)


def write_atomic_at(dir_fd: int, name: str, data: bytes, *, path: StrPath, mode: int) -> None:
    """Replace ``name`` in ``dir_fd`` with ``data``; errors name ``path``.

    The temp file is made exclusively under a random name in the directory descriptor the
    rename uses, so neither a planted name nor a swapped directory can redirect it; it is
    private until written, and its mode is set on the descriptor (neither the 0600 it was
    made with nor the umask decides who reads it). Whatever was at ``name`` (a symlink, a
    FIFO) is replaced, never followed.
    """
    tmp, fd = _create_temp(dir_fd, name, path)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            raise named(exc, path) from None
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk must not also leave litter behind
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _create_temp(dir_fd: int, name: str, path: StrPath) -> tuple[str, int]:
    """A new temp file beside ``name``: its name and a descriptor open for writing. Raises
    FileExistsError when no free name turns up (somebody plants every one we draw)."""
    for _ in range(_TEMP_ATTEMPTS):
        # 64 random bits (secrets.token_hex, without importing it on every host's start).
        tmp = f".{name[:_TEMP_NAME_MAX]}.{os.urandom(8).hex()}.tmp"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS
            return tmp, os.open(tmp, flags, _TEMP_MODE, dir_fd=dir_fd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise named(exc, os.path.join(os.path.dirname(os.fspath(path)), tmp)) from None
    raise FileExistsError(errno.EEXIST, "no free temp name", os.fspath(path))
