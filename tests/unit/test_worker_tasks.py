"""Task records, reward calls, result records and reward-fn imports of the reference worker."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from supervisor.demo import worker
from supervisor.demo.worker import (
    BadTask,
    Job,
    MalformedTask,
    Outcome,
    RewardFnError,
    call_reward,
    exact_match,
    is_task_name,
    load_reward_fn,
    make_result,
    parse_task,
    percentile,
    run_job,
)

#: A task as ``areal.reward.fs_protocol.build_task`` writes it (FSRewardClient's args).
REAL_TASK: dict[str, Any] = {
    "schema_version": 1,
    "task_id": "0f3c",
    "reward_fn": "supervisor.demo.worker.exact_match",
    "args": ["What is 6 x 7?", "It is 42.", [], []],
    "kwargs": {"answer": "42"},
    "created_at": 1700000000.5,
}


@pytest.mark.parametrize(
    ("completions", "answer", "score"),
    [
        ("It is 42.", "42", 1.0),
        ("It is 41.", "42", 0.0),
        (["a", "42"], 42, 1.0),  # str() of both, as AReaL's simple reward does
        ("It is 42.", None, 0.0),  # no answer: nothing can match
    ],
)
def test_exact_match_finds_the_answer_in_the_completions(
    completions: object, answer: object, score: float
) -> None:
    """exact_match is 1.0 exactly when str(answer) occurs in str(completions)."""
    assert exact_match("prompt", completions, [], [], answer=answer) == score


def test_exact_match_takes_the_trainer_s_call_shape() -> None:
    """The client's positional args (prompt, completions, prompt_ids, completion_ids) and
    extra keyword fields are accepted."""
    assert exact_match(*REAL_TASK["args"], **REAL_TASK["kwargs"], extra="x") == 1.0
    assert exact_match("p", "42") == 0.0


def test_the_real_task_record_parses() -> None:
    """Every field of the real task record is read as written."""
    task = parse_task(json.dumps(REAL_TASK).encode(), "0f3c")
    assert task == worker.Task(
        task_id="0f3c",
        reward_fn="supervisor.demo.worker.exact_match",
        args=["What is 6 x 7?", "It is 42.", [], []],
        kwargs={"answer": "42"},
        created_at=1700000000.5,
    )


def test_task_id_defaults_to_the_file_stem_and_the_record_s_id_wins() -> None:
    """A record without task_id (or an empty one) is named after its file; else its own id
    names the result, as the real worker does."""
    bare = {"reward_fn": "m.f"}
    assert parse_task(json.dumps(bare).encode(), "t-7").task_id == "t-7"
    assert parse_task(json.dumps({**bare, "task_id": ""}).encode(), "t-7").task_id == "t-7"
    assert parse_task(json.dumps({**bare, "task_id": "abc"}).encode(), "t-7").task_id == "abc"


def test_missing_args_kwargs_and_created_at_have_defaults() -> None:
    """No args is [], no kwargs is {}, a created_at that is no finite number is None."""
    for created in (None, "soon", True, math.nan):
        task = parse_task(json.dumps({"reward_fn": "m.f", "created_at": created}).encode(), "s")
        assert (task.args, task.kwargs, task.created_at) == ([], {}, None)


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b'{"task_id": "a",'])
def test_bytes_that_are_not_json_are_malformed(data: bytes) -> None:
    """Bytes that are not (yet) JSON raise MalformedTask: a writer may still be at it."""
    with pytest.raises(MalformedTask):
        parse_task(data, "stem")


@pytest.mark.parametrize(
    ("record", "answered_as", "needle"),
    [
        ([1, 2], "stem", "not an object"),
        ({"task_id": 7, "reward_fn": "m.f"}, "stem", "task_id is int"),
        ({"task_id": "../escape", "reward_fn": "m.f"}, "stem", "cannot name a result file"),
        ({"task_id": ".hidden", "reward_fn": "m.f"}, "stem", "cannot name a result file"),
        ({"task_id": "t"}, "t", "reward_fn is not an import path"),
        ({"task_id": "t", "reward_fn": " "}, "t", "reward_fn is not an import path"),
        ({"task_id": "t", "reward_fn": "m.f", "args": "abc"}, "t", "args is str"),
        ({"task_id": "t", "reward_fn": "m.f", "kwargs": [1]}, "t", "kwargs is list"),
    ],
)
def test_json_that_is_no_task_record_is_a_bad_task_answered_by_its_id(
    record: object, answered_as: str, needle: str
) -> None:
    """JSON that is not a usable task record raises BadTask, naming the id its error result
    goes to: the record's own id when usable, else the file stem."""
    with pytest.raises(BadTask, match=needle) as info:
        parse_task(json.dumps(record).encode(), "stem")
    assert info.value.task_id == answered_as


def test_call_reward_scores_numbers_as_floats() -> None:
    """A reward fn's numeric answer (bool, int or float) becomes an ok float score."""
    assert call_reward(lambda: True, [], {}) == Outcome("ok", 1.0, None)
    assert call_reward(lambda a, b=0: a + b, [1], {"b": 2}) == Outcome("ok", 3.0, None)


def _raises_key_error(*args: object, **kwargs: object) -> float:
    """A reward fn that fails the way a bad dataset row makes real ones fail."""
    raise KeyError("missing")


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (_raises_key_error, "KeyError: 'missing'"),
        (lambda: "1.0", "returned str, not a number"),
        (lambda: None, "returned NoneType, not a number"),
        (lambda: math.nan, "not a finite number"),
        (lambda: math.inf, "not a finite number"),
        (lambda x: x, "TypeError"),  # called with the wrong arguments
    ],
)
def test_call_reward_turns_failures_into_error_outcomes(fn: Any, needle: str) -> None:
    """A raising fn or a non-number answer is an error outcome (no score) naming the cause."""
    outcome = call_reward(fn, [], {})
    assert (outcome.status, outcome.score) == ("error", None)
    assert outcome.error is not None and needle in outcome.error


def test_run_job_imports_the_task_s_fn_and_measures_the_call() -> None:
    """A pool call imports the task's reward fn by path, scores it and times it."""
    job = Job(
        task_id="t", reward_fn=REAL_TASK["reward_fn"], args=["p", "42"], kwargs={"answer": 42}
    )
    outcome = run_job(job)
    assert (outcome.status, outcome.score, outcome.error) == ("ok", 1.0, None)
    assert outcome.verify_ms is not None and outcome.verify_ms >= 0


def test_run_job_answers_an_unimportable_fn_with_an_error() -> None:
    """A reward fn that cannot be imported is that task's error, not an exception."""
    outcome = run_job(Job(task_id="t", reward_fn="no_such_module_xyz.fn", args=[], kwargs={}))
    assert (outcome.status, outcome.score) == ("error", None)
    assert outcome.error is not None and "No module named 'no_such_module_xyz'" in outcome.error


def test_result_is_the_real_record() -> None:
    """Results carry exactly the real worker's fields; total is queue wait plus verify."""
    ok = make_result(
        task_id="t",
        outcome=Outcome("ok", 1.0, None, verify_ms=2.5),
        queue_wait_ms=10.0,
        host="h",
        shard=2,
        finished_at=5.0,
    )
    assert ok == {
        "schema_version": 1,
        "task_id": "t",
        "status": "ok",
        "score": 1.0,
        "error": None,
        "queue_wait_ms": 10.0,
        "verify_ms": 2.5,
        "total_ms": 12.5,
        "worker_host": "h",
        "shard": 2,
        "finished_at": 5.0,
    }
    bad = make_result(
        task_id="t",
        outcome=Outcome("error", None, "x" * 5000),
        queue_wait_ms=None,
        host="h",
        shard=2,
        finished_at=5.0,
    )
    assert (bad["score"], bad["queue_wait_ms"], bad["verify_ms"], bad["total_ms"]) == (None,) * 4
    assert len(bad["error"]) == worker.MAX_ERROR_CHARS
    assert json.loads(json.dumps(bad)) == bad


def test_percentile_is_nearest_rank() -> None:
    """Percentiles pick a sample (nearest rank), None for no samples."""
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 51.0  # round(0.5 * 99) = 50 (banker's), index 50
    assert percentile(reversed(samples), 95) == 95.0
    assert percentile(samples, 100) == 100.0


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
