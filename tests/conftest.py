"""Fixtures shared by every test tier.

``openssh``: one real OpenSSH ``sshd`` for the whole session (see ``tests/sshd.py``), listening
on 127.0.0.1, 127.0.0.2 and 127.0.0.3 at one port, with generated keys. Build a config for a
run directory with ``openssh.config(root, hosts=N, ...)``; take the server down with
``openssh.stop()`` and back with ``openssh.start()`` (a test that stops it must start it again,
in a ``finally``); drop established connections with ``openssh.kill_sessions(address)``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sshd import OpenSsh


@pytest.fixture(scope="session")
def openssh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenSsh]:
    """A running OpenSSH server on loopback aliases, stopped at the end of the session."""
    server = OpenSsh.create(tmp_path_factory.mktemp("openssh"))
    try:
        yield server
    finally:
        server.stop()
