"""Config loading: the corpus of invalid files, defaults, rendering and the launch key."""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from supervisor import config, health, leadership, vocabulary
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
    """Keys left out take docs/CONFIG.md's defaults (the health ones derived from the trainer
    client's 15 s heartbeat limit and 30 s task timeout); host address defaults to its name."""
    c = config.parse(minimal(), Path("/etc/x.toml"))
    assert (c.trainer.heartbeat_stale_s, c.trainer.task_timeout_s) == (15, 30)
    assert c.health.heartbeat_stale_s == 5
    assert c.health.progress_stale_s == 10
    assert c.health.restart_cooldown_s == 5
    assert c.health.stop_grace_s == 30
    assert c.health.restart_stop == "kill"
    assert c.health.ready_timeout_s == 60
    assert c.health.backoff_max_s == 300
    assert c.health.max_restarts == 0
    assert c.health.kill_after_grace is False
    assert c.health.kill_stuck is True
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


@pytest.mark.parametrize(
    ("table", "policy"),
    [("health", health.Policy), ("fleet", vocabulary.FleetPolicy), ("ha", leadership.Policy)],
)
def test_each_policy_key_has_one_default(table: str, policy: type[Any]) -> None:
    """A config that leaves a table out gets the policy's own defaults, field for field: the
    unit tests of the cores (which build ``Policy()``) run what production runs."""
    built = getattr(config.parse(minimal(), Path("/etc/x.toml")), table)
    default = policy()
    differ = {
        f.name: (getattr(built, f.name), getattr(default, f.name))
        for f in dataclasses.fields(policy)
        if getattr(built, f.name) != getattr(default, f.name)
    }
    assert differ == {}


def test_health_defaults_follow_the_trainer_table_and_set_keys_win() -> None:
    """A slower trainer client moves the derived defaults; a key set in [health] is kept."""
    c = config.parse(
        minimal(trainer={"heartbeat_stale_s": 60, "task_timeout_s": 120}), Path("/etc/x.toml")
    )
    assert (c.health.heartbeat_stale_s, c.health.restart_cooldown_s) == (20, 20)
    assert (c.health.progress_stale_s, c.health.stop_grace_s) == (40, 120)
    kept = config.parse(
        minimal(trainer={"heartbeat_stale_s": 60}, health={"heartbeat_stale_s": 7}),
        Path("/etc/x.toml"),
    )
    assert kept.health.heartbeat_stale_s == 7
    assert "health.heartbeat_stale_s" in kept.keys_set


def test_a_derived_stale_limit_never_goes_below_what_polling_can_see() -> None:
    """With a slow poll the derived stale limit stays above two poll intervals plus one."""
    c = config.parse(minimal(watch={"poll_interval_s": 4}), Path("/etc/x.toml"))
    assert c.health.heartbeat_stale_s == 9
    assert c.health.progress_stale_s == 10


def test_the_shipped_defaults_beat_the_trainer() -> None:
    """No warning for a config that sets nothing: every derived default is in time."""
    assert config.trainer_warnings(config.parse(minimal(), Path("/etc/x.toml"))) == []


def test_thresholds_that_cannot_beat_the_trainer_are_named_with_both_numbers() -> None:
    """The old 60 s stale limit, a 5-minute stuck limit, a 30 s cooldown, no auto restart and
    no stuck check each warn, naming the setting's number and the trainer's."""
    c = config.parse(
        minimal(
            health={
                "heartbeat_stale_s": 60,
                "progress_stale_s": 300,
                "restart_cooldown_s": 30,
                "auto_restart": False,
            }
        ),
        Path("/etc/x.toml"),
    )
    warned = dict(config.trainer_warnings(c))
    assert set(warned) == {
        "health.heartbeat_stale_s",
        "health.progress_stale_s",
        "health.restart_cooldown_s",
        "health.auto_restart",
    }
    assert "60s cannot beat the trainer" in warned["health.heartbeat_stale_s"]
    assert "15s old" in warned["health.heartbeat_stale_s"]
    assert "300s" in warned["health.progress_stale_s"]
    assert "30s timeout" in warned["health.progress_stale_s"]
    off = config.parse(minimal(health={"progress_stale_s": 0}), Path("/etc/x.toml"))
    assert [k for k, _ in config.trainer_warnings(off)] == ["health.progress_stale_s"]


def test_a_trainer_too_impatient_for_any_default_is_warned_about_as_derived() -> None:
    """A 4 s trainer limit cannot be beaten even by the derived stale limit, and says so."""
    c = config.parse(minimal(trainer={"heartbeat_stale_s": 4}), Path("/etc/x.toml"))
    warned = dict(config.trainer_warnings(c))
    assert "(derived from [trainer])" in warned["health.heartbeat_stale_s"]


def test_check_reports_trainer_warnings_without_failing(tmp_path: Path) -> None:
    """check-config lists a threshold that cannot beat the trainer as a warning, not a problem."""
    path = tmp_path / "slow.toml"
    path.write_text(
        '[run]\nroot = "/shared/reward/run-1"\n[ssh]\nknown_hosts = "/etc/kh"\n'
        "[health]\nheartbeat_stale_s = 60\n"
        '[[hosts]]\nname = "worker-0"\nshard = 0\n'
    )
    checked = config.check(path)
    assert checked.config is not None and checked.problems == ()
    assert "health.heartbeat_stale_s" in [w.key for w in checked.warnings]


@pytest.mark.parametrize("section", ["trainer", "health"])
def test_unknown_trainer_and_restart_keys_are_refused(section: str) -> None:
    """A misspelt key in [trainer] or a bad restart_stop is a problem with its key."""
    raw = (
        minimal(trainer={"heartbeat_stale": 15})
        if section == "trainer"
        else minimal(health={"restart_stop": "gently"})
    )
    with pytest.raises(ConfigError) as caught:
        config.parse(raw, Path("/etc/x.toml"))
    keys = [p.key for p in caught.value.problems]
    assert keys == (
        ["trainer.heartbeat_stale"] if section == "trainer" else ["health.restart_stop"]
    )


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


def test_a_config_larger_than_the_cap_is_refused_unread(tmp_path: Path) -> None:
    """A file past MAX_CONFIG_BYTES (a log symlinked as the config) is a ConfigError that
    check() reports too, and the CLI falls back to the default socket."""
    big = tmp_path / "big.toml"
    big.write_bytes(b"# " + b"x" * config.MAX_CONFIG_BYTES + b"\n")
    with pytest.raises(ConfigError, match="larger than"):
        config.load(big)
    assert "larger than" in str(config.check(big).problems[0])
    assert config.sockets_from_raw_file(big) == config.default_socket_candidates(big)


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


def test_progress_check_can_be_turned_off_and_permanent_codes_are_a_set() -> None:
    """``progress_stale_s = 0`` turns stuck detection off; exit codes become a frozenset."""
    cfg = config.parse(
        minimal(health={"progress_stale_s": 0, "permanent_exit_codes": [2, 70, 2]}), Path("x")
    )
    assert cfg.health.progress_stale_s == 0
    assert cfg.health.permanent_exit_codes == frozenset({2, 70})
    assert config.parse(minimal(), Path("x")).health.progress_stale_s == 10


def test_keepalives_are_spread_so_the_fleet_sends_at_most_its_rate() -> None:
    """Each connection keeps its interval while the fleet stays under the rate (50/s by
    default); past it, intervals stretch to hosts / rate; a rate of 0 turns that off."""
    ssh = config.parse(minimal(), Path("x")).ssh
    assert ssh.keepalive_fleet_rate == 50
    assert config.fleet_ssh(ssh, 100) is ssh
    assert config.fleet_ssh(ssh, 750) is ssh  # 750 / 50 = 15 s: exactly the interval
    assert config.fleet_ssh(ssh, 1000).keepalive_interval_s == 20
    assert config.fleet_ssh(ssh, 1000).keepalive_count_max == ssh.keepalive_count_max
    off = config.parse(minimal(ssh={**minimal()["ssh"], "keepalive_fleet_rate": 0}), Path("x"))
    assert config.fleet_ssh(off.ssh, 10_000) is off.ssh


@pytest.mark.parametrize("rate", [-1, float("nan"), float("inf"), "fast"])
def test_a_bad_keepalive_fleet_rate_is_a_problem_naming_the_key(rate: object) -> None:
    """A negative, NaN, infinite or non-numeric rate is refused with the key."""
    with pytest.raises(ConfigError) as refused:
        config.parse(minimal(ssh={**minimal()["ssh"], "keepalive_fleet_rate": rate}), Path("x"))
    assert "ssh.keepalive_fleet_rate" in str(refused.value)


def test_evidence_settings_default_to_three_seconds_auto_and_can_be_turned_off() -> None:
    """Evidence is collected for at most 3 s by default, stacks by py-spy or the signal;
    ``evidence_timeout_s = 0`` turns collection off."""
    default = config.parse(minimal(), Path("x")).health
    assert (default.evidence_timeout_s, default.evidence_stacks) == (3.0, "auto")
    cfg = config.parse(
        minimal(health={"evidence_timeout_s": 0, "evidence_stacks": "signal"}), Path("x")
    )
    assert (cfg.health.evidence_timeout_s, cfg.health.evidence_stacks) == (0.0, "signal")


@pytest.mark.parametrize(
    ("health", "key"),
    [
        ({"evidence_timeout_s": 31}, "health.evidence_timeout_s"),
        ({"evidence_timeout_s": 0.1}, "health.evidence_timeout_s"),
        ({"evidence_stacks": "gdb"}, "health.evidence_stacks"),
    ],
)
def test_evidence_settings_out_of_bounds_are_refused(health: dict[str, Any], key: str) -> None:
    """Evidence may hold a restart back a few seconds, never half a minute; stacks are taken
    only in the named ways."""
    with pytest.raises(ConfigError) as caught:
        config.parse(minimal(health=health), Path("x"))
    assert [p.key for p in caught.value.problems] == [key]


@pytest.mark.parametrize(
    ("listen", "bound"),
    [
        ("9464", ("127.0.0.1", 9464)),
        (":9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:9464", ("0.0.0.0", 9464)),
        ("[::1]:9464", ("::1", 9464)),
    ],
)
def test_metrics_listen_with_only_a_port_binds_loopback(
    listen: str, bound: tuple[str, int]
) -> None:
    """A bare port (or ``:PORT``) listens on 127.0.0.1; any other address must be named."""
    cfg = config.parse(minimal(metrics={"listen": listen}), Path("/etc/x.toml"))
    assert cfg.metrics.listen is not None
    assert config.split_host_port(cfg.metrics.listen) == bound


@pytest.mark.parametrize("listen", ["localhost", "x:0", "x:65536", "x:", "x:٩٤", ""])
def test_metrics_listen_without_a_valid_port_is_refused(listen: str) -> None:
    """No port, port 0, past 65535 or non-ASCII digits: a problem naming the key."""
    with pytest.raises(ConfigError, match=r"metrics\.listen: must be HOST:PORT or PORT"):
        config.parse(minimal(metrics={"listen": listen}), Path("/etc/x.toml"))


def test_ssh_algorithm_lists_default_to_none_and_keep_the_given_order() -> None:
    """Unset lists mean the modern defaults; a given list is kept as written."""
    cfg = config.parse(minimal(), Path("/etc/x.toml"))
    assert all(getattr(cfg.ssh, key) is None for key in config.SSH_ALGORITHM_KEYS)
    ssh = {"known_hosts": "/etc/rs/known_hosts", "kex_algs": ["diffie-hellman-group14-sha1"]}
    cfg = config.parse(minimal(ssh=ssh), Path("/etc/x.toml"))
    assert cfg.ssh.kex_algs == ("diffie-hellman-group14-sha1",)


@pytest.mark.parametrize(
    ("value", "key", "reason"),
    [
        (["curve25519-sha256", "curve-nope"], "ssh.kex_algs[1]", "'curve-nope' is not an"),
        ([], "ssh.kex_algs", "must name at least one algorithm"),
        ("curve25519-sha256", "ssh.kex_algs", "must be an array"),
        ([5], "ssh.kex_algs[0]", "must be a string"),
    ],
)
def test_bad_ssh_algorithm_lists_are_problems_naming_the_key(
    value: object, key: str, reason: str
) -> None:
    """An unknown algorithm, an empty list or a wrong type is reported with its key."""
    ssh = {"known_hosts": "/etc/rs/known_hosts", "kex_algs": value}
    with pytest.raises(ConfigError) as caught:
        config.parse(minimal(ssh=ssh), Path("/etc/x.toml"))
    assert [(p.key, p.reason[: len(reason)]) for p in caught.value.problems] == [(key, reason)]


def test_every_ssh_algorithm_key_is_checked_against_its_own_kind() -> None:
    """A MAC name is not a key exchange algorithm: each list is validated for its kind."""
    for key in config.SSH_ALGORITHM_KEYS:
        ssh = {"known_hosts": "/etc/rs/known_hosts", key: ["hmac-sha2-256"]}
        if key == "mac_algs":
            config.parse(minimal(ssh=ssh), Path("/etc/x.toml"))
            continue
        with pytest.raises(ConfigError, match=rf"ssh\.{key}\[0\]"):
            config.parse(minimal(ssh=ssh), Path("/etc/x.toml"))


def test_privilege_warnings_name_root_use_and_nothing_else() -> None:
    """A daemon running as root and root logins (global or per host) are each one warning
    naming the hosts; an unprivileged daemon logging in as a service user gets none."""
    plain = config.parse(
        minimal(ssh={"known_hosts": "/etc/rs/known_hosts", "username": "reward"}),
        Path("/etc/x.toml"),
    )
    assert config.privilege_warnings(plain, euid=1000) == []
    [(event, fields)] = config.privilege_warnings(plain, euid=0)
    assert event == "daemon.running_as_root"
    assert "service account" in fields["advice"]
    hosts = [
        {"name": "worker-0", "shard": 0, "username": "root"},
        {"name": "worker-1", "shard": 1},
    ]
    mixed = config.parse(
        minimal(ssh={"known_hosts": "/etc/rs/known_hosts", "username": "reward"}, hosts=hosts),
        Path("/etc/x.toml"),
    )
    [(event, fields)] = config.privilege_warnings(mixed, euid=1000)
    assert (event, fields["hosts"], fields["host_count"]) == ("ssh.root_login", ["worker-0"], 1)
    everyone = config.parse(
        minimal(ssh={"known_hosts": "/etc/rs/known_hosts", "username": "root"}, hosts=hosts),
        Path("/etc/x.toml"),
    )
    assert [e for e, _ in config.privilege_warnings(everyone, euid=0)] == [
        "daemon.running_as_root",
        "ssh.root_login",
    ]
    assert config.privilege_warnings(everyone, euid=0)[1][1]["hosts"] == ["worker-0", "worker-1"]


def test_ha_defaults_and_values() -> None:
    """``[ha]`` left out: no standby, the documented timings; given: taken as written."""
    default = config.parse(minimal(), Path("/etc/x.toml")).ha
    assert default == leadership.Policy(
        standby=False,
        poll_interval_s=0.5,
        check_interval_s=5.0,
        confirm_timeout_s=30.0,
        handover_hold_s=5.0,
    )
    given = config.parse(
        minimal(
            ha={
                "standby": True,
                "poll_interval_s": 1,
                "check_interval_s": 30,
                "confirm_timeout_s": 60,
                "handover_hold_s": 2.5,
            }
        ),
        Path("/etc/x.toml"),
    ).ha
    assert given == leadership.Policy(
        standby=True,
        poll_interval_s=1.0,
        check_interval_s=30.0,
        confirm_timeout_s=60.0,
        handover_hold_s=2.5,
    )


@pytest.mark.parametrize(
    ("ha", "problem"),
    [
        ({"standby": "yes"}, "ha.standby: must be"),
        ({"poll_interval_s": 0}, "ha.poll_interval_s: must be"),
        ({"check_interval_s": 31}, "ha.check_interval_s: must be at most 30"),
        ({"confirm_timeout_s": -1}, "ha.confirm_timeout_s: must be"),
        ({"handover_hold_s": "5"}, "ha.handover_hold_s: must be"),
        ({"stanby": True}, "ha.stanby: unknown key"),
    ],
)
def test_bad_ha_values_are_problems_naming_the_key(ha: dict[str, Any], problem: str) -> None:
    """Each bad ``[ha]`` value is refused naming its key (a typo with a did-you-mean)."""
    with pytest.raises(ConfigError) as caught:
        config.parse(minimal(ha=ha), Path("/etc/x.toml"))
    reported = [f"{p.key}: {p.reason}" for p in caught.value.problems]
    assert any(r.startswith(problem) for r in reported), reported


def test_kill_stuck_can_be_turned_off_and_must_be_a_boolean() -> None:
    """health.kill_stuck = false reaches the core's policy; a string is refused by name."""
    c = config.parse(minimal(health={"kill_stuck": False}), Path("/etc/x.toml"))
    assert c.health.kill_stuck is False
    with pytest.raises(ConfigError, match=r"health\.kill_stuck"):
        config.parse(minimal(health={"kill_stuck": "no"}), Path("/etc/x.toml"))


def test_open_file_limit_warning_names_what_the_fleet_needs() -> None:
    """A limit below one descriptor a host plus the spare is one warning saying how many are
    needed; a limit at exactly that, or above, is none."""
    hosts = [{"name": f"worker-{i}", "shard": i} for i in range(10)]
    ten = config.parse(minimal(hosts=hosts), Path("/etc/x.toml"))
    needed = 10 + config.OPEN_FILES_SPARE
    assert config.open_files_needed(ten) == needed
    assert config.open_file_limit_warnings(ten, needed) == []
    assert config.open_file_limit_warnings(ten, 65536) == []
    [(event, fields)] = config.open_file_limit_warnings(ten, needed - 1)
    assert event == "daemon.open_file_limit_low"
    assert (fields["limit"], fields["needed"], fields["hosts"]) == (needed - 1, needed, 10)
    assert "LimitNOFILE" in fields["advice"]


def test_the_daemon_shutdown_bound_and_the_stop_wait_come_from_stop_grace() -> None:
    """The fleet gives up on stopping hosts 15 s past stop_grace_s, and ``stop`` waits for
    the daemon's exit 15 s past that."""
    c = config.parse(minimal(health={"stop_grace_s": 40}), Path("/etc/x.toml"))
    assert c.fleet.shutdown_timeout_s == config.shutdown_timeout_s(40) == 55
    assert config.exit_wait_s(40) == 70


#: The field types a kind of key may fill (a choice fills a ``str`` or a ``Literal`` of its
#: choices, checked apart).
KIND_TYPES: dict[str, set[object]] = {
    "seconds": {float},
    "count": {int},
    "integer": {int},
    "rate": {float},
    "fraction": {float},
    "flag": {bool},
    "text": {str, str | None},
    "choice": {str},
    "path": {Path, Path | None},
    "strings": {tuple[str, ...], tuple[str, ...] | None},
    "paths": {tuple[Path, ...]},
    "algorithms": {tuple[str, ...] | None},
    "exit_codes": {frozenset[int]},
    "env": {Mapping[str, str]},
    "number": {float | None},
    "json_list": {tuple[typing.Any, ...]},
    "json_table": {Mapping[str, typing.Any]},
}


def schema_mismatches(name: str, section: config.Section) -> list[str]:
    """How a table of the schema and its dataclass disagree: a field that is neither a key
    nor filled by the validator, a key that is no field, or a key whose kind cannot fill
    its field's type."""
    hints = typing.get_type_hints(section.result)
    fields = {f.name for f in dataclasses.fields(section.result)}
    out = [
        f"{name}.{f}: a field with no key" for f in fields - set(section.keys) - section.not_keys
    ]
    out += [f"{name}.{k}: a key with no field" for k in set(section.keys) - fields]
    out += [f"{name}.{k}: a key and not a key" for k in set(section.keys) & section.not_keys]
    for key_name, key in section.keys.items():
        hint = hints.get(key_name)
        if typing.get_origin(hint) is typing.Literal:
            if key.kind != "choice" or typing.get_args(hint) != key.choices:
                out.append(f"{name}.{key_name}: {hint} but {key.kind} {key.choices}")
        elif key_name in hints and hint not in KIND_TYPES[key.kind]:
            out.append(f"{name}.{key_name}: {hint} cannot hold a {key.kind}")
    return out


def test_the_schema_and_the_dataclasses_name_the_same_keys_with_fitting_kinds() -> None:
    """Every field of a table's dataclass is a key of the schema (or one the validator fills
    from elsewhere), every key is a field, and each key's kind fits its field's type."""
    assert [m for name, s in config.SCHEMA.items() for m in schema_mismatches(name, s)] == []


def test_a_field_missing_from_the_schema_or_a_key_without_a_field_is_a_mismatch() -> None:
    """The schema check finds a dataclass field with no key, a key with no field, and a kind
    that does not fit its field."""
    ha = config.SCHEMA["ha"]
    keys = dict(ha.keys)
    del keys["standby"]
    keys["standbye"] = config.Key("flag")
    keys["poll_interval_s"] = config.Key("count")
    assert sorted(schema_mismatches("ha", config.Section(leadership.Policy, keys))) == [
        "ha.poll_interval_s: <class 'float'> cannot hold a count",
        "ha.standby: a field with no key",
        "ha.standbye: a key with no field",
    ]


def test_an_empty_host_address_or_port_zero_is_a_problem_not_a_silent_default() -> None:
    """``address = ""`` once left its host out without a word, and ``port = 0`` became 22:
    each is now a problem naming the key."""
    hosts = [{"name": "worker-0", "shard": 0, "address": "", "port": 0}]
    with pytest.raises(ConfigError) as caught:
        config.parse(minimal(hosts=hosts), Path("/etc/x.toml"))
    assert [(p.key, p.reason) for p in caught.value.problems] == [
        ("hosts[0].address", "'' is not a host name or IP address"),
        ("hosts[0].port", "must be in 1..65535, not 0"),
    ]


def test_every_ssh_key_is_read_when_known_hosts_is_missing() -> None:
    """A missing known_hosts hides no other [ssh] problem (the keys after the algorithm lists
    were once left unread), and a bad client key is named by its index in the file."""
    ssh = {"connect_timeout_s": 0, "client_keys": [1, "rel"], "max_concurrent_handshakes": 0}
    with pytest.raises(ConfigError) as caught:
        config.parse(minimal(ssh=ssh), Path("/etc/x.toml"))
    assert [(p.key, p.reason) for p in caught.value.problems] == [
        ("ssh.known_hosts", "required: host keys are always verified"),
        ("ssh.client_keys[0]", "must be a string, not an integer"),
        ("ssh.client_keys[1]", "must be an absolute path, not 'rel'"),
        ("ssh.connect_timeout_s", "must be a positive number of seconds, not 0.0"),
        ("ssh.max_concurrent_handshakes", "must be at least 1, not 0"),
    ]


def test_a_bad_value_is_one_problem_under_its_own_key() -> None:
    """A bad trainer limit is not echoed by the health defaults derived from it, nor a
    wrong-typed python by a second problem."""
    doc = minimal(trainer={"heartbeat_stale_s": 0}, worker={"python": 3})
    with pytest.raises(ConfigError) as caught:
        config.parse(doc, Path("/etc/x.toml"))
    assert sorted((p.key, p.reason) for p in caught.value.problems) == [
        ("trainer.heartbeat_stale_s", "must be a positive number of seconds, not 0.0"),
        ("worker.python", "must be a string, not an integer"),
    ]


def test_a_huge_shard_count_is_reported_without_listing_every_shard() -> None:
    """A shard count of a billion (a typo) names the first ten unserved shards, quickly and
    in little memory."""
    doc = minimal(run={"root": "/shared/reward/run-1", "shard_count": 10**9})
    with pytest.raises(ConfigError) as caught:
        config.parse(doc, Path("/etc/x.toml"))
    [problem] = caught.value.problems
    assert problem.reason.startswith("no host serves shard(s) 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 ...")


def test_a_probe_table_turns_probes_on_with_the_run_reward_fn_by_default(tmp_path: Path) -> None:
    """``[probe]`` sets the health policy's probe settings, its task names ``run.reward_fn``
    unless it names its own, and without the table probes stay off."""
    base = (
        f'[run]\nroot = "{tmp_path}/run"\nreward_fn = "pkg.mod.fn"\n'
        f'[ssh]\nknown_hosts = "{tmp_path}/kh"\n'
        '[[hosts]]\nname = "w0"\nshard = 0\n'
    )
    off = tmp_path / "off.toml"
    off.write_text(base)
    assert config.load(off).probe is None
    assert config.load(off).health.probe_interval_s == 0
    on = tmp_path / "on.toml"
    on.write_text(
        base + '[probe]\ninterval_s = 5\nargs = ["q", 1]\nkwargs = {answer = "18"}\nexpect = 1\n'
    )
    loaded = config.load(on)
    assert loaded.health.probe_interval_s == 5
    assert loaded.health.probe_expect == 1.0
    task = json.loads(loaded.health.probe_task)
    assert task == {
        "schema_version": 1,
        "reward_fn": "pkg.mod.fn",
        "args": ["q", 1],
        "kwargs": {"answer": "18"},
    }


def test_a_probe_table_with_a_bad_value_is_refused_by_key(tmp_path: Path) -> None:
    """A probe interval under a second and an expect that is not a number are each named."""
    path = tmp_path / "bad.toml"
    path.write_text(
        f'[run]\nroot = "{tmp_path}/run"\n[ssh]\nknown_hosts = "{tmp_path}/kh"\n'
        '[[hosts]]\nname = "w0"\nshard = 0\n[probe]\ninterval_s = 0.5\nexpect = "one"\n'
    )
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    keys = {p.key for p in caught.value.problems}
    assert {"probe.interval_s", "probe.expect"} <= keys


def test_failover_after_s_is_derived_from_the_trainer_and_a_set_value_wins() -> None:
    """after_s leaves one beat, the watch's lag and the launch under the trainer's limit."""
    c = config.parse(minimal(), Path("/etc/x.toml"))
    assert c.failover.after_s == 15 - 1 - 2 - 1
    inotify = config.parse(minimal(watch={"mode": "inotify"}), Path("/etc/x.toml"))
    assert inotify.failover.after_s == 15 - 1 - 2
    slow = config.parse(minimal(trainer={"heartbeat_stale_s": 60}), Path("/etc/x.toml"))
    assert slow.failover.after_s == 60 - 1 - 2 - 1
    kept = config.parse(minimal(failover={"after_s": 9}), Path("/etc/x.toml"))
    assert kept.failover.after_s == 9
    with pytest.raises(ConfigError, match=r"failover\.after_s"):
        config.parse(minimal(failover={"after_s": 0.5}), Path("/etc/x.toml"))


def test_spares_take_the_host_keys_without_a_shard_and_names_stay_unique() -> None:
    """[[spares]] read like [[hosts]] less the shard; a name used twice is refused."""
    c = config.parse(
        minimal(spares=[{"name": "spare-0", "port": 2222}, {"name": "spare-1"}]),
        Path("/etc/x.toml"),
    )
    assert [(s.name, s.address, s.port) for s in c.spares] == [
        ("spare-0", "spare-0", 2222),
        ("spare-1", "spare-1", 22),
    ]
    assert config.parse(minimal(), Path("/etc/x.toml")).spares == ()
    for bad, where in [
        ([{"name": "worker-0"}], "spares[0].name"),
        ([{"name": "s"}, {"name": "s"}], "spares[1].name"),
        ([{"name": "s", "shard": 1}], "spares[0].shard"),
        ([{"name": "s", "port": 0}], "spares[0].port"),
        ([{"port": 22}], "spares[0].name"),
        (["s"], "spares[0]"),
        ({"name": "s"}, "spares"),
    ]:
        with pytest.raises(ConfigError, match=where.replace("[", r"\[").replace("]", r"\]")):
            config.parse(minimal(spares=bad), Path("/etc/x.toml"))


def test_the_default_socket_places_are_root_s_or_the_user_s_and_fit_af_unix() -> None:
    """Root's daemon has one place, /run/reward-supervisor; another user's looks there
    (the shipped unit's runtime directory), then in /run/user/UID (what $XDG_RUNTIME_DIR
    names in a login session, derived from the uid so that every environment agrees), then
    in a private /tmp directory; a long config name is shortened (with a hash of it), so
    that the longest place stays within AF_UNIX's limit, and two long names stay apart."""
    path = Path("/etc/reward-supervisor/gsm8k.toml")
    assert config.default_socket_candidates(path, 0) == (Path("/run/reward-supervisor/gsm8k.sock"),)
    assert config.default_socket_candidates(path, 1000) == (
        Path("/run/reward-supervisor/gsm8k.sock"),
        Path("/run/user/1000/reward-supervisor/gsm8k.sock"),
        Path("/tmp/reward-supervisor-1000/gsm8k.sock"),
    )
    long_a, long_b = Path(f"/x/{'é' * 120}a.toml"), Path(f"/x/{'é' * 120}b.toml")
    a = config.default_socket_candidates(long_a, 4294967294)
    b = config.default_socket_candidates(long_b, 4294967294)
    assert all(len(os.fsencode(str(p))) <= config.MAX_SOCKET_PATH for p in a + b)
    assert {p.name for p in a}.isdisjoint({p.name for p in b})
    raw = minimal()
    parsed = config.parse(raw, Path("/etc/x.toml"))
    assert config.socket_candidates(parsed) == config.default_socket_candidates(Path("/etc/x.toml"))
    assert parsed.control.socket in config.socket_candidates(parsed)
    raw["control"] = {"socket": "/srv/rs/x.sock"}
    assert config.socket_candidates(config.parse(raw, Path("/etc/x.toml"))) == (
        Path("/srv/rs/x.sock"),
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="gives directories to another uid: needs root")
def test_a_user_s_daemon_takes_the_first_private_place_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For a user who is not root, /run/reward-supervisor only where it is theirs and no one
    else may write it (the unit's runtime directory), else /run/user/UID only where that is
    theirs and private, else the /tmp directory (made private, or refused, by the daemon)."""
    uid = 4242
    system, runtime = tmp_path / "run-rs", tmp_path / "run-user"
    monkeypatch.setattr(config, "SYSTEM_SOCKET_DIR", system)
    monkeypatch.setattr(config, "USER_RUNTIME_DIR", str(runtime / "{uid}"))
    monkeypatch.setattr(config, "TMP_SOCKET_DIR", str(tmp_path / "tmp-{uid}"))
    path = Path("/etc/x.toml")
    tmp, user_runtime, unit = (
        tmp_path / "tmp-4242" / "x.sock",
        runtime / "4242" / "reward-supervisor" / "x.sock",
        system / "x.sock",
    )
    assert config.default_socket_path(path, uid) == tmp
    (runtime / "4242").mkdir(parents=True, mode=0o700)
    assert config.default_socket_path(path, uid) == tmp  # not the user's: root's
    os.chown(runtime / "4242", uid, uid)
    assert config.default_socket_path(path, uid) == user_runtime
    system.mkdir(mode=0o770)
    os.chown(system, uid, uid)
    system.chmod(0o770)
    assert config.default_socket_path(path, uid) == user_runtime  # the group may write it
    system.chmod(0o700)
    assert config.default_socket_path(path, uid) == unit
    assert config.default_socket_path(path, 0) == unit
