"""The daemon's process ends once it has stopped: ``daemon.stopped`` is its last line, written
after everything else, and nothing after it can hold the process open."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: A process run as ``reward-supervisor run`` runs, by ``process.run_process``, whose main
#: logs in the background and leaves a thread behind that will never end and is no daemon
#: thread: the interpreter's own exit would wait for it for ever.
PROGRAM = """
import atexit
import sys
import threading
from pathlib import Path

import structlog

from supervisor import logs
from supervisor.process import run_process

logs.configure("json", "info", background=True)
atexit.register(Path(sys.argv[1]).write_text, "atexit handlers ran")


async def main() -> int:
    threading.Thread(target=threading.Event().wait, name="never-ends").start()
    for i in range(200):
        structlog.get_logger().info("main.working", i=i)
    return 7


run_process(main, stopped=lambda: {"role": "leader"})
"""


def test_the_process_ends_with_daemon_stopped_as_its_last_line(tmp_path: Path) -> None:
    """The exit code is main's, every line main logged is written, ``daemon.stopped`` (with
    the exit code and the caller's fields) comes last, the atexit handlers ran (the log
    writer's flush; coverage's data under the tests), and a thread that never ends does
    not keep the process alive."""
    marker = tmp_path / "atexit"
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(marker)],
        capture_output=True,
        text=True,
        timeout=60,  # the old exit waited for the thread for ever
        check=False,
    )
    assert result.returncode == 7, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["i"] for line in lines if line["event"] == "main.working"] == list(range(200))
    assert lines[-1]["event"] == "daemon.stopped"
    assert (lines[-1]["exit_code"], lines[-1]["role"]) == (7, "leader")
    assert marker.read_text() == "atexit handlers ran"
