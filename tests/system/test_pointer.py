"""``run.pointer_file`` keeps the seed's meaning: written once the fleet is first all ready,
and a failure to write it is reported and retried, never the end of the daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults.harness import events
from tests.sshd import OpenSsh
from tests.system.daemonproc import Daemons, all_ready, fast_config, poll_until, write_config

pytestmark = [pytest.mark.system, pytest.mark.openssh]


async def test_pointer_is_written_only_once_every_host_is_ready(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """While workers start (slowly) there is no pointer; once all are ready it is a copy
    of ctl/launch_meta.json, and status says when it was written."""
    root = tmp_path / "runs" / "run-1"
    pointer = tmp_path / "ws" / "tmp" / "sao-reward-current.json"
    raw = fast_config(openssh, root, 2, tmp_path)
    raw["run"]["pointer_file"] = str(pointer)
    raw["worker"]["env"] = {"REWARD_WORKER_FAULT": "slow_start:ready_after=2"}
    config = write_config(tmp_path / "rs.toml", raw)
    daemon = await daemons.start(config)
    starting = await daemon.wait_status(
        lambda s: any(r.get("state") == "starting" for r in s.get("hosts", {}).values()),
        60,
        "a host starting",
    )
    # One snapshot: a host still starting, and the pointer not written.
    assert starting["daemon"]["pointer"]["written"] is False
    status = await daemon.wait_status(
        lambda s: all_ready(s, 2) and bool(s["daemon"]["pointer"]["written"]),
        60,
        "2 ready and the pointer written",
    )
    assert json.loads(pointer.read_text()) == json.loads(
        (root / "ctl" / "launch_meta.json").read_text()
    )
    assert status["daemon"]["pointer"]["error"] is None
    assert status["daemon"]["pointer"]["written_at"] is not None
    # The log is in the daemon's order: the write began after the last host became ready.
    written = [i for i, x in enumerate(daemon.lines) if x.get("event") == "pointer.written"]
    readied = [
        i
        for i, x in enumerate(daemon.lines)
        if x.get("event") == "host.state" and x.get("to") == "ready"
    ]
    assert len(written) == 1 and len(readied) == 2
    assert written[0] > max(readied)


async def test_an_unwritable_pointer_is_reported_and_retried_not_fatal(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """A pointer whose directory cannot be made leaves the daemon running, shows the error
    in status (JSON and table), and is written by a later retry once the path is fixed."""
    root = tmp_path / "runs" / "run-1"
    blocker = tmp_path / "ws"
    blocker.write_text("a file where the pointer's directory should be\n")
    pointer = blocker / "tmp" / "sao-reward-current.json"
    raw = fast_config(openssh, root, 2, tmp_path)
    raw["run"]["pointer_file"] = str(pointer)
    config = write_config(tmp_path / "rs.toml", raw)
    daemon = await daemons.start(config)
    failing = await daemon.wait_status(
        lambda s: all_ready(s, 2) and (s["daemon"]["pointer"] or {}).get("failures", 0) >= 1,
        60,
        "2 ready and a failed pointer write",
    )
    row = failing["daemon"]["pointer"]
    assert row["written"] is False and row["path"] == str(pointer)
    assert row["error"]
    from supervisor import render

    assert f"pointer file {pointer} not written" in render.render_table(failing)
    line = events(daemon, "pointer.not_written")[0]
    assert line["path"] == str(pointer) and line["level"] == "error"

    blocker.unlink()
    await daemon.wait_status(
        lambda s: bool(s["daemon"]["pointer"]["written"]), 60, "the pointer written on a retry"
    )
    await poll_until(pointer.exists, 10, "the pointer file on disk")
    assert json.loads(pointer.read_text())["root"] == str(root)
    assert daemon.process is not None and daemon.process.returncode is None
