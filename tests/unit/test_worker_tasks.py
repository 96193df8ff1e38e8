"""Task parsing, reward evaluation, results and reward-fn resolution of the reference worker."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from supervisor.demo import worker
from supervisor.demo.worker import (
    MalformedTask,
    RewardFnError,
    evaluate,
    exact_match,
    is_task_name,
    load_reward_fn,
    make_result,
    parse_task,
    reward_fn_spec,
)


@pytest.mark.parametrize(
    ("task", "reward"),
    [
        ({"answer": "42", "reference": "42"}, 1.0),
        ({"answer": " 42\n", "reference": "42 "}, 1.0),
        ({"answer": "41", "reference": "42"}, 0.0),
        ({"answer": 42, "reference": "42"}, 1.0),
        ({"answer": "42"}, 0.0),
        ({}, 1.0),  # both missing: str(None) == str(None)
    ],
)
def test_exact_match_compares_stripped_strings(task: dict[str, Any], reward: float) -> None:
    """exact_match is 1.0 exactly when str(answer).strip() == str(reference).strip()."""
    assert exact_match(task) == reward


def test_task_id_defaults_to_file_stem() -> None:
    """A task without an id is named after its file."""
    assert parse_task(b'{"answer": "1"}', "t-7") == ("t-7", {"answer": "1"})


def test_task_id_from_json_wins_and_integers_are_accepted() -> None:
    """An explicit id (string or integer) names the result, whatever the file is called."""
    assert parse_task(b'{"id": "abc"}', "stem")[0] == "abc"
    assert parse_task(b'{"id": 12}', "stem")[0] == "12"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"\xff\xfe",
        b"[1, 2]",
        b'"text"',
        b'{"id": null}',
        b'{"id": true}',
        b'{"id": ["a"]}',
        b'{"id": ""}',
        b'{"id": "../escape"}',
        b'{"id": ".hidden"}',
    ],
)
def test_malformed_tasks_are_refused(data: bytes) -> None:
    """Bytes that are not a JSON object with an id usable as a file name raise MalformedTask."""
    with pytest.raises(MalformedTask):
        parse_task(data, "stem")


def test_evaluate_returns_the_reward_as_float() -> None:
    """A reward fn's numeric answer (bool, int or float) becomes a float with no error."""
    assert evaluate({}, lambda task: True) == (1.0, None)
    assert evaluate({}, lambda task: 3) == (3.0, None)
    assert evaluate({}, lambda task: 0.5) == (0.5, None)


def _raises_key_error(task: Mapping[str, Any]) -> float:
    """A reward fn that fails the way a bad dataset row makes real ones fail."""
    return float(task["missing"])


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (_raises_key_error, "KeyError: 'missing'"),
        (lambda task: "1.0", "str, not a number"),
        (lambda task: None, "NoneType, not a number"),
        (lambda task: math.nan, "not a finite number"),
        (lambda task: math.inf, "not a finite number"),
    ],
)
def test_evaluate_turns_failures_into_zero_reward_with_error(fn: Any, needle: str) -> None:
    """A raising fn or a non-number answer yields reward 0.0 and an error naming the cause."""
    reward, error = evaluate({}, fn)
    assert reward == 0.0
    assert error is not None
    assert needle in error


def test_result_has_the_contract_fields_and_error_only_when_failed() -> None:
    """Results carry id, reward, host, shard, pid, finished_at; error only for failures."""
    ok = make_result(task_id="t", reward=1.0, error=None, host="h", shard=2, pid=9, finished_at=5.0)
    assert ok == {"id": "t", "reward": 1.0, "host": "h", "shard": 2, "pid": 9, "finished_at": 5.0}
    bad = make_result(
        task_id="t", reward=0.0, error="KeyError: 'x'", host="h", shard=2, pid=9, finished_at=5.0
    )
    assert bad["error"] == "KeyError: 'x'"
    assert json.loads(json.dumps(bad)) == bad


@pytest.mark.parametrize(
    ("name", "taken"),
    [
        ("a.json", True),
        ("task-001.json", True),
        (".a.json", False),
        (".json", False),
        ("a.json.tmp", False),
        ("a.JSON", False),
        ("a.txt", False),
    ],
)
def test_only_visible_json_files_are_tasks(name: str, taken: bool) -> None:
    """Temp and hidden files written by atomic writers are never taken as tasks."""
    assert is_task_name(name) is taken


@pytest.mark.parametrize("spec", [None, "", "exact_match", " exact_match "])
def test_builtin_reward_fn_is_the_default(spec: str | None) -> None:
    """No spec, or the name exact_match, selects the built-in reward fn."""
    assert load_reward_fn(spec) is exact_match


@pytest.mark.parametrize(
    "spec", ["supervisor.demo.worker.exact_match", "supervisor.demo.worker:exact_match"]
)
def test_reward_fn_loads_from_dotted_and_colon_paths(spec: str) -> None:
    """Both pkg.mod.func and pkg.mod:func name the same callable."""
    assert load_reward_fn(spec) is worker.exact_match


def test_reward_fn_colon_form_reaches_nested_attributes() -> None:
    """pkg.mod:Class.attr walks attributes after the colon."""
    expected: object = json.JSONDecoder.decode
    assert load_reward_fn("json:JSONDecoder.decode") is expected


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nodots", "expected pkg.mod.func"),
        ("pkg.mod:", "expected pkg.mod.func"),
        ("no_such_module_xyz.fn", "cannot import 'no_such_module_xyz'"),
        ("supervisor.demo.worker.no_such_fn", "has no attribute 'no_such_fn'"),
        ("supervisor.demo.worker.IDLE_POLL_S", "not callable"),
    ],
)
def test_unusable_reward_fn_raises_with_the_spec_and_cause(spec: str, needle: str) -> None:
    """A reward fn that cannot be imported or called raises RewardFnError naming it."""
    with pytest.raises(RewardFnError, match=needle):
        load_reward_fn(spec)


def test_reward_fn_spec_prefers_flag_then_manifest(tmp_path: Path) -> None:
    """The flag wins; without it the manifest's reward_fn is used; without both, None."""
    assert reward_fn_spec(None, tmp_path) is None
    (tmp_path / "manifest.json").write_text(json.dumps({"reward_fn": "m.f"}))
    assert reward_fn_spec(None, tmp_path) == "m.f"
    assert reward_fn_spec("flag.f", tmp_path) == "flag.f"
    (tmp_path / "manifest.json").write_text(json.dumps({"run_id": "x"}))
    assert reward_fn_spec(None, tmp_path) is None


@pytest.mark.parametrize("content", ["{not json", "[1]", '{"reward_fn": 3}'])
def test_unusable_manifest_is_a_reward_fn_error(tmp_path: Path, content: str) -> None:
    """A manifest that exists but cannot say which reward fn to use is fatal, not ignored."""
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(RewardFnError, match=r"manifest\.json"):
        reward_fn_spec(None, tmp_path)
