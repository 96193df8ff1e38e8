"""Config loading: the corpus of invalid files, defaults, rendering and the launch key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor import config
from supervisor.errors import ConfigError

CONFIGS = Path(__file__).parent.parent / "configs"
REPO = Path(__file__).parent.parent.parent
INVALID = sorted(p for p in CONFIGS.glob("*.toml") if not p.name.startswith("valid"))


def expected_problems(path: Path) -> list[str]:
    """The ``# expect: key: message`` lines at the top of a corpus file."""
    return [
        line.removeprefix("# expect:").strip()
        for line in path.read_text().splitlines()
        if line.startswith("# expect:")
    ]


def minimal(**sections: Any) -> dict[str, Any]:
    """A valid config document, with sections overridden."""
    doc: dict[str, Any] = {
        "run": {"root": "/shared/reward/run-1"},
        "ssh": {"known_hosts": "/etc/rs/known_hosts"},
        "hosts": [{"name": "worker-0", "shard": 0}],
    }
    doc.update(sections)
    return doc


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_each_invalid_config_reports_every_expected_problem(path: Path) -> None:
    """Every problem listed in the file's header is reported, with file and key."""
    expected = expected_problems(path)
    assert expected, f"{path.name} has no '# expect:' lines"
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    reported = [f"{p.key}: {p.reason}" for p in caught.value.problems]
    assert all(p.file == str(path) for p in caught.value.problems)
    for line in expected:
        assert any(r.startswith(line) for r in reported), (line, reported)


def test_shipped_example_and_minimal_configs_are_valid() -> None:
    """systemd/example.toml and the minimal corpus file load without problems."""
    example = config.load(REPO / "systemd" / "example.toml")
    assert [h.name for h in example.hosts] == ["worker-0", "worker-1"]
    minimal_config = config.load(CONFIGS / "valid_minimal.toml")
    assert minimal_config.run.shard_count == 1


def test_defaults_are_the_documented_ones() -> None:
    """Keys left out take DESIGN §6's defaults; host address defaults to its name."""
    c = config.parse(minimal(), Path("/etc/x.toml"))
    assert c.health.heartbeat_stale_s == 60
    assert c.health.ready_timeout_s == 60
    assert c.health.restart_cooldown_s == 30
    assert c.health.backoff_max_s == 300
    assert c.health.max_restarts == 0
    assert c.health.kill_after_grace is False
    assert c.ssh.keepalive_interval_s == 15
    assert c.ssh.connect_timeout_s == 20
    assert c.run.forbid_hosts == ("head",)
    assert c.run.run_id == "run-1"
    assert c.run.on_exit == "stop"
    assert c.watch.debounce_ms == 50
    assert c.hosts[0].address == "worker-0"
    assert c.hosts[0].port == 22
    assert c.hosts[0].concurrency == 48
    assert c.worker.argv == config.DEFAULT_ARGV


def test_argv_fields_are_substituted_inside_single_arguments() -> None:
    """A root with spaces and shell characters stays one argument, untouched."""
    root = "/shared/my run/$(touch pwned)/`x`/'q'"
    c = config.parse(
        minimal(
            run={"root": root},
            worker={"argv": ["{python}", "--root={root}", "--host", "{host}", "{shard}"]},
        ),
        Path("/etc/x.toml"),
    )
    argv = config.render_argv(c, c.hosts[0])
    assert argv == ("python3", f"--root={root}", "--host", "worker-0", "0")


def test_launch_key_changes_only_with_launch_parameters() -> None:
    """Health settings do not restart workers on reload; argv, env and address do."""
    base = config.parse(minimal(), Path("/etc/x.toml"))
    health_changed = config.parse(minimal(health={"restart_cooldown_s": 5}), Path("/etc/x.toml"))
    env_changed = config.parse(minimal(worker={"env": {"A": "1"}}), Path("/etc/x.toml"))
    moved = config.parse(
        minimal(hosts=[{"name": "worker-0", "shard": 0, "address": "10.0.0.9"}]),
        Path("/etc/x.toml"),
    )

    def key(c: config.Config) -> tuple[object, ...]:
        return config.launch_key(c, c.hosts[0])

    assert key(base) == key(health_changed)
    assert key(base) != key(env_changed)
    assert key(base) != key(moved)


def test_shard_count_defaults_to_highest_shard_plus_one_and_gaps_are_refused() -> None:
    """Shards 0 and 2 without 1 is a config error: shard 1's tasks would never be consumed."""
    with pytest.raises(ConfigError, match="no host serves shard"):
        config.parse(
            minimal(hosts=[{"name": "a", "shard": 0}, {"name": "b", "shard": 2}]),
            Path("/etc/x.toml"),
        )


def test_missing_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A config path that does not exist is reported, not a traceback."""
    with pytest.raises(ConfigError, match="file not found"):
        config.load(tmp_path / "nope.toml")


def test_socket_path_too_long_is_refused() -> None:
    """AF_UNIX paths longer than 107 bytes cannot be bound; say so at load time."""
    with pytest.raises(ConfigError, match=r"control\.socket"):
        config.parse(minimal(control={"socket": "/run/" + "x" * 120}), Path("/etc/x.toml"))


def test_host_name_validation_accepts_dns_names_and_ip_addresses() -> None:
    """DNS names and IP literals pass; shell metacharacters never do."""
    for good in ("worker-0", "w0.cluster.local", "A-1"):
        assert config.is_valid_host_name(good)
    for bad in ("", "a b", "a;b", "$(x)", "a/b", "-a", "a-", "x" * 64, "ü"):
        assert not config.is_valid_host_name(bad)
    assert config.is_valid_address("10.0.0.1")
    assert config.is_valid_address("::1")
    assert not config.is_valid_address("10.0.0.1; id")


def test_a_bad_root_hides_no_other_problem() -> None:
    """With run.root invalid, the hosts are still checked against forbid/allow lists and every
    other run key is read: each problem is reported, and nothing else."""
    path = CONFIGS / "root_invalid_cross_checks.toml"
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    reported = [f"{p.key}: {p.reason}" for p in caught.value.problems]
    assert len(reported) == len(expected_problems(path)), reported


def test_an_invalid_host_entry_does_not_also_leave_its_shard_unserved() -> None:
    """A host dropped for a bad name is one problem, not a second "no host serves shard"."""
    hosts = [
        {"name": "worker-0", "shard": 0},
        {"name": "bad name", "shard": 1},
        {"name": "worker-2", "shard": 2},
    ]
    with pytest.raises(ConfigError) as caught:
        config.parse(minimal(hosts=hosts), Path("/etc/x.toml"))
    assert [p.key for p in caught.value.problems] == ["hosts[1].name"]


def test_stale_minimum_says_where_it_comes_from() -> None:
    """The heartbeat_stale_s floor names its source: the poll interval when that sets it,
    the worker's beat otherwise."""
    cases = [({"poll_interval_s": 5}, 5, "2 x watch.poll_interval_s (5s) + 1s"), ({}, 2, "beats")]
    for watch, stale, source in cases:
        doc = minimal(watch=watch, health={"heartbeat_stale_s": stale})
        with pytest.raises(ConfigError) as caught:
            config.parse(doc, Path("/etc/x.toml"))
        [problem] = caught.value.problems
        assert problem.key == "health.heartbeat_stale_s"
        assert source in problem.reason


def write_config(path: Path, known_hosts: Path, keys: list[Path]) -> Path:
    """A minimal valid config file naming these SSH files."""
    listed = ", ".join(f'"{k}"' for k in keys)
    path.write_text(
        f'[run]\nroot = "/shared/run-1"\n[ssh]\nknown_hosts = "{known_hosts}"\n'
        f'client_keys = [{listed}]\n[[hosts]]\nname = "w0"\nshard = 0\n'
    )
    return path


def test_missing_or_empty_ssh_files_are_warnings_not_problems(tmp_path: Path) -> None:
    """check(): a known_hosts that does not exist or is empty, and a missing key file, are
    warned about by key; the config stays valid; present files give no warning."""
    key = tmp_path / "id"
    key.write_text("key material is not read\n")
    missing = write_config(tmp_path / "a.toml", tmp_path / "nope", [key, tmp_path / "gone"])
    checked = config.check(missing)
    assert checked.config is not None and checked.problems == ()
    assert [w.key for w in checked.warnings] == ["ssh.known_hosts", "ssh.client_keys[1]"]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    assert [w.key for w in config.check(write_config(tmp_path / "b.toml", empty, [])).warnings] == [
        "ssh.known_hosts"
    ]
    empty.write_text("[127.0.0.1]:22 ssh-ed25519 AAAA\n")
    assert config.check(write_config(tmp_path / "c.toml", empty, [key])).warnings == ()


def test_warnings_come_with_the_problems_of_an_invalid_config(tmp_path: Path) -> None:
    """An invalid config still gets its file warnings, beside every problem."""
    path = tmp_path / "bad.toml"
    path.write_text(
        f'[run]\nroot = "relative"\n[ssh]\nknown_hosts = "{tmp_path / "nope"}"\n'
        '[[hosts]]\nname = "w0"\nshard = 0\n'
    )
    checked = config.check(path)
    assert checked.config is None
    assert [p.key for p in checked.problems] == ["run.root"]
    assert [w.key for w in checked.warnings] == ["ssh.known_hosts"]
