"""Reading status files and exit records as another user: permission problems are reasons."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.statusfiles import StatusProblem, StatusRecord, read_exit, read_status


def test_unreadable_files_are_problems_for_a_non_root_reader() -> None:
    """Read as user nobody, a 0600 root file is "unreadable: EACCES" and its exit record None."""
    if os.geteuid() != 0:
        pytest.skip("dropping to user nobody needs root (CI runs as root)")
    nobody = pwd.getpwnam("nobody")
    scratch = Path(tempfile.mkdtemp(prefix="statusfiles-"))
    try:
        scratch.chmod(0o755)
        secret = scratch / "h1.json"
        secret.write_bytes(b'{"pid": 1, "heartbeat_at": 1}')
        secret.chmod(0o600)
        public = scratch / "h2.json"
        public.write_bytes(b'{"pid": 2, "heartbeat_at": 2}')
        public.chmod(0o644)
        out = _as_user(
            nobody,
            lambda: f"{read_status(secret)!r}|{read_exit(secret)!r}|{read_status(public)!r}",
        )
    finally:
        shutil.rmtree(scratch)
    assert out == "|".join(
        [
            repr(StatusProblem("unreadable: EACCES")),
            "None",
            repr(StatusRecord(pid=2, ready=False, heartbeat_at=2.0, seq=None)),
        ]
    )


def _as_user(user: pwd.struct_passwd, fn: Callable[[], str]) -> str:
    """``fn()`` evaluated in a forked child that dropped to ``user``; its text."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, answer, never return into pytest
        code = 1
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.write(write_fd, fn().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        out = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return out
