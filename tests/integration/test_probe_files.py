"""The probe adapter's files, on a real filesystem: written in the run's task record, read
under the hostile-file rules (no symlink followed, capped, a bad record is an error or a
field read as absent), and swept (only probe files, never a trainer's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor import probes
from supervisor.errors import UnsafeFileError


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A run root with a shard 0 inbox and an outbox."""
    run = tmp_path / "run"
    (run / "inbox" / "0").mkdir(parents=True)
    (run / "outbox").mkdir()
    return run


def test_a_probe_task_is_the_run_s_task_record_under_a_recognisable_id(root: Path) -> None:
    """The written task is the configured record plus its id and creation time, under a
    name no trainer task id (32 hex digits) can have, and no temp file is left."""
    task_id = probes.probe_id(0)
    probes.write_task(root, 0, task_id, '{"schema_version":1,"reward_fn":"m.f","args":[1]}')
    record = json.loads((root / "inbox" / "0" / f"{task_id}.json").read_text())
    assert record["task_id"] == task_id and record["reward_fn"] == "m.f"
    assert record["args"] == [1] and isinstance(record["created_at"], float)
    assert task_id.startswith("rsprobe-0-") and "-" not in task_id.removeprefix("rsprobe-0-")
    assert os.listdir(root / "inbox" / "0") == [f"{task_id}.json"]


def test_a_result_is_read_only_when_it_is_a_regular_json_object(root: Path) -> None:
    """No result yet is None; a symlink planted as the result is refused, not followed; a
    record that is not an object, or too big, is an error naming it."""
    assert probes.read_result(root, "rsprobe-0-a") is None
    secret = root.parent / "secret.json"
    secret.write_text('{"status": "ok", "score": 1.0}')
    (root / "outbox" / "rsprobe-0-b.json").symlink_to(secret)
    with pytest.raises(UnsafeFileError):
        probes.read_result(root, "rsprobe-0-b")
    (root / "outbox" / "rsprobe-0-c.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        probes.read_result(root, "rsprobe-0-c")
    (root / "outbox" / "rsprobe-0-d.json").write_text(" " * (probes.RESULT_MAX_BYTES + 10))
    with pytest.raises(ValueError, match=r"rsprobe-0-d"):
        probes.read_result(root, "rsprobe-0-d")


def test_an_answer_takes_each_field_only_of_the_right_type() -> None:
    """A status that is no string is an error, a score that is no finite number is none,
    the error text is cut to its cap, and no record at all is unanswered."""
    odd = probes.answer_of(7, {"status": 3, "score": True, "error": "x" * 5000}, None, 0.2)
    assert (odd.pid, odd.status, odd.score, odd.round_trip_s) == (7, "error", None, 0.2)
    assert odd.error is not None and len(odd.error) == probes.ERROR_MAX_CHARS
    inf = probes.answer_of(7, {"status": "ok", "score": float("inf")}, None, 0.1)
    assert (inf.status, inf.score) == ("ok", None)
    ok = probes.answer_of(7, {"status": "ok", "score": 1}, None, 0.1)
    assert (ok.status, ok.score, ok.error) == ("ok", 1.0, None)
    none = probes.answer_of(7, None, "no result within 20s", 20.0)
    assert (none.status, none.error) == (None, "no result within 20s")


def test_the_sweep_removes_probe_files_only_and_names_the_tasks_it_took(root: Path) -> None:
    """Probe tasks, results and temp files go; a trainer's task and result stay; the
    inbox probe ids are returned by shard (their results may still come)."""
    trainer_id = "0123456789abcdef0123456789abcdef"
    (root / "inbox" / "0" / f"{trainer_id}.json").write_text("{}")
    (root / "outbox" / f"{trainer_id}.json").write_text("{}")
    (root / "inbox" / "0" / "rsprobe-0-aa.json").write_text("{}")
    (root / "inbox" / "0" / ".rsprobe-0-bb.json.1234.tmp").write_text("{")
    (root / "outbox" / "rsprobe-0-cc.json").write_text("{}")
    removed, taken = probes.sweep(root)
    assert removed == 3
    assert taken == {0: ["rsprobe-0-aa"]}
    assert os.listdir(root / "inbox" / "0") == [f"{trainer_id}.json"]
    assert os.listdir(root / "outbox") == [f"{trainer_id}.json"]


def test_the_sweep_does_not_follow_a_planted_symlink_directory(root: Path) -> None:
    """A shard inbox that is a symlink elsewhere is not entered: what it points at stays."""
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rsprobe-1-aa.json").write_text("{}")
    (root / "inbox" / "1").symlink_to(elsewhere)
    probes.sweep(root)
    assert os.listdir(elsewhere) == ["rsprobe-1-aa.json"]


def test_late_results_are_removed_once_they_exist(root: Path) -> None:
    """Of the results still owed, those written are removed and named; the others wait."""
    (root / "outbox" / "rsprobe-0-aa.json").write_text("{}")
    assert probes.remove_results(root, ["rsprobe-0-aa", "rsprobe-0-bb"]) == ["rsprobe-0-aa"]
    assert os.listdir(root / "outbox") == []
