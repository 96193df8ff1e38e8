"""The parser of agent replies: any line a host sends is an answer or noise, never a crash."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor import agent as protocol
from supervisor.remote import (
    MAX_REPLY_CHARS,
    TokenBucket,
    evidence_of,
    host_text,
    parse_push,
    parse_reply,
)


@pytest.mark.parametrize(
    "line",
    [
        '{"id": 1e999}',
        '{"id": -1e999}',
        '{"id": NaN}',
        '{"id": 1.0}',
        '{"id": "1"}',
        '{"id": true}',
        '{"id": -3}',
        '{"id": 0}',
        '{"id": null}',
        "{}",
        "[1]",
        '"1"',
        "7",
        "null",
        "[" * 200_000,
        "[" * 50_000,
        '{"id": 1, "x": ' + "[" * 50_000,
        '{"id": 1, "x": ' + "[" * 20_000 + "]" * 20_000 + "}",
        '{"a":' * 100_000,
        '{"id": ' + "9" * 5000 + "}",
        "\x00\x00",
        "\ufffd\ufffd{",
        "",
        '{"id": 1' + " " * MAX_REPLY_CHARS + "}",
    ],
)
def test_hostile_lines_are_noise(line: str) -> None:
    """Floats, huge, negative or string ids, deep nesting, huge numbers, NUL and overlong
    lines are not replies, and parsing them raises nothing."""
    assert parse_reply(line) is None


def test_a_reply_with_a_positive_int_id_is_returned_whole() -> None:
    """A well-formed reply comes back with its id and every field."""
    line = json.dumps({"id": 7, "ok": True, "result": {"pid": 42}})
    assert parse_reply(line) == (7, {"id": 7, "ok": True, "result": {"pid": 42}})


@given(st.text(max_size=2000))
def test_any_text_parses_or_is_noise(line: str) -> None:
    """Arbitrary text never makes the parser raise, and what it accepts has a positive int id."""
    parsed = parse_reply(line)
    if parsed is not None:
        rid, reply = parsed
        assert type(rid) is int and rid > 0 and reply["id"] == rid


@given(
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=30,
    )
)
def test_any_json_value_as_id_parses_or_is_noise(value: object) -> None:
    """Whatever JSON value a host puts in ``id``, only a positive int makes a reply."""
    parsed = parse_reply(json.dumps({"id": value}))
    assert (parsed is not None) == (type(value) is int and value > 0)


@pytest.mark.parametrize("value", [1e999, 1.5, "12", [1], {"a": 1}, True])
def test_result_fields_of_the_wrong_type_are_a_protocol_error(value: object) -> None:
    """A pid that is not an int is the host's error, a ProtocolError naming the field."""
    with pytest.raises(protocol.ProtocolError, match="'pid'"):
        protocol.read_reply({"ok": True, "result": {"pid": value}}, protocol.ProbeReply)


def test_null_and_int_pids_read_and_a_missing_field_is_an_error() -> None:
    """A null pid is "none found", an int is returned as it is; a reply lacking a required
    field is the host's error."""
    reply = protocol.read_reply({"ok": True, "result": {"pid": None}}, protocol.ProbeReply)
    assert reply == protocol.ProbeReply(pid=None)
    reply = protocol.read_reply({"ok": True, "result": {"pid": 12}}, protocol.ProbeReply)
    assert reply == protocol.ProbeReply(pid=12)
    with pytest.raises(protocol.ProtocolError, match="lacks 'pid'"):
        protocol.read_reply({"ok": True, "result": {}}, protocol.ProbeReply)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("pid", 0),
        ("pid", -1),
        ("pid", protocol.PID_MAX + 1),
        ("pid", 10**30),
        ("start_time", -1),
        ("start_time", 2**64),
    ],
)
def test_pids_and_start_times_out_of_range_are_a_protocol_error(key: str, value: int) -> None:
    """A pid no Linux kernel can hand out, or an impossible start time, is the host's error,
    never passed on."""
    result = {"pid": 5, "start_time": 7, key: value}
    with pytest.raises(protocol.ProtocolError, match="out of range"):
        protocol.read_reply({"ok": True, "result": result}, protocol.LaunchReply)


def test_a_huge_int_is_not_echoed_whole() -> None:
    """An int of thousands of digits is named, not printed into the error."""
    with pytest.raises(protocol.ProtocolError) as failed:
        protocol.read_reply({"ok": True, "result": {"pid": 10**4000}}, protocol.ProbeReply)
    assert len(str(failed.value)) < 200


def test_failures_and_refusals_read_with_their_holder() -> None:
    """A failure carries its kind, its text (cut) and a checked holder pid."""
    raw = {"ok": False, "kind": "refused", "error": "x" * 10_000, "holder_pid": 42}
    failure = protocol.read_reply(raw, protocol.LaunchReply)
    assert isinstance(failure, protocol.Failure)
    assert failure.kind == "refused" and failure.holder_pid == 42
    assert len(failure.error) == protocol.TEXT_MAX
    with pytest.raises(protocol.ProtocolError):
        protocol.read_reply({**raw, "holder_pid": True}, protocol.LaunchReply)


@given(
    st.dictionaries(
        st.sampled_from(["ok", "result", "pid", "kind", "error", "holder_pid", "start_time"]),
        st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.lists(st.none()),
    )
)
def test_any_reply_reads_or_is_a_protocol_error(raw: dict[str, object]) -> None:
    """Whatever a host sends as a reply, reading it gives a typed reply or a ProtocolError."""
    for expected in (protocol.ProbeReply, protocol.LaunchReply, protocol.TerminateReply):
        try:
            reply = protocol.read_reply(raw, expected)
        except protocol.ProtocolError:
            continue
        assert isinstance(reply, expected | protocol.Failure)


def test_requests_round_trip_and_unknown_ops_are_refused() -> None:
    """What remote.py writes the agent reads back as the same request; anything else is a
    ProtocolError."""
    spec = {"host": "w", "pidfile": "/r/ctl/w.pid"}
    for request in (
        protocol.ProbeRequest(spec=spec, pid=7),
        protocol.LaunchRequest(spec=spec),
        protocol.TerminateRequest(spec=spec, pid=7, grace_s=3.0, kill=True),
        protocol.PingRequest(),
        protocol.DisarmSeedRequest(spec=spec, wrap_script="/r/ctl/w.wrap.sh"),
        protocol.WatchRequest(spec=spec, pid=7, start_time=123),
        protocol.WatchRequest(spec=spec, pid=7),
    ):
        line = protocol.request_line(9, request)
        assert protocol.read_request(json.loads(line)) == (9, request)
    for bad in ({"op": "rm -rf"}, {"op": "terminate", "spec": spec, "pid": "7"}, [1], None):
        with pytest.raises(protocol.ProtocolError):
            protocol.read_request(bad)


def test_the_agent_answers_a_request_it_cannot_read_with_a_failure_and_its_id() -> None:
    """A bad line, or a good one naming no op we have, is answered, never dropped."""
    reply = json.loads(protocol.answer_line(b'{"id": 5, "op": "format-disk"}\n'))
    assert reply["id"] == 5 and reply["ok"] is False and "unknown op" in reply["error"]
    reply = json.loads(protocol.answer_line(b"[[[[\n"))
    assert reply["id"] is None and reply["ok"] is False


@given(st.text(max_size=1000))
def test_host_text_is_bounded_and_always_encodes(text: str) -> None:
    """Whatever a host sends as text (lone surrogates included) comes back bounded and
    encodable as UTF-8, and unchanged when it already was."""
    cleaned = host_text(text, 100)
    assert cleaned is not None and len(cleaned) == min(len(text), 100)
    cleaned.encode("utf-8")
    if all(not 0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert cleaned == text[:100]


def test_host_text_of_a_non_string_is_none() -> None:
    """A number, list or null where text was expected gives None, for the caller's default."""
    assert host_text(5) is None
    assert host_text(None) is None
    assert host_text(["x"]) is None


@given(st.lists(st.floats(min_value=0, max_value=100), max_size=200))
def test_token_bucket_never_allows_more_than_its_budget(gaps: list[float]) -> None:
    """Over any sequence of attempts, the lines let through between the first and the last
    attempt are at most the burst plus one per refill interval elapsed."""
    bucket = TokenBucket(burst=5, every_s=3.0)
    now, allowed = 0.0, 0
    for gap in gaps:
        now += gap
        allowed += bucket.take(now)
    assert allowed <= 5 + now / 3.0


def test_token_bucket_refills_after_a_quiet_spell() -> None:
    """A burst is spent at once; after a quiet spell of a burst's worth of refills it is back."""
    bucket = TokenBucket(burst=3, every_s=1.0)
    assert [bucket.take(0.0) for _ in range(5)] == [True, True, True, False, False]
    assert bucket.take(0.5) is False
    assert [bucket.take(10.0) for _ in range(4)] == [True, True, True, False]


def test_a_pushed_exit_reads_back_as_written() -> None:
    """What the agent pushes the daemon reads as the same exit, whatever it knew of it."""
    for news in (
        protocol.WorkerExit(pid=7, start_time=99, signal=9, exited_at=1.5e9),
        protocol.WorkerExit(pid=7, exit_code=3),
        protocol.WorkerExit(pid=7),
        protocol.WorkerExit(pid=7, exit_code=2, log_tail="Traceback ...\nImportError: x\n"),
        protocol.WorkerExit(pid=7, signal=9, reaped=49),
        protocol.WorkerExit(pid=7, signal=9, reaped=0),
    ):
        assert parse_push(protocol.push_line(news)) == news


def test_a_pushed_usage_reads_back_as_written_and_says_only_how_it_counted() -> None:
    """A usage push reads back as the same measure; a ``via`` other than "pss" or "rss" is
    "unknown" (no text of the host's reaches a status); out-of-range figures are malformed."""
    usage = protocol.WorkerUsage(pid=7, start_time=99, rss_bytes=3 << 30, processes=49, via="pss")
    assert parse_push(protocol.push_line(usage)) == usage
    odd = parse_push(json.dumps({"usage": {"pid": 7, "rss_bytes": 5, "via": "\x1b[2Jpss"}}))
    assert isinstance(odd, protocol.WorkerUsage) and odd.via == "unknown"
    for body in (
        {"pid": 7, "rss_bytes": -1},
        {"pid": 7, "rss_bytes": protocol.RSS_MAX + 1},
        {"pid": 7, "rss_bytes": 1.5},
        {"pid": 7, "processes": -1},
        {"pid": 0},
        [7],
    ):
        assert isinstance(parse_push(json.dumps({"usage": body})), str), body
    assert parse_push('{"id": 3, "usage": {"pid": 7}}') is None  # a reply, not a push


def test_a_pushed_log_tail_is_bounded_and_safe_to_encode() -> None:
    """A host's log tail is cut to LOG_TAIL_MAX and a lone surrogate becomes U+FFFD, so the
    status reply that carries it later can be encoded; anything but a string is malformed."""
    body = {"pid": 7, "log_tail": "\ud800" + "x" * (2 * protocol.LOG_TAIL_MAX)}
    news = parse_push(json.dumps({"exit": body}))
    assert isinstance(news, protocol.WorkerExit) and news.log_tail is not None
    assert len(news.log_tail) == protocol.LOG_TAIL_MAX
    assert news.log_tail.startswith("\ufffd")
    news.log_tail.encode("utf-8")
    assert isinstance(parse_push(json.dumps({"exit": {"pid": 7, "log_tail": 5}})), str)


@pytest.mark.parametrize(
    "body",
    [
        {"pid": 0},
        {"pid": -1},
        {"pid": 1 << 40},
        {"pid": "7"},
        {"pid": True},
        {"pid": 7, "exit_code": 256},
        {"pid": 7, "exit_code": -1},
        {"pid": 7, "signal": 0},
        {"pid": 7, "signal": 999},
        {"pid": 7, "exited_at": 1e999},
        {"pid": 7, "start_time": -1},
        {"pid": 7, "reaped": -1},
        {"pid": 7, "reaped": protocol.PID_MAX + 1},
        {"pid": 7, "reaped": 1e3},
        {"pid": 7, "reaped": "49"},
        {"pid": 7, "reaped": True},
        {},
        [7],
        "7",
        None,
    ],
)
def test_a_malformed_push_is_named_never_raised(body: object) -> None:
    """A push with a field out of range or of the wrong type is reported as malformed (a
    string for the noise log), never an exception and never an exit."""
    assert isinstance(parse_push(json.dumps({"exit": body})), str)


@given(
    st.text(max_size=1000)
    | st.builds(
        lambda v: json.dumps({"exit": v}),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda children: (
                st.lists(children, max_size=4)
                | st.dictionaries(
                    st.sampled_from(
                        ["pid", "exit_code", "signal", "start_time", "exited_at", "reaped", "x"]
                    ),
                    children,
                    max_size=6,
                )
            ),
            max_leaves=20,
        ),
    )
)
def test_any_line_is_an_exit_a_malformed_push_or_no_push(line: str) -> None:
    """Whatever a host writes, parse_push returns an exit, a usage, a reason or None."""
    result = parse_push(line)
    assert result is None or isinstance(result, str | protocol.WorkerExit | protocol.WorkerUsage)


@pytest.mark.parametrize(
    "line",
    [
        '{"exit": ' + "[" * 200_000,
        '{"exit": {"pid": 7}}' + " " * MAX_REPLY_CHARS,
        '{"id": 1, "exit": {}}',
    ],
)
def test_deep_long_or_reply_lines_are_no_push(line: str) -> None:
    """Deep nesting, overlong lines and replies are not pushes, and raise nothing."""
    assert parse_push(line) is None


def test_the_agent_reads_a_waitpid_status_as_code_or_signal() -> None:
    """A status word is an exit code or a signal, as waitpid encodes them."""
    assert protocol.wait_status_exit(3 << 8) == (3, None)
    assert protocol.wait_status_exit(0) == (0, None)
    assert protocol.wait_status_exit(9) == (None, 9)
    assert protocol.wait_status_exit(11 | 0x80) == (None, 11)


def test_an_evidence_reply_is_cut_to_its_bounds() -> None:
    """Stacks, log tail, notes and each note are cut to the protocol's bounds, whatever
    the host sends; the round trip of a reply keeps its fields."""
    result = {
        "stacks": "s" * (protocol.STACKS_MAX * 2),
        "via": "py-spy",
        "log_tail": "l" * (protocol.LOG_TAIL_MAX * 2),
        "notes": ["n" * (protocol.TEXT_MAX * 2)] * 50,
        "elapsed_s": 0.5,
    }
    reply = protocol.read_reply({"ok": True, "result": result}, protocol.EvidenceReply)
    assert isinstance(reply, protocol.EvidenceReply)
    assert reply.stacks is not None and len(reply.stacks) == protocol.STACKS_MAX
    assert reply.log_tail is not None and len(reply.log_tail) == protocol.LOG_TAIL_MAX
    assert len(reply.notes) == protocol.NOTES_MAX
    assert all(len(note) == protocol.TEXT_MAX for note in reply.notes)
    empty = protocol.read_reply({"ok": True, "result": {}}, protocol.EvidenceReply)
    assert empty == protocol.EvidenceReply()


@pytest.mark.parametrize(
    "result",
    [{"notes": [1]}, {"notes": "text"}, {"stacks": 7}, {"elapsed_s": -1.0}, {"via": ["x"]}],
)
def test_an_evidence_reply_of_the_wrong_shape_is_a_protocol_error(
    result: dict[str, object],
) -> None:
    """Notes that are not strings, stacks that are not text, a negative duration: the host's
    error, never passed on."""
    with pytest.raises(protocol.ProtocolError):
        protocol.read_reply({"ok": True, "result": result}, protocol.EvidenceReply)


@pytest.mark.parametrize("timeout_s", [-1.0, protocol.EVIDENCE_TIMEOUT_MAX + 1])
def test_an_evidence_request_out_of_bounds_is_refused(timeout_s: float) -> None:
    """The agent refuses to spend longer than the protocol's bound on evidence."""
    request = {"id": 3, "op": "evidence", "spec": {}, "pid": 5, "timeout_s": timeout_s}
    with pytest.raises(protocol.ProtocolError, match="out of range") as failed:
        protocol.read_request(request)
    assert failed.value.rid == 3


_ANY = st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.lists(st.text())


@given(
    st.dictionaries(st.sampled_from(["stacks", "via", "log_tail", "notes", "elapsed_s", "x"]), _ANY)
)
def test_any_evidence_result_reads_or_is_a_protocol_error(result: dict[str, object]) -> None:
    """Whatever a host sends as evidence, reading it gives a bounded EvidenceReply that the
    daemon can turn into the core's record, or a ProtocolError."""
    try:
        reply = protocol.read_reply({"ok": True, "result": result}, protocol.EvidenceReply)
    except protocol.ProtocolError:
        return
    assert isinstance(reply, protocol.EvidenceReply)
    evidence = evidence_of(9, reply)
    assert len(evidence.stacks or "") <= protocol.STACKS_MAX
    assert len(evidence.notes) <= protocol.NOTES_MAX
    assert all(isinstance(note, str) for note in evidence.notes)


@pytest.mark.parametrize("reaped", [-1, protocol.PID_MAX + 1, True, "3", 3.0, [3]])
def test_a_terminate_reply_s_reaped_count_out_of_range_is_a_protocol_error(
    reaped: object,
) -> None:
    """A terminate's count of processes reaped is an int from 0 to PID_MAX or null; anything
    else is a protocol error, never trusted."""
    with pytest.raises(protocol.ProtocolError, match="reaped"):
        protocol.read_reply(
            {"ok": True, "result": {"outcome": "killed", "reaped": reaped}},
            protocol.TerminateReply,
        )


def test_a_terminate_reply_reads_with_or_without_its_reaped_count() -> None:
    """A count, null, or none at all (an agent from before sweeps): all read."""
    for result, reaped in (({"reaped": 49}, 49), ({"reaped": None}, None), ({}, None)):
        reply = protocol.read_reply(
            {"ok": True, "result": {"outcome": "killed", **result}}, protocol.TerminateReply
        )
        assert reply == protocol.TerminateReply(outcome="killed", reaped=reaped)
