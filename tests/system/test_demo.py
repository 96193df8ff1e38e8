"""The README's first command works: the demo recovers both faults and loses no task."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.system


def test_demo_runs_to_completion_with_zero_lost_tasks() -> None:
    """``reward-supervisor demo`` exits 0, reports every task done (ok, rightly scored) and
    both faults healed."""
    result = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "demo", "--duration", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    found = re.search(r"tasks submitted: (\d+)", out)
    assert found is not None, out
    submitted = int(found.group(1))
    completed = re.search(r"tasks completed: (\d+) \(lost: (\d+), left in inbox: (\d+)\)", out)
    assert completed is not None, out
    assert int(completed.group(1)) == submitted > 0
    assert completed.group(2) == "0"
    assert completed.group(3) == "0"
    # Every result the real record, ok, with the score the task's answer calls for.
    scored = re.search(r"results: (\d+) ok \((\d+) scored 1\.0\), (\d+) errors, (\d+) wrong", out)
    assert scored is not None, out
    assert int(scored.group(1)) == submitted and int(scored.group(2)) > 0
    assert (scored.group(3), scored.group(4)) == ("0", "0")
    assert re.search(r"fault kill -9 on demo-\d: recovered in [\d.]+s", out), out
    assert re.search(r"fault hang \(SIGSTOP\) on demo-\d: recovered in [\d.]+s", out), out
    assert "result: OK" in out
