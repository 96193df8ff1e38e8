"""The command line's parser: every option explained, every bad value a usage error."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from supervisor import cli, logs


def subparsers(
    parser: argparse.ArgumentParser | None = None,
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every subcommand's parser, with its name."""
    parser = parser or cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """``COMMAND OPTION`` for every option or positional without a help text."""
    return [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, sub in subparsers(parser)
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]


def test_every_option_and_argument_has_help() -> None:
    """No option or positional of any subcommand lacks a help text (``--help`` explains all)."""
    parser = cli.build_parser()
    assert len(list(subparsers(parser))) >= 15
    assert undocumented(parser) == []


def test_the_walk_finds_an_option_added_without_help() -> None:
    """The walk is not vacuous: an option added with no help is named by it."""
    parser = cli.build_parser()
    [status] = [sub for name, sub in subparsers(parser) if name == "status"]
    status.add_argument("--new-option")
    assert undocumented(parser) == ["status --new-option"]


@pytest.mark.parametrize(
    ("name", "parser"), list(subparsers()), ids=[name for name, _ in subparsers()]
)
def test_every_choice_option_refuses_a_bad_value_with_a_usage_error(
    name: str, parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]
) -> None:
    """An option with choices given a value outside them exits 2 with a usage message."""
    for action in parser._actions:
        if not action.choices or not action.option_strings:
            continue
        with pytest.raises(SystemExit) as exited:
            cli.main([name, action.option_strings[0], "bogus", "-c", "x.toml"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "invalid choice: 'bogus'" in err and "usage:" in err
        assert "Traceback" not in err


def test_run_log_level_bogus_is_a_usage_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``run --log-level bogus`` exits 2 before anything runs; any case of a real level passes."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "-c", "x.toml", "--log-level", "bogus"])
    assert exited.value.code == 2
    assert "--log-level: invalid choice: 'bogus'" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["run", "-c", "x.toml", "--log-level", "WARNING"])
    assert args.log_level == "warning"


def test_log_level_choices_are_the_ones_logging_accepts() -> None:
    """The parser's level list is the logging module's, so no accepted value can fail later."""
    assert set(cli.LOG_LEVELS) == set(logs.LEVEL_NAMES)


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "-c", "x.toml", "--watch", "--interval", "-1"],
        ["status", "-c", "x.toml", "--interval", "nan"],
        ["stop", "-c", "x.toml", "--timeout", "0"],
        ["demo", "--hosts", "1"],
        ["demo", "--duration", "-5"],
        ["preflight", "-c", "x.toml", "--host-timeout", "0"],
        ["preflight", "-c", "x.toml", "--min-free-mb", "-1"],
        ["status", "-c", "x.toml", "worker-0", "--lines", "-1"],
        ["status", "-c", "x.toml", "worker-0", "--lines", "1001"],
        ["status", "-c", "x.toml", "worker-0", "--lines", "many"],
    ],
    ids=lambda argv: " ".join(argv[:1] + argv[-2:]),
)
def test_numbers_out_of_range_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative, zero or non-number where a positive value belongs exits 2 with usage."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_check_config_takes_c_the_environment_or_the_positional(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """check-config reads ``-c FILE``, ``$REWARD_SUPERVISOR_CONFIG`` or the positional file;
    two different files are refused."""
    parser = cli.build_parser()
    monkeypatch.setenv(cli.CONFIG_ENV, "env.toml")
    assert cli._check_config_path(parser.parse_args(["check-config", "-c", "a.toml"])) == "a.toml"
    assert cli._check_config_path(parser.parse_args(["check-config", "b.toml"])) == "b.toml"
    assert cli._check_config_path(parser.parse_args(["check-config"])) == "env.toml"
    both = parser.parse_args(["check-config", "-c", "a.toml", "b.toml"])
    with pytest.raises(cli.CliError) as refused:
        cli._check_config_path(both)
    assert refused.value.code == cli.Failure.USAGE and refused.value.exit_status == cli.EXIT_USAGE
    monkeypatch.delenv(cli.CONFIG_ENV)
    with pytest.raises(cli.CliError):
        cli._check_config_path(parser.parse_args(["check-config"]))


def test_run_standby_control_socket_and_handover_parse() -> None:
    """``run --standby --control-socket P``, ``status --control-socket P`` and ``handover``
    (with ``--timeout``) parse; without the flags, nothing is overridden."""
    parser = cli.build_parser()
    args = parser.parse_args(["run", "-c", "c.toml", "--standby", "--control-socket", "/r/b.sock"])
    assert (args.standby, args.control_socket) == (True, "/r/b.sock")
    args = parser.parse_args(["run", "-c", "c.toml"])
    assert (args.standby, args.control_socket) == (False, None)
    args = parser.parse_args(["status", "-c", "c.toml", "--control-socket", "/r/b.sock"])
    assert args.control_socket == "/r/b.sock"
    args = parser.parse_args(["handover", "-c", "c.toml", "--timeout", "12", "--json"])
    assert (args.handler, args.timeout, args.json) == (cli.cmd_handover, 12.0, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["handover", "-c", "c.toml", "--timeout", "0"])
