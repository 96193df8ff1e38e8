"""``init`` with real files and real hosts: keys taken from a known_hosts file as OpenSSH
takes them, or read from the OpenSSH sshd on loopback and confirmed; nothing written over an
existing file, or before the keys are confirmed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from supervisor import config, starter
from supervisor.starter import Request, StarterProblem, Target
from tests import ports
from tests.sshd import OpenSsh

pytestmark = pytest.mark.openssh


def _request(tmp_path: Path, openssh: OpenSsh, **overrides: object) -> Request:
    """Two hosts of ``openssh``, the reference worker, keys from its known_hosts file."""
    values: dict[str, object] = {
        "hosts": tuple(
            Target(f"w{i}", address, openssh.port)
            for i, address in enumerate(openssh.addresses[:2])
        ),
        "root": tmp_path / "run",
        "output": tmp_path / "cfg" / "fleet.toml",
        "username": openssh.username,
        "client_keys": (openssh.client_key,),
        "known_hosts_from": openssh.known_hosts,
        "worker_module": "supervisor.demo.worker",
        "reward_fn": "supervisor.demo.worker.exact_match",
    }
    values.update(overrides)
    return Request(**values)  # type: ignore[arg-type]


def _run(request: Request, *, confirm: bool = True) -> tuple[list[str], list[str]]:
    """``starter.run``: what it said, and what it asked (answered ``confirm``)."""
    said: list[str] = []
    asked: list[str] = []

    def answer(question: str) -> bool:
        asked.append(question)
        return confirm

    starter.run(request, said.append, answer)
    return said, asked


def test_keys_from_a_known_hosts_file_are_written_in_openssh_s_form(
    openssh: OpenSsh, tmp_path: Path
) -> None:
    """Each host's key is taken from the file as OpenSSH takes it, the port 22 line of a
    host on another port included (OpenSSH falls back to it), and written as
    ``[address]:port``; the config names that file, passes check-config, and nothing is
    asked."""
    bare = tmp_path / "bare_known_hosts"
    key = " ".join(openssh.known_hosts.read_text().split()[1:3])
    bare.write_text("".join(f"{a} {key}\n" for a in openssh.addresses))
    request = _request(tmp_path, openssh, known_hosts_from=bare)
    said, asked = _run(request)
    assert asked == []
    lines = request.known_hosts.read_text().splitlines()[1:]
    assert lines == [f"[{a}]:{openssh.port} {key}" for a in openssh.addresses[:2]]
    assert config.load(request.output).ssh.known_hosts == request.known_hosts
    assert said[0].endswith(f"(2 host keys, from {bare})")
    assert said[1] == "check-config: no problems"


def test_a_host_the_file_has_no_key_for_is_named_with_the_line_it_needs(
    openssh: OpenSsh, tmp_path: Path
) -> None:
    """A host the known_hosts file has no key for (another port's line does not count) stops
    init before anything is written, naming the host and the line OpenSSH would need."""
    other = tmp_path / "other_port"
    key = " ".join(openssh.known_hosts.read_text().split()[1:3])
    other.write_text(f"[127.0.0.1]:2222 {key}\n[127.0.0.2]:{openssh.port} {key}\n")
    request = _request(tmp_path, openssh, known_hosts_from=other)
    with pytest.raises(
        StarterProblem, match=rf"no host key for w0 \('\[127.0.0.1\]:{openssh.port}'\)"
    ):
        _run(request)
    assert not request.output.parent.exists()


def test_without_a_known_hosts_file_init_says_to_scan(openssh: OpenSsh, tmp_path: Path) -> None:
    """No known_hosts file where one was expected (a user who never logged in with ssh):
    init says to pass --scan, and writes nothing."""
    request = _request(tmp_path, openssh, known_hosts_from=tmp_path / "none")
    with pytest.raises(StarterProblem, match=r"no .*/none: pass --scan"):
        _run(request)
    assert not request.output.parent.exists()


def test_scanned_keys_are_shown_with_the_host_s_fingerprint_and_written_once_confirmed(
    openssh: OpenSsh, tmp_path: Path
) -> None:
    """``--scan``: each host's key is shown with the fingerprint ``ssh-keygen -lf`` prints on
    the host; answered no, nothing is written; answered yes, the lines are written."""
    request = _request(tmp_path, openssh, known_hosts_from=None)
    with pytest.raises(StarterProblem, match="not confirmed: nothing written"):
        _run(request, confirm=False)
    assert not request.output.parent.exists()
    said, asked = _run(request)
    assert len(asked) == 1
    printed = subprocess.run(
        ["ssh-keygen", "-lf", f"{openssh.host_key}.pub"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    shown = [line.split() for line in said if line.startswith("  ")][:2]
    assert shown == [
        [f"w{i}", f"[{a}]:{openssh.port}", "ssh-ed25519", printed]
        for i, a in enumerate(openssh.addresses[:2])
    ]
    assert (
        request.known_hosts.read_text().splitlines()[1:]
        == openssh.known_hosts.read_text().splitlines()[:2]
    )


def test_a_host_that_shows_no_key_is_named_and_nothing_is_written(
    openssh: OpenSsh, tmp_path: Path
) -> None:
    """A host where nothing listens stops ``--scan`` with its name and why, before any
    question or file."""
    closed = ports.reserve("127.0.0.1")
    request = _request(
        tmp_path, openssh, known_hosts_from=None, hosts=(Target("w0", "127.0.0.1", closed),)
    )
    with pytest.raises(
        StarterProblem, match=r"no host key from w0 \(127.0.0.1:\d+: connection refused\)"
    ):
        _run(request)
    assert not request.output.parent.exists()


def test_files_that_exist_are_kept_unless_forced(openssh: OpenSsh, tmp_path: Path) -> None:
    """An existing config or known_hosts is never replaced without ``--force``; with it, both
    are written again."""
    request = _request(tmp_path, openssh)
    request.output.parent.mkdir()
    request.known_hosts.write_text("mine\n")
    with pytest.raises(StarterProblem, match="exists; pick another -o, or pass --force"):
        _run(request)
    assert request.known_hosts.read_text() == "mine\n"
    assert not request.output.exists()
    forced = _request(tmp_path, openssh, force=True)
    _run(forced)
    assert request.known_hosts.read_text().startswith("# Written by `reward-supervisor init`")
    assert config.load(request.output).hosts[0].name == "w0"
