"""A control socket that answers each command with a canned reply, served by a thread: what the
CLI's tests talk to when the daemon's side is not what they are about."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

#: How often the serving thread looks whether it should stop (an accept's timeout).
POLL_S = 0.05

Reply = Mapping[str, Any] | Callable[[Mapping[str, Any]], Mapping[str, Any]]


class CannedDaemon:
    """Answers ``{"cmd": C, ...}`` with ``replies[C]`` (a reply, or a function of the
    request), or with an ``unknown_command`` refusal; records every request."""

    def __init__(self, replies: Mapping[str, Reply]) -> None:
        # A short directory of its own: a unix socket's path is limited to 107 bytes.
        self._dir = Path(tempfile.mkdtemp(prefix="canned-", dir="/tmp"))
        self.path = self._dir / "control.sock"
        self.requests: list[dict[str, Any]] = []
        self._replies = dict(replies)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="canned-daemon", daemon=True)

    def __enter__(self) -> Self:
        self._sock.bind(str(self.path))
        self._sock.listen(16)
        self._sock.settimeout(POLL_S)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        """Accept and answer one request a connection until told to stop."""
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(10)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        """Read one request line and send its canned reply."""
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        request = json.loads(data)
        self.requests.append(request)
        found = self._replies.get(request.get("cmd"))
        if found is None:
            reply: Mapping[str, Any] = {
                "ok": False,
                "code": "unknown_command",
                "error": f"no canned reply for {request.get('cmd')!r}",
            }
        else:
            reply = found(request) if callable(found) else found
        conn.sendall(json.dumps(reply).encode() + b"\n")


def config_with_socket(directory: Path, socket_path: Path) -> Path:
    """The shipped example config (hosts worker-0 and worker-1) with its run root under
    ``directory`` and its control socket at ``socket_path``, written to ``directory``."""
    example = Path(__file__).resolve().parents[1] / "systemd" / "example.toml"
    text = example.read_text(encoding="utf-8")
    for old, new in (
        ('"/run/reward-supervisor/gsm8k.sock"', json.dumps(str(socket_path))),
        ('"/shared/reward/gsm8k/trial-3/run-1"', json.dumps(str(directory / "run"))),
        ('"/shared/reward"', json.dumps(str(directory))),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = directory / "rs.toml"
    path.write_text(text, encoding="utf-8")
    os.chmod(path, 0o600)
    return path
