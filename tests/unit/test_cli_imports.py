"""A command imports what it needs: ``import supervisor.cli``, and the commands that only read
a config and ask the daemon, import no core, no SSH, no logging and no event loop, so that
they start fast
(how fast is ``bench/bench_cli.py``'s); a command that does read the run root sets up its
logs first, so that a library's log line never lands in its answer on stdout.

Each case runs in a fresh interpreter and reports the modules it ended with: structural, so
that the start cannot slow down again without a test saying which import did it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.canned import CannedDaemon, config_with_socket

REPO = Path(__file__).resolve().parents[2]

#: What a command that reads a config and asks the daemon never needs: the cores, SSH, the
#: logging stack, the control server, the daemon-side status views, an event loop.
HEAVY = frozenset(
    {
        "supervisor.fleet",
        "supervisor.health",
        "supervisor.leadership",
        "supervisor.control",
        "supervisor.view",
        "supervisor.logs",
        "supervisor.remote",
        "asyncssh",
        "structlog",
        "asyncio",
    }
)

# In the child: run the command (or only import the CLI), then report what was imported and
# whether structlog, if it was, had been set up.
CHILD = """
import json, sys
argv, out = json.loads(sys.argv[1]), sys.argv[2]
code = None
if argv is None:
    import supervisor.cli
else:
    from supervisor import cli
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
structlog = sys.modules.get("structlog")
with open(out, "w") as f:
    json.dump({
        "code": code,
        "modules": sorted(sys.modules),
        "structlog_configured": structlog is not None and structlog.is_configured(),
    }, f)
"""

STATUS: dict[str, Any] = {
    "ok": True,
    "daemon": {"pid": 4242, "summary": "2/2 ready", "all_ready": True, "root": "/r"},
    "hosts": {
        "worker-0": {"state": "ready", "shard": 0, "pid": 11, "ssh": "connected"},
        "worker-1": {"state": "ready", "shard": 1, "pid": 12, "ssh": "connected"},
    },
}
REPLIES: dict[str, Any] = {
    "status": STATUS,
    "ping": {"ok": True, "pid": 4242},
    "restart-host": {"ok": True, "host": "worker-0", "state": "stale", "last_reason": "operator"},
    "drain": {"ok": True, "label": "worker-0", "shard": 0, "to": "spare-0"},
    "reload": {"ok": True, "reloaded": True, "errors": []},
    "unfreeze": {"ok": True, "frozen": False, "was_frozen": False},
}


def run_child(argv: list[str] | None, tmp_path: Path) -> tuple[dict[str, Any], str]:
    """Run ``argv`` (None: only ``import supervisor.cli``) in a fresh interpreter; its
    report and its stdout."""
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(argv), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.exists(), done.stderr
    report: dict[str, Any] = json.loads(out.read_text())
    return report, done.stdout


@pytest.fixture
def daemon() -> Iterator[CannedDaemon]:
    """A control socket answering the commands of ``REPLIES``."""
    with CannedDaemon(REPLIES) as canned:
        yield canned


def test_importing_the_cli_imports_no_core_no_ssh_no_logging_no_event_loop(
    tmp_path: Path,
) -> None:
    """``import supervisor.cli`` brings in none of the heavy modules."""
    report, _ = run_child(None, tmp_path)
    assert HEAVY.isdisjoint(report["modules"]), HEAVY & set(report["modules"])


def test_status_of_a_missing_config_fails_before_any_heavy_import(tmp_path: Path) -> None:
    """``status -c MISSING`` exits 2 having imported none of the heavy modules."""
    report, _ = run_child(["status", "-c", str(tmp_path / "missing.toml")], tmp_path)
    assert report["code"] == 2
    assert HEAVY.isdisjoint(report["modules"]), HEAVY & set(report["modules"])


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["status", "--json"],
        ["restart-host", "worker-0"],
        ["restart-host", "worker-0", "--json"],
        ["drain", "worker-0"],
        ["reload"],
        ["unfreeze"],
        ["wait-ready", "--timeout", "30"],
    ],
    ids=" ".join,
)
def test_a_command_that_asks_the_daemon_imports_no_core_no_ssh_no_logging(
    argv: list[str], daemon: CannedDaemon, tmp_path: Path
) -> None:
    """A command answered by the daemon succeeds having imported only what asks and shows
    (over a blocking socket: no event loop either)."""
    config = config_with_socket(tmp_path, daemon.path)
    report, _ = run_child([*argv, "-c", str(config)], tmp_path)
    assert report["code"] == 0
    assert daemon.requests, "the command never reached the socket"
    assert HEAVY.isdisjoint(report["modules"]), HEAVY & set(report["modules"])


@pytest.mark.parametrize(
    "argv",
    [["status", "--json"], ["status", "worker-0", "--json"], ["check-config", "--json"]],
    ids=" ".join,
)
def test_a_command_that_may_log_sets_up_its_logs_first(argv: list[str], tmp_path: Path) -> None:
    """A command that reads the run root (``status`` with no daemon) or reaches the SSH side
    (``check-config`` looks for the reward fn) imports modules that may log: the logs were
    set up (to stderr) before, and stdout is its one JSON answer."""
    config = config_with_socket(tmp_path, tmp_path / "nobody-listens.sock")
    report, stdout = run_child([*argv, "-c", str(config)], tmp_path)
    # status without a daemon, of a run none has led: not running (3), as init scripts say.
    assert report["code"] == (3 if argv[0] == "status" else 0)
    assert "structlog" not in report["modules"] or report["structlog_configured"]
    answer = json.loads(stdout)
    assert "code" not in answer
    if argv[0] == "status":
        assert answer["daemon"]["running"] is False
        assert answer["daemon"]["why_code"] == "no_daemon"
