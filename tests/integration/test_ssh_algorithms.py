"""SSH algorithms: nothing SHA-1 is offered by default, against a real OpenSSH that offers only
SHA-1; the ``[ssh]`` lists override the defaults."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import parse
from supervisor.remote import RemoteHost, connect_options
from supervisor.sshalgs import DEFAULT_ALGS, ENCRYPTION_ALGS, is_weak_algorithm
from tests.sshd import OpenSsh

pytestmark = pytest.mark.openssh

WAIT_S = 30.0

#: One sshd per case, offering only a SHA-1 choice where it matters (and the config that
#: accepts it). A MAC is only used with a cipher that has none of its own, hence aes128-ctr.
CASES: dict[str, tuple[str, list[str], dict[str, list[str]]]] = {
    "kex": (
        "ed25519",
        ["KexAlgorithms diffie-hellman-group14-sha1"],
        {"kex_algs": ["curve25519-sha256", "diffie-hellman-group14-sha1"]},
    ),
    "mac": (
        "ed25519",
        ["Ciphers aes128-ctr", "MACs hmac-sha1"],
        {"mac_algs": ["hmac-sha2-256-etm@openssh.com", "hmac-sha1"]},
    ),
    "host_key": (
        "rsa",
        ["HostKeyAlgorithms ssh-rsa"],
        {"server_host_key_algs": ["rsa-sha2-512", "ssh-rsa"]},
    ),
}


def test_defaults_offer_nothing_sha1_and_keep_aes_gcm_first() -> None:
    """No default list names ssh-rsa, diffie-hellman-group14-sha1 or hmac-sha1 (or any other
    SHA-1 algorithm); AES-GCM stays first; host keys drop the SHA-1 ones from asyncssh's
    per-host choice."""
    offered = [name for names in DEFAULT_ALGS.values() for name in names]
    assert not [name for name in offered if is_weak_algorithm(name)]
    for weak in (
        "ssh-rsa",
        "diffie-hellman-group14-sha1",
        "hmac-sha1",
        "hmac-sha1-etm@openssh.com",
    ):
        assert weak not in offered
        assert is_weak_algorithm(weak)
    assert "curve25519-sha256" in DEFAULT_ALGS["kex_algs"]
    assert "hmac-sha2-256-etm@openssh.com" in DEFAULT_ALGS["mac_algs"]
    assert "rsa-sha2-512" in DEFAULT_ALGS["signature_algs"]
    assert DEFAULT_ALGS["encryption_algs"] == ENCRYPTION_ALGS
    assert ENCRYPTION_ALGS[:2] == ("aes256-gcm@openssh.com", "aes128-gcm@openssh.com")


def test_connect_options_use_the_config_lists_when_given(openssh: OpenSsh, tmp_path: Path) -> None:
    """A configured list replaces its default whole, in the given order; the rest stay."""
    config = openssh.config(tmp_path / "run", 1, ssh={"mac_algs": ["hmac-sha1"]})
    options = connect_options(config.hosts[0], config.ssh)
    assert options["mac_algs"] == ["hmac-sha1"]
    assert options["kex_algs"] == list(DEFAULT_ALGS["kex_algs"])
    host_keys = options["server_host_key_algs"]
    assert isinstance(host_keys, str) and host_keys.startswith("-")
    assert "ssh-rsa" in host_keys.removeprefix("-").split(",")


@pytest.fixture(params=sorted(CASES))
def sha1_only(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, OpenSsh]]:
    """An OpenSSH on 127.0.0.1 that offers only SHA-1 in one respect."""
    case: str = request.param
    key_type, lines, _ = CASES[case]
    server = OpenSsh.create(
        tmp_path / f"sshd-{case}", ("127.0.0.1",), host_key_type=key_type, extra_config=lines
    )
    try:
        yield case, server
    finally:
        server.stop()


async def first_outcome(server: OpenSsh, root: Path, ssh: dict[str, Any]) -> tuple[bool, str]:
    """Connect once with ``ssh`` overrides: up or down, and the reason given."""
    config = parse(server.config_dict(root, 1, ssh=ssh), root.parent / "rs.toml")
    outcome: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()

    def on_connection(up: bool, reason: str) -> None:
        """Keep the first transition."""
        if not outcome.done():
            outcome.set_result((up, reason))

    remote = RemoteHost(
        config.hosts[0],
        config.ssh,
        python=config.worker.python,
        handshakes=asyncio.Semaphore(1),
        on_connection=on_connection,
    )
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(remote.maintain())
        try:
            async with asyncio.timeout(WAIT_S):
                return await outcome
        finally:
            await remote.aclose()


# Finite-field Diffie-Hellman (the SHA-1 group14 case) makes `cryptography` warn.
@pytest.mark.filterwarnings("ignore:Diffie-Hellman over finite fields")
async def test_a_server_offering_only_sha1_is_refused_unless_configured(
    sha1_only: tuple[str, OpenSsh], tmp_path: Path
) -> None:
    """Against an OpenSSH offering only a SHA-1 key exchange, MAC or host key signature, the
    defaults refuse to connect and say which negotiation failed; listing that algorithm in
    the config's ``[ssh]`` list connects."""
    case, server = sha1_only
    up, reason = await first_outcome(server, tmp_path / "run", {})
    assert not up
    # Whichever side sees the empty intersection first says so: we in the reason, or sshd in
    # its log, with our offer (which must not hold the SHA-1 algorithm).
    offers = re.findall(r"Unable to negotiate .*Their offer: (\S+)", server.log_tail(20000))
    assert "no matching" in reason.lower() or offers, (reason, server.log_tail())
    weak = CASES[case][2]
    assert all(name not in offer.split(",") for offer in offers for name in _weak(weak))
    up, reason = await first_outcome(server, tmp_path / "run", weak)
    assert up, reason


def _weak(lists: dict[str, list[str]]) -> list[str]:
    """The SHA-1 algorithms named in ``lists``."""
    return [name for names in lists.values() for name in names if is_weak_algorithm(name)]
