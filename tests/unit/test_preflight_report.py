"""preflight's pure parts: what the worker argv asks for, reading a host's answer (hostile
input), the clock interval, and the report a person or a script reads."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from supervisor import preflight
from supervisor.preflight import CheckName, HostReport, Options, Report, Status

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
KEYS = (
    *("python", "executable", "root_exists", "dirs", "writable", "disk", "module", "reward_fn"),
    "time",
)
GOOD: dict[str, Any] = {
    "preflight": 1,
    "python": "3.11.7",
    "executable": "/usr/bin/python3",
    "root_exists": True,
    "dirs": {".": "match", "ctl": "match", "status": "match"},
    "writable": {"ctl": "ok", "status": "ok"},
    "disk": {"free_bytes": 5 << 30, "free_inodes": 1000},
    "module": {"found": True, "origin": "/opt/w/fs_worker.py"},
    "reward_fn": {"found": True, "origin": "/opt/w/simple_answer.py"},
    "time": 100.9,
    "elapsed_s": 0.5,
}


def evaluate(reply: dict[str, Any], options: Options | None = None) -> dict[CheckName, Any]:
    """``preflight.evaluate`` of ``reply`` sent at 100.0 and answered at 101.0, by name."""
    checks = preflight.evaluate(
        reply,
        address="10.0.0.1:22",
        module="areal.reward.fs_worker",
        module_argv=["python3"],
        sent_wall=100.0,
        answered_wall=101.0,
        options=options or Options(),
        reward_fn="areal.reward.simple_answer.simple_answer_reward_fn",
    )
    assert [c.name for c in checks] == list(CheckName)
    return {c.name: c for c in checks}


def test_the_module_is_the_one_after_dash_m_with_the_interpreter_options() -> None:
    """``python -X utf8 -m mod ...`` checks ``mod`` with ``python -X utf8``; an argv without
    ``-m`` (or with ``-m`` only after a script) checks only its executable."""
    assert preflight.module_target(["py", "-m", "a.b", "--root", "/r"]) == (["py"], "a.b")
    assert preflight.module_target(["py", "-X", "utf8", "-m", "w"]) == (["py", "-X", "utf8"], "w")
    assert preflight.module_target(["/opt/bin/worker", "--x"]) == (["/opt/bin/worker"], None)
    assert preflight.module_target(["py", "run.py", "-m", "x"]) == (["py"], None)
    assert preflight.module_target(["py", "-m"]) == (["py"], None)
    assert preflight.module_target(["py", "-c", "x", "-m", "y"]) == (["py"], None)
    assert preflight.module_target(["py", "-I", "-W", "error", "-m", "z"]) == (
        ["py", "-I", "-W", "error"],
        "z",
    )


def test_a_good_answer_passes_every_check() -> None:
    """Everything as it should be: every check ok, the clock informational."""
    checks = evaluate(GOOD)
    assert {n: c.status for n, c in checks.items()} == {
        n: Status.INFO if n is CheckName.CLOCK else Status.OK for n in CheckName
    }


def test_the_clock_interval_leaves_out_the_hosts_own_work() -> None:
    """Sent at 100.0, answered at 101.0, the host read 100.9 after 0.5 s of work: its
    reading was taken between 100.5 and 101.0 of ours, so the offset is in [-0.1, +0.4]."""
    clock = evaluate(GOOD)[CheckName.CLOCK].values
    assert (round(clock["offset_s"], 6), round(clock["within_s"], 6)) == (0.15, 0.25)


def test_each_bad_answer_fails_its_own_check() -> None:
    """A stranger's nonce, an unwritable status/, little disk, an old python, a missing
    module, a reward fn missing or without its function: each fails the check it belongs
    to, with its code."""
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {"dirs": {".": "missing", "ctl": "missing", "status": "missing"}},
            "run_root",
            "different",
        ),
        ({"root_exists": False, "dirs": {}}, "run_root", "missing"),
        ({"writable": {"ctl": "ok", "status": "EROFS: read-only"}}, "writable", "not_writable"),
        ({"disk": {"free_bytes": 10}}, "disk", "low"),
        ({"python": "3.6.15"}, "python", "too_old"),
        ({"module": {"found": False, "error": "No module named 'x'"}}, "module", "not_found"),
        ({"module": {"found": False, "hung": True}}, "module", "hung"),
        ({"module": {"found": False, "raised": True}}, "module", "import_failed"),
        ({"reward_fn": {"found": False, "error": "No module"}}, "reward_fn", "not_found"),
        ({"reward_fn": {"found": False, "raised": True}}, "reward_fn", "import_failed"),
        ({"reward_fn": {"found": False, "no_function": True}}, "reward_fn", "no_function"),
        ({"reward_fn": {"found": False, "hung": True}}, "reward_fn", "hung"),
        ({"reward_fn": "garbage"}, "reward_fn", "not_found"),
    ]
    for patch, name, code in cases:
        checks = evaluate({**GOOD, **patch})
        failing = [(c.name.value, c.code) for c in checks.values() if c.status is Status.FAIL]
        assert failing == [(name, code)], patch


@given(st.dictionaries(st.sampled_from(KEYS), JSON))
def test_any_answer_from_a_host_gives_a_row_and_never_raises(reply: dict[str, object]) -> None:
    """Whatever types a hostile host puts under each key, every check gets a row."""
    evaluate({"preflight": 1, **reply})


@given(st.text())
def test_parse_reply_never_raises(text: str) -> None:
    """Any output from a host parses to an answer or None."""
    preflight.parse_reply(text)


def test_parse_reply_takes_the_last_answer_and_skips_noise() -> None:
    """rc-file chatter before the answer is skipped; deep nesting and huge lines are not
    parsed; a JSON line that is not hostcheck's is not an answer."""
    answer = json.dumps({"preflight": 1, "python": "3.11.0"})
    assert preflight.parse_reply(f"Welcome!\n{answer}\n") == json.loads(answer)
    assert preflight.parse_reply("[" * 100_000) is None
    assert preflight.parse_reply(json.dumps({"preflight": 2})) is None
    assert preflight.parse_reply(" " * (preflight.MAX_REPLY_LINE + 1) + answer) is None


def test_the_report_names_every_failing_check() -> None:
    """The table's verdict and failure lines name each failing host and check; the JSON
    lists them with their codes; a clean report says all hosts are ok."""
    bad = evaluate({**GOOD, "disk": {"free_bytes": 10}, "python": "3.6.0"})
    rows = (
        HostReport(
            host="w0",
            address="a:22",
            user="u",
            checks=tuple(evaluate(GOOD).values()),
            elapsed_s=1,
        ),
        HostReport(host="w1", address="b:22", user="u", checks=tuple(bad.values()), elapsed_s=1),
        HostReport(
            host="w2",
            address="c:22",
            user="u",
            checks=tuple(preflight.connect_failed("login", "refused")),
            elapsed_s=1,
        ),
    )
    report = Report(root="/r", hosts=rows, elapsed_s=2.0)
    text = preflight.render(report, Options())
    assert text.splitlines()[-1] == (
        "preflight: 2 of 3 hosts failed (2.0s): w1 (python, disk), w2 (ssh)"
    )
    assert "  w2: ssh: refused" in text.splitlines()
    assert preflight.failures(report) == ["w1: python", "w1: disk", "w2: ssh"]
    as_json = preflight.as_json(report, Options())
    assert as_json["ok"] is False
    assert [(f["host"], f["check"], f["code"]) for f in as_json["failures"]] == [
        ("w1", "python", "too_old"),
        ("w1", "disk", "low"),
        ("w2", "ssh", "login"),
    ]
    clean = Report(root="/r", hosts=rows[:1], elapsed_s=1.0)
    assert preflight.render(clean, Options()).splitlines()[-1] == "preflight: all 1 hosts ok (1.0s)"


def test_what_a_host_says_reaches_the_terminal_escaped() -> None:
    """An escape sequence in a host's version string or error is shown escaped in the table
    and in the failure lines, never sent to the terminal as is."""
    hostile = {
        **GOOD,
        "python": "3.11\x1b[2J",
        "module": {"found": False, "error": "x\x1b]0;t\x07"},
    }
    row = HostReport(
        host="w0", address="a:22", user="u", checks=tuple(evaluate(hostile).values()), elapsed_s=1
    )
    text = preflight.render(Report(root="/r", hosts=(row,), elapsed_s=1.0), Options())
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[2J" in text and "\\x07" in text


def test_a_host_too_old_for_hostcheck_fails_python_and_skips_the_rest() -> None:
    """The bootstrap's own answer (``hostcheck: false``) fails ``python`` as too old and
    skips every later check instead of failing them for missing fields."""
    reply = {"preflight": 1, "python": "3.6.15", "executable": "/p", "hostcheck": False}
    checks = evaluate(reply)
    assert (checks[CheckName.PYTHON].status, checks[CheckName.PYTHON].code) == (
        Status.FAIL,
        "too_old",
    )
    later = list(CheckName)[list(CheckName).index(CheckName.PYTHON) + 1 :]
    assert later and all(checks[name].status is Status.SKIP for name in later)


def test_what_was_created_is_named_briefly_with_shard_inboxes_as_ranges() -> None:
    """The run root's parent by its path, the run's directories relative to the root, and
    the shards' inboxes as ranges: every directory is named, a thousand in one phrase."""
    created = ["/s", "/s/r", "/s/r/ctl", "/s/r/inbox", *(f"/s/r/inbox/{n}" for n in range(1000))]
    created += ["/s/r/inbox/1002"]
    text = preflight.created_text("/s/r", created)
    assert text == "/s, /s/r, ctl/, inbox/, inbox/N/ for shards 0-999, 1002"
    assert preflight.created_text("/r", ["/r/inbox/3"]) == "inbox/N/ for shard 3"
