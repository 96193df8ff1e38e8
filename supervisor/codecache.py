"""The agent's compiled code, kept on the host between its starts.

Sent as plain text at the head of the program every host runs (``remote.packed_program``),
before anything is decompressed, so it is small and stdlib-only, and runs on every Python a
host may have (3.7 and later). Compiling the agent's ~110 KB of source was half of each of
its starts (~20 of ~44 ms of CPU; docs/BENCHMARKS.md); loading the code compiled by an earlier
start takes under a millisecond. A host compiles once per version of the program and Python
build, as Python itself keeps ``__pycache__``.

The cache is the user's own (``~/.cache/reward-supervisor``, mode 0700): a file is used only
if it is a regular file, not reached through a symlink, owned by the user and writable by no
one else, in such a directory, no larger than ``CACHE_MAX``, and its header names this very
program and Python build and its checksum matches; anything else, or any error, and the
program is compiled as if there were no cache. Whoever can write there can already run code
as the user (their ``~/.bashrc``). Writes are atomic (a unique temporary name, then rename),
so starts racing each other each read a whole file or none.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import stat
import sys
import zlib
from types import CodeType

#: A cache file larger than this is not read (the agent's code is ~150 KB).
CACHE_MAX = 4 << 20
#: A cache file not used for this long is removed when another is written (one per version
#: of the program and Python build: a host would otherwise keep one per upgrade).
STALE_S = 7 * 86400
_MAGIC = b"reward-supervisor code 1\n"


def cache_dir() -> str | None:
    """``~/.cache/reward-supervisor`` of the user we run as; None where the home directory
    is not one (unset or relative, ``/``, missing, or not ours): no cache is kept there."""
    home = os.path.expanduser("~")
    if not os.path.isabs(home) or os.path.dirname(home) == home:
        return None
    try:
        if not _private(os.stat(home)):
            return None
    except OSError:
        return None
    return os.path.join(home, ".cache", "reward-supervisor")


def cache_name(key: str) -> str:
    """The file of program ``key`` for this Python build (its version string's checksum too:
    hosts sharing an NFS home with two builds of one version must not take turns at it)."""
    build = zlib.crc32(sys.version.encode("utf-8", "replace"))
    return f"code-{key}-{sys.implementation.cache_tag}-{build:08x}.bin"


def _header(key: str) -> bytes:
    return _MAGIC + key.encode("ascii") + b"\n" + sys.version.encode("utf-8", "replace") + b"\n"


def _private(st: os.stat_result) -> bool:
    """Ours, and writable by no one else."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def load(key: str, count: int) -> list[CodeType] | None:
    """The ``count`` code objects cached for program ``key``, or None."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or not _private(st):
            return None
        fd = os.open(
            os.path.join(directory, cache_name(key)), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        )
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not _private(st) or st.st_size > CACHE_MAX:
                return None
            chunks = []
            size = 0
            while size <= st.st_size:
                chunk = os.read(fd, st.st_size + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
    data = b"".join(chunks)
    header = _header(key)
    if not data.startswith(header) or len(data) < len(header) + 4:
        return None
    body = data[len(header) + 4 :]
    if zlib.crc32(body).to_bytes(4, "big") != data[len(header) : len(header) + 4]:
        return None
    try:
        # Our own file, in a directory only we can write, checksummed: see the module's doc.
        codes = marshal.loads(body)  # noqa: S302
    except (EOFError, ValueError, TypeError):
        return None
    if type(codes) is not tuple or len(codes) != count:
        return None
    if not all(type(code) is CodeType for code in codes):
        return None
    return list(codes)


def store(key: str, codes: list[CodeType]) -> None:
    """Keep ``codes`` for program ``key``; silently nothing where that cannot be done."""
    directory = cache_dir()
    if directory is None:
        return
    temporary = None
    try:
        for path in (os.path.dirname(directory), directory):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or not _private(st):
            return
        body = marshal.dumps(tuple(codes))
        data = _header(key) + zlib.crc32(body).to_bytes(4, "big") + body
        name = cache_name(key)
        temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
        fd = os.open(
            temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temporary, os.path.join(directory, name))
        temporary = None
        _prune(directory, name)
    except (OSError, ValueError):
        pass
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def _prune(directory: str, keep: str) -> None:
    """Remove the cache files of other programs or builds unused for ``STALE_S``."""
    import time  # here: only a start that compiled gets this far

    now = time.time()
    for name in os.listdir(directory):
        if name == keep or not name.startswith("code-") or not name.endswith(".bin"):
            continue
        path = os.path.join(directory, name)
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and now - st.st_atime > STALE_S and now - st.st_mtime > STALE_S:
            os.unlink(path)


def codes(key: str, packed: str, names: tuple[str, ...]) -> list[CodeType]:
    """The code of each text of program ``key`` (the modules ``names``, then the program):
    from the cache, or decompressed from ``packed`` (zlib, base64), compiled and cached."""
    found = load(key, len(names) + 1)
    if found is not None:
        return found
    import binascii

    texts = zlib.decompress(binascii.a2b_base64(packed)).split(b"\0")
    labels = [f"<reward-supervisor {name}>" for name in names] + ["<reward-supervisor agent>"]
    # zip(strict=) came in 3.10; hosts may run 3.7. As many labels as texts, by construction.
    pairs = zip(texts, labels)  # noqa: B905
    compiled = [compile(text, label, "exec", dont_inherit=True) for text, label in pairs]
    store(key, compiled)
    return compiled
