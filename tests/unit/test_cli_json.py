"""The CLI's failures as a program sees them: a code beside the message, from the daemon's
refusal through the client to ``--json`` (exactly one object on stdout, success or
failure) and the exit status the code maps to. Asserted by code, never by wording."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from supervisor import cli, logs
from supervisor.refusals import Refusal
from tests.canned import CannedDaemon, config_with_socket

Capsys = pytest.CaptureFixture[str]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """A command run here may set up the logs (to stderr, at warning): put structlog and
    the root logger back afterwards, for the tests that capture logs after these."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    logs.stop_background()
    structlog.reset_defaults()
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)


def run(argv: list[str], capsys: Capsys) -> tuple[int, Any]:
    """``reward-supervisor ARGV`` in this process: its exit status and the one JSON object
    it printed (``json.loads`` refuses a second one, or none)."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = int(exc.code or 0)
    return status, json.loads(capsys.readouterr().out)


def refusing(code: object, message: str = "refused") -> dict[str, Any]:
    """A daemon's refusal on the wire."""
    return {"ok": False, "code": code, "error": message}


@pytest.fixture
def nobody(tmp_path: Path) -> Path:
    """A config whose control socket nobody serves."""
    return config_with_socket(tmp_path, tmp_path / "absent.sock")


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "worker-0", "--lines", "0"],
        ["restart-host", "worker-0"],
        ["stop-host", "worker-0"],
        ["start-host", "worker-0"],
        ["drain", "worker-0"],
        ["undrain", "worker-0"],
        ["reload"],
        ["stop"],
        ["unfreeze"],
        ["handover"],
        ["events"],
    ],
    ids=" ".join,
)
def test_with_no_daemon_every_command_prints_one_failure_object_and_exits_3(
    argv: list[str], nobody: Path, capsys: Capsys
) -> None:
    """No daemon: ``{"ok": false, "code": "no_daemon", "error": ...}`` and exit 3 (``status
    HOST`` shows the files instead, says why by the same code, and exits 3 too: not
    running, as an init script's status says it)."""
    status, answer = run([*argv, "-c", str(nobody), "--json"], capsys)
    if argv[0] == "status":
        assert status == cli.EXIT_NO_DAEMON and answer["daemon"]["why_code"] == Refusal.NO_DAEMON
        return
    assert status == cli.EXIT_NO_DAEMON
    assert answer["ok"] is False and answer["code"] == Refusal.NO_DAEMON
    assert isinstance(answer["error"], str) and answer["error"]


@pytest.mark.parametrize(
    ("code", "exit_status"),
    [
        (Refusal.UNKNOWN_HOST, cli.EXIT_USAGE),
        (Refusal.SENTINEL_HELD, cli.EXIT_FAILED),
        (Refusal.NOT_LEADER, cli.EXIT_FAILED),
        (Refusal.UNAVAILABLE, cli.EXIT_FAILED),
        (Refusal.SHUTTING_DOWN, cli.EXIT_FAILED),
        (Refusal.BAD_REQUEST, cli.EXIT_FAILED),
        ("a_code_from_a_newer_daemon", cli.EXIT_FAILED),
    ],
)
def test_a_daemons_refusal_code_reaches_json_and_the_exit_status(
    code: str, exit_status: int, tmp_path: Path, capsys: Capsys
) -> None:
    """The daemon's code, whatever it is, is the CLI's ``code``; the exit status follows
    from it (an unknown host is a usage error wherever it is found); the message passes."""
    with CannedDaemon({"restart-host": refusing(code, "the daemon says why")}) as daemon:
        config = config_with_socket(tmp_path, daemon.path)
        status, answer = run(["restart-host", "-c", str(config), "worker-0", "--json"], capsys)
    assert (status, answer["ok"], answer["code"]) == (exit_status, False, code)
    assert answer["error"] == "the daemon says why"
    assert status == cli.exit_status(code)


@pytest.mark.parametrize(
    "reply",
    [
        {"ok": False, "error": "an older daemon gives no code"},
        refusing("x" * 41),
        refusing("Not_A_Code"),
        refusing("two words"),
        refusing(7),
        refusing(""),
    ],
    ids=["none", "too long", "upper case", "a space", "a number", "empty"],
)
def test_a_reply_without_a_usable_code_is_a_plain_failure(
    reply: Mapping[str, Any], tmp_path: Path, capsys: Capsys
) -> None:
    """No code, or something that is not one: ``failed``, exit 1; never echoed as a code."""
    with CannedDaemon({"unfreeze": reply}) as daemon:
        config = config_with_socket(tmp_path, daemon.path)
        status, answer = run(["unfreeze", "-c", str(config), "--json"], capsys)
    assert (status, answer["code"]) == (cli.EXIT_FAILED, Refusal.FAILED)


def test_a_host_not_in_the_config_is_refused_before_the_daemon_is_asked(
    tmp_path: Path, capsys: Capsys
) -> None:
    """``restart-host worker-9``: ``unknown_host``, exit 2, and no request was sent."""
    with CannedDaemon({}) as daemon:
        config = config_with_socket(tmp_path, daemon.path)
        status, answer = run(["restart-host", "-c", str(config), "worker-9", "--json"], capsys)
        assert daemon.requests == []
    assert (status, answer["ok"], answer["code"]) == (cli.EXIT_USAGE, False, Refusal.UNKNOWN_HOST)


def test_bad_usage_with_json_prints_one_failure_object_and_exits_2(capsys: Capsys) -> None:
    """argparse's refusal (a missing HOST) still exits 2 with its usage on stderr, and with
    ``--json`` the one object on stdout says ``usage``."""
    status, answer = run(["restart-host", "--json"], capsys)
    assert (status, answer["ok"], answer["code"]) == (cli.EXIT_USAGE, False, cli.Failure.USAGE)


def test_an_invalid_config_is_invalid_config_and_exits_2(tmp_path: Path, capsys: Capsys) -> None:
    """A config that does not validate: ``invalid_config``, exit 2, for a command and for
    ``check-config`` alike."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nroot = 7\n")
    status, answer = run(["restart-host", "-c", str(bad), "worker-0", "--json"], capsys)
    assert (status, answer["code"]) == (cli.EXIT_USAGE, cli.Failure.INVALID_CONFIG)
    status, answer = run(["check-config", str(bad), "--json"], capsys)
    assert (status, answer["ok"], answer["code"]) == (
        cli.EXIT_USAGE,
        False,
        cli.Failure.INVALID_CONFIG,
    )
    assert answer["problems"]


def test_a_refused_reload_is_reload_refused_with_the_daemons_errors(
    tmp_path: Path, capsys: Capsys
) -> None:
    """The daemon keeps its config: ``reload_refused``, exit 1, its errors carried along."""
    refused = {"ok": True, "reloaded": False, "errors": ["c.toml: hosts[1].shard: required"]}
    with CannedDaemon({"reload": refused}) as daemon:
        config = config_with_socket(tmp_path, daemon.path)
        status, answer = run(["reload", "-c", str(config), "--json"], capsys)
    assert (status, answer["ok"], answer["code"]) == (
        cli.EXIT_FAILED,
        False,
        cli.Failure.RELOAD_REFUSED,
    )
    assert answer["errors"] == refused["errors"] and answer["reloaded"] is False


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Path]:
    """A config whose daemon answers every host command, drain, unfreeze and status."""
    row = {"ok": True, "host": "worker-0", "state": "stale", "last_reason": "operator"}
    replies: dict[str, Mapping[str, Any]] = {
        "restart-host": row,
        "stop-host": row,
        "start-host": row,
        "drain": {"ok": True, "label": "worker-0", "shard": 0, "to": "spare-0"},
        "unfreeze": {"ok": True, "frozen": False, "was_frozen": True},
        "status": {"ok": True, "daemon": {"pid": 1}, "hosts": {}},
    }
    with CannedDaemon(replies) as daemon:
        yield config_with_socket(tmp_path, daemon.path)


@pytest.mark.parametrize(
    "argv",
    [
        ["restart-host", "worker-0"],
        ["stop-host", "worker-0"],
        ["start-host", "worker-0"],
        ["drain", "worker-0"],
        ["unfreeze"],
        ["status"],
    ],
    ids=" ".join,
)
def test_a_success_prints_one_object_that_says_ok(
    argv: list[str], served: Path, capsys: Capsys
) -> None:
    """Success: exit 0 and one object with ``"ok": true`` and no ``code``."""
    status, answer = run([*argv, "-c", str(served), "--json"], capsys)
    assert (status, answer["ok"]) == (cli.EXIT_OK, True) and "code" not in answer


def test_wait_ready_says_its_codes_once_in_its_phase_lines(tmp_path: Path, capsys: Capsys) -> None:
    """``wait-ready --json`` prints phase lines; a timeout's is its failure object
    (``not_ready``, exit 1), with no second object after it; no daemon is ``no_daemon``,
    exit 3."""
    waiting = {
        "ok": True,
        "daemon": {"all_ready": False, "root": "/r"},
        "hosts": {"worker-0": {"state": "starting", "last_reason": "launched"}},
    }
    with CannedDaemon({"status": waiting}) as daemon:
        config = config_with_socket(tmp_path, daemon.path)
        status = cli.main(["wait-ready", "-c", str(config), "--json", "--timeout", "0.3"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["phase"] for line in lines] == ["manifest", "timeout"]
    assert (status, lines[-1]["ok"], lines[-1]["code"]) == (
        cli.EXIT_FAILED,
        False,
        cli.Failure.NOT_READY,
    )
    assert lines[-1]["not_ready"]["worker-0"]["state"] == "starting"
    nobody = config_with_socket(tmp_path, tmp_path / "absent.sock")
    status = cli.main(["wait-ready", "-c", str(nobody), "--json", "--timeout", "0.3"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (status, [line["code"] for line in lines]) == (cli.EXIT_NO_DAEMON, ["no_daemon"])


def test_every_code_has_one_meaning_and_an_exit_status() -> None:
    """The daemon's codes and the command line's own never share a value, and each maps to
    one of the four documented exit statuses."""
    refusals = {str(c) for c in Refusal}
    failures = {str(c) for c in cli.Failure}
    assert refusals.isdisjoint(failures)
    statuses = {cli.exit_status(code) for code in refusals | failures}
    assert statuses == {cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_NO_DAEMON}
