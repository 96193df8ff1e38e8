"""``init``'s pure parts: the hosts as typed, the config and known_hosts it writes."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor import config, starter
from supervisor.remote import HostKey
from supervisor.starter import Request, StarterProblem, Target

KEY = HostKey("ssh-ed25519", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB", "SHA256:x")


def test_hosts_are_named_by_address_unless_named_and_take_port_22_by_default() -> None:
    """``[NAME=]ADDRESS[:PORT]``: the address names a host without a name; an IPv6 address
    with a port goes in brackets; the port is 22 unless given."""
    assert starter.parse_hosts("w0=10.0.0.1:2222, gpu-3 ,v6=[::1]:22822,v6b=::2") == (
        Target("w0", "10.0.0.1", 2222),
        Target("gpu-3", "gpu-3", 22),
        Target("v6", "::1", 22822),
        Target("v6b", "::2", 22),
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("127.0.0.1:2201,127.0.0.1:2202", "two hosts named 127.0.0.1: name each"),
        ("w0=h:0", "is not a port"),
        ("w0=h:22x", "is not a port"),
        ("a_b=h", "cannot name a host"),
        ("w0=bad host", "is not a host name or address"),
        (" , ", "names no host"),
    ],
)
def test_hosts_that_cannot_be_a_fleet_are_refused_with_what_to_type(text: str, said: str) -> None:
    """Two hosts of one name, a port that is none, a name that cannot name a status file, an
    address that is none, nothing at all: a usage error (exit 2) saying what is wrong."""
    with pytest.raises(StarterProblem, match=said) as refused:
        starter.parse_hosts(text)
    assert refused.value.code == starter.EXIT_USAGE


def test_a_host_s_known_hosts_name_is_openssh_s() -> None:
    """``[address]:port`` off port 22, the bare address on it, as OpenSSH writes them; one
    line per key even when two names share an address and port."""
    targets = (Target("a", "10.0.0.1", 2222), Target("b", "10.0.0.2", 22))
    text = starter.known_hosts_text(targets, {"a": [KEY], "b": [KEY]})
    assert text.splitlines()[1:] == [f"[10.0.0.1]:2222 {KEY.text}", f"10.0.0.2 {KEY.text}"]
    twice = (Target("a", "h", 2222), Target("b", "h", 2222))
    assert len(starter.known_hosts_text(twice, {"a": [KEY], "b": [KEY]}).splitlines()) == 2


@given(st.text())
def test_any_text_survives_the_trip_through_toml(text: str) -> None:
    """Whatever a path, a user name or an env value holds, TOML reads back the same text."""
    assert (
        tomllib.loads(f"k = {starter._toml(text)}\n{starter._toml_key(text or 'k2')} = 1")["k"]
        == text
    )


def _request(tmp_path: Path, **overrides: object) -> Request:
    """A request for two hosts, one on port 2222, with a worker.env to quote."""
    key = tmp_path / "id_ed25519"
    key.write_text("not read by this test")
    values: dict[str, object] = {
        "hosts": (Target("w0", "127.0.0.1", 2222), Target("gpu-1", "gpu-1", 22)),
        "root": Path("/shared/reward/run 1"),
        "output": tmp_path / "fleet.toml",
        "username": "alice",
        "client_keys": (key,),
        "known_hosts_from": None,
        "env": {"PYTHONPATH": "/opt/areal", "ODD": 'a "quoted" \\ value'},
        "concurrency": 4,
    }
    values.update(overrides)
    return Request(**values)  # type: ignore[arg-type]


def test_the_starter_config_is_what_was_asked_and_passes_check_config(tmp_path: Path) -> None:
    """Every host on its shard in the order given, the root, user, key, worker and reward fn
    as asked, the trainer's limits spelt out: check-config finds no problem and no warning
    (its known_hosts in place), and nothing is left to a default that cannot beat the
    trainer."""
    request = _request(tmp_path, worker_module="supervisor.demo.worker", reward_fn="m.f")
    request.output.write_text(starter.config_text(request))
    request.known_hosts.write_text(
        starter.known_hosts_text(request.hosts, {"w0": [KEY], "gpu-1": [KEY]})
    )
    checked = config.check(request.output)
    assert (checked.problems, checked.warnings) == ((), ())
    loaded = checked.config
    assert loaded is not None
    assert [(h.name, h.address, h.port, h.shard, h.concurrency) for h in loaded.hosts] == [
        ("w0", "127.0.0.1", 2222, 0, 4),
        ("gpu-1", "gpu-1", 22, 1, 4),
    ]
    assert loaded.run.root == Path("/shared/reward/run 1")
    assert (loaded.run.reward_fn, loaded.ssh.username) == ("m.f", "alice")
    assert loaded.ssh.known_hosts == request.known_hosts
    assert loaded.worker.argv[1:3] == ("-m", "supervisor.demo.worker")
    assert dict(loaded.worker.env) == request.env
    assert "control.socket" not in loaded.keys_set
    assert {"trainer.heartbeat_stale_s", "trainer.task_timeout_s"} <= loaded.keys_set


def test_next_steps_are_preflight_run_and_status_of_the_file_written() -> None:
    """The three commands, each of the config written, each with what it does."""
    lines = starter.next_steps(Path("/home/a/fleet.toml"))
    commands = [line.split("#")[0].split() for line in lines[1:]]
    assert commands == [
        ["reward-supervisor", verb, "-c", "/home/a/fleet.toml"]
        for verb in ("preflight", "run", "status")
    ]
