"""Offline status speaks the seed's terms: its verdict per host, and a table that shows it."""

from __future__ import annotations

import pytest

from supervisor import render, view
from supervisor.statusfiles import StatusProblem, StatusRecord

FRESH = StatusRecord(pid=7, ready=True, heartbeat_at=1.0, seq=None)
NOT_READY = StatusRecord(pid=7, ready=False, heartbeat_at=1.0, seq=None)


@pytest.mark.parametrize(
    ("record", "age_s", "verdict"),
    [
        (FRESH, 1.0, "ok"),
        (FRESH, 15.0, "ok"),  # the seed's test is "older than", not "as old as"
        (FRESH, 15.01, "heartbeat_stale"),
        # Stale is judged before ready, as the seed did.
        (NOT_READY, 99.0, "heartbeat_stale"),
        (NOT_READY, 1.0, "not_ready"),
        (StatusProblem("missing"), None, "status_missing"),
        (StatusProblem("not JSON"), 1.0, "status_bad"),
        (StatusProblem("missing pid"), 1.0, "status_bad"),
        (FRESH, None, "status_missing"),
    ],
)
def test_seed_verdict_matches_the_seeds_order_of_checks(
    record: StatusRecord | StatusProblem, age_s: float | None, verdict: str
) -> None:
    """Missing, unreadable, stale, not ready, ok: the seed's reasons, in its order."""
    assert view.seed_verdict(record, age_s, 15.0) == verdict
    assert verdict in view.SEED_VERDICTS


def test_offline_table_shows_the_verdict_pids_and_the_stop_sentinel() -> None:
    """Without a daemon the table has a VERDICT column, both pids and the sentinel note."""
    status = {
        "daemon": {"running": False, "note": "daemon not running: files only"},
        "hosts": {
            "worker-0": {
                "shard": 0,
                "verdict": "ok",
                "pid": 41,
                "status_pid": 41,
                "heartbeat_age_s": 0.5,
                "last_reason": "ready (status pid 41)",
                "stop_sentinel": False,
            },
            "worker-1": {
                "shard": 1,
                "verdict": "status_missing",
                "pid": None,
                "status_pid": None,
                "heartbeat_age_s": None,
                "last_reason": "missing",
                "stop_sentinel": True,
            },
        },
    }
    lines = render.render_table(status).splitlines()
    assert lines[0] == "daemon not running: files only"
    assert lines[1].split() == ["HOST", "SHARD", "VERDICT", "PID", "STATUS", "PID", "BEAT", "NOTE"]
    assert lines[2].split()[:6] == ["worker-0", "0", "ok", "41", "41", "0.5s"]
    assert lines[3].split()[:6] == ["worker-1", "1", "status_missing", "-", "-", "-"]
    assert "ctl/worker-1.stop present" in lines[3]
