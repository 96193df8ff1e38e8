"""The SSH algorithms: what this asyncssh can negotiate for each ``[ssh]`` list, and what we
offer when a list is not set (asyncssh's own defaults without SHA-1). Asks asyncssh, never
connects: ``remote.py`` stays the only module that talks SSH through it.

Its own module so that ``config.py`` can check a configured list without importing
``remote.py`` (which imports ``config.py``), and only when a config sets one: importing
asyncssh costs more than reading a large config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import asyncssh

#: asyncssh's defaults, AES-GCM first: asyncssh drives chacha20-poly1305 with several Python
#: calls per packet (~20 us) where AES-GCM is one OpenSSL call (~3.5 us); at 1000 hosts the
#: keepalives alone made that ~1% of a core (docs/BENCHMARKS.md). Either is an OpenSSH
#: default; a server that offers no GCM still negotiates the rest of the list.
_GCM_FIRST: Final = ("aes256-gcm@openssh.com", "aes128-gcm@openssh.com")
ENCRYPTION_ALGS: Final = _GCM_FIRST + tuple(
    alg.decode("ascii")
    for alg in asyncssh.encryption.get_default_encryption_algs()
    if alg.decode("ascii") not in _GCM_FIRST
)
#: Signature algorithms that hash with SHA-1: RSA's ``ssh-rsa`` (off by default since OpenSSH
#: 8.8: chosen-prefix collisions on SHA-1 are practical), its certificate form, and DSA.
_SHA1_SIGNATURES: Final = frozenset(
    {
        "ssh-rsa",
        "ssh-rsa-cert-v01@openssh.com",
        "ssh-dss",
        "ssh-dss-cert-v01@openssh.com",
        "x509v3-ssh-rsa",
        "x509v3-ssh-dss",
    }
)


def is_weak_algorithm(name: str) -> bool:
    """Never offered by default: SHA-1 in a key exchange (``diffie-hellman-group14-sha1``),
    a MAC (``hmac-sha1``) or a signature (``ssh-rsa``); and GSS key exchange, never used."""
    return "sha1" in name or name in _SHA1_SIGNATURES or name.startswith("gss-")


def _modern(algs: Sequence[bytes]) -> tuple[str, ...]:
    names = (alg.decode("ascii") for alg in algs)
    return tuple(dict.fromkeys(name for name in names if not is_weak_algorithm(name)))


_HOST_KEY_ALGS: Final = (
    asyncssh.public_key.get_x509_certificate_algs()
    + asyncssh.public_key.get_certificate_algs()
    + asyncssh.public_key.get_public_key_algs()
)
#: The defaults of each ``[ssh]`` algorithm list: asyncssh's own, without the weak ones
#: (OpenSSH 9.x offers the same modern set). The host key algorithms asyncssh derives per
#: connection from the keys known_hosts holds for the host (an explicit list would ignore
#: that, and pick a key type known_hosts lacks); from those, the weak ones are removed.
DEFAULT_ALGS: Final[Mapping[str, tuple[str, ...]]] = {
    "kex_algs": _modern(asyncssh.kex.get_default_kex_algs()),
    "encryption_algs": ENCRYPTION_ALGS,
    "mac_algs": _modern(asyncssh.mac.get_default_mac_algs()),
    "signature_algs": _modern(
        asyncssh.public_key.get_public_key_algs()
        + asyncssh.public_key.get_default_public_key_algs()
    ),
}
#: What no host key list is allowed to offer by default: asyncssh takes a leading "-" as
#: "its per-host default without these" (OpenSSH's syntax).
WEAK_HOST_KEY_ALGS: Final = "-" + ",".join(
    name for name in (alg.decode("ascii") for alg in _HOST_KEY_ALGS) if is_weak_algorithm(name)
)
#: What this asyncssh can negotiate, per ``[ssh]`` list (config validation names the key).
SUPPORTED_ALGS: Final[Mapping[str, frozenset[str]]] = {
    key: frozenset(alg.decode("ascii") for alg in algs)
    for key, algs in (
        ("kex_algs", asyncssh.kex.get_kex_algs()),
        ("encryption_algs", asyncssh.encryption.get_encryption_algs()),
        ("mac_algs", asyncssh.mac.get_mac_algs()),
        ("signature_algs", asyncssh.public_key.get_public_key_algs()),
        ("server_host_key_algs", _HOST_KEY_ALGS),
    )
}
